"""Quantising float rows to GGUF blocks (load time, tools/make_model.py) and decoding them through
gguf.quants.

Q8_0 and Q4_0 are numba kernels that do gguf.quants' float32 operations in its order (no fastmath), so
their blocks are the same bytes as gguf's numpy quantiser (bit-exact with ggml's reference for Q8_0),
10-50x faster and in parallel over rows; the K-quants are numpy, over chunks of rows in threads.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, prange

from .formats import QTYPES, qtype_name


def dequantize_rows(data: np.ndarray, qtype, cols: int) -> np.ndarray:
    """uint8 [R, bytes_per_row] blocks -> float32 [R, cols], by gguf.quants.dequantize."""
    import gguf

    name = qtype_name(qtype)
    out = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType[name])
    return out.reshape(data.shape[0], cols).astype(np.float32, copy=False)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    # float [..., 1] -> uint8 [..., 2] little-endian fp16
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8)


def _k_scales_pack(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    # 6-bit sc, m: uint8 [n, 8] -> uint8 [n, 12] in the layout _k_scale_min reads
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _quantize_k_asym(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    # blocks float32 [n, 256] -> (d, dmin float16-rounded [n, 1], sc, m uint8 [n, 8], q uint8 [n, 8, 32])
    # per sub-block of 32: min_s = min(0, min x), scale_s = (max x - min_s) / levels; the 8 scales and
    # mins go to 6 bits under one fp16 d / dmin; q = round((x + dmin m) / (d sc)) in [0, levels].
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - lo) / levels
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), 0, 63)
    m = np.clip(np.round(_safe_div(-lo, dmin)), 0, 63)
    step = (d * sc)[:, :, None]
    q = np.clip(np.round(_safe_div(sub + (dmin * m)[:, :, None], step)), 0, levels)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_k_asym(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_pack(sc, m), qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_k_asym(blocks, 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= (q[:, s] >> 4) << s
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_pack(sc, m), qh, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # 16 groups of 16, symmetric: scale_g = amax_g / 31 -> int8 under one fp16 d; q in [-32, 31]
    n = blocks.shape[0]
    grp = blocks.reshape(n, 16, 16)
    scale = np.abs(grp).max(axis=2) / 31
    d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), -128, 127)
    q = np.clip(np.round(_safe_div(grp, (d * sc)[:, :, None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, k, l]: element 128h + 32k + l
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


_K_QUANTISERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}
_K_CHUNK = 1024  # 256-blocks per numpy call of a K quantiser (bounded temporaries; threads take chunks)


@njit(parallel=True, nogil=True, cache=True)
def _q4_0_kernel(w, d, qs):
    # w float32 [R, C] -> d float32 [R, C / 32] (block scales, before fp16), qs uint8 [R, C / 32, 16]:
    # gguf.quants.Q4_0.quantize_blocks' float32 operations in its order: d = (the value of largest
    # magnitude, the first one) / -8, q = min(15, trunc(x / d + 8.5)), element l | element 16 + l << 4
    R, C = w.shape
    for r in prange(R):
        for b in range(C // 32):
            o = 32 * b
            imax, amax = 0, abs(w[r, o])
            for l in range(1, 32):
                a = abs(w[r, o + l])
                if a > amax:
                    imax, amax = l, a
            s = w[r, o + imax] / np.float32(-8.0)
            inv = np.float32(0.0) if s == 0 else np.float32(1.0) / s
            d[r, b] = s
            for l in range(16):
                lo = min(np.uint8(np.trunc(w[r, o + l] * inv + np.float32(8.5))), np.uint8(15))
                hi = min(np.uint8(np.trunc(w[r, o + 16 + l] * inv + np.float32(8.5))), np.uint8(15))
                qs[r, b, l] = lo | (hi << np.uint8(4))


@njit(parallel=True, nogil=True, cache=True)
def _q8_0_kernel(w, d, qs):
    # w float32 [R, C] -> d float32 [R, C / 32], qs int8 [R, C / 32, 32]: gguf.quants.Q8_0.quantize_blocks'
    # operations (d = max |x| / 127, q = x / d rounded half away from zero, as its np_roundf does)
    R, C = w.shape
    for r in prange(R):
        for b in range(C // 32):
            o = 32 * b
            amax = np.float32(0.0)
            for l in range(32):
                amax = max(amax, abs(w[r, o + l]))
            s = amax / np.float32(127.0)
            inv = np.float32(0.0) if s == 0 else np.float32(1.0) / s
            d[r, b] = s
            for l in range(32):
                v = w[r, o + l] * inv
                a = abs(v)
                f = np.floor(a)
                q = f + np.floor(np.float32(2.0) * (a - f))
                qs[r, b, l] = np.int8(-q) if v < 0 else np.int8(q)


_JIT_QUANTISERS = {"Q4_0": (_q4_0_kernel, np.uint8), "Q8_0": (_q8_0_kernel, np.int8)}


def _quantize_jit(w: np.ndarray, name: str) -> np.ndarray:
    # w float32 [R, C] -> uint8 [R, C / 32 * bytes per block] by the type's kernel: fp16 d, then the quants
    kernel, qdt = _JIT_QUANTISERS[name]
    _, bs, ts = QTYPES[name]
    r, nb = w.shape[0], w.shape[1] // bs
    d = np.empty((r, nb), np.float32)
    qs = np.empty((r, nb, ts - 2), qdt)
    if r and nb:
        kernel(np.ascontiguousarray(w), d, qs)
    out = np.empty((r, nb, ts), np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(r, nb, 2)
    out[:, :, 2:] = qs.view(np.uint8)
    return out.reshape(r, nb * ts)


def _quantize_k(w: np.ndarray, name: str) -> np.ndarray:
    # the K quantiser over chunks of _K_CHUNK blocks, several chunks at once in threads (numpy releases
    # the GIL); blocks are independent, so the bytes do not depend on the chunking
    _, bs, ts = QTYPES[name]
    blocks = np.ascontiguousarray(w).reshape(-1, bs)
    out = np.empty((blocks.shape[0], ts), np.uint8)

    def one(a: int) -> None:
        out[a:a + _K_CHUNK] = _K_QUANTISERS[name](blocks[a:a + _K_CHUNK])

    starts = range(0, blocks.shape[0], _K_CHUNK)
    if len(starts) <= 1:
        for a in starts:
            one(a)
    else:
        with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
            list(pool.map(one, starts))
    return out.reshape(w.shape[0], w.shape[1] // bs * ts)


def quantize_rows(w: np.ndarray, qtype) -> np.ndarray:
    """float [R, C] -> uint8 [R, bytes_per_row] GGUF blocks of qtype.

    Q8_0, Q4_0: numba kernels giving gguf.quants.quantize's bytes (see the module docstring); Q4_1,
    Q5_0, Q5_1: gguf.quants.quantize (Q8_0 bit-exact with ggml's reference quantiser).
    Q4_K, Q5_K, Q6_K: our simple round-to-nearest quantiser (gguf.quants cannot quantise them):
    per sub-block min/max scales, 6-bit (K) or int8 (Q6_K) sub-scales under one fp16 super-scale.
    It writes valid blocks that ggml and gguf.quants decode, but it is not llama.cpp's search-based
    K-quant quantiser and does not match it bit for bit (its error is somewhat larger).
    """
    name = qtype_name(qtype)
    _, bs, ts = QTYPES[name]
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % bs:
        raise ValueError(f"{name} needs a 2-D array with a multiple of {bs} columns, got {w.shape}")
    if name in _JIT_QUANTISERS:
        return _quantize_jit(w, name)
    if name in _K_QUANTISERS:
        return _quantize_k(w, name)
    import gguf

    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]))
