"""executors/graphs.py: the attention half of one-token steps replayed as CUDA graphs.

The graphed engine must give the eager engine's logits (and the dense reference's) token by token,
across families with rotary scaling, sliding windows, QK-norm and sandwich norms, for a dense and a
MoE FFN; a new KV cache re-captures. CUDA only (run on the GPU machine); on the CPU the wrapper is
not installed, which one test checks, and the hybrid FFNs' split one-token step (graph_pre,
graph_send, graph_fast, graph_post: what the graphs replay, run eagerly) must equal their forward.
"""

from __future__ import annotations

import pytest
import torch

from hotcold.executors import make_hybrid
from hotcold.executors.engine import random_hot
from hotcold.executors.graphs import GraphedBlock, split_step, step_kinds
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.moe import HybridMoE, random_experts
from hotcold.executors.step import HostNodeStep, SplitStep
from hotcold.models.transformer import Block, KVCache
from test_executors import assert_close, folder, fresh, random_predictors, reference, tokens  # noqa: F401 (fixture)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def step_logits(lm, toks: torch.Tensor, cache_len: int) -> torch.Tensor:
    """Prefill the first 3 tokens, then one token at a time: logits [T, V]."""
    cache = KVCache(lm.config, cache_len, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
    out = []
    with torch.inference_mode():
        out.append(lm.model(toks[:, :3], 0, cache)[0])
        for i in range(3, toks.shape[1]):
            out.append(lm.model(toks[:, i : i + 1], i, cache)[0])
    return torch.cat(out)


def test_cpu_tier_is_not_wrapped(folder):
    lm = fresh(folder, "llama")
    with make_hybrid(lm, random_hot(lm, 0.5), None, threads=2):
        assert not any(isinstance(b, GraphedBlock) for b in lm.model.layers)


def test_step_kinds_and_modes_on_a_cpu_tier(folder):
    """step_kinds answers as the Protocols' isinstance checks do (decided once per class); blocks wrapped
    by hand on a CPU tier take no graph mode, and none defers (deferral needs CUDA host nodes)."""
    lm = fresh(folder, "qwen3_moe")
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.5),
                     defer_experts=True):
        blocks = [GraphedBlock(b if isinstance(b, Block) else b.block) for b in lm.model.layers]
        for b in blocks:
            assert step_kinds(b.ffn) == (isinstance(b.ffn, SplitStep), isinstance(b.ffn, HostNodeStep)) == (True, True)
        assert step_kinds(torch.nn.Linear(2, 2)) == (False, False)
        for a, b in zip(blocks, blocks[1:]):
            object.__setattr__(a, "next_block", b)
            object.__setattr__(b, "prev_block", a)
        assert [b.mode() for b in blocks] == [False] * len(blocks)
        assert not any(b.defers() for b in blocks)


@pytest.mark.parametrize("family,frac,learned", [("llama", 0.5, True), ("llama", 0.0, True), ("llama", 1.0, False),
                                                ("qwen3_moe", 0.5, False), ("qwen2_moe", 0.0, False),
                                                ("qwen2_moe", 1.0, False), ("mixtral", 0.25, False)])
def test_split_step_matches_forward(folder, family, frac, learned):
    lm = fresh(folder, family)
    preds = random_predictors(lm) if learned else None
    with make_hybrid(lm, random_hot(lm, frac), preds, cpu_dtype="f32", threads=2,
                     gpu_experts=random_experts(lm, frac)) as eng:
        gen = torch.Generator().manual_seed(3)
        split = 0
        for block in lm.model.layers:
            ffn = block.ffn
            if isinstance(ffn, (HybridFFN, HybridMoE)):  # both declare the whole protocol
                assert isinstance(ffn, HostNodeStep)
            if not isinstance(ffn, SplitStep):
                continue
            for _ in range(3):
                x = torch.randn(1, 1, lm.config.hidden_size, generator=gen)
                with torch.inference_mode():
                    want = ffn(x)
                    eng.reset_stats()
                    got = split_step(ffn, x)
                    split_stats = eng.stats()["decode"]
                    eng.reset_stats()
                    ffn(x)
                    eager_stats = eng.stats()["decode"]
                assert got.shape == want.shape
                assert_close(got, want, tol=1e-5)
                for k in ("rows_gpu", "rows_cpu", "experts_gpu", "experts_cpu", "layer_calls"):
                    assert split_stats[k] == eager_stats[k], k
            split += 1
        assert split == lm.config.num_layers


def test_split_step_with_the_expert_cache_matches_forward(folder):
    ref = reference(folder, "qwen3_moe")
    lm = fresh(folder, "qwen3_moe")
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.25),
                     expert_cache_bytes=1 << 20, prefetch_experts=4) as eng:
        gen = torch.Generator().manual_seed(4)
        layers = [l for l, b in enumerate(lm.model.layers) if hasattr(b.ffn, "cache")]
        moes = [lm.model.layers[l].ffn for l in layers]
        assert moes[0].cache is not None and moes[0].ahead is not None
        k, cached = lm.config.top_k, 0
        for step in range(6):
            for l, ffn in zip(layers, moes):
                x = torch.randn(1, 1, lm.config.hidden_size, generator=gen)
                ffn.residual = torch.randn(1, 1, lm.config.hidden_size, generator=gen)  # what the norm's hook holds
                with torch.inference_mode():
                    want = ref.model.layers[l].ffn(x)  # the dense MoE layer
                    eager = ffn(x)
                    eng.reset_stats()
                    got = split_step(ffn, x)
                    st = eng.stats()["decode"]
                assert_close(eager, want, tol=1e-5)
                assert_close(got, want, tol=1e-5)
                assert st["experts_gpu"] + st["experts_cpu"] == k and st["layer_calls"] == 1, (step, st)
                cached += st["experts_cached"]
        assert cached > 0  # the split step computed experts from the cache


def test_step_graph_asks_its_blocks_once_per_cache(folder):
    """StepGraph.ready (the whole-step graph's gate, run every one-token step): while a block is not
    captured for this cache it asks again; once every block is, it holds them only if each one's mode
    is one it may hold ("whole"; "host" too with host_nodes), and a refusal is kept for that cache
    (not one check a step); a new cache asks again; a block that cannot be graphed refuses at once."""
    from types import SimpleNamespace

    from hotcold.executors.graphs import StepGraph

    lm = fresh(folder, "llama")
    model = lm.model
    for i, b in enumerate(model.layers):
        model.layers[i] = GraphedBlock(b)
    cache = KVCache(lm.config, 8)
    tok = SimpleNamespace(shape=torch.Size([1, 1]), is_cuda=True)  # the gate reads no more of the tokens

    def capture(modes, c=cache):
        for i, (b, mode) in enumerate(zip(model.layers, modes)):
            k = c.layers[i][0]
            b.captured = None if mode is None else SimpleNamespace(key=(k.data_ptr(), tuple(k.shape), None, None, mode))

    n = lm.config.num_layers
    step, host = StepGraph(model), StepGraph(model, host_nodes=True)
    capture([None] * n)
    assert not step.ready(tok, cache) and step.refused is None
    capture(["whole"] * n)
    assert step.ready(tok, cache) and host.ready(tok, cache)
    capture(["whole"] * (n - 1) + ["host"])
    assert not step.ready(tok, cache) and step.refused is not None
    assert host.ready(tok, cache)
    capture(["whole"] * n)
    assert not step.ready(tok, cache)  # refused for this cache: not asked again
    other = KVCache(lm.config, 16)
    capture(["whole"] * n, other)
    assert step.ready(tok, other)
    capture([True] * n, other)  # split steps: the host runs between their graphs
    assert not host.ready(tok, other)
    assert not step.ready(SimpleNamespace(shape=torch.Size([1, 2]), is_cuda=True), other)
    model.layers[0].block.pre_norm = False  # (OPT-style blocks are never graphed)
    fresh_step = StepGraph(model)
    assert not fresh_step.ready(tok, KVCache(lm.config, 12)) and fresh_step.refused is not None


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma3", "qwen3_moe", "qwen2_moe", "opt"])
def test_graphed_steps_match_eager_and_reference(folder, family):
    toks = tokens(n=14, seed=21, device="cuda")
    ref = reference(folder, family, "cuda")
    want = step_logits(ref, toks, 20)
    got = {}
    for graphs in (False, True):
        lm = fresh(folder, family, "cuda")
        with make_hybrid(lm, random_hot(lm, 0.5), None, cpu_dtype="f32", threads=2, cuda_graphs=graphs,
                         gpu_experts=random_experts(lm, 0.5)):
            got[graphs] = step_logits(lm, toks, 20)
            if graphs:
                blocks = [b for b in lm.model.layers if isinstance(b, GraphedBlock)]
                assert len(blocks) == lm.config.num_layers
                assert [b.replays for b in blocks] == [toks.shape[1] - 3] * len(blocks)
                # a new, larger cache: captured again, same results
                again = step_logits(lm, toks, 31)
                assert_close(again, got[True], tol=1e-5)
                assert [b.replays for b in blocks] == [2 * (toks.shape[1] - 3)] * len(blocks)
    assert_close(got[True], got[False], tol=1e-5)
    assert_close(got[True], want, tol=2e-5)


@pytest.mark.cuda
@CUDA
def test_graphed_steps_with_the_expert_cache_match_reference(folder):
    toks = tokens(n=14, seed=22, device="cuda")
    want = step_logits(reference(folder, "qwen3_moe", "cuda"), toks, 20)
    lm = fresh(folder, "qwen3_moe", "cuda")
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.25),
                     expert_cache_bytes=1 << 20, prefetch_experts=4) as eng:
        got = step_logits(lm, toks, 20)
        st = eng.stats()["decode"]
        assert all(b.replays == toks.shape[1] - 3 for b in lm.model.layers)
    assert st["experts_cached"] > 0 and st["experts_prefetched"] > 0
    assert_close(got, want, tol=2e-5)


def test_split_step_prefetches_for_the_next_layer_without_host_experts(folder):
    """A MoE layer whose experts all sit on the fast tier still runs the cache's step after the
    replay (statistics off): its look-ahead prefetches the next layer's host experts."""
    lm = fresh(folder, "qwen3_moe")
    n = lm.config.num_experts
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts={0: list(range(n)), 1: []},
                     expert_cache_bytes=1 << 20, prefetch_experts=2, stats=False):
        first = lm.model.layers[0].ffn
        assert first.n_cold == 0 and first.ahead is not None
        first.residual = torch.randn(1, 1, lm.config.hidden_size)
        x = torch.randn(1, 1, lm.config.hidden_size)
        first.cache.take_copied()
        with torch.inference_mode():
            split_step(first, x)
        assert first.cache.take_copied() > 0


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_step_graph_of_a_dense_device_model(folder, family):
    """A model wholly on the GPU (a dense run): every block is captured whole, so from the second
    one-token step with a cache the whole step (blocks, final norm, head; gemma3's sandwich norms,
    tied head and soft-capping) replays as one graph (StepGraph), with the eager model's logits; a
    new cache captures again; ffn=False (attention graphs only) installs none."""
    from hotcold.executors.graphs import graph_blocks

    toks = tokens(n=12, seed=23, device="cuda")
    want = step_logits(reference(folder, family, "cuda"), toks, 20)
    lm = fresh(folder, family, "cuda")
    graph_blocks(lm.model)
    got = step_logits(lm, toks, 20)
    step = lm.model.one_token_step
    assert step.replays == toks.shape[1] - 4  # 3 prompt tokens, then the first one-token step block by block
    assert step.captured.head and all(b.replays == toks.shape[1] - 3 for b in lm.model.layers)
    assert_close(got, want, tol=2e-5)
    again = step_logits(lm, toks, 25)
    assert step.replays == 2 * (toks.shape[1] - 4)
    assert_close(again, want, tol=2e-5)
    lm = fresh(folder, family, "cuda")
    graph_blocks(lm.model, ffn=False)
    assert lm.model.one_token_step is None
    assert_close(step_logits(lm, toks, 20), want, tol=2e-5)
