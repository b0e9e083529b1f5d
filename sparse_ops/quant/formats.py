"""GGUF block formats the CPU kernels compute on: the type table, the layouts and the defaults.

A `QuantMatrix` is R rows of C logical columns, each row a contiguous run of C / block_size GGUF
blocks of one type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), held as uint8 [R, bytes_per_row]: exactly
what `gguf.GGUFReader` exposes for a quantised tensor, so a memory-mapped file is used in place.
The kernels never expand the matrix: each block is decoded in registers and multiplied by float32
x (or accumulated into out), reading only the selected rows, several side by side (8 on AVX-512, else
4; see vector.py and kquants.py). Accumulation is float32. Same threading model as `cpu`: numba,
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
where the CPU has it; see vector.py). That reads the nibble and K-quant types' rows
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

import numpy as np

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

# Row-interleaved layout (see interleaved.py): per type, the fields of a block in interleaved order
X8 = 8  # rows per interleaved group
X8_FIELDS = {  # per type: (byte offset in the GGUF block, bytes, unit), in the interleaved order
    Q4_0: ((0, 2, 2), (2, 16, 4)),  # d, qs
    Q4_K: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)),  # d, dmin, scales, qs
    Q8_0: ((0, 2, 2), (2, 32, 4)),  # d, qs
    Q4_1: ((0, 2, 2), (2, 2, 2), (4, 16, 4)),  # d, m, qs
}
X8_TYPES = tuple(X8_FIELDS)
PACK_DEFAULT = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q8_0"})  # types `pack_rows` may interleave (see there)


def qtype_name(qtype) -> str:
    """'Q4_K' | ggml type id 12 | gguf.GGMLQuantizationType.Q4_K -> 'Q4_K'."""
    name = getattr(qtype, "name", qtype)
    if isinstance(name, (int, np.integer)) and int(name) in _NAME_OF_ID:
        return _NAME_OF_ID[int(name)]
    if isinstance(name, str) and name.upper() in QTYPES:
        return name.upper()
    raise ValueError(f"unsupported quantisation type {qtype!r}; supported: {', '.join(QTYPES)}")
