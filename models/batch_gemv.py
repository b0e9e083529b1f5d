"""x @ W.T for a few rows of x over a GGUF-quantised W, each row bit for bit the one-token GEMV's.

A decode step of B sequences (models/batch_step.py) multiplies the same
weights by a few activation rows. `qgemv` per row reads the whole matrix each time; here each group
of weight rows (8 interleaved rows, or the one-token kernel's span of _BLOCK rows) is read once and
dotted with every row while it is in cache. The pieces are the one-token kernel's own (the same
activation quantisation, spans and dot intrinsics), so row b equals qgemv(m, X[b]) exactly.

An interleaved matrix with two rows or more goes through the MoE prefill's tile kernel
(sparse_ops/quant/tiles.py): each block of a group pair is loaded and unpacked once for up to 8 rows
and dotted with each, with the one-token kernel's block arithmetic per row (the same bits); the
block's decoding is much of a one-token dot's work, so this is the part of a batched step that grows
with B (SmolLM2's matrices at B = 4, cache-hot: 1.3-1.5x faster than a group dot per row).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from hotcold.models.cpu_step import _mat, threshold_into
from hotcold.sparse_ops.input_sparse import im_kernel
from hotcold.sparse_ops.quant.activations import _quantize_span, _sums16_span
from hotcold.sparse_ops.quant.formats import _BLOCK, X8
from hotcold.sparse_ops.quant.interleaved import _x8_dot_any
from hotcold.sparse_ops.quant.kernels import _qgemv_any
from hotcold.sparse_ops.quant.tiles import WIDE, _tile_rows

_JIT = dict(parallel=True, nogil=True, fastmath=True, cache=True)  # as the quant kernels'
DECODE_AHEAD = 4096  # bytes of a group's weights prefetched ahead of its tile dots (see _gemv_x8_tiles)


@njit(**_JIT)
def _gemv_x8_rows(qt, w, XQ, XD, OUT):
    # OUT[b] = W X[b] for an interleaved matrix: each group of 8 weight rows is read once for all b
    for g in prange(w.shape[0]):
        for b in range(XQ.shape[0]):
            _x8_dot_any(qt, w, g, XQ[b], XD[b], OUT[b])


@njit(**_JIT)
def _gemv_x8_tiles(qt, w, XQ, XD, OUT):
    # OUT[b] = W X[b] for an interleaved matrix, B >= 2: per task WIDE groups side by side, each block
    # decoded once for a tile of rows (_tile_rows: bit for bit _x8_dot_any's per row)
    B, G = XQ.shape[0], w.shape[0]
    xrows = np.arange(B)
    for p in prange((G + WIDE - 1) // WIDE):
        g = WIDE * p
        _tile_rows(qt, w, g, min(WIDE, G - g), XQ, XD, xrows, 0, B, OUT, 0, X8 * g, DECODE_AHEAD)


@njit(**_JIT)
def _gemv_span_rows(qt, w, rows, X, XS, XQ, XD, use_xq, OUT):
    # OUT[b] = W[rows] X[b], in the row spans of the one-token kernel (_BLOCK rows a task)
    K = rows.shape[0]
    for s in prange((K + _BLOCK - 1) // _BLOCK):
        lo, hi = s * _BLOCK, min(K, (s + 1) * _BLOCK)
        for b in range(X.shape[0]):
            _qgemv_any(qt, w, rows, lo, hi, X[b], XS[b], XQ[b], XD[b], use_xq, OUT[b])


@njit(nogil=True, cache=True)
def _gemv_batch(m, X, OUT):
    # OUT [B, R] = X [B, C] @ W.T for m as cpu_step._gemv's: each row's activations prepared as the
    # one-token GEMV prepares them (Q8 blocks, or sums of 16). Input sparsity (m[5]) as the one-token
    # GEMV applies it: an input-major copy's kernel row by row (each row keeps its own inputs), or
    # each row thresholded before the dense product
    sp = m[5]
    if sp[0] >= 0:
        for b in range(X.shape[0]):
            im_kernel(X[b], OUT[b], sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6], sp[7], sp[8])
        return
    if sp[0] == -2:
        XT = np.empty_like(X)
        for b in range(X.shape[0]):
            threshold_into(X[b], sp[1], sp[7], XT[b])
        X = XT
    B, C = X.shape
    XQ = np.empty((B, C), np.int8)
    XD = np.empty((B, C // 16), np.float32)
    XS = np.empty((B, C // 16), np.float32)
    for b in range(B):
        if m[1] or m[2]:
            _quantize_span(X[b], 0, C, XQ[b], XD[b])
        else:
            _sums16_span(X[b], 0, C, XS[b])
    if m[1] and B > 1:
        _gemv_x8_tiles(m[0], m[3], XQ, XD, OUT)
    elif m[1]:
        _gemv_x8_rows(m[0], m[3], XQ, XD, OUT)
    else:
        _gemv_span_rows(m[0], m[3], m[4], X, XS, XQ, XD, m[2], OUT)


def matrix_args(m) -> tuple:
    """A QuantMatrix as _gemv_batch's argument (as models/cpu_step._mat builds it), without input sparsity."""
    return _mat(m)


def qgemv_batch(m, X: np.ndarray) -> np.ndarray:
    """X [B, cols] float32 (C-contiguous) -> [B, rows] float32, row b = qgemv(m, X[b])."""
    out = np.empty((X.shape[0], m.rows), np.float32)
    _gemv_batch(matrix_args(m), X, out)
    return out
