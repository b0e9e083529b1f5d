"""One block per row in LLVM vector IR for the 256-element K-quants (Q4_K, Q5_K, Q6_K)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .formats import Q4_K, Q5_K, Q6_K
from .vector import (_F32, _FAST, _I8, _I32, _I64, _IR_BLOCK_BYTES, _axpy_intrinsic, _dot_intrinsic, _hsum, _int_dot,
                     _load, _prefetch, _shuffle, _splat, _vconst)


# ---------------------------------------------------------------------------------------------
# K-quants (Q4_K, Q5_K, Q6_K) in LLVM vector IR: vector.py's scheme (_IR_ROWS rows side by side, one
# float accumulator per row, p loaded and stored once per block for all rows) over 256-element
# blocks. A block's scales and mins are unpacked with vector ops, without branches, and its values
# come as 8 pieces of 32 unsigned q (<32 x i8>, in element order: piece k = elements 32k..32k+31).
# All three types are w = sc_g q - mn_g over groups g of 32 (Q4_K, Q5_K: one per piece) or 16
# elements (Q6_K, whose mn_g = 32 sc_g): the scale multiplies the group's dot, the min the sum of x
# over the group (float x: from _sums16; xq: dx * sum of xq of the 32-block, and for Q6_K, whose
# groups are smaller, -32 sum(xq) is where the integer dot starts: vpdpbusd adds to it).
# Float x is compute-bound: per 16 weights a zero-extension, a conversion and 1-2 FMAs; rows in L2,
# 1 thread, Q4_K / Q6_K reach 9.4 / 10.9 GB/s with float x, 20 / 26 with xq (one vpdpbusd per 32
# weights, a conversion and an FMA per 8 lanes of it). Q6_K's -32 in int8 before the conversion
# instead of in mn: 12% slower. Like the IR kernels of vector.py, these read rows from DRAM two to three times
# as fast as numba loops over blocks (`tools/bench_quant.py`).

_K_GROUPS = {Q4_K: 8, Q5_K: 8, Q6_K: 16}  # scale groups per block


def _kblock(bd, qt, row, b):
    # block b of a K-quant row (i8*) -> (pieces, sc, mn): the 8 pieces; sc, mn <G x float> (G =
    # _K_GROUPS[qt]) such that q in group g weighs sc_g * q - mn_g: Q4_K / Q5_K d * scale, dmin * min;
    # Q6_K d * scale, 32 d * scale
    o = bd.mul(b, ir.Constant(_I64, _IR_BLOCK_BYTES[qt]))
    v32 = ir.VectorType(_I8, 32)

    def at(k, ty):  # value of type ty at byte k of the block
        return _load(bd, row, bd.add(o, ir.Constant(_I64, k)), ty)

    def c8(v):
        return _vconst(_I8, 32, v)

    if qt == Q6_K:  # element 128h + 32k + l: low 4 bits in ql[64h + 32(k & 1) + l] (k >= 2: high
        pieces = []  # nibble), high 2 bits in qh[32h + l] >> 2k
        for h in range(2):
            ql0, ql1, qh = at(64 * h, v32), at(64 * h + 32, v32), at(128 + 32 * h, v32)
            pieces += [bd.or_(bd.and_(ql0, c8(15)), bd.shl(bd.and_(qh, c8(3)), c8(4))),
                       bd.or_(bd.and_(ql1, c8(15)), bd.shl(bd.and_(qh, c8(12)), c8(2))),
                       bd.or_(bd.lshr(ql0, c8(4)), bd.and_(qh, c8(48))),
                       bd.or_(bd.lshr(ql1, c8(4)), bd.lshr(bd.and_(qh, c8(192)), c8(2)))]
        d = bd.fpext(at(208, ir.HalfType()), _F32)
        sc = bd.fmul(bd.sitofp(at(192, ir.VectorType(_I8, 16)), ir.VectorType(_F32, 16)), _splat(bd, d, 16),
                     flags=_FAST)
        return pieces, sc, bd.fmul(sc, _vconst(_F32, 16, 32.0), flags=_FAST)
    # scales[12] at byte 4, as llama.cpp unpacks them: bytes 0-3 / 4-7 hold scales / mins 0-3 in their
    # low 6 bits, bytes 8-11 the low 4 bits of scales / mins 4-7 in their low / high nibbles, whose
    # top 2 bits are the top 2 bits of bytes 0-3 / 4-7
    v2 = ir.VectorType(_I32, 2)
    u = at(4, v2)  # bytes 0-3, 4-7
    u2 = _splat(bd, at(12, _I32), 2)  # bytes 8-11, twice
    lo = bd.and_(u, _vconst(_I32, 2, 0x3F3F3F3F))  # scales 0-3, mins 0-3
    hi = bd.or_(bd.and_(bd.lshr(u2, ir.Constant(v2, [ir.Constant(_I32, 0), ir.Constant(_I32, 4)])),
                        _vconst(_I32, 2, 0x0F0F0F0F)),
                bd.shl(bd.and_(bd.lshr(u, _vconst(_I32, 2, 6)), _vconst(_I32, 2, 0x03030303)),
                       _vconst(_I32, 2, 4)))
    d, dmin = bd.fpext(at(0, ir.HalfType()), _F32), bd.fpext(at(2, ir.HalfType()), _F32)
    sc, mn = (bd.fmul(bd.uitofp(bd.bitcast(_shuffle(bd, lo, [i, i + 2], hi), ir.VectorType(_I8, 8)),
                                ir.VectorType(_F32, 8)), _splat(bd, f, 8), flags=_FAST)
              for i, f in ((0, d), (1, dmin)))
    # qs[128]: piece 2c / 2c + 1 = low / high nibbles of qs[32c:32c + 32]; Q5_K: qh[32] before qs, bit
    # k of qh[l] the 5th bit of element l of piece k
    qs0 = 16 if qt == Q4_K else 48
    qh = at(16, v32) if qt == Q5_K else None
    pieces = []
    for c in range(4):
        v = at(qs0 + 32 * c, v32)
        for k, q in ((2 * c, bd.and_(v, c8(15))), (2 * c + 1, bd.lshr(v, c8(4)))):
            if qh is not None:  # (qh >> k & 1) << 4
                h = bd.shl(qh, c8(4 - k)) if k <= 4 else bd.lshr(qh, c8(k - 4))
                q = bd.or_(q, bd.and_(h, c8(16)))
            pieces.append(q)
    return pieces, sc, mn


def _khalf_f32(bd, q, h):
    # elements 16h..16h+15 of a piece as <16 x float>
    return bd.uitofp(_shuffle(bd, q, list(range(16 * h, 16 * h + 16))), ir.VectorType(_F32, 16))


def _fadd_wide(bd, acc, v):
    # acc + v, v <8 x float> added to the first 8 lanes of acc <8 or 16 x float>
    n = acc.type.count
    if n != v.type.count:
        v = _shuffle(bd, v, list(range(8)) + [8] * (n - 8), _vconst(_F32, 8, 0.0))
    return bd.fadd(acc, v, flags=_FAST)


def _make_kdot(qt, xq):
    """Intrinsic (w, rows, j, hi, x, xd, out) as _make_dot's, for K-quant rows: xq False: x float32 [C],
    xd its sums over 16 elements (_sums16; for the mins); xq True: x int8 [C], xd as _quantize_x returns."""
    G = _K_GROUPS[qt]

    def body(bd, ptrs, pos, nxt, nb, xp, xdp, op, lanes, accs):
        even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
        with cgutils.for_range(bd, nb) as loop:
            b = loop.index
            xo = bd.mul(b, ir.Constant(_I64, 256))
            xd16 = _load(bd, xdp, bd.mul(b, ir.Constant(_I64, 16)), ir.VectorType(_F32, 16))
            if xq:  # xd16: (dx, dx * sum of xq) of the block's 8 sub-blocks of 32
                xv = [_load(bd, xp, bd.add(xo, ir.Constant(_I64, 32 * k)), ir.VectorType(_I8, 32))
                      for k in range(8)]
                dxg = _shuffle(bd, xd16, [2 * (g * 8 // G) for g in range(G)])  # dx of each group
                xsum = _shuffle(bd, xd16, odd)  # Q4_K, Q5_K
                z = [None] * 8
                if qt == Q6_K:  # -32 * (sums of xq), the start of each piece's integer dot
                    z = [bd.sub(_vconst(_I32, lanes, 0), _int_dot(bd, qt, _vconst(_I8, 32, 32), v))
                         for v in xv]
            else:  # xd16: sums of x over 16 elements
                xv = [[_load(bd, xp, bd.add(xo, ir.Constant(_I64, 32 * k + 16 * h)),
                             ir.VectorType(_F32, 16)) for h in range(2)] for k in range(8)]
                xsum = xd16 if G == 16 else bd.fadd(_shuffle(bd, xd16, even), _shuffle(bd, xd16, odd),
                                                    flags=_FAST)
            _prefetch(bd, nxt, b, qt)
            for ptr, acc in zip(ptrs, accs):
                pieces, sc, mn = _kblock(bd, qt, ptr, b)
                a = bd.load(acc)
                if xq:
                    sv = bd.fmul(sc, dxg, flags=_FAST)  # d * scale * dx per group
                    for k, q in enumerate(pieces):
                        t = bd.sitofp(_int_dot(bd, qt, q, xv[k], z[k]), ir.VectorType(_F32, lanes))
                        s = _shuffle(bd, sv, [(2 * k + 2 * i // lanes) * G // 16 for i in range(lanes)])
                        a = bd.fadd(a, bd.fmul(t, s, flags=_FAST), flags=_FAST)
                else:
                    for k, q in enumerate(pieces):
                        t = [bd.fmul(_khalf_f32(bd, q, h), xv[k][h], flags=_FAST) for h in range(2)]
                        if G == 8:  # one scale for the piece
                            t = [bd.fadd(t[0], t[1], flags=_FAST)]
                        for g, th in enumerate(t):
                            s = _splat(bd, bd.extract_element(sc, ir.Constant(_I32, k * len(t) + g)), 16)
                            a = bd.fadd(a, bd.fmul(th, s, flags=_FAST), flags=_FAST)
                if not (xq and qt == Q6_K):  # - sum over the groups of mn * (sum of x over it)
                    a = _fadd_wide(bd, a, bd.fneg(bd.fmul(mn, xsum, flags=_FAST), flags=_FAST))
                bd.store(a, acc)
        for i, acc in zip(pos, accs):
            bd.store(_hsum(bd, bd.load(acc)), bd.gep(op, [i]))

    return _dot_intrinsic(qt, xq, body)


def _make_kaxpy(qt):
    """Intrinsic (w, rows, j, hi, a, p) as _make_axpy's, for K-quant rows."""
    G = _K_GROUPS[qt]

    def body(bd, ptrs, nxt, nb, cs, pp):
        with cgutils.for_range(bd, nb) as loop:
            b = loop.index
            _prefetch(bd, nxt, b, qt)
            blocks = [_kblock(bd, qt, ptr, b) for ptr in ptrs]
            scs = [bd.fmul(sc, _splat(bd, c, G), flags=_FAST) for (_, sc, _), c in zip(blocks, cs)]
            mins = _vconst(_F32, G, 0.0)  # sum over the rows of c * mn
            for (_, _, mn), c in zip(blocks, cs):
                mins = bd.fadd(mins, bd.fmul(mn, _splat(bd, c, G), flags=_FAST), flags=_FAST)
            for k in range(8):
                for h in range(2):
                    o = bd.add(bd.mul(b, ir.Constant(_I64, 256)), ir.Constant(_I64, 32 * k + 16 * h))
                    pv = _load(bd, pp, o, ir.VectorType(_F32, 16))
                    for (pieces, _, _), s in zip(blocks, scs):
                        s = _splat(bd, bd.extract_element(s, ir.Constant(_I32, (2 * k + h) * G // 16)), 16)
                        pv = bd.fadd(pv, bd.fmul(_khalf_f32(bd, pieces[k], h), s, flags=_FAST), flags=_FAST)
                    m = bd.extract_element(mins, ir.Constant(_I32, (2 * k + h) * G // 16))
                    pv = bd.fsub(pv, _splat(bd, m, 16), flags=_FAST)
                    bd.store(pv, bd.bitcast(bd.gep(pp, [o]), pv.type.as_pointer()), align=4)

    return _axpy_intrinsic(qt, body)


_q4_k_dot, _q5_k_dot, _q6_k_dot = (_make_kdot(qt, False) for qt in (Q4_K, Q5_K, Q6_K))
_q4_k_dot_xq, _q5_k_dot_xq, _q6_k_dot_xq = (_make_kdot(qt, True) for qt in (Q4_K, Q5_K, Q6_K))
_q4_k_axpy, _q5_k_axpy, _q6_k_axpy = (_make_kaxpy(qt) for qt in (Q4_K, Q5_K, Q6_K))
