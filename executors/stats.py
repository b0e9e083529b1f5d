"""Where the time of a hybrid forward goes: per-phase sums of GPU work, CPU work, transfers and waiting.

Every HybridFFN and HybridMoE of an engine writes into one `StatsBook`. Times are seconds. On CUDA,
GPU work and transfers are timed with CUDA events that are read lazily (when complete, never forcing
a sync); on the CPU device they are wall-clock spans on the calling thread. CPU work is the worker's kernel
time; `wait` is the main thread blocked on the worker's result; `cpu_wait` is the worker blocked on
its input (the D2H copy); `host` is the attention and predictors that the plan put on the CPU
(main thread's view: copies, hand-off to the worker and its compute).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

PHASES = ("decode", "prefill")
TIMES = ("gpu_s", "cpu_s", "transfer_s", "wait_s", "cpu_wait_s", "host_s")


@dataclass
class PhaseStats:
    """Sums over one phase. tokens: forward passes counted at the first hybrid layer (decode: one
    token each; prefill: the tokens of the chunk)."""

    tokens: int = 0
    forwards: int = 0
    layer_calls: int = 0
    gpu_s: float = 0.0  # predictor + hot FFN (+ streamed cold FFN); MoE: router, shared and GPU experts
    cpu_s: float = 0.0  # worker: mask -> rows and the numba kernel
    transfer_s: float = 0.0  # D2H of input and mask, H2D of the CPU result, streamed weights
    wait_s: float = 0.0  # main thread blocked on the worker (MoE: and on the routing's D2H copy)
    cpu_wait_s: float = 0.0  # worker blocked on its input copy
    host_s: float = 0.0  # attention and predictors the plan put on the CPU, copies and hand-off included
    rows_gpu: int = 0  # hot neurons computed and kept (predicted active), summed over tokens and layers
    rows_cpu: int = 0  # cold neurons computed by the CPU (decode: per token; prefill: per chunk)
    rows_streamed: int = 0  # cold neurons computed on the fast tier from streamed weights (prefill)
    hot_rows: int = 0  # hot neurons resident, summed over layer calls
    cold_rows: int = 0  # cold neurons in host memory, summed over layer calls
    experts_gpu: int = 0  # MoE: (token, routed expert) pairs computed on the fast tier, over layers
    experts_cpu: int = 0  # MoE: (token, routed expert) pairs computed by the CPU worker, over layers
    experts_cached: int = 0  # MoE: of experts_gpu, those found in the expert cache (decode)
    experts_prefetched: int = 0  # MoE: experts copied into the expert cache ahead of their layer
    lookahead_named: int = 0  # MoE: routed host experts (cached or not) the look-ahead had named
    lookahead_routed: int = 0  # MoE: routed host experts in layers that follow a look-ahead
    regimes: dict = field(default_factory=dict)  # prefill: {"cpu": n, "stream": n} layer calls


class StatsBook:
    """Accumulates PhaseStats; `pending` holds (phase, field, start, end) CUDA event spans not yet read."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.phases = {p: PhaseStats() for p in PHASES}
        self.pending: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self.counters: dict[tuple[str, str], torch.Tensor] = {}  # on-device row counts, read lazily

    def add(self, phase: str, **values) -> None:
        st = self.phases[phase]
        for k, v in values.items():
            setattr(st, k, getattr(st, k) + v)

    def span(self, phase: str, name: str, start, end) -> None:
        """A timed span: two perf_counter floats, or two CUDA events (read later)."""
        if start is None:
            return
        if isinstance(start, float):
            self.add(phase, **{name: end - start})
        else:
            self.pending.append((phase, name, start, end))

    def count(self, phase: str, name: str, n: torch.Tensor) -> None:
        """Add a device-side count (a 0-d tensor) to field `name` without synchronising."""
        acc = self.counters.get((phase, name))
        if acc is None or acc.device != n.device:
            with torch.inference_mode(False):
                acc = self.counters[(phase, name)] = torch.zeros((), dtype=torch.int64, device=n.device)
        acc.add_(n)

    def resolve(self, block: bool = False) -> None:
        """Read the CUDA event spans that have completed (all of them with block=True)."""
        keep = []
        for i, (phase, name, a, b) in enumerate(self.pending):
            if not block and not b.query():
                keep = self.pending[i:]
                break
            b.synchronize()
            self.add(phase, **{name: a.elapsed_time(b) / 1e3})
        self.pending = keep
        if block:
            for (phase, name), acc in self.counters.items():
                self.add(phase, **{name: int(acc.item())})
                acc.zero_()

    def reset(self) -> None:
        self.resolve(block=True)
        self.phases = {p: PhaseStats() for p in PHASES}

    def summary(self) -> dict:
        """Per phase: the sums, and per token the means (milliseconds and rows)."""
        self.resolve(block=True)
        out = {}
        for phase, st in self.phases.items():
            d = asdict(st)
            n = max(1, st.tokens if phase == "decode" else st.forwards)
            d["per_token" if phase == "decode" else "per_forward"] = {
                **{k.replace("_s", "_ms"): 1e3 * getattr(st, k) / n for k in TIMES},
                **{k: getattr(st, k) / n for k in ("rows_gpu", "rows_cpu", "rows_streamed", "experts_gpu",
                                                    "experts_cpu", "experts_cached", "experts_prefetched")},
            }
            host = st.experts_cached + st.experts_cpu  # routed experts that live in host memory
            d["cache_hit_rate"] = st.experts_cached / host if host and (st.experts_cached or st.experts_prefetched) else None
            d["lookahead_recall"] = st.lookahead_named / st.lookahead_routed if st.lookahead_routed else None
            out[phase] = d
        return out


def now() -> float:
    return time.perf_counter()


def parse_smaps_rollup(text: str) -> tuple[int, int, int] | None:
    """(resident bytes, of them anonymous, of those in transparent huge pages) from
    /proc/PID/smaps_rollup's text; None when it lacks a field."""
    keys = ("Rss", "Anonymous", "AnonHugePages")
    kb = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in keys and len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            kb[key] = int(parts[0]) * 1024
    return tuple(kb[k] for k in keys) if len(kb) == len(keys) else None


def huge_page_share() -> tuple[int, int, int] | None:
    """This process's (resident, anonymous, in huge pages) bytes, or None where Linux does not say.
    A weight copied into anonymous memory and read from 4 KiB pages streams at up to ~30% less
    (advise_hugepages), so a huge-page share well below the weights' explains a slow run. (Blocks
    kept in a mapped GGUF file are file pages, always 4 KiB.)"""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return parse_smaps_rollup(f.read())
    except OSError:
        return None
