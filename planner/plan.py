"""The plan artifact: `plan.json` (human-readable) + `plan.safetensors` (index lists), read and written.

plan.safetensors (metadata {"fingerprint", "format": "1", "mode"}), L = num_layers:
  attention_gpu              uint8 [L]   1: layer l's attention, KV cache, norms (+ router, shared expert) on the GPU
  predictor_gpu              uint8 [L]   1: layer l's neuron predictor on the GPU (0: on the CPU, or none needed)
  predictor_off              uint8 [L]   1: no predictor in layer l: its CPU rows are all computed (absent: 0)
  lm_head_gpu                uint8 [1]   1: lm_head (and final norm) on the GPU
  gpu_count                  int32 [L]   GPU neurons (dense/gated layers) or GPU experts (MoE layers) of layer l
  dense/gated layers
    layers.{l}.neuron_order  int32 [I]   every neuron, hottest first (profile frequency, stable)
    layers.{l}.gpu_neurons   int32 [n]   the GPU neurons = neuron_order[:n], hottest first
  MoE layers
    layers.{l}.expert_order  int32 [E]   every expert, most routed first
    layers.{l}.gpu_experts   int32 [m]   the GPU experts, most routed first
plan.json: see `plan_json` in make.py (budget, bytes per component per device, per-layer choices and
predicted times, predicted tokens/s, solver status and gap, the cost constants).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hotcold.artifacts import ArtifactError, atomic_path, find_artifact_dir, read_artifact
from hotcold.planner.costs import Constants

FORMAT = "1"
PLAN_JSON = "plan.json"
PLAN_TENSORS = "plan.safetensors"


@dataclass
class Plan:
    """A plan read back, for the runtime."""

    path: Path  # plan.safetensors
    meta: dict  # plan.json
    fingerprint: str
    mode: str  # "hybrid" | "cpu" | "gpu"
    attention_gpu: np.ndarray  # bool [L]
    predictor_gpu: np.ndarray  # bool [L]
    lm_head_gpu: bool
    gpu_count: np.ndarray  # int [L]
    neuron_order: dict[int, np.ndarray] = field(default_factory=dict)
    gpu_neurons: dict[int, np.ndarray] = field(default_factory=dict)
    expert_order: dict[int, np.ndarray] = field(default_factory=dict)
    gpu_experts: dict[int, np.ndarray] = field(default_factory=dict)
    predictor_off: np.ndarray | None = None  # bool [L]: layers whose CPU rows run without a predictor

    @property
    def num_layers(self) -> int:
        return len(self.attention_gpu)

    @property
    def splits_nothing(self) -> bool:
        """An all-CPU plan without MoE layers in which no layer asks a predictor: nothing is placed or
        skipped, so the model runs whole (the dense engine)."""
        return self.mode == "cpu" and self.predictor_off is not None and all(
            e.get("kind") != "moe" for e in self.meta.get("layers", [])) and bool(self.predictor_off.all())

    def predicted_s_at(self, position: float | None = None) -> float:
        """The predicted seconds per decode step; at `position` (the mean number of cached positions
        a step reads), with the KV cache's read set to that instead of the half context the plan assumed
        (plans written before the per-layer KV times were recorded: unchanged)."""
        t = float(self.meta["predicted"]["time_per_token_s"])
        if position is None:
            return t
        for e in self.meta.get("layers", []):
            if "kv_s_per_position" in e:
                t += e["kv_s_per_position"] * (min(e["kv_window"], position) - e["kv_positions"])
        return t

    @property
    def cpu_threads(self) -> int | None:
        """The CPU threads its hardware profile measured the kernels with (None: not recorded)."""
        return self.meta.get("hardware", {}).get("cpu_threads")

    @property
    def batch(self) -> int | None:
        """The sequences whose KV caches the budget holds, where `plan --batch N` chose them (None:
        planned for one sequence by default)."""
        return planned_batch(self.meta)

    @property
    def predicted_tok_per_s(self) -> float:
        return float(self.meta["predicted"]["tokens_per_s"])

    @property
    def expert_cache_bytes(self) -> int:
        """The GPU bytes the plan gives the MoE expert cache (0: none)."""
        return int(self.meta.get("budget", {}).get("expert_cache_bytes", 0))

    @property
    def expert_stream_bytes(self) -> int:
        """The GPU bytes the plan keeps for prefill's streamed host experts (its cost constant)."""
        got = self.meta.get("cost_constants", {}).get("expert_stream_bytes")
        return int(got) if got is not None else Constants().expert_stream_bytes

    @property
    def gpu_int4(self) -> bool:
        """Planned with 4-bit GPU weights (`plan --gpu-int4`): its GPU bytes assume them."""
        return bool(self.meta.get("weights", {}).get("gpu_int4"))

    @property
    def gpu_int4_down(self) -> bool | None:
        """Whether W_down's hot columns are requantised to int4 too (None: the plan does not say)."""
        v = self.meta.get("weights", {}).get("gpu_int4_down")
        return None if v is None else bool(v)


def planned_batch(meta: dict) -> int | None:
    """plan.json's batch where `plan --batch` set it, else None (plans without the record: None)."""
    budget = meta.get("budget", {})
    return int(budget["batch"]) if budget.get("batch_set") and budget.get("batch") else None


def read_plan_json(path: Path) -> dict | None:
    """plan.json beside plan.safetensors (or in the folder `path`), without the tensors; None when
    it is missing or unreadable (loading the plan reports that)."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    try:
        return json.loads((folder / PLAN_JSON).read_text())
    except (OSError, ValueError):
        return None


def write_plan(folder: Path, tensors: dict[str, np.ndarray], meta: dict) -> list[Path]:
    """Write plan.safetensors then plan.json, each atomically."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    paths = [folder / PLAN_TENSORS, folder / PLAN_JSON]
    with atomic_path(paths[0]) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp),
                  metadata={"fingerprint": meta["fingerprint"], "format": FORMAT, "mode": meta["mode"]})
    with atomic_path(paths[1]) as tmp:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
    return paths


def find_plan(model_path: Path, fingerprint: str, given: Path | None = None) -> Path | None:
    """plan.safetensors: the one given (a file or a folder), or the one in the model's artifact folder."""
    if given is not None:
        given = Path(given).expanduser()
        return given / PLAN_TENSORS if given.is_dir() else given
    folder = find_artifact_dir(model_path, fingerprint)
    if folder is not None and (folder / PLAN_TENSORS).is_file():
        return folder / PLAN_TENSORS
    return None


def check_plan_path(path: Path) -> None:
    """A --plan that names neither plan.safetensors nor a folder holding one: the error load_plan
    raises, before anything loads."""
    path = Path(path).expanduser()
    if not (path / PLAN_TENSORS if path.is_dir() else path).is_file():
        raise ArtifactError(f"{path}: no plan here; run `hotcold plan MODEL --vram SIZE` first")


def load_plan(path: Path, fingerprint: str | None = None) -> Plan:
    """Read plan.safetensors (+ plan.json beside it); refuse a plan made for another model."""
    path = Path(path)
    if path.is_dir():
        path = path / PLAN_TENSORS
    if not path.is_file():
        raise ArtifactError(f"{path}: no plan here; run `hotcold plan MODEL --vram SIZE` first")
    header, tensors, meta = read_artifact(path, "plan", FORMAT, fingerprint, "re-run `hotcold plan`",
                                          meta_path=path.with_name(PLAN_JSON), framework="np")
    plan = Plan(path=path, meta=meta, fingerprint=header.get("fingerprint", ""), mode=header.get("mode", meta.get("mode")),
                attention_gpu=tensors["attention_gpu"].astype(bool), predictor_gpu=tensors["predictor_gpu"].astype(bool),
                lm_head_gpu=bool(tensors["lm_head_gpu"][0]), gpu_count=tensors["gpu_count"].astype(np.int64),
                predictor_off=tensors["predictor_off"].astype(bool) if "predictor_off" in tensors else
                np.zeros(len(tensors["attention_gpu"]), bool))
    for name, t in tensors.items():
        if name.startswith("layers."):
            _, layer, what = name.split(".", 2)
            getattr(plan, what)[int(layer)] = t.astype(np.int64)
    return plan
