"""Integer input-major GEMV for the 32-block quantised types (Q4_0, Q4_1, Q8_0): the thresholded input
quantised to int8 once per 32-block, as the dense kernels quantise theirs, and dotted with the kept
channels' codes by AVX-512 VNNI (vpdpbusd), four channels at a time.

Layout (`pack_int`), input-major like sparse_ops/input_sparse.py's code kinds, rows padded to a
multiple of 128 (a tile) with zero codes and zero scales:

  codes  uint8 [C, Rp/2] (4-bit) or [C, Rp] (8-bit): channel j's codes for every row, one run per
         channel, so a dropped channel's bytes are never read. Per tile, 64 bytes of a 4-bit run hold
         128 rows (low nibble: rows 0-63 of the tile, high nibble: rows 64-127); 8-bit runs take two
         64-byte chunks. Within a 64-byte chunk the rows are permuted (`ROW_OF_BYTE`) so that the
         byte interleave of four channels' chunks (vpunpck{l,h}bw, then {l,h}wd: four vectors of
         16 rows x 4 channels) lands rows in order: vector k, lane l is row 16 k + l.
  d, m   fp16 bits int16 [C/32, Rp]: per input block and row, w = d * code + m, the file's weights
         exactly; m only for Q4_1: Q4_0's is -8 d and Q8_0's (code = q + 128) -128 d, applied as
         constants (the scales then cost half a bit per weight, as in the file, instead of one).

Per call the kept channels (|x| > threshold) of each 32-block are quantised with the block's
dx = max |x kept| / 127 (the dense kernels' dx of the thresholded input: the dropped entries are the
smallest) and grouped in fours, the last padded with a zero activation (`int_prep`). A task walks
its tiles; per tile and kept block the four-channel groups are interleaved and dotted (vpdpbusd)
into 8 int32 accumulators of 16 rows held in registers, then scaled into float32:
out += d dx acc + m dx sum(xq). A block with no kept channel costs nothing; one with some reads its
kept channels' codes and the block's scales. The integer sums are exact: the product differs from
the dense integer kernel's on the thresholded input only by float32 summation order.

Granularity: TEAL's design (input-major, a column per input channel) rather than the GGUF rows
grouped by input block. At 20-50% sparsity a 32-channel block whose every input is dropped is rare
(independent channels: 0.5^32), so a block-grouped row layout would read nearly every byte; the
column layout reads the kept channels' bytes alone, at the cost of the interleave (8 byte/word
unpacks per four channels and 128 rows) and of padding each block's kept channels to a multiple of four.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from hotcold.sparse_ops.quant.activations import _quantize_span
from hotcold.sparse_ops.quant.vector import _F32, _FAST, _I8, _I16, _I32, _I64, _VNNI, _load, _shuffle, _splat, _vconst

__all__ = ["OFFSET", "ROW_OF_BYTE", "TILE", "available", "pack_int", "unpack_int", "int_prep", "int_task"]

TILE = 128  # rows per tile (8 int32 vectors of 16 lanes)
PREFETCH_TILES = 8  # a kept channel's bytes this many tiles ahead are prefetched while a tile is dotted


def _row_of_byte() -> np.ndarray:
    # byte P of a 64-byte chunk holds row 16 k + 4 q + i of the chunk's 64 rows, where P = 16 q + 4 k + i:
    # after the two-level unpack of four chunks, int32 lane 4 q + i of vector k comes from byte 16 q + 4 k + i
    p = np.arange(64)
    q, k, i = p // 16, (p % 16) // 4, p % 4
    return (16 * k + 4 * q + i).astype(np.int64)


ROW_OF_BYTE = _row_of_byte()


def available() -> bool:
    """Whether this CPU runs the kernel (AVX-512 VNNI, with numba compiling for this CPU)."""
    return bool(_VNNI)


def pack_int(q: np.ndarray, d: np.ndarray, m: np.ndarray, nibbles: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes uint8 [R, C] (4-bit: < 16), d, m float16 [R, C/32] -> (codes, d bits, m bits) in the layout above."""
    rows, cols = q.shape
    rp = -(-rows // TILE) * TILE
    t = np.zeros((cols, rp), np.uint8)
    t[:, :rows] = q.T
    t = t.reshape(cols, rp // TILE, TILE)
    if nibbles:
        codes = t[:, :, :64][:, :, ROW_OF_BYTE] | (t[:, :, 64:][:, :, ROW_OF_BYTE] << 4)
    else:
        codes = t.reshape(cols, rp // TILE, 2, 64)[..., ROW_OF_BYTE]
    sd, sm = (np.zeros((cols // 32, rp), np.float16) for _ in range(2))
    sd[:, :rows], sm[:, :rows] = d.T, m.T
    return (np.ascontiguousarray(codes.reshape(cols, -1)), sd.view(np.int16), sm.view(np.int16))


def unpack_int(codes: np.ndarray, rows: int, nibbles: bool) -> np.ndarray:
    """The inverse of pack_int's codes: uint8 [R, C] (for tests and references)."""
    cols = codes.shape[0]
    if nibbles:
        c = codes.reshape(cols, -1, 64)
        t = np.empty((cols, c.shape[1], TILE), np.uint8)
        t[:, :, ROW_OF_BYTE], t[:, :, 64 + ROW_OF_BYTE] = c & 15, c >> 4
    else:
        c = codes.reshape(cols, -1, 2, 64)
        t = np.empty_like(c)
        t[..., ROW_OF_BYTE] = c
    return np.ascontiguousarray(t.reshape(cols, -1)[:, :rows].T)


@njit(nogil=True, fastmath=True, cache=True)
def int_prep(x, thr, qidx, qxb, bstart, bid, bxs):
    """The kept channels of x (|x| > thr) per 32-block, quantised as the dense kernels quantise the
    thresholded input (`_quantize_span`, the same compiled code: bit for bit their int8 values and
    scales): qidx int64 [C] the channels in fours (a block's last four padded with its last kept
    channel), qxb int8 [C] their int8 values (padding 0), bstart int64 [C/32 + 1] each kept block's
    first four, bid int64 [C/32] the kept blocks, bxs float32 [C/16] (dx, dx * sum of xq) per kept
    block. Returns (channels kept, kept blocks)."""
    C = x.shape[0]
    xs = np.empty(C, np.float32)
    for j in range(C):
        xs[j] = x[j] if abs(x[j]) > thr else np.float32(0.0)
    xq = np.empty(C, np.int8)
    xd = np.empty(C // 16, np.float32)
    _quantize_span(xs, 0, C, xq, xd)
    kept = 0
    nq = 0
    nkb = 0
    for b in range(C // 32):
        pos0 = 4 * nq  # <= 32 b: each earlier block took at most 32 slots, so pos stays < C
        pos = pos0
        for l in range(32):  # branch-free compaction: every entry written, only the kept ones advance
            j = 32 * b + l
            qidx[pos] = j
            qxb[pos] = xq[j]
            pos += abs(x[j]) > thr
        if pos == pos0:
            continue
        kept += pos - pos0
        last = qidx[pos - 1]
        while (pos - pos0) % 4:
            qidx[pos] = last
            qxb[pos] = 0
            pos += 1
        bid[nkb] = b
        bstart[nkb] = nq
        bxs[2 * nkb] = xd[2 * b]
        bxs[2 * nkb + 1] = xd[2 * b + 1]
        nq = pos // 4
        nkb += 1
    bstart[nkb] = nq
    return kept, nkb


def _data(context, bd, ty, val):
    a = context.make_array(ty)(context, bd, val)
    return a, bd.bitcast(a.data, ir.PointerType(_I8))


def _interleave4(bd, a, b, c, d):
    # four <64 x i8> chunks -> four <64 x i8> vectors: vector k's int32 lane 4 q + i holds byte
    # 16 q + 4 k + i of a, b, c, d (in that byte order): vpunpck{l,h}bw then vpunpck{l,h}wd per 128-bit lane
    def bytes_(x, y, hi):
        return _shuffle(bd, x, [n + 16 * q + 8 * hi + i for q in range(4) for i in range(8) for n in (0, 64)], y)

    def words(x, y, hi):
        w = ir.VectorType(_I16, 32)
        r = _shuffle(bd, bd.bitcast(x, w), [n + 8 * q + 4 * hi + i for q in range(4) for i in range(4) for n in (0, 32)],
                     bd.bitcast(y, w))
        return bd.bitcast(r, ir.VectorType(_I8, 64))

    ab, cd = [bytes_(a, b, h) for h in (0, 1)], [bytes_(c, d, h) for h in (0, 1)]
    return [words(ab[0], cd[0], 0), words(ab[0], cd[0], 1), words(ab[1], cd[1], 0), words(ab[1], cd[1], 1)]


def _prefetch_line(bd, ptr):
    # the 64-byte line at ptr into the L2 cache (prefetcht1)
    f = bd.module.declare_intrinsic("llvm.prefetch", [ir.PointerType(_I8)],
                                    fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8), _I32, _I32, _I32]))
    bd.call(f, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


def _fma(bd, a, b, c):
    name = f"llvm.fma.v{a.type.count}f32"
    f = bd.module.globals.get(name) or ir.Function(bd.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return bd.call(f, [a, b, c])


def _dpbusd(bd, acc, q, xq):
    t = ir.VectorType(_I32, 16)
    f = bd.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(t, [t] * 3))
    return bd.call(f, [acc, bd.bitcast(q, t), bd.bitcast(xq, t)])


def _make_task(nibbles: bool, offset: int | None):
    """Intrinsic (codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc): facc[rows of tiles t0..t1]
    += the kept blocks' products (see the module docstring). offset: m = offset * d (Q4_0: -8, Q8_0:
    -128; m is not read), None: m as stored (Q4_1). Per tile and kept block the 8 accumulators of its
    128 rows stay in registers while the block's fours are dotted, then are scaled into facc."""

    def task(typingctx, codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc):
        def codegen(context, bd, sig, args):
            ca, cp = _data(context, bd, sig.args[0], args[0])
            cs = bd.extract_value(ca.strides, 0)
            da, dp = _data(context, bd, sig.args[1], args[1])
            ds = bd.extract_value(da.strides, 0)
            mp = _data(context, bd, sig.args[2], args[2])[1] if offset is None else None
            ptr = [context.make_array(sig.args[i])(context, bd, args[i]).data for i in range(3, 8)]
            qip, qxp, bsp, bip, bxp = ptr
            fp = context.make_array(sig.args[11])(context, bd, args[11]).data
            nkb_, t0_, t1_ = args[8], args[9], args[10]
            tile_bytes = 64 if nibbles else 128
            v16i, v16f, v16h = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16), ir.VectorType(ir.HalfType(), 16)
            one = ir.Constant(_I64, 1)
            accs = [cgutils.alloca_once(bd, v16i) for _ in range(8)]
            with cgutils.for_range(bd, nkb_) as lb:
                kb = lb.index
                b = bd.load(bd.gep(bip, [kb]))
                q0, q1 = bd.load(bd.gep(bsp, [kb])), bd.load(bd.gep(bsp, [bd.add(kb, one)]))
                k2 = bd.mul(kb, ir.Constant(_I64, 2))
                dx = _splat(bd, bd.load(bd.gep(bxp, [k2])), 16)
                sx = bd.load(bd.gep(bxp, [bd.add(k2, one)]))
                sx = _splat(bd, sx if offset is None else bd.fmul(sx, ir.Constant(_F32, float(offset))), 16)
                drow = bd.gep(dp, [bd.mul(b, ds)])
                mrow = bd.gep(mp, [bd.mul(b, ds)]) if offset is None else None
                with cgutils.for_range_slice(bd, t0_, t1_, one) as (t, _):
                    for a in accs:
                        bd.store(_vconst(_I32, 16, 0), a)
                    base = bd.mul(t, ir.Constant(_I64, tile_bytes))
                    # prefetch what this loop reads PREFETCH_TILES tiles later: this block's kept
                    # channels at tile t + PREFETCH_TILES, or past the task's last tile the next kept
                    # block's at its first tiles (a short task's streams would start cold every block)
                    pt = bd.add(t, ir.Constant(_I64, PREFETCH_TILES))
                    here = bd.icmp_signed("<", pt, t1_)
                    has_next = bd.icmp_signed("<", bd.add(kb, one), nkb_)
                    pk = bd.select(here, kb, bd.select(has_next, bd.add(kb, one), kb))
                    ptile = bd.select(here, pt, bd.add(t0_, bd.sub(pt, t1_)))
                    pq0 = bd.load(bd.gep(bsp, [pk]))
                    pq1 = bd.select(bd.or_(here, has_next), bd.load(bd.gep(bsp, [bd.add(pk, one)])), pq0)
                    pbase = bd.mul(ptile, ir.Constant(_I64, tile_bytes))
                    pb = bd.load(bd.gep(bip, [pk]))
                    for sp_ in (dp, mp) if offset is None else (dp,):
                        srow = bd.gep(sp_, [bd.add(bd.mul(pb, ds), bd.mul(ptile, ir.Constant(_I64, 256)))])
                        for h in range(4):  # the tile's 128 scales
                            _prefetch_line(bd, bd.gep(srow, [ir.Constant(_I64, 64 * h)]))
                    with cgutils.for_range_slice(bd, pq0, pq1, one) as (pqi, _):
                        pq4 = bd.mul(pqi, ir.Constant(_I64, 4))
                        for c in range(4):
                            ch = bd.gep(cp, [bd.mul(bd.load(bd.gep(qip, [bd.add(pq4, ir.Constant(_I64, c))])), cs)])
                            for h in range(tile_bytes // 64):  # (past the array's end: prefetch never faults)
                                _prefetch_line(bd, bd.gep(ch, [bd.add(pbase, ir.Constant(_I64, 64 * h))]))
                    with cgutils.for_range_slice(bd, q0, q1, one) as (qi, _):
                        q4 = bd.mul(qi, ir.Constant(_I64, 4))
                        chans = [bd.gep(cp, [bd.mul(bd.load(bd.gep(qip, [bd.add(q4, ir.Constant(_I64, c))])), cs)])
                                 for c in range(4)]
                        xw = bd.load(bd.bitcast(bd.gep(qxp, [q4]), ir.PointerType(_I32)), align=1)
                        xv = bd.bitcast(_splat(bd, xw, 16), ir.VectorType(_I8, 64))
                        parts = []
                        for h in range(tile_bytes // 64):
                            o = bd.add(base, ir.Constant(_I64, 64 * h))
                            vs = _interleave4(bd, *[_load(bd, c, o, ir.VectorType(_I8, 64)) for c in chans])
                            if nibbles:
                                parts += [bd.and_(v, _vconst(_I8, 64, 15)) for v in vs]
                                parts += [bd.lshr(v, _vconst(_I8, 64, 4)) for v in vs]
                            else:
                                parts += vs
                        for a, p in zip(accs, parts):
                            bd.store(_dpbusd(bd, bd.load(a), p, xv), a)
                    for k, a in enumerate(accs):
                        r = bd.add(bd.mul(t, ir.Constant(_I64, 128)), ir.Constant(_I64, 16 * k))
                        fa = bd.bitcast(bd.gep(fp, [r]), v16f.as_pointer())
                        # facc + d dx acc + m sx (offset: d (dx acc + offset sx)), fused multiply-adds
                        acc = bd.sitofp(bd.load(a), v16f)
                        r2 = bd.mul(r, ir.Constant(_I64, 2))
                        dv = bd.fpext(_load(bd, drow, r2, v16h), v16f)
                        if offset is None:
                            mv = bd.fpext(_load(bd, mrow, r2, v16h), v16f)
                            f = _fma(bd, mv, sx, bd.load(fa, align=4))
                            bd.store(_fma(bd, dv, bd.fmul(acc, dx, flags=_FAST), f), fa, align=4)
                        else:
                            bd.store(_fma(bd, dv, _fma(bd, acc, dx, sx), bd.load(fa, align=4)), fa, align=4)
            return context.get_dummy_value()

        ok = (isinstance(codes, types.Array) and codes.dtype == types.uint8 and codes.ndim == 2
              and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.int16 for a in (d, m))
              and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
                      for a, dt in ((qidx, types.int64), (qxb, types.int8), (bstart, types.int64),
                                    (bid, types.int64), (bxs, types.float32), (facc, types.float32))))
        if not ok:
            return None
        return types.void(codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc), codegen

    task.__name__ = task.__qualname__ = f"_int_task_{'q4' if nibbles else 'q8'}_{'m' if offset is None else -offset}"
    return intrinsic(task)


Q4_1, Q4_0, Q8_0 = 0, 1, 2  # int_task's formats
OFFSET = {Q4_0: -8, Q8_0: -128}  # m = OFFSET * d
_task_q4_1, _task_q4_0, _task_q8_0 = _make_task(True, None), _make_task(True, -8), _make_task(False, -128)


@njit(nogil=True, fastmath=True, cache=True)
def int_task(fmt, codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc):
    """One task's tiles t0..t1 (see _make_task) of a Q4_1 | Q4_0 | Q8_0 matrix (fmt)."""
    if fmt == Q4_1:
        _task_q4_1(codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc)
    elif fmt == Q4_0:
        _task_q4_0(codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc)
    else:
        _task_q8_0(codes, d, m, qidx, qxb, bstart, bid, bxs, nkb, t0, t1, facc)
