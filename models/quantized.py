"""Layers whose weights stay in GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) in host memory.

A quantised GGUF file is used in place: each `QuantMatrix` is a view of the memory-mapped file,
never expanded wholesale. The modules here replace `nn.Linear`, `nn.Embedding` and the stacked
MoE `Experts` of the reference model on the CPU:

- one token (decode) multiplies straight from the blocks (`sparse_ops.quant.qgemv`, numba);
- several tokens (prefill) decode the blocks `CHUNK_BYTES` of float32 rows at a time and multiply
  with torch (each block is decoded once per call, then reused by every token), in bfloat16 where
  the CPU has bfloat16 dot products (`sparse_ops.quant.ops.GEMM_BF16`).

`dequantized(module, device, dtype)` turns them into ordinary modules for a GPU. `quantize_model`
builds the same modules from an HF checkpoint's float weights (`--quantize q8_0|q4_0|q4_k`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hotcold.models.gguf_loader import drop_file_pages
from hotcold.models.layers import activation_fn
from hotcold.sparse_ops import quant
from hotcold.sparse_ops.cpu import host_empty
from hotcold.sparse_ops.quant import QTYPES, QuantMatrix, qdequantize, qgemv

__all__ = ["QuantLinear", "QuantEmbedding", "HalfEmbedding", "QuantExperts", "GEMV_TOKENS", "quantize_model", "dequantize_model",
           "QUANTIZE_TYPES", "is_quantized", "quant_bytes", "dequantized_rows", "pack_for_decode",
           "drop_module_pages"]

GEMV_TOKENS = 4  # up to this many tokens per call: one block-decoding GEMV per token
CHUNK_BYTES = 32 << 20  # float32 rows decoded at once for several tokens
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}  # --quantize choices


def _rows_per_chunk(cols: int) -> int:
    # a multiple of 8: an interleaved matrix's chunks are then whole groups, decoded in place
    return max(8, CHUNK_BYTES // (4 * cols) // 8 * 8)


def qlinear(m: QuantMatrix, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T for W = m [out, in] in blocks. x: [..., in] (CPU) -> [..., out] float32."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, m.cols).float().contiguous()  # [N, in]
    n = xf.shape[0]
    if n <= GEMV_TOKENS:
        out = np.empty((n, m.rows), np.float32)
        xn = xf.numpy()
        for t in range(n):
            qgemv(m, xn[t], out[t])
        y = torch.from_numpy(out)
    else:
        y = torch.empty((n, m.rows), dtype=torch.float32)
        step = _rows_per_chunk(m.cols)
        buf = quant.gemm_scratch(min(step, m.rows), m.cols)
        xg = xf.to(torch.bfloat16) if quant.ops.GEMM_BF16 else xf  # [N, in]
        for a in range(0, m.rows, step):
            b = min(m.rows, a + step)
            w = quant.gemm_operands(m, np.arange(a, b, dtype=np.int64), buf)  # [b - a, in]
            y[:, a:b] = xg @ w.T
    return y.reshape(*lead, m.rows)


class QuantLinear(nn.Module):
    """nn.Linear over a QuantMatrix weight [out, in] in host memory (bias, if any, a float tensor)."""

    def __init__(self, qweight: QuantMatrix, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, float32 [out, in] (a fresh copy: for code that needs dense rows)."""
        return torch.from_numpy(qdequantize(self.qweight))

    def dequantize(self, rows=None) -> torch.Tensor:
        """float32 [K, in] of the given rows (all when None)."""
        idx = None if rows is None else np.asarray(torch.as_tensor(rows).cpu(), np.int64)
        return torch.from_numpy(qdequantize(self.qweight, idx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qlinear(self.qweight, x)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qweight.qtype}"


class QuantEmbedding(nn.Module):
    """Token embedding [V, D] in blocks: looks rows up by decoding them; as a tied head, a QuantLinear."""

    def __init__(self, qweight: QuantMatrix, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return torch.from_numpy(qdequantize(self.qweight))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [...] -> [..., D] in self.dtype
        ids = tokens.reshape(-1).cpu().numpy().astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.from_numpy(qdequantize(self.qweight, ids))
        return out.reshape(*tokens.shape, self.embedding_dim).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Tied output head: x [..., D] -> [..., V] float32."""
        return qlinear(self.qweight, x)


class HalfEmbedding(nn.Module):
    """A float16 / bfloat16 token embedding [V, D] kept in that dtype on the CPU (a GGUF's F16 / BF16
    token_embd: float32 would double it), rows converted to `dtype` as they are looked up. The
    table is held as its 16-bit patterns (an integer buffer, which moving a model to another dtype
    leaves alone); as a tied head, `logits` multiplies from it (numba's half GEMV for one token)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        if weight.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
            raise ValueError(f"HalfEmbedding takes a float16 / bfloat16 [V, D] table, got {weight.dtype} "
                             f"{list(weight.shape)}")
        self.register_buffer("bits", weight.view(torch.int16), persistent=False)
        self.half_dtype = weight.dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The table in its stored dtype (a view)."""
        return self.bits.view(self.half_dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [...] -> [..., D] in self.dtype
        return F.embedding(tokens.to(self.weight.device), self.weight).to(self.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Tied output head: x [..., D] -> [..., V] float32 (on the table's device)."""
        from hotcold.sparse_ops.cpu import HostMatrix, gemv

        xf = x.reshape(-1, self.embedding_dim).to(self.weight.device)
        if self.weight.device.type == "cpu" and xf.shape[0] == 1:
            y = torch.from_numpy(gemv(HostMatrix.from_torch(self.weight), xf[0].float().numpy()))[None]
        else:
            y = torch.cat([(xf.float() @ self.weight[a:a + 8192].float().T)
                           for a in range(0, self.num_embeddings, 8192)], dim=-1)  # [N, V], 8192 rows at a time
        return y.reshape(*x.shape[:-1], self.num_embeddings)


class QuantExperts(nn.Module):
    """E gated experts in blocks: gate, up QuantMatrix [E*I, D] (expert e's rows at [e*I, (e+1)*I));
    down QuantMatrix [E*D, I] (expert e's W_down at rows [e*D, (e+1)*D)), as GGUF stacks them."""

    def __init__(self, gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, n: int, act: str):
        super().__init__()
        self.n, self.hidden, self.dim = n, gate.rows // n, gate.cols
        if up.shape != gate.shape or down.shape != (n * self.dim, self.hidden):
            raise ValueError(f"expert matrices do not match: gate {gate.shape}, up {up.shape}, down {down.shape}")
        self.qgate, self.qup, self.qdown = gate, up, down
        self.act_name = act
        self.act = activation_fn(act)

    def matrix(self, which: str, e: int) -> QuantMatrix:
        """Expert e's gate | up [I, D] or down [D, I] as a QuantMatrix view (no copy)."""
        m = {"gate": self.qgate, "up": self.qup, "down": self.qdown}[which]
        k = m.rows // self.n
        return QuantMatrix(m.data[e * k:(e + 1) * k], m.qtype, (k, m.cols))

    def activations(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's down-projection input. x: [N, D] -> h: [N, I] float32."""
        return self.act(qlinear(self.matrix("gate", e), x)) * qlinear(self.matrix("up", e), x)

    def down_proj(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's down projection. h: [N, I] -> [N, D] in h's dtype."""
        return qlinear(self.matrix("down", e), h).to(h.dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N, D]
        return self.down_proj(e, self.activations(e, x)).to(x.dtype)

    def dense(self, which: str) -> torch.Tensor:
        """Dequantised stack: gate/up [E, I, D], down [E, D, I], float32."""
        m = {"gate": self.qgate, "up": self.qup, "down": self.qdown}[which]
        return torch.from_numpy(qdequantize(m)).reshape(self.n, m.rows // self.n, m.cols)

    gate = property(lambda self: self.dense("gate"))
    up = property(lambda self: self.dense("up"))
    down = property(lambda self: self.dense("down"))

    def extra_repr(self) -> str:
        return f"{self.n} experts, {self.dim} -> {self.hidden}, {self.qgate.qtype}/{self.qdown.qtype}"


QUANT_MODULES = (QuantLinear, QuantEmbedding, QuantExperts)


def is_quantized(model: nn.Module) -> bool:
    """Whether any of model's weights are held in blocks."""
    return any(isinstance(m, QUANT_MODULES) for m in model.modules())


def quant_bytes(module: nn.Module) -> int:
    """Bytes of the blocks held by module's quantised submodules (GGUF blocks on the host, int4 on a GPU)."""
    from hotcold.sparse_ops.gpu_quant import Int4Linear

    total = 0
    for m in module.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding, Int4Linear)):
            total += m.qweight.nbytes
        elif isinstance(m, QuantExperts):
            total += m.qgate.nbytes + m.qup.nbytes + m.qdown.nbytes
    return total


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def dequantize_module(m: nn.Module, device, dtype: torch.dtype, int4: bool = False) -> nn.Module:
    """An ordinary module (nn.Linear | nn.Embedding | Experts) with m's dequantised weights on device.
    int4: a QuantLinear of a 4-bit type that torch's int4 kernels take on device (Q4_0 / Q4_1 / Q4_K,
    see sparse_ops/gpu_quant.py) becomes an Int4Linear instead, its weights repacked, not expanded."""
    from hotcold.models.layers import Experts

    if int4 and isinstance(m, QuantLinear):
        from hotcold.sparse_ops.gpu_quant import Int4Linear, int4_supported

        if int4_supported(m.qweight.qtype, device, m.qweight.shape):
            bias = None if m.bias is None else m.bias.detach().to(device, dtype)
            return Int4Linear.from_quant(m.qweight, device, bias)
    if isinstance(m, QuantLinear):
        out = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        out.weight = nn.Parameter(dequantized_rows(m.qweight, device, dtype), requires_grad=False)
        if m.bias is not None:
            out.bias = nn.Parameter(m.bias.detach().to(device, dtype), requires_grad=False)
        return out
    if isinstance(m, QuantEmbedding):
        out = nn.Embedding(m.num_embeddings, m.embedding_dim, device="meta")
        out.weight = nn.Parameter(dequantized_rows(m.qweight, device, dtype), requires_grad=False)
        return out
    if isinstance(m, QuantExperts):
        out = Experts(m.n, m.dim, m.hidden, m.act_name, device="meta")
        for which in ("gate", "up", "down"):
            q = {"gate": m.qgate, "up": m.qup, "down": m.qdown}[which]
            w = dequantized_rows(q, device, dtype).reshape(m.n, q.rows // m.n, q.cols)
            setattr(out, which, nn.Parameter(w, requires_grad=False))
        return out
    return m


def dequantized_rows(q: QuantMatrix, device, dtype: torch.dtype, rows=None) -> torch.Tensor:
    """q's rows (all when None) dequantised into a new [K, cols] tensor on device (not an inference
    tensor), decoded CHUNK_BYTES of float32 at a time."""
    idx = np.arange(q.rows, dtype=np.int64) if rows is None else np.asarray(torch.as_tensor(rows).cpu(), np.int64)
    with torch.inference_mode(False):
        out = torch.empty((len(idx), q.cols), dtype=dtype, device=device)
    step = _rows_per_chunk(q.cols)
    for a in range(0, len(idx), step):
        out[a:a + step] = torch.from_numpy(qdequantize(q, idx[a:a + step])).to(device, dtype)
    return out


def dequantize_model(model: nn.Module, device, dtype: torch.dtype, int4: bool = False) -> nn.Module:
    """Replace every quantised submodule of model by its dequantised counterpart on device (in place;
    int4: see dequantize_module)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QUANT_MODULES):
            _set(model, name, dequantize_module(m, device, dtype, int4))
    return model


def _quantizable(w: torch.Tensor, qtype: str) -> bool:
    return w.shape[-1] % QTYPES[qtype][1] == 0


# The LM head takes Q8 activations whatever its block type, where that type has an interleaved
# layout (Q8_0: Gemma 3's 262k-row tied head, 178 MB of its 253 MB file), as llama.cpp's does; the
# other Q8_0 matrices keep float x (XQ_DEFAULT). Logits move by about Q8's 1/254 per activation.
# With XQ_DEFAULT empty (float x everywhere, as exact comparisons set it) the head keeps float x too.
HEAD_XQ = True


def pack_for_decode(model: nn.Module, tied: bool | None = None, is_head: bool = False) -> int:
    """Interleave the CPU matrices of model that one-token decoding reads whole (`quant.pack_rows`:
    QuantLinear weights, and a QuantEmbedding that is the tied LM head; its lookups decode rows from
    either layout), for the faster GEMV; the file pages of what was copied are dropped, so RAM
    holds one copy. Call it once the model's split FFNs have taken their rows (row selections need
    the GGUF layout). tied: whether a QuantEmbedding is the LM head (None: model.config says);
    is_head: model is the LM head itself (see HEAD_XQ). Returns the bytes interleaved."""
    if tied is None:
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    heads = {id(model) if is_head else id(getattr(model, "lm_head", None))}
    done = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) or (tied and isinstance(m, QuantEmbedding)):
            head = id(m) in heads or isinstance(m, QuantEmbedding)
            packed = quant.pack_rows(m.qweight, xq=True if head and HEAD_XQ and quant.formats.XQ_DEFAULT else None)
            if packed is not m.qweight:
                drop_file_pages(m.qweight.data)
                m.qweight, done = packed, done + packed.nbytes
    fuse_qkv(model)
    return done


def fuse_qkv(model: nn.Module) -> None:
    """Attention modules whose q, k and v are interleaved QuantLinears of one type and width, without
    biases, or float16/bfloat16 nn.Linears on the CPU of one width, get one matrix of their rows
    [q; k; v] (`attn.qkv`: a QuantMatrix, or a half tensor with `attn.qkv_bias`) that a one-token
    step multiplies in one GEMV call instead of three (Attention._decode_cpu); q, k and v become
    views of its rows, so RAM holds one copy. Each row's result is the same either way."""
    for m in model.modules():
        lins = [getattr(m, n, None) for n in ("q", "k", "v")]
        if getattr(m, "qkv", None) is not None:
            continue
        if all(isinstance(lin, nn.Linear) for lin in lins):
            _fuse_half_qkv(m, lins)
            continue
        if not all(isinstance(lin, QuantLinear) and lin.bias is None and lin.qweight.interleaved for lin in lins):
            continue
        ws = [lin.qweight for lin in lins]
        if len({(w.qtype, w.cols) for w in ws}) != 1:
            continue
        data = np.concatenate([w.data for w in ws])  # [groups of q, k, v; bytes per group]
        m.qkv = QuantMatrix(data, ws[0].qtype, (sum(w.rows for w in ws), ws[0].cols), interleaved=True)
        a = 0
        for lin, w in zip(lins, ws):
            lin.qweight = QuantMatrix(data[a:a + len(w.data)], w.qtype, w.shape, interleaved=True)
            a += len(w.data)


def _fuse_half_qkv(m: nn.Module, lins: list[nn.Linear]) -> None:
    """fuse_qkv for float16/bfloat16 nn.Linears on the CPU (16-core H200 host: a fused 15360-row q/k/v
    matrix reads 91 GB/s where a 13B step's separate projections average 72; a hybrid 13B step with 9
    attentions on the CPU takes 73.1 ms against 82.3 with them apart)."""
    ws = [lin.weight for lin in lins]
    if len({(w.dtype, w.device.type, w.shape[1]) for w in ws}) != 1 or ws[0].device.type != "cpu" \
            or ws[0].dtype not in (torch.float16, torch.bfloat16):
        return
    biases = [lin.bias for lin in lins]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        return
    with torch.no_grad():
        qkv = host_empty((sum(w.shape[0] for w in ws), ws[0].shape[1]), ws[0].dtype)  # [Nq + 2 Nk, D]
        torch.cat([w.detach() for w in ws], out=qkv)
        a = 0
        for lin, w in zip(lins, ws):
            lin.weight = nn.Parameter(qkv[a:a + w.shape[0]], requires_grad=w.requires_grad)  # a view: one copy
            a += w.shape[0]
    m.qkv = qkv
    m.qkv_bias = torch.cat([b.detach().float() for b in biases]) if biases[0] is not None else None


def drop_module_pages(module: nn.Module) -> None:
    """drop_file_pages for every block matrix of module (QuantLinear, QuantEmbedding, QuantExperts):
    for a module whose weights have been copied elsewhere (a split FFN's hot and cold parts)."""
    for m in module.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            drop_file_pages(m.qweight.data)
        elif isinstance(m, QuantExperts):
            for q in (m.qgate, m.qup, m.qdown):
                drop_file_pages(q.data)


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str) -> list[str]:
    """Quantise model's matrices in place (HF checkpoints: `--quantize q8_0|q4_0|q4_k`): linear
    layers, the embedding and stacked experts become blocks of that type; matrices whose input size
    is not a multiple of the block size stay as they are. Returns the names of those left."""
    from hotcold.models.layers import Experts

    if kind not in QUANTIZE_TYPES:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE_TYPES)}, got {kind!r}")
    qtype = QUANTIZE_TYPES[kind]
    left = []
    for name, m in list(model.named_modules()):
        if name.endswith(("router", "shared_gate")) or ".predictor" in name:
            continue  # tiny, and read by fast-tier code as plain tensors
        if isinstance(m, nn.Linear):
            if not _quantizable(m.weight, qtype):
                left.append(name)
                continue
            bias = None if m.bias is None else m.bias.detach().float().clone()
            _set(model, name, QuantLinear(QuantMatrix.quantize(m.weight.float().numpy(), qtype), bias))
        elif isinstance(m, nn.Embedding) and name == "embed":
            if not _quantizable(m.weight, qtype):
                left.append(name)
                continue
            _set(model, name, QuantEmbedding(QuantMatrix.quantize(m.weight.float().numpy(), qtype), m.weight.dtype))
        elif isinstance(m, Experts):
            E, I, D = m.gate.shape
            if not (_quantizable(m.gate, qtype) and _quantizable(m.down, qtype)):
                left.append(name)
                continue
            q = {w: QuantMatrix.quantize(getattr(m, w).float().reshape(-1, getattr(m, w).shape[-1]).numpy(), qtype)
                 for w in ("gate", "up", "down")}
            _set(model, name, QuantExperts(q["gate"], q["up"], q["down"], E, m.act_name))
    return left

