"""Input-sparse GEMV (TEAL): y = W s(x), where s(x) zeroes the entries of x with |x| <= threshold,
reading only the weights of the input channels that survive.

A row-major matrix (GGUF blocks, or float rows) stores each input channel's weights strided across
every row, so skipping a channel skips no bytes. `InputMajor` holds the matrix input-major instead:
channel j's weights for all R rows are one contiguous run, and a token whose input keeps a fraction
k of the channels reads about k of the weight bytes:

  kind F32 / F16   W^T as float32 [C, R] / fp16 bits [C, R] (as int16)
  kind Q4 / Q8     4- or 8-bit codes [C, R/2] / [C, R] (uint8) with, per block of 32 input channels
                   and row, a scale d and offset m (fp16 bits, [C/32, R] each): w = d * code + m.

The code form is exact for the GGUF types whose blocks are 32 channels with fp16 scales: Q4_1 (d, m
as stored), Q4_0 (code = nibble, m = -8 d) and Q8_0 (code = q + 128, m = -128 d): every weight is the
one the file holds, so a thresholded product differs from the dense product of the thresholded input
only by float32 summation order. For 4-bit codes byte k of a channel's run holds row k (low nibble)
and row k + R/2 (high nibble), so both halves unpack into contiguous rows. The scales cost one bit
per weight (read for every block with a surviving channel); the codes 4 (Q4) or 8 (Q8) bits per
surviving weight. Other types (Q5_0, the K-quants, bf16) have no input-major form here: their
inputs are still thresholded, multiplied dense (see executors/input_sparse.py).

Q4_0 / Q4_1 matrices (Q8_0 on request) are held instead, where the CPU has AVX-512 VNNI, in the
integer layout of sparse_ops/input_sparse_int.py (kinds QI4_1, QI4_0, QI8_0): the same codes and
scales in 128-row tiles, the kept input quantised to int8 per 32-block as the dense kernels quantise
theirs, and integer dot products four channels at a time, 2-3x the float32 kinds' speed
(tools/bench_input_sparse.py), so that the sparse product pays at the sparsities TEAL reaches.

The float32 kernel (`im_gemv` of the other kinds) selects the surviving channels once, then splits the rows between numba's
threads; each accumulates code * x over a block's surviving channels in float32 and applies the
block's d and m once (m times the sum of those inputs). A counter [surviving, total] per matrix
records the sparsity achieved.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from hotcold.sparse_ops.cpu import _widen, get_threads
from hotcold.sparse_ops.quant import qgemv_rows_kernel, qgemv_x8_kernel
from hotcold.sparse_ops.input_sparse_int import OFFSET, TILE, int_prep, int_task, pack_int, unpack_int
from hotcold.sparse_ops.input_sparse_int import Q4_0 as INT_Q4_0, Q4_1 as INT_Q4_1, Q8_0 as INT_Q8_0
from hotcold.sparse_ops.input_sparse_int import available as int_available

__all__ = ["InputMajor", "im_gemv", "input_major", "KINDS", "sparse_linear_torch", "im_repeat", "qdense_repeat"]

F32, F16, Q4, Q8 = 0, 1, 2, 3
QI4_1, QI4_0, QI8_0 = 4 + INT_Q4_1, 4 + INT_Q4_0, 4 + INT_Q8_0  # the integer kinds: 4 + int_task's format
KINDS = {"f32": F32, "f16": F16, "q4": Q4, "q8": Q8, "qi4_1": QI4_1, "qi4_0": QI4_0, "qi8_0": QI8_0}
_INT_KINDS = {"Q4_1": QI4_1, "Q4_0": QI4_0, "Q8_0": QI8_0}
BLOCK = 32  # input channels per scale block of the code kinds
_CHUNK = 256  # rows (4-bit: row pairs) per parallel task, at least: the inner loops run over a task's rows,
# and short ones cost more than they save (4096 x 4096 Q4_1, 1 thread: 128-row tasks ran 2x slower than one)
_NONE_F32 = np.zeros((1, 1), np.float32)
_NONE_I16 = np.zeros((1, 1), np.int16)
_NONE_U8 = np.zeros((1, 1), np.uint8)
for _a in (_NONE_F32, _NONE_I16, _NONE_U8):
    _a.setflags(write=False)


class InputMajor:
    """One matrix W [R, C] held input-major for `im_gemv`, with its input threshold.

    kind: F32 | F16 | Q4 | Q8; wf [C, R] float32 (F32); wh [C, R] int16 fp16 bits (F16); codes [C, R/2 or R]
    uint8, d, m [C/32, R] int16 fp16 bits (Q4, Q8); the unused arrays are 1x1 placeholders.
    threshold: inputs with |x| <= threshold are skipped (0: only exact zeros).
    threads: the tasks the kernel splits the rows into, at most (default: numba's thread count now).
    counter: int64 [2], (channels kept, channels seen) summed over the calls."""

    def __init__(self, kind: int, rows: int, cols: int, threshold: float, wf=_NONE_F32, wh=_NONE_I16,
                 codes=_NONE_U8, d=_NONE_I16, m=_NONE_I16, threads: int | None = None):
        if kind == Q4 and rows % 2:
            raise ValueError(f"4-bit input-major codes need an even row count, got {rows}")
        if kind in (Q4, Q8, QI4_1, QI4_0, QI8_0) and cols % BLOCK:
            raise ValueError(f"code kinds need cols to be a multiple of {BLOCK}, got {cols}")
        self.kind, self.rows, self.cols = kind, rows, cols
        self.threshold = np.float32(threshold)
        self.wf, self.wh, self.codes, self.d, self.m = wf, wh, codes, d, m
        for a in (wf, wh, codes, d, m):  # read-only, as a cached copy's mapped views are: the kernels
            a.setflags(write=False)  # compile for one kind of array
        self.counter = np.zeros(2, np.int64)
        span = rows // 2 if kind == Q4 else rows  # the kernel splits rows (4-bit: row pairs) into tasks
        if kind >= QI4_1:  # 128-row tiles (sparse_ops/input_sparse_int.py)
            span = -(-rows // TILE) * TILE // 2
        self.tasks = max(1, min(threads or get_threads(), span // _CHUNK))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.wf, self.wh, self.codes, self.d, self.m) if a.size > 1)

    def args(self) -> tuple:
        """The kernel's arguments after x and out (cpu_step carries them in a matrix's tuple)."""
        return (self.kind, self.threshold, self.wf, self.wh, self.codes, self.d, self.m, self.counter, self.tasks)

    def dense(self) -> np.ndarray:
        """float32 [R, C]: the weights it holds, row-major (for tests and references)."""
        if self.kind == F32:
            return self.wf.T.copy()
        if self.kind == F16:
            return self.wh.view(np.float16).astype(np.float32).T.copy()
        if self.kind >= QI4_1:
            q = unpack_int(self.codes, self.rows, self.kind != QI8_0).T.astype(np.float32)  # [C, R]
            d = np.repeat(self.d.view(np.float16)[:, :self.rows].astype(np.float32), BLOCK, axis=0)
            if self.kind == QI4_1:
                m = np.repeat(self.m.view(np.float16)[:, :self.rows].astype(np.float32), BLOCK, axis=0)
            else:  # the file's -8 d / -128 d, rounded to fp16 as _blocks rounds them
                m = (d * OFFSET[self.kind - 4]).astype(np.float16).astype(np.float32)
            return (d * q + m).T.copy()
        if self.kind == Q4:
            lo, hi = self.codes & 15, self.codes >> 4
            q = np.concatenate([lo, hi], axis=1).astype(np.float32)  # [C, R]
        else:
            q = self.codes.astype(np.float32)
        d = np.repeat(self.d.view(np.float16).astype(np.float32), BLOCK, axis=0)
        m = np.repeat(self.m.view(np.float16).astype(np.float32), BLOCK, axis=0)
        return (d * q + m).T.copy()

    def __repr__(self) -> str:
        name = {v: k for k, v in KINDS.items()}[self.kind]
        return f"InputMajor({name}, {self.rows}x{self.cols}, threshold={float(self.threshold):.4g})"


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.astype(np.float16)).view(np.int16)


def _blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF rows uint8 [R, nb * bytes] of a 32-channel type -> (codes uint8 [R, C], d, m float16 [R, nb])."""
    nb = cols // BLOCK
    if qtype == "Q8_0":
        b = raw.reshape(rows, nb, 34)
        d = b[:, :, :2].copy().view(np.float16)[..., 0]
        q = b[:, :, 2:].view(np.int8).astype(np.int16) + 128
        return q.reshape(rows, cols).astype(np.uint8), d, (d.astype(np.float32) * -128).astype(np.float16)
    size, off = (18, 2) if qtype == "Q4_0" else (20, 4)
    b = raw.reshape(rows, nb, size)
    d = b[:, :, :2].copy().view(np.float16)[..., 0]
    m = (d.astype(np.float32) * -8).astype(np.float16) if qtype == "Q4_0" else b[:, :, 2:4].copy().view(np.float16)[..., 0]
    qs = b[:, :, off:]  # [R, nb, 16]: element i < 16 the low nibble of qs[i], else the high nibble of qs[i - 16]
    q = np.concatenate([qs & 15, qs >> 4], axis=2)  # [R, nb, 32]
    return q.reshape(rows, cols), d, m


CODE_TYPES = {"Q4_0": Q4, "Q4_1": Q4, "Q8_0": Q8}


def input_major(w, threshold: float, integer: bool | None = None) -> InputMajor | None:
    """W (a QuantMatrix, or a float32/float16 [R, C] tensor or array) input-major, or None where it has
    no exact input-major form here (other GGUF types, bfloat16, an odd row count with 4-bit float codes).
    integer: for the code types, the integer kinds (sparse_ops/input_sparse_int.py: x quantised to int8
    per 32-block) rather than the float32 ones. None: where the CPU has AVX-512 VNNI and the dense
    kernel of w quantises x too (Q4_0 / Q4_1, `formats.XQ_DEFAULT`, or an interleaved matrix), so
    that both products round x alike; Q8_0 rows keep float x (int8 x would add ~40% to its error)."""
    from hotcold.sparse_ops.quant import QuantMatrix

    if isinstance(w, QuantMatrix):
        kind = CODE_TYPES.get(w.qtype)
        if kind is None:
            return None
        if integer is None:
            from hotcold.sparse_ops.quant.formats import XQ_DEFAULT

            integer = int_available() and (w.qtype in XQ_DEFAULT or bool(w.interleaved))
        if integer:
            q, d, m = _blocks(np.ascontiguousarray(w.row_data()), w.qtype, w.rows, w.cols)
            codes, db, mb = pack_int(q, d, m, kind == Q4)
            ik = _INT_KINDS[w.qtype]
            return InputMajor(ik, w.rows, w.cols, threshold, codes=codes, d=db, m=mb if ik == QI4_1 else _NONE_I16)
        if kind == Q4 and w.rows % 2:
            return None
        q, d, m = _blocks(np.ascontiguousarray(w.row_data()), w.qtype, w.rows, w.cols)
        qt = np.ascontiguousarray(q.T)  # [C, R]
        if kind == Q4:
            half = w.rows // 2
            qt = np.ascontiguousarray(qt[:, :half] | (qt[:, half:] << 4))
        return InputMajor(kind, w.rows, w.cols, threshold, codes=qt, d=_f16_bits(d.T), m=_f16_bits(m.T))
    t = torch.as_tensor(w).detach().cpu()
    if t.dim() != 2 or t.dtype not in (torch.float32, torch.float16):
        return None
    rows, cols = t.shape
    if t.dtype == torch.float32:
        return InputMajor(F32, rows, cols, threshold, wf=np.ascontiguousarray(t.T.numpy()))
    return InputMajor(F16, rows, cols, threshold, wh=np.ascontiguousarray(t.T.numpy()).view(np.int16))


@njit(nogil=True, fastmath=True, cache=True)
def _select(x, thr, idx):
    # indices of x's entries with |x| > thr into idx; returns how many
    n = 0
    for j in range(x.shape[0]):
        if abs(x[j]) > thr:
            idx[n] = j
            n += 1
    return n


_SPAN = dict(nogil=True, fastmath=True, cache=True, error_model="numpy")  # numpy's error model: the inner
# loops vectorise (with python's, numba kept them scalar: 4-5x slower)


@njit(**_SPAN)
def _float_span(w, x, idx, n, lo, hi, out):
    # out[lo:hi] = sum over the n selected channels j of x[j] * w[j, lo:hi] (w: float32 or fp16 bits);
    # four channels per pass over the accumulators (a quarter of their loads and stores)
    k = hi - lo
    acc = np.zeros(k, np.float32)
    p = 0
    while p + 4 <= n:
        x0, x1, x2, x3 = x[idx[p]], x[idx[p + 1]], x[idx[p + 2]], x[idx[p + 3]]
        w0, w1, w2, w3 = w[idx[p], lo:hi], w[idx[p + 1], lo:hi], w[idx[p + 2], lo:hi], w[idx[p + 3], lo:hi]
        for i in range(k):
            acc[i] += x0 * _widen(w0[i]) + x1 * _widen(w1[i]) + x2 * _widen(w2[i]) + x3 * _widen(w3[i])
        p += 4
    while p < n:
        xj, wj = x[idx[p]], w[idx[p], lo:hi]
        for i in range(k):
            acc[i] += xj * _widen(wj[i])
        p += 1
    out[lo:hi] = acc


@njit(**_SPAN)
def _code_span(nibbles, codes, d, m, x, idx, n, lo, hi, out):
    # rows lo..hi of out (for nibbles: rows lo..hi and lo+R/2..hi+R/2, lo/hi counting row pairs)
    k = hi - lo
    half = codes.shape[1] if nibbles else 0
    acc = np.zeros(k, np.float32)  # the block's sums of code * x (nibbles: low nibbles' rows)
    acc2 = np.zeros(k, np.float32)  # (nibbles: high nibbles' rows)
    res = np.zeros(k, np.float32)
    res2 = np.zeros(k, np.float32)
    f15 = np.uint8(15)
    p = 0
    while p < n:
        b = idx[p] // 32
        sx = np.float32(0.0)
        e = p  # the block's selected channels are idx[p:e]
        while e < n and idx[e] // 32 == b:
            sx += x[idx[e]]
            e += 1
        acc[:] = 0.0
        acc2[:] = 0.0
        while p + 4 <= e:  # four channels per pass over the accumulators
            x0, x1, x2, x3 = x[idx[p]], x[idx[p + 1]], x[idx[p + 2]], x[idx[p + 3]]
            c0, c1 = codes[idx[p], lo:hi], codes[idx[p + 1], lo:hi]
            c2, c3 = codes[idx[p + 2], lo:hi], codes[idx[p + 3], lo:hi]
            if nibbles:
                for i in range(k):
                    acc[i] += (x0 * np.float32(c0[i] & f15) + x1 * np.float32(c1[i] & f15)
                               + x2 * np.float32(c2[i] & f15) + x3 * np.float32(c3[i] & f15))
                for i in range(k):
                    acc2[i] += (x0 * np.float32(c0[i] >> 4) + x1 * np.float32(c1[i] >> 4)
                                + x2 * np.float32(c2[i] >> 4) + x3 * np.float32(c3[i] >> 4))
            else:
                for i in range(k):
                    acc[i] += (x0 * np.float32(c0[i]) + x1 * np.float32(c1[i])
                               + x2 * np.float32(c2[i]) + x3 * np.float32(c3[i]))
            p += 4
        while p < e:
            xj, cj = x[idx[p]], codes[idx[p], lo:hi]
            if nibbles:
                for i in range(k):
                    acc[i] += xj * np.float32(cj[i] & f15)
                for i in range(k):
                    acc2[i] += xj * np.float32(cj[i] >> 4)
            else:
                for i in range(k):
                    acc[i] += xj * np.float32(cj[i])
            p += 1
        db, mb = d[b, lo:hi], m[b, lo:hi]
        for i in range(k):
            res[i] += _widen(db[i]) * acc[i] + _widen(mb[i]) * sx
        if nibbles:
            db, mb = d[b, half + lo:half + hi], m[b, half + lo:half + hi]
            for i in range(k):
                res2[i] += _widen(db[i]) * acc2[i] + _widen(mb[i]) * sx
    out[lo:hi] = res
    if nibbles:
        out[half + lo:half + hi] = res2


@njit(parallel=True, nogil=True, fastmath=True, cache=True, error_model="numpy")
def im_kernel(x, out, kind, thr, wf, wh, codes, d, m, counter, tasks):
    """out = W s(x) for an InputMajor's arguments (see InputMajor.args). x float32 [C]; out float32 [R]."""
    C = x.shape[0]
    R = out.shape[0]
    if kind >= QI4_1:
        nb = C // 32
        qidx, qxb = np.empty(C, np.int64), np.empty(C, np.int8)
        bstart, bid, bxs = np.empty(nb + 1, np.int64), np.empty(nb, np.int64), np.empty(2 * nb, np.float32)
        n, nkb = int_prep(x, thr, qidx, qxb, bstart, bid, bxs)
        counter[0] += n
        counter[1] += C
        facc = np.zeros(d.shape[1], np.float32)
        tiles = d.shape[1] // TILE
        if tasks == 1:  # no parallel region: its launch costs microseconds, a small matrix's whole product
            int_task(kind - 4, codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, 0, tiles, facc)
        else:
            for t in prange(tasks):
                int_task(kind - 4, codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, tiles * t // tasks,
                         tiles * (t + 1) // tasks, facc)
        out[:] = facc[:R]
        return
    idx = np.empty(C, np.int64)
    n = _select(x, thr, idx)
    counter[0] += n
    counter[1] += C
    span = R // 2 if kind == Q4 else R  # the parallel loop's range: rows, or row pairs
    for t in prange(tasks):
        lo, hi = span * t // tasks, span * (t + 1) // tasks
        if kind == F32:
            _float_span(wf, x, idx, n, lo, hi, out)
        elif kind == F16:
            _float_span(wh, x, idx, n, lo, hi, out)
        else:
            _code_span(kind == Q4, codes, d, m, x, idx, n, lo, hi, out)


@njit(nogil=True, cache=True)
def im_repeat(n, x, out, kind, thr, wf, wh, codes, d, m, counter, tasks):
    """n calls of im_kernel in one jitted loop (for timing it as decode calls it, without Python's dispatch)."""
    for _ in range(n):
        im_kernel(x, out, kind, thr, wf, wh, codes, d, m, counter, tasks)


@njit(nogil=True, cache=True)
def qdense_repeat(n, qt, interleaved, xq, data, rows, x, out):
    """n dense products of a QuantMatrix's arguments as the fused step calls them (models/cpu_step.py _gemv)."""
    for _ in range(n):
        if interleaved:
            qgemv_x8_kernel(qt, data, x, out)
        else:
            qgemv_rows_kernel(qt, data, rows, x, xq, out)


def im_gemv(im: InputMajor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out = W s(x): x float32 [C] -> out float32 [R], reading only the surviving channels' weights."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    if x.shape[0] != im.cols:
        raise ValueError(f"x has {x.shape[0]} entries; the matrix has {im.cols} columns")
    if out is None:
        out = np.empty(im.rows, np.float32)
    elif out.shape != (im.rows,) or out.dtype != np.float32:
        raise ValueError(f"out must be float32 [{im.rows}]")
    im_kernel(x, out, *im.args())
    return out


def sparse_linear_torch(x: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """The torch form of an input-sparse product for any device (the GPU's reference path): W's columns
    of the inputs above threshold times those inputs. x [C] (one token), w [R, C] -> [R] in x's dtype."""
    keep = (x.abs() > threshold).nonzero()[:, 0]
    return w.index_select(1, keep) @ x.index_select(0, keep).to(w.dtype)
