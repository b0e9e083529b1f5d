"""Sampling functions against direct computations, and the stop-string splitter."""

from __future__ import annotations

import torch

from hotcold.models.generate import split_stop
from hotcold.models.sampling import (
    SamplingParams,
    apply_presence_frequency,
    apply_repetition_penalty,
    min_p_filter,
    sample,
    top_k_filter,
    top_p_filter,
)


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    out = top_k_filter(logits, 2)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 3]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.5) == [0]
    assert kept(0.6) == [0, 1]
    assert kept(0.8) == [0, 1]
    assert kept(0.81) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(0.0) == [0]  # never empty


def test_top_p_with_unsorted_logits():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert torch.isfinite(top_p_filter(logits, 0.7)).nonzero().flatten().tolist() == [1, 3]


def test_min_p_relative_to_top():
    logits = torch.tensor([0.6, 0.3, 0.08, 0.02]).log()
    assert torch.isfinite(min_p_filter(logits, 0.1)).nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.isfinite(min_p_filter(logits, 0.6)).nonzero().flatten().tolist() == [0]


def test_repetition_penalty_direction():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency():
    logits = torch.zeros(4)
    out = apply_presence_frequency(logits, torch.tensor([1, 1, 3]), presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, -1.0, 0.0, -0.75]


def test_greedy_and_seeded_sampling():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(temperature=0)) == int(logits.argmax())
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = [sample(logits, p, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(a)) == 1


def test_sampling_follows_distribution():
    """With filters off, empirical frequencies match softmax(logits / T)."""
    logits = torch.tensor([1.0, 0.0, -1.0])
    p = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, p, g) for _ in range(4000)]), minlength=3).float()
    expected = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_top_k_restricts_samples():
    logits = torch.tensor([3.0, 2.9, 2.8, 2.7, -5.0])
    p = SamplingParams(temperature=5.0, top_k=2, top_p=1.0, min_p=0.0)
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, p, g) for _ in range(200)} == {0, 1}


def test_split_stop():
    assert split_stop("hello world", ["wor"]) == ("hello ", True, "")
    assert split_stop("hello wo", ["world"]) == ("hello ", False, "wo")
    assert split_stop("hello", ["xyz"]) == ("hello", False, "")
    assert split_stop("a</s", ["</s>", "s>"]) == ("a", False, "</s")
    assert split_stop("ab", []) == ("ab", False, "")


def test_top_k_candidates_match_full_vocabulary_filters():
    """The candidate path (top_k first, then top_p / min_p on the k candidates) gives the same
    distribution as the filters applied in turn to the whole vocabulary."""
    V = 2000
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 3
    p = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02)
    ref = logits / p.temperature
    for f, arg in ((top_k_filter, p.top_k), (top_p_filter, p.top_p), (min_p_filter, p.min_p)):
        ref = f(ref, arg)
    want = torch.softmax(ref, dim=-1)
    n = 6000
    g = torch.Generator().manual_seed(2)
    got = torch.bincount(torch.tensor([sample(logits, p, g) for _ in range(n)]), minlength=V).float() / n
    assert set(torch.nonzero(got).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert torch.allclose(got, want, atol=0.02)
