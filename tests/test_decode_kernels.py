"""The CPU decode kernels against torch: sparse_ops.attention.decode_attention (rotary, the cache
write, GQA, a sliding window, scaled_dot_product_attention over the written positions) and
sparse_ops.norm.rms_norm (RMSNorm, Gemma's 1 + w)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hotcold.models.layers import RMSNorm, Rotary, apply_rope, attention_mask
from hotcold.sparse_ops.attention import decode_attention
from hotcold.sparse_ops.norm import rms_norm


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv,Dh,pos,window,rotary", [(4, 4, 16, 0, None, True), (8, 2, 32, 9, None, True),
                                                         (6, 3, 8, 20, 5, True), (4, 1, 64, 30, None, False),
                                                         (2, 2, 16, 31, 32, True)])
def test_decode_attention_matches_torch(H, Hkv, Dh, pos, window, rotary, cache_dtype):
    """Against torch over the same cache contents (a float16 cache: its values and the new key and
    value rounded to float16, as the kernel stores them)."""
    gen = torch.Generator().manual_seed(pos)
    S = 32
    kc, vc = (torch.randn(1, Hkv, S, Dh, generator=gen).to(cache_dtype) for _ in range(2))
    q, k, v = (torch.randn(1, 1, n, Dh, generator=gen) for n in (H, Hkv, Hkv))  # [B, T, heads, Dh]
    positions = torch.tensor([pos])
    scale = 0.3
    rot = Rotary(Dh, 10000.0, None)
    cos, sin = rot(positions)
    want_kc, want_vc = kc.float(), vc.float()
    qr, kr = (apply_rope(t, cos, sin) if rotary else t for t in (q, k))
    want_kc[:, :, pos] = kr[0, 0].to(cache_dtype).float()
    want_vc[:, :, pos] = v[0, 0].to(cache_dtype).float()
    want = F.scaled_dot_product_attention(qr.transpose(1, 2), want_kc[:, :, : pos + 1], want_vc[:, :, : pos + 1],
                                          attn_mask=attention_mask(positions, pos + 1, window), scale=scale,
                                          enable_gqa=H != Hkv)[0, :, 0]  # [H, Dh]
    got_kc, got_vc = kc[0].numpy().copy(), vc[0].numpy().copy()
    got = decode_attention(q[0, 0].numpy(), k[0, 0].numpy(), v[0, 0].numpy(), got_kc, got_vc, pos, scale,
                           cos[0].numpy() if rotary else None, sin[0].numpy() if rotary else None, window)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5)
    assert got_kc.dtype == kc.numpy().dtype
    np.testing.assert_allclose(got_kc.astype(np.float32), want_kc[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(got_vc.astype(np.float32), want_vc[0].numpy(), atol=0)


def test_decode_attention_rejects_mismatched_shapes():
    z = np.zeros
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(z((3, 8), np.float32), z((2, 8), np.float32), z((2, 8), np.float32),
                         z((2, 4, 8), np.float32), z((2, 4, 8), np.float32), 0, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(z((2, 8), np.float32), z((2, 8), np.float32), z((2, 8), np.float32),
                         z((2, 4, 8), np.float32), z((2, 4, 8), np.float32), 4, 1.0)
    with pytest.raises(ValueError, match="float32 or float16"):
        decode_attention(z((2, 8), np.float32), z((2, 8), np.float32), z((2, 8), np.float32),
                         z((2, 4, 8), np.float32), z((2, 4, 8), np.float16), 0, 1.0)


@pytest.mark.parametrize("plus_one", [False, True])
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_matches_torch(plus_one, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen) * 3, torch.randn(96, generator=gen)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w if plus_one else w)
    np.testing.assert_allclose(rms_norm(x.numpy(), w.numpy(), 1e-6, plus_one), want.numpy(), rtol=1e-5, atol=1e-6)
    norm = RMSNorm(96, 1e-6, plus_one)
    norm.weight.data = w
    with torch.inference_mode():  # a decode step's rows (the kernel) and the module's forward (one row: the kernel)
        np.testing.assert_allclose(norm.rows(x).numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(norm(x).numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    for dtype, ulp in ((torch.float16, 2 ** -10), (torch.bfloat16, 2 ** -7)):  # a half model: the kernel in float32
        half = RMSNorm(96, 1e-6, plus_one).to(dtype)
        half.weight.data = w.to(dtype)
        with torch.inference_mode():
            xh = x.to(dtype)
            wh = half.weight.float()
            exact = xh.float() * torch.rsqrt(xh.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + wh if plus_one else wh)
            got = half.rows(xh)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.float().numpy(), exact.numpy(), rtol=ulp, atol=ulp)  # rounded once
            # torch's path rounds twice (x normed, then times w): within two units
            np.testing.assert_allclose(half._torch(xh).float().numpy(), exact.numpy(), rtol=2 * ulp, atol=2 * ulp)



ULP = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # a unit in the last place, relative


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plus_one", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 1, 16, 128), (3, 37, 96), (0, 64)])
def test_rms_norm_cuda_matches_torch(dtype, plus_one, shape):
    """The Triton RMSNorm (sparse_ops/fused_gpu.py, what RMSNorm runs on CUDA) against RMSNorm's torch
    ops: float32 within rounding, 16-bit dtypes within a unit of their last place (the sum's order
    differs); a row alone gives the bits it gives among others."""
    from hotcold.sparse_ops.fused_gpu import fused_ready, rms_norm_cuda

    gen = torch.Generator().manual_seed(len(shape))
    D = shape[-1]
    x = (torch.randn(shape, generator=gen) * 3).to("cuda", dtype)
    norm = RMSNorm(D, 1e-6, plus_one)
    norm.weight.data = torch.randn(D, generator=gen) * 0.5
    norm = norm.to("cuda", dtype)
    with torch.inference_mode():
        assert fused_ready(x)
        got, want = norm(x), norm._torch(x)
        one_row = rms_norm_cuda(x.reshape(-1, D)[:1], norm.weight, 1e-6, plus_one)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=2 * ULP[dtype])
    if x.numel():
        assert torch.equal(one_row[0], got.reshape(-1, D)[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,H,Dh,scaling", [(1, 1, 16, 128, None), (2, 9, 4, 64, None),
                                              (1, 5, 2, 32, {"rope_type": "linear", "factor": 4.0})])
def test_rope_cuda_matches_torch(dtype, B, T, H, Dh, scaling):
    """The Triton rotary embedding against apply_rope with Rotary's tables, at positions far into a
    context (large angles) as well as near its start."""
    from hotcold.sparse_ops.fused_gpu import rope_cuda

    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, H, Dh, generator=gen).to("cuda", dtype)
    rot = Rotary(Dh, 10000.0, scaling).to("cuda")
    for start in (0, 3000):
        pos = torch.arange(start, start + T, device="cuda")
        with torch.inference_mode():
            got = rope_cuda(x, pos, rot.inv_freq)
            want = apply_rope(x, *rot(pos))
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * ULP[dtype], atol=1e-4 + 4 * ULP[dtype])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("E,k,renormalise", [(128, 8, True), (60, 4, False), (8, 2, True), (6, 3, True),
                                             (3, 3, True), (64, 6, False), (1024, 1, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_pack_cuda_matches_route(E, k, renormalise, dtype):
    """One kernel's routing equals models.layers.route (same experts in the same order, weights
    within float32 rounding) and packs x's float32 bits, the weights' bits and the ids as the
    torch path does; a non-power-of-two k, a D that is not a multiple of the block, extra entries."""
    from hotcold.models.layers import route
    from hotcold.sparse_ops.fused_gpu import route_pack_cuda

    gen = torch.Generator().manual_seed(E + k)
    D = 1500
    x = torch.randn(1, D, generator=gen).to("cuda", dtype)
    logits = (torch.randn(1, E, generator=gen) * 2).to("cuda", dtype)
    with torch.inference_mode():
        packed, w, ids = route_pack_cuda(logits, x, k, renormalise, extra=3)
        want_w, want_ids = route(logits, k, renormalise)
    assert packed.shape == (D + 2 * k + 3,) and packed.dtype == torch.int32
    assert w.shape == (1, k) and w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.is_contiguous() and ids.is_contiguous()
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
    if len(torch.unique(logits)) == E:
        assert torch.equal(ids, want_ids)
    else:  # equal bfloat16 logits: either of two equal experts is a right answer
        assert len(torch.unique(ids)) == k
        probs = torch.softmax(logits.float(), -1)[0, ids[0]]
        torch.testing.assert_close(probs / probs.sum() if renormalise else probs, w[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(packed[:D].view(torch.float32), x[0].float())
    assert torch.equal(packed[D:D + k].view(torch.float32), w[0])
    assert torch.equal(packed[D + k:D + 2 * k], ids[0].to(torch.int32))
    with pytest.raises(ValueError, match="top_k"):
        route_pack_cuda(logits, x, E + 1, renormalise)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_project_half_one_token_matches_float32(dtype, bias):
    """One token through a half-precision nn.Linear on the CPU takes numba's GEMV (half_gemv): equal to
    the float32 product of the same (rounded) weights within float32 summation error, rounded once to
    the half dtype; several tokens and a linear with a hook take torch's path."""
    from hotcold.models.layers import _HOST, half_gemv_ready, project

    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(1, 1, 96, generator=gen).to(dtype)
    want = (x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)).to(dtype)  # [1, 1, 40]
    with torch.inference_mode():
        assert half_gemv_ready(lin.weight, x)
        got = project(lin, x)
        assert id(lin.weight) in _HOST  # the kernel ran, over the weight's own memory
        assert _HOST[id(lin.weight)][2].data.ctypes.data == lin.weight.data_ptr()
        assert got.shape == (1, 1, 40) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        with torch.no_grad():
            lin.weight.mul_(2)  # in place: the cached matrix sees it
        torch.testing.assert_close(project(lin, x).float(), (2 * want.float() - (lin.bias.float() if bias else 0)),
                                   rtol=2e-2, atol=5e-2)
        X = torch.randn(1, 3, 96, generator=gen).to(dtype)  # several tokens: torch (float32 for float16)
        assert not half_gemv_ready(lin.weight, X)
        torch.testing.assert_close(project(lin, X).float(), (X.float() @ lin.weight.float().T +
                                   (lin.bias.float() if bias else 0)), rtol=2e-2, atol=5e-2)
        seen = []
        lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        project(lin, x)
        assert seen == [(1, 1, 40)]  # a hooked linear is called, so its hooks fire
    assert not half_gemv_ready(lin.weight, x)  # autograd on: torch records the product



@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_half_qkv_decodes_as_before_with_one_copy(tmp_path, family, dtype):
    """fuse_qkv on a half-precision CPU model: each attention's q, k and v become views of one [q; k; v]
    matrix (`attn.qkv`, one copy in RAM), and one-token decoding through it (one GEMV) gives the
    logits of the unfused model; both within half rounding of the float32 model."""
    import copy

    from hotcold.models.transformer import KVCache
    from hotcold.models.loader import load_model
    from hotcold.models.quantized import fuse_qkv
    from tiny_models import make_tiny

    folder = make_tiny(family, tmp_path)
    ref = load_model(folder, device="cpu", dtype="float32")
    lm = load_model(folder, device="cpu", dtype=dtype)
    fused = copy.deepcopy(lm)
    fuse_qkv(fused.model)
    toks = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(5))

    def decode(m):
        cache = KVCache(m.config, 13, device=m.device, dtype=m.dtype)
        with torch.inference_mode():
            return torch.cat([m.model(toks[:, i:i + 1], i, cache) for i in range(12)], dim=1).float()

    for block in fused.model.layers:
        a = block.attn
        assert isinstance(a.qkv, torch.Tensor) and a.qkv.shape[0] == a.q.weight.shape[0] + 2 * a.k.weight.shape[0]
        assert a.q.weight.data_ptr() == a.qkv.data_ptr()  # views: one copy
        assert a.v.weight.data_ptr() + a.v.weight.numel() * a.v.weight.element_size() == \
            a.qkv.data_ptr() + a.qkv.numel() * a.qkv.element_size()
        assert (a.qkv_bias is not None) == (family == "qwen2")
    want, plain, got = decode(ref), decode(lm), decode(fused)
    scale = want.abs().max()
    tol = {"float16": 2e-2, "bfloat16": 1e-1}[dtype]
    assert (got - plain).abs().max() <= tol / 4 * scale  # the same products, summed in another order
    assert (got - want).abs().max() <= tol * scale
