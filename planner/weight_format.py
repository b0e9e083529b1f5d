"""How a run stores its weights, as the cost model counts them: `WeightFormat` (bytes per weight on
each side, the CPU kernel kind, int4 shares on the GPU), the named float formats, the formats of GGUF
blocks and of `--quantize`, and the int4 GPU kernels' measured speeds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hotcold.errors import HotcoldError


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored for the run: bytes per weight, extra bytes per row (int8 per-row scale),
    the CPU kernel kind, and the bytes of one KV / activation element.

    A quantised model (GGUF blocks, models/quantized.py) is dequantised on the GPU but stays in blocks
    in host memory: host_bytes_per_weight (attention, LM head, embedding) and host_ffn_bytes_per_weight
    (FFN rows: gate and up in the file's type, W_down transposed as Q8_0; experts: all in the file's) are then its host
    bytes, and cpu_kind names the block type whose kernel rates the probe measured (q4_k ...).
    None: as on the GPU."""

    name: str
    bytes_per_weight: float
    row_overhead_bytes: float
    cpu_kind: str
    kv_bytes: int
    host_bytes_per_weight: float | None = None
    host_ffn_bytes_per_weight: float | None = None
    host_embed_bytes_per_weight: float | None = None  # the token embedding (often wider than the rest)
    # `--gpu-int4`: the GPU's attention matrices, and the hot FFN rows' up/gate (gpu_ffn_*) and W_down
    # columns (gpu_down_*), in torch's int4 layout where the file's type allows (sparse_ops/gpu_quant.py,
    # executors/weights.py): their bytes per weight, and the share of the GEMV bandwidth the int4
    # kernel reaches (None / 1: as bytes_per_weight). The LM head is counted as the dtype unless
    # gpu_head_int4.
    gpu_attn_bytes_per_weight: float | None = None
    gpu_attn_speed: float = 1.0
    gpu_ffn_bytes_per_weight: float | None = None
    gpu_ffn_speed: float = 1.0
    gpu_down_bytes_per_weight: float | None = None
    gpu_down_speed: float = 1.0
    # `--gpu-int4`: the dense/gated layers whose up, gate and down are all of a 4-bit type (True: every
    # layer). A layer of these with every neuron on the GPU keeps its whole FFN int4 from its own
    # blocks (W_down too: its blocks run along the neuron axis, which is whole then): `whole_int4`.
    gpu_whole_int4: bool | frozenset = False
    gpu_head_int4: bool = False  # `--gpu-int4`: an untied LM head of a 4-bit type kept int4 on the GPU
    # `--gpu-int4`: the MoE layers whose gate and up experts (gpu_experts_int4) and whose down experts
    # (gpu_experts_down_int4) are of a 4-bit type: the GPU's experts keep them 4-bit (a Q4Stack read by
    # the Triton expert kernels, sparse_ops/moe_gpu.py). True: every layer.
    gpu_experts_int4: bool | frozenset = False
    gpu_experts_down_int4: bool | frozenset = False

    # bytes per weight of each part: its own figure where set, else the dtype's (embedding: the host's)
    gpu_attn_w = property(lambda self: _or(self.gpu_attn_bytes_per_weight, self.bytes_per_weight))
    gpu_ffn_w = property(lambda self: _or(self.gpu_ffn_bytes_per_weight, self.bytes_per_weight))
    gpu_down_w = property(lambda self: _or(self.gpu_down_bytes_per_weight, self.bytes_per_weight))
    host_w = property(lambda self: _or(self.host_bytes_per_weight, self.bytes_per_weight))
    host_embed_w = property(lambda self: _or(self.host_embed_bytes_per_weight, self.host_w))
    host_ffn_w = property(lambda self: _or(self.host_ffn_bytes_per_weight, self.bytes_per_weight))

    @property
    def gpu_int4(self) -> bool:
        """Whether any GPU part is counted int4 (`--gpu-int4` found 4-bit matrices to keep)."""
        return (self.gpu_attn_bytes_per_weight is not None or self.gpu_ffn_bytes_per_weight is not None
                or self.gpu_head_int4 or bool(self.gpu_whole_int4) or bool(self.gpu_experts_int4)
                or bool(self.gpu_experts_down_int4))

    def experts_int4(self, layer: int) -> tuple[bool, bool]:
        """Whether layer's GPU experts keep (gate and up, down) 4-bit (see gpu_experts_int4)."""
        return tuple(w is True or (isinstance(w, frozenset) and layer in w)
                     for w in (self.gpu_experts_int4, self.gpu_experts_down_int4))

    def whole_int4(self, layer: int) -> bool:
        """Whether layer's FFN, when every neuron is on the GPU, is kept int4 whole (see gpu_whole_int4)."""
        w = self.gpu_whole_int4
        return w is True or (isinstance(w, frozenset) and layer in w)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def quantized_format(base: WeightFormat, kind: str, host_bpw: float, host_ffn_bpw: float,
                     host_embed_bpw: float | None = None) -> WeightFormat:
    """`base` (the GPU side's dtype) for a model whose host side is GGUF blocks of `kind` (q4_k ...)."""
    return dataclasses.replace(base, name=f"{kind}/{base.name}", cpu_kind=kind, row_overhead_bytes=0.0,
                               host_bytes_per_weight=host_bpw, host_ffn_bytes_per_weight=host_ffn_bpw,
                               host_embed_bytes_per_weight=host_embed_bpw)


# int4 on the GPU: 4-bit codes + one bf16 (scale, zero) pair per 32 weights
INT4_GPU_BYTES_PER_WEIGHT = 0.5 + 4 / 32
# the int4 kernel's share of the bf16 GEMV's bandwidth (tools/bench_gpu_quant.py, H200, one token:
# 0.9-1.3 TB/s of its own bytes against 1.8-3.1 TB/s; 1.35-1.6x faster per weight than bf16)
INT4_GPU_SPEED = 0.45
# the same for the Triton kernels of 4-bit GPU experts (Q4Stack) against their bf16 twins
# (tools/bench_moe_int4.py, H200, 8 routed Qwen3-30B-A3B experts, L2 flushed, both kernels' tiles
# swept: 36 us at 655 GB/s of their 4-bit bytes against 37.7 us at 2.0 TB/s in bf16)
INT4_EXPERT_SPEED = 0.33


def _int4_mix(bytes_per_weight: float, share: float) -> tuple[float, float]:
    """(bytes per weight, speed) of GPU weights of which `share` are int4 and the rest bytes_per_weight."""
    w = share * INT4_GPU_BYTES_PER_WEIGHT + (1 - share) * bytes_per_weight
    # time per weight = bytes / (bandwidth x speed), averaged over the int4 and the expanded share
    t = share * INT4_GPU_BYTES_PER_WEIGHT / INT4_GPU_SPEED + (1 - share) * bytes_per_weight
    return w, w / t


def gpu_int4_format(fmt: WeightFormat, int4_share: float, ffn_share: float = 0.0,
                    whole: bool | frozenset = False, head: bool = False, experts: bool | frozenset = False,
                    experts_down: bool | frozenset = False) -> WeightFormat:
    """fmt with `--gpu-int4`: int4_share of the GPU's attention weights kept int4, and ffn_share of the
    hot FFN rows' up/gate weights (their W_down columns too where INT4_DOWN_DEFAULT requantises them);
    whole: the layers whose FFN is kept int4 whole when every neuron is hot (WeightFormat.gpu_whole_int4);
    head: the LM head is of a 4-bit type (kept int4 when untied); experts, experts_down: the MoE layers
    whose GPU experts keep gate/up, down 4-bit (WeightFormat.gpu_experts_int4)."""
    from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT

    if int4_share <= 0 and ffn_share <= 0 and not whole and not head and not experts and not experts_down:
        return fmt
    bpw = fmt.bytes_per_weight
    (aw, asp), (fw, fsp), (dw, dsp) = (_int4_mix(bpw, s) for s in (int4_share, ffn_share,
                                                                    ffn_share if INT4_DOWN_DEFAULT else 0.0))
    return dataclasses.replace(fmt, name=f"{fmt.name}+int4", gpu_attn_bytes_per_weight=aw, gpu_attn_speed=asp,
                               gpu_ffn_bytes_per_weight=fw, gpu_ffn_speed=fsp, gpu_down_bytes_per_weight=dw,
                               gpu_down_speed=dsp, gpu_whole_int4=whole, gpu_head_int4=head,
                               gpu_experts_int4=experts, gpu_experts_down_int4=experts_down)


def quantize_format(base: WeightFormat, kind: str, gpu_int4: bool = False, moe: bool = False) -> WeightFormat:
    """The format an HF checkpoint gets from `--quantize kind` (q8_0 | q4_0 | q4_k): every matrix in
    blocks of kind, a dense FFN's W_down host copy Q8_0 (moe: the FFN weights are experts', whose
    W_down stays in kind); gpu_int4: 4-bit kinds kept int4 on the GPU."""
    from hotcold.sparse_ops.quant import QTYPES

    _, bs, ts = QTYPES[kind.upper()]
    _, bs8, ts8 = QTYPES["Q8_0"]
    bpw = ts / bs
    fmt = quantized_format(base, kind, bpw, bpw if moe else (2 * bpw + ts8 / bs8) / 3)
    share = 1.0 if gpu_int4 and kind.upper() in ("Q4_0", "Q4_K") else 0.0
    return gpu_int4_format(fmt, share, share, whole=share > 0, head=share > 0, experts=share > 0,
                           experts_down=share > 0)


FORMATS = {
    "bf16": WeightFormat("bf16", 2.0, 0.0, "bf16", 2),
    "f16": WeightFormat("f16", 2.0, 0.0, "f16", 2),
    "f32": WeightFormat("f32", 4.0, 0.0, "f32", 4),
    "i8": WeightFormat("i8", 1.0, 4.0, "i8", 2),
}
_FORMAT_ALIASES = {"bfloat16": "bf16", "float16": "f16", "fp16": "f16", "float32": "f32", "fp32": "f32", "int8": "i8"}


def weight_format(name: str) -> WeightFormat:
    key = _FORMAT_ALIASES.get(name, name)
    if key not in FORMATS:
        raise HotcoldError(f"--dtype: unknown weight format '{name}' (use {', '.join(FORMATS)})")
    return FORMATS[key]

