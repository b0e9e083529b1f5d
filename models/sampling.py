"""Sampling as small pure functions over a logits vector [V] (fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy. Defaults follow llama.cpp."""

    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    repetition_penalty: float = 1.0  # 1: off (llama.cpp's repeat_penalty, over the last `penalty_window` ids)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_window: int = 64

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_repetition_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive (multiply negative) logits of recently seen ids by `penalty` (CTRL style)."""
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    ids = torch.unique(recent)
    vals = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_presence_frequency(logits: torch.Tensor, seen: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI-style penalties: subtract presence once per seen id and frequency per occurrence."""
    if (presence == 0.0 and frequency == 0.0) or seen.numel() == 0:
        return logits
    counts = torch.bincount(seen, minlength=logits.shape[-1]).to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits; others -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def penalise(logits: torch.Tensor, history: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """All history-dependent penalties. history: [N] ids of prompt and generated tokens."""
    recent = history[-params.penalty_window :] if params.penalty_window > 0 else history
    logits = apply_repetition_penalty(logits, recent, params.repetition_penalty)
    return apply_presence_frequency(logits, history, params.presence_penalty, params.frequency_penalty)


def sample_id(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one id from (already penalised) logits [V], as a 0-d int64 tensor on logits' device: on a
    GPU nothing waits for it (the generator must be on that device). With top_k on, the filters after
    it work on the k candidates alone, as llama.cpp's sampler chain does (top_p sorting a 151,936-token
    vocabulary took 9 ms per token on a 2-core machine; the k candidates take microseconds)."""
    if params.greedy:
        return torch.argmax(logits)
    logits = logits / params.temperature
    ids = None
    if 0 < params.top_k < logits.shape[-1]:
        logits, ids = torch.topk(logits, params.top_k)  # [k] candidates and their ids
    logits = top_p_filter(logits, params.top_p)
    logits = min_p_filter(logits, params.min_p)
    probs = torch.softmax(logits, dim=-1)
    i = torch.multinomial(probs, 1, generator=generator)  # [1]
    return (i if ids is None else ids[i]).reshape(())


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """sample_id as a Python int."""
    return int(sample_id(logits, params, generator))
