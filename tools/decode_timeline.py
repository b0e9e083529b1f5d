#!/usr/bin/env python3
"""Where a hybrid engine's decode step spends its host time: wall-clock wrappers on the engine's calls.

Greedy-decodes --tokens tokens after a 64-token prompt with the engine's calls wrapped (the layer's
graphed forward, graph replays, the host half of split steps, CPU jobs, the CPU expert kernel,
CUDA event waits, a HostBlock's step and its host share (one compiled call, LayerHostNode, or the
module path's host half); on a CPU tier the hybrid layers' forward)
and prints, per call, how often it runs per token and its median and total host time per token,
the CPU time inside the graphs' host nodes (their own clocks: they run on CUDA's thread, outside
any wrapper; a graphed HostBlock's LayerHostNode among them), then the timeline of one token (every wrapped call from the step's start to the next
step's). cProfile cannot show this: it charges a replay the GPU time it waits behind, and it sees
the calling thread only.

    python tools/make_model.py qwen3-30b-a3b --layers 6 --dtype q4_0 --format gguf --calib-tokens 16 --out M
    python tools/decode_timeline.py M/model.gguf --device cuda --fraction 0.5 --threads 15
    python tools/decode_timeline.py M/model.gguf --device cuda --plan M/p1.5   # by a plan
    python tools/decode_timeline.py D/model.gguf --fraction 0.1 --attention-cpu 0,1   # a dense model, no predictors
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

import hotcold.executors.graphs as graphs
import hotcold.executors.host_block as host_block
import hotcold.executors.hybrid as hybrid
import hotcold.executors.layer_node as layer_node
import hotcold.executors.moe as moe
import hotcold.executors.moe_host as moe_host
from hotcold.errors import HotcoldError
from hotcold.executors import make_hybrid, random_hot
from hotcold.executors.cpu_executor import ColdJob
from hotcold.executors.from_plan import open_for_run
from hotcold.executors.moe import random_experts
from hotcold.models.generate import Generator
from hotcold.models.loader import load_model
from hotcold.models.sampling import SamplingParams
from hotcold.models.transformer import Transformer

# (owner, attribute, label): what gets wrapped
CALLS = [
    (Transformer, "forward", "step"),
    (graphs.GraphedBlock, "forward", "layer"),
    (host_block.HostBlock, "forward", "host.block"),
    (host_block.HostBlock, "_host_half", "host.half"),
    (layer_node.LayerHostNode, "__call__", "host.node"),
    (moe.HybridMoE, "forward", "moe.forward"),
    (hybrid.HybridFFN, "forward", "ffn.forward"),
    (moe.HybridMoE, "graph_send", "send"),
    (hybrid.HybridFFN, "graph_send", "send"),
    (moe.HybridMoE, "graph_post", "post"),
    (hybrid.HybridFFN, "graph_post", "post"),
    (moe.HybridMoE, "_receive", "receive"),
    (hybrid.HybridFFN, "_receive", "receive"),
    (moe_host.MoEJob, "run", "job.run"),
    (ColdJob, "run", "job.run"),
    (moe_host, "qexperts_routed", "qexperts"),  # one token's routed experts (decode)
    (moe_host, "qexperts_trusted", "qexperts"),
]
if torch.cuda.is_available():
    CALLS += [(torch.cuda.CUDAGraph, "replay", "replay"), (torch.cuda.Event, "synchronize", "event.sync")]


class Recorder:
    """Wraps CALLS; while `on`, records (label, start, end, thread) of every call."""

    def __init__(self):
        self.events: list[tuple[str, float, float, str]] = []
        self.on = False
        self._saved = []
        for owner, name, label in CALLS:
            f = getattr(owner, name)
            self._saved.append((owner, name, f))
            setattr(owner, name, self._wrap(f, label))

    def _wrap(self, f, label):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                if self.on:
                    self.events.append((label, t0, time.perf_counter(), threading.current_thread().name))
        return wrapped

    def restore(self) -> None:
        for owner, name, f in self._saved:
            setattr(owner, name, f)


def node_clocks(eng) -> dict[int, tuple[float, int]]:
    """Per hybrid layer with a host node (dense cold rows, MoE CPU experts, or a graphed HostBlock's
    whole host share): (busy seconds, calls) so far."""
    out = {}
    for l, f in (*eng.layers.items(), *eng.moe.items()):
        node = getattr(f, "_node", None)
        if node is not None:
            out[l] = (node.busy_s, node.calls)
    for l, b in enumerate(eng.lm.model.layers):
        if isinstance(b, host_block.HostBlock) and b._graph is not None:
            out[l] = (b._node.busy_s, b._node.calls)
    return out


def report(rec: Recorder, steps: list[float], tokens: int, nodes: dict[int, tuple[float, int]] | None = None) -> str:
    """The per-call table, the host nodes' CPU time, and one token's timeline (the steps' starts mark
    the tokens)."""
    lines = [f"decode step median {1e6 * statistics.median(steps):.0f} µs ({1 / statistics.median(steps):.1f} tok/s)",
             f"{'call':12} {'per token':>9} {'median µs':>10} {'µs/token':>9}"]
    by = defaultdict(list)
    for label, a, b, _ in rec.events:
        by[label].append(b - a)
    for label, v in by.items():
        lines.append(f"{label:12} {len(v) / tokens:9.1f} {1e6 * statistics.median(v):10.1f} {1e6 * sum(v) / tokens:9.1f}")
    busy = {l: (s, c) for l, (s, c) in (nodes or {}).items() if c}
    if busy:
        lines.append(f"{'host nodes':12} {sum(c for _, c in busy.values()) / tokens:9.1f} "
                     f"{1e6 * statistics.median(s / c for s, c in busy.values()):10.1f} "
                     f"{1e6 * sum(s for s, _ in busy.values()) / tokens:9.1f}")
    first = next((k for k in ("step", "layer", "moe.forward", "ffn.forward") if k in by), None)
    if first is None:
        return "\n".join(lines)
    starts = [a for label, a, _, _ in rec.events if label == first]
    per = len(starts) // tokens
    if per == 0 or len(starts) < per * (tokens // 2 + 1) + 1:
        return "\n".join(lines)
    k = tokens // 2
    t0, t1 = starts[k * per], starts[(k + 1) * per]
    lines.append(f"timeline of token {k} ({1e6 * (t1 - t0):.0f} µs), µs from its start:")
    for label, a, b, th in sorted(rec.events, key=lambda e: e[1]):
        if t0 <= a < t1:
            lines.append(f"  {1e6 * (a - t0):8.1f} .. {1e6 * (b - t0):8.1f}  {label:12} {th}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model folder or GGUF")
    ap.add_argument("--plan", type=Path, help="run by this plan (otherwise: --fraction of a MoE's experts on the fast tier)")
    ap.add_argument("--fraction", type=float, default=0.5, help="share of each MoE layer's experts on the fast tier (random)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: one per core, less one)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--attention-cpu", default="", help="without --plan: layers (e.g. 0,1) whose attention runs "
                    "on the CPU; with no predictors they decode as HostBlocks")
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    if not 0.0 <= args.fraction <= 1.0:
        ap.error("--fraction must be between 0 and 1")
    try:
        attention_cpu = {int(l) for l in args.attention_cpu.split(",") if l.strip()}
    except ValueError:
        ap.error("--attention-cpu must be layer numbers separated by commas")
    try:
        if args.plan is not None:
            eng = open_for_run(Path(args.model), args.plan, device=args.device, dtype=args.dtype, threads=args.threads)
        else:
            lm = load_model(args.model, "cpu", args.dtype)
            if attention_cpu and not all(0 <= l < lm.config.num_layers for l in attention_cpu):
                ap.error(f"--attention-cpu names a layer outside 0..{lm.config.num_layers - 1}")
            moe_model = any(lm.config.ffn_kind(l) == "moe" for l in range(lm.config.num_layers))
            eng = make_hybrid(lm, {} if moe_model else random_hot(lm, args.fraction), None, device=args.device,
                              gpu_experts=random_experts(lm, args.fraction) if moe_model else None, stats=False,
                              threads=args.threads, gpu_int4=args.device != "cpu", attention_cpu=attention_cpu)
    except HotcoldError as e:
        sys.exit(f"error: {e}")
    rec = Recorder()
    try:
        gen = Generator(eng.lm, 512)
        prompt, greedy = list(range(100, 164)), SamplingParams(temperature=0.0)
        for _ in gen.generate(prompt, 4, greedy, ignore_eos=True):  # graphs captured, kernels compiled
            pass
        nodes0 = node_clocks(eng)
        stamps = [time.perf_counter()]
        rec.on = True
        for _ in gen.generate(prompt, args.tokens + 1, greedy, ignore_eos=True):
            stamps.append(time.perf_counter())
        rec.on = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the last step's host nodes have run
        nodes = {l: (s - nodes0.get(l, (0.0, 0))[0], c - nodes0.get(l, (0.0, 0))[1])
                 for l, (s, c) in node_clocks(eng).items()}
        # the first token comes from the prompt's prefill: keep the calls of the decode steps after it
        rec.events = [e for e in rec.events if e[1] >= stamps[1]]
        print(report(rec, [b - a for a, b in zip(stamps[1:], stamps[2:])], args.tokens, nodes))
    finally:
        rec.restore()
        eng.close()


if __name__ == "__main__":
    main()
