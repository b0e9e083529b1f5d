#!/usr/bin/env python3
"""Our CPU expert kernels against kvcache-ai's kt-kernel on the same experts, routing and inputs.

    python tools/bench_kt_kernel.py [--threads 8,15] [--tokens 1,128] [--layers 8] [--repeats 20]
        [--burst 10] [--engines ours,kt] [--kt-methods LLAMAFILE,AMXINT4,AMXINT8] [--json FILE]

Shape: Qwen3-30B-A3B's MoE layer by default (hidden 2048, experts of 768, 128 experts, top-8), in
Q4_0 blocks. --layers distinct random weight sets (one MoE layer each, 340 MB of Q4_0 at the default
shape) are cycled call by call, so the weights come from DRAM, not from the caches.

Engines, one MoE layer call each (all routed experts of the T tokens, weighted and summed):
  ours           the engine's own path over the stacks it builds (`host_quant_experts` -> `pack_rows`
                 row-interleaved): `MoEJob.run`, i.e. `qexperts` for one token and `qexperts_tokens`
                 (`qexpert_batch` for an expert with >= EXPERT_BATCH_TOKENS tokens) for a chunk;
                 float32 in and out, Q8 activations.
  kt LLAMAFILE   kt-kernel's `KTMoEWrapper(method="LLAMAFILE")` over the *same Q4_0 blocks* (handed to
                 its `load_weights` in place of a GGUF file: the wrapper's GGUF loader is replaced by
                 one that returns our stacks in the GGUF layout); bfloat16 in and out.
  kt AMXINT4/8   `KTMoEWrapper(method="AMXINT4"/"AMXINT8").load_weights_from_tensors`, which quantises
                 float weights itself (int4 / int8, an fp32 scale per row): it is given our Q4_0
                 weights dequantised (rounded to bfloat16, the type it takes), so both compute the
                 same function up to their own quantisation. It writes its quantised copy under
                 --kt-dir while loading (removed once loaded).
kt-kernel is called as its own benchmarks call it: `cpu_infer.submit(moe.forward_task(...))` then
`cpu_infer.sync()`, on host tensors (`KTMoEWrapper.forward` adds the copies to and from the GPU;
where CUDA is present it is called once on the check input and must agree).

Timing: per (threads, tokens), --repeats rounds; in each round every engine runs one burst of
1 + --burst calls (the first untimed: it wakes the thread team), the engines' order rotating from
round to round, with --gap-ms of sleep before each burst (kt-kernel's workers spin 50 ms after a
task before they sleep: they would steal the next engine's cores). Call i of a round uses layer
i mod --layers and the i-th routing and input of that round, the same for every engine. The table
gives the median, p10 and p90 µs of a call; MB / call = distinct routed experts per call (mean over
the calls) x the engine's weight bytes of one expert (gate + up + down) in its own format: Q4_0 18
bytes per 32 weights (ours and LLAMAFILE), AMXINT4 / AMXINT8 4 / 8 bits a weight plus an fp32
scale per row; GB/s = MB / call over the median. ours / theirs = their median / ours (> 1: ours is
faster). A last table puts ours beside the fastest kt-kernel method at each thread count and
token count.

Check: on the first routing of layer 0, each engine's output against a float64 reference computed
from the dequantised Q4_0 weights (gguf-py's decoder) on the same bfloat16-rounded input: relative
L2 error ||out - ref|| / ||ref||, held to a per-engine tolerance (rel err marked FAIL above it; exit
status 3). A fast wrong kernel is worthless.

Several --threads values run one child process each (kt-kernel's thread pool is a process-wide
singleton sized once); the parent prints the combined table. Exit status: 0; 2 kt-kernel requested
but not importable (one line); 3 a check failed or a kt-kernel method could not be set up or run
(the rest still measured; each failure printed with what was tried).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_moe_cpu, also when loaded by path
from bench_moe_cpu import packed_experts, random_experts  # noqa: E402
from kt_adapter import KT_METHODS, KT_VERSION, Kt, KtError, KtMissing, _Blocks, import_kt, kt_preflight  # noqa: E402,F401

TOLERANCE = {"ours": 0.03, "LLAMAFILE": 0.03, "AMXINT8": 0.05, "AMXINT4": 0.35}  # relative L2 error
# (AMXINT4 requantises Q4_0 weights, 32-weight blocks each with its own scale, to int4 with one scale
# per row: its error is its format's, ~0.1 on these weights; 0.35 is the bound kt-kernel's own test
# puts on its int4 modes.)


# -- setup -----------------------------------------------------------------------------------


@dataclass
class Layer:
    raw: tuple  # (gate, up, down) QuantMatrix in the GGUF layout
    packed: tuple  # the same, as the engine stacks them
    cold: object  # ColdFFN over `packed`
    bf16: tuple = ()  # torch bfloat16 [E, I, D], [E, I, D], [E, D, I] (for the AMX methods)


def build_layers(args) -> list[Layer]:
    from hotcold.executors.weights import ColdFFN

    E, D, I = args.experts, args.hidden, args.inter
    layers = []
    for n in range(args.layers):
        raw = random_experts(E, D, I, args.qtype, seed=1 + 3 * n + 1000 * args.seed)
        packed = packed_experts(raw)
        cold = ColdFFN(idx=np.arange(E * I, dtype=np.int64), up=packed[1], gate=packed[0], down_t=None,
                       up_bias=None, act="silu", down=packed[2])
        layers.append(Layer(raw, packed, cold))
    return layers


def make_calls(rng, n: int, T: int, E: int, k: int, D: int) -> list[tuple]:
    """n (x, ids, weights): x float32 [T, D] rounded to bfloat16 (the input both engines get); ids int64
    [T, k] distinct per token; weights float32 [T, k] summing to 1 per token."""
    import torch

    xs = [torch.from_numpy(rng.standard_normal((T, D), dtype=np.float32)).to(torch.bfloat16).float().numpy()
          for _ in range(min(n, 4))]
    calls = []
    for i in range(n):
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64)
        w = rng.random((T, k)).astype(np.float32) + 0.05
        calls.append((xs[i % len(xs)], ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)))
    return calls


def reference(layer: Layer, x: np.ndarray, ids: np.ndarray, w: np.ndarray, D: int, I: int) -> np.ndarray:
    """float64 [T, D]: sum over each token's routed experts of w * down(silu(gate x) * (up x)), the
    weights dequantised by gguf-py (`QuantMatrix.dequantize`, independent of our kernels)."""
    gate, up, down = layer.raw
    out = np.zeros(x.shape, np.float64)
    for e in np.unique(ids).tolist():
        tok, slot = np.nonzero(ids == e)
        rows = np.arange(e * I, (e + 1) * I)
        xe = x[tok].astype(np.float64)
        g = xe @ gate.dequantize(rows).astype(np.float64).T
        h = g / (1.0 + np.exp(-g)) * (xe @ up.dequantize(rows).astype(np.float64).T)
        out[tok] += w[tok, slot][:, None] * (h @ down.dequantize(np.arange(e * D, (e + 1) * D)).astype(np.float64).T)
    return out


# -- engines ---------------------------------------------------------------------------------


class Ours:
    name = "ours"

    def __init__(self, layers: list[Layer], E: int):
        from hotcold.executors.moe_host import MoEJob

        self.layers, self.job = layers, MoEJob
        self.pos = np.arange(E, dtype=np.int64)
        self.expert_bytes = sum(m.nbytes for m in layers[0].packed) / E

    def prepare(self, n: int, x, ids, w):
        return self.job(cold=self.layers[n].cold, pos=self.pos, expert_rows=[], scale=np.zeros(0, np.float32),
                        x=x, ids=ids, weights=w, out=np.empty_like(x))

    @staticmethod
    def run(job) -> None:
        job.run()

    @staticmethod
    def output(job) -> np.ndarray:
        return job.out


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Row:
    threads: int
    tokens: int
    engine: str
    us: float = float("nan")
    p10: float = float("nan")
    p90: float = float("nan")
    calls: int = 0
    mb_per_call: float = float("nan")
    gb_s: float = float("nan")
    rel_err: float = float("nan")
    tolerance: float = float("nan")
    ok: bool = True
    speed_ours_over_theirs: float | None = None
    note: str = ""
    times: list = field(default_factory=list, repr=False)


def measure(engines: list, layers: list[Layer], T: int, threads: int, args, rng) -> list[Row]:
    E, D, I, k, L = args.experts, args.hidden, args.inter, args.k, args.layers
    per_round = args.burst + 1
    calls = make_calls(rng, args.repeats * per_round, T, E, k, D)
    rows = {e.name: Row(threads, T, e.name) for e in engines}
    # check (and compilation / first touch): layer 0, the first call's routing and input
    x, ids, w = calls[0]
    ref = reference(layers[0], x, ids, w, D, I)
    for e in list(engines):
        r = rows[e.name]
        r.tolerance = TOLERANCE[e.name.split()[-1]]
        try:
            p = e.prepare(0, x, ids, w)
            e.run(p)
            out = e.output(p)
        except Exception as err:
            r.ok, r.note = False, f"{e.name}: first call failed: {type(err).__name__}: {err}"
            print(r.note, flush=True)
            engines.remove(e)
            continue
        r.rel_err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
        r.ok = bool(np.isfinite(r.rel_err) and r.rel_err <= r.tolerance)
        if isinstance(e, Kt):
            r.note = e.forward_check(0, x, ids, w, out)
    distinct = np.mean([len(np.unique(c[1])) for c in calls])
    for rnd in range(args.repeats):
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)] if engines else []
        for e in order:
            time.sleep(args.gap_ms / 1e3)
            for j in range(per_round):
                i = rnd * per_round + j
                p = e.prepare(i % L, *calls[i])
                t0 = time.perf_counter()
                e.run(p)
                dt = time.perf_counter() - t0
                if j:
                    rows[e.name].times.append(dt)
    for e in engines:
        r = rows[e.name]
        t = np.asarray(r.times) * 1e6
        r.us, r.calls = float(np.median(t)), len(t)
        r.p10, r.p90 = float(np.percentile(t, 10)), float(np.percentile(t, 90))
        r.mb_per_call = distinct * e.expert_bytes / 1e6
        r.gb_s = r.mb_per_call * 1e6 / (r.us * 1e-6) / 1e9
    ours = rows.get("ours")
    for r in rows.values():
        if r.engine != "ours" and ours is not None and ours.calls and r.calls:
            r.speed_ours_over_theirs = r.us / ours.us
    return list(rows.values())


# -- output ----------------------------------------------------------------------------------

HEAD = ("| threads | tokens | engine       | µs / call |    p10 µs |    p90 µs | MB / call |   GB/s |  rel err "
        "| ours / theirs |")


def table(rows: list[Row]) -> str:
    lines = [HEAD, "|" + "|".join("-" * (len(c)) for c in HEAD.split("|")[1:-1]) + "|"]
    for r in rows:
        err = f"{r.rel_err:.2g}" + ("" if r.ok else " FAIL")
        ratio = "" if r.speed_ours_over_theirs is None else f"{r.speed_ours_over_theirs:.2f}x"
        lines.append(f"| {r.threads:>7} | {r.tokens:>6} | {r.engine:<12} | {r.us:>9.1f} | {r.p10:>9.1f} | "
                     f"{r.p90:>9.1f} | {r.mb_per_call:>9.2f} | {r.gb_s:>6.1f} | {err:>8} | {ratio:>13} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Per (threads, tokens): ours against the fastest kt-kernel method of the same run (its median),
    the ratio their µs / ours (> 1: ours faster) and each one's GB/s of expert weights."""
    head = "| threads | tokens | ours µs | best kt µs | best kt      | ours / best kt | ours GB/s | kt GB/s |"
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for key in dict.fromkeys((r.threads, r.tokens) for r in rows):
        got = [r for r in rows if (r.threads, r.tokens) == key and r.calls]
        ours = next((r for r in got if r.engine == "ours"), None)
        theirs = sorted((r for r in got if r.engine != "ours"), key=lambda r: r.us)
        if ours is None or not theirs:
            continue
        kt = theirs[0]
        lines.append(f"| {key[0]:>7} | {key[1]:>6} | {ours.us:>7.0f} | {kt.us:>10.0f} | {kt.engine:<12} | "
                     f"{kt.us / ours.us:>13.2f}x | {ours.gb_s:>9.1f} | {kt.gb_s:>7.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _print_summary(rows: list[Row]) -> None:
    text = summary(rows)
    if text:
        print("\nours against the fastest kt-kernel method:\n")
        print(text)


def _as_dict(r: Row) -> dict:
    d = {k: v for k, v in r.__dict__.items() if k != "times"}
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}


def _row(d: dict) -> Row:
    """A Row back from its JSON form (null floats are NaN again)."""
    return Row(**{k: (float("nan") if v is None and k != "speed_ours_over_theirs" else v) for k, v in d.items()})


def settings(args, kt) -> dict:
    import numba
    import torch

    from hotcold.executors.moe_host import EXPERT_BATCH_TOKENS
    from hotcold.sparse_ops.quant.ops import GEMM_BF16

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        layer = numba.threading_layer()
    except ValueError:  # (no parallel region run yet)
        layer = "?"
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                numba=numba.__version__, numba_threading_layer=layer, gemm_bf16=GEMM_BF16,
                expert_batch_tokens=EXPERT_BATCH_TOKENS, kt_kernel=getattr(kt, "__version__", None) if kt else None,
                kt_cpu_variant=getattr(kt, "__cpu_variant__", None) if kt else None, qtype=args.qtype,
                experts=args.experts, k=args.k, hidden=args.hidden, inter=args.inter, layers=args.layers,
                repeats=args.repeats, burst=args.burst, gap_ms=args.gap_ms, kt_pools=args.kt_pools)


# -- main ------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        v = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return v


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=_ints, default=[8, 15], help="thread counts, comma-separated (default 8,15)")
    ap.add_argument("--tokens", type=_ints, default=[1, 128],
                    help="tokens a layer call, comma-separated (default 1,128; e.g. 1,128,512)")
    ap.add_argument("--layers", type=int, default=8, help="distinct weight sets cycled (default 8)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="routed experts per token (default 8)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="expert intermediate size (default 768)")
    ap.add_argument("--qtype", default="Q4_0", help="our blocks' type, also LLAMAFILE's (default Q4_0)")
    ap.add_argument("--repeats", type=int, default=20, help="rounds over the engines (default 20)")
    ap.add_argument("--burst", type=int, default=10, help="timed calls per engine per round (default 10)")
    ap.add_argument("--gap-ms", type=float, default=80.0, help="sleep before each burst (default 80)")
    ap.add_argument("--engines", default="ours,kt", help="ours, kt or both (default ours,kt)")
    ap.add_argument("--kt-methods", default=",".join(KT_METHODS), help=f"default {','.join(KT_METHODS)}")
    ap.add_argument("--kt-pools", type=int, default=1, help="kt-kernel threadpool_count: NUMA subpools (default 1)")
    ap.add_argument("--kt-dir", default=None, help="where AMX methods write their quantised copy while loading "
                                                   "(default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write settings, rows and failures here")
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - {"ours", "kt"}:
        ap.error(f"--engines takes ours, kt or both, got {args.engines!r}")
    args.engine_set = engines
    args.methods = [m.strip().upper() for m in args.kt_methods.split(",") if m.strip()]
    if "kt" in engines and (not args.methods or set(args.methods) - set(KT_METHODS)):
        ap.error(f"--kt-methods takes some of {','.join(KT_METHODS)}, got {args.kt_methods!r}")
    if args.k > args.experts or min(args.layers, args.repeats, args.burst, args.experts, args.k) < 1:
        ap.error("need 1 <= --k <= --experts and --layers, --repeats, --burst >= 1")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    kt = None
    if "kt" in args.engine_set:
        try:
            kt = import_kt()
        except KtMissing as e:
            print(f"kt-kernel is not importable here ({e}): install kt-kernel {KT_VERSION} (a Python 3.12 wheel) "
                  "or put it on PYTHONPATH, or run with --engines ours", file=sys.stderr)
            return 2
        if getattr(kt, "__version__", None) != KT_VERSION:
            print(f"warning: kt-kernel {getattr(kt, '__version__', '?')}; this tool follows {KT_VERSION}'s API",
                  flush=True)
    if len(args.threads) > 1:
        return parent(argv, args, kt)
    return run(args, kt)


def _child_argv(argv: list[str], threads: int, json_path: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--threads", "--json"):
            skip = True
            continue
        if a.startswith(("--threads=", "--json=")):
            continue
        out.append(a)
    return out + ["--threads", str(threads), "--json", json_path]


def parent(argv: list[str], args, kt) -> int:
    """One child process per thread count (kt-kernel's CPUInfer is sized once per process)."""
    rows, failures, first, status = [], [], None, 0
    with tempfile.TemporaryDirectory(prefix="bench_kt_") as tmp:
        for T in args.threads:
            path = os.path.join(tmp, f"t{T}.json")
            print(f"\n== {T} threads (child process) ==", flush=True)
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *_child_argv(argv, T, path)]).returncode
            if rc not in (0, 3) or not os.path.exists(path):
                failures.append(f"{T} threads: the child process exited with status {rc}")
                status = 3
                continue
            data = json.load(open(path))
            first = first or data["settings"]
            rows += data["rows"]
            failures += data["failures"]
            status = max(status, rc)
    print("\nall thread counts:\n")
    print(table([_row(r) for r in rows]))
    _print_summary([_row(r) for r in rows])
    _footer(failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=first, rows=rows, failures=failures), f, indent=1)
    return status


def _footer(failures: list[str]) -> None:
    print("\nµs / call: median over the timed calls; MB / call: distinct routed experts x one expert's weight bytes "
          "in the engine's format; ours / theirs: their median / ours (> 1: ours faster); rel err: against the "
          "float64 reference from the dequantised Q4_0 weights")
    for f in failures:
        print(f"FAILED: {f}")


def run(args, kt) -> int:
    import torch

    from hotcold.sparse_ops.cpu import get_threads, set_threads

    T_threads = args.threads[0]
    if T_threads > (os.cpu_count() or 1):
        print(f"warning: {T_threads} threads on {os.cpu_count()} cores", flush=True)
    before = get_threads(), torch.get_num_threads()
    set_threads(T_threads)
    torch.set_num_threads(T_threads)
    try:
        return _run(args, kt, T_threads)
    finally:
        set_threads(before[0])
        torch.set_num_threads(before[1])


def _run(args, kt, T_threads: int) -> int:
    from hotcold.sparse_ops.cpu import get_threads

    E, D, I = args.experts, args.hidden, args.inter
    t0 = time.perf_counter()
    print(f"building {args.layers} layers of {E} experts [{D} x {I}] in {args.qtype} ...", flush=True)
    layers = build_layers(args)
    print(f"  {time.perf_counter() - t0:.1f} s, {sum(m.nbytes for m in layers[0].packed) / 1e6:.0f} MB a layer",
          flush=True)
    engines, failures = [], []
    if "ours" in args.engine_set:
        engines.append(Ours(layers, E))
        for T in (1, 2):  # compiled, and numba's thread team started, before kt-kernel pins its own threads
            engines[0].run(engines[0].prepare(0, *make_calls(np.random.default_rng(0), 1, T, E, args.k, D)[0]))
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    workdir = None
    if kt is not None:
        bad = kt_preflight(kt, args.methods, args)
        for m, why in bad.items():
            failures.append(f"kt {m}: {why}")
            print(f"kt {m}: skipped: {why}", flush=True)
        todo = [m for m in args.methods if m not in bad]
        if todo:
            workdir = Path(args.kt_dir or tempfile.mkdtemp(prefix="kt_weights_"))
        for m in todo:
            t0 = time.perf_counter()
            print(f"loading kt {m} ({args.layers} layers, cpuinfer_threads={T_threads}, "
                  f"threadpool_count={args.kt_pools}) ...", flush=True)
            try:
                engines.append(Kt(kt, m, layers, args, T_threads, workdir))
            except KtError as e:
                failures.append(str(e))
                print(f"FAILED: {e}", flush=True)
                continue
            print(f"  {time.perf_counter() - t0:.1f} s", flush=True)
            if affinity is not None and os.sched_getaffinity(0) != affinity:
                print(f"  (kt-kernel narrowed this thread's CPU affinity to {sorted(os.sched_getaffinity(0))}; "
                      "restored)", flush=True)
                os.sched_setaffinity(0, affinity)
        for layer in layers:
            layer.bf16 = ()
        gc.collect()
    rows = []
    try:
        for T in args.tokens:
            rng = np.random.default_rng(args.seed + T)
            got = measure(list(engines), layers, T, T_threads, args, rng)
            if "ours" in args.engine_set:
                for r in got:
                    if r.engine == "ours":
                        r.note = f"numba {get_threads()} threads"
            rows += got
            for r in got:
                if not r.ok:
                    failures.append(r.note if r.calls == 0 and r.note else
                                    f"{r.engine}, {T} tokens: rel err {r.rel_err:.3g} > tolerance {r.tolerance}")
            print(f"\n{T_threads} threads, {T} token(s) a call, {args.k} of {E} experts a token, "
                  f"{args.layers} layers cycled, {args.repeats} x {args.burst} timed calls an engine\n")
            print(table(got), flush=True)
            for r in got:
                if r.note:
                    print(f"  {r.engine}: {r.note}")
    finally:
        for e in engines:
            if isinstance(e, Kt):
                e.close()
        if workdir is not None and args.kt_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    _print_summary(rows)
    _footer(failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=settings(args, kt), rows=[_as_dict(r) for r in rows], failures=failures), f,
                      indent=1)
    return 3 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
