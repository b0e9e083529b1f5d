"""GGUF blocks decoded by torch ops, on any device: the fast tier's view of a `QuantMatrix`'s bytes.

Prefill streams CPU-held quantised experts to the GPU as the raw bytes the CPU kernels read (the
file's blocks, or their row-interleaved copy, `quant.pack_rows`), so nothing is repacked at load
and no second host copy exists; this module turns those bytes back into weights where they land.
Each decode is a handful of elementwise torch ops over the block tensor (memory-bound: on a GPU a
chunk of experts decodes in a small fraction of the time its bytes take to cross PCIe).

Types: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (`DECODABLE`), GGUF layout or interleaved ("x8": groups of 8
rows whose blocks are stored field by field, unit-major; `X8_FIELDS`). An interleaved group-block
is a fixed permutation of its 8 rows' blocks, so it is gathered back by one index (`_x8_order`).
The arithmetic is gguf's reference decoders': in float32 for a float32 output (bit-equal to
`QuantMatrix.dequantize`, gguf.quants, the independent reference in the tests); for a 16-bit output
the 4- and 8-bit types multiply in that dtype (the block scale rounded to it first: within a few of
its ulps of the block's largest weight, far below the 4-bit quantisation error), which cuts the
temporaries a decode allocates.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from hotcold.sparse_ops.quant import QTYPES, X8, X8_FIELDS, QuantMatrix

DECODABLE = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"})


@functools.lru_cache(maxsize=None)
def _x8_order(qtype: str) -> np.ndarray:
    """int64 [8 * T]: position j of the 8 rows' blocks (row r's byte i at r * T + i) in an interleaved
    group-block, so that group_block[order] is the 8 blocks in the GGUF layout."""
    ts = QTYPES[qtype][2]
    order = np.empty(X8 * ts, np.int64)
    base = 0
    for off, size, unit in X8_FIELDS[QTYPES[qtype][0]]:
        for u in range(size // unit):
            for r in range(X8):
                for j in range(unit):
                    order[r * ts + off + u * unit + j] = base + (u * X8 + r) * unit + j
        base += X8 * size
    return order


def gguf_rows(data: torch.Tensor, qtype: str, rows: int, interleaved: bool) -> torch.Tensor:
    """uint8 [rows, blocks, T]: the matrix's blocks in the GGUF layout (a view, or one gather when
    interleaved). data: uint8 [rows, row_bytes], or [rows / 8, 8 * row_bytes] when interleaved."""
    ts = QTYPES[qtype][2]
    if not interleaved:
        return data.reshape(rows, -1, ts)
    g = rows // X8
    order = torch.from_numpy(_x8_order(qtype)).to(data.device)
    blocks = data.reshape(g, -1, X8 * ts).index_select(2, order)  # [g, nb, 8 * T], GGUF order per row
    return blocks.reshape(g, -1, X8, ts).transpose(1, 2).reshape(rows, -1, ts)


def _f16(b: torch.Tensor, ct: torch.dtype = torch.float32) -> torch.Tensor:
    # [..., 2] uint8 -> ct [...] (little-endian fp16)
    return b.contiguous().view(torch.float16)[..., 0].to(ct)


def _q4_0(b: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    qs = b[..., 2:18]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).to(ct).sub_(8)  # elements 0-15 low nibbles, 16-31 high
    return q.mul_(_f16(b[..., 0:2], ct)[..., None])


def _q4_1(b: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    qs = b[..., 4:20]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).to(ct)
    return q.mul_(_f16(b[..., 0:2], ct)[..., None]).add_(_f16(b[..., 2:4], ct)[..., None])


def _q8_0(b: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    return b[..., 2:34].contiguous().view(torch.int8).to(ct).mul_(_f16(b[..., 0:2], ct)[..., None])


def _q4_k(b: torch.Tensor, ct: torch.dtype) -> torch.Tensor:  # in float32 whatever ct
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [R, nb]
    s = b[..., 4:16].to(torch.int32)  # 12 bytes: 6-bit scales and mins of the 8 sub-blocks
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # sub-blocks 2c / 2c + 1: low / high nibbles
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()
    w = q * (d[..., None] * sc.float())[..., None] - (dmin[..., None] * mn.float())[..., None]
    return w.flatten(-2)


def _q6_k(b: torch.Tensor, ct: torch.dtype) -> torch.Tensor:  # in float32 whatever ct
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64).to(torch.int32)  # two halves of 128 elements
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32).to(torch.int32)
    scales = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*b.shape[:-1], 2, 4, 2)
    d = _f16(b[..., 208:210])
    lo = torch.stack([ql[..., 0:32] & 15, ql[..., 32:64] & 15, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], dim=-2)
    hi = (qh >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.int32)[:, None]) & 3  # [.., 2, 4, 32]
    q = (lo | (hi << 4)).float() - 32  # [..., 2 halves, 4 quarters, 32]
    sc = scales[..., None].expand(*scales.shape, 16).reshape(*scales.shape[:-1], 32)  # 16 elements a scale
    return (q * sc * d[..., None, None, None]).flatten(-3)


_DECODE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize(data: torch.Tensor, qtype: str, shape: tuple[int, int], interleaved: bool = False,
               dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix whose blocks are `data` (uint8, on any device, as `QuantMatrix.data` holds them) as
    dtype [rows, cols]; into `out` when given (any [rows, cols] view of that dtype)."""
    if qtype not in _DECODE:
        raise ValueError(f"no torch decoder for {qtype} (decodable: {', '.join(sorted(DECODABLE))})")
    rows, cols = shape
    ct = out.dtype if out is not None else dtype  # the dtype the 4- and 8-bit types multiply in
    w = _DECODE[qtype](gguf_rows(data, qtype, rows, interleaved), ct).reshape(rows, cols)
    if out is None:
        return w.to(dtype)
    return out.copy_(w)


def dequantize_matrix(m: QuantMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A QuantMatrix decoded by `dequantize` on the CPU (for tests and references)."""
    return dequantize(torch.from_numpy(m.data), m.qtype, m.shape, m.interleaved, dtype)
