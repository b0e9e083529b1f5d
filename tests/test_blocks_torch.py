"""hotcold.sparse_ops.blocks_torch: GGUF blocks decoded by torch ops, against gguf.quants' decoders.

Random valid blocks of each decodable type (`random_matrix`), in the file's layout and row-interleaved
(`pack_rows`, where the type has that layout), decoded on the CPU; the CUDA cases repeat it on a GPU
and check the Triton decoder (sparse_ops/blocks_gpu.py) the same way.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.sparse_ops.blocks_torch import DECODABLE, dequantize, dequantize_matrix
from hotcold.sparse_ops.quant import PACK_DEFAULT, QTYPES, pack_rows, random_matrix

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("qtype", sorted(DECODABLE))
@pytest.mark.parametrize("interleaved", [False, True])
def test_decodes_as_gguf(qtype, interleaved):
    m = random_matrix(qtype, (24, 2 * QTYPES[qtype][1]), seed=QTYPES[qtype][0])
    want = m.dequantize()  # gguf.quants, in the file's layout
    if interleaved:
        if qtype not in PACK_DEFAULT:
            pytest.skip(f"{qtype} has no interleaved layout")
        m = pack_rows(m, xq=True)
        assert m.interleaved
    got = dequantize_matrix(m).numpy()
    np.testing.assert_array_equal(got, want)  # the same float32 arithmetic: exact


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_bf16_output_into_a_view_and_unknown_types(qtype):
    """A 16-bit output multiplies in that dtype: within a few of its ulps (of the matrix's largest
    weight: Q4_1's d * q + m may cancel) of gguf's float32 result."""
    m = pack_rows(random_matrix(qtype, (16, 64), seed=1), xq=True)
    out = torch.full((2, 16, 64), float("nan"), dtype=torch.bfloat16)
    dequantize(torch.from_numpy(m.data), m.qtype, m.shape, m.interleaved, out=out[1])
    want = torch.from_numpy(random_matrix(qtype, (16, 64), seed=1).dequantize())
    torch.testing.assert_close(out[1].float(), want, rtol=2 ** -6, atol=2 ** -7 * float(want.abs().max()))
    assert torch.isnan(out[0].float()).all()  # only the view was written
    with pytest.raises(ValueError, match="no torch decoder for Q5_0"):
        dequantize(torch.from_numpy(random_matrix("Q5_0", (8, 32)).data), "Q5_0", (8, 32))


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("qtype", sorted(DECODABLE))
def test_decodes_on_cuda(qtype):
    m = random_matrix(qtype, (64, 4 * QTYPES[qtype][1]), seed=7)
    if qtype in PACK_DEFAULT:
        m = pack_rows(m, xq=True)
    got = dequantize(torch.from_numpy(m.data).cuda(), m.qtype, m.shape, m.interleaved, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), m.dequantize())


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_decoder_on_cuda(qtype, interleaved):
    """sparse_ops.blocks_gpu: one kernel, equal to gguf's float32 decode; into a strided bf16 view
    within bf16's rounding, leaving the rest of the buffer alone. Rows and columns not multiples of
    the kernel's tile (40 x 288) check its edges."""
    blocks_gpu = pytest.importorskip("hotcold.sparse_ops.blocks_gpu")  # imports Triton
    m = random_matrix(qtype, (40, 288), seed=5)
    want = m.dequantize()
    if interleaved:
        m = pack_rows(m, xq=True)
        assert m.interleaved
    data = torch.from_numpy(m.data).cuda()
    got = blocks_gpu.dequantize(data, m.qtype, m.shape, m.interleaved, torch.empty(40, 288, device="cuda"))
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    buf = torch.full((40, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    blocks_gpu.dequantize(data, m.qtype, m.shape, m.interleaved, buf[:, 7:295])
    torch.testing.assert_close(buf[:, 7:295].float().cpu(), torch.from_numpy(want), rtol=2 ** -7, atol=0)
    assert torch.isnan(buf[:, :7].float()).all() and torch.isnan(buf[:, 295:].float()).all()
    with pytest.raises(ValueError, match="no Triton decoder for Q4_K"):
        blocks_gpu.dequantize(data, "Q4_K", m.shape, False, got)
