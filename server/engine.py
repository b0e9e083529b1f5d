"""The serving engine: loads the model in the background, then generates on one worker thread.

Requests are admitted up to `max_concurrency` (running + waiting; beyond that `Busy`) and wait in a
FIFO queue. On the CPU up to `parallel` of them run together (continuous batching, server/batching.py):
each step decodes one token of every running sequence in one `decode_rows` call, a new request's
prompt is prefilled in chunks between steps, and a finished one leaves at once; their KV slots
stay behind as a prefix cache. A model on a GPU runs one generation at a time around one
`Generator` (one KV cache). Tokens go back to the request's event loop through an asyncio queue;
a cancelled job (client gone) stops before its next token and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hotcold.errors import HotcoldError
from hotcold.models.generate import GenerationStats, Generator, TokenEvent
from hotcold.models.sampling import SamplingParams
from hotcold.server.batching import Sequence, Slots

log = logging.getLogger("hotcold.server")
DEFAULT_CTX = 4096  # without --ctx: the model's context up to this (the KV cache grows to it)
DEFAULT_PARALLEL = 4  # sequences decoded together on the CPU


@contextmanager
def one_torch_thread():
    """torch's own operations on one thread within: a token's sampling operations are small (the
    largest: over the vocabulary's logits), each one an OpenMP region on the cores whose numba kernel
    threads have just run; 2 cores, SmolLM2's 49k logits, a busy machine: sampling a
    token took 5-8 ms on 2 threads against 0.3-0.6 ms on one. (The numba kernels keep their threads.)"""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Busy(Exception):
    """All `max_concurrency` slots are taken."""


class NotReady(Exception):
    """The model is still loading (or failed to load)."""


@dataclass
class _Done:
    stats: GenerationStats


@dataclass
class _Failed:
    error: BaseException


@dataclass
class Job:
    """One admitted request: what to generate and where its tokens go."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    seed: Optional[int]
    logprobs: Optional[int]
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    constraint: Any = None  # the request's grammar state (server/constrain.py), or None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting -> running -> done, or cancelled while waiting
    stats: Optional[GenerationStats] = None
    _cancel: threading.Event = field(default_factory=threading.Event)
    _engine: Any = None

    def cancel(self) -> None:
        """Stop this job (idempotent); a waiting job frees its slot at once."""
        self._engine._cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self._cancel.set()


class ServingEngine:
    """Owns the model and the worker thread; `submit` from the event loop, then `stream`."""

    def __init__(self, load: Callable[[], Any], max_concurrency: int = 8, ctx: Optional[int] = None,
                 on_finished: Optional[Callable[[GenerationStats], None]] = None, parallel: int = DEFAULT_PARALLEL,
                 cache_slots: Optional[int] = None):
        self._load = load
        self._ctx = ctx
        self.max_concurrency = max(max_concurrency, parallel)
        self.on_finished = on_finished
        self.on_step: Optional[Callable[[int], None]] = None  # called with each decode step's batch size
        self.parallel = parallel  # sequences decoded together (1 where the model cannot batch: GPU)
        self._cache_slots = max(cache_slots or 2 * parallel, parallel)
        self.slots: Optional[Slots] = None
        self.lm = None
        self._setup = None  # executors.from_plan.RunSetup when `load` returns one
        self.generator: Optional[Generator] = None
        self.state = "loading"  # loading -> ready, or failed
        self.load_error: Optional[str] = None
        self.waiting = 0
        self.running = 0
        self._lock = threading.Lock()
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._current: Optional[Job] = None
        self._closing = False

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def max_context(self) -> int:
        return self.generator.max_context

    def check_fits(self, n_prompt: int) -> None:
        """Raise ContextLengthError for a prompt the context cannot hold."""
        self.generator.check_fits(n_prompt)

    def start(self, on_fatal: Callable[[], None] = lambda: None) -> None:
        """Load the model and serve the queue on a daemon thread; `on_fatal` runs if loading fails."""
        self._thread = threading.Thread(target=self._main, args=(on_fatal,), name="hotcold-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after the current step; queued jobs are dropped."""
        if self._current is not None:
            self._current.cancel()
        self._closing = True
        self._queue.put(None)

    def _main(self, on_fatal: Callable[[], None]) -> None:
        try:
            loaded = self._load()
            # a RunSetup is kept whole: its hybrid engine owns the CPU worker and the page-locked host
            # weights (released when it is collected), so they live as long as the server
            self._setup = loaded if hasattr(loaded, "engine") else None
            lm = loaded.lm if self._setup is not None else loaded
            if lm.tokenizer is None:
                raise HotcoldError(f"{lm.path}: no tokenizer in the model; hotcold serve needs one")
            ctx = self._ctx or min(lm.config.max_position_embeddings, DEFAULT_CTX)
            self.lm, self.generator = lm, Generator(lm, max_context=ctx)
        except Exception as e:  # any load failure ends the server with one line
            if self._setup is not None:
                self._setup.close()
            self.load_error = str(e) if isinstance(e, HotcoldError) else f"{type(e).__name__}: {e}"
            self.state = "failed"
            on_fatal()
            return
        batched = lm.device.type == "cpu" and (self._setup is None or self._setup.engine is None)
        if batched:
            self.slots = Slots(lm.config, self._cache_slots, self.generator.max_context, lm.dtype)
            self._warm_up()
        else:
            self.parallel = 1
        self.state = "ready"
        log.info("model %s ready (context %d, %s)", lm.name, self.generator.max_context,
                 f"{self.parallel} sequences at a time, {self._cache_slots} KV slots of "
                 f"{self.slots.cache.slot_nbytes() / 2**20:.0f} MiB each (committed as they fill)" if batched
                 else "one sequence at a time: a model on a GPU or split by its plan does not batch yet, "
                 "whatever --parallel says")
        try:
            self._serve_batched() if batched else self._serve()
        finally:
            if self._setup is not None:
                self._setup.close()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                if job.state == "cancelled":
                    continue
                job.state, self.waiting, self.running = "running", self.waiting - 1, self.running + 1
                self._current = job
            final = self._run(job)
            with self._lock:  # free the slot before answering, so the client's next request fits
                job.state, self.running, self._current = "done", self.running - 1, None
            job._put(final)

    def _warm_up(self) -> None:
        """Compile the batched step's kernels (numba, cached on disk after the first start) while
        /health still says loading, instead of in the first requests."""
        from hotcold.models.batch_step import decode_rows

        if len(self.slots.ids) < 2 or self.generator.max_context < 2:
            return
        with torch.inference_mode():
            self.lm.model(torch.tensor([[0]]), 0, self.slots.cache.view(0))
            self.lm.model(torch.tensor([[0]]), 0, self.slots.cache.view(1))
            decode_rows(self.lm.model, [0, 0], [1, 1], self.slots.cache, [0, 1])

    def _serve_batched(self) -> None:
        """Continuous batching: admit jobs into free slots, advance prefills a chunk, sample every
        sequence with logits, then one decode step for all sequences with a token to feed."""
        from hotcold.models.batch_step import decode_rows

        waiting: list[Job] = []
        running: list[Sequence] = []
        while not self._closing:
            try:  # block only when there is nothing to do
                item = self._queue.get(block=not (running or waiting))
                while True:
                    if item is None:
                        return
                    waiting.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            waiting = [j for j in waiting if j.state != "cancelled"]
            while waiting and len(running) < self.parallel:
                job = waiting.pop(0)
                with self._lock:
                    if job.state == "cancelled":
                        continue
                    job.state, self.waiting, self.running = "running", self.waiting - 1, self.running + 1
                seq = self._guarded(job, lambda: Sequence(job, self.lm, self.slots, self.generator.max_context))
                if seq is not None:
                    running.append(seq)
            for seq in running:
                if seq.job.cancelled:
                    self._end(seq)
                    continue
                if seq.prefilling:
                    self._guarded(seq.job, seq.prefill_chunk, seq)
                if not seq.done and seq.logits is not None:  # (a prompt just prefilled samples at once)
                    with one_torch_thread():
                        event = self._guarded(seq.job, seq.sample, seq)
                    if event is not None:
                        seq.job._put(event)
                        if seq.done:
                            self._end(seq)
            running = [s for s in running if not s.done]
            step = [s for s in running if s.token is not None]
            if step:
                try:
                    logits = decode_rows(self.lm.model, [s.token for s in step], [s.position for s in step],
                                         self.slots.cache, [s.slot for s in step])
                except Exception as e:  # the whole step failed: every sequence in it ends with the error
                    log.exception("decode step failed")
                    for s in step:
                        self._end(s, _Failed(e), drop=True)
                    running = [s for s in running if not s.done]
                    continue
                for s, row in zip(step, logits):
                    s.stepped(row)
                if self.on_step:
                    self.on_step(len(step))

    def _guarded(self, job: Job, fn, seq: Optional[Sequence] = None):
        """fn(); a failure ends this job alone (its slot forgotten) and returns None."""
        try:
            return fn()
        except Exception as e:
            if not isinstance(e, HotcoldError):
                log.exception("generation failed")
            if seq is not None:
                self._end(seq, _Failed(e), drop=True)
            else:
                with self._lock:
                    job.state, self.running = "done", self.running - 1
                job._put(_Failed(e))
            return None

    def _end(self, seq: Sequence, final=None, drop: bool = False) -> None:
        """The sequence leaves the batch: its slot freed (kept as cache unless `drop`), the job answered."""
        seq.done = True
        if drop:
            self.slots.drop(seq.slot)
            stats = seq.stats
        else:
            stats = seq.finish()
        if final is None:
            if self.on_finished:
                self.on_finished(stats)
            final = _Done(stats)
        with self._lock:
            seq.job.state, self.running = "done", self.running - 1
        seq.job._put(final)

    def _run(self, job: Job):
        """Generate for one job, handing events over; returns the final _Done or _Failed item."""
        events = None
        try:
            events = self.generator.generate(job.prompt_ids, job.max_tokens, job.sampling, stop=job.stop,
                                             seed=job.seed, logprobs=job.logprobs, ignore_eos=job.ignore_eos,
                                             constraint=job.constraint)
            for event in events:
                if job.cancelled:
                    break
                job._put(event)
            stats = self.generator.stats
            if self.on_finished:
                self.on_finished(stats)
            return _Done(stats)
        except Exception as e:  # one failed request must not stop the server
            if not isinstance(e, HotcoldError):
                log.exception("generation failed")
            return _Failed(e)
        finally:
            if events is not None:
                events.close()

    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: list[str],
               seed: Optional[int], logprobs: Optional[int], ignore_eos: bool = False, constraint=None) -> Job:
        """Admit a job (from the event loop); raises NotReady or Busy."""
        if not self.ready:
            raise NotReady(self.load_error or "model is loading")
        job = Job(prompt_ids, max_tokens, sampling, stop, seed, logprobs, ignore_eos, asyncio.get_running_loop(),
                  constraint, _engine=self)
        with self._lock:
            if self.waiting + self.running >= self.max_concurrency:
                raise Busy()
            self.waiting += 1
        self._queue.put(job)
        return job

    def _cancel(self, job: Job) -> None:
        with self._lock:
            job._cancel.set()
            if job.state == "waiting":
                job.state, self.waiting = "cancelled", self.waiting - 1

    async def stream(self, job: Job) -> AsyncIterator[TokenEvent]:
        """The job's TokenEvents; sets `job.stats` at the end; re-raises a generation error."""
        while True:
            item = await job.out.get()
            if isinstance(item, _Done):
                job.stats = item.stats
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
