"""Where a model's load time goes, stage by stage: `LoadTimes`, filled by `load_model` and
`open_for_run` (and `make_hybrid`, for a split model), printed by `hotcold run --stats` and
recorded by `tools/bench.py`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# The stages in the order a load passes through them (a stage not timed is left out of the line).
STAGES = (
    "parse",      # GGUF header / HF config and tensor list, fingerprint, plan and predictors read
    "build",      # the module allocated (meta build, empty parameters)
    "weights",    # tensors read from the file: views of the mapping, dequantised or copied ones
    "tokenizer",  # the tokenizer built from the file's vocabulary
    "split",      # a plan's FFN / MoE split: hot rows and experts gathered, cold ones laid out for the CPU
    "upload",     # the fast tier's weights moved to the device (dequantised or int4-packed there)
    "repack",     # host matrices interleaved for the one-token CPU kernels (pack_rows)
    "pin",        # host memory page-locked for streaming and the expert cache
    "kernels",    # host kernels built or loaded from numba's cache, host nodes and steps
    "graphs",     # CUDA graphs captured
)


@dataclass
class LoadTimes:
    """Seconds per load stage (see STAGES), and the whole load's wall time once `finish` is called.
    Stages may repeat (their times add up); `other` is the wall time no stage covered."""

    stages: dict[str, float] = field(default_factory=dict)
    total_s: float | None = None
    _start: float = field(default_factory=time.perf_counter, repr=False)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed code as stage `name` (added to earlier time of that stage)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def finish(self) -> "LoadTimes":
        """The load is over: its wall time since this object was made."""
        self.total_s = time.perf_counter() - self._start
        return self

    @property
    def other_s(self) -> float:
        total = self.total_s if self.total_s is not None else time.perf_counter() - self._start
        return max(0.0, total - sum(self.stages.values()))

    def as_dict(self) -> dict[str, float]:
        """Stage -> seconds (rounded to ms), in STAGES order, with "other" and "total"."""
        out = {k: round(self.stages[k], 3) for k in sorted(self.stages, key=_order)}
        out["other"] = round(self.other_s, 3)
        if self.total_s is not None:
            out["total"] = round(self.total_s, 3)
        return out

    def line(self) -> str:
        """One line: 'load 2.41 s: parse 0.05, weights 0.31, tokenizer 0.27, repack 0.12, other 0.02'."""
        d = self.as_dict()
        total = d.pop("total", None)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in d.items())
        return f"load {total:.2f} s: {parts}" if total is not None else f"load: {parts}"


def _order(name: str) -> int:
    return STAGES.index(name) if name in STAGES else len(STAGES)
