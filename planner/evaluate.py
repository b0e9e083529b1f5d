"""A placement of a model's units (`Placement`: which are on the GPU) and its evaluation under the
cost model of planner/costs.py: per layer the GPU and CPU bytes and seconds, the predicted time per
step (`evaluate`), and the same placement without the predictors that do not pay
(`without_needless_predictors`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hotcold.planner.costs import ModelCosts


@dataclass
class Placement:
    """Which units are on the GPU. on_gpu[l] is a bool array over layer l's units (in hot-first order);
    for dense/gated layers the planner only produces prefixes, the evaluator accepts any subset."""

    mode: str  # "hybrid" | "cpu" | "gpu"
    attn_gpu: list[bool]
    on_gpu: list[np.ndarray]
    head_gpu: bool
    # per layer, the predictor on the GPU although the attention is on the CPU (the FFN's input is
    # back on the GPU after the attention, so the GPU predictor needs no extra round trip); None: the
    # predictor sits beside the attention. An attention on the GPU always has its predictor there.
    pred_gpu: list[bool] | None = None
    # per layer, no predictor: the CPU computes every one of the layer's CPU rows (cheaper when the
    # predictor would select nearly all of them anyway); None: every layer with CPU rows asks one
    pred_off: list[bool] | None = None

    @classmethod
    def all_cpu(cls, costs: ModelCosts) -> "Placement":
        n = len(costs.layers)
        return cls("cpu", [False] * n, [np.zeros(lc.n_units, bool) for lc in costs.layers], False)

    @classmethod
    def all_gpu(cls, costs: ModelCosts) -> "Placement":
        n = len(costs.layers)
        return cls("gpu", [True] * n, [np.ones(lc.n_units, bool) for lc in costs.layers], True)

    def gpu_items(self, costs: ModelCosts, l: int) -> np.ndarray:
        """Neuron (or expert) ids on the GPU in layer l, hottest first."""
        lc = costs.layers[l]
        parts = [lc.order[lc.starts[k]:lc.starts[k + 1]] for k in np.flatnonzero(self.on_gpu[l])]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class LayerEval:
    t_s: float
    attn_s: float
    pred_s: float
    ffn_gpu_s: float
    ffn_cpu_s: float
    sync_s: float
    predictor: str  # gpu | cpu | none (no CPU rows) | off (CPU rows all computed, no predictor)
    gpu_bytes: dict[str, float]
    cpu_bytes: dict[str, float]


@dataclass
class Evaluation:
    """Predicted time per step and bytes per component per device of a placement."""

    time_s: float
    layers: list[LayerEval]
    head_s: float
    fixed_s: float
    gpu_bytes: dict[str, float]
    cpu_bytes: dict[str, float]

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu_bytes.values())

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_bytes.values())


def evaluate(costs: ModelCosts, p: Placement) -> Evaluation:
    """The cost model applied to a placement, written independently of the ILP (tests compare them)."""
    hybrid = p.mode == "hybrid"
    comps = ("attention", "kv_cache", "ffn", "predictors", "lm_head", "embedding", "workspace", "router_shared",
             "expert_cache", "reserve")
    gpu = dict.fromkeys(comps, 0.0)
    cpu = dict.fromkeys(comps, 0.0)
    out = []
    total = costs.fixed_s
    for l, lc in enumerate(costs.layers):
        on = np.asarray(p.on_gpu[l], bool)
        a = bool(p.attn_gpu[l])
        has_cpu = bool((~on).any())
        has_gpu = bool(on.any())
        whole = not has_cpu and lc.whole_bytes is not None and lc.n_units > 0
        g = {"attention": a * lc.attn_bytes, "kv_cache": a * lc.kv_bytes,
             "ffn": lc.whole_bytes if whole else float(lc.unit_bytes[on].sum())}
        h = {"attention": (not a) * lc.attn_host_bytes, "kv_cache": (not a) * lc.kv_bytes,
             "ffn": float(lc.unit_host_bytes[~on].sum())}
        sync = 0.0
        attn_s = lc.attn_gpu_s if a else lc.attn_cpu_s
        if not a and hybrid:
            attn_s += lc.attn_sync_s
            sync += lc.attn_sync_s
        predictor = "none"
        pred_s = 0.0
        off = has_cpu and lc.kind != "moe" and p.pred_off is not None and bool(p.pred_off[l])
        if off:
            predictor = "off"
        elif has_cpu and lc.kind != "moe":
            pg = a or (p.pred_gpu is not None and bool(p.pred_gpu[l]))
            predictor = "gpu" if pg else "cpu"
            pred_s = lc.pred_gpu_s if pg else lc.pred_cpu_s
            if not pg and hybrid:
                pred_s += lc.pred_sync_s
                sync += lc.pred_sync_s
            if pg:
                g["predictors"] = lc.pred_bytes
            else:
                h["predictors"] = lc.pred_host_bytes
        ffn_gpu = (lc.whole_gpu_s if whole else float(lc.unit_gpu_s[on].sum())) + (lc.ffn_gpu_fixed_s if has_gpu else 0.0)
        ffn_cpu = float((lc.unit_all_cpu_s if off else lc.unit_cpu_s)[~on].sum()) + (lc.ffn_cpu_fixed_s if has_cpu else 0.0) \
            + (lc.all_cpu_fixed_s if off else 0.0)
        if has_cpu and hybrid:
            ffn_gpu += lc.hybrid_gpu_s
            ffn_cpu += lc.ffn_sync_s
            sync += lc.ffn_sync_s
        t = attn_s + pred_s + max(ffn_gpu, ffn_cpu)
        total += t
        for k, v in g.items():
            gpu[k] += v
        for k, v in h.items():
            cpu[k] += v
        out.append(LayerEval(t, attn_s, pred_s, ffn_gpu, ffn_cpu, sync, predictor, g, h))
    if p.head_gpu:
        head_s = costs.head_gpu_s
        gpu["lm_head"] = costs.head_bytes
    else:
        head_s = costs.head_cpu_s + (costs.head_sync_s if hybrid else 0.0)
        cpu["lm_head"] = 0.0 if costs.tied else costs.head_host_bytes
    total += head_s
    cpu["embedding"] = costs.embed_bytes
    cpu["reserve"] = costs.host_reserve_bytes
    if p.mode != "cpu":
        gpu["workspace"] = costs.workspace_bytes
        gpu["router_shared"] = costs.moe_gpu_bytes
        gpu["expert_cache"] = costs.expert_cache_bytes
    else:
        cpu["router_shared"] = costs.moe_gpu_bytes
        total += costs.moe_cpu_delta_s
    return Evaluation(total, out, head_s, costs.fixed_s, gpu, cpu)


def without_needless_predictors(costs: ModelCosts, p: Placement) -> Placement:
    """`p` with the predictor turned off in each dense/gated layer with CPU rows whose predictor is
    not allowed (LayerStats.predictor_allowed) or whose step is predicted faster when the CPU computes
    all of its CPU rows than when a predictor first selects some of them: a gated model's predictor
    often selects 85-97% of the rows, and then its own time is not repaid."""
    L = len(costs.layers)
    asked = evaluate(costs, dataclasses.replace(p, pred_off=[False] * L))
    unasked = evaluate(costs, dataclasses.replace(p, pred_off=[True] * L))
    off = [b.predictor == "off" and (not lc.predictor_allowed or b.t_s < a.t_s)
           for lc, a, b in zip(costs.layers, asked.layers, unasked.layers)]
    return dataclasses.replace(p, pred_off=off if any(off) else None)
