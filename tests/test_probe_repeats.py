"""The hardware probe on a busy machine: one preempted measurement does not set a rate or overhead."""

from __future__ import annotations

import itertools
import time

from hotcold.planner import timing


def _sleeper(pattern):
    """A call that takes the next duration of `pattern` (seconds), cycling."""
    durations = itertools.cycle(pattern)

    def fn():
        end = time.perf_counter() + next(durations)
        while time.perf_counter() < end:
            pass
    return fn


def test_call_time_is_the_fastest_call_not_a_preempted_one():
    # one call in five preempted for 8 ms (the busy moment that set cpu_call_s to 8 ms): 20 µs counts
    t = timing._call_time(_sleeper([20e-6, 20e-6, 8e-3, 20e-6, 20e-6]), reps=20)
    assert 15e-6 < t < 200e-6, t


def test_call_time_over_the_bound_is_capped():
    calls = [0]

    def slow():
        calls[0] += 1
        _sleeper([3e-3])()

    assert timing._call_time(slow, reps=3, tries=2) == timing.CALL_BOUND_S
    assert calls[0] == 1 + 2 * 3  # the warm-up, then every try measured again


def test_rate_ignores_a_disturbed_batch():
    # one batch preempted for 30 ms among batches of 1 ms calls: the rate stays 1 ms a call
    fn = _sleeper([1e-3] * 15 + [30e-3] + [1e-3] * 1000)
    t = timing._rate(fn, min_time=0.05)
    assert 0.9e-3 < t < 2e-3, t
