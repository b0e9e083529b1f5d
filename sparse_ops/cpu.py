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

import ctypes
import os
import sys

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = [
    "HostMatrix", "quantize_i8", "gemv_rows", "gemv", "axpy_rows", "ffn_rows", "ffn_rows_batch",
    "ffn_dense", "torch_view", "advise_hugepages", "host_empty", "gather_columns", "set_threads", "get_threads", "mask_to_rows", "index_map", "split_rows", "ACTS", "KINDS",
]

KINDS = ("f32", "f16", "bf16", "i8")
ACTS = {"relu": 0, "silu": 1, "gelu_tanh": 2}
_STORAGE = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16, "i8": np.int8}
_FROM_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_TO_DTYPE = {v: k for k, v in _FROM_DTYPE.items()}
_JIT = dict(parallel=True, nogil=True, fastmath=True, cache=True)
_TILE_BYTES = 1 << 16  # per-thread partial sums of one token tile: tile * D * 4 bytes
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under t's memory (call before the memory is first
    touched). With 4 KiB pages a GEMV streaming a matrix misses the TLB every 4 KiB and the
    prefetchers stop at each page; a cold neuron's ~10 KB rows cross pages. A [15360, 5120] float16
    GEMV read 17.7 GB/s from 4 KiB pages against 24.4 from huge ones on the 2-core Xeon (numpy
    advises its own large arrays; torch does not). Returns whether the advice was taken;
    HOTCOLD_HUGEPAGES=0 turns it off."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or os.environ.get("HOTCOLD_HUGEPAGES", "1") == "0":
        return False
    start = t.data_ptr()
    a, b = (start + _HUGE - 1) // _HUGE * _HUGE, (start + t.numel() * t.element_size()) // _HUGE * _HUGE
    if b <= a:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE) == 0


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor (outside inference mode) with huge pages advised before its first touch."""
    with torch.inference_mode(False):
        t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t)
    return t


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


@njit(nogil=True, fastmath=True, cache=True)
def _act(z, act):
    # z: float32 scalar; act: 0 relu, 1 silu, 2 gelu_tanh
    if act == 0:
        return z if z > 0 else np.float32(0.0)
    if act == 1:
        if z >= 0:
            return z / (np.float32(1.0) + np.exp(-z))
        e = np.exp(z)
        return z * e / (np.float32(1.0) + e)
    c = np.float32(0.7978845608028654)  # sqrt(2/pi)
    return np.float32(0.5) * z * (np.float32(1.0) + np.tanh(c * (z + np.float32(0.044715) * z * z * z)))


@njit(nogil=True, cache=True)
def _rows_in_range(rows, n):
    for j in range(rows.shape[0]):
        if rows[j] < 0 or rows[j] >= n:
            return False
    return True


_BLOCK = 8  # rows read side by side by one thread: 8 memory streams in flight instead of 1


@njit(nogil=True, fastmath=True, cache=True)
def _dot_block(w, s, rows, j0, x, out):
    # out[j0 + i] = w[rows[j0 + i]] · x * s[...] for i < 8 (8 rows streamed together)
    w0, w1, w2, w3 = w[rows[j0]], w[rows[j0 + 1]], w[rows[j0 + 2]], w[rows[j0 + 3]]
    w4, w5, w6, w7 = w[rows[j0 + 4]], w[rows[j0 + 5]], w[rows[j0 + 6]], w[rows[j0 + 7]]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for d in range(x.shape[0]):
        xd = x[d]
        a0 += _widen(w0[d]) * xd
        a1 += _widen(w1[d]) * xd
        a2 += _widen(w2[d]) * xd
        a3 += _widen(w3[d]) * xd
        a4 += _widen(w4[d]) * xd
        a5 += _widen(w5[d]) * xd
        a6 += _widen(w6[d]) * xd
        a7 += _widen(w7[d]) * xd
    out[j0] = a0 * s[rows[j0]]
    out[j0 + 1] = a1 * s[rows[j0 + 1]]
    out[j0 + 2] = a2 * s[rows[j0 + 2]]
    out[j0 + 3] = a3 * s[rows[j0 + 3]]
    out[j0 + 4] = a4 * s[rows[j0 + 4]]
    out[j0 + 5] = a5 * s[rows[j0 + 5]]
    out[j0 + 6] = a6 * s[rows[j0 + 6]]
    out[j0 + 7] = a7 * s[rows[j0 + 7]]


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
    # out[j] = w[rows[j]] · x * s[rows[j]] for j in [lo, hi): blocks of 8, then the rest one by one
    j = lo
    while j + _BLOCK <= hi:
        _dot_block(w, s, rows, j, x, out)
        j += _BLOCK
    while j < hi:
        out[j] = _dot(w[rows[j]], x) * s[rows[j]]
        j += 1


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


@njit(nogil=True, fastmath=True, cache=True)
def _keep_active(z, rows, bias, use_bias, act):
    # Phase 2 of the one-token FFN kernels: of the selected rows [K] with pre-activations z [K] (+ bias
    # per matrix row when use_bias), the rows whose activation is not exactly 0 and those activations.
    K = rows.shape[0]
    keep = np.empty(K, np.int64)
    h = np.empty(K, np.float32)
    n = 0
    for j in range(K):
        v = z[j] + bias[rows[j]] if use_bias else z[j]
        a = _act(v, act)
        if a != 0.0:
            keep[n] = rows[j]
            h[n] = a
            n += 1
    return keep[:n], h[:n]


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
    keep, h = _keep_active(z, rows, bias, use_bias, act)
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
                        g = _act(_dot(gate[r], xt) * gs[r], act)
                        hv = g * (_dot(upr, xt) * us[r]) if g != 0.0 else np.float32(0.0)
                    else:
                        z = _dot(upr, xt) * us[r]
                        if use_bias:
                            z += bias[r]
                        hv = _act(z, act)
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
# Host matrices

_TILE = 128  # columns (and rows) per tile of gather_columns


@njit(parallel=True, nogil=True, cache=True)
def _gather_columns_kernel(src, cols, out):
    # src: [R, C], cols: [K], out: [K, R] = src[:, cols].T; tiles of _TILE columns x _TILE rows, so
    # that the strided reads of a tile's columns stay in cache while its rows are written
    R, K = src.shape[0], cols.shape[0]
    for b in prange((K + _TILE - 1) // _TILE):
        j0, j1 = b * _TILE, min(K, (b + 1) * _TILE)
        for r0 in range(0, R, _TILE):
            r1 = min(R, r0 + _TILE)
            for j in range(j0, j1):
                c = cols[j]
                for r in range(r0, r1):
                    out[j, r] = src[r, c]


def gather_columns(src: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """src[:, cols].T as a new contiguous CPU tensor [K, R] with huge pages advised (host_empty), in
    numba tiles: W_down [D, I] to cold rows [K, D]. torch's copy of a transposed float16 view read
    0.2-0.4 GB/s on the 2-core machine ([4096, 11008]: 206-373 ms), the tiles 1.5 GB/s (60 ms).
    src: contiguous [R, C] on the CPU, any 1-, 2-, 4- or 8-byte dtype; cols: int [K], each in 0..C-1."""
    if src.device.type != "cpu" or src.dim() != 2 or not src.is_contiguous():
        raise ValueError("src must be a contiguous 2-D CPU tensor")
    c = np.ascontiguousarray(cols.cpu().numpy(), dtype=np.int64)
    if c.ndim != 1 or (c.size and (c.min() < 0 or c.max() >= src.shape[1])):
        raise ValueError(f"cols must be a 1-D index into {src.shape[1]} columns")
    out = host_empty((c.size, src.shape[0]), src.dtype)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    if c.size:
        _gather_columns_kernel(src.detach().view(bits).numpy(), c, out.view(bits).numpy())
    return out


def quantize_i8(w: torch.Tensor, block_rows: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: returns (q int8 [N, D], scale float32 [N]) with w ≈ q * scale[:, None]."""
    w = w.detach().cpu()
    n, d = w.shape
    q = np.empty((n, d), np.int8)
    scale = np.empty(n, np.float32)
    for lo in range(0, n, block_rows):  # bounded temporary memory for big matrices
        b = w[lo:lo + block_rows].float()
        sc = b.abs().amax(dim=1) / 127.0
        inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
        q[lo:lo + block_rows] = (b * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8).numpy()
        scale[lo:lo + block_rows] = sc.numpy()
    return q, scale


class HostMatrix:
    """A row-major [N, D] matrix in host memory, kept for row-gathered access.

    data: float32 [N, D] | uint16 [N, D] holding fp16 or bf16 bits | int8 [N, D]
    kind: "f32" | "f16" | "bf16" | "i8"
    scale: float32 [N] per-row scale, only for "i8" (row ≈ data * scale)
    """

    def __init__(self, data: np.ndarray, kind: str, scale: np.ndarray | None = None):
        if kind not in _STORAGE:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if data.ndim != 2 or data.dtype != _STORAGE[kind] or not data.flags.c_contiguous:
            raise ValueError(f"{kind} data must be a C-contiguous 2-D {np.dtype(_STORAGE[kind])} array, "
                             f"got {data.dtype} {data.shape}")
        if (kind == "i8") != (scale is not None):
            raise ValueError("scale is required for kind 'i8' and only for it")
        if scale is not None and (scale.dtype != np.float32 or scale.shape != (data.shape[0],)):
            raise ValueError(f"scale must be float32 [{data.shape[0]}]")
        self.data, self.kind, self.scale = data, kind, scale
        self._w = data.view(np.int16) if kind == "f16" else data  # kernel dispatch type (see _widen)
        self._s = scale if scale is not None else np.ones(data.shape[0], np.float32)
        self._all_rows: np.ndarray | None = None

    @classmethod
    def from_torch(cls, t: torch.Tensor, kind: str | None = None) -> "HostMatrix":
        """From a 2-D tensor. kind None: from t.dtype; "i8": quantise per row; another kind converts.
        Shares memory with t when t is a contiguous CPU tensor of that dtype."""
        if t.dim() != 2:
            raise ValueError(f"expected a 2-D tensor, got shape {tuple(t.shape)}")
        t = t.detach()
        if kind is None:
            if t.dtype not in _FROM_DTYPE:
                raise ValueError(f"no kind for dtype {t.dtype}; pass kind=")
            kind = _FROM_DTYPE[t.dtype]
        if kind == "i8":
            q, scale = quantize_i8(t)
            return cls(q, "i8", scale)
        if kind not in _TO_DTYPE:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        t = t.to(device="cpu", dtype=_TO_DTYPE[kind]).contiguous()
        data = t.numpy() if kind == "f32" else t.view(torch.uint16).numpy()
        return cls(data, kind)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def row_bytes(self) -> int:
        """Bytes a kernel reads per selected row."""
        return self.data.shape[1] * self.data.itemsize

    def to_torch(self) -> torch.Tensor:
        """Dequantised float32 [N, D] copy (for tests / references)."""
        if self.kind == "f32":
            return torch.from_numpy(self.data.copy())
        if self.kind == "i8":
            return torch.from_numpy(self.data).float() * torch.from_numpy(self.scale)[:, None]
        bits = torch.from_numpy(self.data.view(np.int16))
        return bits.view(_TO_DTYPE[self.kind]).float()

    def __repr__(self) -> str:
        return f"HostMatrix({self.kind}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB)"


# ---------------------------------------------------------------------------------------------
# Python entry points

def set_threads(n: int) -> None:
    """numba.set_num_threads, clamped to [1, NUMBA_NUM_THREADS]. Thread-local: call it in the thread
    that runs the kernels (a new thread starts with NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def get_threads() -> int:
    """numba's thread count for the calling thread."""
    return numba.get_num_threads()


def _as_rows(rows: np.ndarray, n: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # int32 is widened (one small copy)
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    if not _rows_in_range(rows, n):
        raise IndexError(f"row index out of range [0, {n})")
    return rows


def _as_f32(a: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a


def _check_out(out: np.ndarray, shape: tuple) -> np.ndarray:
    if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    return out


def _quant(m) -> bool:
    """Whether m holds GGUF blocks (sparse_ops.quant.QuantMatrix): the entry points below hand those
    to quant's kernels, so callers use one API for both storages."""
    return type(m).__name__ == "QuantMatrix"


def gemv_rows(m: HostMatrix, rows: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out[j] = m[rows[j]] · x. rows int [K]; x float32 [D]; returns out float32 [K] (overwritten)."""
    if _quant(m):
        from hotcold.sparse_ops.quant import qgemv_rows

        return qgemv_rows(m, rows, x, out)
    n, d = m.shape
    rows = _as_rows(rows, n)
    x = _as_f32(x, (d,), "x")
    out = np.empty(rows.shape[0], np.float32) if out is None else _check_out(out, rows.shape)
    if rows.shape[0]:
        _gemv_rows_kernel(m._w, m._s, rows, x, out)
    return out


def gemv(m: HostMatrix, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Dense out = m @ x over all N rows (for CPU-placed dense layers). x [D] -> out [N]."""
    if _quant(m):
        from hotcold.sparse_ops.quant import qgemv

        return qgemv(m, x, out)
    if m._all_rows is None:
        m._all_rows = np.arange(m.shape[0], dtype=np.int64)
    return gemv_rows(m, m._all_rows, x, out)


def axpy_rows(m: HostMatrix, rows: np.ndarray, coeff: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[D] += sum_j coeff[j] * m[rows[j]]  (down projection with m = W_down transposed, [I, D])."""
    if _quant(m):
        from hotcold.sparse_ops.quant import qaxpy_rows

        return qaxpy_rows(m, rows, coeff, out)
    n, d = m.shape
    rows = _as_rows(rows, n)
    coeff = _as_f32(coeff, rows.shape, "coeff")
    _check_out(out, (d,))
    k = rows.shape[0]
    if k:
        _axpy_rows_kernel(m._w, m._s, rows, coeff, min(get_threads(), k), out)
    return out


_NO_BIAS = np.zeros(1, np.float32)


def batch_input(X: np.ndarray, d: int, act: str) -> np.ndarray:
    """Check a batched FFN call's activation name and tokens X [T, d] (ValueError); X as contiguous float32."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    return X


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
    if _quant(up):
        from hotcold.sparse_ops.quant import qffn_rows, qffn_rows_batch

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
    rows = _as_rows(rows, n)
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


# ---------------------------------------------------------------------------------------------
# Selection helpers (numpy, for the executor's CPU side)

def mask_to_rows(mask: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """Sorted int64 positions of the set entries of mask [N], or of mask[idx] when idx is given
    (positions into a matrix compacted to the rows idx)."""
    m = np.asarray(mask)
    return np.flatnonzero(m if idx is None else m[idx])


def index_map(idx: np.ndarray, n: int) -> np.ndarray:
    """int32 [n]: position of each neuron in idx, -1 for neurons not in idx."""
    pos = np.full(n, -1, np.int32)
    pos[np.asarray(idx)] = np.arange(len(idx), dtype=np.int32)
    return pos


def split_rows(rows: np.ndarray, hot_map: np.ndarray,
               cold_map: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split selected neurons rows [K] into (hot, cold) with hot_map = index_map(hot_idx, N).

    hot: int64 positions in the GPU-compacted arrays. cold: int64 neuron indices not on the GPU,
    or their positions in a CPU-compacted matrix when cold_map = index_map(cold_idx, N) is given.
    Order follows rows.
    """
    rows = np.asarray(rows, dtype=np.int64)
    hp = hot_map[rows]
    is_hot = hp >= 0
    cold = rows[~is_hot]
    if cold_map is not None:
        cold = cold_map[cold].astype(np.int64)
        if cold.size and cold.min() < 0:
            raise ValueError("a selected neuron is in neither hot_map nor cold_map")
    return hp[is_hot].astype(np.int64), cold
