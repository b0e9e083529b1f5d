"""The serving engine: loads the model in the background, then runs one generation at a time.

Requests are admitted up to `max_concurrency` (running + waiting; beyond that `Busy`), wait in
a FIFO queue, and run on one worker thread around one `Generator` (one KV cache). Tokens go
back to the request's event loop through an asyncio queue; a cancelled job (client gone)
stops between tokens and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from hotcold.errors import HotcoldError
from hotcold.models.generate import GenerationStats, Generator, TokenEvent
from hotcold.models.sampling import SamplingParams

log = logging.getLogger("hotcold.server")
DEFAULT_CTX = 4096  # without --ctx: the model's context up to this (the KV cache grows to it)


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


class Engine:
    """Owns the model and the worker thread; `submit` from the event loop, then `stream`."""

    def __init__(self, load: Callable[[], Any], max_concurrency: int = 8, ctx: Optional[int] = None,
                 on_finished: Optional[Callable[[GenerationStats], None]] = None):
        self._load = load
        self._ctx = ctx
        self.max_concurrency = max_concurrency
        self.on_finished = on_finished
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

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def max_context(self) -> int:
        return self.generator.max_context

    def start(self, on_fatal: Callable[[], None] = lambda: None) -> None:
        """Load the model and serve the queue on a daemon thread; `on_fatal` runs if loading fails."""
        self._thread = threading.Thread(target=self._main, args=(on_fatal,), name="hotcold-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after the current job's next token; queued jobs are dropped."""
        if self._current is not None:
            self._current.cancel()
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
        self.state = "ready"
        log.info("model %s ready (context %d)", lm.name, self.generator.max_context)
        try:
            self._serve()
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
