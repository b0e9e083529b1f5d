"""Expert deferral (EngineOptions.defer_experts, executors/graphs.py): a MoE layer whose next layer also
steps as one graph with a host node leaves its CPU experts to that layer's graph, and their sum joins
the residual one layer late.

The engine's decode logits must equal an independent reference: the quantised dense model stepped
block by block in PyTorch, where each deferring layer adds its GPU-placed experts (and shared expert)
at once and its host-placed experts after the next layer, computed by MoEFFN.mix. They must also be
measurably further from the exact model's logits than from that reference (deferral really ran).
CUDA only for the engine; on the CPU, the option says that it does not apply.
"""

from __future__ import annotations

import pytest
import torch

from hotcold.executors import make_hybrid
from hotcold.executors.moe import random_experts
from hotcold.models.layers import MoEFFN, route
from hotcold.models.transformer import KVCache
from test_executors import T, decode_logits, tokens
from test_executors_quant import ROUTING_TIE, TOL, folder, fresh, reference, rel_err  # noqa: F401 (fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def deferred_logits(ref, toks: torch.Tensor, placed: dict[int, list[int]]) -> tuple[torch.Tensor, set[int]]:
    """ref's logits [1, T, V] decoding toks one at a time with expert deferral: a MoE layer with host
    experts (those not in placed[layer]) followed by another such layer adds its host experts' sum
    after that next layer. Also the steps where some router had a near tie (k-th and (k+1)-th
    probabilities closer than ROUTING_TIE: the engine's rounding may pick the other expert there)."""
    m, n = ref.model, ref.config.num_experts
    host = {l: set(range(n)) - set(placed.get(l, range(n))) for l in range(len(m.layers))}
    hosted = [isinstance(b.ffn, MoEFFN) and bool(host[l]) for l, b in enumerate(m.layers)]
    defer = [hosted[l] and l + 1 < len(hosted) and hosted[l + 1] for l in range(len(hosted))]
    cache = KVCache(ref.config, toks.shape[1] + 1, device=ref.device, dtype=ref.dtype)
    out, ties = [], set()
    with torch.inference_mode():
        for i in range(toks.shape[1]):
            pos = torch.tensor([i])
            x, carry = m.embed_tokens(toks[:, i:i + 1], pos), None
            for l, b in enumerate(m.layers):
                res = x + b.attn(b.attn_norm(x), pos, cache.layers[l], i)
                f = b.ffn_norm(res).reshape(1, -1)
                late = None
                if isinstance(b.ffn, MoEFFN):
                    ffn = b.ffn
                    logits = ffn.router(f)
                    p = torch.softmax(logits.float(), -1)[0].sort(descending=True).values
                    if p[ffn.top_k - 1] - p[ffn.top_k] < ROUTING_TIE:
                        ties.add(i)
                    w, ids = route(logits, ffn.top_k, ffn.renormalise)

                    def part(keep):
                        return lambda e, xe: ffn.experts.expert(e, xe) * float(e in keep)

                    now = ffn.add_shared(f, MoEFFN.mix(f, w, ids, part(set(range(n)) - host[l] if defer[l] else range(n))))
                    if defer[l]:
                        late = MoEFFN.mix(f, w, ids, part(host[l]))
                else:
                    now = b.ffn(f)
                x = res + now.reshape(res.shape) + (0 if carry is None else carry.reshape(res.shape))
                carry = late
            out.append(m.head(x))
    return torch.cat(out, dim=1), ties


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("last_on_gpu", [False, True])
def test_deferred_experts_match_the_deferred_reference(folder, last_on_gpu):
    """qwen3_moe (3 MoE layers), Q4_0, one expert in four on the GPU: layers 0 and 1 defer and the last
    is exact; with every expert of the last layer on the GPU, only layer 0 defers and layer 1 (its
    step still a host node) carries it and runs its own experts at once."""
    from hotcold.executors.graphs import GraphedBlock

    ref = reference(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=23)
    lm = fresh(folder, "qwen3_moe", "q4_0")
    placed = random_experts(lm, 0.25, seed=5)
    if last_on_gpu:
        placed[max(placed)] = list(range(lm.config.num_experts))
    want, ties = deferred_logits(ref, toks, placed)
    exact = decode_logits(ref, toks)
    with make_hybrid(lm, {}, None, device="cuda", threads=2, gpu_int4=True, stats=False, gpu_experts=placed,
                     defer_experts=True) as eng:
        got = decode_logits(lm, toks.cuda()).cpu()
        blocks = lm.model.layers
        assert all(isinstance(b, GraphedBlock) and b.replays == T for b in blocks)
        defers = [b.defers() for b in blocks]
        assert defers == ([True, False, False] if last_on_gpu else [True, True, False])
        modes = [b.captured.key[-1] for b in blocks]
        assert modes == (["defer", "defer", "whole"] if last_on_gpu else ["defer", "defer", "defer"]), modes
        # every layer's host node ran once a step, deferred or not
        assert [m._node.calls if m.n_cold else T for m in eng.moe.values()] == [T] * 3
    assert len(ties) <= 2, ties
    errs = [rel_err(got[:, i], want[:, i]) for i in range(T)]
    assert all(e < 2 * TOL["q4_0"] for i, e in enumerate(errs) if i not in ties), (errs, ties)
    # deferral changed the function: the engine is much nearer the deferred reference than the exact model
    off = max(rel_err(got[:, i], exact[:, i]) for i in range(1, T) if i not in ties)
    assert off > 2 * max(e for i, e in enumerate(errs) if i not in ties), (off, errs)


def test_defer_experts_says_where_it_does_not_apply(folder):
    """On the CPU (no CUDA graphs, so no host nodes) no layer defers: the engine is exact, and a run
    that asked for deferral is told so."""
    from hotcold.executors.from_plan import open_for_run
    from test_executors_quant import model_path

    lm = fresh(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=23)
    with make_hybrid(lm, {}, None, threads=2, stats=False, gpu_experts=random_experts(lm, 0.25, seed=5),
                     defer_experts=True) as eng:
        assert not any(m.defer_host() for m in eng.moe.values())
        got = decode_logits(lm, toks)
    assert rel_err(got, decode_logits(reference(folder, "qwen3_moe", "q4_0"), toks)) < 2 * TOL["q4_0"]
    setup = open_for_run(model_path(folder, "qwen3_moe", "q4_0"), use_plan=False, device="cpu", quantize="q4_0",
                         defer_experts=True)
    try:
        assert any(n.startswith("--defer-experts: no layer defers") for n in setup.notes), setup.notes
    finally:
        setup.close()


def test_the_deferred_reference_is_the_model_where_nothing_defers(folder):
    """The reference's own check: with every expert placed on the GPU (nothing to defer) it is the
    quantised model's decode; with host experts in consecutive layers it is not."""
    ref = reference(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=23)
    n = ref.config.num_experts
    exact = decode_logits(ref, toks)
    same, _ = deferred_logits(ref, toks, {l: list(range(n)) for l in range(ref.config.num_layers)})
    assert rel_err(same, exact) < 1e-5
    moved, _ = deferred_logits(ref, toks, random_experts(ref, 0.25, seed=5))
    assert rel_err(moved, exact) > 0.05
