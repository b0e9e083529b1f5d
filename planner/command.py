"""`hotcold probe` and `hotcold plan`: measure this machine, place a model's units on GPU and CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from hotcold.errors import HotcoldError


def probe(
    force: bool = typer.Option(False, "--force", help="Measure again even if this machine has a cached profile."),
    quick: bool = typer.Option(False, "--quick", help="Small sizes: a rough profile in a few seconds (tests)."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads to measure the kernels "
                                          "with (default: what `run` takes here: one a physical core; with a GPU, "
                                          "two fewer than the CPUs at most). To plan for another count: `probe --threads N --json "
                                          "> hw.json`, then `plan --hardware hw.json`."),
) -> None:
    """Measure this machine's GPU, CPU kernels and PCIe once; the result is cached per host for `plan`."""
    from rich.console import Console

    from hotcold.planner.hardware import hardware_path
    from hotcold.planner.probe import load_hardware

    err = Console(stderr=True)
    log = (lambda m: err.print(f"[dim]{m}[/dim]")) if not as_json else None
    if log and (force or not hardware_path().is_file()):
        err.print("measuring this machine (about 10 s)...")
    hw, path, measured = load_hardware(None, force=force, quick=quick, log=log, threads=threads)
    if hw.busy_warning():
        err.print(f"[yellow]warning: {hw.busy_warning()}[/yellow]")
    if as_json:
        print(hw.to_json(), end="")
        return
    _print_hardware(hw, path, measured)


def _print_hardware(hw, path, measured: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hardware profile", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for k, v in hw.summary_rows():
        table.add_row(k, v)
    console = Console()
    console.print(table)
    how = f"measured in {hw.probe_s:.1f} s" if measured else "cached (--force to measure again)"
    console.print(f"{path} ({how})")


def plan(
    model: Optional[Path] = typer.Argument(None, help="HF model folder or .gguf file (default: the embedded Gemma 3 270M)"),
    vram: Optional[str] = typer.Option(None, "--vram", help="GPU memory hotcold may use: 8GiB, 512MiB, 8G, 0 "
                                                            "(all-CPU). Default: the GPU's free memory, 0 without CUDA."),
    ram: Optional[str] = typer.Option(None, "--ram", help="Host memory hotcold may use (default: available RAM)."),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=1, help="Context length the KV cache must hold "
                                                                 "(default: the model's, up to 4096)."),
    batch: Optional[int] = typer.Option(None, "--batch", min=1, help="Sequences decoded together: the budget "
                                        "holds their KV caches (--ctx each) and `hotcold serve` decodes as many "
                                        "together by default (default: 1, and serve's own default)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight storage at run time: bf16, f16, f32 or i8."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="profile.safetensors or its folder "
                                                                   "(default: the model's own)."),
    uniform: bool = typer.Option(False, "--uniform", help="No profile: every neuron fires with probability "
                                                          "1 - --assume-sparsity (smoke tests)."),
    assume_sparsity: float = typer.Option(0.9, "--assume-sparsity", min=0.0, max=1.0,
                                          help="With --uniform: fraction of neurons inactive per token."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="Plan for another machine: h200, rtx4090, or a "
                                                                    "JSON file from `hotcold probe` (default: this one)."),
    solver: str = typer.Option("cbc", "--solver", help="cbc (bundled with PuLP) or highs (highspy)."),
    block: int = typer.Option(0, "--block", min=0, help="Neurons per placement block (0: about 8192 blocks in all, "
                                                        "16-128 per layer)."),
    time_limit: float = typer.Option(8.0, "--time-limit", min=0.1, help="Solver time limit in seconds."),
    gap: float = typer.Option(0.005, "--gap", min=0.0, max=1.0, help="Relative optimality gap at which to stop."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Solver threads (default: up to 8)."),
    workspace: Optional[str] = typer.Option(None, "--workspace", help="GPU workspace to keep free (default 256MiB "
                                                                      "plus per-token activations)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Plan for `hotcold run --quantize q8_0|q4_0|q4_k` "
                                                                    "(an HF checkpoint quantised at load)."),
    gpu_int4: Optional[bool] = typer.Option(None, "--gpu-int4/--no-gpu-int4", help="Keep a quantised model's "
                                            "Q4_0/Q4_1/Q4_K attention and hot FFN up/gate rows 4-bit on the GPU "
                                            "(torch's int4 kernels), or expand them to --dtype. Default: whichever "
                                            "plan is predicted faster, where the GPU runs the int4 kernels (the run "
                                            "follows the plan)."),
    expert_cache: Optional[str] = typer.Option(None, "--expert-cache", help="MoE models: GPU memory within --vram for "
                                               "the expert cache that look-ahead prefetch fills (e.g. 1GiB; default 0)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Artifact folder (default: MODEL.hotcold beside the model)."),
    explain: bool = typer.Option(False, "--explain", help="Compare with the greedy hottest-neurons-first placement."),
    as_json: bool = typer.Option(False, "--json", help="Print plan.json instead of the table."),
) -> None:
    """Place every layer's neurons or experts, attention and KV cache on the GPU or CPU for the fastest decode."""
    import dataclasses

    from rich.console import Console

    from hotcold.artifacts import artifact_dir
    from hotcold.models.loader import default_model_path, describe_model
    from hotcold.planner.costs import Constants, expert_stream_budget
    from hotcold.planner.weight_format import weight_format
    from hotcold.planner.inputs import model_format, predictors_within_budget, read_profile, uniform_stats
    from hotcold.profiler.artifact import find_profile
    from hotcold.planner.make import PlanRequest, plan_json, plan_tensors
    from hotcold.planner.plan import write_plan
    from hotcold.planner.hardware import PRESETS
    from hotcold.planner.probe import load_hardware
    from hotcold.planner.sizes import parse_size

    err = Console(stderr=True)
    fmt = weight_format(dtype)
    if solver not in ("cbc", "highs"):
        raise HotcoldError(f"--solver: unknown solver '{solver}' (use cbc or highs)")
    # sizes first: a mistyped size is reported before any missing profile or measurement of this machine
    sizes = {flag: parse_size(v, flag) for flag, v in (("--vram", vram), ("--ram", ram), ("--workspace", workspace),
                                                       ("--expert-cache", expert_cache)) if v is not None}
    if hardware is not None and hardware not in PRESETS and not Path(hardware).expanduser().is_file():
        raise HotcoldError(f"--hardware: '{hardware}' is neither a preset ({', '.join(PRESETS)}) nor a file; "
                           "`hotcold probe --json > FILE` writes one")
    path = (model if model is not None else default_model_path()).expanduser()
    info = describe_model(path)
    cfg = info.config
    if quantize is not None:
        from hotcold.models.quantized import QUANTIZE_TYPES

        if quantize not in QUANTIZE_TYPES:
            raise HotcoldError(f"--quantize: unknown type '{quantize}' (use {', '.join(QUANTIZE_TYPES)})")
        if info.path.is_file():
            raise HotcoldError(f"--quantize applies to HF checkpoints; {info.path.name} is a GGUF file and runs in "
                               "its own quantisation")
    # a quantised model: its host side in blocks; int4: its 4-bit matrices also kept int4 on the GPU
    fmt, int4 = [model_format(info.path, fmt, quantize, gpu_int4=g, moe=getattr(cfg, "num_experts", 0) > 0)
                 for g in (False, True)]
    pred_off_reason = None
    if uniform:
        stats, source, sparsity = uniform_stats(cfg, assume_sparsity), "uniform", assume_sparsity
    else:
        prof = find_profile(info.path, info.fingerprint, profile)
        if prof is None or not prof.is_file():
            where = f" at {prof}" if prof is not None else ""
            raise HotcoldError(f"{info.path}: no profile{where}; run `hotcold profile {info.path}` first "
                               "(or plan with an assumed sparsity: --uniform --assume-sparsity 0.9)")
        stats, prof_meta = read_profile(prof, cfg, info.fingerprint)
        source, sparsity = str(prof), None
        if not prof_meta.get("predictors") and not (prof.parent / "predictors.safetensors").is_file():
            for st in stats:  # nothing to place on the CPU: a split would compute every cold row anyway
                st.predictor_allowed = False
            pred_off_reason = ("the profile has no predictors (profiled with --no-predictors): every CPU neuron is "
                               f"computed, exactly (`hotcold profile {info.path}` trains them)")
        elif not predictors_within_budget(prof_meta):
            pm = prof_meta["predictors"]
            pred_off_reason = (f"the profile's predictors raise held-out perplexity {pm['heldout_ppl_rise']:+.2%}, over "
                               f"its {prof_meta['ppl_budget']:.0%} budget: every CPU neuron is computed, exactly "
                               "(`hotcold profile --recall 0.99` may train predictors within it)")
    hw, hw_file, measured = load_hardware(
        hardware, log=(lambda m: err.print(f"[dim]{m}[/dim]")) if not as_json else None)
    if measured and not as_json:
        err.print(f"[dim]measured this machine once; cached in {hw_file}[/dim]")
    if hw.busy_warning():
        err.print(f"[yellow]warning: {hw.busy_warning()}[/yellow]")
    vram_b = sizes["--vram"] if vram is not None else (
        int(hw.gpu_free_bytes * 0.95) if hw.cuda and hw.gpu_free_bytes else 0)
    ram_b = sizes["--ram"] if ram is not None else int(hw.ram_available_bytes)
    ctx_n = ctx if ctx is not None else min(cfg.max_position_embeddings, 4096)
    constants = Constants(expert_stream_bytes=expert_stream_budget(vram_b))
    if workspace is not None:
        constants = dataclasses.replace(constants, workspace_bytes=sizes["--workspace"])
    if expert_cache is not None:
        constants = dataclasses.replace(constants, expert_cache_bytes=sizes["--expert-cache"])
    req = PlanRequest(vram=vram_b, ram=ram_b, ctx=ctx_n, fmt=fmt, batch=batch or 1, block_size=block, solver=solver,
                      time_limit=time_limit, gap=gap, threads=threads, explain=explain, constants=constants)
    result, req, choice, line = _plan_gpu_weights(cfg, stats, hw, req, int4, gpu_int4, measured)
    if line and not as_json:
        err.print(f"[dim]{line}[/dim]")
    meta = plan_json(result, req, fingerprint=info.fingerprint, model=info.path, model_type=cfg.model_type, hw=hw,
                     hw_file=hw_file, profile_source=source, sparsity=sparsity)
    meta["weights"]["gpu_int4_choice"] = choice
    meta["budget"]["batch_set"] = batch is not None  # serve's --parallel default follows a chosen batch only
    if pred_off_reason and any(le["predictor"] == "off" for le in meta["layers"]):
        meta["predictors_off_reason"] = pred_off_reason
    folder = artifact_dir(info.path, info.fingerprint, out)
    paths = write_plan(folder, plan_tensors(result), meta)
    if as_json:
        print(json.dumps(meta, indent=1))
        return
    print_plan(result, meta, paths[1])


# ------------------------------------------------------------------------------------------- int4 or expanded
def _int4_unavailable(hw, measured: bool) -> str | None:
    """Why the plan's hardware cannot run torch's int4 kernels; None if it can. The presets (H200,
    RTX 4090: compute capability >= 8.0) can; torch answers for this machine; a profile of another
    machine cannot be checked here."""
    import socket

    if hw.source.startswith("preset:"):
        return None
    if measured or hw.hostname == socket.gethostname():
        from hotcold.sparse_ops.gpu_quant import cuda_int4_available

        return None if cuda_int4_available() else "torch's int4 kernels do not run on this GPU"
    return (f"the hardware profile of {hw.hostname or 'another machine'}: whether its GPU runs the int4 kernels "
            "cannot be checked here; --gpu-int4 plans int4 for it")


def _faster(a, b) -> bool:
    """Whether plan a beats plan b: predicted faster per token; within 0.5%, fewer GPU bytes."""
    ta, tb = a.evaluation.time_s, b.evaluation.time_s
    if abs(ta - tb) <= 0.005 * max(ta, tb):
        return a.evaluation.gpu_total < b.evaluation.gpu_total
    return ta < tb


def _plan_gpu_weights(cfg, stats, hw, req, int4, gpu_int4: bool | None, measured: bool):
    """make_plan with a quantised model's 4-bit matrices expanded to the dtype on the GPU (req.fmt) or
    kept int4 (format int4): as --gpu-int4 / --no-gpu-int4 say, else both plans and the better
    (_faster), where the model has 4-bit matrices, the plan a GPU and its hardware the int4 kernels.
    Returns (result, its request, plan.json's weights.gpu_int4_choice, a line for the user or None)."""
    import dataclasses

    from hotcold.planner.make import BudgetError, make_plan

    def plan_with(kept_int4: bool):
        r = dataclasses.replace(req, fmt=int4) if kept_int4 else req
        return make_plan(cfg, stats, hw, r), r

    def choice(mode: str, **tok_s) -> dict:
        return {"mode": mode, "int4_tok_s": tok_s.get("int4"), "expanded_tok_s": tok_s.get("expanded")}

    if gpu_int4 is not None:
        result, r = plan_with(gpu_int4)
        kind = "int4" if r.fmt.gpu_int4 else "expanded"
        flag = "--gpu-int4" if gpu_int4 else "--no-gpu-int4"
        why = f"{flag}: the model has no Q4_0/Q4_1/Q4_K matrices" if gpu_int4 and not int4.gpu_int4 else flag
        return (result, r, choice("flag", **{kind: result.tokens_per_s}),
                f"GPU weights: {kind} ({why}; predicted {result.tokens_per_s:.1f} tok/s)")
    on_gpu = int4.gpu_int4 and hw.cuda and req.vram > 0  # 4-bit matrices a GPU of the plan could keep
    why = _int4_unavailable(hw, measured) if on_gpu else None
    if not on_gpu or why:
        result, r = plan_with(False)
        return result, r, choice("auto", expanded=result.tokens_per_s), why and f"GPU weights: expanded ({why})"
    made, errors = {}, {}
    for kind in ("int4", "expanded"):
        try:
            made[kind] = plan_with(kind == "int4")
        except BudgetError as e:
            errors[kind] = e
    if not made:
        raise errors["int4"]  # int4 needs less of the GPU: its message names the budget auto needs
    if len(made) == 2:
        best, other = ("int4", "expanded") if _faster(made["int4"][0], made["expanded"][0]) else ("expanded", "int4")
    else:
        (best,), other = made, next(iter(errors))
    tok_s = {k: res.tokens_per_s for k, (res, _) in made.items()}
    alt = f"{other} {tok_s[other]:.1f}" if other in tok_s else f"{other} does not fit"
    return (*made[best], choice("auto", **tok_s), f"GPU weights: {best} (predicted {tok_s[best]:.1f} tok/s; {alt})")


# ------------------------------------------------------------------------------------------- the table
def _groups(layers: list[dict], buckets: int) -> list[list[dict]]:
    """Runs of consecutive layers with the same attention/predictor placement and a similar GPU share."""
    def key(e):
        share = e.get("gpu_fraction", len(e.get("gpu_experts", [])) / max(1, e.get("experts", 1)))
        return (e["kind"], e["attention"], e["predictor"], round(share * buckets))

    out: list[list[dict]] = []
    for e in layers:
        if out and key(out[-1][-1]) == key(e):
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _mix(group: list[dict], key: str) -> str:
    """'gpu', 'cpu', or e.g. 'gpu 7/10' when the layers of a run differ."""
    vals = [x[key] for x in group]
    if len(set(vals)) == 1:
        return vals[0]
    top = max(set(vals), key=vals.count)
    return f"{top} {vals.count(top)}/{len(vals)}"


def print_plan(result, meta: dict, json_path: Path, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from hotcold.planner.sizes import format_size

    console = console or Console()
    pred = meta["predicted"]
    # a plan for a machine without a GPU has no VRAM, whatever --vram said (a note says it was ignored)
    vram = f"VRAM {meta['budget']['vram']}" if meta["hardware"].get("cuda") else "no GPU"
    title = (f"hotcold plan: {meta['mode']} — {vram}, RAM {meta['budget']['ram']}, "
             f"ctx {meta['budget']['ctx']}, batch {meta['budget']['batch']}, {meta['weights']['format']}")
    console.print(title)
    # an all-CPU plan (the machine has no GPU, or --vram 0) has no GPU column: the words match the machine
    has_gpu = meta["mode"] != "cpu"
    comp = Table()
    comp.add_column("component")
    if has_gpu:
        comp.add_column("GPU", justify="right")
    comp.add_column("CPU", justify="right")
    gpu, cpu = meta["bytes"]["gpu"], meta["bytes"]["cpu"]
    for k in ("attention", "kv_cache", "ffn", "predictors", "router_shared", "expert_cache", "lm_head", "embedding",
              "workspace", "reserve", "total"):
        if gpu.get(k) or cpu.get(k):
            cells = [format_size(gpu.get(k, 0)) if gpu.get(k) else "-"] if has_gpu else []
            comp.add_row(k.replace("router_shared", "MoE router/shared").replace("_", " ").replace("ffn", "FFN / experts"),
                         *cells, format_size(cpu.get(k, 0)) if cpu.get(k) else "-")
    console.print(comp)
    layers = meta["layers"]
    groups = _groups(layers, 20)
    if len(groups) > 12:
        groups = _groups(layers, 5)
    if len(groups) > 12:  # too varied to group by choice: equal runs of consecutive layers
        size = -(-len(layers) // 10)
        groups = [layers[i:i + size] for i in range(0, len(layers), size)]
    lt = Table()
    columns = ("layers", "attention+KV", "predictor", "FFN on GPU", "of activations", "µs/layer", "bound by")
    if not has_gpu:  # every layer wholly on the CPU: where its time goes is all there is to say
        columns = ("layers", "µs/layer")
    for c in columns:
        lt.add_column(c, justify="right" if c in ("of activations", "µs/layer") else "left")
    for g in groups:
        a, b = g[0]["layer"], g[-1]["layer"]
        e = g[0]
        if e["kind"] == "moe":
            n = sum(len(x["gpu_experts"]) for x in g) / len(g)
            ffn = f"{n:.1f}/{e['experts']} experts"
        else:
            fr = [x.get("gpu_fraction", 0.0) for x in g]
            ffn = f"{100 * sum(fr) / len(fr):.0f}%" + (f" ({100 * min(fr):.0f}-{100 * max(fr):.0f}%)"
                                                       if max(fr) - min(fr) > 0.05 else "") + f" of {e['neurons']}"
        share = sum(x["gpu_activation_share"] for x in g) / len(g)
        t = sum(x["time_us"] for x in g) / len(g)
        cpu_bound = sum(1 for x in g if x["ffn_cpu_us"] > x["ffn_gpu_us"])
        bound = "CPU" if cpu_bound == len(g) else "GPU" if cpu_bound == 0 else f"CPU {cpu_bound}/{len(g)}"
        span = f"{a}" if a == b else f"{a}-{b}"
        if not has_gpu:
            lt.add_row(span, f"{t:.0f}")
            continue
        lt.add_row(span, _mix(g, "attention"), _mix(g, "predictor"), ffn, f"{100 * share:.0f}%", f"{t:.0f}", bound)
    console.print(lt)
    off = [x["layer"] for x in layers if x.get("predictor") == "off"]
    if off:
        why = meta.get("predictors_off_reason") or ("computing every CPU neuron there is predicted faster than "
                                                     "asking a predictor that would select nearly all of them")
        console.print(f"predictors off in {len(off)} of {len(layers)} layers: {why}")
    bd = pred["breakdown_s"]
    console.print(f"predicted [bold]{pred['tokens_per_s']:.2f} tok/s[/bold] ({1e3 * pred['time_per_step_s']:.2f} ms per "
                  f"step): FFN {1e3 * bd['ffn']:.2f} ms, attention {1e3 * bd['attention']:.2f} ms, predictors "
                  f"{1e3 * bd['predictors']:.2f} ms, sync {1e3 * pred['sync_s']:.2f} ms, lm_head {1e3 * bd['lm_head']:.2f} ms, "
                  f"fixed {1e3 * bd['fixed']:.2f} ms" + (f"; lm_head on {meta['lm_head'].upper()}" if has_gpu else ""))
    s = meta["solver"]
    if s.get("name"):
        gap = "-" if s.get("gap") is None else f"{100 * s['gap']:.2f}%"
        console.print(f"solver {s['name']}: {s['status']} in {s['time_s']:.2f} s, gap {gap}, {s['variables']} variables, "
                      f"block {meta['block_size']} neurons")
    else:
        console.print(f"solver {s['status']}")
    alt = meta["alternatives"]
    if "all_cpu_tokens_per_s" in alt and meta["mode"] != "cpu":
        console.print(f"all-CPU would be {alt['all_cpu_tokens_per_s']:.2f} tok/s")
    if "greedy" in alt:
        g = alt["greedy"]
        fits = "" if g["fits"] else " (over the RAM budget)"
        console.print(f"greedy hottest-neurons-first: {g['tokens_per_s']:.2f} tok/s{fits}; this plan is "
                      f"{g['speedup_of_plan']:.3f}x its speed")
        _print_explain(result, console)
    for n in meta["notes"]:
        console.print(f"note: {n}")
    console.print(f"wrote {json_path} and {json_path.with_name('plan.safetensors').name}")


def _print_explain(result, console) -> None:
    """Where the plan and greedy differ most, per layer."""
    from rich.table import Table

    if result.greedy is None:
        return
    gp, gev = result.greedy
    p, ev, costs = result.placement, result.evaluation, result.costs
    rows = []
    for l, lc in enumerate(costs.layers):
        d = gev.layers[l].t_s - ev.layers[l].t_s
        n_p = len(p.gpu_items(costs, l))
        n_g = len(gp.gpu_items(costs, l))
        if abs(d) > 1e-9 or n_p != n_g or p.attn_gpu[l] != gp.attn_gpu[l]:
            rows.append((abs(d), l, n_p, n_g, d))
    if not rows:
        console.print("the plan and greedy place every layer alike")
        return
    t = Table(title="layers where the plan differs most from greedy", title_justify="left")
    for c in ("layer", "plan: attention / GPU units", "greedy: attention / GPU units", "plan µs", "greedy µs"):
        t.add_column(c, justify="right")
    for _, l, n_p, n_g, d in sorted(rows, reverse=True)[:8]:
        t.add_row(str(l), f"{'gpu' if p.attn_gpu[l] else 'cpu'} / {n_p}", f"{'gpu' if gp.attn_gpu[l] else 'cpu'} / {n_g}",
                  f"{ev.layers[l].t_s * 1e6:.1f}", f"{gev.layers[l].t_s * 1e6:.1f}")
    console.print(t)
    if result.placement.head_gpu != gp.head_gpu:
        console.print(f"lm_head: plan {'GPU' if p.head_gpu else 'CPU'}, greedy {'GPU' if gp.head_gpu else 'CPU'}")

