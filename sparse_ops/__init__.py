"""hotcold.sparse_ops: kernels only, no model knowledge.

cpu  numba kernels over a *selected subset of rows* of a host matrix (`HostMatrix`: f32, fp16/bf16
     bits, or int8 with per-row scale): `gemv_rows` (out[j] = m[rows[j]]·x), `axpy_rows`
     (out += Σ coeff[j]·m[rows[j]]), the fused FFN `ffn_rows` / `ffn_rows_batch` (gated or
     ungated+bias; relu | silu | gelu_tanh), dense `gemv`, `ffn_dense` (a prompt chunk's FFN over
     all rows as torch GEMMs, masked after the activation), `set_threads`, and numpy selection
     helpers (`mask_to_rows`, `index_map`, `split_rows`). All release the GIL.
attention  `decode_attention`: one token's rotary, KV-cache write and attention on the CPU in one
     numba call (float32 or float16 cache).
gpu  torch ops for the GPU's compacted hot neurons (device-agnostic): `compact_rows`, `hot_ffn`,
     `mask_to_rows`, `index_map`, `split_mask`, `split_rows`.
fused_gpu  Triton kernels for CUDA: RMSNorm (`rms_norm_cuda`), the rotary embedding (`rope_cuda`) and
     a token's MoE routing packed for the host (`route_pack_cuda`), one kernel each instead of ~7,
     ~12 and ~10 torch ops.
(also: quant (GGUF block kernels, a package by format and concern), host_matrix (`HostMatrix`, huge pages),
selection (what cpu and quant share: activations, row checks, threads), gpu_quant (int4 GEMMs), moe_gpu
(routed experts), norm (CPU RMSNorm).)

Row layout: one neuron is one row, so pass W_up/W_gate as [I, D] and W_down transposed, [I, D].
"""

from .quant import jit_cache  # noqa: F401  (numba's cache stamp, before any kernel is defined)
from . import cpu, gpu
from .cpu import HostMatrix, axpy_rows, ffn_rows, ffn_rows_batch, gemv, gemv_rows, set_threads
from .gpu import compact_rows, hot_ffn

__all__ = ["cpu", "gpu", "HostMatrix", "gemv_rows", "gemv", "axpy_rows", "ffn_rows", "ffn_rows_batch",
           "set_threads", "compact_rows", "hot_ffn"]
