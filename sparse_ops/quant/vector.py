"""One block per row in LLVM vector IR: the helpers and the dot / axpy intrinsics of the 32-element
block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)."""

from __future__ import annotations

import numba
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import _NAME_OF_ID, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


# ---------------------------------------------------------------------------------------------
# Q8_0 / Q4_0 (and Q4_1, Q5_0, Q5_1) in LLVM vector IR. Q8_0 and Q4_0 carry most decode work (Q4_0 weights
# with Q8 activations, the Q8_0 W_down copy), and LLVM vectorises numba block loops over them badly: for
# 16-lane blocks it picks wider vectors, runs every block through its remainder loop and reduces it
# to a scalar, and it forms no VNNI dot products. So each (type, kernel) is a numba intrinsic that
# walks all blocks of _IR_ROWS rows with explicit vectors:
# - one <16 x float> accumulator per row (<8 x float> after vpdpbusd), reduced once per row; axpy
#   loads and stores p once per block for all its rows;
# - Q8 activations: integer products, AVX-512 VNNI vpdpbusd (Q4_0's / Q5_0's q as u8 x int8 x) and
#   vpmaddwd (Q8_0) when numba compiles for a CPU that has them, else even / odd int32 products,
#   which LLVM lowers to pmaddwd where it can;
# - 8 rows side by side rather than 4 (more memory streams in flight): +10-20% with rows from DRAM;
# - while a group of rows is read, the next group's are prefetched into L2 (`_prefetch`: block b of
#   each next row with block b of the current ones): +15-30% from DRAM. The hardware prefetchers start
#   over on every row, and a selection's rows are short and scattered. Prefetching only the next rows'
#   first lines gains less; prefetcht0 (into L1) less than L2; two groups ahead the same as one.
# Together these kernels read rows from DRAM two to three times as fast as numba loops over blocks, 4
# rows at a time (`tools/bench_quant.py --flush-mb 128 --baseline OLD_QUANT_PY` compares two versions
# of this file).
# Q4_1 (w = d q + m: the min times the block's sum of x, from _sums16; xq: times dx * sum of xq, from
# _quantize_x, as Q5_1) takes the same kernels (SmolLM2's file is Q4_1). So do Q5_0 / Q5_1, Q4_0 /
# Q4_1 with a 5th bit per element from the block's uint32 qh, a <32 x i1> mask (on AVX-512 a mask
# register: one masked byte move puts 16 or 0 in each lane), xq included (Gemma 3's Q4_K_M file stores
# attention and FFN gate / up as Q5_0).
#
# A block's 32 values are handled in element order (Q4_0: its 16 low nibbles are elements 0-15, the
# high ones 16-31; Q5_0: bit i of qh is element i's), as x and the Q8 activations are stored. Row
# pointers come from numba arrays, so these intrinsics trust the caller (the *_rows_ir helpers) for
# bounds.

def _host_has(*features: str) -> bool:
    # whether numba compiles for this very CPU (not for NUMBA_CPU_NAME=generic etc.) and it has features
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    try:
        host = llvm_binding.get_host_cpu_features()
    except RuntimeError:
        return False
    return all(host.get(f, False) for f in features)


_VNNI = _host_has("avx512vnni", "avx512vl", "avx512bw")  # x86 dot-product intrinsics in _int_dot
_AVX2 = _host_has("avx2")  # without VNNI: pmaddubsw / pmaddwd for the unsigned-q dots (_int_dot, _dot4)
_IR_ROWS = 8 if _host_has("avx512f") else 4  # rows side by side: 8 fit AVX-512's 32 vector registers
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_FAST = ("fast",)


def _vconst(t, n, v):
    return ir.Constant(ir.VectorType(t, n), [ir.Constant(t, v)] * n)


def _shuffle(bd, a, idx, b=None):
    return bd.shuffle_vector(a, a if b is None else b, ir.Constant(ir.VectorType(_I32, len(idx)), idx))


def _splat(bd, v, n):
    return _shuffle(bd, bd.insert_element(ir.Constant(ir.VectorType(v.type, n), None), v, ir.Constant(_I32, 0)),
                    [0] * n)


def _load(bd, ptr, off, ty):
    # value of type ty at ptr + off elements (unaligned)
    return bd.load(bd.bitcast(bd.gep(ptr, [off]), ty.as_pointer()), align=1)


def _hsum(bd, v):
    n = v.type.count
    while n > 1:
        n //= 2
        v = bd.fadd(_shuffle(bd, v, list(range(n))), _shuffle(bd, v, list(range(n, 2 * n))), flags=_FAST)
    return bd.extract_element(v, ir.Constant(_I32, 0))


_IR_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q4_K: 144, Q5_K: 176, Q6_K: 210}
_IR_OFFSET = {Q4_0: 8, Q5_0: 16}  # w = d * (q - offset); Q4_1, Q5_1 (_IR_MIN): w = d * q + m
_IR_MIN = (Q4_1, Q5_1)


def _block(bd, qt, row, b, signed=False):
    # block b of a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 row (i8*) -> (d, q of elements 0-15, q of elements
    # 16-31, m), q as <16 x i8>: Q8_0's int8, else unsigned: the stored nibbles, for Q5_0 / Q5_1 | the
    # 5th bit << 4 (bit i of the uint32 qh for element i); signed: Q4_0's / Q5_0's q - _IR_OFFSET
    # instead (w / d); m: Q4_1's / Q5_1's min, else None
    o = bd.mul(b, ir.Constant(_I64, _IR_BLOCK_BYTES[qt]))
    d = bd.fpext(_load(bd, row, o, ir.HalfType()), _F32)
    o = bd.add(o, ir.Constant(_I64, 2))
    m = None
    if qt in _IR_MIN:
        m = bd.fpext(_load(bd, row, o, ir.HalfType()), _F32)
        o = bd.add(o, ir.Constant(_I64, 2))
    v16 = ir.VectorType(_I8, 16)
    if qt == Q8_0:
        return d, _load(bd, row, o, v16), _load(bd, row, bd.add(o, ir.Constant(_I64, 16)), v16), m
    h = None
    if qt in (Q5_0, Q5_1):  # qh as <32 x i1> (AVX-512: a mask register) -> 16 or 0 per element; signed
        # Q5_0: 0 or -16, i.e. q - 16 by the same op (1 thread: +4% over subtracting 16 afterwards)
        hv = (0, -16) if signed and qt == Q5_0 else (16, 0)
        h = bd.select(bd.bitcast(_load(bd, row, o, _I32), ir.VectorType(ir.IntType(1), 32)),
                      _vconst(_I8, 32, hv[0]), _vconst(_I8, 32, hv[1]))
        o = bd.add(o, ir.Constant(_I64, 4))
    qs = _load(bd, row, o, v16)
    lo, hi = bd.and_(qs, _vconst(_I8, 16, 15)), bd.lshr(qs, _vconst(_I8, 16, 4))
    if h is not None:
        lo, hi = bd.or_(lo, _shuffle(bd, h, list(range(16)))), bd.or_(hi, _shuffle(bd, h, list(range(16, 32))))
    if signed and qt == Q4_0:
        lo, hi = bd.sub(lo, _vconst(_I8, 16, 8)), bd.sub(hi, _vconst(_I8, 16, 8))
    return d, lo, hi, m


def _block_f32(bd, qt, row, b):
    # block b -> (d, two <16 x float> of its values / d (Q4_1, Q5_1: of its q), m); kept as two halves,
    # not one <32 x i8>: the concatenation and split cost 5% in axpy
    d, lo, hi, m = _block(bd, qt, row, b, signed=True)
    return d, [bd.sitofp(h, ir.VectorType(_F32, 16)) for h in (lo, hi)], m


def _dot_lanes(qt):
    # int32 lanes of _int_dot's result for qt (float accumulators of the xq kernels have as many)
    return 8 if (_VNNI or _AVX2) and qt != Q8_0 else 16


def _maddubs(bd, q, xq):
    # AVX2: <8 x i32>, per lane the sum of 4 products of q's u8 (< 64: pmaddubsw's int16 pair sums
    # cannot saturate) and xq's s8: pmaddubsw, then pmaddwd against ones
    v16, i8x32 = ir.VectorType(_I16, 16), ir.VectorType(_I8, 32)
    ub = bd.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(v16, [i8x32, i8x32]))
    wd = bd.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd",
                                     fnty=ir.FunctionType(ir.VectorType(_I32, 8), [v16, v16]))
    return bd.call(wd, [bd.call(ub, [q, xq]), _vconst(_I16, 16, 1)])


def _vpdpbusd(bd, acc, q, xq):
    # AVX-512 VNNI: acc <8 x i32> + per lane the sum of 4 products of q's u8 and xq's s8 (<32 x i8> each)
    t = ir.VectorType(_I32, 8)
    f = bd.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", fnty=ir.FunctionType(t, [t] * 3))
    return bd.call(f, [acc, bd.bitcast(q, t), bd.bitcast(xq, t)])


def _int_dot(bd, qt, q, xq, acc=None):
    # q . xq, <32 x i8> each -> <_dot_lanes(qt) x i32> of partial sums (+ acc); q signed for Q8_0,
    # unsigned for the others (Q4_0's nibbles, the K-quants' 4-6 bit values). Lanes are in element
    # order: the first half of the lanes sums elements 0-15, the second half 16-31.
    v16 = ir.VectorType(_I16, 32)
    if _VNNI and qt != Q8_0:  # 4 u8 x s8 products per int32 lane, added to acc
        return _vpdpbusd(bd, _vconst(_I32, 8, 0) if acc is None else acc, q, xq)
    if _AVX2 and qt != Q8_0:  # the same lanes in two AVX2 instructions (q < 64 for these types)
        r = _maddubs(bd, q, xq)
        return r if acc is None else bd.add(r, acc, flags=["nsw"])
    if _VNNI:  # Q8_0: int16 pairs
        f = bd.module.declare_intrinsic("llvm.x86.avx512.pmaddw.d.512",
                                        fnty=ir.FunctionType(ir.VectorType(_I32, 16), [v16] * 2))
        r = bd.call(f, [bd.sext(q, v16), bd.sext(xq, v16)])
    else:  # portable: even + odd products in int32, which LLVM turns into pmaddwd where it can
        t = ir.VectorType(_I32, 16)
        ext = bd.sext if qt == Q8_0 else bd.zext
        ev, od = list(range(0, 32, 2)), list(range(1, 32, 2))
        r = bd.add(bd.mul(ext(_shuffle(bd, q, ev), t), bd.sext(_shuffle(bd, xq, ev), t), flags=["nsw"]),
                   bd.mul(ext(_shuffle(bd, q, od), t), bd.sext(_shuffle(bd, xq, od), t), flags=["nsw"]),
                   flags=["nsw"])
    return r if acc is None else bd.add(r, acc)


def _ir_types_ok(w, rows, *vectors):
    # the types the IR kernels are written for: uint8 rows of blocks, int64 row indices, and vectors
    # given as (type, dtype), C-contiguous (x, xd, out, p: read through their data pointers)
    return (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8
            and isinstance(rows, types.Array) and rows.ndim == 1 and rows.dtype == types.int64
            and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == dt
                    for a, dt in vectors))


def _next_rows(context, bd, sig, args):
    # args (w, rows, j, ...) -> pointers to the next _IR_ROWS rows, rows[j + _IR_ROWS + r] of w (r <
    # _IR_ROWS; past the end of rows, its last row), which the kernels prefetch (_prefetch)
    w = context.make_array(sig.args[0])(context, bd, args[0])
    rows = context.make_array(sig.args[1])(context, bd, args[1])
    last = bd.sub(bd.extract_value(rows.shape, 0), ir.Constant(_I64, 1))
    stride = bd.extract_value(w.strides, 0)
    ptrs = []
    for r in range(_IR_ROWS):
        i = bd.add(args[2], ir.Constant(_I64, _IR_ROWS + r))
        i = bd.select(bd.icmp_signed("<", i, last), i, last)
        row = bd.load(cgutils.get_item_pointer(context, bd, sig.args[1], rows, [i]))
        ptrs.append(bd.gep(w.data, [bd.mul(row, stride)]))
    return ptrs


def _dot_args(context, bd, qt, sig, args):
    """A dot intrinsic's operands: the rows' pointers and positions i (out[i]), the next rows'
    pointers (for _prefetch), blocks per row, and the data pointers of x, xd, out."""
    ptrs, pos, nb = _row_ptrs(context, bd, qt, sig, args)
    data = tuple(context.make_array(t)(context, bd, a).data for t, a in zip(sig.args[4:], args[4:]))
    return ptrs, pos, _next_rows(context, bd, sig, args), nb, data


def _axpy_types_ok(w, rows, a, p) -> bool:
    # as _ir_types_ok, for an axpy's coefficients a (float32, read element by element: any layout) and p
    return (_ir_types_ok(w, rows, (p, types.float32)) and isinstance(a, types.Array) and a.ndim == 1
            and a.dtype == types.float32)


def _axpy_args(context, bd, qt, sig, args):
    """An axpy intrinsic's operands: the rows' pointers, the next rows', blocks per row, each row's
    coefficient a[i] (0 for a repeated last row), and the data pointer of p."""
    ptrs, pos, nb = _row_ptrs(context, bd, qt, sig, args)
    av = context.make_array(sig.args[4])(context, bd, args[4])
    cs = [bd.select(bd.icmp_signed("==", i, bd.add(args[2], ir.Constant(_I64, r))),  # 0 for repeats
                    bd.load(cgutils.get_item_pointer(context, bd, sig.args[4], av, [i])),
                    ir.Constant(_F32, 0.0)) for r, i in enumerate(pos)]
    pp = context.make_array(sig.args[5])(context, bd, args[5]).data
    return ptrs, _next_rows(context, bd, sig, args), nb, cs, pp


def _prefetch(bd, ptrs, b, qt):
    # block b of the rows at ptrs into the L2 cache (prefetcht1 every 64 bytes of the block)
    f = bd.module.declare_intrinsic("llvm.prefetch", [ir.PointerType(_I8)],
                                    fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8), _I32, _I32, _I32]))
    o = bd.mul(b, ir.Constant(_I64, _IR_BLOCK_BYTES[qt]))
    for ptr in ptrs:
        for k in range(-(-_IR_BLOCK_BYTES[qt] // 64)):  # read, locality 2, data
            bd.call(f, [bd.gep(ptr, [bd.add(o, ir.Constant(_I64, 64 * k))]), ir.Constant(_I32, 0),
                        ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


def _row_ptrs(context, bd, qt, sig, args):
    # args (w, rows, j, hi, ...) -> (pointers to rows rows[j + r] of w for r < _IR_ROWS, rows past hi
    # repeating rows[hi - 1]; their positions j + r (clamped); blocks per row)
    w = context.make_array(sig.args[0])(context, bd, args[0])
    rows = context.make_array(sig.args[1])(context, bd, args[1])
    j, last = args[2], bd.sub(args[3], ir.Constant(_I64, 1))
    stride = bd.extract_value(w.strides, 0)
    ptrs, pos = [], []
    for r in range(_IR_ROWS):
        i = bd.add(j, ir.Constant(_I64, r))
        i = bd.select(bd.icmp_signed("<", i, last), i, last)
        row = bd.load(cgutils.get_item_pointer(context, bd, sig.args[1], rows, [i]))
        ptrs.append(bd.gep(w.data, [bd.mul(row, stride)]))
        pos.append(i)
    nb = bd.sdiv(bd.extract_value(w.shape, 1), ir.Constant(_I64, _IR_BLOCK_BYTES[qt]))
    return ptrs, pos, nb


def _dot_intrinsic(qt, xq, body):
    """The intrinsic (w, rows, j, hi, x, xd, out) of _make_dot / _make_kdot: the type check, the
    operands (_dot_args) and one accumulator per row (float32, `lanes` wide) are the same for every
    type; body(bd, ptrs, pos, nxt, nb, xp, xdp, op, lanes, accs) emits the block loop and the stores."""

    def dot(typingctx, w, rows, j, hi, x, xd, out):
        if not _ir_types_ok(w, rows, (x, types.int8 if xq else types.float32), (xd, types.float32),
                            (out, types.float32)):
            return None

        def codegen(context, bd, sig, args):
            ptrs, pos, nxt, nb, (xp, xdp, op) = _dot_args(context, bd, qt, sig, args)
            lanes = _dot_lanes(qt) if xq else 16
            accs = [cgutils.alloca_once_value(bd, _vconst(_F32, lanes, 0.0)) for _ in ptrs]
            body(bd, ptrs, pos, nxt, nb, xp, xdp, op, lanes, accs)
            return context.get_dummy_value()

        return types.void(w, rows, j, hi, x, xd, out), codegen

    dot.__name__ = dot.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_dot{'_xq' if xq else ''}"
    return intrinsic(dot)


def _axpy_intrinsic(qt, body):
    """The intrinsic (w, rows, j, hi, a, p) of _make_axpy / _make_kaxpy: the type check and the
    operands (_axpy_args) are the same for every type; body(bd, ptrs, nxt, nb, cs, pp) emits the
    block loop."""

    def axpy(typingctx, w, rows, j, hi, a, p):
        if not _axpy_types_ok(w, rows, a, p):
            return None

        def codegen(context, bd, sig, args):
            ptrs, nxt, nb, cs, pp = _axpy_args(context, bd, qt, sig, args)
            body(bd, ptrs, nxt, nb, cs, pp)
            return context.get_dummy_value()

        return types.void(w, rows, j, hi, a, p), codegen

    axpy.__name__ = axpy.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_axpy"
    return intrinsic(axpy)


def _make_dot(qt, xq):
    """Intrinsic (w, rows, j, hi, x, xd, out): out[i] = w[rows[i]] . x for i in [j, min(j + _IR_ROWS, hi)).
    w: uint8 [R, bytes_per_row] of qt blocks. xq False: x float32 [C] and xd its sums over 16 elements
    (_sums16; read for Q4_1's / Q5_1's mins only); xq True: x int8 [C] and xd as _quantize_x returns."""

    def body(bd, ptrs, pos, nxt, nb, xp, xdp, op, lanes, accs):
        offs = [cgutils.alloca_once_value(bd, ir.Constant(_F32, 0.0)) for _ in ptrs]
        with cgutils.for_range(bd, nb) as loop:
            b = loop.index
            _prefetch(bd, nxt, b, qt)
            xo = bd.mul(b, ir.Constant(_I64, 32))
            if xq:
                xv = _load(bd, xp, xo, ir.VectorType(_I8, 32))
                b2 = bd.mul(b, ir.Constant(_I64, 2))
                dx = bd.load(bd.gep(xdp, [b2]))
                sx = bd.load(bd.gep(xdp, [bd.add(b2, ir.Constant(_I64, 1))]))  # dx * sum(xq of block b)
            else:
                xv = [_load(bd, xp, bd.add(xo, ir.Constant(_I64, h)), ir.VectorType(_F32, 16)) for h in (0, 16)]
            for ptr, acc, off in zip(ptrs, accs, offs):
                if xq:
                    d, lo, hi, m = _block(bd, qt, ptr, b)
                    q = _shuffle(bd, lo, list(range(32)), hi)
                    t = bd.sitofp(_int_dot(bd, qt, q, xv), ir.VectorType(_F32, lanes))
                    sc = bd.fmul(d, dx, flags=_FAST)
                    if qt in _IR_OFFSET:  # sum((q - 8) xq) = sum(q xq) - 8 sum(xq) (Q5_0: 16)
                        bd.store(bd.fadd(bd.load(off), bd.fmul(d, sx, flags=_FAST), flags=_FAST), off)
                    elif m is not None:  # + m * dx * sum(xq)
                        bd.store(bd.fadd(bd.load(off), bd.fmul(m, sx, flags=_FAST), flags=_FAST), off)
                else:
                    d, f, m = _block_f32(bd, qt, ptr, b)
                    t = bd.fadd(bd.fmul(f[0], xv[0], flags=_FAST), bd.fmul(f[1], xv[1], flags=_FAST), flags=_FAST)
                    sc = d
                    if m is not None:  # Q4_1, Q5_1: + m * (sum of x over the block)
                        b2 = bd.mul(b, ir.Constant(_I64, 2))
                        xsum = bd.fadd(bd.load(bd.gep(xdp, [b2])), bd.load(bd.gep(xdp, [bd.add(b2, ir.Constant(_I64, 1))])),
                                       flags=_FAST)
                        bd.store(bd.fadd(bd.load(off), bd.fmul(m, xsum, flags=_FAST), flags=_FAST), off)
                bd.store(bd.fadd(bd.load(acc), bd.fmul(t, _splat(bd, sc, lanes), flags=_FAST), flags=_FAST), acc)
        for i, acc, off in zip(pos, accs, offs):
            s = _hsum(bd, bd.load(acc))
            if xq and qt in _IR_OFFSET:
                k = ir.Constant(_F32, float(_IR_OFFSET[qt]))
                s = bd.fsub(s, bd.fmul(k, bd.load(off), flags=_FAST), flags=_FAST)
            elif qt in _IR_MIN:
                s = bd.fadd(s, bd.load(off), flags=_FAST)
            bd.store(s, bd.gep(op, [i]))

    return _dot_intrinsic(qt, xq, body)


def _make_axpy(qt):
    """Intrinsic (w, rows, j, hi, a, p): p += sum of a[i] * w[rows[i]] over i in [j, min(j + _IR_ROWS, hi)).
    p is loaded and stored once per block for all the rows."""

    def body(bd, ptrs, nxt, nb, cs, pp):
        with cgutils.for_range(bd, nb) as loop:
            b = loop.index
            _prefetch(bd, nxt, b, qt)
            po = [bd.add(bd.mul(b, ir.Constant(_I64, 32)), ir.Constant(_I64, h)) for h in (0, 16)]
            pv = [_load(bd, pp, o, ir.VectorType(_F32, 16)) for o in po]
            for ptr, c in zip(ptrs, cs):
                d, f, m = _block_f32(bd, qt, ptr, b)
                cd = _splat(bd, bd.fmul(c, d, flags=_FAST), 16)
                pv = [bd.fadd(v, bd.fmul(h, cd, flags=_FAST), flags=_FAST) for v, h in zip(pv, f)]
                if m is not None:  # Q4_1, Q5_1: + c * m on every element
                    cm = _splat(bd, bd.fmul(c, m, flags=_FAST), 16)
                    pv = [bd.fadd(v, cm, flags=_FAST) for v in pv]
            for o, v in zip(po, pv):
                bd.store(v, bd.bitcast(bd.gep(pp, [o]), v.type.as_pointer()), align=4)

    return _axpy_intrinsic(qt, body)


_q8_0_dot, _q4_0_dot = _make_dot(Q8_0, False), _make_dot(Q4_0, False)
_q8_0_dot_xq, _q4_0_dot_xq = _make_dot(Q8_0, True), _make_dot(Q4_0, True)
_q8_0_axpy, _q4_0_axpy = _make_axpy(Q8_0), _make_axpy(Q4_0)
_q4_1_dot, _q4_1_dot_xq, _q4_1_axpy = _make_dot(Q4_1, False), _make_dot(Q4_1, True), _make_axpy(Q4_1)
_q5_0_dot, _q5_1_dot = _make_dot(Q5_0, False), _make_dot(Q5_1, False)
_q5_0_dot_xq, _q5_1_dot_xq = _make_dot(Q5_0, True), _make_dot(Q5_1, True)
_q5_0_axpy, _q5_1_axpy = _make_axpy(Q5_0), _make_axpy(Q5_1)
