"""4-bit GGUF matrices kept quantised on the GPU, multiplied by torch's int4 "tinygemm" kernels.

The alternative to dequantising a Q4_0 / Q4_1 / Q4_K `QuantMatrix` to bf16 when it goes to the GPU:
its 4-bit codes are repacked once for `aten._weight_int4pack_mm` (CUDA) and stay 4-bit in VRAM, with
one bf16 (scale, zero) pair per group of 32 weights: 5 bits a weight against bf16's 16. torch's own
kernels only: `_convert_weight_to_int4pack` / `_weight_int4pack_mm` on CUDA, their `_for_cpu`
twins on the CPU (used by the tests and `tools/bench_gpu_quant.py --device cpu`).

Kernel semantics (read in torch's sources, aten/src/ATen/native/cuda/int4mm.cu, cpu/int4mm_kernel.cpp,
torch/_meta_registrations.py, torch/testing/_internal/common_quantization.py `_group_quantize_tensor`;
checked numerically on the CPU ops by tests/test_gpu_quant.py):
  w[n, k] = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n],  q in [0, 15]
  scales_and_zeros: [K / group, N, 2], [..., 0] = scale, [..., 1] = zero, bf16 (CUDA reads raw bf16;
                    it does not check the dtype)
  CUDA packing input: uint8 [N, K / 2], element 2j in the HIGH nibble of byte j, 2j + 1 in the low
                    one (`q[:, ::2] << 4 | q[:, 1::2]`); out: int32 [N / 8, K / (inner_k_tiles * 16),
                    32, inner_k_tiles / 2], the m16n8k16 tensor-core B layout.
  CPU packing input: int32 [N, K] of codes 0..15 (the op packs them itself); out: uint8 [N, K / 2].
  Rounding: CUDA dequantises in bf16 (`__hfma2`: each w rounded to bf16 before the MMA), accumulates
  in float32, writes bf16; the CPU kernel dequantises and accumulates in float32, writes x's dtype.

GGUF -> tinygemm, group 32 (exact up to the bf16 rounding of scale and zero; GGUF's d, m, dmin are fp16):
  Q4_0  w = d * (q - 8)              scale d,          zero 0
  Q4_1  w = d * q + m                scale d,          zero m + 8d
  Q4_K  w = d * sc_j * q - dmin * m_j   (sub-block j of 32)   scale d * sc_j,  zero 8 d sc_j - dmin m_j
GGUF's nibble order inside a block (Q4_0 / Q4_1: element i < 16 low nibble of qs[i], else high nibble
of qs[i - 16]; Q4_K: sub-blocks 2c / 2c + 1 low / high nibbles of qs[32c:32c + 32]) differs from
tinygemm's, so the codes are unpacked and repacked at load, by torch ops on the device the blocks are
moved to as they are (`split_blocks`, also what the MoE experts' Q4Stack keeps).

Constraints (`int4_supported` checks them; nothing is padded here unless asked: `int4_padded` gives
the sizes the split FFNs' hot rows are padded to with zero rows, `Int4Matrix.from_quant(n=)`):
  CUDA: compute capability >= 8.0 (bf16 mma.sync m16n8k16; ROCm is not supported here), x bf16
        contiguous [M, K], inner_k_tiles in {2, 4, 8} with K % (inner_k_tiles * 16) == 0, group in
        {32, 64, 128, 256} dividing K, N % 8 == 0 (the packing pads N up to a multiple of 8 and the
        output would have the padded width);
  CPU:  N % 16 == 0, K % group == 0.
inner_k_tiles (None: the largest of 8, 4, 2 that divides K / 16) only sets the CUDA layout; every
GGUF 4-bit type has K % 32 == 0, so some inner_k_tiles always fits unless one is forced.

Measured (`tools/bench_gpu_quant.py`, H200, torch 2.11 cu130, L2 flushed, kernel time; K x N):
int4 holds 0.31x the VRAM of bf16 and, for one token, runs 1.35-1.6x faster (4096x4096 11.8 against
18.6 us, 5120x13824 34 against 46 us, 2048x768 expert 7.3 against 11.5 us), 1.2-1.45x at 4 tokens,
but it reaches only 0.9-1.3 TB/s of its weight bytes against bf16's 1.8-3.1 TB/s, and its time grows
with M: break-even near 8-16 tokens, 7-14x slower than bf16 at 128 (prefill). inner_k_tiles 2 / 4 / 8
are within 10% of each other.

Requantised floats (`quantize_int4`, `Int4Matrix.from_float`): W_down's hot columns, whose GGUF
blocks run along the other axis, as asymmetric min/max int4 groups of 32 (see INT4_DOWN_DEFAULT).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import nn

from hotcold.sparse_ops.quant import QTYPES, QuantMatrix, qtype_name

__all__ = ["Int4Matrix", "Int4Linear", "int4_supported", "int4_unsupported_reason", "int4_layout_reason",
           "cuda_int4_available", "int4_padded", "decode_int4", "decode_int4_halves", "quantize_int4", "INT4_QTYPES",
           "GROUP_SIZE", "INT4_DOWN_DEFAULT"]

INT4_QTYPES = ("Q4_0", "Q4_1", "Q4_K")
GROUP_SIZE = 32  # every type above has one (scale, zero) per 32 weights
INNER_K_TILES = (8, 4, 2)  # preferred first: 16-byte loads per lane
DECODE_ROWS_BYTES = 16 << 20  # GGUF bytes decoded at once by decode_int4
# Whether the split FFNs' hot W_down columns are requantised to int4 under --gpu-int4 (else kept in
# the tier dtype; the planner counts what this says). No: W_down's GGUF blocks run along the neuron
# axis, so its hot columns in the plan's order regroup neurons of different blocks, and requantising
# them (quantize_int4) is a second 4-bit rounding of the size of the file's own. Measured with
# tools/int4_down_error.py (relative RMS of the FFN output on 512 tokens of real text, mean of the
# layers, hot neurons a random 25 / 50 / 100% in random order): SmolLM2-135M Q4_1 +0.037 / 0.052 /
# 0.074 (bf16's own rounding of W_down: 0.0011; ascending order helps only when every neuron is hot);
# perplexity (docs/quantization.md's 3 x 256 tokens) 10.890 dense, 10.897 with int4 hot up/gate and W_down
# expanded, 12.172 (+11.8%) with W_down requantised. A generated ReLU llama (D 2048, I 5632, Q4_0 of
# its f16 weights): +0.040 / 0.057 / 0.078, against the Q4_0 file's own error of 0.086 for W_down and
# 0.148 for the whole FFN. int4 up/gate alone hold a hot neuron in 0.54x the bf16 bytes; with W_down
# too it would be 0.31x.
INT4_DOWN_DEFAULT = False


# ---------------------------------------------------------------------------------------------
# Support checks

def _kernel_device(device) -> str | None:
    """'cuda' | 'cpu' when torch's int4 kernels run on device, else None."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available() or torch.version.hip is not None:
            return None
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx >= torch.cuda.device_count() or torch.cuda.get_device_capability(idx) < (8, 0):
            return None
        return "cuda"
    if dev.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu"
    return None


def cuda_int4_available(device="cuda") -> bool:
    """Whether torch's int4 CUDA kernels run on this machine's GPU (device): `hotcold plan` asks
    before counting a quantised model's 4-bit matrices int4 there."""
    return _kernel_device(device) == "cuda"


def _pick_inner_k_tiles(k: int) -> int | None:
    return next((t for t in INNER_K_TILES if k % (t * 16) == 0), None)


def int4_unsupported_reason(qtype, device, shape: tuple[int, int] | None = None,
                            inner_k_tiles: int | None = None) -> str | None:
    """Why a qtype matrix of shape (N rows, K cols) cannot be kept int4 on device; None if it can."""
    try:
        name = qtype_name(qtype)
    except ValueError:
        return f"unsupported quantisation type {qtype!r}"
    if name not in INT4_QTYPES:
        return f"{name} is not a 4-bit type tinygemm can hold (supported: {', '.join(INT4_QTYPES)})"
    return int4_layout_reason(device, shape, inner_k_tiles)


def int4_layout_reason(device, shape: tuple[int, int] | None = None, inner_k_tiles: int | None = None) -> str | None:
    """Why torch's int4 kernels cannot hold a matrix of shape (N, K) on device, whatever its source
    (GGUF blocks or floats requantised); None if they can."""
    kind = _kernel_device(device)
    if kind is None:
        return (f"torch's int4 kernels do not run on {device!r} (CUDA needs an NVIDIA GPU of compute "
                f"capability >= 8.0; CPU needs aten._weight_int4pack_mm_for_cpu)")
    if inner_k_tiles is not None and inner_k_tiles not in INNER_K_TILES:
        return f"inner_k_tiles must be one of {INNER_K_TILES}, got {inner_k_tiles}"
    if shape is not None:
        n, k = int(shape[0]), int(shape[1])
        if n <= 0 or k <= 0 or k % GROUP_SIZE:
            return f"shape {(n, k)}: K must be a positive multiple of {GROUP_SIZE}"
        t = _pick_inner_k_tiles(k) if inner_k_tiles is None else inner_k_tiles
        if t is None or k % (t * 16):
            return f"shape {(n, k)}: K must be a multiple of {(t or 2) * 16} (inner_k_tiles {t or 2} x 16)"
        step = _N_STEP[kind]
        if n % step:
            return f"shape {(n, k)}: N must be a multiple of {step} on {kind}"
    return None


_N_STEP = {"cuda": 8, "cpu": 16}  # rows the packing takes at a time
_K_STEP = max(GROUP_SIZE, INNER_K_TILES[-1] * 16)  # the smallest K every layout takes


def int4_padded(n: int, device, as_k: bool = False) -> int:
    """n rounded up to a row count (N) torch's int4 kernels take on device, and with as_k to a column
    count (K) as well: what zero rows (or columns) pad a matrix to."""
    step = _N_STEP.get(_kernel_device(device), 16)
    if as_k:
        step = math.lcm(step, _K_STEP)
    return -(-n // step) * step


def int4_supported(qtype, device, shape: tuple[int, int] | None = None, inner_k_tiles: int | None = None) -> bool:
    """Whether a qtype matrix (of shape (N, K), when given) can be kept int4 on device."""
    return int4_unsupported_reason(qtype, device, shape, inner_k_tiles) is None


# ---------------------------------------------------------------------------------------------
# GGUF blocks -> codes, scales, zeros (torch ops, where the blocks are: a GPU load splits them there)

def _f16(b: torch.Tensor) -> torch.Tensor:
    # uint8 [..., 2] little-endian fp16 -> float32 [...]
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibble_halves(qs: torch.Tensor) -> torch.Tensor:
    # 32 quants a byte each [..., 32] -> [..., 16]: byte i = quant i | quant i + 16 << 4
    return qs[..., :16] | (qs[..., 16:] << 4)


def _halves_q4_0(b: torch.Tensor):
    # b: uint8 [..., nb, 18] -> codes [..., nb * 16], scale, zero [..., nb]: Q4_0's bytes already pack so
    d = _f16(b[..., 0:2])
    return b[..., 2:18].flatten(-2), d, torch.zeros_like(d)


def _halves_q4_1(b: torch.Tensor):
    # b: [..., nb, 20]; w = q d + m = (q - 8) d + (m + 8 d)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return b[..., 4:20].flatten(-2), d, m + 8 * d


def _halves_q4_k(b: torch.Tensor):
    # b: [..., nb, 144] -> one group per sub-block: codes [..., nb * 8 * 16], scale, zero [..., nb * 8]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]  # [..., nb, 1]
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:144].unflatten(-1, (4, 32))  # chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high)
    codes = torch.stack([_nibble_halves(qs & 15), _nibble_halves(qs >> 4)], dim=-2)  # [..., nb, 4, 2, 16]
    scale = d * sc  # [..., nb, 8], exact in float32
    zero = scale * 8 - dmin * mn  # (separate ops, so a GPU rounds each as the CPU does: no fused multiply-add)
    return codes.flatten(-4), scale.flatten(-2), zero.flatten(-2)


_HALVES = {"Q4_0": _halves_q4_0, "Q4_1": _halves_q4_1, "Q4_K": _halves_q4_k}


def split_blocks(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit type's GGUF blocks (uint8 [..., blocks, bytes a block], on any device) split where they
    are: codes uint8 [..., K / 2], per group of 32 byte i holding element i in its low nibble and
    element i + 16 in its high one (as Q4_0 packs them), scale and zero float32 [..., K / 32], so that
    w = (code - 8) * scale + zero: gguf's values exactly (Q4_K's one group per sub-block)."""
    return _HALVES[int4_type(qtype)](raw)


def int4_type(qtype: str) -> str:
    """qtype, where its blocks can be kept as 4-bit codes (INT4_QTYPES); else ValueError."""
    if qtype not in _HALVES:
        raise ValueError(f"{qtype} cannot be kept as int4 (supported: {', '.join(INT4_QTYPES)})")
    return qtype


def unpack_halves(codes: torch.Tensor) -> torch.Tensor:
    """split_blocks' codes [..., K / 2] one a byte, in order: uint8 [..., K / 32, 32]."""
    c = codes.unflatten(-1, (-1, 16))  # [..., groups, 16]
    return torch.stack([c & 15, c >> 4], dim=-2).flatten(-2)


def halves_to_pairs(codes: torch.Tensor) -> torch.Tensor:
    """split_blocks' codes [..., K / 2] repacked as tinygemm takes them: element 2j in the high nibble
    of byte j, element 2j + 1 in the low one."""
    e = unpack_halves(codes).flatten(-2)  # [..., K]
    return (e[..., 0::2] << 4) | e[..., 1::2]


def decode_int4_halves(q: QuantMatrix, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q's blocks moved to device as they are and split there (split_blocks): codes uint8 [N, K / 2],
    scale and zero float32 [N, K / 32], DECODE_ROWS_BYTES of blocks at a time."""
    n, k = q.shape
    _, bs, ts = QTYPES[int4_type(q.qtype)]
    data = q.row_data() if q.interleaved else q.data  # (quant.pack_rows' layout: its GGUF rows, a copy)
    codes = torch.empty((n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((n, k // GROUP_SIZE), dtype=torch.float32, device=device)
    zero = torch.empty_like(scale)
    step = max(1, DECODE_ROWS_BYTES // q.row_bytes())
    with warnings.catch_warnings():  # a view of a read-only file mapping: only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for a in range(0, n, step):
            raw = torch.from_numpy(np.ascontiguousarray(data[a:a + step])).to(device).view(-1, k // bs, ts)
            codes[a:a + step], scale[a:a + step], zero[a:a + step] = split_blocks(raw, q.qtype)
    return codes, scale, zero


def decode_int4(q: QuantMatrix, device="cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q's weights as tinygemm sees them, split on device: codes uint8 [N, K / 2] packed two a byte
    (element 2j in the high nibble), scale and zero float32 [N, K / 32], w = (code - 8) * scale + zero."""
    codes, scale, zero = decode_int4_halves(q, device)
    return halves_to_pairs(codes), scale, zero


def _pad_rows(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int):
    """decode_int4's tensors with zero rows appended up to n rows (scale and zero 0: weights 0)."""
    pad = n - packed.shape[0]
    if pad < 0:
        raise ValueError(f"cannot pad {packed.shape[0]} rows to {n}")
    return tuple(torch.nn.functional.pad(a, (0, 0, 0, pad)) for a in (packed, scale, zero))


# ---------------------------------------------------------------------------------------------
# Floats -> codes, scales, zeros (numpy): requantisation where the GGUF blocks do not fit

def _bf16(a: np.ndarray) -> np.ndarray:
    # float32 values rounded to bf16 (as the kernel holds scale and zero), float32 again
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def _pack(codes: np.ndarray) -> np.ndarray:
    # codes uint8 [N, K] in 0..15 -> [N, K / 2], element 2j in the high nibble of byte j
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float weights [N, K] (K a multiple of 32) in decode_int4's layout, asymmetric per group of 32
    along K: scale = (max - min) / 15 and zero = min + 8 scale, each rounded to bf16 before the codes
    are chosen (the nearest for what the kernel multiplies by); a constant group has scale 0."""
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"K must be a multiple of {GROUP_SIZE}, got {k}")
    g = np.asarray(w, np.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo = g.min(-1)  # [N, K / 32]
    scale = _bf16((g.max(-1) - lo) / 15)
    zero = _bf16(lo + 8 * scale)
    step = np.where(scale > 0, scale, 1)[..., None]
    codes = np.where(scale[..., None] > 0, np.rint((g - zero[..., None]) / step) + 8, 8)  # [N, K / 32, 32]
    return _pack(np.clip(codes, 0, 15).astype(np.uint8).reshape(n, k)), scale, zero


# ---------------------------------------------------------------------------------------------
# Int4Matrix

class Int4Matrix:
    """A [N, K] weight held as torch's tinygemm int4 layout on one device.

    packed: CUDA int32 [N / 8, K / (inner_k_tiles * 16), 32, inner_k_tiles / 2] | CPU uint8 [N, K / 2]
    scales_and_zeros: bf16 [K / group, N, 2]
    shape: (N, K); qtype: the GGUF type it came from (None: requantised floats, `from_float`)
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, shape: tuple[int, int],
                 group_size: int = GROUP_SIZE, inner_k_tiles: int = 8, qtype: str | None = None):
        n, k = int(shape[0]), int(shape[1])
        if scales_and_zeros.shape != (k // group_size, n, 2) or scales_and_zeros.dtype != torch.bfloat16:
            raise ValueError(f"scales_and_zeros must be bf16 {(k // group_size, n, 2)}, got "
                             f"{scales_and_zeros.dtype} {tuple(scales_and_zeros.shape)}")
        if packed.device != scales_and_zeros.device:
            raise ValueError(f"packed on {packed.device}, scales_and_zeros on {scales_and_zeros.device}")
        self.packed, self.scales_and_zeros = packed, scales_and_zeros.contiguous()
        self.shape, self.group_size, self.inner_k_tiles, self.qtype = (n, k), group_size, inner_k_tiles, qtype
        self._cuda = packed.device.type == "cuda"

    @classmethod
    def from_quant(cls, q: QuantMatrix, device, inner_k_tiles: int | None = None, rows=None,
                   n: int | None = None) -> "Int4Matrix":
        """Repack a Q4_0 / Q4_1 / Q4_K QuantMatrix [N, K] for device (ValueError if it cannot be):
        rows: only those rows, in that order (their own blocks: no float round trip); n: padded with
        zero rows to n rows (see int4_padded)."""
        if rows is not None:
            rows = np.asarray(rows, np.int64)
            q = QuantMatrix(np.ascontiguousarray(q.row_data(rows)), q.qtype, (len(rows), q.cols))
        n = q.rows if n is None else int(n)
        why = int4_unsupported_reason(q.qtype, device, (n, q.cols), inner_k_tiles)
        if why is not None:
            raise ValueError(f"{q.qtype} {(n, q.cols)} cannot be kept as int4 on {device}: {why}")
        return cls.from_codes(*_pad_rows(*decode_int4(q, device), n), device, inner_k_tiles, q.qtype)

    @classmethod
    def from_float(cls, w, device, inner_k_tiles: int | None = None) -> "Int4Matrix":
        """Requantise float weights w [N, K] (numpy, or a tensor on any device) for device (see
        quantize_int4; ValueError if the kernels cannot take [N, K] there)."""
        w = w.detach().float().cpu().numpy() if isinstance(w, torch.Tensor) else np.asarray(w, np.float32)
        why = int4_layout_reason(device, w.shape, inner_k_tiles)
        if why is not None:
            raise ValueError(f"floats {w.shape} cannot be kept as int4 on {device}: {why}")
        return cls.from_codes(*quantize_int4(w), device, inner_k_tiles)

    @classmethod
    def from_codes(cls, packed, scale, zero, device, inner_k_tiles: int | None = None,
                   qtype: str | None = None) -> "Int4Matrix":
        """From decode_int4's layout (codes uint8 [N, K / 2], scale and zero float32 [N, K / 32]; numpy
        arrays, or tensors on any device), packed for device; qtype: the GGUF type the codes came from
        (None: requantised floats)."""
        n, k = packed.shape[0], 2 * packed.shape[1]
        why = int4_layout_reason(device, (n, k), inner_k_tiles)
        if why is not None:
            raise ValueError(f"an int4 matrix {(n, k)} cannot be kept on {device}: {why}")
        dev = torch.device(device)
        t = _pick_inner_k_tiles(k) if inner_k_tiles is None else inner_k_tiles
        sz = torch.stack([torch.as_tensor(scale), torch.as_tensor(zero)], dim=-1).to(dev)  # [N, K / 32, 2]
        sz = sz.transpose(0, 1).to(torch.bfloat16).contiguous()  # [K / 32, N, 2]
        w = torch.as_tensor(np.ascontiguousarray(packed) if isinstance(packed, np.ndarray) else packed).to(dev)
        if dev.type == "cuda":
            with torch.cuda.device(dev):
                w = torch.ops.aten._convert_weight_to_int4pack(w, t)
        else:
            codes = torch.stack([w >> 4, w & 15], dim=-1).reshape(n, k).to(torch.int32)  # [N, K]
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, t)
        return cls(w, sz, (n, k), GROUP_SIZE, t, qtype)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Device bytes held: packed codes + scales and zeros."""
        return (self.packed.numel() * self.packed.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T: x [..., K] on this device (any float dtype; multiplied in bf16) -> [..., N] in x's dtype."""
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
        if not (x.is_cuda if self._cuda else x.is_cpu):  # (CUDA's op checks the device index)
            raise ValueError(f"x is on {x.device}, the weight on {self.device}")
        # decode's common case, x bf16 [M, K] contiguous, goes straight to the op: every torch call
        # costs host time that a one-token GEMV of a few microseconds cannot hide
        fast = x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[0] > 0
        x2 = x if fast else x.reshape(-1, k).to(torch.bfloat16).contiguous()  # [M, K]
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], n)
        if x2.data_ptr() % 16:  # the CUDA kernel loads x 4 bytes at a time
            x2 = x2.clone()
        op = torch.ops.aten._weight_int4pack_mm if self._cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = op(x2, self.packed, self.group_size, self.scales_and_zeros)  # [M, N] bf16
        return y if fast else y.reshape(*x.shape[:-1], n).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, chunk: int = 256) -> torch.Tensor:
        """The weights the kernel multiplies by, [N, K] (one-hot rows through `mm`: K / chunk
        calls of M = chunk, for tests and references, not for speed)."""
        n, k = self.shape
        out = torch.empty((n, k), dtype=dtype, device=self.device)
        for a in range(0, k, chunk):
            b = min(k, a + chunk)
            eye = torch.zeros((b - a, k), dtype=torch.bfloat16, device=self.device)  # [b - a, K]
            eye[:, a:b] = torch.eye(b - a, dtype=torch.bfloat16, device=self.device)
            out[:, a:b] = self.mm(eye).T.to(dtype)
        return out

    def __repr__(self) -> str:
        return (f"Int4Matrix({self.qtype or 'requantised'}, shape={self.shape}, group={self.group_size}, "
                f"{self.device}, {self.nbytes / 2**20:.1f} MiB)")


class Int4Linear(nn.Module):
    """nn.Linear over an Int4Matrix weight [out, in] (bias, if any, a float tensor on its device).

    The packed layout is device-specific: build it on the device it runs on (`from_quant`) rather
    than moving it with `.to()`."""

    def __init__(self, weight: Int4Matrix, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = weight
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.device), requires_grad=False)

    @classmethod
    def from_quant(cls, q: QuantMatrix, device, bias: torch.Tensor | None = None,
                   inner_k_tiles: int | None = None) -> "Int4Linear":
        return cls(Int4Matrix.from_quant(q, device, inner_k_tiles), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out] in x's dtype
        y = self.qweight.mm(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, int4 from {self.qweight.qtype}, "
                f"bias={self.bias is not None}")
