"""CPU kernels over GGUF-quantised rows: GEMV / axpy / fused FFN that decode blocks as they read them.

A `QuantMatrix` is R rows of C logical columns, each row a contiguous run of C / block_size GGUF
blocks of one type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), held as uint8 [R, bytes_per_row]: exactly
what `gguf.GGUFReader` exposes for a quantised tensor, so a memory-mapped file is used in place.
The kernels never expand the matrix: each block is decoded in registers and multiplied by float32
x (or accumulated into out), reading only the selected rows, several side by side (8 on AVX-512, else
4; see the LLVM IR sections below). Accumulation is float32. Same threading model as `cpu`: numba,
`nogil`, thread count from `cpu.set_threads` in the calling thread.

Offsets that are constant over a block (Q4_1's / Q5_1's min, the K-quants' mins, Q6_K's -32; with Q8
activations also Q4_0's -8 and Q5_0's -16) are applied once per sub-block with precomputed sums of x,
not per weight.

Block layouts (from `gguf.quants`; d, dmin are fp16, element index i within the block):
  Q8_0  34 B / 32:  d, qs int8[32]                       w = d * qs[i]
  Q4_0  18 B / 32:  d, qs[16]                            w = d * (nib(i) - 8); nib(i): i < 16 low nibble
                                                         of qs[i], else high nibble of qs[i - 16]
  Q4_1  20 B / 32:  d, m, qs[16]                         w = d * nib(i) + m
  Q5_0  22 B / 32:  d, qh uint32, qs[16]                 w = d * (q(i) - 16); q(i) = nib(i) | (qh bit i) << 4
  Q5_1  24 B / 32:  d, m, qh uint32, qs[16]              w = d * q(i) + m
  Q4_K 144 B / 256: d, dmin, scales[12], qs[128]         8 sub-blocks of 32, 6-bit scale sc_s / min m_s:
                    w = d * sc_s * q - dmin * m_s; sub-block 2c / 2c+1 = low / high nibbles of qs[32c:32c+32]
  Q5_K 176 B / 256: d, dmin, scales[12], qh[32], qs[128] as Q4_K with a 5th bit (qh[l] >> s) & 1
  Q6_K 210 B / 256: ql[128], qh[64], scales int8[16], d  16 sub-blocks of 16: w = d * sc_g * (q - 32)

Q8 activations (`xq=True`; every type): x is quantised per 32-block to int8 with a float32 scale, as
llama.cpp does (it uses 256-blocks for the K-quants), and blocks are dotted in integers (AVX-512 VNNI
where the CPU has it; see the LLVM IR sections). That reads the nibble and K-quant types' rows
1.3-1.7x faster than float x (on 2 threads of a 2-core AVX-512 machine Q4_0 19.6 against 14.1 GB/s of
weights; Q8_0's rows about the same; `tools/bench_quant.py --flush-mb 128` measures each). It costs
accuracy (`tools/bench_quant.py --xq-error`: quantised Gaussian W [4096, 4096], relative RMS error of
y = W x, Gaussian x | x with 8 outlier channels at 30x): against the stored weights 0.0053 | 0.0107 for
every type (0 for float x); against the float weights, float x -> xq:
  Q8_0 0.0054 -> 0.0075 | 0.0052 -> 0.0119     Q4_0 0.0861 -> 0.0864 | 0.0833 -> 0.0841
  Q4_1 0.0774 -> 0.0775 | 0.0759 -> 0.0769     Q5_0 0.0430 -> 0.0434 | 0.0414 -> 0.0427
  Q5_1 0.0378 -> 0.0381 | 0.0368 -> 0.0383     Q4_K 0.0773 -> 0.0775 | 0.0754 -> 0.0764
  Q5_K 0.0377 -> 0.0379 | 0.0373 -> 0.0388     Q6_K 0.0192 -> 0.0199 | 0.0186 -> 0.0215
xq is the default only where its error is lost in the weights' own (`XQ_DEFAULT`): Q4_0, Q4_1 and
Q4_K (+0.1-0.3% / +1-1.4%). The 5-bit types' nearly is (Q5_0 +0.9% / +3%, Q5_1 +0.8% / +4%, Q5_K
+0.5% / +4%); for Q6_K it would add 4% / 16%, for Q8_0 40% / 130%. (Q5_0 in XQ_DEFAULT would make
Gemma 3 270M Q4_K_M, whose attention and FFN gate / up are Q5_0, decode about 4% faster.)
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hotcold.sparse_ops.cpu import ACTS, _act, _keep_active, _rows_in_range, batch_input, get_threads

__all__ = ["QuantMatrix", "qgemv_rows", "qgemv", "qaxpy_rows", "qffn_rows", "qffn_rows_batch", "qdequantize",
           "qexperts", "qexperts_trusted", "qexperts_tokens", "check_expert_stacks", "qexpert_batch", "gemm_operands", "gemm_scratch",
           "GEMM_BF16", "transpose_quantized", "quantize_rows", "dequantize_rows", "random_matrix", "pack_rows",
           "QTYPES", "DOWN_T_DEFAULT", "XQ_DEFAULT", "PACK_DEFAULT"]

# name -> (ggml type id, elements per block, bytes per block)
QTYPES = {"Q8_0": (8, 32, 34), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
          "Q5_1": (7, 32, 24), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
_NAME_OF_ID = {v[0]: k for k, v in QTYPES.items()}
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (
    QTYPES[k][0] for k in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
DOWN_T_DEFAULT = "Q8_0"  # type of the transposed W_down built at load time (see transpose_quantized)
XQ_DEFAULT = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # types whose GEMVs quantise x to Q8 by default (see module docstring)
_XQ_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # types with Q8-activation kernels
_JIT = dict(parallel=True, nogil=True, fastmath=True, cache=True)
_INLINE = dict(nogil=True, fastmath=True, inline="always")  # the row drivers, inlined into their kernels
_BLOCK = 8  # rows per parallel task


# ---------------------------------------------------------------------------------------------
# QuantMatrix

def _qtype_name(qtype) -> str:
    """'Q4_K' | ggml type id 12 | gguf.GGMLQuantizationType.Q4_K -> 'Q4_K'."""
    name = getattr(qtype, "name", qtype)
    if isinstance(name, (int, np.integer)) and int(name) in _NAME_OF_ID:
        return _NAME_OF_ID[int(name)]
    if isinstance(name, str) and name.upper() in QTYPES:
        return name.upper()
    raise ValueError(f"unsupported quantisation type {qtype!r}; supported: {', '.join(QTYPES)}")


class QuantMatrix:
    """R rows of `cols` logical columns stored as GGUF blocks of one type, uint8 [R, bytes_per_row].

    data: uint8 [R, cols / block_size * block_bytes], C-contiguous rows (a memmap view is kept as is);
      interleaved: uint8 [R / 8, 8 * bytes_per_row], groups of 8 rows with their blocks interleaved
      (see `pack_rows`: read only whole, by qgemv and qdequantize)
    qtype: "Q8_0" | "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" | "Q4_K" | "Q5_K" | "Q6_K", a ggml type id or GGMLQuantizationType
    shape: logical (R, cols)
    """

    def __init__(self, data: np.ndarray, qtype, shape: tuple[int, int], interleaved: bool = False):
        name = _qtype_name(qtype)
        _, bs, ts = QTYPES[name]
        if len(shape) != 2:
            raise ValueError(f"shape must be (rows, cols), got {shape}")
        r, c = int(shape[0]), int(shape[1])
        if c <= 0 or c % bs:
            raise ValueError(f"{name} needs cols to be a positive multiple of {bs}, got {c}")
        want = (r, c // bs * ts)
        if interleaved:
            if QTYPES[name][0] not in _X8_TYPES or r % X8:
                raise ValueError(f"no interleaved layout for {name} with {r} rows")
            want = (r // X8, X8 * want[1])
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != want:
            raise ValueError(f"{name} data for shape {(r, c)} must be a uint8 array of shape {want}, got "
                             f"{getattr(data, 'dtype', type(data))} {getattr(data, 'shape', '')}")
        if not data.flags.c_contiguous:
            raise ValueError("data must be C-contiguous")
        self.data, self.qtype, self.shape, self.interleaved = data, name, (r, c), interleaved
        self._id = QTYPES[name][0]
        self._all_rows: np.ndarray | None = None

    @classmethod
    def from_gguf(cls, tensor) -> "QuantMatrix":
        """From a `gguf.GGUFReader` tensor (its `data` is uint8 [rows, bytes_per_row]; `shape` is ggml's
        [cols, rows]). No copy."""
        ne = [int(v) for v in tensor.shape]
        if len(ne) != 2:
            raise ValueError(f"{tensor.name}: expected a 2-D tensor, got ggml shape {ne}")
        return cls(tensor.data, tensor.tensor_type, (ne[1], ne[0]))

    @classmethod
    def quantize(cls, w: np.ndarray, qtype) -> "QuantMatrix":
        """Quantise a float [R, C] array (see `quantize_rows`)."""
        name = _qtype_name(qtype)
        w = np.asarray(w, np.float32)
        return cls(quantize_rows(w, name), name, w.shape)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def block_size(self) -> int:
        return QTYPES[self.qtype][1]

    def row_bytes(self) -> int:
        """Bytes a kernel reads per selected row."""
        return self.data.shape[1] // X8 if self.interleaved else self.data.shape[1]

    def row_data(self, rows: np.ndarray | None = None) -> np.ndarray:
        """uint8 [K, row_bytes] of rows (all when None) in the GGUF layout (a copy if interleaved)."""
        if not self.interleaved:
            return self.data if rows is None else self.data[np.asarray(rows, np.int64)]
        rows = np.arange(self.rows, dtype=np.int64) if rows is None else _as_rows(rows, self.rows)
        out = np.empty((rows.shape[0], self.row_bytes()), np.uint8)
        if rows.shape[0]:
            _x8_rows_kernel(self.data, _x8_table(self._id), rows, out)
        return out

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 [K, cols] of rows (all when None), through gguf.quants (for tests / references)."""
        return dequantize_rows(self.row_data(rows), self.qtype, self.cols)

    def __repr__(self) -> str:
        lay = ", interleaved" if self.interleaved else ""
        return f"QuantMatrix({self.qtype}, shape={self.shape}{lay}, {self.nbytes / 2**20:.1f} MiB)"


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


_IR_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24}
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


# ---------------------------------------------------------------------------------------------
# K-quants (Q4_K, Q5_K, Q6_K) in LLVM vector IR: the scheme above (_IR_ROWS rows side by side, one
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
# instead of in mn: 12% slower. Like the IR kernels above, these read rows from DRAM two to three times
# as fast as numba loops over blocks (`tools/bench_quant.py`).

_IR_BLOCK_BYTES.update({Q4_K: 144, Q5_K: 176, Q6_K: 210})
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


# ---------------------------------------------------------------------------------------------
# Row-interleaved Q4_0 / Q4_1 / Q4_K / Q8_0 ("x8"): a dense matrix's rows in groups of 8 whose blocks are
# interleaved, for the one-token GEMV over all rows (attention, the LM head, dense FFNs). The
# kernels above handle a block per row: its scale, nibble unpacking, integer dot, conversion and
# scaling cost ~14 instructions per 32 weights, so Q4_0 / Q4_K with Q8 activations are compute-bound
# (on 2 threads of a 2-core machine 31 / 34 GB/s where Q8_0's rows stream at 49).
# Interleaved, that work is shared by 8 rows. Block b of group g (rows 8g..8g+7) holds the same bytes
# as the 8 rows' blocks b, field by field (`_X8_FIELDS`), each field cut into units (2 bytes for an
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

X8 = 8  # rows per interleaved group
_X8_FIELDS = {  # per type: (byte offset in the GGUF block, bytes, unit), in the interleaved order
    Q4_0: ((0, 2, 2), (2, 16, 4)),  # d, qs
    Q4_K: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),  # d, dmin, scales, qs
    Q8_0: ((0, 2, 2), (2, 32, 4)),  # d, qs
    Q4_1: ((0, 2, 2), (2, 2, 2), (4, 16, 4)),  # d, m, qs
}
_X8_TYPES = tuple(_X8_FIELDS)
PACK_DEFAULT = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q8_0"})  # types `pack_rows` may interleave (see there)


def _dot4(bd, acc, q, xq, nibbles=False):
    # acc + the sums of 4 products q[4l..4l+3] . xq[4l..4l+3] per int32 lane l; q <32 x i8> unsigned,
    # xq signed; acc <8 x i32>. nibbles: q < 16, so that AVX2's pmaddubsw (u8 x s8, adjacent pairs
    # summed in int16 with saturation) cannot saturate (2 x 15 x 128 < 2^15; Q8_0's q + 128 could)
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


def _x8_nibble_dots(bd, row, o, xp, xo, chunks):
    # 32-byte chunks of nibbles at row + o + 32k (k < chunks), x's Q8 values at xp + xo -> (low, high)
    # <8 x i32> per-row dots: chunk k's low nibbles against x[xo + 4k..], its high ones against
    # x[xo + 4 chunks + 4k..] (Q4_0: elements 4k and 16 + 4k; Q4_K: sub-blocks 2c, 2c + 1)
    v32 = ir.VectorType(_I8, 32)
    sums = [_vconst(_I32, 8, 0), _vconst(_I32, 8, 0)]
    for k in range(chunks):
        qs = _load(bd, row, bd.add(o, ir.Constant(_I64, 32 * k)), v32)
        for h, q in enumerate((bd.and_(qs, _vconst(_I8, 32, 15)), bd.lshr(qs, _vconst(_I8, 32, 4)))):
            xv = _load(bd, xp, bd.add(xo, ir.Constant(_I64, 4 * (chunks * h + k))), _I32)
            sums[h] = _dot4(bd, sums[h], q, bd.bitcast(_splat(bd, xv, 8), v32), nibbles=True)
    return sums


def _x8_xd(bd, xdp, k):
    # (dx, dx * sum of xq) of x's 32-block k (as _quantize_x stores them), each splat over 8 lanes
    k2 = bd.mul(k, ir.Constant(_I64, 2))
    return tuple(_splat(bd, bd.load(bd.gep(xdp, [bd.add(k2, ir.Constant(_I64, i))])), 8) for i in (0, 1))


def _x8_q4_block(bd, row, o, b, xp, xdp, qt):
    # block b of a Q4_0 / Q4_1 group at row + o -> <8 x float>: each row's block . x
    f8, h8 = ir.VectorType(_F32, 8), ir.VectorType(ir.HalfType(), 8)
    d = bd.fpext(_load(bd, row, o, h8), f8)
    qs = 16 if qt == Q4_0 else 32  # Q4_1: the 8 rows' m after their d
    lo, hi = _x8_nibble_dots(bd, row, bd.add(o, ir.Constant(_I64, qs)), xp, bd.mul(b, ir.Constant(_I64, 32)), 4)
    dx, sx = _x8_xd(bd, xdp, b)
    t = bd.fmul(bd.fmul(bd.sitofp(bd.add(lo, hi), f8), dx, flags=_FAST), d, flags=_FAST)
    if qt == Q4_0:  # sum((q - 8) xq) dx = dot dx - 8 dx sum(xq)
        return bd.fsub(t, bd.fmul(d, bd.fmul(_vconst(_F32, 8, 8.0), sx, flags=_FAST), flags=_FAST), flags=_FAST)
    m = bd.fpext(_load(bd, row, bd.add(o, ir.Constant(_I64, 16)), h8), f8)  # w = d q + m
    return bd.fadd(t, bd.fmul(m, sx, flags=_FAST), flags=_FAST)


def _x8_q8_0_block(bd, row, o, b, xp, xdp):
    # block b of a Q8_0 group at row + o -> <8 x float>: each row's block . x; the int8 q go into
    # vpdpbusd's unsigned operand as q + 128 (the sign bit flipped), and 128 sum(xq) comes off
    f8, v32 = ir.VectorType(_F32, 8), ir.VectorType(_I8, 32)
    d = bd.fpext(_load(bd, row, o, ir.VectorType(ir.HalfType(), 8)), f8)
    sums = [_vconst(_I32, 8, 0), _vconst(_I32, 8, 0)]  # two chains
    for k in range(8):
        q = bd.xor(_load(bd, row, bd.add(o, ir.Constant(_I64, 16 + 32 * k)), v32), _vconst(_I8, 32, -128))
        xv = _load(bd, xp, bd.add(bd.mul(b, ir.Constant(_I64, 32)), ir.Constant(_I64, 4 * k)), _I32)
        sums[k % 2] = _dot4(bd, sums[k % 2], q, bd.bitcast(_splat(bd, xv, 8), v32))
    dx, sx = _x8_xd(bd, xdp, b)
    t = bd.fsub(bd.fmul(bd.sitofp(bd.add(sums[0], sums[1]), f8), dx, flags=_FAST),
                bd.fmul(_vconst(_F32, 8, 128.0), sx, flags=_FAST), flags=_FAST)
    return bd.fmul(d, t, flags=_FAST)


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


def _x8_q4_k_block(bd, row, o, b, xp, xdp):
    # block b (256 elements) of a Q4_K group at row + o -> <8 x float>: each row's block . x
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
            t = bd.fmul(bd.sitofp(dot, f8), dx, flags=_FAST)
            acc_sc = bd.fadd(acc_sc, bd.fmul(lanes(sc, s), t, flags=_FAST), flags=_FAST)
            acc_mn = bd.fadd(acc_mn, bd.fmul(lanes(mn, s), sx, flags=_FAST), flags=_FAST)
    return bd.fsub(bd.fmul(d, acc_sc, flags=_FAST), bd.fmul(dmin, acc_mn, flags=_FAST), flags=_FAST)


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
                v = block(bd, row, bd.mul(b, ir.Constant(_I64, gb)), b, xp, xdp)
                bd.store(bd.fadd(bd.load(acc), v, flags=_FAST), acc)
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
def _qgemv_x8_kernel(qt, w, x, out):
    # out = W x over all rows of an interleaved matrix w: uint8 [R / 8, ...] of type qt; out [R]
    xq, xd = _quantize_x(x)
    for g in prange(w.shape[0]):
        _x8_dot_any(qt, w, g, xq, xd, out)


def _x8_table(qt) -> np.ndarray:
    # int64 [F, 4]: per field (source offset, bytes, unit, offset in the interleaved block)
    rows, dst = [], 0
    for off, size, unit in _X8_FIELDS[qt]:
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
    # interleaved (the fields of _X8_FIELDS): one strided copy per field straight into out, in units
    # of the field's unit (2- and 4-byte elements, possibly unaligned: 4-5x faster than byte copies
    # through a transposed reshape and a concatenation)
    g = src.size // (X8 * nb * ts)
    base = 0
    for off, size, unit in _X8_FIELDS[qt]:
        dt, k = _UNIT_DTYPES[unit], size // unit
        rows = np.ndarray((g, X8, nb, k), dt, buffer=src, offset=off, strides=(X8 * nb * ts, nb * ts, ts, unit))
        dst = np.ndarray((g, nb, k, X8), dt, buffer=out, offset=base, strides=(X8 * nb * ts, X8 * ts, X8 * unit, unit))
        dst[...] = rows.transpose(0, 2, 3, 1)
        base += X8 * size


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


# Q8 activations: xq int8 [C] and xd float32 [C/16] = (dx_b, dx_b * sum of xq over b) per 32-block
# b, so that block b of x ~ xq * dx_b.

@njit(nogil=True, fastmath=True, cache=True)
def _quantize_span(x, lo, hi, xq, xd):
    # blocks [lo / 32, hi / 32) of x (lo, hi multiples of 32) into xq int8 [C], xd float32 [C / 16]
    for b in range(lo // 32, hi // 32):
        amax = np.float32(0.0)
        for l in range(32):
            amax = max(amax, abs(x[32 * b + l]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for l in range(32):
            q = np.int32(np.round(x[32 * b + l] * inv))
            xq[32 * b + l] = q
            s += q
        xd[2 * b] = d
        xd[2 * b + 1] = d * np.float32(s)


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_x(x):
    # x: [C] float32 -> (xq int8 [C], xd float32 [C/16]) as described above
    xq = np.empty(x.shape[0], np.int8)
    xd = np.empty(2 * (x.shape[0] // 32), np.float32)
    _quantize_span(x, 0, x.shape[0], xq, xd)
    return xq, xd


@njit(nogil=True, fastmath=True, cache=True)
def _sums16_span(x, lo, hi, xs):
    # xs[i] = sum of x[16 i : 16 i + 16] for i in [lo / 16, hi / 16) (lo, hi multiples of 16)
    for i in range(lo // 16, hi // 16):
        s = np.float32(0.0)
        for l in range(16):
            s += x[16 * i + l]
        xs[i] = s


@njit(nogil=True, fastmath=True, cache=True)
def _sums16(x):
    # x: [C] -> float32 [C / 16] sums of 16 consecutive elements
    xs = np.empty(x.shape[0] // 16, np.float32)
    _sums16_span(x, 0, x.shape[0], xs)
    return xs


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
def _qgemv_rows_kernel(qt, w, rows, x, use_xq, out):
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
def _qffn_one_kernel(x, rows, qu, up, gate, qd, down, act, gated, use_xq, bias, use_bias, scale, use_scale,
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
    keep, h = _keep_active(z, rows, bias, use_bias, act)
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
    for j in range(k * I + lo, k * I + hi):
        h[j] = _act(g[j], act) * u[j] * coef[k]
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
def _qexperts_one_kernel(x, first, coef, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down, out):
    # One token through n whole experts (MoE decode). Expert k's gate / up rows are [first[k] I,
    # (first[k] + 1) I) of gate / up (type qu); its W_down, as GGUF stores it (blocks along the neuron
    # axis), rows [first[k] D, (first[k] + 1) D) of down (type qd). gu_x8 / d_x8: the matrices are
    # interleaved (pack_rows; Q8 activations). Two parallel phases (each a fork/join of the thread
    # team): (1) per task, 32 rows of one expert: g, u, h = act(g) u coef[k], and h's sums of 16 and
    # Q8 blocks (when xq_down); (2) per task, a span of output rows d: part[k D + d] = W_down_k[d] .
    # h_k for every expert k over its own blocks, then out[d] += their sum (in k order).
    n, D = first.shape[0], x.shape[0]
    K = n * I
    xs = _sums16(x)
    if xq_up:
        xq, xd = _quantize_x(x)
    else:
        xq, xd = np.empty(0, np.int8), np.empty(0, np.float32)
    g = np.empty(K, np.float32)
    u = np.empty(K, np.float32)
    h = np.empty(K, np.float32)
    hs = np.empty(K // 16, np.float32)  # I is a multiple of 32: no block straddles two experts
    hq = np.empty(K if xq_down else 0, np.int8)
    hd = np.empty(K // 16 if xq_down else 0, np.float32)
    step = 4 * _BLOCK  # rows per task: a multiple of X8 and of the 32 of a Q8 block
    ni = (I + step - 1) // step
    for t in prange(n * ni):
        k, c = t // ni, t % ni
        lo, hi = c * step, min(I, (c + 1) * step)
        _expert_h_span(qu, gate, up, gu_x8, first, k, I, lo, hi, x, xs, xq, xd, xq_up, coef, act, xq_down, g, u, h, hs,
                       hq, hd)
    part = np.empty(n * D, np.float32)
    sd = 2 * _BLOCK  # output rows per task (a multiple of X8)
    nd = (D + sd - 1) // sd
    for c in prange(nd):
        lo, hi = c * sd, min(D, (c + 1) * sd)
        for k in range(n):
            _expert_down_span(qd, down, d_x8, first, k, D, lo, hi, I, h, hs, hq, hd, xq_down, part)
        for d in range(lo, hi):
            acc = np.float32(0.0)
            for k in range(n):
                acc += part[k * D + d]
            out[d] += acc


@njit(**_JIT)
def _qexperts_pairs_kernel(X, tok, first, coef, starts, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down,
                           out):
    # Several tokens through whole experts (MoE prefill): pair j is token tok[j] through the expert at
    # position first[j] with weight coef[j]; the pairs are grouped by expert, group k = pairs
    # [starts[k], starts[k+1]). _qexperts_one_kernel's two phases over pairs instead of experts:
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
def _qdequant_kernel(qt, w, rows, out):
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

# ---------------------------------------------------------------------------------------------
# Python entry points

def _as_rows(rows: np.ndarray, n: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    if not _rows_in_range(rows, n):
        raise IndexError(f"row index out of range [0, {n})")
    return rows


def _as_f32(a: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a)


def _check_out(out: np.ndarray, shape: tuple) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}")
    return out


def _check_m(m, name: str = "m", whole: bool = False) -> None:
    # whole: the caller reads all rows (interleaved matrices allowed)
    if not isinstance(m, QuantMatrix):
        raise ValueError(f"{name} must be a QuantMatrix, got {type(m).__name__}")
    if m.interleaved and not whole:
        raise ValueError(f"{name} is interleaved (pack_rows): only qgemv and qdequantize read it")


def pack_rows(m: QuantMatrix, xq: bool | None = None) -> QuantMatrix:
    """m in the interleaved layout (see "Row-interleaved ..." above) when its type is in
    PACK_DEFAULT, its rows are a multiple of 8 and Q8 activations suit it (xq None: its type is in
    XQ_DEFAULT; True: the caller accepts them, e.g. for Q8_0 predictors); else m. For matrices only
    read whole: one-token qgemv over all rows runs 1.5-1.9x faster (1 thread, from DRAM); qdequantize
    (prefill) reads it too; row selections do not. m's data is left as it is (the caller may drop
    its file pages)."""
    _check_m(m, whole=True)
    if xq is None:
        xq = m.qtype in XQ_DEFAULT
    if m.interleaved or m.qtype not in PACK_DEFAULT or not xq or m.rows % X8:
        return m
    nb, ts = m.cols // QTYPES[m.qtype][1], QTYPES[m.qtype][2]
    src = np.ascontiguousarray(m.data).reshape(-1)  # [G * 8 * nb * ts]: G groups of 8 rows
    out = np.empty((m.rows // X8, X8 * nb * ts), np.uint8)
    _interleave(m._id, src, nb, ts, out)
    return QuantMatrix(out, m.qtype, m.shape, interleaved=True)


def qgemv_rows(m: QuantMatrix, rows: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
               xq: bool | None = None) -> np.ndarray:
    """out[i] = m[rows[i]] · x. rows int [K]; x float32 [cols]; returns out float32 [K] (overwritten).

    xq: quantise x to Q8 per 32-block and dot in integers (None: when m's type is in `XQ_DEFAULT`)."""
    _check_m(m)
    rows = _as_rows(rows, m.rows)
    x = _as_f32(x, (m.cols,), "x")
    out = np.empty(rows.shape[0], np.float32) if out is None else _check_out(out, rows.shape)
    if xq is None:
        xq = m.qtype in XQ_DEFAULT
    if xq and m.qtype not in _XQ_TYPES:
        raise ValueError(f"xq=True supports {', '.join(_XQ_TYPES)}, not {m.qtype}")
    if rows.shape[0]:
        _qgemv_rows_kernel(m._id, m.data, rows, x, bool(xq), out)
    return out


def qgemv(m: QuantMatrix, x: np.ndarray, out: np.ndarray | None = None, xq: bool | None = None) -> np.ndarray:
    """Dense out = m @ x over all rows. x float32 [cols] -> out float32 [rows]. An interleaved m
    (`pack_rows`) always takes Q8 activations."""
    _check_m(m, whole=True)
    if m.interleaved:
        if xq is False:
            raise ValueError("an interleaved matrix takes Q8 activations only (xq=False is not available)")
        x = _as_f32(x, (m.cols,), "x")
        out = np.empty(m.rows, np.float32) if out is None else _check_out(out, (m.rows,))
        _qgemv_x8_kernel(m._id, m.data, x, out)
        return out
    if m._all_rows is None:
        m._all_rows = np.arange(m.rows, dtype=np.int64)
    return qgemv_rows(m, m._all_rows, x, out, xq)


def qaxpy_rows(m: QuantMatrix, rows: np.ndarray, coeff: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[cols] += sum_i coeff[i] * m[rows[i]] (down projection with m = W_down transposed)."""
    _check_m(m)
    rows = _as_rows(rows, m.rows)
    coeff = _as_f32(coeff, rows.shape, "coeff")
    _check_out(out, (m.cols,))
    k = rows.shape[0]
    if k:
        _qaxpy_rows_kernel(m._id, m.data, rows, coeff, min(get_threads(), k), out)
    return out


def qffn_rows(x: np.ndarray, rows: np.ndarray, up: QuantMatrix, down_t: QuantMatrix, act: str,
              gate: QuantMatrix | None = None, out: np.ndarray | None = None,
              xq: bool | None = None, up_bias: np.ndarray | None = None,
              row_scale: np.ndarray | None = None) -> np.ndarray:
    """Fused sparse FFN of one token over the selected neurons; returns out float32 [D] (+=).

    x float32 [D]; up, gate [I, D] (same type); down_t [I, D], W_down transposed (any type, see
    `transpose_quantized`). h_j = act(gate_j·x) * (up_j·x) when gate is given, else
    act(up_j·x + up_bias_j); out += sum_j h_j * row_scale_j * down_t[j] over j in rows (row_scale
    float32 [I] or None: e.g. the routing weight of the expert a row belongs to). act: relu | silu |
    gelu_tanh. xq: as in `qgemv_rows`, for gate / up (None: when up's type is in `XQ_DEFAULT`).
    """
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    _check_m(up, "up")
    _check_m(down_t, "down_t")
    n, d = up.shape
    if down_t.shape != (n, d):
        raise ValueError(f"down_t has shape {down_t.shape}, expected {(n, d)} like up (W_down transposed)")
    if gate is not None:
        _check_m(gate, "gate")
        if gate.shape != (n, d) or gate.qtype != up.qtype:
            raise ValueError(f"gate must be {up.qtype} {(n, d)} like up, got {gate.qtype} {gate.shape}")
    x = _as_f32(x, (d,), "x")
    rows = _as_rows(rows, n)
    out = np.zeros(d, np.float32) if out is None else _check_out(out, (d,))
    k = rows.shape[0]
    if k:
        g = gate if gate is not None else up
        use_xq = up.qtype in XQ_DEFAULT if xq is None else bool(xq)
        bias = _NONE if (up_bias is None or gate is not None) else _as_f32(up_bias, (n,), "up_bias")
        scale = _NONE if row_scale is None else _as_f32(row_scale, (n,), "row_scale")
        _qffn_one_kernel(x, rows, up._id, up.data, g.data, down_t._id, down_t.data, ACTS[act],
                         gate is not None, use_xq, bias, bias is not _NONE, scale, scale is not _NONE,
                         min(get_threads(), k), out)
    return out


_NONE = np.zeros(1, np.float32)
BATCH_CHUNK_BYTES = 16 << 20  # float32 rows decoded at once by qffn_rows_batch


def gemm_operands(m: QuantMatrix, rows: np.ndarray, buf: np.ndarray | None = None):
    """Rows of m decoded for a torch GEMM: bfloat16 where `GEMM_BF16`, else float32. buf: a
    scratch array of at least len(rows) rows of that dtype (None: a new one). -> [K, cols] tensor."""
    import torch

    if buf is not None:
        buf = buf[: len(rows)]
    if GEMM_BF16:
        return torch.from_numpy(qdequantize(m, rows, buf, bf16=True)).view(torch.bfloat16)
    return torch.from_numpy(qdequantize(m, rows, buf))


def gemm_scratch(rows: int, cols: int) -> np.ndarray:
    """A scratch buffer for `gemm_operands` of rows x cols."""
    return np.empty((rows, cols), np.uint16 if GEMM_BF16 else np.float32)


def _gemm_bf16_supported() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Several tokens' products (prefill) over decoded blocks in bfloat16 where oneDNN has bfloat16
# kernels (AVX512-BF16 / AMX): 2-core Zen 4, [64, 4096] x [4096, 11008]: 365 GFLOP/s against 110 in
# float32. x, the decoded weights and the products are rounded to bfloat16 (2^-9 relative), far
# below a 4-bit block's own error (~8%) and of the order of the Q8 activations that llama.cpp's
# prefill and our one-token kernels use. Tests that compare the block path exactly turn it off.
GEMM_BF16 = _gemm_bf16_supported()


def _torch_act(act: str):
    """The torch function of an activation name (one of ACTS), for the GEMM paths."""
    import torch

    return {"relu": torch.relu, "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[act]


def qffn_rows_batch(X: np.ndarray, rows: np.ndarray, up: QuantMatrix, down_t: QuantMatrix, act: str,
                    gate: QuantMatrix | None = None, up_bias: np.ndarray | None = None,
                    out: np.ndarray | None = None, row_scale: np.ndarray | None = None) -> np.ndarray:
    """`qffn_rows` for T tokens sharing one selection: X float32 [T, D] -> out float32 [T, D] (+=).

    The selected rows are decoded `BATCH_CHUNK_BYTES` of float32 at a time (each block once per
    call, whatever T) and multiplied with torch's GEMM (see `GEMM_BF16`), so prefill reads the
    blocks once."""
    import torch

    n, d = up.shape
    X = batch_input(X, d, act)
    rows = _as_rows(rows, n)
    out = np.zeros((X.shape[0], d), np.float32) if out is None else _check_out(out, (X.shape[0], d))
    if rows.shape[0] == 0 or X.shape[0] == 0:
        return out
    fn = _torch_act(act)
    y = torch.from_numpy(out)
    x = torch.from_numpy(X).to(torch.bfloat16 if GEMM_BF16 else torch.float32)  # [T, D]
    step = max(1, BATCH_CHUNK_BYTES // (4 * d))
    buf = gemm_scratch(min(step, rows.shape[0]), d)
    for a in range(0, rows.shape[0], step):
        r = rows[a:a + step]
        z = (x @ gemm_operands(gate if gate is not None else up, r, buf).T).float()  # [T, k]
        if gate is not None:
            h = fn(z) * (x @ gemm_operands(up, r, buf).T).float()
        else:
            h = fn(z + torch.from_numpy(up_bias[r]).float()) if up_bias is not None else fn(z)
        if row_scale is not None:
            h = h * torch.from_numpy(np.asarray(row_scale, np.float32)[r])
        y += (h.to(x.dtype) @ gemm_operands(down_t, r, buf)).float()  # [T, D]
    return out


def _expert_shapes(gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix) -> tuple[int, int, int]:
    # (experts E, hidden I, dim D) of stacked experts: gate, up [E*I, D] of one type, down [E*D, I]
    for name, m in (("gate", gate), ("up", up), ("down", down)):
        _check_m(m, name, whole=True)  # (an expert is read whole: interleaved groups are fine)
    if gate.shape != up.shape or gate.qtype != up.qtype or gate.interleaved != up.interleaved:
        raise ValueError(f"gate and up must match: {gate.qtype} {gate.shape} vs {up.qtype} {up.shape}")
    d, i = gate.cols, down.cols
    e = down.rows // d if d else 0
    if e <= 0 or down.rows != e * d or gate.rows != e * i:
        raise ValueError(f"down {down.shape} is not {gate.rows // max(i, 1)} experts' [D={d}, I={i}] W_down "
                         f"beside gate {gate.shape}")
    if i % 32 or (down.interleaved and d % X8):
        raise ValueError(f"expert hidden size {i} must be a multiple of 32 (and dim {d} of 8 when interleaved)")
    return e, i, d


def qexperts(x: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
             down: QuantMatrix, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """One token through whole experts in the file's own blocks (MoE decode): out += sum_k coef[k] *
    down_e (act(gate_e x) * (up_e x)) for e = experts[k]. Returns out float32 [D] (+=).

    x float32 [D]; experts int [n] (positions in the stacks, distinct); coef float32 [n] (routing
    weights); gate, up [E*I, D] of one type (expert e's rows [e*I, (e+1)*I)); down [E*D, I], each
    expert's W_down as GGUF stores it (blocks along I; rows [e*D, (e+1)*D)): read in place, no
    transposed copy. Q8 activations where the type is in `XQ_DEFAULT` (x for gate/up, each expert's h
    for down). One call, two parallel phases: the experts' gate/up rows with the activation, then
    the down GEMVs, summed per span of output rows."""
    e, i, d = check_expert_stacks(gate, up, down, act)
    x = _as_f32(x, (d,), "x")
    experts = _as_rows(experts, e)
    if len(np.unique(experts)) != len(experts):
        raise ValueError("experts must be distinct")
    coef = _as_f32(coef, experts.shape, "coef")
    out = np.zeros(d, np.float32) if out is None else _check_out(out, (d,))
    return qexperts_trusted(x, experts, coef, gate, up, down, act, out)


def check_expert_stacks(gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, act: str) -> tuple[int, int, int]:
    """Check stacked experts as `qexperts` takes them (ValueError if not) -> (experts E, hidden I, dim D)."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    return _expert_shapes(gate, up, down)


def qexperts_trusted(x: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
                     down: QuantMatrix, act: str, out: np.ndarray) -> np.ndarray:
    """`qexperts` without its argument checks, for a caller that checked its stacks once
    (`check_expert_stacks`) and passes its own well-formed buffers: x float32 [D] and out float32
    [D] C-contiguous, experts int64 [n] distinct and in range, coef float32 [n]. The MoE executor's
    decode step calls it once a layer, where the checks cost about as much as the call."""
    if experts.shape[0]:
        _qexperts_one_kernel(x, experts, coef, up._id, gate.data, up.data, up.interleaved, down._id, down.data,
                             down.interleaved, down.cols, ACTS[act], up.interleaved or up.qtype in XQ_DEFAULT,
                             down.interleaved or down.qtype in XQ_DEFAULT, out)
    return out


def qexperts_tokens(X: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
                    down: QuantMatrix, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """`qexperts` for T tokens in one call (MoE prefill): out[t] += sum_k coef[t, k] * expert
    experts[t, k] (x[t]) over the k with experts[t, k] >= 0 (positions in the stacks; -1: skipped, an
    expert computed elsewhere). X float32 [T, D]; experts int [T, k] (distinct per token); coef float32
    [T, k]; returns out float32 [T, D] (+=). Each routed expert's gate/up rows are read once for all of
    its tokens and its down rows once per span of output rows; each token gets the products the
    one-token kernel computes (its Q8 activations), summed in ascending expert order (equal to
    `qexperts` given the experts in that order, up to the float rounding of that sum: ~1e-7).
    2-core AMX Xeon, 64 Q4_0 Qwen3-30B-A3B experts, 8 routed per token: 64 tokens 25 ms (per-token
    `qexperts` 56, `qexpert_batch`'s bfloat16 GEMMs 79), 256 tokens 87 ms (235, 98), 1024 tokens 374
    ms (GEMMs 166: from ~50 tokens an expert, decoding its blocks once for a GEMM is faster)."""
    e, i, d = check_expert_stacks(gate, up, down, act)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    experts = np.asarray(experts)
    if experts.ndim != 2 or experts.shape[0] != X.shape[0] or experts.dtype.kind not in "iu":
        raise ValueError(f"experts must be an int array [{X.shape[0]}, k], got {experts.dtype} {experts.shape}")
    coef = _as_f32(coef, experts.shape, "coef")
    if ((experts < -1) | (experts >= e)).any():
        raise IndexError(f"expert position out of range [0, {e}) (or -1)")
    chosen = np.sort(np.where(experts >= 0, experts, e + np.arange(experts.shape[1])), axis=1)  # (skips distinct)
    if (np.diff(chosen, axis=1) == 0).any():
        raise ValueError("experts must be distinct per token")
    out = np.zeros(X.shape, np.float32) if out is None else _check_out(out, X.shape)
    t_idx, k_idx = np.nonzero(experts >= 0)
    if t_idx.shape[0] == 0:
        return out
    first = experts[t_idx, k_idx].astype(np.int64)
    order = np.lexsort((t_idx, first))  # by expert, then token
    tok, first, c = t_idx[order].astype(np.int64), first[order], np.ascontiguousarray(coef[t_idx, k_idx][order])
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1], True]).astype(np.int64)
    _qexperts_pairs_kernel(X, tok, first, c, starts, up._id, gate.data, up.data, up.interleaved, down._id, down.data,
                           down.interleaved, down.cols, ACTS[act], up.interleaved or up.qtype in XQ_DEFAULT,
                           down.interleaved or down.qtype in XQ_DEFAULT, out)
    return out


def qexpert_batch(X: np.ndarray, expert: int, gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, act: str,
                  coef: np.ndarray | None = None) -> np.ndarray:
    """T tokens through one whole expert (prefill), as `qexperts` lays them out: X float32 [T, D] ->
    float32 [T, D] = coef[:, None] * down_e (act(gate_e X) * (up_e X)) (coef float32 [T] or None).
    The expert's blocks are decoded once (bfloat16 where `GEMM_BF16`) for torch GEMMs."""
    import torch

    e, i, d = check_expert_stacks(gate, up, down, act)
    if not 0 <= expert < e:
        raise IndexError(f"expert {expert} out of range [0, {e})")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    fn = _torch_act(act)
    x = torch.from_numpy(X).to(torch.bfloat16 if GEMM_BF16 else torch.float32)  # [T, D]
    rows = np.arange(expert * i, (expert + 1) * i, dtype=np.int64)
    h = fn((x @ gemm_operands(gate, rows).T).float()) * (x @ gemm_operands(up, rows).T).float()  # [T, I]
    if coef is not None:
        h = h * torch.from_numpy(_as_f32(coef, (X.shape[0],), "coef"))[:, None]
    w_down = gemm_operands(down, np.arange(expert * d, (expert + 1) * d, dtype=np.int64))  # [D, I]
    return (h.to(x.dtype) @ w_down.T).float().numpy()


def qdequantize(m: QuantMatrix, rows: np.ndarray | None = None, out: np.ndarray | None = None,
                bf16: bool = False) -> np.ndarray:
    """float32 [K, cols] of m's rows (all when None), decoded in parallel by the kernels' block code
    (gguf.quants' numpy decoder, `QuantMatrix.dequantize`, is the independent reference); bf16:
    uint16 [K, cols] holding bfloat16 bits instead (rounded to nearest even; half the bytes, for a
    bfloat16 GEMM: `torch.from_numpy(a).view(torch.bfloat16)`). out, when given, must be a
    C-contiguous array of that dtype and shape; it is overwritten."""
    _check_m(m, whole=True)
    if rows is None:
        if m._all_rows is None:
            m._all_rows = np.arange(m.rows, dtype=np.int64)
        rows = m._all_rows
    rows = _as_rows(rows, m.rows)
    k = rows.shape[0]
    shape, dt = (k, m.cols), (np.uint16 if bf16 else np.float32)
    if out is None:
        out = np.empty(shape, dt)
    elif out.dtype != dt or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {np.dtype(dt)} array of shape {shape}")
    data = m.data
    if m.interleaved and k and k % X8 == 0 and rows[0] % X8 == 0 and rows[-1] - rows[0] == k - 1 \
            and bool(np.all(np.diff(rows) == 1)):  # whole groups: decoded in place
        _x8_dequant_kernel(m._id, m.data, rows[0] // X8, out, bf16)
        return out
    if m.interleaved:  # other rows in the GGUF layout first (a copy)
        data, rows = m.row_data(rows), np.arange(k, dtype=np.int64)
    if rows.shape[0] and bf16:
        _qdequant_bf16_kernel(m._id, data, rows, out)
    elif rows.shape[0]:
        out[:] = 0.0
        _qdequant_kernel(m._id, data, rows, out)
    return out

# ---------------------------------------------------------------------------------------------
# Quantising (load time, numpy)

def dequantize_rows(data: np.ndarray, qtype, cols: int) -> np.ndarray:
    """uint8 [R, bytes_per_row] blocks -> float32 [R, cols], by gguf.quants.dequantize."""
    import gguf

    name = _qtype_name(qtype)
    out = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType[name])
    return out.reshape(data.shape[0], cols).astype(np.float32, copy=False)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    # float [..., 1] -> uint8 [..., 2] little-endian fp16
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8)


def _k_scales_pack(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    # 6-bit sc, m: uint8 [n, 8] -> uint8 [n, 12] in the layout _k_scale_min reads
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _quantize_k_asym(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    # blocks float32 [n, 256] -> (d, dmin float16-rounded [n, 1], sc, m uint8 [n, 8], q uint8 [n, 8, 32])
    # per sub-block of 32: min_s = min(0, min x), scale_s = (max x - min_s) / levels; the 8 scales and
    # mins go to 6 bits under one fp16 d / dmin; q = round((x + dmin m) / (d sc)) in [0, levels].
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - lo) / levels
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), 0, 63)
    m = np.clip(np.round(_safe_div(-lo, dmin)), 0, 63)
    step = (d * sc)[:, :, None]
    q = np.clip(np.round(_safe_div(sub + (dmin * m)[:, :, None], step)), 0, levels)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_k_asym(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_pack(sc, m), qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_k_asym(blocks, 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= (q[:, s] >> 4) << s
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales_pack(sc, m), qh, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # 16 groups of 16, symmetric: scale_g = amax_g / 31 -> int8 under one fp16 d; q in [-32, 31]
    n = blocks.shape[0]
    grp = blocks.reshape(n, 16, 16)
    scale = np.abs(grp).max(axis=2) / 31
    d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d)), -128, 127)
    q = np.clip(np.round(_safe_div(grp, (d * sc)[:, :, None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, k, l]: element 128h + 32k + l
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


_K_QUANTISERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize_rows(w: np.ndarray, qtype) -> np.ndarray:
    """float [R, C] -> uint8 [R, bytes_per_row] GGUF blocks of qtype.

    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: gguf.quants.quantize (Q8_0 bit-exact with ggml's reference quantiser).
    Q4_K, Q5_K, Q6_K: our simple round-to-nearest quantiser (gguf.quants cannot quantise them):
    per sub-block min/max scales, 6-bit (K) or int8 (Q6_K) sub-scales under one fp16 super-scale.
    It writes valid blocks that ggml and gguf.quants decode, but it is not llama.cpp's search-based
    K-quant quantiser and does not match it bit for bit (its error is somewhat larger).
    """
    name = _qtype_name(qtype)
    _, bs, ts = QTYPES[name]
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % bs:
        raise ValueError(f"{name} needs a 2-D array with a multiple of {bs} columns, got {w.shape}")
    if name in _K_QUANTISERS:
        blocks = np.ascontiguousarray(w).reshape(-1, bs)
        return _K_QUANTISERS[name](blocks).reshape(w.shape[0], w.shape[1] // bs * ts)
    import gguf

    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]))


def transpose_quantized(m: QuantMatrix, kind=None, strip: int = 256) -> QuantMatrix:
    """m [R, C] -> its transpose [C, R] quantised as `kind` (None: `DOWN_T_DEFAULT`; "same": m's type).

    Built strip by strip of `strip` columns (a multiple of m's block size): dequantise the strip
    [R, strip], transpose, requantise its rows. Memory is O(R * strip). R must be a multiple of kind's
    block size. Used at load time for W_down, which GGUF stores as [D, I] while the sparse down
    projection needs neuron j's D weights contiguous.

    Requantising adds error; relative RMS error of the transposed copy against the dequantised
    original (`tools/bench_quant.py --requant`; Gaussian [4096, 2048], then real ffn_down tensors):
      kind   Q8_0    Q4_0   Q4_1   Q4_K   Q5_K   Q6_K   (as "same")
      extra  0.0053  0.078  0.078  0.078  0.038  0.019  (Q8_0 kind: 0.005 for every source type)
      SmolLM2-135M Q4_1 [576, 1536]: same 0.080-0.088, Q8_0 0.0056-0.0064
      gemma-3-270m Q4_K / Q6_K [640, 2048]: same impossible (640 % 256 != 0), Q8_0 0.0058-0.0064
    A same-type requantisation is a second, independent rounding (total error x1.4 for 4-bit types);
    Q8_0 adds ~0.005, i.e. Q4_K's total error goes from 0.0784 to 0.0786. Hence DOWN_T_DEFAULT = Q8_0:
    W_down's CPU copy is 1.9x the bytes of a 4.5-bit type, but these kernels are compute-bound on a
    small CPU and Q8_0 rows decode fastest (qaxpy_rows per row about as fast as Q4_K, faster than
    Q5_K / Q6_K), and it works for any D that is a multiple of 32."""
    _check_m(m)
    kind = m.qtype if kind == "same" else _qtype_name(DOWN_T_DEFAULT if kind is None else kind)
    _, bs_in, ts_in = QTYPES[m.qtype]
    _, bs_out, ts_out = QTYPES[kind]
    r, c = m.shape
    if r % bs_out:
        raise ValueError(f"cannot store the transpose as {kind}: its rows have {r} elements, "
                         f"not a multiple of {bs_out}")
    if strip <= 0 or strip % bs_in:
        raise ValueError(f"strip must be a positive multiple of {bs_in}, got {strip}")
    out = np.empty((c, r // bs_out * ts_out), np.uint8)
    for c0 in range(0, c, strip):
        c1 = min(c, c0 + strip)
        part = m.data[:, c0 // bs_in * ts_in: c1 // bs_in * ts_in]
        dense = dequantize_rows(part, m.qtype, c1 - c0)  # [R, c1 - c0]
        out[c0:c1] = quantize_rows(np.ascontiguousarray(dense.T), kind)
    return QuantMatrix(out, kind, (c, r))


def random_matrix(qtype, shape: tuple[int, int], seed: int = 0, scale: float = 0.01) -> QuantMatrix:
    """Random valid blocks (random quant bytes, fp16 scale fields near `scale`) for tests / benchmarks."""
    name = _qtype_name(qtype)
    _, bs, ts = QTYPES[name]
    r, c = shape
    if c % bs:
        raise ValueError(f"{name} needs cols to be a multiple of {bs}, got {c}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (r * (c // bs), ts), dtype=np.uint8)
    fields = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(name, (0,))
    for i, o in enumerate(fields):  # Q4_1's / Q5_1's second field (m) is signed; the K mins are subtracted
        v = scale * rng.uniform(0.5, 1.5, (blocks.shape[0], 1))
        if name in ("Q4_1", "Q5_1") and i == 1:
            v *= rng.choice([-8.0, 8.0], (blocks.shape[0], 1))
        blocks[:, o:o + 2] = _f16_bytes(v)
    return QuantMatrix(blocks.reshape(r, c // bs * ts), name, (r, c))
