"""Row dots of the float storage kinds (f32, fp16 bits, bf16 bits, int8) in LLVM vector IR, for `cpu`'s
GEMV over rows.

`_float_dot(w, rows, j, hi, x, out)` computes out[i] = w[rows[i], :C] . x[:C] for the _IR_ROWS rows i
in [j, min(j + _IR_ROWS, hi)), where C is the largest multiple of FLOAT_CHUNK not above the row
length (the caller adds the remaining columns and the row scale). It walks the rows side by side a
chunk of FLOAT_CHUNK elements at a time: one <16 x float> accumulator per row, x loaded once per
chunk for all the rows, each element widened in registers (fp16: vcvtph2ps; bf16: a 16-bit shift;
int8: a conversion), and while a group of rows is read the next group's chunk at the same offset is
prefetched into L2 (prefetcht1), as the GGUF block kernels do (quant/vector.py). numba's own loop
(the block of 8 rows in `cpu`) vectorises to 256-bit vectors without prefetching: the IR reads fp16
rows from DRAM about 1.2x as fast on the 2-core AVX-512 Xeon and the same from cache
(`tools/bench_kernels.py --llama` compares both sides of a decode with llama.cpp).

Rows past `hi` repeat row hi - 1 (and store its value again), so a span's last, partial group
needs no scalar loop; the pointers come from numba arrays and the caller (`cpu._gemv_span`) keeps
j, hi within rows.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hotcold.sparse_ops.quant.vector import _IR_ROWS, _hsum, _load, _vconst

FLOAT_CHUNK = 32  # elements per row and step: one 64-byte line of a 16-bit row
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_FAST = ("fast",)
_LANES = 16
# numba storage type -> (LLVM element type, bytes)
_ELEM = {types.float32: (_F32, 4), types.int16: (_I16, 2), types.uint16: (_I16, 2), types.int8: (_I8, 1)}


def _widen(bd, dtype, v):
    """<n x storage> -> <n x float>: f32 as is, int16 as fp16 bits, uint16 as bf16 bits, int8 by value."""
    n = v.type.count
    ft = ir.VectorType(_F32, n)
    if dtype == types.float32:
        return v
    if dtype == types.int16:
        return bd.fpext(bd.bitcast(v, ir.VectorType(ir.HalfType(), n)), ft)
    if dtype == types.uint16:
        return bd.bitcast(bd.shl(bd.zext(v, ir.VectorType(_I32, n)), _vconst(_I32, n, 16)), ft)
    return bd.sitofp(v, ft)


def float_dot_types_ok(w, rows, x, out) -> bool:
    """Whether _float_dot takes these numba types: w a C-contiguous 2-D array of a float storage kind,
    rows int64, x and out C-contiguous float32 (the typing of `cpu`'s row dot picks a loop otherwise)."""
    return (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and w.dtype in _ELEM
            and isinstance(rows, types.Array) and rows.ndim == 1 and rows.dtype == types.int64
            and all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.float32
                    for a in (x, out)))


def _row_ptr(context, bd, sig, args, base, stride, i, bound):
    # pointer (i8*) to row rows[min(i, bound)] of w
    i = bd.select(bd.icmp_signed("<", i, bound), i, bound)
    ra = context.make_array(sig.args[1])(context, bd, args[1])
    row = bd.load(cgutils.get_item_pointer(context, bd, sig.args[1], ra, [i]))
    return bd.gep(base, [bd.mul(row, stride)]), i


@intrinsic
def _float_dot(typingctx, w, rows, j, hi, x, out):
    """See the module docstring. w: [R, C] float32 | int16 | uint16 | int8; rows int64 [K]; j, hi: int;
    x, out: float32, C-contiguous."""
    if not float_dot_types_ok(w, rows, x, out):
        return None

    def codegen(context, bd, sig, args):
        et, esz = _ELEM[sig.args[0].dtype]
        wa = context.make_array(sig.args[0])(context, bd, args[0])
        xp = context.make_array(sig.args[4])(context, bd, args[4]).data
        op = context.make_array(sig.args[5])(context, bd, args[5]).data
        base = bd.bitcast(wa.data, ir.PointerType(_I8))
        stride = bd.extract_value(wa.strides, 0)
        last = bd.sub(args[3], ir.Constant(_I64, 1))
        end = bd.sub(bd.extract_value(context.make_array(sig.args[1])(context, bd, args[1]).shape, 0),
                     ir.Constant(_I64, 1))
        ptrs, pos, nxt = [], [], []
        for r in range(_IR_ROWS):
            p, i = _row_ptr(context, bd, sig, args, base, stride, bd.add(args[2], ir.Constant(_I64, r)), last)
            ptrs.append(p)
            pos.append(i)
            nxt.append(_row_ptr(context, bd, sig, args, base, stride,
                                bd.add(args[2], ir.Constant(_I64, _IR_ROWS + r)), end)[0])
        nc = bd.sdiv(bd.extract_value(wa.shape, 1), ir.Constant(_I64, FLOAT_CHUNK))
        vt = ir.VectorType(_F32, _LANES)
        accs = [cgutils.alloca_once_value(bd, _vconst(_F32, _LANES, 0.0)) for _ in ptrs]
        pf = bd.module.declare_intrinsic("llvm.prefetch", [ir.PointerType(_I8)],
                                         fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8), _I32, _I32, _I32]))
        lines = -(-FLOAT_CHUNK * esz // 64)
        with cgutils.for_range(bd, nc) as loop:
            xo = bd.mul(loop.index, ir.Constant(_I64, FLOAT_CHUNK))
            bo = bd.mul(xo, ir.Constant(_I64, esz))
            for p in nxt:  # read, locality 2 (L2), data
                for k in range(lines):
                    bd.call(pf, [bd.gep(p, [bd.add(bo, ir.Constant(_I64, 64 * k))]), ir.Constant(_I32, 0),
                                 ir.Constant(_I32, 2), ir.Constant(_I32, 1)])
            offs = [bd.add(xo, ir.Constant(_I64, h)) for h in range(0, FLOAT_CHUNK, _LANES)]
            xv = [_load(bd, xp, o, vt) for o in offs]
            for p, acc in zip(ptrs, accs):
                a = bd.load(acc)
                for o, xx in zip(offs, xv):
                    wv = _load(bd, bd.bitcast(p, et.as_pointer()), o, ir.VectorType(et, _LANES))
                    a = bd.fadd(a, bd.fmul(_widen(bd, sig.args[0].dtype, wv), xx, flags=_FAST), flags=_FAST)
                bd.store(a, acc)
        for i, acc in zip(pos, accs):
            bd.store(_hsum(bd, bd.load(acc)), bd.gep(op, [i]))
        return context.get_dummy_value()

    return types.void(w, rows, j, hi, x, out), codegen


__all__ = ["FLOAT_CHUNK", "_float_dot", "float_dot_types_ok"]
