"""Quantising float rows to GGUF blocks and decoding them through gguf.quants (load time, numpy)."""

from __future__ import annotations

import numpy as np

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


def quantize_rows(w: np.ndarray, qtype) -> np.ndarray:
    """float [R, C] -> uint8 [R, bytes_per_row] GGUF blocks of qtype.

    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: gguf.quants.quantize (Q8_0 bit-exact with ggml's reference quantiser).
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
    if name in _K_QUANTISERS:
        blocks = np.ascontiguousarray(w).reshape(-1, bs)
        return _K_QUANTISERS[name](blocks).reshape(w.shape[0], w.shape[1] // bs * ts)
    import gguf

    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]))
