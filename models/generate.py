"""The token generator: prefill then decode over a preallocated KV cache, as a Python iterator.

The CLI and the server consume `Generator.generate(...)`, which yields one TokenEvent per
sampled token; the last event carries `finish_reason` ("stop" or "length"). Text is
detokenised incrementally and held back while it could still be the start of a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hotcold.errors import ContextLengthError
from hotcold.machine import spare_cpus_for_spinning
from hotcold.models.loader import LoadedModel
from hotcold.models.sampling import SamplingParams, penalise, sample_id
from hotcold.models.transformer import KVCache
from hotcold.sparse_ops.selection import get_threads, release_threads

PREFILL_CHUNK = 1024  # prompt tokens a forward pass: on the H100 host, a 2,048-token prompt of the 48-layer
# Qwen3-30B-A3B shape at its 8 GiB plan prefilled at 1,812 tok/s in chunks of 512, 2,598 of 1,024


@dataclass
class TokenEvent:
    """One generated token and the text it completed (may be empty while text is held back)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # on the last event: "stop" (EOS or stop string) or "length"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt prefix reused from the previous call's KV cache
    completion_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def decode_tok_per_s(self) -> float:
        n = self.completion_tokens - 1  # the first token comes from prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def split_stop(text: str, stops: Sequence[str]) -> tuple[str, bool, str]:
    """(text safe to emit, stop string found, text held back as a possible stop prefix)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if hits:
        return text[: min(hits)], True, ""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold], False, text[len(text) - hold :]


def _masked(logits: torch.Tensor, constraint) -> torch.Tensor:
    return logits if constraint is None else constraint.apply(logits)


class Generator:
    """Generates tokens for one sequence at a time, reusing the KV cache for a shared prompt prefix."""

    def __init__(self, lm: LoadedModel, max_context: int | None = None, pipeline: bool | str = "auto"):
        self.lm = lm
        model_ctx = lm.config.max_position_embeddings
        self.max_context = min(max_context or model_ctx, model_ctx)
        self.cache: KVCache | None = None
        self.cached_ids: list[int] = []
        # the last prompt and its next-token logits: the same prompt again starts from them, so a
        # repeated request does not recompute its last token one-token-wise, whose rounding (the
        # block kernels' Q8 activations against a prompt's bfloat16 GEMMs) can flip a near tie
        self.last_prompt: tuple[list[int], torch.Tensor] | None = None
        self.stats = GenerationStats()
        # on CUDA, wait for each step's logits on a blocking event (the thread sleeps) rather than in
        # the copy's spin-wait, leaving its core to CPU work queued behind the step (a host node's
        # kernels); off until measured (tools/bench_moe_decode.py --wait spin,block)
        self.blocking_wait = False
        # on CUDA, sample on the device and queue the next step before the host reads the token, so
        # the host's per-token work (reading the token, detokenising, stop strings, the consumer,
        # the next step's launch) overlaps the GPU's and host nodes' step instead of adding to it;
        # off for logprobs (the host reads them) and with pipeline=False. "auto": on CUDA; True: on
        # any device (on the CPU the order changes nothing: the tests compare both loops there)
        self.pipeline: bool | str = pipeline
        self._token_host: torch.Tensor | None = None  # pinned [1] int64: the sampled id's landing place
        self._event: tuple | None = None  # (blocking, the torch.cuda.Event the host waits on for a step)
        # on CUDA, end the main thread's numba thread team once the prompt is in (release_threads):
        # decoding's CPU work runs in CUDA's host-function thread, whose team may then spin between
        # regions where it leaves room (machine.spare_cpus_for_spinning); False keeps it (to compare)
        self.release_threads = True

    def ends_main_team(self) -> bool:
        """Whether a CUDA generation ends the main thread's numba team once its prompt is in: asked for
        (release_threads) and the run's team leaves two CPUs (machine.spare_cpus_for_spinning)."""
        return self.release_threads and spare_cpus_for_spinning(get_threads())

    def _ensure_cache(self, needed: int) -> None:
        if self.cache is None or self.cache.max_len < needed:
            size = min(self.max_context, max(needed, 256))
            self.cache = KVCache(self.lm.config, size, device=self.lm.device, dtype=self.lm.dtype,
                                 layer_devices=self.lm.layer_devices)
            self.cached_ids, self.last_prompt = [], None

    @torch.inference_mode()
    def forward(self, ids: list[int] | torch.Tensor, start: int, last_only: bool = True) -> torch.Tensor:
        """Run ids (a list, or [T] int64 on the model's device) at positions start.. through the
        model, writing the cache; logits [T or 1, V] fp32."""
        tokens = ids.view(1, -1) if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=self.lm.device)
        out = None
        for i in range(0, tokens.shape[1], PREFILL_CHUNK):
            chunk = tokens[:, i : i + PREFILL_CHUNK]
            out = self.lm.model(chunk, start + i, self.cache, last_only=last_only)
        return out[0]

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt >= self.max_context:
            raise ContextLengthError(
                f"prompt has {n_prompt} tokens but the context holds {self.max_context}; "
                "shorten the prompt or raise --ctx (the model allows "
                f"{self.lm.config.max_position_embeddings})"
            )

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int = 256,
        sampling: SamplingParams = SamplingParams(),
        stop: Sequence[str] = (),
        seed: int | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        constraint=None,
    ) -> Iterator[TokenEvent]:
        """Yield TokenEvents until EOS, a stop string, max_tokens or the end of the context.

        constraint: a grammar's per-sequence state (server/constrain.py's Constraint): `apply(logits)`
        masks what it forbids before sampling, `accept(token)` advances it, and the generation
        ends ("stop") when it is `done`."""
        if not prompt_ids:
            raise ContextLengthError("prompt is empty; give at least one token")
        self.check_fits(len(prompt_ids))
        budget = min(max_tokens, self.max_context - len(prompt_ids))
        self._ensure_cache(len(prompt_ids) + budget)
        budget = min(budget, self.cache.max_len - len(prompt_ids))
        tok = self.lm.tokenizer
        eos = set() if ignore_eos else (set(tok.eos_ids) if tok else set(self.lm.config.eos_token_ids))
        detok = tok.detokenizer() if tok else None
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()

        # Prefill only the part of the prompt not already in the cache.
        n = len(prompt_ids)
        if self.last_prompt is not None and self.last_prompt[0] == prompt_ids and self.cached_ids[:n] == prompt_ids:
            stats.cached_prompt_tokens = n
            logits = self.last_prompt[1].clone()
        else:
            reuse = 0
            for a, b in zip(self.cached_ids, prompt_ids[:-1]):
                if a != b:
                    break
                reuse += 1
            stats.cached_prompt_tokens = reuse
            self.cached_ids = list(prompt_ids[:reuse])
            logits = self.forward(prompt_ids[reuse:], reuse)[-1]
            self.last_prompt = (list(prompt_ids), logits.clone())
        self.cached_ids = list(prompt_ids)
        on_gpu = logits.is_cuda and torch.device(self.lm.device).type == "cuda"
        if on_gpu and self.ends_main_team():
            release_threads()
        pipelined = logprobs is None and (self.pipeline is True or (self.pipeline == "auto" and on_gpu))
        device = logits.device if pipelined else torch.device("cpu")
        gen = torch.Generator(device=device).manual_seed(seed if seed is not None else torch.seed())
        history = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        pending = ""
        t_first = None
        while True:
            more = stats.completion_tokens + 1 < budget  # a step may follow this token
            if pipelined:
                token_dev = sample_id(_masked(penalise(logits, history, sampling), constraint), sampling, gen)
                step = (lambda: self.forward(token_dev.view(1), len(self.cached_ids))[-1]) if more else None
                token, logits = self._read_after(token_dev, step)  # logits: the next step's, queued
                if more:
                    history = torch.cat([history, token_dev.view(1)])
            else:
                if self.blocking_wait and logits.is_cuda:
                    event = self._step_event()
                    event.record()
                    event.synchronize()
                logits = logits.cpu()
                token = int(sample_id(_masked(penalise(logits, history, sampling), constraint), sampling, gen))
            if constraint is not None:
                constraint.accept(token)  # starts the next mask, computed while the next step runs
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            stats.completion_tokens += 1
            stats.token_ids.append(token)
            event = TokenEvent(token, "")
            if logprobs is not None:
                lp = torch.log_softmax(logits, dim=-1)
                event.logprob = float(lp[token])
                if logprobs > 0:
                    top = torch.topk(lp, logprobs)
                    event.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
            if token in eos:
                event.text, event.finish_reason = pending + (detok.flush() if detok else ""), "stop"
            elif constraint is not None and constraint.done:  # the grammar is complete: nothing may follow
                event.text, event.finish_reason = pending + (detok.add(token) + detok.flush() if detok else ""), "stop"
            else:
                pending += detok.add(token) if detok else ""
                event.text, stopped, pending = split_stop(pending, stop)
                if stopped:
                    event.finish_reason = "stop"
                elif stats.completion_tokens >= budget:
                    event.text += pending + (detok.flush() if detok else "")
                    event.finish_reason = "length"
            if event.finish_reason:
                stats.finish_reason = event.finish_reason
                stats.decode_s = time.perf_counter() - t_first
                yield event
                return
            yield event
            if not pipelined:
                history = torch.cat([history, torch.tensor([token])])
                logits = self.forward([token], len(self.cached_ids))[-1]
            self.cached_ids.append(token)

    def _read_after(self, token_dev: torch.Tensor, launch) -> tuple[int, torch.Tensor | None]:
        """The sampled id token_dev (0-d) as an int, with launch() (the next step) queued on the
        GPU before the host waits for it: the id's copy is ordered before the step, so the host gets it
        while the step runs. Returns (id, launch's result)."""
        if not token_dev.is_cuda:
            return int(token_dev), launch() if launch is not None else None
        if self._token_host is None:
            self._token_host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        event = self._step_event()
        self._token_host.copy_(token_dev.view(1), non_blocking=True)
        event.record()
        queued = launch() if launch is not None else None
        event.synchronize()
        return int(self._token_host[0]), queued

    def _step_event(self) -> torch.cuda.Event:
        """The event the host waits on for a step's result: blocking (the thread sleeps) with
        blocking_wait, else spinning."""
        if self._event is None or self._event[0] != self.blocking_wait:
            self._event = (self.blocking_wait, torch.cuda.Event(blocking=self.blocking_wait))
        return self._event[1]
