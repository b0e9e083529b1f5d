"""CPU sparse kernels: numba GEMV / axpy / fused FFN over a selected subset of matrix rows.

A `HostMatrix` holds a row-major [N, D] matrix in host memory (f32, fp16 or bf16 bits as uint16,
or int8 with a per-row scale). The kernels read only the rows they are given, so their cost is
proportional to the number of selected rows, not to N. Weights of one neuron are one row: for an
FFN pass W_up / W_gate as [I, D] and W_down *transposed*, also [I, D].

All kernels are `numba.njit(parallel=True, nogil=True, fastmath=True, cache=True)`: they release the
GIL, so a worker thread can run them while the main thread queues GPU work. fp16/bf16 are widened
to float32 in the inner loop by LLVM intrinsics (no float16 array type in numba); accumulation is
float32. The thread count is numba's and is *thread-local*: call `set_threads` in the thread that
runs the kernels.

Reductions into out[D] (axpy, the down projection) give each thread a chunk of the selected rows
and its own partial sum, then add the partials in parallel over D. Splitting D among threads
instead was measured slower: 85 vs 28 GB/s (f32), 101 vs 13 (f16) with 16 threads on the H200 host,
K = 4096 of 32768 rows, D = 4096 (`tools/bench_kernels.py --variants`).
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from hotcold.sparse_ops.float_rows import FLOAT_CHUNK, _float_dot, float_dot_types_ok
from hotcold.sparse_ops.host_matrix import (_TO_DTYPE, KINDS, HostMatrix, advise_hugepages, gather_columns,
                                            host_empty, quantize_i8)
from hotcold.sparse_ops.quant.matrix import QuantMatrix
from hotcold.sparse_ops.quant.vector import _IR_ROWS
from hotcold.sparse_ops.quant.ops import qaxpy_rows, qffn_rows, qffn_rows_batch, qgemv, qgemv_rows
from hotcold.sparse_ops.selection import (ACTS, activate, as_rows, batch_input, get_threads, index_map, keep_active,
                                          mask_to_rows, release_threads, set_threads, split_rows)

__all__ = [
    "HostMatrix", "quantize_i8", "gemv_rows", "gemv", "axpy_rows", "ffn_rows", "ffn_rows_batch",
    "ffn_dense", "torch_view", "advise_hugepages", "host_empty", "gather_columns", "set_threads", "get_threads", "release_threads", "mask_to_rows", "index_map", "split_rows", "ACTS", "KINDS",
]

_JIT = dict(parallel=True, nogil=True, fastmath=True, cache=True)
_TILE_BYTES = 1 << 16  # per-thread partial sums of one token tile: tile * D * 4 bytes


# ---------------------------------------------------------------------------------------------
# Element widening: storage element -> float32, inlined into the inner loops.
# fp16 bits travel as int16 and bf16 bits as uint16 so that numba dispatches on the array type.

@intrinsic
def _bf16_bits_to_f32(typingctx, v):
    """bf16 bits (16-bit int) -> float32: zext to i32, shl 16, bitcast."""
    if not isinstance(v, types.Integer) or v.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        w = builder.zext(args[0], ir.IntType(32))
        w = builder.shl(w, ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(w, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, v):
    """fp16 bits (16-bit int) -> float32: bitcast to half, fpext."""
    if not isinstance(v, types.Integer) or v.bitwidth != 16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, v):
    """float32 -> fp16 bits (int16): fptrunc to half (round to nearest even), bitcast."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(v), codegen


def _narrow(v, like):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_narrow, inline="always")
def _narrow_impl(v, like):
    """float32 v -> the storage type of `like` (an element of the destination): float32 or fp16 bits."""
    if like == types.float32:
        return lambda v, like: np.float32(v)
    if like == types.int16:
        return lambda v, like: _f32_to_f16_bits(np.float32(v))
    return None


def _widen(v):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(v):
    if v == types.float32:
        return lambda v: v
    if v == types.int8:
        return lambda v: np.float32(v)
    if v == types.uint16:
        return lambda v: _bf16_bits_to_f32(v)
    if v == types.int16:
        return lambda v: _f16_bits_to_f32(v)
    return None


# ---------------------------------------------------------------------------------------------
# Kernels. `w` is the storage array (float32 | int16 fp16 bits | uint16 bf16 bits | int8),
# `s` a float32 [N] per-row scale (ones unless int8), `rows` int64 [K].

@njit(nogil=True, fastmath=True, cache=True)
def _dot(wr, x):
    # wr: [D] storage, x: [D] float32 -> float32
    acc = np.float32(0.0)
    for d in range(x.shape[0]):
        acc += _widen(wr[d]) * x[d]
    return acc



_BLOCK = 8  # rows read side by side by one thread: 8 memory streams in flight instead of 1


def _rows_dot(w, rows, j, hi, x, out):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_rows_dot, inline="always")
def _rows_dot_impl(w, rows, j, hi, x, out):
    """out[i] = w[rows[i], :C] . x[:C] for the _IR_ROWS rows i from j (clamped to hi - 1), C = the row
    length rounded down to FLOAT_CHUNK: float_rows' vector IR where the types allow (C-contiguous), else
    the same sums in a numba loop."""
    if float_dot_types_ok(w, rows, x, out):
        return lambda w, rows, j, hi, x, out: _float_dot(w, rows, j, hi, x, out)

    def loop(w, rows, j, hi, x, out):
        c = x.shape[0] - x.shape[0] % FLOAT_CHUNK
        for i in range(j, min(hi, j + _IR_ROWS)):
            wr = w[rows[i]]
            acc = np.float32(0.0)
            for d in range(c):
                acc += _widen(wr[d]) * x[d]
            out[i] = acc
    return loop


@njit(nogil=True, fastmath=True, cache=True)
def _axpy_block(w, rows, j0, a, p):
    # p[D] += sum_i a[j0 + i] * w[rows[j0 + i]] for i < 8 (a already holds the row scales)
    w0, w1, w2, w3 = w[rows[j0]], w[rows[j0 + 1]], w[rows[j0 + 2]], w[rows[j0 + 3]]
    w4, w5, w6, w7 = w[rows[j0 + 4]], w[rows[j0 + 5]], w[rows[j0 + 6]], w[rows[j0 + 7]]
    c0, c1, c2, c3 = a[j0], a[j0 + 1], a[j0 + 2], a[j0 + 3]
    c4, c5, c6, c7 = a[j0 + 4], a[j0 + 5], a[j0 + 6], a[j0 + 7]
    for d in range(p.shape[0]):
        p[d] += (c0 * _widen(w0[d]) + c1 * _widen(w1[d]) + c2 * _widen(w2[d]) + c3 * _widen(w3[d])
                 + c4 * _widen(w4[d]) + c5 * _widen(w5[d]) + c6 * _widen(w6[d]) + c7 * _widen(w7[d]))


@njit(nogil=True, fastmath=True, cache=True)
def _gemv_span(w, s, rows, lo, hi, x, out):
    # out[j] = w[rows[j]] · x * s[rows[j]] for j in [lo, hi): _IR_ROWS rows side by side over the
    # columns in whole FLOAT_CHUNKs (_rows_dot), then the remaining columns and the scale row by row
    for j in range(lo, hi, _IR_ROWS):
        _rows_dot(w, rows, j, hi, x, out)
    D = x.shape[0]
    c = D - D % FLOAT_CHUNK
    for j in range(lo, hi):
        r = rows[j]
        acc = out[j]
        if c < D:
            wr = w[r]
            for d in range(c, D):
                acc += _widen(wr[d]) * x[d]
        out[j] = acc * s[r]


@njit(nogil=True, fastmath=True, cache=True)
def _axpy_span(w, rows, lo, hi, a, p):
    # p += sum_{j in [lo, hi)} a[j] * w[rows[j]]
    j = lo
    while j + _BLOCK <= hi:
        _axpy_block(w, rows, j, a, p)
        j += _BLOCK
    while j < hi:
        c = a[j]
        if c != 0.0:
            wr = w[rows[j]]
            for d in range(p.shape[0]):
                p[d] += c * _widen(wr[d])
        j += 1


@njit(**_JIT)
def _gemv_rows_kernel(w, s, rows, x, out):
    # w: [N, D], rows: [K], x: [D], out: [K] (overwritten); each thread takes whole blocks of 8
    K = rows.shape[0]
    nb = (K + _BLOCK - 1) // _BLOCK
    for b in prange(nb):
        _gemv_span(w, s, rows, b * _BLOCK, min(K, (b + 1) * _BLOCK), x, out)


@njit(**_JIT)
def _axpy_rows_kernel(w, s, rows, coeff, nt, out):
    # out[D] += sum_j coeff[j] * w[rows[j]]: nt chunks of rows, per-chunk partial sums, then a reduction
    K, D = rows.shape[0], w.shape[1]
    a = np.empty(K, np.float32)
    for j in range(K):
        a[j] = coeff[j] * s[rows[j]]
    part = np.zeros((nt, D), np.float32)
    for c in prange(nt):
        _axpy_span(w, rows, c * K // nt, (c + 1) * K // nt, a, part[c])
    for d in prange(D):
        acc = np.float32(0.0)
        for c in range(nt):
            acc += part[c, d]
        out[d] += acc


@njit(**_JIT)
def _ffn_one_kernel(x, rows, up, us, gate, gs, bias, down, ds, act, gated, use_bias, nt, out):
    # One token, in phases that each stream blocks of 8 rows: (1) the gate (or up + bias) of every
    # selected row, (2) keep the rows whose activation is not exactly 0, (3) gated: their up rows,
    # (4) the down rows of those, weighted, summed per thread and reduced into out [D] (+=).
    # The prange loops repeat _gemv_rows_kernel's and _axpy_rows_kernel's on purpose: calling those
    # parallel kernels from here measured 15-25% slower (3,428 of 11,008 f16 rows, 2 threads).
    K, D = rows.shape[0], x.shape[0]
    nb = (K + _BLOCK - 1) // _BLOCK
    z = np.empty(K, np.float32)
    f, fs = (gate, gs) if gated else (up, us)
    for b in prange(nb):
        _gemv_span(f, fs, rows, b * _BLOCK, min(K, (b + 1) * _BLOCK), x, z)
    keep, h = keep_active(z, rows, bias, use_bias, act)
    n = keep.shape[0]
    if gated:
        u = np.empty(n, np.float32)
        nb2 = (n + _BLOCK - 1) // _BLOCK
        for b in prange(nb2):
            _gemv_span(up, us, keep, b * _BLOCK, min(n, (b + 1) * _BLOCK), x, u)
        for j in range(n):
            h[j] *= u[j]
    for j in range(n):
        h[j] *= ds[keep[j]]
    part = np.zeros((nt, D), np.float32)
    for c in prange(nt):
        _axpy_span(down, keep, c * n // nt, (c + 1) * n // nt, h, part[c])
    for d in prange(D):
        acc = np.float32(0.0)
        for c in range(nt):
            acc += part[c, d]
        out[d] += acc


@njit(**_JIT)
def _ffn_rows_kernel(X, rows, up, us, gate, gs, bias, down, ds, act, gated, use_bias, nt, tile, out):
    # X: [T, D]; up/gate/down: [N, D]; out: [T, D] (+=). Tokens go in tiles of `tile`; the rows are
    # split in nt chunks, each accumulating its part of h @ down into part[c] (no races), then reduced.
    T, D = X.shape
    K = rows.shape[0]
    part = np.empty((nt, tile, D), np.float32)
    hbuf = np.empty((nt, tile), np.float32)
    for t0 in range(0, T, tile):
        n = min(tile, T - t0)
        for c in prange(nt):
            p = part[c]
            h = hbuf[c]
            for t in range(n):
                for d in range(D):
                    p[t, d] = 0.0
            for j in range(c * K // nt, (c + 1) * K // nt):
                r = rows[j]
                upr = up[r]
                nz = False
                for t in range(n):
                    xt = X[t0 + t]
                    if gated:
                        g = activate(_dot(gate[r], xt) * gs[r], act)
                        hv = g * (_dot(upr, xt) * us[r]) if g != 0.0 else np.float32(0.0)
                    else:
                        z = _dot(upr, xt) * us[r]
                        if use_bias:
                            z += bias[r]
                        hv = activate(z, act)
                    h[t] = hv * ds[r]
                    nz = nz or hv != 0.0
                if nz:  # skip reading the down row when every token's activation is exactly zero
                    dr = down[r]
                    for t in range(n):
                        a = h[t]
                        if a != 0.0:
                            pt = p[t]
                            for d in range(D):
                                pt[d] += a * _widen(dr[d])
        for d in prange(D):
            for t in range(n):
                acc = np.float32(0.0)
                for c in range(nt):
                    acc += part[c, t, d]
                out[t0 + t, d] += acc



# ---------------------------------------------------------------------------------------------
# Python entry points


def _as_f32(a: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a


def _check_out(out: np.ndarray, shape: tuple) -> np.ndarray:
    if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    return out



def gemv_rows(m: HostMatrix, rows: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out[j] = m[rows[j]] · x. rows int [K]; x float32 [D]; returns out float32 [K] (overwritten)."""
    if isinstance(m, QuantMatrix):

        return qgemv_rows(m, rows, x, out)
    n, d = m.shape
    rows = as_rows(rows, n)
    x = _as_f32(x, (d,), "x")
    out = np.empty(rows.shape[0], np.float32) if out is None else _check_out(out, rows.shape)
    if rows.shape[0]:
        _gemv_rows_kernel(m._w, m._s, rows, x, out)
    return out


def gemv(m: HostMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Dense out = m @ x over all N rows (for CPU-placed dense layers). x [D] -> out [N]."""
    if isinstance(m, QuantMatrix):

        return qgemv(m, x, out)
    if m._all_rows is None:
        m._all_rows = np.arange(m.shape[0], dtype=np.int64)
    return gemv_rows(m, m._all_rows, x, out)


def axpy_rows(m: HostMatrix, rows: np.ndarray, coeff: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[D] += sum_j coeff[j] * m[rows[j]]  (down projection with m = W_down transposed, [I, D])."""
    if isinstance(m, QuantMatrix):

        return qaxpy_rows(m, rows, coeff, out)
    n, d = m.shape
    rows = as_rows(rows, n)
    coeff = _as_f32(coeff, rows.shape, "coeff")
    _check_out(out, (d,))
    k = rows.shape[0]
    if k:
        _axpy_rows_kernel(m._w, m._s, rows, coeff, min(get_threads(), k), out)
    return out


_NO_BIAS = np.zeros(1, np.float32)



def ffn_rows_batch(X: np.ndarray, rows: np.ndarray, up: HostMatrix, down_t: HostMatrix, act: str,
                   gate: HostMatrix | None = None, up_bias: np.ndarray | None = None,
                   out: np.ndarray | None = None, row_scale: np.ndarray | None = None) -> np.ndarray:
    """Fused sparse FFN for T tokens sharing one row selection; returns out float32 [T, D] (+=).

    For each selected neuron i: h = act(gate_i·x) * (up_i·x) when gate is given (bias ignored),
    else h = act(up_i·x + up_bias_i); then out += sum_i h_i * row_scale_i * down_t[i]. act: relu |
    silu | gelu_tanh. row_scale: float32 [N] per matrix row, or None (1): e.g. the routing weight
    of the MoE expert a row belongs to, when several experts are stacked in one matrix.
    QuantMatrix operands (all of up, gate, down_t) go to `quant.qffn_rows(_batch)`.
    """
    if isinstance(up, QuantMatrix):

        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.ndim == 2 and X.shape[0] == 1:
            o = None if out is None else _check_out(out, X.shape).reshape(-1)
            res = qffn_rows(X[0], rows, up, down_t, act, gate, o, up_bias=up_bias, row_scale=row_scale)
            return res.reshape(1, -1) if out is None else out
        return qffn_rows_batch(X, rows, up, down_t, act, gate, up_bias, out, row_scale)
    n, d = up.shape
    X = batch_input(X, d, act)
    for name, mat in (("down_t", down_t), ("gate", gate)):
        if mat is not None and mat.shape != (n, d):
            raise ValueError(f"{name} has shape {mat.shape}, expected {(n, d)} like up")
    T = X.shape[0]
    rows = as_rows(rows, n)
    out = np.zeros((T, d), np.float32) if out is None else _check_out(out, (T, d))
    k = rows.shape[0]
    if k == 0 or T == 0:
        return out
    bias = _NO_BIAS if (up_bias is None or gate is not None) else _as_f32(up_bias, (n,), "up_bias")
    g = gate if gate is not None else up  # same storage type: gated and ungated share one compilation
    ds = down_t._s  # the kernels scale each row's h by it (the i8 row scale, else ones)
    if row_scale is not None:
        row_scale = _as_f32(row_scale, (n,), "row_scale")
        ds = row_scale if down_t.kind != "i8" else ds * row_scale
    if T == 1:
        _ffn_one_kernel(X[0], rows, up._w, up._s, g._w, g._s, bias,
                        down_t._w, ds, ACTS[act], gate is not None, bias is not _NO_BIAS,
                        min(get_threads(), k), out[0])
        return out
    tile = max(1, min(T, _TILE_BYTES // (4 * d)))
    _ffn_rows_kernel(X, rows, up._w, up._s, g._w, g._s, bias, down_t._w, ds, ACTS[act],
                     gate is not None, bias is not _NO_BIAS, min(get_threads(), k), tile, out)
    return out


def ffn_rows(x: np.ndarray, rows: np.ndarray, up: HostMatrix, down_t: HostMatrix, act: str,
             gate: HostMatrix | None = None, up_bias: np.ndarray | None = None,
             out: np.ndarray | None = None, row_scale: np.ndarray | None = None) -> np.ndarray:
    """One token of `ffn_rows_batch`: x float32 [D] -> out float32 [D] (+=)."""
    d = up.shape[1]
    x = _as_f32(x, (d,), "x")
    out2 = None if out is None else _check_out(out, (d,)).reshape(1, d)
    res = ffn_rows_batch(x.reshape(1, d), rows, up, down_t, act, gate, up_bias, out2, row_scale)
    return res.reshape(d) if out is None else out


_TORCH_ACT = {"relu": torch.relu, "silu": torch.nn.functional.silu,
              "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}


def torch_view(m: HostMatrix) -> torch.Tensor:
    """The matrix as a torch tensor of its own dtype, sharing its memory (f32, f16, bf16; not i8)."""
    if m.kind == "i8":
        raise ValueError("i8 rows have no torch dtype of their own")
    if m.kind == "f32":
        return torch.from_numpy(m.data)
    return torch.from_numpy(m.data.view(np.int16)).view(_TO_DTYPE[m.kind])


def ffn_dense(X: np.ndarray, mask: np.ndarray | None, up: HostMatrix, down_t: HostMatrix, act: str,
              gate: HostMatrix | None = None, up_bias: np.ndarray | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """The FFN over all N rows for T tokens at once, as three torch GEMMs in the weights' own dtype
    (f32, f16, bf16): for a prompt chunk, where `ffn_rows_batch` would read the rows once per token
    tile. h as in ffn_rows_batch, zeroed where mask [N] is False (None: every row); out float32
    [T, D] += h @ down_t. X: float32 [T, D]."""
    n, d = up.shape
    X = batch_input(X, d, act)
    out = np.zeros(X.shape, np.float32) if out is None else _check_out(out, X.shape)
    if X.shape[0] == 0 or (mask is not None and not mask.any()):
        return out
    U = torch_view(up)  # [N, D]
    x = torch.from_numpy(X).to(U.dtype)  # [T, D]
    z = torch.nn.functional.linear(x, U)  # [T, N]
    if gate is not None:
        h = _TORCH_ACT[act](torch.nn.functional.linear(x, torch_view(gate))) * z
    else:
        if up_bias is not None:
            z = z + torch.from_numpy(_as_f32(up_bias, (n,), "up_bias")).to(z.dtype)
        h = _TORCH_ACT[act](z)
    if mask is not None:
        h *= torch.from_numpy(np.asarray(mask, dtype=bool)).to(h.dtype)  # [N]
    torch.from_numpy(out).add_((h @ torch_view(down_t)).float())  # [T, D]
    return out
