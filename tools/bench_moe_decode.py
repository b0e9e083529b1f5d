#!/usr/bin/env python3
"""Decode speed of a MoE model's hybrid engine by placement, eager against CUDA graphs.

For each share of experts on the fast tier (random placement, --fractions), with and without CUDA
graphs (--graphs), and optionally with an expert cache (--cache), greedy-decodes --tokens tokens
after a 64-token prompt and prints tok/s; --profile adds, per configuration, torch.profiler's
top host-side ops and the kernel launches per token (where eager decoding spends its time).
--fused no,yes compares torch's ops for RMSNorm, the rotary embedding and the one-token routing with
the Triton kernels the engine uses on CUDA (sparse_ops/fused_gpu.py); with graphs, the last column
is the GPU time of layer 0's first graph (attention half and router: one replay, then a
synchronise, median of 30).

    python tools/make_model.py qwen3-30b-a3b --layers 4 --calib-tokens 64 --format hf --out /tmp/q3
    python tools/bench_moe_decode.py /tmp/q3/hf [--fractions 1,0.25] [--cache 2GiB] [--inline no,yes] [--profile]
    python tools/make_model.py qwen3-30b-a3b --layers 6 --calib-tokens 64 --format gguf --dtype q4_0 --out /tmp/q4
    python tools/bench_moe_decode.py /tmp/q4/model.gguf --fractions 0.35 --graphs yes --int4 no,yes
    python tools/bench_moe_decode.py /tmp/q4/model.gguf --fractions 0.2 --graphs yes --int4 yes --fused no,yes
    python tools/bench_moe_decode.py /tmp/q4/model.gguf --fractions 0.2 --graphs yes --int4 yes --host-nodes no,yes --repeats 3
    python tools/bench_moe_decode.py /tmp/q4/model.gguf --fractions 0.2 --graphs yes --int4 yes --pipeline no,yes --threads 14,15
    python tools/bench_moe_decode.py /tmp/q4/model.gguf --fractions 0.33 --graphs yes --int4 yes --defer no,yes --idle
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hotcold.executors.moe as moe
import hotcold.models.layers as layers
from hotcold.executors import make_hybrid
from hotcold.executors.moe import random_experts
from hotcold.models.generate import Generator
from hotcold.models.loader import load_model
from hotcold.planner.sizes import parse_size
from hotcold.models.sampling import SamplingParams

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


FUSED_READY = layers.fused_ready


def graph_us(lm) -> float:
    """GPU time of layer 0's first graph (replay + synchronise, median of 30) in µs; nan if none."""
    c = getattr(lm.model.layers[0], "captured", None)
    if c is None:
        return float("nan")
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        c.graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def host_nodes(lm) -> list:
    """The MoE layers' host nodes (executors/host_node.py), where the engine made them."""
    blocks = [getattr(b, "block", b) for b in lm.model.layers]
    return [n for n in (getattr(getattr(b, "ffn", None), "_node", None) for b in blocks) if n is not None]


def idle_shares(gen, lm, prompt, greedy, n: int) -> str:
    """Per token: the GPU's kernel time (the union of its kernels' intervals under torch.profiler, all
    streams) and the CPU experts' time (the host nodes time themselves) against the decode time of
    an unprofiled run, and so each one's idle share."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "    --idle: needs a CUDA GPU"
    nodes = host_nodes(lm)
    busy0 = sum(x.busy_s for x in nodes)
    for _ in gen.generate(prompt, n + 1, greedy, ignore_eos=True):
        pass
    wall = gen.stats.decode_s / n
    cpu = (sum(x.busy_s for x in nodes) - busy0) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in gen.generate(prompt, n + 1, greedy, ignore_eos=True):
            pass
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
    busy, end = 0.0, float("-inf")  # union of the kernels' intervals, µs
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    gpu = busy * 1e-6 / n  # the prompt's logits are reused (the same prompt again): n one-token steps
    return (f"    per token {1e6 * wall:.0f} µs: GPU kernels {1e6 * gpu:.0f} µs (idle {100 * (1 - gpu / wall):.0f}%),"
            f" CPU experts {1e6 * cpu:.0f} µs (idle {100 * (1 - cpu / wall):.0f}%)"
            + ("" if nodes else "; no host nodes: CPU time not measured"))


def measure(path: str, fraction: float, cache: int, graphs, inline: bool | None, int4: bool, fused: bool,
            host: bool, block: bool, pipeline: bool, threads: int | None, release: bool, defer: bool, args) -> str:
    layers.fused_ready = moe.fused_ready = FUSED_READY if fused else (lambda x: False)  # read at each call
    lm = load_model(path, "cpu", args.dtype)
    eng = make_hybrid(lm, {}, None, device=args.device, gpu_experts=random_experts(lm, fraction),
                      expert_cache_bytes=cache, stats=False, threads=threads, cuda_graphs=graphs,
                      cpu_inline=inline, gpu_int4=int4, host_nodes=host, defer_experts=defer)
    try:
        gen = Generator(eng.lm, 512)
        gen.blocking_wait, gen.pipeline = block, "auto" if pipeline else False
        gen.release_threads = release
        ended = gen.ends_main_team()
        prompt, greedy = [(100 + i) % lm.config.vocab_size for i in range(64)], SamplingParams(temperature=0.0)
        for _ in gen.generate(prompt, 8, greedy, ignore_eos=True):  # warm-up (compilation, capture)
            pass
        for _ in gen.generate(prompt, args.tokens, greedy, ignore_eos=True):
            pass
        tps = gen.stats.decode_tok_per_s
        g = graphs if isinstance(graphs, str) else "yes" if graphs else "no"
        line = (f"{fraction:>9.2f} {cache / 2**30:>9.1f} {g:>9} {'auto' if inline is None else 'yes' if inline else 'no':>7}"
                f" {'yes' if int4 else 'no':>5} {'yes' if fused else 'no':>5} {'yes' if host else 'no':>5}"
                f" {'block' if block else 'spin':>5} {'yes' if pipeline else 'no':>5} {threads or 'auto':>7}"
                f" {tps:>9.1f} {1e3 / tps:>9.2f}"
                f" {graph_us(lm) if graphs is True else float('nan'):>9.0f}"
                f" {'inline' if eng.cpu.inline else 'worker':>7} {'ended' if ended else 'kept':>6}"
                f" {sum(b.defers() for b in lm.model.layers if hasattr(b, 'defers')):>6}")
        if args.idle:
            line += "\n" + idle_shares(gen, lm, prompt, greedy, args.tokens)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            n = 8
            with profile(activities=acts) as prof:
                for _ in gen.generate(prompt, n + 1, greedy, ignore_eos=True):
                    pass
            ka = prof.key_averages()
            launches = sum(e.count for e in ka if e.key in LAUNCHES)
            line += f" {launches / n:>9.0f}\n" + ka.table(sort_by="self_cpu_time_total", row_limit=12,
                                                          max_name_column_width=40)
        return line
    finally:
        eng.close()
        layers.fused_ready = moe.fused_ready = FUSED_READY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a MoE model folder or GGUF")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", default="auto", help="CPU worker threads (auto: one per core, less one), "
                    "comma-separated to compare")
    ap.add_argument("--fractions", default="1,0.25", help="shares of each layer's experts on the fast tier")
    ap.add_argument("--cache", default="0", help="expert cache size (e.g. 2GiB), CUDA only; 0: none")
    ap.add_argument("--graphs", default="no,yes", help="CUDA graphs: no / attention (the attention half only) / layers "
                    "(attention and the FFN's device half, per layer) / yes (the engine's default: also the whole step "
                    "as one graph where it can) / step (that over host-node layers too), comma-separated")
    ap.add_argument("--inline", default="auto", help="CPU experts in the main thread rather than a worker: no / yes / "
                    "auto (the engine's default: yes with graphs) / no,yes")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--int4", default="no", help="a quantised model's 4-bit matrices (GPU experts too) kept 4-bit on "
                    "the GPU: no / yes / no,yes")
    ap.add_argument("--fused", default="yes",
                    help="Triton RMSNorm, rotary and routing on CUDA (the engine's): no / yes / no,yes")
    ap.add_argument("--host-nodes", default="yes", help="a MoE layer's CPU experts as a CUDA host node of one graph "
                    "per layer (the engine's default) rather than between two replays: no / yes / no,yes")
    ap.add_argument("--wait", default="spin", help="how the generator waits for each step's logits on CUDA: spin "
                    "(the copy's own wait) / block (a blocking event: the thread sleeps) / spin,block")
    ap.add_argument("--pipeline", default="yes", help="the generator samples on the GPU and queues the next step "
                    "before reading the token (the default) rather than after: no / yes / no,yes")
    ap.add_argument("--repeats", type=int, default=1, help="run the configurations this many times, alternating")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table per configuration")
    ap.add_argument("--main-team", default="release", help="on CUDA, end the main thread's numba team once the "
                    "prompt is in (Generator.release_threads, the engine's default, where the decoding team leaves "
                    "two CPUs: the last column says what ran) or keep it beside the host nodes' team: release / "
                    "keep / keep,release")
    ap.add_argument("--defer", default="no", help="expert deferral (a layer's CPU experts join one layer late, "
                    "beside the next layer's GPU work; not exact): no / yes / no,yes; the last column counts the "
                    "layers that defer")
    ap.add_argument("--idle", action="store_true", help="per configuration, the share of decode time the GPU "
                    "(its kernels) and the CPU (its experts, timed by the host nodes) each sit idle")
    args = ap.parse_args()
    cache = parse_size(args.cache) if args.cache != "0" else 0
    print(f"model {args.model}, device {args.device}, {args.dtype}, greedy {args.tokens} tokens after 64")
    print(f"{'GPU share':>9} {'cache GiB':>9} {'graphs':>9} {'inline':>7} {'int4':>5} {'fused':>5} {'host':>5} {'wait':>5} {'pipe':>5} {'threads':>7} {'tok/s':>9} {'ms/token':>9} {'graph µs':>9} {'worker':>7} {'main team':>6} {'defer':>6}"
          + (f" {'launches':>9}" if args.profile else ""))
    yes = {"yes": True, "no": False}
    configs = [(frac, graphs, inline, int4, fused, host, block, pipe, threads, release, defer)
               for frac in (float(f) for f in args.fractions.split(","))
               for graphs in (yes.get(g.strip(), g.strip()) for g in args.graphs.split(","))
               for inline in (yes.get(i.strip()) for i in args.inline.split(","))
               for int4 in (i.strip() == "yes" for i in args.int4.split(","))
               for fused in (f.strip() == "yes" for f in args.fused.split(","))
               for host in (h.strip() == "yes" for h in args.host_nodes.split(","))
               for block in (w.strip() == "block" for w in args.wait.split(","))
               for pipe in (p.strip() == "yes" for p in args.pipeline.split(","))
               for threads in (None if t.strip() == "auto" else int(t) for t in args.threads.split(","))
               for release in (m.strip() == "release" for m in args.main_team.split(","))
               for defer in (d.strip() == "yes" for d in args.defer.split(","))]
    for _ in range(args.repeats):
        for config in configs:
            print(measure(args.model, config[0], cache, *config[1:], args), flush=True)


if __name__ == "__main__":
    main()
