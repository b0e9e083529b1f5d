"""Row-interleaved ("x8") Q4_0 / Q4_1 / Q4_K / Q8_0 matrices: the layout, its kernels and the packing."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .activations import _quantize_x
from .formats import _INLINE, _JIT, _NAME_OF_ID, Q4_0, Q4_1, Q4_K, Q8_0, X8, X8_FIELDS
from .vector import (_AVX2, _F32, _FAST, _I8, _I16, _I32, _I64, _IR_BLOCK_BYTES, _VNNI, _load, _maddubs, _shuffle,
                     _splat, _vconst, _vpdpbusd)


# ---------------------------------------------------------------------------------------------
# Row-interleaved Q4_0 / Q4_1 / Q4_K / Q8_0 ("x8"): a dense matrix's rows in groups of 8 whose blocks are
# interleaved, for the one-token GEMV over all rows (attention, the LM head, dense FFNs). The
# kernels of vector.py and kquants.py handle a block per row: its scale, nibble unpacking, integer dot, conversion and
# scaling cost ~14 instructions per 32 weights, so Q4_0 / Q4_K with Q8 activations are compute-bound
# (on 2 threads of a 2-core machine 31 / 34 GB/s where Q8_0's rows stream at 49).
# Interleaved, that work is shared by 8 rows. Block b of group g (rows 8g..8g+7) holds the same bytes
# as the 8 rows' blocks b, field by field (`X8_FIELDS`), each field cut into units (2 bytes for an
# fp16, 1 for Q4_K's packed scales, 4 for quants) and stored unit-major: unit u of row 0, ..., of row
# 7, then unit u + 1. So a 32-byte chunk of quants is 4 consecutive elements of each row, one row per
# int32 lane (Q4_0: low nibbles elements 4c..4c+3, high ones 16+4c..; Q4_K: sub-blocks 2c / 2c+1),
# and one vpdpbusd against x's 4 values broadcast adds 4 products to each row's lane; the scales of
# the 8 rows are one vector load. About 5 instructions per row and 32 weights. Used where a matrix
# is only read whole (`pack_rows`); row selections keep the GGUF layout. Q4_1 (its m beside d) and
# Q8_0 (q + 128 as the unsigned operand) take the same scheme; Q8_0 only where Q8 activations are
# accepted (CPU predictors, the LM head). On a 2-core machine interleaved rows read 1.3-1.7x faster
# (Q4_0 on 2 threads 47 against 31 GB/s, the DRAM's rate); where many threads make both layouts
# bandwidth-bound (15 threads of a 16-core host) they tie. Software prefetch ahead of the group's
# single stream gains nothing here.



# The per-block arithmetic of the group dots (the _x8_*_block functions) and their sum over blocks
# carry no reassociating fast-math flags (_EXACT: only "no signed zeros", which also keeps numba's
# fast-math pass from adding its own; products that may fuse go through llvm.fmuladd): LLVM then
# computes them the same way wherever they are inlined, so the several-token kernels (tiles.py) give
# each token bit for bit the one-token kernel's products (the Q8 rounding of an expert's h,
# downstream of them, would otherwise flip now and then).
_EXACT = ("nsz",)


def _fmuladd(bd, a, b, c):
    # a * b + c, fused where the target has FMA (the same choice in every kernel)
    name = f"llvm.fmuladd.v{a.type.count}f32"
    f = bd.module.globals.get(name) or ir.Function(bd.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return bd.call(f, [a, b, c])


def _groups(row):
    # row: one group's pointer, or a tuple of groups' pointers whose lanes are side by side
    return row if isinstance(row, tuple) else (row,)


def _gload(bd, row, off, ty):
    # a vector ty of one group's 8 rows at row + off; for several groups (_groups), theirs concatenated
    # (group 0's lanes first): the 16-lane forms of the block functions below for two groups at once
    # (AVX-512: one zmm instruction where one group takes a ymm one; each lane computes the same)
    vs = [_load(bd, r, off, ty) for r in _groups(row)]
    while len(vs) > 1:
        a, b = vs[0], vs[1]
        vs = [_shuffle(bd, a, list(range(2 * a.type.count)), b)] + vs[2:]
    return vs[0]


def _dot4(bd, acc, q, xq, nibbles=False):
    # acc + the sums of 4 products q[4l..4l+3] . xq[4l..4l+3] per int32 lane l; q <32 x i8> unsigned,
    # xq signed; acc <8 x i32>. nibbles: q < 16, so that AVX2's pmaddubsw (u8 x s8, adjacent pairs
    # summed in int16 with saturation) cannot saturate (2 x 15 x 128 < 2^15; Q8_0's q + 128 could).
    # <64 x i8> / <16 x i32> (two groups): AVX-512 VNNI only
    if acc.type.count == 16:
        t = ir.VectorType(_I32, 16)
        f = bd.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(t, [t] * 3))
        return bd.call(f, [acc, bd.bitcast(q, t), bd.bitcast(xq, t)])
    if _VNNI:
        return _vpdpbusd(bd, acc, q, xq)
    if nibbles and _AVX2:  # 3 instructions per 32 products, as llama.cpp's AVX2 kernels do
        return bd.add(acc, _maddubs(bd, q, xq), flags=["nsw"])
    v16 = ir.VectorType(_I16, 32)  # portable: int16 products, then pairs twice (pmaddubsw / pmaddwd)
    p = bd.mul(bd.zext(q, v16), bd.sext(xq, v16), flags=["nsw"])
    ev, od = list(range(0, 32, 2)), list(range(1, 32, 2))
    t16 = ir.VectorType(_I32, 16)
    p2 = bd.add(bd.sext(_shuffle(bd, p, ev), t16), bd.sext(_shuffle(bd, p, od), t16), flags=["nsw"])
    p4 = bd.add(_shuffle(bd, p2, list(range(0, 16, 2))), _shuffle(bd, p2, list(range(1, 16, 2))), flags=["nsw"])
    return bd.add(acc, p4, flags=["nsw"])


def _x8_nibble_dots(bd, row, o, xp, xo, chunks, chains=2):
    # 32-byte chunks of nibbles at row + o + 32k (k < chunks), x's Q8 values at xp + xo -> (low, high)
    # <8 x i32> per-row dots: chunk k's low nibbles against x[xo + 4k..], its high ones against
    # x[xo + 4 chunks + 4k..] (Q4_0: elements 4k and 16 + 4k; Q4_K: sub-blocks 2c, 2c + 1); chains=1:
    # (their sum,), one accumulator (an integer sum: the same in any order)
    L = 8 * len(_groups(row))
    sums = [_vconst(_I32, L, 0)] * chains
    for k in range(chunks):
        qs = _gload(bd, row, bd.add(o, ir.Constant(_I64, 32 * k)), ir.VectorType(_I8, 32))
        for h, q in enumerate((bd.and_(qs, _vconst(_I8, 4 * L, 15)), bd.lshr(qs, _vconst(_I8, 4 * L, 4)))):
            xv = _load(bd, xp, bd.add(xo, ir.Constant(_I64, 4 * (chunks * h + k))), _I32)
            sums[h % chains] = _dot4(bd, sums[h % chains], q, bd.bitcast(_splat(bd, xv, L), q.type), nibbles=True)
    return sums


def _x8_xd(bd, xdp, k, lanes=8):
    # (dx, dx * sum of xq) of x's 32-block k (as _quantize_x stores them), each splat over the lanes
    k2 = bd.mul(k, ir.Constant(_I64, 2))
    return tuple(_splat(bd, bd.load(bd.gep(xdp, [bd.add(k2, ir.Constant(_I64, i))])), lanes) for i in (0, 1))


def _x8_q4_block(bd, row, o, b, xp, xdp, acc, qt, chains=2):
    # acc + block b of a Q4_0 / Q4_1 group at row + o . x -> <8 x float>, one lane a row (row a tuple
    # of groups: <8 n x float>, see _gload): acc + (dot (d dx) + c sx) with dot the block's integer dot
    # and c = -8 d (Q4_0: sum((q - 8) xq) dx = dot dx - 8 dx sum(xq)) or m (Q4_1: w = d q + m); -8 d
    # is exact and shared by the tokens of a tile. One addition on acc's chain from block to block
    # (the one-token loop is bound by that chain's latency); chains: the integer dot's accumulators
    L = 8 * len(_groups(row))
    f8, h8 = ir.VectorType(_F32, L), ir.VectorType(ir.HalfType(), 8)
    d = bd.fpext(_gload(bd, row, o, h8), f8)
    qs = 16 if qt == Q4_0 else 32  # Q4_1: the 8 rows' m after their d
    dots = _x8_nibble_dots(bd, row, bd.add(o, ir.Constant(_I64, qs)), xp, bd.mul(b, ir.Constant(_I64, 32)), 4, chains)
    dot = dots[0] if chains == 1 else bd.add(dots[0], dots[1])
    dx, sx = _x8_xd(bd, xdp, b, L)
    if qt == Q4_0:
        c = bd.fmul(d, _vconst(_F32, L, -8.0), flags=_EXACT)
    else:
        c = bd.fpext(_gload(bd, row, bd.add(o, ir.Constant(_I64, 16)), h8), f8)
    v = _fmuladd(bd, bd.sitofp(dot, f8), bd.fmul(d, dx, flags=_EXACT), bd.fmul(c, sx, flags=_EXACT))
    return bd.fadd(acc, v, flags=_EXACT)


def _x8_q8_0_block(bd, row, o, b, xp, xdp, acc, chains=2):
    # acc + block b of a Q8_0 group at row + o . x -> <8 x float>, as _x8_q4_block; the int8 q go into
    # vpdpbusd's unsigned operand as q + 128 (the sign bit flipped), and 128 sum(xq) comes off (row a
    # tuple of groups: <8 n x float>, see _gload)
    L = 8 * len(_groups(row))
    f8, v32 = ir.VectorType(_F32, L), ir.VectorType(_I8, 32)
    d = bd.fpext(_gload(bd, row, o, ir.VectorType(ir.HalfType(), 8)), f8)
    sums = [_vconst(_I32, L, 0)] * chains
    for k in range(8):
        q = bd.xor(_gload(bd, row, bd.add(o, ir.Constant(_I64, 16 + 32 * k)), v32), _vconst(_I8, 4 * L, -128))
        xv = _load(bd, xp, bd.add(bd.mul(b, ir.Constant(_I64, 32)), ir.Constant(_I64, 4 * k)), _I32)
        sums[k % chains] = _dot4(bd, sums[k % chains], q, bd.bitcast(_splat(bd, xv, L), q.type))
    dot = sums[0] if chains == 1 else bd.add(sums[0], sums[1])
    dx, sx = _x8_xd(bd, xdp, b, L)
    c = bd.fmul(d, _vconst(_F32, L, -128.0), flags=_EXACT)
    v = _fmuladd(bd, bd.sitofp(dot, f8), bd.fmul(d, dx, flags=_EXACT), bd.fmul(c, sx, flags=_EXACT))
    return bd.fadd(acc, v, flags=_EXACT)


def _x8_q4_k_scales(bd, at):
    # a Q4_K group block's (at(k, ty): its byte k) 6-bit scales and mins of the 8 rows, unpacked as
    # llama.cpp does for all rows at once: bytes 0-3 / 4-7 / 8-11 of the rows' packed scales are
    # 32-byte vectors A, B, C (lane 8j + r: byte j of row r) -> (sc, mn), each two <32 x i8> for
    # sub-blocks 0-3 and 4-7 (lane 8 (s % 4) + r: sub-block s of row r)
    c8 = lambda v: _vconst(_I8, 32, v)  # noqa: E731
    A, B, C = (at(32 + 32 * k, ir.VectorType(_I8, 32)) for k in range(3))
    sc = (bd.and_(A, c8(63)), bd.or_(bd.and_(C, c8(15)), bd.shl(bd.lshr(A, c8(6)), c8(4))))
    mn = (bd.and_(B, c8(63)), bd.or_(bd.lshr(C, c8(4)), bd.shl(bd.lshr(B, c8(6)), c8(4))))
    return sc, mn


def _x8_q4_k_block(bd, row, o, b, xp, xdp, acc, chains=2):
    # acc + block b (256 elements) of a Q4_K group at row + o . x -> <8 x float>, one lane a row
    f8 = ir.VectorType(_F32, 8)
    d, dmin = (bd.fpext(_load(bd, row, bd.add(o, ir.Constant(_I64, k)), ir.VectorType(ir.HalfType(), 8)), f8)
               for k in (0, 16))
    sc, mn = _x8_q4_k_scales(bd, lambda k, ty: _load(bd, row, bd.add(o, ir.Constant(_I64, k)), ty))

    def lanes(v, s):  # sub-block s's 8 rows as floats
        return bd.uitofp(_shuffle(bd, v[s // 4], list(range(8 * (s % 4), 8 * (s % 4) + 8))), f8)

    acc_sc, acc_mn = _vconst(_F32, 8, 0.0), _vconst(_F32, 8, 0.0)
    for c in range(4):
        dots = _x8_nibble_dots(bd, row, bd.add(o, ir.Constant(_I64, 128 + 256 * c)), xp,
                               bd.add(bd.mul(b, ir.Constant(_I64, 256)), ir.Constant(_I64, 64 * c)), 8)
        for h, dot in enumerate(dots):
            s = 2 * c + h
            dx, sx = _x8_xd(bd, xdp, bd.add(bd.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, s)))
            t = bd.fmul(bd.sitofp(dot, f8), dx, flags=_EXACT)
            acc_sc = _fmuladd(bd, lanes(sc, s), t, acc_sc)
            acc_mn = _fmuladd(bd, lanes(mn, s), sx, acc_mn)
    return bd.fadd(acc, _fmuladd(bd, d, acc_sc, bd.fneg(bd.fmul(dmin, acc_mn, flags=_EXACT))), flags=_EXACT)


def _make_x8_dot(qt):
    """Intrinsic (w, g, xq, xd, out): out[8g:8g+8] = the 8 rows of group g of w (uint8 [R / 8, blocks
    x 8 x block bytes], the interleaved layout above) . x, with Q8 activations xq int8 [C], xd as
    _quantize_x returns."""
    block = {Q4_0: lambda *a: _x8_q4_block(*a, Q4_0), Q4_1: lambda *a: _x8_q4_block(*a, Q4_1),
             Q4_K: _x8_q4_k_block, Q8_0: _x8_q8_0_block}[qt]

    def dot(typingctx, w, g, xq, xd, out):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8
                and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
                        for a, dt in ((xq, types.int8), (xd, types.float32), (out, types.float32)))):
            return None

        def codegen(context, bd, sig, args):
            wa = context.make_array(sig.args[0])(context, bd, args[0])
            xp, xdp, op = (context.make_array(t)(context, bd, a).data for t, a in zip(sig.args[2:], args[2:]))
            gb = X8 * _IR_BLOCK_BYTES[qt]
            row = bd.gep(wa.data, [bd.mul(args[1], bd.extract_value(wa.strides, 0))])
            nb = bd.sdiv(bd.extract_value(wa.shape, 1), ir.Constant(_I64, gb))
            acc = cgutils.alloca_once_value(bd, _vconst(_F32, 8, 0.0))
            with cgutils.for_range(bd, nb) as loop:
                b = loop.index
                bd.store(block(bd, row, bd.mul(b, ir.Constant(_I64, gb)), b, xp, xdp, bd.load(acc)), acc)
            dst = bd.gep(op, [bd.mul(args[1], ir.Constant(_I64, X8))])
            bd.store(bd.load(acc), bd.bitcast(dst, ir.VectorType(_F32, 8).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(w, g, xq, xd, out), codegen

    dot.__name__ = dot.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_x8_dot_xq"
    return intrinsic(dot)


_q4_0_x8_dot_xq, _q4_1_x8_dot_xq, _q4_k_x8_dot_xq, _q8_0_x8_dot_xq = (_make_x8_dot(qt)
                                                                      for qt in (Q4_0, Q4_1, Q4_K, Q8_0))


@njit(**_INLINE)
def _x8_dot_any(qt, w, g, xq, xd, out):
    # out[8g:8g+8] = the 8 rows of group g of the interleaved matrix w (type qt) . x (Q8: xq, xd)
    if qt == Q4_K:
        _q4_k_x8_dot_xq(w, g, xq, xd, out)
    elif qt == Q8_0:
        _q8_0_x8_dot_xq(w, g, xq, xd, out)
    elif qt == Q4_1:
        _q4_1_x8_dot_xq(w, g, xq, xd, out)
    else:
        _q4_0_x8_dot_xq(w, g, xq, xd, out)


@njit(**_JIT)
def qgemv_x8_kernel(qt, w, x, out):
    # out = W x over all rows of an interleaved matrix w: uint8 [R / 8, ...] of type qt; out [R]
    xq, xd = _quantize_x(x)
    for g in prange(w.shape[0]):
        _x8_dot_any(qt, w, g, xq, xd, out)


def _x8_table(qt) -> np.ndarray:
    # int64 [F, 4]: per field (source offset, bytes, unit, offset in the interleaved block)
    rows, dst = [], 0
    for off, size, unit in X8_FIELDS[qt]:
        rows.append((off, size, unit, dst))
        dst += X8 * size
    return np.array(rows, np.int64)


@njit(**_JIT)
def _x8_rows_kernel(w, table, rows, out):
    # out[j] = row rows[j] of the interleaved matrix w in the GGUF layout; out: uint8 [K, nb * T]
    ts = 0
    for f in range(table.shape[0]):
        ts += table[f, 1]
    nb = out.shape[1] // ts
    for j in prange(rows.shape[0]):
        src, dst, l = w[rows[j] // X8], out[j], rows[j] % X8
        for b in range(nb):
            for f in range(table.shape[0]):
                off, size, unit, at = table[f, 0], table[f, 1], table[f, 2], table[f, 3]
                for u in range(size // unit):
                    s = X8 * ts * b + at + (X8 * u + l) * unit
                    t = ts * b + off + u * unit
                    for k in range(unit):
                        dst[t + k] = src[s + k]


def _x8_store_rows(bd, v, dst, stride, col):
    # v <32 x float>, lanes 4r..4r+3 for row r -> dst[r * stride + col .. + 4] (float*)
    f4p = ir.VectorType(_F32, 4).as_pointer()
    for r in range(X8):
        p = bd.gep(dst, [bd.add(bd.mul(ir.Constant(_I64, r), stride), col)])
        bd.store(_shuffle(bd, v, [4 * r + k for k in range(4)]), bd.bitcast(p, f4p), align=4)


def _x8_decode_q4_k(bd, at, d, rep4, b, dst, stride):
    # block b of a Q4_K group (at(k, ty): its byte k) -> dst rows (see _make_x8_decode)
    f8, f32v, v32 = ir.VectorType(_F32, 8), ir.VectorType(_F32, 32), ir.VectorType(_I8, 32)
    c8 = lambda v: _vconst(_I8, 32, v)  # noqa: E731
    dmin = bd.fpext(at(16, ir.VectorType(ir.HalfType(), 8)), f8)
    sc, mn = _x8_q4_k_scales(bd, at)
    col0 = bd.mul(b, ir.Constant(_I64, 256))
    for c in range(4):
        pats = []  # sub-blocks 2c, 2c + 1: (d * scale, dmin * min) in lanes 4r..4r+3
        for h in range(2):
            s = 2 * c + h
            lanes = [8 * (s % 4) + r for r in rep4]
            pats.append(tuple(bd.fmul(bd.uitofp(_shuffle(bd, v[s // 4], lanes), f32v), _shuffle(bd, f, rep4), flags=_FAST)
                              for v, f in ((sc, d), (mn, dmin))))
        for j in range(8):
            qs = at(128 + 256 * c + 32 * j, v32)
            for h, q in enumerate((bd.and_(qs, c8(15)), bd.lshr(qs, c8(4)))):
                v = bd.fsub(bd.fmul(bd.uitofp(q, f32v), pats[h][0], flags=_FAST), pats[h][1], flags=_FAST)
                _x8_store_rows(bd, v, dst, stride, bd.add(col0, ir.Constant(_I64, 32 * (2 * c + h) + 4 * j)))


def _make_x8_decode(qt):
    """Intrinsic (w, g, buf): the 8 rows of group g of the interleaved matrix w decoded into buf
    float32 [8, C] (C-contiguous), for prefill's GEMMs."""

    def dec(typingctx, w, g, buf):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8 and isinstance(buf, types.Array)
                and buf.ndim == 2 and buf.layout == "C" and buf.dtype == types.float32):
            return None

        def codegen(context, bd, sig, args):
            wa = context.make_array(sig.args[0])(context, bd, args[0])
            ba = context.make_array(sig.args[2])(context, bd, args[2])
            gb = X8 * _IR_BLOCK_BYTES[qt]
            row = bd.gep(wa.data, [bd.mul(args[1], bd.extract_value(wa.strides, 0))])
            nb = bd.sdiv(bd.extract_value(wa.shape, 1), ir.Constant(_I64, gb))
            stride = bd.extract_value(ba.shape, 1)
            f8, f32v, v32 = ir.VectorType(_F32, 8), ir.VectorType(_F32, 32), ir.VectorType(_I8, 32)
            rep4 = [r for r in range(X8) for _ in range(4)]  # row r's value in lanes 4r..4r+3
            with cgutils.for_range(bd, nb) as loop:
                b = loop.index
                o = bd.mul(b, ir.Constant(_I64, gb))

                def at(k, ty):
                    return _load(bd, row, bd.add(o, ir.Constant(_I64, k)), ty)

                d = bd.fpext(at(0, ir.VectorType(ir.HalfType(), 8)), f8)
                if qt in (Q4_0, Q4_1, Q8_0):
                    col0 = bd.mul(b, ir.Constant(_I64, 32))
                    dp = _shuffle(bd, d, rep4)
                    mp = _shuffle(bd, bd.fpext(at(16, ir.VectorType(ir.HalfType(), 8)), f8), rep4) if qt == Q4_1 else None
                    q0 = 32 if qt == Q4_1 else 16  # the quants after d (and Q4_1's m)
                    for c in range(8 if qt == Q8_0 else 4):
                        qs = at(q0 + 32 * c, v32)
                        if qt == Q8_0:
                            halves = ((bd.sitofp(qs, f32v), 4 * c),)
                        else:
                            off = _vconst(_I8, 32, 8 if qt == Q4_0 else 0)
                            halves = tuple((bd.sitofp(bd.sub(q, off), f32v), 4 * c + 16 * h)
                                           for h, q in enumerate((bd.and_(qs, _vconst(_I8, 32, 15)),
                                                                  bd.lshr(qs, _vconst(_I8, 32, 4)))))
                        for v, e in halves:
                            v = bd.fmul(v, dp, flags=_FAST)
                            if mp is not None:  # Q4_1: w = d q + m
                                v = bd.fadd(v, mp, flags=_FAST)
                            _x8_store_rows(bd, v, ba.data, stride, bd.add(col0, ir.Constant(_I64, e)))
                else:
                    _x8_decode_q4_k(bd, at, d, rep4, b, ba.data, stride)
            return context.get_dummy_value()

        return types.void(w, g, buf), codegen

    dec.__name__ = dec.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_x8_decode"
    return intrinsic(dec)


_q4_0_x8_decode, _q4_1_x8_decode, _q4_k_x8_decode, _q8_0_x8_decode = (_make_x8_decode(qt)
                                                                      for qt in (Q4_0, Q4_1, Q4_K, Q8_0))


@njit(nogil=True, fastmath=True, cache=True)
def _bf16_bits(src, dst):
    # float32 src [C] -> bfloat16 bits in uint16 dst [C], rounded to nearest even
    u = src.view(np.uint32)
    for i in range(dst.shape[0]):
        v = u[i]
        dst[i] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**_JIT)
def _x8_dequant_kernel(qt, w, g0, out, bf16):
    # rows 8 g0 .. 8 g0 + K of the interleaved matrix w -> out [K, C]: float32, or bfloat16 bits
    # (uint16, nearest even) when bf16; K a multiple of 8
    C = out.shape[1]
    for g in prange(out.shape[0] // X8):
        buf = np.empty((X8, C), np.float32)
        if qt == Q4_K:
            _q4_k_x8_decode(w, g0 + g, buf)
        elif qt == Q8_0:
            _q8_0_x8_decode(w, g0 + g, buf)
        elif qt == Q4_1:
            _q4_1_x8_decode(w, g0 + g, buf)
        else:
            _q4_0_x8_decode(w, g0 + g, buf)
        for r in range(X8):
            if bf16:
                _bf16_bits(buf[r], out[X8 * g + r])
            else:
                out[X8 * g + r, :] = buf[r]


_UNIT_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _interleave(qt, src: np.ndarray, nb: int, ts: int, out: np.ndarray) -> None:
    # src uint8 [G * 8 * nb * ts], G groups of 8 GGUF rows of type qt -> out uint8 [G * nb * 8 * ts],
    # interleaved (the fields of X8_FIELDS): one strided copy per field straight into out, in units
    # of the field's unit (2- and 4-byte elements, possibly unaligned: 4-5x faster than byte copies
    # through a transposed reshape and a concatenation)
    g = src.size // (X8 * nb * ts)
    base = 0
    for off, size, unit in X8_FIELDS[qt]:
        dt, k = _UNIT_DTYPES[unit], size // unit
        rows = np.ndarray((g, X8, nb, k), dt, buffer=src, offset=off, strides=(X8 * nb * ts, nb * ts, ts, unit))
        dst = np.ndarray((g, nb, k, X8), dt, buffer=out, offset=base, strides=(X8 * nb * ts, X8 * ts, X8 * unit, unit))
        dst[...] = rows.transpose(0, 2, 3, 1)
        base += X8 * size
