"""GGUF blocks decoded on CUDA by one Triton kernel: Q4_0, Q4_1 and Q8_0, GGUF or interleaved rows;
and a second kernel for the 4-bit stacks of the GPU's experts (`moe_gpu.Q4Stack`).

`blocks_torch.dequantize` decodes any decodable type with a dozen torch ops, each a pass over the
weights (gathering an interleaved group back to the GGUF order, splitting nibbles, converting,
scaling, copying out); prefill decodes every streamed expert group that way. Here each output
weight is computed from its bytes where they lie, in one pass: its block's fp16 scale (and Q4_1's
min), its nibble or byte, written once in the output's dtype. The arithmetic is the reference
decoders' in float32, rounded once to the output dtype, so a float32 output equals
`QuantMatrix.dequantize` bit for bit. Importing this module imports Triton: callers import it only
for a CUDA tier.

Byte addresses (block b of row r, T bytes a block, B bytes a row): GGUF rows hold the block at
r * B + b * T. Interleaved ("x8", `quant.X8_FIELDS`) groups of 8 rows store their 8 blocks b field by
field, each field in units (2 bytes for an fp16, 4 for quants) unit-major, at (r // 8) * 8B + b * 8T:
field (offset o, unit n) byte j of row r % 8 = rr lies at 8o + ((j // n) * 8 + rr) * n + j % n.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# per type: (bytes a block, offset of the quants, offset of Q4_1's min or -1, bits a quant)
_LAYOUT = {"Q4_0": (18, 2, -1, 4), "Q4_1": (20, 4, 2, 4), "Q8_0": (34, 2, -1, 8)}
TYPES = frozenset(_LAYOUT)
_ROWS, _COLS = 8, 256  # output tile of one program


@triton.jit
def _byte(base, rr, j, off: tl.constexpr, unit: tl.constexpr, X8: tl.constexpr):
    # the address of byte j of the field at `off` in row rr's block b, the block's group (X8) or row at base
    if X8:
        return base + 8 * off + ((j // unit) * 8 + rr) * unit + j % unit
    return base + off + j


@triton.jit
def _f16(p, base, rr, off: tl.constexpr, X8: tl.constexpr):
    lo = tl.load(p + _byte(base, rr, 0, off, 2, X8)).to(tl.uint16)
    hi = tl.load(p + _byte(base, rr, 1, off, 2, X8)).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode(src, out, rows, cols, row_bytes, out_stride, T: tl.constexpr, QS: tl.constexpr, MIN: tl.constexpr,
            BITS: tl.constexpr, X8: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]  # [1, COLS]
    mask = (r < rows) & (c < cols)
    r = tl.where(mask, r, 0).to(tl.int64)
    c = tl.where(mask, c, 0)
    b, e = c // 32, c % 32
    if X8:
        base, rr = (r // 8) * (8 * row_bytes) + b * (8 * T), r % 8
    else:
        base, rr = r * row_bytes + b * T, r * 0
    d = _f16(src, base, rr, 0, X8)
    if BITS == 4:  # byte e % 16 of the quants: element e % 16 in its low nibble, e % 16 + 16 in its high one
        q = tl.load(src + _byte(base, rr, e % 16, QS, 4, X8))
        q = ((q >> (4 * (e // 16)).to(tl.uint8)) & 15).to(tl.float32)
        if MIN >= 0:
            w = q * d + _f16(src, base, rr, MIN, X8)
        else:
            w = (q - 8.0) * d
    else:
        w = tl.load(src + _byte(base, rr, e, QS, 4, X8)).to(tl.int8, bitcast=True).to(tl.float32) * d
    tl.store(out + r * out_stride + c, w.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _decode_halves(codes, scale, zero, out, rows, K, ROWS: tl.constexpr, COLS: tl.constexpr):
    # a Q4Stack's rows: w = (code - 8) * scale + zero, codes packed as Q4_0 packs a group of 32
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    mask = (r < rows) & (c < K)
    r = tl.where(mask, r, 0).to(tl.int64)
    c = tl.where(mask, c, 0)
    g, e = c // 32, c % 32
    q = tl.load(codes + r * (K // 2) + g * 16 + e % 16)
    q = ((q >> (4 * (e // 16)).to(tl.uint8)) & 15).to(tl.float32)
    s = tl.load(scale + r * (K // 32) + g).to(tl.float32)
    z = tl.load(zero + r * (K // 32) + g).to(tl.float32)
    tl.store(out + r * K + c, ((q - 8.0) * s + z).to(out.dtype.element_ty), mask=mask)


def dequantize_halves(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A Q4Stack's matrices (codes uint8 [..., N, K / 2], scale and zero fp16 [..., N, K / 32], on the
    device) as dtype [..., N, K] in one kernel: `Q4Stack.dequantize` without its float32 temporaries."""
    codes, scale, zero = codes.contiguous(), scale.contiguous(), zero.contiguous()
    K = 2 * codes.shape[-1]
    out = torch.empty((*codes.shape[:-1], K), dtype=dtype, device=codes.device)
    rows = out.numel() // K
    if rows:
        _decode_halves[(triton.cdiv(rows, _ROWS), triton.cdiv(K, _COLS))](codes, scale, zero, out, rows, K,
                                                                          ROWS=_ROWS, COLS=_COLS)
    return out


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, int], interleaved: bool,
               out: torch.Tensor) -> torch.Tensor:
    """`blocks_torch.dequantize` for Q4_0 / Q4_1 / Q8_0 in one kernel: the matrix whose blocks are
    `data` (uint8 on the device, as `QuantMatrix.data` holds them: [rows, row bytes], or [rows / 8,
    8 * row bytes] interleaved) into `out` ([rows, cols] with unit column stride, any float dtype)."""
    if qtype not in _LAYOUT:
        raise ValueError(f"no Triton decoder for {qtype} (it has {', '.join(sorted(TYPES))})")
    rows, cols = shape
    if out.shape != (rows, cols) or out.stride(1) != 1 or not data.is_contiguous():
        raise ValueError(f"out must be a [{rows}, {cols}] view with unit column stride and data contiguous")
    T, qs, mn, bits = _LAYOUT[qtype]
    grid = (triton.cdiv(rows, _ROWS), triton.cdiv(cols, _COLS))
    _decode[grid](data, out, rows, cols, cols // 32 * T, out.stride(0), T=T, QS=qs, MIN=mn, BITS=bits,
                 X8=bool(interleaved), ROWS=_ROWS, COLS=_COLS)
    return out
