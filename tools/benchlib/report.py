"""The report: the machine, token agreement, the table and the JSON report's contents."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from benchlib.children import _ids_digest
from benchlib.common import METRICS, NOISY, fmt_bytes, fmt_num, fmt_ratio, ratio, summarise
from benchlib.inputs import BenchEngine, ModelPaths, reference_engine

def format_table(report: dict, markdown: bool = False) -> str:
    """The comparison table: one row per engine, medians ± half-range, (ratio to the reference)."""
    s = report["settings"]
    ref = report.get("reference")
    lines = [
        f"model: {s['model_label']}   prompt {s['prompt_tokens']} tokens, generate {s['tokens']} (greedy, EOS "
        f"ignored)   threads {s['threads']}   device {s['device']}"
        + (f"   vram budget {fmt_bytes(s['vram_bytes'])}" if s.get("vram_bytes") else "")
        + f"   median of {s['repeats']}",
    ]
    header = ["engine", "load s", "prefill tok/s", "decode tok/s", "TTFT s", "peak RAM", "peak VRAM"]
    rows, failed = [header], []
    for name, e in report["engines"].items():
        summ, rat = e.get("summary") or {}, e.get("ratio") or {}
        if not summ:
            failed.append(f"{name}: {e.get('status', 'no result')}: {e.get('note', '')}"[:200])
            continue

        def cell(metric: str, fmt, spread: bool = True) -> str:
            m = summ.get(metric)
            if m is None:
                return "-"
            text = fmt(m["median"])
            if spread and m["n"] > 1:
                text += f"±{fmt_num(m['spread'], like=m['median'])}"
            if name != ref and rat.get(metric) is not None:
                text += f" ({fmt_ratio(rat[metric])})"
            return text

        rows.append([name, fmt_num(summ["load_s"]["median"]) if "load_s" in summ else "-",
                     cell("prefill_tok_per_s", fmt_num), cell("decode_tok_per_s", fmt_num), cell("ttft_s", fmt_num),
                     cell("peak_ram_bytes", fmt_bytes, False), cell("peak_vram_bytes", fmt_bytes, False)])
    if markdown:  # the table alone, to paste into docs/performance.md
        return "\n".join(["| " + " | ".join(r) + " |" for r in rows[:1]] + ["|" + "---|" * len(header)]
                         + ["| " + " | ".join(r) + " |" for r in rows[1:]])
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines += failed
    if ref:
        lines.append(f"(×) = engine / {ref}: above 1 is faster for tok/s, slower for TTFT, more memory for RAM/VRAM; "
                     "± = half the range over repeats")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)



def machine_info(threads: int, probe: dict) -> dict:
    from importlib import metadata

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import psutil

        physical, logical, ram = psutil.cpu_count(logical=False), psutil.cpu_count(), psutil.virtual_memory().total
    except ImportError:
        physical, logical, ram = None, os.cpu_count(), None
    versions = {}
    for pkg in ("hotcold", "torch", "llama-cpp-python", "transformers", "accelerate", "numba", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": cpu, "physical_cores": physical, "logical_cpus": logical, "ram_bytes": ram,
            "threads": threads, "gpu": probe.get("gpu_name"), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "llama_cpp_gpu_offload": probe.get("llama_gpu_offload")}


def default_threads() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy generations."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_report(args, paths: ModelPaths, engines: list[BenchEngine], runs: dict[str, list[dict]], prompt_ids: list[int],
                 machine: dict, notes: list[str], extra_settings: dict) -> dict:
    ref = reference_engine(engines)
    report: dict = {
        "command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
        "settings": {"model_label": paths.label, "hf": str(paths.hf) if paths.hf else None,
                     "gguf": str(paths.gguf) if paths.gguf else None, "hotcold_model": str(paths.hotcold),
                     "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "threads": args.threads,
                     "repeats": args.repeats, "device": args.device, "dtype": args.dtype,
                     "vram_bytes": args.vram_bytes, "warmup": not args.no_warmup, **extra_settings},
        "prompt_ids": prompt_ids, "prompt_ids_sha": _ids_digest(prompt_ids), "reference": ref,
        "engines": {}, "notes": list(notes),
    }
    for e in engines:
        rs = runs.get(e.name, [])
        ok = [r for r in rs if "error" not in r]
        entry: dict = {"kind": e.kind, "args": e.args, "runs": rs}
        if ok:
            entry["summary"] = {m: s for m in METRICS if (s := summarise([r.get(m) for r in ok])) is not None}
            entry["status"] = "ok" if len(ok) == len(rs) else f"{len(rs) - len(ok)} of {len(rs)} runs failed"
        else:
            entry["status"] = rs[0].get("status", "failed") if rs else "not run"
            entry["note"] = rs[0]["error"] if rs else ""
        report["engines"][e.name] = entry
    ref_summ = report["engines"].get(ref, {}).get("summary") if ref else None
    for name, entry in report["engines"].items():
        if ref_summ and entry.get("summary"):
            entry["ratio"] = {m: ratio(s["median"], (ref_summ.get(m) or {}).get("median"))
                              for m, s in entry["summary"].items()}
    # Consistency: same prompt ids, exactly --tokens tokens, greedy agreement with the reference.
    ref_ids = next((r["token_ids"] for r in runs.get(ref or "", []) if "token_ids" in r), None)
    for name, entry in report["engines"].items():
        ok = [r for r in entry["runs"] if "error" not in r]
        if not ok:
            continue
        if any(r.get("prompt_ids_sha") != report["prompt_ids_sha"] for r in ok):
            report["notes"].append(f"{name}: was fed different prompt ids")
        if any(r.get("completion_tokens") != args.tokens for r in ok):
            got = sorted({r.get("completion_tokens") for r in ok})
            report["notes"].append(f"{name}: generated {got} tokens, not {args.tokens}")
        if ref_ids is not None and name != ref:
            entry["agreement_with_reference"] = agreement(ok[0]["token_ids"], ref_ids)
        for n in sorted({n for r in ok for n in r.get("notes", [])}):
            report["notes"].append(f"{name}: {n}")
        budget = args.vram_bytes
        vram = (entry.get("summary", {}).get("peak_vram_bytes") or {}).get("max")
        if budget and vram and vram > budget:
            report["notes"].append(f"{name}: peak VRAM {fmt_bytes(vram)} is over the {fmt_bytes(budget)} budget "
                                   "(includes the CUDA context and compute buffers)")
    noisy = []
    for name, entry in report["engines"].items():
        for m in ("prefill_tok_per_s", "decode_tok_per_s"):
            st = (entry.get("summary") or {}).get(m)
            if st and st["n"] > 1 and st["median"] and st["spread"] / st["median"] > NOISY:
                noisy.append(f"{name} {m.split('_')[0]} ±{100 * st['spread'] / st['median']:.0f}%")
    if noisy:
        load, cpus = machine.get("load_average_before"), machine.get("logical_cpus") or 1
        busy = bool(load) and load[0] >= 0.25 * cpus  # else the runs varied on an idle machine
        report["notes"].append("noisy: " + ", ".join(noisy) + " of the median"
                               + (f"; load average {load[0]:.1f} on {cpus} CPUs before the runs" if load else "")
                               + (": the machine was busy" if busy else "") + ": the ratios are unreliable")
    agree = [f"{n} {e['agreement_with_reference']}/{args.tokens}" for n, e in report["engines"].items()
             if "agreement_with_reference" in e]
    if agree:
        report["notes"].append(f"greedy tokens identical to {ref} before the first divergence: " + ", ".join(agree))
    report["table"] = format_table(report)
    report["table_markdown"] = format_table(report, markdown=True)
    return report


def _summary_line(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name}: {r.get('status', 'failed')}: {r['error']}"
    return (f"{name}: prefill {fmt_num(r.get('prefill_tok_per_s'))} tok/s, decode {fmt_num(r.get('decode_tok_per_s'))} "
            f"tok/s, ttft {fmt_num(r.get('ttft_s'))} s, load {fmt_num(r.get('load_s'))} s, "
            f"RAM {fmt_bytes(r.get('peak_ram_bytes'))}, {r.get('completion_tokens')} tokens")
