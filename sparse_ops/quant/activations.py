"""Q8 activations and sums of x, the per-call preparation of x the block kernels read."""

from __future__ import annotations

import numpy as np
from numba import njit


# Q8 activations: xq int8 [C] and xd float32 [C/16] = (dx_b, dx_b * sum of xq over b) per 32-block
# b, so that block b of x ~ xq * dx_b.

@njit(nogil=True, fastmath=True, cache=True)
def _quantize_span(x, lo, hi, xq, xd):
    # blocks [lo / 32, hi / 32) of x (lo, hi multiples of 32) into xq int8 [C], xd float32 [C / 16]
    for b in range(lo // 32, hi // 32):
        amax = np.float32(0.0)
        for l in range(32):
            amax = max(amax, abs(x[32 * b + l]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for l in range(32):
            q = np.int32(np.round(x[32 * b + l] * inv))
            xq[32 * b + l] = q
            s += q
        xd[2 * b] = d
        xd[2 * b + 1] = d * np.float32(s)


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_x(x):
    # x: [C] float32 -> (xq int8 [C], xd float32 [C/16]) as described above
    xq = np.empty(x.shape[0], np.int8)
    xd = np.empty(2 * (x.shape[0] // 32), np.float32)
    _quantize_span(x, 0, x.shape[0], xq, xd)
    return xq, xd


@njit(nogil=True, fastmath=True, cache=True)
def _sums16_span(x, lo, hi, xs):
    # xs[i] = sum of x[16 i : 16 i + 16] for i in [lo / 16, hi / 16) (lo, hi multiples of 16)
    for i in range(lo // 16, hi // 16):
        s = np.float32(0.0)
        for l in range(16):
            s += x[16 * i + l]
        xs[i] = s


@njit(nogil=True, fastmath=True, cache=True)
def _sums16(x):
    # x: [C] -> float32 [C / 16] sums of 16 consecutive elements
    xs = np.empty(x.shape[0] // 16, np.float32)
    _sums16_span(x, 0, x.shape[0], xs)
    return xs
