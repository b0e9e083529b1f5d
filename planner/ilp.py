"""The placement MILP, built with PuLP (classic `LpVariable` API, pulp>=3,<4) and solved by CBC
(bundled with PuLP) or HiGHS (highspy).

Dense/gated layer l (K neuron blocks in hot-first order; see costs.py for the time model):
  z[l,a,n]  binary   the layer's attention and predictor are on the GPU (a = 1), both on the CPU
                     (a = 0), or the attention on the CPU and the predictor on the GPU (a = 2), and
                     exactly its n hottest blocks are on the GPU (prefix structure), n = 0..K; sum
                     over (a, n) = 1.
                     Block k is on the GPU iff sum_{a, n > k} z[l,a,n] = 1.
  The time of each choice is computed exactly, t = attention + predictor + u with
  u = max(GPU side, CPU side + sync), the sync, predictor and launches only where they apply: the
  constraints t_l >= GPU time and t_l >= CPU time + sync are evaluated per prefix rather than left
  to the solver. With every block on the GPU, a layer the format keeps int4 whole (costs.py
  `whole_bytes`, `whole_gpu_s`) takes those figures instead of the blocks' sums. This
  "multiple-choice" form has the tightest possible LP relaxation per layer (the convex hull of its
  choices) and solves an 80-layer x 100-block model in about a second, where
  the textbook form (block binaries x[l,k] with x[l,k+1] <= x[l,k], a continuous u_l and sync
  indicators) needed up to the time limit in GPU-bound regimes.
MoE layer l (any subset of experts can be on the GPU):
  y[l,e]  binary   expert e on the GPU
  a[l]    binary   attention + KV cache + router + shared expert on the GPU
  c[l]    binary   the layer has CPU experts: c >= 1 - y[l,e]
  u[l]    >= 0     u >= sum GPU experts' time + hybrid launches * c,
                   u >= sum CPU experts' time + (calls + sync) * c
lm_head: h binary. Objective: expected seconds per decode step (in microseconds); constraints:
GPU bytes <= vram, host bytes <= ram (bytes in MiB). Other objectives (least GPU bytes for a RAM
budget, least host bytes for a VRAM budget) serve the "budget too small" messages.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from hotcold.errors import HotcoldError
from hotcold.planner.costs import LayerCosts, ModelCosts
from hotcold.planner.evaluate import Placement

US = 1e6  # objective unit: microseconds
MB = float(1 << 20)  # byte unit in constraints: MiB
MARGIN = 1024.0  # bytes kept below each budget against solver tolerances (greedy keeps it too)
SOLVERS = ("cbc", "highs")


@dataclass
class SolveResult:
    placement: Placement | None
    status: str  # optimal | feasible | infeasible | not solved
    objective: float | None  # seconds per step (objective "time") or bytes
    bound: float | None
    gap: float | None  # relative, (objective - bound) / objective
    solver: str
    time_s: float
    n_vars: int
    n_constraints: int
    build_s: float = 0.0  # of time_s, building the model in PuLP
    log: str = ""  # CBC's log (empty for HiGHS)


def prefix_options(lc: LayerCosts) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """For a in (0, 1, 2) (0: attention and predictor on the CPU, 1: both on the GPU, 2: the attention
    on the CPU, the predictor on the GPU): (a, time_s[n], gpu_bytes[n], host_bytes[n]) of a hybrid
    layer whose n hottest blocks are on the GPU, n = 0..K. Written apart from evaluate.evaluate (tests
    compare them)."""
    K = lc.n_units
    n = np.arange(K + 1)
    gpu_cum = np.concatenate([[0.0], np.cumsum(lc.unit_gpu_s)])
    cpu_rest = np.concatenate([np.cumsum(lc.unit_cpu_s[::-1])[::-1], [0.0]])  # CPU time of blocks n..K-1
    bytes_cum = np.concatenate([[0.0], np.cumsum(lc.unit_bytes)])
    if lc.whole_bytes is not None and K:  # every block on the GPU: the FFN kept int4 whole
        gpu_cum[K], bytes_cum[K] = lc.whole_gpu_s, lc.whole_bytes
    host_cum = np.concatenate([[0.0], np.cumsum(lc.unit_host_bytes)])
    has_cpu = (n < K).astype(float)
    has_gpu = (n > 0).astype(float)
    gpu_side = gpu_cum + lc.ffn_gpu_fixed_s * has_gpu + lc.hybrid_gpu_s * has_cpu
    cpu_side = cpu_rest + (lc.ffn_cpu_fixed_s + lc.ffn_sync_s) * has_cpu
    u = np.maximum(gpu_side, cpu_side)
    ab = lc.attn_bytes + lc.kv_bytes
    out = []
    for a in (0, 1, 2):
        attn_gpu, pred_gpu = a == 1, a >= 1
        attn = lc.attn_gpu_s if attn_gpu else lc.attn_cpu_s + lc.attn_sync_s
        pred = has_cpu * (lc.pred_gpu_s if pred_gpu else lc.pred_cpu_s + lc.pred_sync_s)
        gpu_b = attn_gpu * ab + bytes_cum + (lc.pred_bytes * has_cpu if pred_gpu else 0.0)
        host_b = (not attn_gpu) * (lc.attn_host_bytes + lc.kv_bytes) + (host_cum[-1] - host_cum) + \
            (0.0 if pred_gpu else lc.pred_host_bytes * has_cpu)
        out.append((a, attn + pred + u, gpu_b, host_b))
    return out


def _solver(name: str, time_limit: float, gap: float, threads: int | None, log_path: str | None):
    threads = threads or min(8, os.cpu_count() or 1)
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads, logPath=log_path)
    if name == "highs":
        if not pulp.HiGHS().available():
            raise HotcoldError("--solver highs: highspy is not installed (pip install highspy)")
        return pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=threads)
    raise HotcoldError(f"--solver: unknown solver '{name}' (use {' or '.join(SOLVERS)})")


def solve(costs: ModelCosts, vram: float | None, ram: float | None, solver: str = "cbc", time_limit: float = 8.0,
          gap: float = 5e-3, threads: int | None = None, objective: str = "time",
          warm: Placement | None = None) -> SolveResult:
    """Solve the hybrid placement. vram/ram None: that budget is not constrained.
    objective: "time" (seconds per step), "min_gpu" (GPU bytes) or "min_host" (host bytes).
    warm: a feasible placement for CBC to start from (dense layers' GPU blocks must be a prefix)."""
    with warnings.catch_warnings():  # PuLP 3.3 announces its 4.0 API on every variable
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"pulp(\..*)?")
        return _solve(costs, vram, ram, solver, time_limit, gap, threads, objective, warm)


def _expr(pairs) -> pulp.LpAffineExpression:
    """A linear expression from (variable, coefficient) pairs, summing repeated variables."""
    acc: dict = {}
    for v, w in pairs:
        acc[v] = acc.get(v, 0.0) + w
    return pulp.LpAffineExpression(list(acc.items()))


class _Model:
    """Linear expressions as coefficient lists (much faster to build than PuLP operator chains)."""

    def __init__(self):
        self.time: list = []
        self.gpu: list = []
        self.host: list = []
        self.time_c = 0.0
        self.gpu_c = 0.0
        self.host_c = 0.0


def _solve(costs, vram, ram, solver, time_limit, gap, threads, objective, warm) -> SolveResult:
    t0 = time.perf_counter()
    prob = pulp.LpProblem("hotcold_plan", pulp.LpMinimize)
    m = _Model()
    m.time_c = costs.fixed_s * US
    m.gpu_c = costs.gpu_fixed_bytes / MB
    m.host_c = (costs.host_reserve_bytes + costs.embed_bytes) / MB
    # Dense layers with identical options (a uniform profile, repeated layer types) are interchangeable:
    # one group takes integer counts w[g,a,n] (how many of its layers choose (a, n)), which removes the
    # permutations a solver would otherwise explore. A group of one is the binary z[l,a,n] above.
    groups: dict = {}  # key -> [layers]
    options: dict = {}
    for l, lc in enumerate(costs.layers):
        if lc.kind != "moe":
            opts = prefix_options(lc)
            options[l] = opts
            key = (lc.n_units,) + tuple(np.round(np.concatenate([o[1] * US, o[2], o[3]]), 6).tobytes() for o in opts)
            groups.setdefault(key, []).append(l)
    layer_vars: list = [None] * len(costs.layers)  # ("dense", group id) or ("moe", a, ys, c, g, u)
    group_vars: list = []  # per group: (layers, [(a, n, w)])
    start: dict = {}  # variable -> initial value
    for l, lc in enumerate(costs.layers):
        if lc.kind == "moe":
            layer_vars[l] = _moe_layer(prob, m, l, lc)
    for gi, members in enumerate(groups.values()):
        l = members[0]
        size = len(members)
        ws = []
        for a, t, gb, hb in options[l]:
            for n in range(costs.layers[l].n_units + 1):
                name = f"z_{l}_{a}_{n}" if size == 1 else f"w_{l}_{a}_{n}"
                w = pulp.LpVariable(name, lowBound=0, upBound=size, cat="Binary" if size == 1 else "Integer")
                ws.append((a, n, w))
                m.time.append((w, float(t[n]) * US))
                m.gpu.append((w, float(gb[n]) / MB))
                m.host.append((w, float(hb[n]) / MB))
        prob += pulp.LpAffineExpression([(w, 1) for _, _, w in ws]) == size, f"choose_{l}"
        group_vars.append((members, ws))
        for mem in members:
            layer_vars[mem] = ("dense", gi)
    hd = pulp.LpVariable("h", cat="Binary")
    h_cpu = costs.head_cpu_s + costs.head_sync_s
    m.time.append((hd, (costs.head_gpu_s - h_cpu) * US))
    m.time_c += h_cpu * US
    m.gpu.append((hd, costs.head_bytes / MB))
    if not costs.tied:
        m.host.append((hd, -costs.head_host_bytes / MB))
        m.host_c += costs.head_host_bytes / MB
    # Solvers drop an objective's constant and would then measure their relative gap against the
    # variable part only: the constant rides on a variable fixed to 1, so gaps are of the real total.
    one = pulp.LpVariable("one", lowBound=1, upBound=1)
    terms, const = {"time": (m.time, m.time_c), "min_gpu": (m.gpu, m.gpu_c), "min_host": (m.host, m.host_c)}[objective]
    prob += _expr(terms + [(one, const)])
    # a margin below each budget against solver tolerances, never below the fixed part
    if vram is not None:
        prob += _expr(m.gpu) <= max(vram - MARGIN, costs.gpu_fixed_bytes) / MB - m.gpu_c, "gpu_budget"
    if ram is not None:
        floor = costs.host_reserve_bytes + costs.embed_bytes
        prob += _expr(m.host) <= max(ram - MARGIN, floor) / MB - m.host_c, "host_budget"
    if warm is not None and solver == "cbc":  # (HiGHS 1.16 mis-reports objectives after setSolution)
        start = _start_values(costs, warm, layer_vars, group_vars, hd)
        start[one] = 1
        for v in prob.variables():
            v.setInitialValue(start.get(v, 0))
    n_vars, n_cons = len(prob.variables()), prob.numConstraints()
    fd, log_path = tempfile.mkstemp(prefix="hotcold-cbc-", suffix=".log")
    os.close(fd)
    try:
        s = _solver(solver, time_limit, gap, threads, log_path if solver == "cbc" else None)
        if warm is not None and solver == "cbc":
            s.optionsDict["warmStart"] = True
        build_s = time.perf_counter() - t0
        try:
            with _quiet_stdout():
                prob.solve(s)
        except pulp.PulpSolverError as e:
            raise HotcoldError(f"the {solver} solver failed ({e}); try --solver {'highs' if solver == 'cbc' else 'cbc'}") from None
        log_text = open(log_path, errors="replace").read() if solver == "cbc" else ""
    finally:
        os.unlink(log_path)
    elapsed = time.perf_counter() - t0
    status, sol_status = prob.status, prob.sol_status

    def empty(st):
        return SolveResult(None, st, None, None, None, solver, elapsed, n_vars, n_cons, build_s, log_text)

    if status == pulp.LpStatusInfeasible or sol_status == pulp.LpSolutionInfeasible:
        return empty("infeasible")
    if sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or hd.value() is None:
        return empty("infeasible" if "infeasible" in log_text.lower() else "not solved")
    placement = _placement(costs, layer_vars, group_vars, hd)
    obj = pulp.value(prob.objective) or 0.0
    bound = _bound(prob, solver, log_text, obj)
    g = max(0.0, (obj - bound) / abs(obj)) if bound is not None and obj else None
    optimal = sol_status == pulp.LpSolutionOptimal and status == pulp.LpStatusOptimal
    if "stopped on time" in log_text.lower():
        optimal = False
    if g is None and optimal:
        g = 0.0
    if g is not None:
        optimal = g <= gap + 1e-6
    scale = US if objective == "time" else 1.0 / MB
    return SolveResult(placement, "optimal" if optimal else "feasible", obj / scale,
                       None if bound is None else bound / scale, g, solver, elapsed, n_vars, n_cons, build_s, log_text)


def _moe_layer(prob, m: _Model, l: int, lc: LayerCosts):
    K = lc.n_units
    ys = [pulp.LpVariable(f"y_{l}_{k}", cat="Binary") for k in range(K)]
    a = pulp.LpVariable(f"a_{l}", cat="Binary")
    c = pulp.LpVariable(f"c_{l}", cat="Binary")  # binary, although implied: a strong variable to branch on
    g = pulp.LpVariable(f"g_{l}", cat="Binary")  # any expert on the GPU (its kernels' launches)
    u = pulp.LpVariable(f"u_{l}", lowBound=0)
    for k in range(K):
        prob += pulp.LpAffineExpression([(c, 1), (ys[k], 1)]) >= 1, f"cpu_{l}_{k}"
        prob += pulp.LpAffineExpression([(g, 1), (ys[k], -1)]) >= 0, f"gpu_{l}_{k}"
    # u >= sum_k y_k G_k + fixed * g + hybrid * c
    gpu_side = [(ys[k], float(lc.unit_gpu_s[k]) * US) for k in range(K)] + [(c, lc.hybrid_gpu_s * US),
                                                                            (g, lc.ffn_gpu_fixed_s * US)]
    prob += _expr([(u, 1)] + [(v, -w) for v, w in gpu_side]) >= 0, f"u_gpu_{l}"
    # u >= sum_k (1 - y_k) C_k + (calls + sync) * c
    cpu_side = [(ys[k], -float(lc.unit_cpu_s[k]) * US) for k in range(K)] + \
        [(c, (lc.ffn_cpu_fixed_s + lc.ffn_sync_s) * US)]
    prob += _expr([(u, 1)] + [(v, -w) for v, w in cpu_side]) >= float(lc.unit_cpu_s.sum()) * US, \
        f"u_cpu_{l}"
    a_cpu = lc.attn_cpu_s + lc.attn_sync_s
    m.time += [(a, (lc.attn_gpu_s - a_cpu) * US), (u, 1.0)]
    m.time_c += a_cpu * US
    ab = (lc.attn_bytes + lc.kv_bytes) / MB
    abh = (lc.attn_host_bytes + lc.kv_bytes) / MB
    m.gpu += [(a, ab)] + [(ys[k], float(lc.unit_bytes[k]) / MB) for k in range(K)]
    m.host += [(a, -abh)] + [(ys[k], -float(lc.unit_host_bytes[k]) / MB) for k in range(K)]
    m.host_c += abh + float(lc.unit_host_bytes.sum()) / MB
    return ("moe", a, ys, c, g, u)


def _placement(costs: ModelCosts, layer_vars, group_vars, hd) -> Placement:
    chosen = []  # per group: the (a, n) choices, one per member layer, in option order
    for members, ws in group_vars:
        picks = []
        for a, n, w in ws:
            picks += [(a, n)] * int(round(w.value() or 0.0))
        if len(picks) != len(members):
            raise HotcoldError("internal: the solver's choices do not cover every layer; report this")
        chosen.append(iter(picks))
    attn, pred, on = [], [], []
    for lc, lv in zip(costs.layers, layer_vars):
        if lv[0] == "dense":
            a, n = next(chosen[lv[1]])  # a: prefix_options' code
            attn.append(a == 1)
            pred.append(a >= 1)
            on.append(np.arange(lc.n_units) < n)
        else:
            _, a, ys, _, _, _ = lv
            attn.append((a.value() or 0.0) > 0.5)
            pred.append(attn[-1])
            on.append(np.array([(y.value() or 0.0) > 0.5 for y in ys], bool))
    return Placement("hybrid", attn, on, (hd.value() or 0.0) > 0.5, pred)


def _start_values(costs: ModelCosts, warm: Placement, layer_vars, group_vars, hd) -> dict:
    """Initial values of every variable from a feasible placement (CBC's -mips start)."""
    from hotcold.planner.evaluate import evaluate

    ev = evaluate(costs, Placement("hybrid", warm.attn_gpu, warm.on_gpu, warm.head_gpu, warm.pred_gpu))
    vals: dict = {hd: int(bool(warm.head_gpu))}
    for members, ws in group_vars:
        counts: dict = {}
        for l in members:
            n = int(np.cumprod(np.asarray(warm.on_gpu[l], bool)).sum())  # the prefix part of the start
            pg = warm.pred_gpu is not None and bool(warm.pred_gpu[l])
            key = (1 if warm.attn_gpu[l] else 2 if pg else 0, n)  # prefix_options' code
            counts[key] = counts.get(key, 0) + 1
        for a, n, w in ws:
            vals[w] = counts.get((a, n), 0)
    for l, lv in enumerate(layer_vars):
        if lv[0] == "moe":
            on = np.asarray(warm.on_gpu[l], bool)
            _, av, ys, c, g, u = lv
            vals[av] = int(bool(warm.attn_gpu[l]))
            for k, y in enumerate(ys):
                vals[y] = int(on[k])
            vals[c] = int((~on).any())
            vals[g] = int(on.any())
            le = ev.layers[l]
            vals[u] = max(le.ffn_gpu_s, le.ffn_cpu_s) * US * (1 + 1e-9)
    return vals


@contextlib.contextmanager
def _quiet_stdout():
    """Silence what native solvers print on file descriptor 1 (HiGHS prints a banner regardless of msg)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _bound(prob, solver: str, log_text: str, obj: float) -> float | None:
    """The solver's best lower bound on the objective, when it reports one."""
    if solver == "highs":
        try:
            b = float(prob.solverModel.getInfo().mip_dual_bound)
            return b if math.isfinite(b) else None
        except Exception:
            return None
    if re.search(r"Result - Optimal solution found(?! \(within gap)", log_text):
        return obj
    found = re.findall(r"Lower bound:\s*([-+0-9.eE]+)", log_text)  # CBC's final bound (printed on stops)
    if found:
        return float(found[-1])
    found = re.findall(r"Exiting as integer gap of ([-+0-9.eE]+)", log_text)  # stopped on the gap
    if found:
        return obj - float(found[-1])
    found = re.findall(r"best possible ([-+0-9.eE]+)", log_text)  # the last progress line
    if found:
        return float(found[-1])
    return None
