"""The numba kernels over a selection of rows: spans dispatched by type, GEMV / axpy over rows, the
fused one-token FFN, whole experts (the spans of one expert, several tokens over GGUF rows) and the
dequantisation."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from hotcold.sparse_ops.selection import activate, keep_active

from .activations import _quantize_span, _quantize_x, _sums16, _sums16_span
from .formats import _BLOCK, _INLINE, _JIT, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, X8
from .interleaved import _bf16_bits, _x8_dot_any
from .kquants import (_q4_k_axpy, _q4_k_dot, _q4_k_dot_xq, _q5_k_axpy, _q5_k_dot, _q5_k_dot_xq, _q6_k_axpy, _q6_k_dot,
                      _q6_k_dot_xq)
from .vector import (_IR_ROWS, _q4_0_axpy, _q4_0_dot, _q4_0_dot_xq, _q4_1_axpy, _q4_1_dot, _q4_1_dot_xq, _q5_0_axpy,
                     _q5_0_dot, _q5_0_dot_xq, _q5_1_axpy, _q5_1_dot, _q5_1_dot_xq, _q8_0_axpy, _q8_0_dot, _q8_0_dot_xq)


@njit(**_INLINE)
def _dot_rows_ir(dot, w, rows, lo, hi, x, xd, out):
    # out[j] = w[rows[j]] . x for j in [lo, hi), _IR_ROWS rows side by side, by an intrinsic of _make_dot
    for j in range(lo, hi, _IR_ROWS):
        dot(w, rows, j, hi, x, xd, out)


@njit(**_INLINE)
def _axpy_rows_ir(axpy, w, rows, lo, hi, a, p):
    # p += sum_{j in [lo, hi)} a[j] * w[rows[j]], _IR_ROWS rows side by side, by an intrinsic of _make_axpy
    for j in range(lo, hi, _IR_ROWS):
        axpy(w, rows, j, hi, a, p)


@njit(nogil=True, fastmath=True, cache=True)
def _qgemv_span(qt, w, rows, lo, hi, x, xs, out):
    # out[j] = w[rows[j]] · x for j in [lo, hi); w: uint8 [R, bytes_per_row] of ggml type qt
    if qt == Q4_K:
        _dot_rows_ir(_q4_k_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q6_K:
        _dot_rows_ir(_q6_k_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q5_K:
        _dot_rows_ir(_q5_k_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q4_0:
        _dot_rows_ir(_q4_0_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q4_1:
        _dot_rows_ir(_q4_1_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q5_0:
        _dot_rows_ir(_q5_0_dot, w, rows, lo, hi, x, xs, out)
    elif qt == Q5_1:
        _dot_rows_ir(_q5_1_dot, w, rows, lo, hi, x, xs, out)
    else:
        _dot_rows_ir(_q8_0_dot, w, rows, lo, hi, x, xs, out)


@njit(nogil=True, fastmath=True, cache=True)
def _qgemv_span_xq(qt, w, rows, lo, hi, xq, xd, out):
    # as _qgemv_span with Q8 activations (see _quantize_x); qt: one of _XQ_TYPES
    if qt == Q4_0:
        _dot_rows_ir(_q4_0_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q4_K:
        _dot_rows_ir(_q4_k_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q4_1:
        _dot_rows_ir(_q4_1_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q6_K:
        _dot_rows_ir(_q6_k_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q5_K:
        _dot_rows_ir(_q5_k_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q5_0:
        _dot_rows_ir(_q5_0_dot_xq, w, rows, lo, hi, xq, xd, out)
    elif qt == Q5_1:
        _dot_rows_ir(_q5_1_dot_xq, w, rows, lo, hi, xq, xd, out)
    else:
        _dot_rows_ir(_q8_0_dot_xq, w, rows, lo, hi, xq, xd, out)


@njit(nogil=True, fastmath=True, cache=True)
def _qaxpy_span(qt, w, rows, lo, hi, a, p):
    # p += sum_{j in [lo, hi)} a[j] * w[rows[j]]
    if qt == Q4_K:
        _axpy_rows_ir(_q4_k_axpy, w, rows, lo, hi, a, p)
    elif qt == Q6_K:
        _axpy_rows_ir(_q6_k_axpy, w, rows, lo, hi, a, p)
    elif qt == Q5_K:
        _axpy_rows_ir(_q5_k_axpy, w, rows, lo, hi, a, p)
    elif qt == Q4_0:
        _axpy_rows_ir(_q4_0_axpy, w, rows, lo, hi, a, p)
    elif qt == Q4_1:
        _axpy_rows_ir(_q4_1_axpy, w, rows, lo, hi, a, p)
    elif qt == Q5_0:
        _axpy_rows_ir(_q5_0_axpy, w, rows, lo, hi, a, p)
    elif qt == Q5_1:
        _axpy_rows_ir(_q5_1_axpy, w, rows, lo, hi, a, p)
    else:
        _axpy_rows_ir(_q8_0_axpy, w, rows, lo, hi, a, p)


@njit(**_JIT)
def qgemv_rows_kernel(qt, w, rows, x, use_xq, out):
    # w: uint8 [R, bytes_per_row], rows: [K], x: [C], out: [K] (overwritten); whole blocks of 8 per task
    K = rows.shape[0]
    nb = (K + _BLOCK - 1) // _BLOCK
    if use_xq:
        xq, xd = _quantize_x(x)
        for b in prange(nb):
            _qgemv_span_xq(qt, w, rows, b * _BLOCK, min(K, (b + 1) * _BLOCK), xq, xd, out)
    else:
        xs = _sums16(x)
        for b in prange(nb):
            _qgemv_span(qt, w, rows, b * _BLOCK, min(K, (b + 1) * _BLOCK), x, xs, out)


@njit(**_JIT)
def _qaxpy_rows_kernel(qt, w, rows, coeff, nt, out):
    # out[C] += sum_j coeff[j] * w[rows[j]]: nt chunks of rows with their own partial sums, then reduced
    K, C = rows.shape[0], out.shape[0]
    part = np.zeros((nt, C), np.float32)
    for c in prange(nt):
        _qaxpy_span(qt, w, rows, c * K // nt, (c + 1) * K // nt, coeff, part[c])
    for d in prange(C):
        acc = np.float32(0.0)
        for c in range(nt):
            acc += part[c, d]
        out[d] += acc


@njit(nogil=True, fastmath=True, cache=True)
def _qgemv_any(qt, w, rows, lo, hi, x, xs, xq, xd, use_xq, out):
    if use_xq:
        _qgemv_span_xq(qt, w, rows, lo, hi, xq, xd, out)
    else:
        _qgemv_span(qt, w, rows, lo, hi, x, xs, out)


@njit(**_JIT)
def qffn_one_kernel(x, rows, qu, up, gate, qd, down, act, gated, use_xq, bias, use_bias, scale, use_scale,
                     nt, out):
    # One token, phases as cpu._ffn_one_kernel: (1) gate (or up) of the selected rows, (2) keep the
    # rows whose activation is not 0, (3) gated: their up rows, (4) out += h @ down rows (per-thread
    # partial sums, reduced). up and gate share type qu; down (W_down transposed) has type qd.
    K, D = rows.shape[0], x.shape[0]
    xs = _sums16(x)
    if use_xq:
        xq, xd = _quantize_x(x)
    else:
        xq, xd = np.empty(0, np.int8), np.empty(0, np.float32)
    nb = (K + _BLOCK - 1) // _BLOCK
    z = np.empty(K, np.float32)
    f = gate if gated else up
    for b in prange(nb):
        _qgemv_any(qu, f, rows, b * _BLOCK, min(K, (b + 1) * _BLOCK), x, xs, xq, xd, use_xq, z)
    keep, h = keep_active(z, rows, bias, use_bias, act)
    m = keep.shape[0]
    if gated:
        u = np.empty(m, np.float32)
        nb2 = (m + _BLOCK - 1) // _BLOCK
        for b in prange(nb2):
            _qgemv_any(qu, up, keep, b * _BLOCK, min(m, (b + 1) * _BLOCK), x, xs, xq, xd, use_xq, u)
        for j in range(m):
            h[j] *= u[j]
    if use_scale:
        for j in range(m):
            h[j] *= scale[keep[j]]
    nt = max(1, min(nt, m))
    part = np.zeros((nt, D), np.float32)
    for c in prange(nt):
        _qaxpy_span(qd, down, keep, c * m // nt, (c + 1) * m // nt, h, part[c])
    for d in prange(D):
        acc = np.float32(0.0)
        for c in range(nt):
            acc += part[c, d]
        out[d] += acc


# `activate` compiled without fast-math (its own source; not cached: its cache entries would share
# `activate`'s file and name)
_activate_exact = njit(nogil=True)(activate.py_func)


@njit(nogil=True, cache=True)
def _gated_span(g, u, c, act, h, lo, hi):
    # h[j] = act(g[j]) u[j] c for j in [lo, hi): an expert's h, without fast-math (as the group dots'
    # arithmetic, see interleaved._EXACT) so that every kernel computing it (one token, several:
    # tiles.py) rounds it alike wherever LLVM inlines it, and its Q8 blocks come out the same
    for j in range(lo, hi):
        h[j] = _activate_exact(g[j], act) * u[j] * c


@njit(nogil=True, fastmath=True, cache=True)
def _expert_gemv(qt, w, x8, first, k, m, lo, hi, x, xs, xq, xd, use_xq, out):
    # out[k m + j] = row (first[k] m + j) of w . x for j in [lo, hi): rows of expert first[k], m per
    # expert; x8 (w interleaved, lo and hi multiples of 8): whole groups; else GGUF rows
    if x8:
        wk = w[first[k] * (m // X8):(first[k] + 1) * (m // X8)]
        ok = out[k * m:(k + 1) * m]
        for c in range(lo // X8, hi // X8):
            _x8_dot_any(qt, wk, c, xq, xd, ok)
    else:
        rows = np.arange(first[k] * m + lo, first[k] * m + hi)
        _qgemv_any(qt, w, rows, 0, hi - lo, x, xs, xq, xd, use_xq, out[k * m + lo:k * m + hi])


@njit(**_INLINE)
def _expert_h_span(qu, gate, up, gu_x8, first, k, I, lo, hi, x, xs, xq, xd, xq_up, coef, act, xq_down, g, u, h, hs,
                   hq, hd):
    # rows [lo, hi) of expert first[k] for one input x: g, u and h = act(g) u coef[k] at [k I + lo, k I +
    # hi), and h's sums of 16 and (xq_down) its Q8 blocks there
    _expert_gemv(qu, gate, gu_x8, first, k, I, lo, hi, x, xs, xq, xd, xq_up, g)
    _expert_gemv(qu, up, gu_x8, first, k, I, lo, hi, x, xs, xq, xd, xq_up, u)
    _gated_span(g, u, coef[k], act, h, k * I + lo, k * I + hi)
    _sums16_span(h, k * I + lo, k * I + hi, hs)
    if xq_down:
        _quantize_span(h, k * I + lo, k * I + hi, hq, hd)


@njit(**_INLINE)
def _expert_down_span(qd, down, d_x8, first, k, D, lo, hi, I, h, hs, hq, hd, xq_down, part):
    # part[k D + d] = row d of expert first[k]'s W_down . h_k for d in [lo, hi), h_k = h[k I, (k + 1) I)
    a, b16 = k * I, k * I // 16
    if xq_down:
        _expert_gemv(qd, down, d_x8, first, k, D, lo, hi, h, hs, hq[a:a + I], hd[b16:b16 + I // 16], True, part)
    else:
        _expert_gemv(qd, down, d_x8, first, k, D, lo, hi, h[a:a + I], hs[b16:b16 + I // 16], hq, hd, False, part)


@njit(**_JIT)
def _qexperts_pairs_kernel(X, tok, first, coef, starts, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down,
                           out):
    # Several tokens through whole experts (MoE prefill): pair j is token tok[j] through the expert at
    # position first[j] with weight coef[j]; the pairs are grouped by expert, group k = pairs
    # [starts[k], starts[k+1]). experts_one.qexperts_one_kernel's two phases over pairs instead of experts:
    # (1) per task, 32 rows of one expert for each of its pairs (the rows stay in cache across the
    # pairs: each expert's gate/up is read once per call, not once per token); (2) per span of output
    # rows, every pair's down rows, summed per token in pair order into out[tok[j]] (+=).
    T, D = X.shape
    P = tok.shape[0]
    xs = np.empty((T, D // 16), np.float32)
    xq = np.empty((T, D if xq_up else 0), np.int8)
    xd = np.empty((T, D // 16 if xq_up else 0), np.float32)
    for t in prange(T):
        _sums16_span(X[t], 0, D, xs[t])
        if xq_up:
            _quantize_span(X[t], 0, D, xq[t], xd[t])
    K = P * I
    g = np.empty(K, np.float32)
    u = np.empty(K, np.float32)
    h = np.empty(K, np.float32)
    hs = np.empty(K // 16, np.float32)
    hq = np.empty(K if xq_down else 0, np.int8)
    hd = np.empty(K // 16 if xq_down else 0, np.float32)
    step = 4 * _BLOCK
    ni = (I + step - 1) // step
    n = starts.shape[0] - 1
    for task in prange(n * ni):
        k, c = task // ni, task % ni
        lo, hi = c * step, min(I, (c + 1) * step)
        for j in range(starts[k], starts[k + 1]):
            t = tok[j]
            _expert_h_span(qu, gate, up, gu_x8, first, j, I, lo, hi, X[t], xs[t], xq[t], xd[t], xq_up, coef, act,
                           xq_down, g, u, h, hs, hq, hd)
    part = np.empty(P * D, np.float32)
    sd = 2 * _BLOCK
    nd = (D + sd - 1) // sd
    for c in prange(nd):
        lo, hi = c * sd, min(D, (c + 1) * sd)
        for j in range(P):
            _expert_down_span(qd, down, d_x8, first, j, D, lo, hi, I, h, hs, hq, hd, xq_down, part)
        acc = np.zeros(T, np.float32)
        for d in range(lo, hi):
            for t in range(T):
                acc[t] = 0.0
            for j in range(P):
                acc[tok[j]] += part[j * D + d]
            for t in range(T):
                out[t, d] += acc[t]


@njit(**_JIT)
def qdequant_kernel(qt, w, rows, out):
    # out[j] = w[rows[j]] as float32 (out zeroed by the caller); one row at a time through the axpy code
    one = np.ones(1, np.float32)
    for j in prange(rows.shape[0]):
        _qaxpy_span(qt, w, rows[j:j + 1], 0, 1, one, out[j])


@njit(**_JIT)
def _qdequant_bf16_kernel(qt, w, rows, out):
    # out[j] = w[rows[j]] as bfloat16 bits (uint16, rounded to nearest even), through a float32 row
    one = np.ones(1, np.float32)
    K, C = out.shape
    nb = (K + _BLOCK - 1) // _BLOCK
    for b in prange(nb):
        buf = np.empty(C, np.float32)
        for j in range(b * _BLOCK, min(K, (b + 1) * _BLOCK)):
            buf[:] = 0.0
            _qaxpy_span(qt, w, rows[j:j + 1], 0, 1, one, buf)
            _bf16_bits(buf, out[j])
