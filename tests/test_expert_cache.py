"""hotcold.executors.expert_cache: the GPU expert cache and the look-ahead that fills it.

Decoding with the cache must give the dense reference's logits (a cached expert is computed on the
fast tier, the others on the CPU worker, never both or neither), whatever the cache size; the cache
itself evicts the least recently used expert, never one the current layer needs, and hands back the
host rows it copied. On the CPU the fast tier is the CPU device; the `cuda` test repeats it on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.executors import make_hybrid
from hotcold.executors.expert_cache import ExpertCache
from hotcold.executors.moe import random_experts
from hotcold.executors.tier import FastTier
from hotcold.executors.weights import host_experts
from test_moe_executor import CUDA, MOE, T, assert_close, decode_logits, folder, fresh, reference, tokens  # noqa: F401


def _moe_dims(lm) -> tuple[int, int, int, int]:
    c = lm.config
    n_moe = sum(c.ffn_kind(l) == "moe" for l in range(c.num_layers))
    return c.moe_intermediate_size, c.hidden_size, c.top_k, n_moe


def _cached_decode(folder, family: str, slots: int, device: str = "cpu", kind: str = "f32"):
    ref = reference(folder, family, device)
    toks = tokens(seed=21, device=device)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, family, device)
    I, D, k, n_moe = _moe_dims(lm)
    nbytes = slots * ExpertCache.slot_bytes(I, D, kind)
    with make_hybrid(lm, {}, None, cpu_dtype=kind, threads=2, gpu_experts=random_experts(lm, 0.25, seed=3),
                     expert_cache_bytes=nbytes, prefetch_experts=k) as eng:
        assert eng.memory()["expert_cache_bytes"] == nbytes
        got = decode_logits(lm, toks)
        st = eng.stats()["decode"]
    return got, want, st, T * k * n_moe


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("slots", [1, 3, 64])
def test_cached_decode_matches_reference(folder, family, slots):
    got, want, st, pairs = _cached_decode(folder, family, slots)
    assert_close(got, want)
    assert st["experts_gpu"] + st["experts_cpu"] == pairs  # every routed expert computed exactly once
    assert st["experts_prefetched"] > 0 and st["experts_cached"] > 0  # the look-ahead fed the cache and it was used
    assert st["experts_cached"] <= st["experts_gpu"]
    assert 0 < st["lookahead_recall"] <= 1 and 0 < st["cache_hit_rate"] <= 1


def test_bigger_cache_hits_more(folder):
    hits = [_cached_decode(folder, "qwen3_moe", slots)[2]["cache_hit_rate"] for slots in (1, 64)]
    assert hits[1] > hits[0]


@pytest.mark.parametrize("kind", ["bf16", "i8"])
def test_cache_lru_pinned_and_contents(kind):
    E, I, D = 5, 8, 16
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(E, I, D, generator=gen), torch.randn(E, I, D, generator=gen)
    down = torch.randn(E, D, I, generator=gen)
    cold = host_experts(gate, up, down, list(range(E)), "silu", kind)
    cache = ExpertCache(FastTier(torch.device("cpu"), torch.float32), 2, I, D, kind)
    rows = [np.arange(p * I, (p + 1) * I) for p in range(E)]
    assert cache.prefetch((0, 0), cold, rows[0]) and cache.prefetch((0, 1), cold, rows[1])
    assert not cache.prefetch((0, 1), cold, rows[1])  # already there
    assert cache.lookup((0, 0)) is not None  # expert 0 is now the most recently used
    assert cache.prefetch((0, 2), cold, rows[2])  # evicts expert 1, the least recently used
    assert cache.lookup((0, 1)) is None and cache.lookup((0, 0)) is not None
    cache.pinned = {(0, 0), (0, 2)}  # both needed by the layer being computed
    assert not cache.prefetch((0, 3), cold, rows[3]) and cache.lookup((0, 3)) is None
    cache.pinned = set()
    assert cache.prefetch((0, 3), cold, rows[3]) and cache.take_copied() == 4
    assert cache.lookup((0, 2)) is None  # expert 0 was used after expert 2: 2 went
    for p in (0, 3):
        got = cache.weights(cache.lookup((0, p)))
        for name, g in zip(("gate", "up", "down_t"), got):
            assert torch.equal(g, getattr(cold, name).to_torch()[rows[p]])
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertCache(FastTier(torch.device("cpu"), torch.float32), 0, I, D, kind)


def test_lfu_keeps_the_often_routed_expert():
    E, I, D = 4, 8, 16
    gen = torch.Generator().manual_seed(1)
    cold = host_experts(torch.randn(E, I, D, generator=gen), torch.randn(E, I, D, generator=gen),
                        torch.randn(E, D, I, generator=gen), list(range(E)), "silu", "f32")
    rows = [np.arange(p * I, (p + 1) * I) for p in range(E)]
    kept = {}
    for policy in ("lru", "lfu"):
        cache = ExpertCache(FastTier(torch.device("cpu"), torch.float32), 2, I, D, "f32", policy)
        for _ in range(5):
            cache.routed((0, 0))  # expert 0 is popular...
        cache.prefetch((0, 0), cold, rows[0])
        cache.prefetch((0, 1), cold, rows[1])  # ...but expert 1 was used more recently
        cache.routed((0, 1))
        cache.prefetch((0, 2), cold, rows[2])
        kept[policy] = {e for e in range(E) if cache.lookup((0, e)) is not None}
    assert kept == {"lru": {1, 2}, "lfu": {0, 2}}
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(FastTier(torch.device("cpu"), torch.float32), 2, I, D, "f32", "fifo")


def test_cache_too_small_for_one_expert(folder):
    lm = fresh(folder, "mixtral")
    with pytest.raises(ValueError, match="holds no expert"):
        make_hybrid(lm, {}, None, cpu_dtype="f32", threads=1, expert_cache_bytes=100)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_cuda_cached_decode_matches_reference(folder, family):
    got, want, st, pairs = _cached_decode(folder, family, 3, device="cuda")
    assert_close(got, want, 1e-4)
    assert st["experts_gpu"] + st["experts_cpu"] == pairs and st["experts_cached"] > 0
