"""Making a plan: choose the mode, solve the ILP, check budgets, explain, and build the artifact's contents.

Modes:
  gpu     the whole model (weights, KV cache for --ctx, lm_head, workspace) fits in --vram: everything on
          the GPU, no predictors, no CPU work. Chosen whenever it fits. (For a very sparse model the cost
          model can predict a split faster, since GPU rows are read densely and CPU rows only when
          active; the plan then says so in a note, and a smaller --vram gets the split.)
  cpu     --vram 0, or no CUDA GPU in the hardware profile: everything on the CPU, no syncs. (Without
          CUDA the runtime's "GPU" tier is the CPU device itself, so a split would only add copies;
          plan for another machine with --hardware h200|rtx4090|FILE.)
  hybrid  the ILP's placement, unless the all-CPU plan is predicted faster (tiny budgets: a hybrid
          layer pays a round trip), in which case the all-CPU plan is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hotcold.errors import HotcoldError
from hotcold.planner.costs import Constants, ModelCosts, build_costs
from hotcold.planner.evaluate import Evaluation, Placement, evaluate, without_needless_predictors
from hotcold.planner.weight_format import WeightFormat
from hotcold.planner.greedy import greedy
from hotcold.planner.ilp import SolveResult, solve
from hotcold.planner.hardware import HardwareProfile
from hotcold.planner.sizes import format_size, size_arg


class BudgetError(HotcoldError):
    """The budgets cannot hold the mandatory parts; the message says the least that would work."""


@dataclass
class PlanRequest:
    vram: int
    ram: int
    ctx: int
    fmt: WeightFormat
    batch: int = 1
    block_size: int = 0  # 0: auto
    solver: str = "cbc"
    time_limit: float = 8.0
    gap: float = 5e-3
    threads: int | None = None
    explain: bool = False
    constants: Constants = field(default_factory=Constants)


@dataclass
class PlanResult:
    mode: str
    costs: ModelCosts
    placement: Placement
    evaluation: Evaluation
    solve: SolveResult | None = None
    greedy: tuple[Placement, Evaluation] | None = None
    all_cpu: Evaluation | None = None
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.costs.batch / self.evaluation.time_s


def _fits(ev: Evaluation, vram: float | None, ram: float | None) -> bool:
    return (vram is None or ev.gpu_total <= vram) and (ram is None or ev.cpu_total <= ram)


def make_plan(cfg, stats, hw: HardwareProfile, req: PlanRequest) -> PlanResult:
    """Place the model within the budgets; raise BudgetError when nothing fits."""
    t0 = time.perf_counter()
    costs = build_costs(cfg, stats, hw, req.fmt, req.ctx, req.batch, req.block_size, req.constants)
    notes: list[str] = []
    vram, ram = float(req.vram), float(req.ram)
    cpu_p = without_needless_predictors(costs, Placement.all_cpu(costs))
    cpu_ev = evaluate(costs, cpu_p)
    cpu_ok = cpu_ev.cpu_total <= ram

    def all_cpu(reason: str | None) -> PlanResult:
        if not cpu_ok:
            hint = " or give the GPU a share with --vram" if costs.has_gpu else ""
            raise BudgetError(f"--ram {format_size(ram)} cannot hold the model for an all-CPU plan: it needs "
                              f"--ram {size_arg(cpu_ev.cpu_total)}{hint}")
        if reason:
            notes.append(reason)
        return PlanResult("cpu", costs, cpu_p, cpu_ev, all_cpu=cpu_ev, notes=notes, elapsed_s=time.perf_counter() - t0)

    if not costs.has_gpu:
        return all_cpu("no CUDA GPU in the hardware profile: all-CPU plan (plan for another machine with "
                       "--hardware h200|rtx4090|FILE)" if vram > 0 else None)
    if vram <= 0:
        return all_cpu(None)
    if vram < costs.gpu_fixed_bytes:
        what = "GPU workspace and CUDA context" + (", MoE routers and shared experts" if costs.moe_gpu_bytes else "")
        raise BudgetError(f"--vram {format_size(vram)} cannot hold the {what} ({format_size(costs.gpu_fixed_bytes)}"
                          f" at batch {costs.batch}): use --vram {size_arg(costs.gpu_fixed_bytes)} or more, or --vram 0 "
                          "for an all-CPU plan")
    if hw.gpu_free_bytes and vram > hw.gpu_free_bytes and hw.source == "measured":
        notes.append(f"--vram {format_size(vram)} is more than the GPU's free memory now ({format_size(hw.gpu_free_bytes)})")
    gpu_p = Placement.all_gpu(costs)
    gpu_ev = evaluate(costs, gpu_p)
    if gpu_ev.gpu_total <= vram:
        if gpu_ev.cpu_total > ram:
            raise BudgetError(f"--ram {format_size(ram)} cannot hold the embedding table and runtime reserve: it needs "
                              f"--ram {size_arg(gpu_ev.cpu_total)}")
        result = PlanResult("gpu", costs, gpu_p, gpu_ev, all_cpu=cpu_ev if cpu_ok else None, notes=notes)
        if req.explain:
            result.greedy = (gpu_p, gpu_ev)
        # The rule is all-GPU whenever it fits. With the GPU computing its rows densely, a very sparse
        # model can be predicted faster split (cold rows read by the CPU only when active): say so.
        res = solve(costs, vram, ram, req.solver, req.time_limit, req.gap, req.threads)
        if res.placement is not None:
            split = evaluate(costs, res.placement)
            if split.time_s < gpu_ev.time_s * 0.99:
                notes.append(f"the whole model fits, so it is all on the GPU; a split would be predicted "
                             f"{gpu_ev.time_s / split.time_s:.2f}x faster (the GPU reads all its rows, the CPU only "
                             f"active ones): pass a smaller --vram to get it")
        result.elapsed_s = time.perf_counter() - t0
        return result
    g = greedy(costs, vram)
    g_ev = evaluate(costs, g)
    res = solve(costs, vram, ram, req.solver, req.time_limit, req.gap, req.threads, warm=g if _fits(g_ev, vram, ram) else None)
    if res.placement is None:
        if res.status != "infeasible":
            raise HotcoldError(f"the {req.solver} solver found no placement within --time-limit {req.time_limit:g} s; "
                               "raise --time-limit or --block")
        raise _budget_error(costs, vram, ram, req)
    ev = evaluate(costs, res.placement)
    if _fits(g_ev, vram, ram) and g_ev.time_s < ev.time_s:  # a solver stopped within its gap may return less
        res.placement, ev = g, g_ev
        notes.append("the solver stopped within its gap at a placement no better than greedy's: kept greedy's")
    if ev.gpu_total > vram or ev.cpu_total > ram:  # the solver's tolerances must never cross a budget
        raise HotcoldError(f"internal: the solver's placement exceeds the budget (GPU {ev.gpu_total:.0f} B, "
                           f"host {ev.cpu_total:.0f} B); report this")
    if not _fits(g_ev, vram, ram):
        notes.append(f"greedy placement would need {format_size(g_ev.cpu_total)} of host RAM (over --ram)")
    placement = without_needless_predictors(costs, res.placement)  # only removes bytes: still within budget
    ev = evaluate(costs, placement)
    result = PlanResult("hybrid", costs, placement, ev, solve=res, all_cpu=cpu_ev if cpu_ok else None, notes=notes)
    if req.explain:
        result.greedy = (g, g_ev)
    if cpu_ok and cpu_ev.time_s < ev.time_s:
        notes.append(f"the all-CPU plan is predicted faster than any split at --vram {format_size(vram)} "
                     f"({costs.batch / cpu_ev.time_s:.2f} vs {costs.batch / ev.time_s:.2f} tok/s): writing the all-CPU plan")
        result.mode, result.placement, result.evaluation = "cpu", cpu_p, cpu_ev
    result.elapsed_s = time.perf_counter() - t0
    return result


def _budget_error(costs: ModelCosts, vram: float, ram: float, req: PlanRequest) -> BudgetError:
    """The RAM budget cannot hold what stays on the CPU: say the least RAM at this VRAM, and the least VRAM
    at this RAM."""
    tl = max(2.0, req.time_limit / 2)
    need_ram = solve(costs, vram, None, req.solver, tl, 1e-4, req.threads, objective="min_host")
    need_vram = solve(costs, None, ram, req.solver, tl, 1e-4, req.threads, objective="min_gpu")
    msg = f"--ram {format_size(ram)} cannot hold what stays on the CPU"
    margin = 2048  # the ILP keeps 1 KiB below each budget
    if need_ram.objective is not None:
        msg += f": with --vram {size_arg(vram)} it needs --ram {size_arg(need_ram.objective + margin)}"
    if need_vram.objective is not None:
        msg += f"; with --ram {size_arg(ram)} it needs --vram {size_arg(need_vram.objective + margin)}"
    else:
        least = costs.host_reserve_bytes + costs.embed_bytes
        msg += f"; even with the whole model on the GPU it needs --ram {size_arg(least)}"
    return BudgetError(msg)


# ------------------------------------------------------------------------------------------- artifact contents
def plan_tensors(result: PlanResult) -> dict[str, np.ndarray]:
    costs, p = result.costs, result.placement
    L = len(costs.layers)
    t: dict[str, np.ndarray] = {
        "attention_gpu": np.array(p.attn_gpu, np.uint8),
        "predictor_gpu": np.array([le.predictor == "gpu" for le in result.evaluation.layers], np.uint8),
        "predictor_off": np.array([le.predictor == "off" for le in result.evaluation.layers], np.uint8),
        "lm_head_gpu": np.array([int(p.head_gpu)], np.uint8),
    }
    counts = np.zeros(L, np.int32)
    for l, lc in enumerate(costs.layers):
        ids = p.gpu_items(costs, l).astype(np.int32)
        counts[l] = len(ids)
        if lc.kind == "moe":
            t[f"layers.{l}.expert_order"] = lc.order.astype(np.int32)
            t[f"layers.{l}.gpu_experts"] = ids
        else:
            t[f"layers.{l}.neuron_order"] = lc.order.astype(np.int32)
            t[f"layers.{l}.gpu_neurons"] = ids
    t["gpu_count"] = counts
    return t


def _us(s: float) -> float:
    return round(s * 1e6, 3)


def _bytes_table(d: dict[str, float]) -> dict:
    out = {k: int(round(v)) for k, v in d.items() if v}
    out["total"] = int(round(sum(d.values())))
    return out


def plan_json(result: PlanResult, req: PlanRequest, *, fingerprint: str, model: Path, model_type: str,
              hw: HardwareProfile, hw_file: Path | None, profile_source: str, sparsity: float | None) -> dict:
    costs, p, ev = result.costs, result.placement, result.evaluation
    layers = []
    for l, (lc, le) in enumerate(zip(costs.layers, ev.layers)):
        ids = p.gpu_items(costs, l)
        n_items = lc.n_items
        entry = {"layer": l, "kind": lc.kind, "attention": "gpu" if p.attn_gpu[l] else "cpu",
                 "predictor": le.predictor}
        if lc.kind == "moe":
            gu4, dn4 = req.fmt.experts_int4(l)
            entry.update(experts=n_items, gpu_experts=[int(i) for i in ids],
                         experts_int4=[w for w, q4 in (("gate", gu4), ("up", gu4), ("down", dn4)) if q4])
        else:
            entry.update(neurons=n_items, gpu_neurons=int(len(ids)), gpu_fraction=round(len(ids) / max(1, n_items), 4),
                         int4_whole=bool(lc.whole_bytes is not None and len(ids) == n_items))
        entry["gpu_activation_share"] = round(_share(lc, p.on_gpu[l]), 4)
        entry.update(kv_s_per_position=lc.kv_pos_gpu_s if p.attn_gpu[l] else lc.kv_pos_cpu_s,
                     kv_positions=lc.kv_pos, kv_window=lc.kv_len)
        entry.update(time_us=_us(le.t_s), attention_us=_us(le.attn_s), predictor_us=_us(le.pred_s),
                     ffn_gpu_us=_us(le.ffn_gpu_s), ffn_cpu_us=_us(le.ffn_cpu_s), sync_us=_us(le.sync_s),
                     gpu_bytes=int(round(sum(le.gpu_bytes.values()))), cpu_bytes=int(round(sum(le.cpu_bytes.values()))))
        layers.append(entry)
    step = ev.time_s
    breakdown = {
        # (the round trips of CPU attention and predictors are on the sync line)
        "attention": sum(le.attn_s - (lc.attn_sync_s if not p.attn_gpu[i] and result.mode == "hybrid" else 0.0)
                         for i, (lc, le) in enumerate(zip(costs.layers, ev.layers))),
        "predictors": sum(le.pred_s - (lc.pred_sync_s if le.predictor == "cpu" and result.mode == "hybrid" else 0.0)
                          for lc, le in zip(costs.layers, ev.layers)),
        "ffn": sum(max(le.ffn_gpu_s, le.ffn_cpu_s) for le in ev.layers),
        "lm_head": ev.head_s,
        "fixed": ev.fixed_s,
    }
    sync_total = sum(le.sync_s for le in ev.layers)
    hw_keys = ("hostname", "source", "cuda", "gpu_name", "gpu_gemv_Bps", "h2d_pinned_Bps", "d2h_pinned_Bps",
               "roundtrip_s", "launch_s", "thread_handoff_s", "cpu_threads", "cpu_kernel", "cpu_call_s")
    hardware = {k: getattr(hw, k) for k in hw_keys}
    hardware["cpu_ffn_Bps"] = hw.cpu_ffn(req.fmt.cpu_kind)
    hardware["cpu_dense_Bps"] = hw.cpu_dense(req.fmt.cpu_kind)
    hardware["file"] = str(hw_file) if hw_file else None
    out = {
        "format": "1",
        "fingerprint": fingerprint,
        "model": str(model),
        "model_type": model_type,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": result.mode,
        "budget": {"vram_bytes": int(req.vram), "ram_bytes": int(req.ram), "vram": format_size(req.vram),
                   "ram": format_size(req.ram), "ctx": req.ctx, "batch": costs.batch,
                   "expert_cache_bytes": int(costs.expert_cache_bytes) if result.mode == "hybrid" else 0},
        "weights": {"format": req.fmt.name, "bytes_per_weight": req.fmt.bytes_per_weight,
                    "host_bytes_per_weight": req.fmt.host_w, "host_ffn_bytes_per_weight": req.fmt.host_ffn_w,
                    "host_embed_bytes_per_weight": req.fmt.host_embed_w,
                    "cpu_kind": req.fmt.cpu_kind, "kv_bytes_per_value": req.fmt.kv_bytes,
                    "gpu_attn_bytes_per_weight": req.fmt.gpu_attn_w,
                    "gpu_ffn_bytes_per_weight": req.fmt.gpu_ffn_w, "gpu_down_bytes_per_weight": req.fmt.gpu_down_w,
                    "gpu_int4": req.fmt.gpu_int4,
                    "gpu_int4_down": req.fmt.gpu_down_w < req.fmt.bytes_per_weight},
        "block_size": costs.block_size,
        "hardware": hardware,
        "profile": {"source": profile_source, "assumed_sparsity": sparsity},
        "solver": _solver_json(result, req),
        "bytes": {"gpu": _bytes_table(ev.gpu_bytes) if result.mode != "cpu" else {"total": 0},
                  "cpu": _bytes_table(ev.cpu_bytes)},
        "lm_head": "gpu" if p.head_gpu else "cpu",
        "embedding": "cpu",
        "predicted": {
            "time_per_step_s": step,
            "time_per_token_s": step / costs.batch,
            "tokens_per_s": costs.batch / step,
            "breakdown_s": breakdown,
            "sync_s": sync_total,
            "cpu_ffn_bound_layers": sum(1 for le in ev.layers if le.ffn_cpu_s > le.ffn_gpu_s),
        },
        "alternatives": {},
        "notes": result.notes,
        "cost_constants": req.constants.to_dict(),
        "layers": layers,
    }
    if result.all_cpu is not None:
        out["alternatives"]["all_cpu_tokens_per_s"] = costs.batch / result.all_cpu.time_s
    if result.greedy is not None:
        g_ev = result.greedy[1]
        out["alternatives"]["greedy"] = {
            "tokens_per_s": costs.batch / g_ev.time_s, "time_per_step_s": g_ev.time_s,
            "gpu_bytes": int(g_ev.gpu_total), "cpu_bytes": int(g_ev.cpu_total),
            "fits": bool(g_ev.gpu_total <= req.vram and g_ev.cpu_total <= req.ram),
            "speedup_of_plan": g_ev.time_s / step,
        }
    return out


def _share(lc, on) -> float:
    """Fraction of the layer's expected activations (or routings) served by its GPU units."""
    tot = 0.0
    got = 0.0
    for k in range(lc.n_units):
        w = lc.unit_freq[k] * (lc.starts[k + 1] - lc.starts[k])
        tot += w
        if on[k]:
            got += w
    return got / tot if tot > 0 else 0.0


def _solver_json(result: PlanResult, req: PlanRequest) -> dict:
    r = result.solve
    if r is None:
        reason = {"gpu": "not run: the whole model fits on the GPU", "cpu": "not run: all-CPU plan"}[result.mode]
        return {"name": None, "status": reason, "time_limit_s": req.time_limit, "gap_limit": req.gap}
    return {"name": r.solver, "status": r.status, "gap": r.gap, "objective_s": r.objective, "bound_s": r.bound,
            "time_s": round(r.time_s, 3), "build_s": round(r.build_s, 3), "variables": r.n_vars,
            "constraints": r.n_constraints, "time_limit_s": req.time_limit, "gap_limit": req.gap,
            "chosen": result.mode == "hybrid"}
