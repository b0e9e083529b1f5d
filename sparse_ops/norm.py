"""RMSNorm and LayerNorm on the CPU as one numba call.

In torch the norm of one token is seven small ops (float, pow, mean, add, rsqrt, two multiplies),
each a few microseconds of dispatch; a decoder layer runs two or four of them per token, so on a
small model (SmolLM2-135M: 30 layers) they cost about a millisecond per token. LayerNorm (OPT) is
here for the fused one-token step (models/cpu_step.py), which normalises inside its numba call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["layer_norm", "rms_norm"]


@njit(nogil=True, fastmath=True, cache=True)
def _rms_norm(x, w, eps, plus_one, out):
    N, D = x.shape
    for t in range(N):
        ss = np.float32(0.0)
        for i in range(D):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.sqrt(ss / D + eps)
        for i in range(D):
            g = w[i] + np.float32(1.0) if plus_one else w[i]
            out[t, i] = x[t, i] * r * g


@njit(nogil=True, fastmath=True, cache=True)
def _layer_norm(x, w, b, eps, out):
    # (x - mean) / sqrt(var + eps) * w + b per row, torch's nn.LayerNorm (the biased variance); two
    # passes over the row in float32. x, out: [N, D]; w: [D]; b: [D], or empty for no bias
    N, D = x.shape
    biased = b.shape[0] > 0
    for t in range(N):
        s = np.float32(0.0)
        for i in range(D):
            s += x[t, i]
        mean = s / D
        ss = np.float32(0.0)
        for i in range(D):
            d = x[t, i] - mean
            ss += d * d
        r = np.float32(1.0) / np.sqrt(ss / D + eps)
        for i in range(D):
            y = (x[t, i] - mean) * r * w[i]
            out[t, i] = y + b[i] if biased else y


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    """(x - mean(x)) / sqrt(var(x) + eps) * w + b (nn.LayerNorm over the last axis). x: float32 [N, D];
    w, b: float32 [D] (b None: no bias) -> float32 [N, D]."""
    out = np.empty_like(x)
    _layer_norm(x, w, np.zeros(0, np.float32) if b is None else b, np.float32(eps), out)
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, plus_one: bool = False) -> np.ndarray:
    """x / sqrt(mean(x²) + eps) * w (w + 1 with plus_one, Gemma's). x: float32 [N, D]; w: float32 [D]
    -> float32 [N, D]."""
    out = np.empty_like(x)
    _rms_norm(x, w, np.float32(eps), plus_one, out)
    return out
