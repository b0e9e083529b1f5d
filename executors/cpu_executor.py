"""The CPU executor: one persistent worker thread computing cold FFN neurons with the numba kernels.

The main thread submits a `ColdJob` (the layer's cold weights, host views of the FFN input and of
the cold part of the active mask, an output buffer, and the event that says the D2H copy has
landed) and goes on queueing fast-tier work; the worker waits for the event, turns the mask into
rows and runs `ffn_rows` (one token) or `ffn_rows_batch` (several tokens sharing one selection),
or for a long prompt chunk `ffn_dense` (GEMMs over all rows, masked).
numba's thread count is per calling thread, so the worker sets it itself, once, at start.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from hotcold.executors.stats import now
from hotcold.executors.weights import ColdFFN
from hotcold.machine import default_threads
from hotcold.sparse_ops.cpu import ffn_dense, ffn_rows, ffn_rows_batch, get_threads, set_threads


@dataclass
class ColdJob:
    """One layer's cold part for N tokens. x, out: float32 [N, D] host views; mask: bool [C] or None
    (all cold neurons); ready: an event to synchronise before reading x and mask (None on the CPU)."""

    cold: ColdFFN
    x: np.ndarray
    mask: np.ndarray | None
    out: np.ndarray
    ready: object = None
    keep: tuple = ()  # device tensors the pending copies read; held until the job is done
    io: object = None  # the HostRows that x and out view (the receiver copies out from it)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    dense: bool = False  # several tokens as torch GEMMs over all rows, masked (prefill's "dense" regime)
    rows: int = 0  # cold neurons computed
    cpu_s: float = 0.0  # mask -> rows + kernel
    input_wait_s: float = 0.0  # blocked on `ready`

    def run(self) -> None:
        t0 = now()
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL
        t1 = now()
        c = self.cold
        rows = np.flatnonzero(self.mask) if self.mask is not None else _all_rows(c)
        self.out.fill(0.0)
        if len(self.x) == 1:
            ffn_rows(self.x[0], rows, c.up, c.down_t, c.act, c.gate, c.up_bias, out=self.out[0])
        elif self.dense:
            ffn_dense(self.x, self.mask, c.up, c.down_t, c.act, c.gate, c.up_bias, out=self.out)
        else:
            ffn_rows_batch(self.x, rows, c.up, c.down_t, c.act, c.gate, c.up_bias, out=self.out)
        self.rows, self.input_wait_s, self.cpu_s = len(rows), t1 - t0, now() - t1

    def wait(self) -> None:
        """Block until the worker finished this job; re-raise its error here."""
        self.done.wait()
        self.keep = ()
        if self.error is not None:
            raise RuntimeError(f"CPU executor failed: {self.error!r}") from self.error


@dataclass
class CallJob:
    """fn(*args) run on the worker (CPU attention, CPU predictors): work that must not start a
    second numba/OpenMP thread team beside the worker's, which then spin against each other."""

    fn: object
    args: tuple
    inference: bool = False  # the caller's torch.inference_mode (grad modes are per thread)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    result: object = None
    cpu_s: float = 0.0

    def run(self) -> None:
        t0 = now()
        with torch.inference_mode() if self.inference else torch.no_grad():
            self.result = self.fn(*self.args)
        self.cpu_s = now() - t0

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"CPU executor failed: {self.error!r}") from self.error


def _all_rows(cold: ColdFFN) -> np.ndarray:
    rows = getattr(cold, "_all_rows", None)
    if rows is None or len(rows) != cold.n:
        rows = cold._all_rows = np.arange(cold.n, dtype=np.int64)
    return rows


class CPUExecutor:
    """A worker thread that runs ColdJobs in submission order. close() stops and joins it.

    inline: no worker thread; submit() runs the job at once in the calling thread. For a CPU fast
    tier there is nothing to overlap with, and a second thread only adds hand-offs and a second
    OpenMP team contending for the same cores (Q4_0 7B shape, 4 layers, 2 cores: see engine.py)."""

    def __init__(self, threads: int | None = None, name: str = "hotcold-cpu", inline: bool = False):
        self.threads = threads or default_threads(cuda=False)
        self.inline, self.name = inline, name
        self._closed = False
        self._thread: threading.Thread | None = None
        self.thread_count: int | None = None  # numba threads as seen inside the worker
        if inline:  # the caller's thread runs the kernels: its numba thread count is set here
            set_threads(self.threads)
            self.thread_count = get_threads()
            return
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        started = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(started,), name=self.name, daemon=True)
        self._thread.start()
        started.wait()

    def _loop(self, started: threading.Event) -> None:
        set_threads(self.threads)
        self.thread_count = get_threads()
        started.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.run()
            except BaseException as e:  # reported to the submitter by job.wait()
                job.error = e
            finally:
                job.done.set()

    def submit(self, job: ColdJob) -> ColdJob:
        if self._closed:
            raise RuntimeError("CPU executor is closed")
        if self.inline:
            try:
                job.run()
            except BaseException as e:  # reported by job.wait(), as from the worker
                job.error = e
            finally:
                job.done.set()
            return job
        self._jobs.put(job)
        return job

    def call(self, fn, *args):
        """fn(*args) on the worker thread, after the jobs already queued; returns its result."""
        if self.inline or threading.current_thread() is self._thread:
            return fn(*args)
        job = CallJob(fn, args, torch.is_inference_mode_enabled())
        self.submit(job).wait()
        return job.result

    @property
    def alive(self) -> bool:
        """Whether jobs may still be submitted."""
        return not self._closed and (self.inline or self._thread.is_alive())

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker after the jobs already submitted; idempotent."""
        if self.inline:
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class HostRows:
    """Host buffers for FFN inputs and CPU results (pinned on CUDA), grown on demand.

    x, out: float32 [rows, D], each with a numpy view sharing its memory."""

    def __init__(self, alloc, dim: int, rows: int = 1):
        self.alloc, self.dim, self.rows = alloc, dim, 0
        self.ensure(rows)

    def ensure(self, rows: int) -> "HostRows":
        if rows > self.rows:
            self.rows = rows
            self.x, self.out = self.alloc((rows, self.dim)), self.alloc((rows, self.dim))
            self.x_np, self.out_np = self.x.numpy(), self.out.numpy()
        return self

    @property
    def nbytes(self) -> int:
        return 2 * self.rows * self.dim * 4
