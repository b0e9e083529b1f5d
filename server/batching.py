"""Continuous batching on the CPU: the running sequences, their KV slots and the prefix cache.

`Sequence` is one request's decoding state (sampling, penalties, grammar, stop strings, incremental
detokenising): what `Generator.generate` does for one sequence, taking its logits from outside, so
that the engine can decode every running sequence in one `decode_rows` step and feed each its row.
`Slots` owns the KV buffer (models/batch_step.SlotCache) and the prefix cache over it: every slot
remembers the tokens whose keys and values it holds, also after its request finished; a new request
takes the idle slot sharing the longest prefix with its prompt (a chat's next turn finds its
history) and prefills only the rest; a prefix held by a busy slot (another client's same system
prompt) is copied into a free one; otherwise the least recently used idle slot is overwritten.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hotcold.models.generate import PREFILL_CHUNK, GenerationStats, TokenEvent, _masked, split_stop
from hotcold.models.sampling import penalise, sample_id
from hotcold.models.batch_step import SlotCache


TAIL_KEPT = 16  # a slot whose tokens diverge from a new prompt by more than this is copied into an empty slot
# if there is one, rather than continued in place: it is another conversation sharing a prefix


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheStats:
    hits: int = 0  # requests that reused a cached prefix (in place or copied)
    misses: int = 0
    evictions: int = 0  # a slot holding another conversation's tokens overwritten
    reused_tokens: int = 0


class Slots:
    """`n` KV slots of `max_len` tokens and what each holds; `parallel` of them may run at once."""

    def __init__(self, config, n: int, max_len: int, dtype):
        self.cache = SlotCache(config, n, max_len, dtype)
        self.ids: list[list[int]] = [[] for _ in range(n)]  # tokens whose KV slot s holds
        self.busy = [False] * n
        self.used = [0] * n  # last use, for LRU
        self.prompt_logits: list = [None] * n  # (prompt, its next-token logits) of the slot's last prefill
        self.stats = CacheStats()
        self._clock = 0

    def acquire(self, prompt: list[int]) -> tuple[int, int, torch.Tensor | None]:
        """(slot, tokens of the prompt already in it, the prompt's logits if it is exactly the slot's
        last prompt): the prompt's last token is always computed unless its logits are kept, as
        Generator does (a one-token recomputation can round differently from the prefill)."""
        free = [s for s in range(len(self.ids)) if not self.busy[s]]
        match = {s: common_prefix(self.ids[s], prompt[:-1]) for s in range(len(self.ids))}
        best = max(range(len(self.ids)), key=lambda s: (match[s], not self.busy[s]))
        n, logits = match[best], None
        tail = len(self.ids[best]) - n  # tokens of the slot's own that the request would overwrite
        empty = [s for s in free if not self.ids[s]]
        kept = self.prompt_logits[best]
        if n and not self.busy[best] and kept is not None and kept[0] == prompt \
                and self.ids[best][:len(prompt)] == prompt:  # the same prompt again
            slot, n, logits = best, len(prompt), kept[1].clone()
        elif n and not self.busy[best] and not (tail > TAIL_KEPT and empty):  # its history continues (a chat's next turn)
            slot = best
        else:
            slot = (empty or sorted(free, key=lambda s: self.used[s]))[0]  # an empty slot, else the LRU
            if self.ids[slot]:
                self.stats.evictions += 1
            if n:  # another slot's prefix: copy its keys and values
                self.cache.copy_prefix(best, slot, n)
        self.stats.hits += n > 0
        self.stats.misses += n == 0
        self.stats.reused_tokens += n
        self.ids[slot] = list(prompt[:n])
        if logits is None:
            self.prompt_logits[slot] = None
        self.busy[slot] = True
        self._touch(slot)
        return slot, n, logits

    def release(self, slot: int) -> None:
        self.busy[slot] = False
        self._touch(slot)

    def drop(self, slot: int) -> None:
        """Forget what slot holds (a request that failed part-way)."""
        self.ids[slot], self.prompt_logits[slot] = [], None
        self.release(slot)

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self.used[slot] = self._clock


class Sequence:
    """One running request: prefill (in chunks) into its slot, then one token per engine step."""

    def __init__(self, job, lm, slots: Slots, max_context: int):
        self.job, self.lm, self.slots = job, lm, slots
        prompt = job.prompt_ids
        self.budget = min(job.max_tokens, max_context - len(prompt), slots.cache.max_len - len(prompt))
        tok = lm.tokenizer
        self.eos = set() if job.ignore_eos else (set(tok.eos_ids) if tok else set(lm.config.eos_token_ids))
        self.detok = tok.detokenizer() if tok else None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.slot, reused, self.logits = slots.acquire(prompt)
        self.stats.cached_prompt_tokens = reused
        self.filled = reused  # prompt tokens whose KV is in the slot
        self.gen = torch.Generator().manual_seed(job.seed if job.seed is not None else torch.seed())
        self.history = torch.tensor(prompt, dtype=torch.long)
        self.pending = ""
        self.token: int | None = None  # the last sampled token, fed to the next step
        self.done = False

    @property
    def prefilling(self) -> bool:
        return self.logits is None and self.token is None

    @property
    def position(self) -> int:
        return len(self.slots.ids[self.slot])

    @torch.inference_mode()
    def prefill_chunk(self) -> None:
        """Prefill the next PREFILL_CHUNK prompt tokens (Generator's chunks: the same numbers)."""
        prompt = self.job.prompt_ids
        chunk = prompt[self.filled:self.filled + PREFILL_CHUNK]
        view = self.slots.cache.view(self.slot)
        out = self.lm.model(torch.tensor([chunk]), self.filled, view, last_only=True)
        self.filled += len(chunk)
        self.slots.ids[self.slot].extend(chunk)
        if self.filled == len(prompt):
            self.logits = out[0, -1]
            self.slots.prompt_logits[self.slot] = (list(prompt), self.logits.clone())

    def sample(self) -> TokenEvent:
        """Sample from the pending logits (Generator.generate's loop body): the event to send; sets
        `done` at the end, else `token` for the next step."""
        job, stats, detok = self.job, self.stats, self.detok
        logits, self.logits = self.logits, None
        token = int(sample_id(_masked(penalise(logits, self.history, job.sampling), job.constraint), job.sampling,
                              self.gen))
        if job.constraint is not None:
            job.constraint.accept(token)
        if self.t_first is None:
            self.t_first = time.perf_counter()
            stats.ttft_s = self.t_first - self.t0
        stats.completion_tokens += 1
        stats.token_ids.append(token)
        event = TokenEvent(token, "")
        if job.logprobs is not None:
            lp = torch.log_softmax(logits, dim=-1)
            event.logprob = float(lp[token])
            if job.logprobs > 0:
                top = torch.topk(lp, job.logprobs)
                event.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        if token in self.eos:
            event.text, event.finish_reason = self.pending + (detok.flush() if detok else ""), "stop"
        elif job.constraint is not None and job.constraint.done:
            event.text, event.finish_reason = self.pending + (detok.add(token) + detok.flush() if detok else ""), "stop"
        else:
            self.pending += detok.add(token) if detok else ""
            event.text, stopped, self.pending = split_stop(self.pending, job.stop)
            if stopped:
                event.finish_reason = "stop"
            elif stats.completion_tokens >= self.budget:
                event.text += self.pending + (detok.flush() if detok else "")
                event.finish_reason = "length"
        if event.finish_reason:
            stats.finish_reason = event.finish_reason
            stats.decode_s = time.perf_counter() - self.t_first
            self.done = True
        else:
            self.history = torch.cat([self.history, torch.tensor([token])])
            self.token = token
        return event

    def stepped(self, logits: torch.Tensor) -> None:
        """The step that fed `token` ran: its KV is in the slot, its logits are next."""
        self.slots.ids[self.slot].append(self.token)
        self.token, self.logits = None, logits

    def finish(self) -> GenerationStats:
        """Free the slot (its tokens stay cached for a later request); a cancelled one's stats as far as it got."""
        if self.t_first is not None and not self.stats.decode_s:
            self.stats.decode_s = time.perf_counter() - self.t_first
        self.slots.release(self.slot)
        return self.stats
