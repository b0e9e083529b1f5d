"""Timing the probe's calls on a machine other work may share: the best of repeats, per-call
overheads as the fastest single call with a sanity bound (planner/probe.py measures with these)."""

from __future__ import annotations

import statistics
import time

REPEATS = 5  # batches of calls per rate; the fastest counts
CALL_BOUND_S = 1e-3  # no per-call overhead or thread hand-off honestly takes this long: a preempted measurement


def _rate(fn, min_time: float, max_reps: int = 10_000) -> float:
    """Seconds per call: the best of REPEATS batches of calls lasting at least min_time/REPEATS each
    (a batch the machine's other work preempted counts slower, not the rate), measured once more
    when even the best batch is over twice the fastest single call seen (every batch was disturbed)."""
    fn()  # warm-up (and JIT compilation)
    for attempt in range(2):
        best, fastest = float("inf"), float("inf")
        for _ in range(REPEATS):
            n, t0 = 0, time.perf_counter()
            while True:
                t = time.perf_counter()
                fn()
                fastest = min(fastest, time.perf_counter() - t)
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_time / REPEATS or n >= max_reps:
                    break
            best = min(best, dt / n)
        if best <= 2 * fastest:
            break
    return best


def _call_time(fn, reps: int, bound: float = CALL_BOUND_S, tries: int = 3) -> float:
    """Seconds of one short call (an overhead: a one-row kernel, a thread hand-off): the fastest of
    `reps` single calls, which one preempted call cannot raise (a median or mean of a busy moment set
    8 ms where 4 µs is the machine's, in every later plan). Measured again while above `bound`, up
    to `tries` times; then `bound`, with the busy warning of the profile's load to say why."""
    fn()
    best = float("inf")
    for _ in range(tries):
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        if best <= bound:
            return best
    return bound


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
