"""One decode step of attention on the CPU as a single numba kernel.

Decoding one token through torch on the CPU costs ~30 small ops per layer after the projections
(rotary on q and k, the cache write, the mask, scaled_dot_product_attention, reshapes), each a few
microseconds of dispatch: on SmolLM2-135M (30 layers) about a fifth of a token's time. `decode_attention`
does the rotary, the cache write and the attention of one token in one call, parallel over the query
heads, on host buffers of float32 or float16 (as int16 bits; see models.transformer.kv_dtype: a
half-precision model's CPU cache is float16, half the bytes each decode step reads).

Rotary is the "rotate halves" layout (HF's `rotate_half`): x' = x * cos + [-x2, x1] * sin with
cos, sin = the layer's tables at the token's position, [Dh] each.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from hotcold.sparse_ops.cpu import _narrow, _widen

__all__ = ["decode_attention"]


@njit(nogil=True, fastmath=True, cache=True, inline="always")
def _rotate(x, cos, sin, out):
    # x: [Dh] float32; out: [Dh] float32 or fp16 bits; cos, sin: [Dh]
    half = x.shape[0] // 2
    for i in range(half):
        out[i] = _narrow(x[i] * cos[i] - x[i + half] * sin[i], out[i])
        out[i + half] = _narrow(x[i + half] * cos[i + half] + x[i] * sin[i + half], out[i + half])


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _decode_attention(q, k, v, cos, sin, rotary, k_cache, v_cache, pos, lo, scale, scores, out):
    H, Dh = q.shape
    G = H // k.shape[0]  # query heads per key/value head
    for g in range(k.shape[0]):  # write the new key (rotated) and value at pos
        kc, vc = k_cache[g, pos], v_cache[g, pos]
        if rotary:
            _rotate(k[g], cos, sin, kc)
        else:
            for d in range(Dh):
                kc[d] = _narrow(k[g, d], kc[d])
        for d in range(Dh):
            vc[d] = _narrow(v[g, d], vc[d])
    n = pos + 1 - lo
    for h in prange(H):
        g = h // G
        qh = np.empty(Dh, np.float32)
        if rotary:
            _rotate(q[h], cos, sin, qh)
        else:
            qh[:] = q[h]
        s = scores[h]
        m = -np.inf
        for j in range(n):
            kj = k_cache[g, lo + j]
            acc = np.float32(0.0)
            for d in range(Dh):
                acc += qh[d] * _widen(kj[d])
            acc *= scale
            s[j] = acc
            if acc > m:
                m = acc
        total = np.float32(0.0)
        for j in range(n):
            e = np.float32(math.exp(s[j] - m))
            s[j] = e
            total += e
        o = out[h]
        o[:] = 0.0
        for j in range(n):
            w = s[j] / total
            vj = v_cache[g, lo + j]
            for d in range(Dh):
                o[d] += w * _widen(vj[d])


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     pos: int, scale: float, cos: np.ndarray | None = None, sin: np.ndarray | None = None,
                     window: int | None = None) -> np.ndarray:
    """Attention of the token at `pos` over the cache, after writing its key and value there.

    q: float32 [H, Dh]; k, v: float32 [Hkv, Dh] (q and k before rotary); k_cache, v_cache: float32
    or float16 [Hkv, S, Dh], written at pos (rounded to float16 in a float16 cache); cos, sin:
    float32 [Dh] rotary tables at pos (None: no rotary); window: sliding window (keys at positions >
    pos - window), None for all. Returns float32 [H, Dh]."""
    H, Dh = q.shape
    if H % k.shape[0] or k.shape != v.shape or k_cache.shape != v_cache.shape or not 0 <= pos < k_cache.shape[1]:
        raise ValueError(f"decode_attention: shapes q {q.shape}, k {k.shape}, v {v.shape}, cache "
                         f"{k_cache.shape} at position {pos} do not fit")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (np.float32, np.float16):
        raise ValueError(f"decode_attention: caches must both be float32 or float16, got {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dtype == np.float16:  # numba has no float16: the kernels take its bits as int16
        k_cache, v_cache = k_cache.view(np.int16), v_cache.view(np.int16)
    lo = max(0, pos - window + 1) if window else 0
    rotary = cos is not None
    if not rotary:
        cos = sin = np.zeros(Dh, np.float32)
    scores = np.empty((H, pos + 1 - lo), np.float32)
    out = np.empty((H, Dh), np.float32)
    _decode_attention(q, k, v, cos, sin, rotary, k_cache, v_cache, pos, lo, np.float32(scale), scores, out)
    return out
