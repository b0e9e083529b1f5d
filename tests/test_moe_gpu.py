"""sparse_ops.moe_gpu: one token's routed fast-tier experts, found on the device.

The reference is a plain per-expert loop over the routed ids (the host-side path HybridMoE takes on
the CPU tier and for several tokens). The torch version runs everywhere; the Triton kernels run on
CUDA (`cuda` tests, run on the GPU machine). 4-bit stacks (Q4Stack) are checked against gguf's own
dequantisation of the same blocks (an independent decoder), then the kernels against the loop over
those weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.sparse_ops.gpu import activation
from hotcold.sparse_ops.moe_gpu import Q4Stack, routed_experts, routed_experts_torch, triton_available
from hotcold.sparse_ops.quant import PACK_DEFAULT, QuantMatrix, pack_rows, random_matrix

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def case(E=12, G=5, I=48, D=80, k=4, seed=0, device="cpu", dtype=torch.float32):
    """Random experts: G of E on the 'fast tier' (slot_of), a token routed to k experts, among
    them at least one with a slot and one without."""
    g = torch.Generator().manual_seed(seed)
    on = torch.randperm(E, generator=g)[:G]
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[on] = torch.arange(G, dtype=torch.int32)
    off = [e for e in range(E) if e not in on.tolist()]
    ids = torch.cat([on[:2], torch.tensor(off[: k - 2])])[torch.randperm(k, generator=g)]
    weights = torch.rand(k, generator=g)
    gate, up = (torch.randn(G, I, D, generator=g) / D**0.5 for _ in range(2))
    down = torch.randn(G, D, I, generator=g) / I**0.5
    x = torch.randn(D, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(x.to(dtype)), to(ids), to(weights), to(slot_of), to(gate.to(dtype)), to(up.to(dtype)),
            to(down.to(dtype)))


def loop_reference(x, ids, weights, slot_of, gate, up, down, act):
    f = activation(act)
    y = torch.zeros(x.shape[-1], dtype=torch.float64)
    for j, e in enumerate(ids.tolist()):
        s = int(slot_of[e])
        if s >= 0:
            xd = x.double().cpu()
            h = f(gate[s].double().cpu() @ xd) * (up[s].double().cpu() @ xd)
            y += float(weights[j]) * (down[s].double().cpu() @ h)
    return y


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu"])
def test_torch_version_matches_loop(act):
    args = case(seed=3)
    y = routed_experts(*args, act)  # the torch version off CUDA
    assert y.dtype == torch.float32 and y.shape == (80,)
    ref = loop_reference(*args, act)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-6)
    # the experts without a slot contribute nothing: zeroing their weights changes nothing
    x, ids, w, slot_of, *mats = args
    w2 = torch.where(slot_of[ids] >= 0, w, torch.zeros_like(w))
    assert torch.allclose(routed_experts(x, ids, w2, slot_of, *mats, act), y)


def test_no_routed_expert_on_the_fast_tier_gives_zeros():
    x, ids, w, slot_of, *mats = case(seed=4)
    slot_of = torch.full_like(slot_of, -1)
    assert torch.count_nonzero(routed_experts(x, ids, w, slot_of, *mats, "silu")) == 0


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="act must be one of"):
        routed_experts(*case(), "tanh")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", [dict(), dict(E=128, G=40, I=768, D=2048, k=8)])  # tiny; Qwen3-30B-A3B
def test_triton_kernels_match_the_reference(dtype, act, shape):
    assert triton_available("cuda"), "Triton is missing from this CUDA install"
    args = case(device="cuda", dtype=dtype, seed=5, **shape)
    y = routed_experts(*args, act)
    ref = loop_reference(*args, act).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (y.cpu() - ref).abs().max() <= tol * ref.abs().max()
    y_torch = routed_experts_torch(*args, act)
    assert (y.cpu() - y_torch.cpu()).abs().max() <= tol * ref.abs().max()


# ----------------------------------------------------------------------------- 4-bit stacks (Q4Stack)

Q4_TYPES = ["Q4_0", "Q4_1", "Q4_K"]


def gguf_dequantize(q: QuantMatrix) -> np.ndarray:
    """q's weights by gguf's own decoder (not ours). -> float32 [N, K]."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(q.data, GGMLQuantizationType[q.qtype]).reshape(q.shape).astype(np.float32)


def q4_case(qtype, E=12, G=5, I=256, D=512, k=4, seed=0, device="cpu", down_q4=True, gate_up_q4=True):
    """case()'s experts quantised to qtype: (x, ids, weights, slot_of, gate, up, down) with each stack
    a Q4Stack (or, where not asked, the float weights the blocks decode to), and the float weights."""
    x, ids, w, slot_of, *mats = case(E=E, G=G, I=I, D=D, k=k, seed=seed)
    blocks = [[QuantMatrix.quantize(m[g].numpy(), qtype) for g in range(G)] for m in mats]
    dense = [torch.from_numpy(np.stack([gguf_dequantize(b) for b in bs])) for bs in blocks]
    want = (gate_up_q4, gate_up_q4, down_q4)
    stacks = [Q4Stack.from_quant(bs, device) if q4 else d.to(device) for bs, d, q4 in zip(blocks, dense, want)]
    to = lambda t: t.to(device)  # noqa: E731
    return (to(x), to(ids), to(w), to(slot_of), *stacks), dense


@pytest.mark.parametrize("qtype", Q4_TYPES)
def test_q4_stack_holds_the_blocks_weights(qtype):
    """Each slot dequantises to gguf's decoding of its blocks: exactly for Q4_0 (fp16 scales, zero 0),
    within the fp16 rounding of (scale, zero) for Q4_1 / Q4_K; 5 bits a weight."""
    (_, _, _, _, gate, up, down), dense = q4_case(qtype, G=3)
    for st, d in zip((gate, up, down), dense):
        got = st.dequantize(torch.arange(3))
        assert got.shape == d.shape and st.shape == tuple(d.shape)
        err = (got - d).abs().max() / d.abs().max()
        assert err == 0 if qtype == "Q4_0" else err < 2e-3, err
        assert torch.equal(st.dequantize(1), got[1])
        assert st.nbytes == d.numel() * (0.5 + 4 / 32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("qtype", Q4_TYPES)
def test_q4_stack_splits_the_blocks_on_the_device_as_numpy_does(qtype, device):
    """from_quant moves the blocks as they are and splits them on the device: codes, scales and zeros
    bit for bit gpu_quant.decode_int4_halves' of each matrix alone (checked against gguf in
    test_gpu_quant), scale and zero rounded to fp16, for more matrices than one copy
    takes (STACK_CHUNK), a row-interleaved one among them where the type has that layout."""
    from hotcold.sparse_ops.gpu_quant import decode_int4_halves
    from hotcold.sparse_ops.moe_gpu import STACK_CHUNK

    n = STACK_CHUNK + 3
    big = random_matrix(qtype, (n * 16, 512), seed=2)
    mats = [QuantMatrix(big.data[g * 16:(g + 1) * 16], qtype, (16, 512)) for g in range(n)]
    if qtype in PACK_DEFAULT:
        mats[STACK_CHUNK] = pack_rows(mats[STACK_CHUNK], xq=True)
        assert mats[STACK_CHUNK].interleaved
    st = Q4Stack.from_quant(mats, device)
    for g, m in enumerate(mats):
        codes, scale, zero = (t.numpy() for t in decode_int4_halves(m))
        assert np.array_equal(st.codes[g].cpu().numpy(), codes)
        assert np.array_equal(st.scale[g].cpu().numpy(), scale.astype(np.float16))
        assert np.array_equal(st.zero[g].cpu().numpy(), zero.astype(np.float16))


def test_q4_stack_refuses_mixed_shapes_and_mixed_gate_up():
    a, b = (QuantMatrix.quantize(np.ones((4, k), np.float32), "Q4_0") for k in (64, 96))
    with pytest.raises(ValueError, match="differ in shape"):
        Q4Stack.from_quant([a, b], "cpu")
    (x, ids, w, slot_of, gate, up, down), _ = q4_case("Q4_0", I=64, D=64)
    with pytest.raises(ValueError, match="both be Q4Stack or both tensors"):
        routed_experts(x, ids, w, slot_of, gate, up.dequantize(torch.arange(5)), down, "silu")


@pytest.mark.parametrize("qtype", Q4_TYPES)
@pytest.mark.parametrize("gate_up_q4, down_q4", [(True, True), (True, False), (False, True)])
def test_torch_version_over_q4_stacks_matches_loop(qtype, gate_up_q4, down_q4):
    args, dense = q4_case(qtype, seed=7, gate_up_q4=gate_up_q4, down_q4=down_q4)
    y = routed_experts(*args, "silu")
    ref = loop_reference(*args[:4], *dense, "silu")
    assert torch.allclose(y.double(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("qtype", Q4_TYPES)
@pytest.mark.parametrize("gate_up_q4, down_q4", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("shape", [dict(I=256, D=512), dict(E=128, G=40, I=768, D=2048, k=8)])  # Qwen3-30B-A3B
def test_triton_q4_kernels_match_the_reference(qtype, gate_up_q4, down_q4, shape):
    """The 4-bit kernels (and the bf16 ones beside them, for the mixed stacks) against the loop over
    the weights the blocks decode to; every routed id without a slot is skipped."""
    assert triton_available("cuda"), "Triton is missing from this CUDA install"
    args, dense = q4_case(qtype, seed=9, device="cuda", gate_up_q4=gate_up_q4, down_q4=down_q4, **shape)
    y = routed_experts(*args, "silu").cpu()
    ref = loop_reference(*(a.cpu() for a in args[:4]), *dense, "silu").float()
    assert (y - ref).abs().max() <= 2e-3 * ref.abs().max()
    y_torch = routed_experts_torch(*args, "silu").cpu()
    assert (y - y_torch).abs().max() <= 1e-4 * ref.abs().max()
    x, ids, w, slot_of, *mats = args
    none = torch.full_like(slot_of, -1)
    assert torch.count_nonzero(routed_experts(x, ids, w, none, *mats, "silu")) == 0
