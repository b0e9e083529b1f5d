"""CPU kernels over GGUF-quantised rows: GEMV / axpy / fused FFN / whole experts that decode blocks as
they read them.

A `QuantMatrix` is R rows of C logical columns, each row a contiguous run of GGUF blocks of one type
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), held as uint8 [R, bytes_per_row]: exactly what
`gguf.GGUFReader` exposes for a quantised tensor, so a memory-mapped file is used in place.

Modules, from the bottom up:
  formats      the type table, block layouts, defaults (`XQ_DEFAULT`, `PACK_DEFAULT`, `DOWN_T_DEFAULT`)
  vector       LLVM vector IR helpers and the dot / axpy intrinsics of the 32-element block types
  kquants      the same intrinsics for the K-quants (256-element blocks)
  activations  Q8 activations and sums of x, prepared once per call
  interleaved  the row-interleaved layout ("x8") of matrices read whole, its kernels and packing
  kernels      numba kernels over row selections, the fused FFN, whole experts, dequantisation
  tiles        whole experts for several tokens over interleaved stacks: a block dotted with a tile of tokens
  experts_one  whole experts for one token (decode): several group streams a block loop, prefetched
  quantise     float rows -> GGUF blocks (load time, numpy) and gguf.quants' decoder
  matrix       `QuantMatrix`, `transpose_quantized`, `random_matrix`
  ops          the Python entry points (argument checks, then one kernel call); `GEMM_BF16`
  jit_cache    numba's cache for hotcold's kernels, stamped by all of their sources

Settings read at call time live in their module, where tests patch them: `formats.XQ_DEFAULT`,
`ops.GEMM_BF16`, `ops.BATCH_CHUNK_BYTES`.
"""

from . import jit_cache # noqa: F401 before any kernel is defined
from .formats import DOWN_T_DEFAULT, PACK_DEFAULT, QTYPES, X8, X8_FIELDS, qtype_name
from .interleaved import qgemv_x8_kernel
from .experts_one import held_experts, qexperts_one_kernel
from .kernels import qffn_one_kernel, qgemv_rows_kernel
from .matrix import QuantMatrix, random_matrix, transpose_quantized
from .ops import (check_expert_stacks, gemm_operands, gemm_scratch, pack_rows, qaxpy_rows, qdequantize, qexpert_batch,
                  qexperts, qexperts_routed, qexperts_tokens, qexperts_trusted, qffn_rows, qffn_rows_batch, qgemv, qgemv_rows)
from .quantise import dequantize_rows, quantize_rows

__all__ = ["jit_cache", "held_experts", "QuantMatrix", "qgemv_rows", "qgemv", "qaxpy_rows", "qffn_rows", "qffn_rows_batch", "qdequantize",
           "qexperts", "qexperts_routed", "qexperts_trusted", "qexperts_tokens", "check_expert_stacks", "qexpert_batch", "gemm_operands",
           "gemm_scratch", "transpose_quantized", "quantize_rows", "dequantize_rows", "random_matrix", "pack_rows",
           "QTYPES", "DOWN_T_DEFAULT", "PACK_DEFAULT", "X8", "X8_FIELDS", "qtype_name", "qgemv_rows_kernel",
           "qgemv_x8_kernel", "qffn_one_kernel", "qexperts_one_kernel"]
