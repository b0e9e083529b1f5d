"""hotcold.sparse_ops.gpu_quant (GGUF 4-bit -> torch's int4 tinygemm kernels) against gguf.quants.dequantize.

On the CPU through the `_for_cpu` ops; the `cuda` tests repeat the checks with the CUDA kernels.
Tolerances: the kernels hold scale and zero in bf16 (relative error <= 2^-9 each), CUDA also rounds
every dequantised weight to bf16, and both round y to bf16. So per weight |w_kernel - w| <= 2^-8 A with
A = 8 |scale| + |zero| of its group (the largest the two rounded terms can be), and per output
|y - x @ w.T| <= 2^-8 (|x| @ A.T) + 2^-9 |y|; the bounds below take about twice that. A wrong nibble
order or group mapping is off by whole steps of scale, far outside them.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from hotcold.sparse_ops import quant
from hotcold.sparse_ops.gpu_quant import (GROUP_SIZE, INT4_QTYPES, Int4Linear, Int4Matrix, decode_int4,
                                          decode_int4_halves, int4_padded, int4_supported, int4_unsupported_reason, quantize_int4)
from hotcold.sparse_ops.quant import QuantMatrix

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def shapes(qtype: str) -> list[tuple[int, int]]:
    """(N, K): N a multiple of 16 (the CPU op's rule); K giving inner_k_tiles 2, 4 and 8 (96, 320, 512)."""
    return [(48, 256), (32, 768)] if qtype == "Q4_K" else [(16, 96), (32, 320), (48, 512)]


def random_q(qtype: str, shape, seed: int, how: str) -> QuantMatrix:
    """Random bytes with sane fp16 scales (every code and 6-bit sub-scale occurs), or quantised
    random normal floats (as a real checkpoint's blocks), as tests/test_quant_ops.py makes them."""
    if how == "bytes":
        return quant.random_matrix(qtype, shape, seed=seed)
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
    return QuantMatrix.quantize(w, qtype)


def deq(m: QuantMatrix) -> np.ndarray:
    """Reference weights: gguf.quants.dequantize of the raw blocks, float64 [N, K]."""
    w = gguf.quants.dequantize(m.data, gguf.GGMLQuantizationType[m.qtype])
    return np.asarray(w, np.float64).reshape(m.shape)


def group_magnitude(m: QuantMatrix) -> np.ndarray:
    """A = 8 |scale| + |zero| per weight, float64 [N, K] (from our decoder; its values are checked
    against gguf in test_decode_matches_gguf)."""
    _, scale, zero = (t.numpy() for t in decode_int4(m))
    a = 8 * np.abs(scale.astype(np.float64)) + np.abs(zero.astype(np.float64))
    return np.repeat(a, GROUP_SIZE, axis=1)


def assert_within(got, want, bound) -> None:
    """Elementwise |got - want| <= bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(bound, err.shape)
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), f"error {err.flat[worst]:.3g} > bound {bound.flat[worst]:.3g}"


def check_mm(m: QuantMatrix, device: str, seed: int) -> None:
    """Int4Matrix.mm == x @ dequantised.T within the bf16 bounds, M = 1 and 7, and the weights the
    kernel sees (one-hot x) == gguf's per element."""
    im = Int4Matrix.from_quant(m, device)
    assert im.shape == m.shape and im.qtype == m.qtype and im.device.type == device
    w, a = deq(m), group_magnitude(m)
    wk = im.dequantize(torch.float32).cpu().double().numpy()  # [N, K]
    assert_within(wk, w, 2.0 ** -7 * a)
    gen = torch.Generator().manual_seed(seed)
    for rows in (1, 7):
        x = torch.randn(rows, m.cols, generator=gen)
        y = im.mm(x.to(device))
        assert y.shape == (rows, m.rows) and y.dtype == torch.float32
        xb = x.to(torch.bfloat16).double().numpy()  # the kernel multiplies bf16 x
        ref = xb @ w.T
        assert_within(y.cpu().double().numpy(), ref, 2.0 ** -7 * (np.abs(xb) @ a.T) + 2.0 ** -8 * np.abs(ref))
        rel = np.linalg.norm(y.cpu().double().numpy() - ref) / np.linalg.norm(ref)
        assert rel < 0.01, rel


# --------------------------------------------------------------------------------------------
# CPU (the _for_cpu ops)

@pytest.mark.parametrize("qtype", INT4_QTYPES)
@pytest.mark.parametrize("how", ["bytes", "floats"])
def test_decode_matches_gguf(qtype, how):
    # w = (code - 8) * scale + zero: exact in float64, codes packed with element 2j in the high nibble
    # (decode_int4, tinygemm's) or per group of 32 element i low and i + 16 high (decode_int4_halves, Q4_0's)
    for n, k in shapes(qtype):
        m = random_q(qtype, (n, k), seed=n + k, how=how)
        packed, scale, zero = (t.numpy() for t in decode_int4(m))
        assert packed.shape == (n, k // 2) and scale.shape == zero.shape == (n, k // GROUP_SIZE)
        codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(n, k).astype(np.float64)
        w = (codes - 8) * np.repeat(scale, GROUP_SIZE, 1) + np.repeat(zero, GROUP_SIZE, 1)
        np.testing.assert_array_equal(w, deq(m))
        if qtype == "Q4_0":
            assert not zero.any()
        halves, s2, z2 = (t.numpy() for t in decode_int4_halves(m))
        c = halves.reshape(n, k // GROUP_SIZE, 16)
        codes = np.stack([c & 15, c >> 4], axis=-2).reshape(n, k).astype(np.float64)
        w = (codes - 8) * np.repeat(s2, GROUP_SIZE, 1) + np.repeat(z2, GROUP_SIZE, 1)
        np.testing.assert_array_equal(w, deq(m))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", INT4_QTYPES)
def test_blocks_split_on_the_gpu_as_on_the_cpu(qtype):
    # the split runs where the blocks are: the same codes, scales and zeros on CUDA (separate ops, no FMA)
    for n, k in shapes(qtype):
        m = random_q(qtype, (n, k), seed=n + k, how="bytes")
        for a, b in zip(decode_int4(m), decode_int4(m, "cuda")):
            assert b.is_cuda and torch.equal(a, b.cpu())


@pytest.mark.parametrize("qtype", INT4_QTYPES)
@pytest.mark.parametrize("how", ["bytes", "floats"])
def test_cpu_mm_matches_dequantised(qtype, how):
    for i, shape in enumerate(shapes(qtype)):
        check_mm(random_q(qtype, shape, seed=10 + i, how=how), "cpu", seed=i)


def test_mm_shapes_dtypes_and_inner_k_tiles():
    m = random_q("Q4_K", (32, 512), seed=3, how="floats")
    im = Int4Matrix.from_quant(m, "cpu")
    assert im.inner_k_tiles == 8 and im.group_size == 32
    assert im.nbytes == 32 * 512 // 2 + 512 // 32 * 32 * 2 * 2  # codes + bf16 (scale, zero) per 32
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    y = im.mm(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, im.mm(x.reshape(6, 512)).reshape(2, 3, 32), rtol=0, atol=0)
    torch.testing.assert_close(im.mm(x.float()), y.float(), rtol=0, atol=0)  # multiplied in bf16 either way
    assert im.mm(torch.zeros(0, 512)).shape == (0, 32)
    assert im.mm(torch.randn(1, 513)[:, 1:]).shape == (1, 32)  # a view at an odd offset
    # the CPU kernel ignores inner_k_tiles: a forced one gives the same product
    torch.testing.assert_close(Int4Matrix.from_quant(m, "cpu", inner_k_tiles=2).mm(x), y, rtol=0, atol=0)
    with pytest.raises(ValueError, match="features"):
        im.mm(torch.randn(1, 256))
    with pytest.raises(ValueError, match="device|on meta"):
        im.mm(torch.randn(1, 512, device="meta"))


def test_int4_linear_replaces_nn_linear():
    m = random_q("Q4_1", (48, 320), seed=4, how="floats")
    bias = torch.randn(48)
    lin = nn.Linear(320, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(deq(m)).float())
        lin.bias.copy_(bias)
    il = Int4Linear.from_quant(m, "cpu", bias=bias)
    assert (il.in_features, il.out_features) == (320, 48) and "int4 from Q4_1" in repr(il)
    x = torch.randn(5, 320)
    with torch.no_grad():
        y, want = il(x), lin(x.to(torch.bfloat16).float())
    assert y.dtype == torch.float32
    rel = float((y - want).norm() / want.norm())
    assert rel < 0.01, rel
    torch.testing.assert_close(Int4Linear(il.qweight)(x) + bias, y, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="bias"):
        Int4Linear(il.qweight, torch.zeros(3))


def test_row_subsets_padding_and_interleaved_rows():
    """from_quant(rows=, n=): those rows' own blocks in that order, then zero rows up to n; an
    interleaved matrix (quant.pack_rows) repacks to the same weights."""
    m = random_q("Q4_0", (64, 256), seed=6, how="floats")
    full = Int4Matrix.from_quant(m, "cpu").dequantize(torch.float32)
    rows = np.array([40, 2, 2, 63, 7])
    sub = Int4Matrix.from_quant(m, "cpu", rows=rows, n=32)
    w = sub.dequantize(torch.float32)
    assert sub.shape == (32, 256) and torch.equal(w[:5], full[rows]) and not w[5:].any()
    packed = quant.pack_rows(m)
    assert packed.interleaved
    assert torch.equal(Int4Matrix.from_quant(packed, "cpu").dequantize(torch.float32), full)
    assert torch.equal(Int4Matrix.from_quant(packed, "cpu", rows=rows, n=16).dequantize(torch.float32)[:5], full[rows])
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        Int4Matrix.from_quant(m, "cpu", rows=rows)
    assert [int4_padded(n, "cpu") for n in (0, 1, 16, 17)] == [0, 16, 16, 32]
    assert int4_padded(17, "cpu", as_k=True) == 32 and int4_padded(33, "cpu", as_k=True) == 64


def test_requantised_floats():
    """quantize_int4 / Int4Matrix.from_float: asymmetric min/max groups of 32 along K, scale and zero
    rounded to bf16 before the codes are chosen: every weight within half a step (plus the bf16
    rounding) of its float, a constant group exact up to bf16, about 8% relative RMS error on normal
    weights; the kernel multiplies by those weights."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 96)).astype(np.float32)
    w[3, 32:64] = 0.7  # a constant group
    packed, scale, zero = quantize_int4(w)
    assert packed.shape == (16, 48) and scale.shape == zero.shape == (16, 3) and scale[3, 1] == 0
    codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(16, 96).astype(np.float64)
    s, z = (np.repeat(a.astype(np.float64), GROUP_SIZE, axis=1) for a in (scale, zero))
    deq = (codes - 8) * s + z
    assert_within(deq, w, 0.5 * s + 2.0 ** -7 * (8 * s + np.abs(z)))
    assert np.all(deq[3, 32:64] == torch.tensor(0.7).bfloat16().item())
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert 0.05 < rel < 0.1, rel
    wk = Int4Matrix.from_float(torch.from_numpy(w), "cpu").dequantize(torch.float32).double().numpy()
    assert_within(wk, deq, 2.0 ** -8 * np.abs(deq))  # dequantize() rounds to bf16
    assert Int4Matrix.from_float(w, "cpu").qtype is None
    with pytest.raises(ValueError, match="K must be"):
        Int4Matrix.from_float(np.zeros((16, 100), np.float32), "cpu")
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        Int4Matrix.from_float(np.zeros((24, 96), np.float32), "cpu")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_other_types_are_refused(qtype):
    m = quant.random_matrix(qtype, (16, 256), seed=0)
    assert not int4_supported(qtype, "cpu") and not int4_supported(qtype, "cpu", m.shape)
    assert qtype in int4_unsupported_reason(qtype, "cpu")
    with pytest.raises(ValueError, match=qtype):
        Int4Matrix.from_quant(m, "cpu")
    assert not int4_supported("F16", "cpu")


def test_unsupported_shapes_and_devices_are_refused():
    for qtype in INT4_QTYPES:
        assert int4_supported(qtype, "cpu") and int4_supported(qtype, torch.device("cpu"), (16, 256))
        assert not int4_supported(qtype, "meta")
    assert not int4_supported("Q4_0", "cpu", (24, 256))  # CPU packing needs N % 16 == 0
    assert "N must be a multiple of 16" in int4_unsupported_reason("Q4_0", "cpu", (24, 256))
    assert not int4_supported("Q4_0", "cpu", (16, 96), inner_k_tiles=8)  # K % (8 * 16) != 0: not padded
    assert "K must be a multiple of" in int4_unsupported_reason("Q4_0", "cpu", (16, 96), inner_k_tiles=8)
    assert not int4_supported("Q4_0", "cpu", (16, 256), inner_k_tiles=3)
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        Int4Matrix.from_quant(quant.random_matrix("Q4_0", (24, 256)), "cpu")
    with pytest.raises(ValueError, match="K must be a multiple of 128"):
        Int4Matrix.from_quant(quant.random_matrix("Q4_0", (16, 96)), "cpu", inner_k_tiles=8)
    if not torch.cuda.is_available():
        assert not int4_supported("Q4_0", "cuda", (16, 256))


# --------------------------------------------------------------------------------------------
# CUDA

@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("qtype", INT4_QTYPES)
@pytest.mark.parametrize("how", ["bytes", "floats"])
def test_cuda_mm_matches_dequantised(qtype, how):
    if not int4_supported(qtype, "cuda"):
        pytest.skip(int4_unsupported_reason(qtype, "cuda"))
    for i, shape in enumerate(shapes(qtype) + [(8, 2048)]):  # N = 8: the CUDA rule is N % 8
        m = random_q(qtype, shape, seed=20 + i, how=how)
        check_mm(m, "cuda", seed=i)
        for t in (2, 4, 8):  # every layout that fits gives the same product
            if int4_supported(qtype, "cuda", shape, inner_k_tiles=t):
                x = torch.randn(3, shape[1], device="cuda", dtype=torch.bfloat16)
                torch.testing.assert_close(Int4Matrix.from_quant(m, "cuda", inner_k_tiles=t).mm(x),
                                           Int4Matrix.from_quant(m, "cuda").mm(x), rtol=0, atol=0)


@pytest.mark.cuda
@CUDA
def test_cuda_row_subsets_and_requantised_floats():
    """The CUDA layout of from_quant(rows=, n=) (N a multiple of 8) and of from_float gives the CPU
    twin's weights (up to CUDA's bf16 rounding of each weight)."""
    if not int4_supported("Q4_K", "cuda"):
        pytest.skip(int4_unsupported_reason("Q4_K", "cuda"))
    m = random_q("Q4_K", (64, 512), seed=7, how="floats")
    rows = np.array([5, 60, 1])
    assert int4_padded(3, "cuda") == 8 and int4_padded(3, "cuda", as_k=True) == 32
    cuda, cpu = (Int4Matrix.from_quant(m, d, rows=rows, n=n).dequantize(torch.float32).cpu()
                 for d, n in (("cuda", 8), ("cpu", 16)))
    assert cuda.shape == (8, 512) and not cuda[3:].any()
    torch.testing.assert_close(cuda, cpu[:8], rtol=2.0 ** -7, atol=0)
    f = torch.randn(16, 96)
    cuda, cpu = (Int4Matrix.from_float(f, d).dequantize(torch.float32).cpu() for d in ("cuda", "cpu"))
    torch.testing.assert_close(cuda, cpu, rtol=2.0 ** -7, atol=0)


@pytest.mark.cuda
@CUDA
def test_cuda_refusals_and_linear():
    if not int4_supported("Q4_0", "cuda"):
        pytest.skip(int4_unsupported_reason("Q4_0", "cuda"))
    assert int4_supported("Q4_0", "cuda", (24, 256)) and not int4_supported("Q4_0", "cuda", (12, 256))
    assert not int4_supported("Q4_0", "cuda", (16, 96), inner_k_tiles=8)
    m = random_q("Q4_K", (64, 512), seed=5, how="floats")
    bias = torch.randn(64)
    il = Int4Linear.from_quant(m, "cuda", bias=bias)
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ torch.from_numpy(deq(m)).cuda().T + bias.cuda().double()
    rel = float((il(x).double() - want).norm() / want.norm())
    assert il(x).dtype == torch.bfloat16 and rel < 0.01, rel


def test_dequantize_module_keeps_4bit_linears_int4_when_asked():
    """models.quantized.dequantize_module(int4=True): a Q4 QuantLinear becomes an Int4Linear computing
    the same product (CPU twin ops here; the engine asks for it on CUDA); other types and int4=False
    are expanded as before; quant_bytes counts the int4 bytes."""
    from hotcold.models.quantized import QuantLinear, dequantize_module, quant_bytes

    bias = torch.randn(32)
    x = torch.randn(3, 256)
    for qtype in ("Q4_0", "Q4_K"):
        ql = QuantLinear(quant.random_matrix(qtype, (32, 256), seed=4), bias.clone())
        m = dequantize_module(ql, "cpu", torch.bfloat16, int4=True)
        assert isinstance(m, Int4Linear)
        assert quant_bytes(nn.Sequential(m)) == m.qweight.nbytes
        want = ql(x)
        assert ((m(x.bfloat16()).float() - want).abs().max() / want.abs().max()) < 2e-2
        assert isinstance(dequantize_module(ql, "cpu", torch.bfloat16), nn.Linear)
    q8 = QuantLinear(quant.random_matrix("Q8_0", (32, 256), seed=4))
    assert isinstance(dequantize_module(q8, "cpu", torch.bfloat16, int4=True), nn.Linear)
