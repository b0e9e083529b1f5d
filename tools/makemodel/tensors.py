"""The random pool tensors are cut from, the storage types, and the tensor plan (every tensor of a model,
in file order, with its HF and GGUF names)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from makemodel.spec import Spec

# ----------------------------------------------------------------------------- random pool

STORAGE = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
QUANT = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}  # --dtype -> GGUF block type (HF form: f16)
QUANT_FTYPE = {"Q8_0": 7, "Q4_0": 2, "Q4_K": 14}  # general.file_type: MOSTLY_Q8_0, MOSTLY_Q4_0, MOSTLY_Q4_K_S
# Kept float in a quantised GGUF. Every embedding row holds the constant channel's A = 2 sqrt(D),
# which sets the scale of the block it lies in: Q4_0 would round that block's other 31 values to
# steps of A/8 (Q8_0: A/127), which on tiny-llama (D = 64, half the embedding in that block) makes
# the GGUF's logits differ from the HF form's by 66% (Q8_0: 7%) against 28% (2%) with the embedding
# in F16. A lookup of a few rows per token, so its type does not change either engine's speed.
QUANT_KEEP_FLOAT = frozenset({"token_embd.weight"})
SEG = 1 << 16  # elements copied per random pool offset


class Pool:
    """Random matrices at memory speed: a pool of N pre-drawn standard normals; a tensor is a run of
    SEG-element slices taken at random offsets of the pool (scaled copies of the pool are cached per
    std in the storage dtype, so building a tensor is only copies). `normal(..., with_float=True)`
    also returns the same values in float32, copied from a cached float32 image of the rounded pool
    (the calibration forward's operand: copying is ~30x faster than converting each matrix) into a
    scratch buffer that the next call reuses (fresh pages for every expert matrix cost as much as the
    copy): the caller is done with it before it asks again."""

    def __init__(self, seed: int, n: int, dtype: torch.dtype):
        self.n, self.dtype = n, dtype
        self.base = np.random.default_rng([seed, 0x9E37]).standard_normal(n + SEG, dtype=np.float32)
        self.scaled: dict[float, np.ndarray] = {}  # std -> scaled pool, least recently used first
        self.images: dict[float, np.ndarray] = {}  # std -> float32 image of scaled[std], likewise
        self.scratch32 = np.empty(0, np.float32)  # normal()'s float32 copies

    def _pool(self, std: float) -> np.ndarray:
        key = float(np.float32(std))
        pool = self.scaled.pop(key, None)
        if pool is None:
            t = (torch.from_numpy(self.base) * float(np.float32(std))).to(self.dtype)  # torch: all cores
            pool = (t.view(torch.int16) if self.dtype == torch.bfloat16 else t).numpy()
            while len(self.scaled) >= 8:
                self.scaled.pop(next(iter(self.scaled)))
        self.scaled[key] = pool
        return pool

    def _image(self, std: float, pool: np.ndarray) -> np.ndarray:
        if self.dtype == torch.float32:
            return pool
        key = float(np.float32(std))
        image = self.images.pop(key, None)
        if image is None:
            t = torch.from_numpy(pool)
            image = (t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t).float().numpy()
            while len(self.images) >= 4:
                self.images.pop(next(iter(self.images)))
        self.images[key] = image
        return image

    def offsets(self, n: int, rng: np.random.Generator) -> list[int]:
        """The pool offsets of an n-element tensor's slices (the one draw from rng a tensor takes)."""
        return rng.integers(0, self.n, size=(n + SEG - 1) // SEG).tolist()

    @staticmethod
    def gather(src: np.ndarray, offsets: list[int], out: np.ndarray) -> np.ndarray:
        """out (1-D) filled with the SEG-element slices of src at offsets (numpy copies: no GIL held)."""
        n = out.shape[0]
        for i, o in enumerate(offsets):
            s = i * SEG
            m = min(SEG, n - s)
            out[s : s + m] = src[o : o + m]
        return out

    def as_tensor(self, a: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """A gathered storage-dtype array as the tensor of that shape (bfloat16 from its int16 bits)."""
        t = torch.from_numpy(a).view(*shape)
        return t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t

    def normal(self, shape: tuple[int, ...], std: float, rng: np.random.Generator, with_float: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pool = self._pool(std)
        n = int(np.prod(shape))
        offsets = self.offsets(n, rng)
        t = self.as_tensor(self.gather(pool, offsets, np.empty(n, dtype=pool.dtype)), shape)
        if not with_float:
            return t
        if self.dtype == torch.float32:
            return t, t
        image = self._image(std, pool)
        if self.scratch32.size < n:
            self.scratch32 = np.empty(n, dtype=np.float32)
        return t, torch.from_numpy(self.gather(image, offsets, self.scratch32[:n])).view(*shape)


def pool_size(total_params: int) -> int:
    """Pool length: 1/64 of the model's parameters, a power of two in [2^18, 2^23]."""
    n = 1 << 18
    while n < total_params // 64 and n < (1 << 23):
        n <<= 1
    return n


# ----------------------------------------------------------------------------- tensor plan


@dataclass
class Part:
    """One HF tensor; a row range of its GGUF tensor."""

    hf: str
    shape: tuple[int, ...]
    kind: str = ""  # GGUF transform: "q"/"k" (llama rotary permutation), "pos" (drop OPT's 2 offset rows)


@dataclass
class Entry:
    """One GGUF tensor, the concatenation (along rows) of its parts' HF tensors."""

    gguf: str
    shape: tuple[int, ...]  # torch order
    f32: bool  # stored as F32 in the GGUF (norms, biases, router), the storage dtype in HF
    parts: list[Part] = field(default_factory=list)


def tensor_plan(s: Spec) -> list[Entry]:
    """Every tensor, in the order they are generated and written (the same in both files)."""
    D, I, H, K, Dh, V = s.hidden, s.ffn, s.heads, s.kv_heads, s.head_dim, s.vocab
    plan: list[Entry] = []

    def add(gguf: str, shape: tuple[int, ...], hf: str | list[Part], f32: bool = False, kind: str = "") -> None:
        parts = hf if isinstance(hf, list) else [Part(hf, shape, kind)]
        plan.append(Entry(gguf, shape, f32 or len(shape) == 1, parts))

    if s.family == "opt":
        p = "model.decoder."
        add("token_embd.weight", (V, D), p + "embed_tokens.weight")
        add("position_embd.weight", (s.context, D), [Part(p + "embed_positions.weight", (s.context + 2, D), "pos")])
        for i in range(s.layers):
            b, q = f"blk.{i}.", f"{p}layers.{i}."
            add(b + "attn_norm.weight", (D,), q + "self_attn_layer_norm.weight")
            add(b + "attn_norm.bias", (D,), q + "self_attn_layer_norm.bias")
            add(b + "attn_qkv.weight", (3 * D, D), [Part(f"{q}self_attn.{x}_proj.weight", (D, D)) for x in "qkv"])
            add(b + "attn_qkv.bias", (3 * D,), [Part(f"{q}self_attn.{x}_proj.bias", (D,)) for x in "qkv"], True)
            add(b + "attn_output.weight", (D, D), q + "self_attn.out_proj.weight")
            add(b + "attn_output.bias", (D,), q + "self_attn.out_proj.bias")
            add(b + "ffn_norm.weight", (D,), q + "final_layer_norm.weight")
            add(b + "ffn_norm.bias", (D,), q + "final_layer_norm.bias")
            add(b + "ffn_up.weight", (I, D), q + "fc1.weight")
            add(b + "ffn_up.bias", (I,), q + "fc1.bias")
            add(b + "ffn_down.weight", (D, I), q + "fc2.weight")
            add(b + "ffn_down.bias", (D,), q + "fc2.bias")
        add("output_norm.weight", (D,), p + "final_layer_norm.weight")
        add("output_norm.bias", (D,), p + "final_layer_norm.bias")
        return plan  # lm_head tied to the embedding, as in OPT

    rot = "q" if s.gguf_arch == "llama" else ""  # llama.cpp permutes q/k rows of `llama` models only
    add("token_embd.weight", (V, D), "model.embed_tokens.weight")
    for i in range(s.layers):
        b, q = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", (D,), q + "input_layernorm.weight")
        add(b + "attn_q.weight", (H * Dh, D), q + "self_attn.q_proj.weight", kind=rot and "q")
        add(b + "attn_k.weight", (K * Dh, D), q + "self_attn.k_proj.weight", kind=rot and "k")
        add(b + "attn_v.weight", (K * Dh, D), q + "self_attn.v_proj.weight")
        if s.family == "qwen3_moe":
            add(b + "attn_q_norm.weight", (Dh,), q + "self_attn.q_norm.weight")
            add(b + "attn_k_norm.weight", (Dh,), q + "self_attn.k_norm.weight")
        add(b + "attn_output.weight", (D, H * Dh), q + "self_attn.o_proj.weight")
        add(b + "ffn_norm.weight", (D,), q + "post_attention_layernorm.weight")
        if s.family == "llama":
            add(b + "ffn_gate.weight", (I, D), q + "mlp.gate_proj.weight")
            add(b + "ffn_up.weight", (I, D), q + "mlp.up_proj.weight")
            add(b + "ffn_down.weight", (D, I), q + "mlp.down_proj.weight")
            continue
        E = s.experts
        moe, names = ((q + "block_sparse_moe.", ("w1", "w3", "w2")) if s.family == "mixtral"
                      else (q + "mlp.", ("gate_proj", "up_proj", "down_proj")))
        add(b + "ffn_gate_inp.weight", (E, D), moe + "gate.weight", f32=True)
        for g, n, shape in zip(("gate", "up", "down"), names, ((I, D), (I, D), (D, I))):
            add(f"{b}ffn_{g}_exps.weight", (E, *shape),
                [Part(f"{moe}experts.{e}.{n}.weight", shape) for e in range(E)])
    add("output_norm.weight", (D,), "model.norm.weight")
    add("output.weight", (V, D), "lm_head.weight")
    return plan


def count_params(plan: list[Entry]) -> int:
    return sum(int(np.prod(p.shape)) for e in plan for p in e.parts)
