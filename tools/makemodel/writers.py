"""The files: streamed sharded safetensors, the GGUF (gguf's GGUFWriter for the header, tensor bytes streamed,
quantised chunk by chunk) and the HF config, written by one I/O thread."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from makemodel.spec import BOS_ID, EOS_ID, Spec
from makemodel.tensors import QUANT_FTYPE, QUANT_KEEP_FLOAT, Entry, Part
from makemodel.tokens import tokenizer_metadata

# ----------------------------------------------------------------------------- writers

ST_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a numpy array (bfloat16 through an int16 view)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class IOThread:
    """Writes files in a background thread so disk writes overlap generation; at most `depth`
    chunks wait in the queue (memory stays bounded). Every file operation goes through it, in order."""

    def __init__(self, depth: int = 2):
        import queue
        import threading

        self.q: "queue.Queue" = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="make_model-io")
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    item[0](*item[1:])
                except BaseException as e:  # reported by submit() / join()
                    self.error = e

    def submit(self, fn, *args) -> None:
        if self.error is not None:
            raise self.error
        self.q.put((fn, *args))

    def join(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class SafetensorsWriter:
    """Sharded safetensors, streamed: each shard's header is written first (offsets are known from
    the plan), then the tensors' bytes as the chunks arrive."""

    def __init__(self, folder: Path, parts: list[Part], dtype: torch.dtype, shard_bytes: int, io: IOThread):
        self.folder, self.dtype, self.io = folder, dtype, io
        esize = torch.finfo(dtype).bits // 8
        shards: list[list[Part]] = [[]]
        size = 0
        for p in parts:
            n = int(np.prod(p.shape)) * esize
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(p)
            size += n
        self.shards = shards
        self.names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.esize = esize
        self.current = -1
        self.f = None
        self.shard_of = {p.hf: i for i, sh in enumerate(shards) for p in sh}
        self.total = sum(int(np.prod(p.shape)) * esize for p in parts)

    def _open(self, i: int) -> None:
        if self.f is not None:
            self.io.submit(self.f.close)
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for p in self.shards[i]:
            n = int(np.prod(p.shape)) * self.esize
            header[p.hf] = {"dtype": ST_DTYPES[self.dtype], "shape": list(p.shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.f = open(self.folder / self.names[i], "wb")
        self.io.submit(self.f.write, struct.pack("<Q", len(blob)) + blob)
        self.current = i

    def write(self, part: Part, chunk: np.ndarray) -> None:
        i = self.shard_of[part.hf]
        if i != self.current:
            self._open(i)
        self.io.submit(self.f.write, chunk.data)

    def close(self) -> None:
        if self.f is not None:
            self.io.submit(self.f.close)
        weight_map = {p.hf: self.names[i] for i, sh in enumerate(self.shards) for p in sh}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def gguf_types(plan: list[Entry], dtype: torch.dtype, quant: str | None = None) -> dict[str, tuple[str, int]]:
    """GGUF tensor name -> (GGML type name, bytes) of the GGUF form: F32 for norms, biases and
    routers; `quant` (e.g. "Q4_0") for the weight matrices, rows * cols / block * bytes-per-block
    bytes ([E, rows, cols] expert stacks likewise); the storage dtype for the token embedding (see
    QUANT_KEEP_FLOAT) and for matrices whose rows are not a whole number of blocks. A layer's three
    expert stacks share one type: if one cannot be quantised, none is (hotcold's QuantExperts holds
    gate, up and down in blocks together)."""
    from hotcold.sparse_ops.quant import QTYPES

    store = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    esize = torch.finfo(dtype).bits // 8
    bs = QTYPES[quant][1] if quant else 0

    def quantisable(e: Entry) -> bool:
        return (bool(quant) and not e.f32 and len(e.shape) >= 2 and e.shape[-1] % bs == 0
                and e.gguf not in QUANT_KEEP_FLOAT)

    ok = {e.gguf: quantisable(e) for e in plan}
    for e in plan:
        if e.gguf.endswith("_exps.weight"):
            prefix = e.gguf[: e.gguf.rindex("ffn_")]
            stacks = [f"{prefix}ffn_{g}_exps.weight" for g in ("gate", "up", "down")]
            ok[e.gguf] = all(ok.get(n, False) for n in stacks)
    out = {}
    for e in plan:
        n = int(np.prod(e.shape))
        if e.f32:
            out[e.gguf] = ("F32", n * 4)
        elif ok[e.gguf]:
            _, bs, ts = QTYPES[quant]
            out[e.gguf] = (quant, n // bs * ts)
        else:
            out[e.gguf] = (store, n * esize)
    return out


def _quantized_bytes(chunk: torch.Tensor, quant: str) -> memoryview:
    from hotcold.sparse_ops.quant import quantize_rows

    return quantize_rows(chunk.float().numpy(), quant).data


class GGUFStreamWriter:
    """GGUF written with gguf's GGUFWriter for the header, metadata and tensor infos; tensor bytes
    are then streamed chunk by chunk (each tensor padded to the alignment, as GGUFWriter does).
    With `quant`, the matrices `gguf_types` assigns it are quantised chunk by chunk (rows are
    quantised independently, so any row chunk gives the same bytes), in the I/O thread."""

    def __init__(self, path: Path, spec: Spec, plan: list[Entry], dtype: torch.dtype, hidden_act: str | None,
                 io: IOThread, quant: str | None = None):
        import gguf

        self.io = io
        self.gguf = gguf
        arch = spec.gguf_arch
        w = gguf.GGUFWriter(str(path), arch)
        ftype = QUANT_FTYPE[quant] if quant else {torch.float16: 1, torch.bfloat16: 32, torch.float32: 0}[dtype]
        w.add_name(f"hotcold make_model {spec.family}")
        w.add_type("model")
        w.add_file_type(ftype)
        w.add_context_length(spec.context)
        w.add_embedding_length(spec.hidden)
        w.add_block_count(spec.layers)
        w.add_head_count(spec.heads)
        if spec.family == "opt":
            w.add_feed_forward_length(spec.ffn)
            w.add_layer_norm_eps(1e-5)
        else:
            w.add_head_count_kv(spec.kv_heads)
            w.add_layer_norm_rms_eps(spec.norm_eps)
            w.add_rope_freq_base(spec.rope_theta)
            w.add_rope_dimension_count(spec.head_dim)
            w.add_vocab_size(spec.vocab)
            if spec.head_dim * spec.heads != spec.hidden:
                w.add_key_length(spec.head_dim)
                w.add_value_length(spec.head_dim)
            if spec.moe:
                w.add_expert_count(spec.experts)
                w.add_expert_used_count(spec.top_k)
            if spec.family == "qwen3_moe":
                w.add_feed_forward_length(spec.ffn * spec.top_k)
                w.add_expert_feed_forward_length(spec.ffn)
            else:
                w.add_feed_forward_length(spec.ffn)
        if hidden_act:
            w.add_string("hotcold.hidden_act", hidden_act)
        for key, value, vtype, sub in tokenizer_metadata():
            vtype = gguf.GGUFValueType(vtype)
            sub = None if sub is None else gguf.GGUFValueType(sub)
            if key == "tokenizer.ggml.tokens" and spec.vocab > len(value):
                value = list(value) + [f"[PAD{i}]" for i in range(len(value), spec.vocab)]
            elif key == "tokenizer.ggml.token_type" and spec.vocab > len(value):
                value = list(value) + [5] * (spec.vocab - len(value))  # UNUSED
            w.add_key_value(key, value, vtype, sub_type=sub)
        self.types = gguf_types(plan, dtype, quant)
        for e in plan:
            tname, nbytes = self.types[e.gguf]
            qt = gguf.GGMLQuantizationType[tname]
            if tname in ("F32", "F16"):
                w.add_tensor_info(e.gguf, e.shape, np.dtype(np.float32 if tname == "F32" else np.float16), nbytes)
            elif tname == "BF16":
                w.add_tensor_info(e.gguf, e.shape, np.dtype(np.uint16), nbytes, raw_dtype=qt)
            else:  # blocks: declared by their byte shape [..., rows, cols / block * bytes per block]
                byte_shape = gguf.quant_shape_to_byte_shape(e.shape, qt)
                w.add_tensor_info(e.gguf, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        self.w = w
        self.f = w.fout[0]
        self.w.flush()
        self.pos = self.f.tell()  # tracked from here on: the writes are asynchronous
        self.align = w.data_alignment
        self._pad()
        self.heads = (spec.heads, spec.kv_heads)

    def _pad(self) -> None:
        pad = -self.pos % self.align
        if pad:
            self.io.submit(self.f.write, b"\0" * pad)
            self.pos += pad

    def write(self, entry: Entry, part: Part, r0: int, chunk: torch.Tensor) -> None:
        from hotcold.models.gguf_loader import permute_rotary

        if part.kind in ("q", "k"):  # chunks hold whole heads
            dh = entry.shape[0] // self.heads[0 if part.kind == "q" else 1]
            chunk = permute_rotary(chunk, chunk.shape[0] // dh).contiguous()
        elif part.kind == "pos" and r0 < 2:
            chunk = chunk[2 - r0 :]
        tname, _ = self.types[entry.gguf]
        if tname not in ("F32", "F16", "BF16"):  # quantised in the I/O thread (overlaps generation)
            from hotcold.sparse_ops.quant import QTYPES

            _, bs, ts = QTYPES[tname]
            self.io.submit(lambda c=chunk, q=tname: self.f.write(_quantized_bytes(c, q)))
            self.pos += chunk.numel() // bs * ts
            return
        if entry.f32:
            chunk = chunk.float()
        data = _raw(chunk)
        self.io.submit(self.f.write, data.data)
        self.pos += data.nbytes

    def end_entry(self) -> None:
        self._pad()

    def close(self) -> None:
        self.io.submit(self.w.close)


# ----------------------------------------------------------------------------- HF files


def hf_config(s: Spec, dtype: torch.dtype) -> dict:
    dt = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    if s.family == "opt":
        return {
            "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
            "hidden_size": s.hidden, "ffn_dim": s.ffn, "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads, "max_position_embeddings": s.context, "vocab_size": s.vocab,
            "word_embed_proj_dim": s.hidden, "do_layer_norm_before": True, "enable_bias": True,
            "layer_norm_elementwise_affine": True, "tie_word_embeddings": True, "init_std": 0.02,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "dropout": 0.0,
            "attention_dropout": 0.0, "torch_dtype": dt, "dtype": dt,
        }
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                           "qwen3_moe": "Qwen3MoeForCausalLM"}[s.family]],
        "model_type": s.family,
        "hidden_act": s.act if s.family == "llama" else "silu",
        "hidden_size": s.hidden,
        "intermediate_size": s.ffn * s.top_k if s.family == "qwen3_moe" else s.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": s.context,
        "rms_norm_eps": s.norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "tie_word_embeddings": False,
        "vocab_size": s.vocab,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": dt,
        "dtype": dt,
    }
    if s.family == "llama":
        cfg["mlp_bias"] = False
    if s.family == "mixtral":
        cfg.update(num_local_experts=s.experts, num_experts_per_tok=s.top_k, sliding_window=None,
                   router_aux_loss_coef=0.0, output_router_logits=False)
    if s.family == "qwen3_moe":
        cfg.update(num_experts=s.experts, num_experts_per_tok=s.top_k, moe_intermediate_size=s.ffn,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                   sliding_window=None, max_window_layers=s.layers, router_aux_loss_coef=0.0,
                   output_router_logits=False)
    return cfg
