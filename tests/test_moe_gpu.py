"""sparse_ops.moe_gpu: one token's routed fast-tier experts, found on the device.

The reference is a plain per-expert loop over the routed ids (the host-side path HybridMoE takes on
the CPU tier and for several tokens). The torch version runs everywhere; the Triton kernels run on
CUDA (`cuda` tests, run on the GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from hotcold.sparse_ops.gpu import activation
from hotcold.sparse_ops.moe_gpu import routed_experts, routed_experts_torch, triton_available

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
