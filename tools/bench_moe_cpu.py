#!/usr/bin/env python3
"""A MoE layer's routed CPU experts for one token, three ways, over the same quantised experts:

  whole, interleaved  `qexperts` on stacks packed by `pack_rows` (what the engine builds where the
                      type allows: Q4_0 / Q4_1 / Q4_K / Q8_0 with Q8 activations)
  whole, GGUF rows    `qexperts` on the file's rows as they are
  W_down^T Q8_0       `qffn_rows` over the experts' gate/up rows with W_down transposed and
                      requantised to Q8_0 (the layout the engine used before: 1.9x Q4_0's bytes
                      for W_down, the neuron-sparse kernel of dense FFNs)

Per way: the median time of one call (k random distinct experts of E, a fresh draw each call, so
the weights come from DRAM once E is large), the weight bytes it reads and their rate, the host
bytes one expert holds, and its speed against the last row.

    python tools/bench_moe_cpu.py [--experts 64] [--k 8] [--hidden 2048] [--inter 768]
        [--qtype Q4_0] [--down-qtype Q4_0] [--threads N] [--iters 60]

The default shape is Qwen3-30B-A3B's (hidden 2048, experts of 768, top-8).

--prompt T,...: instead, a prompt chunk of T tokens (each routed to k random experts) through the
interleaved stacks three ways: one `qexperts` call per token; each routed expert decoded once for a
torch GEMM over its tokens (`qexpert_batch`: bfloat16 where the CPU has it, else float32); all of them
in one `qexperts_tokens` call (each expert's blocks read once for its tokens). Median of --iters / 10.

    python tools/bench_moe_cpu.py --prompt 8,64,256,1024

--gap-us G,...: instead, the interleaved `qexperts` call with the calling thread busy for G µs between
calls (the numba workers idle meanwhile, as in a decode, where a layer's GPU half and the copies come
between two layers' CPU experts): the median time of a call after each gap, so the cost of waking
the thread team shows against back-to-back calls (G = 0).

    python tools/bench_moe_cpu.py --k 2 --experts 128 --gap-us 0,100,400,2000
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hotcold.executors.weights import quant_cols_t
from hotcold.sparse_ops.cpu import get_threads, set_threads
from hotcold.sparse_ops import quant
from hotcold.sparse_ops.quant import (QuantMatrix, pack_rows, qexpert_batch, qexperts, qexperts_tokens, qffn_rows,
                                     random_matrix)


def random_experts(E: int, D: int, I: int, qtype: str = "Q4_0", down_qtype: str | None = None,
                   seed: int = 1) -> tuple[QuantMatrix, QuantMatrix, QuantMatrix]:
    """E random experts [D x I] in GGUF blocks, stacked as a file stores them: gate, up [E*I, D] and
    down [E*D, I] (each expert's W_down as GGUF stores it), from seeds seed, seed+1, seed+2. Small
    weights (scale 1e-3): silu is rarely exactly 0."""
    return (random_matrix(qtype, (E * I, D), seed=seed, scale=1e-3),
            random_matrix(qtype, (E * I, D), seed=seed + 1, scale=1e-3),
            random_matrix(down_qtype or qtype, (E * D, I), seed=seed + 2, scale=1e-3))


def packed_experts(mats) -> tuple[QuantMatrix, ...]:
    """(gate, up, down) stacks as the engine holds them (`host_quant_experts`): each row-interleaved by
    `pack_rows` where its type allows."""
    return tuple(pack_rows(m) for m in mats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64, help="E, CPU experts of the layer (default 64)")
    ap.add_argument("--k", type=int, default=8, help="routed experts per token (default 8)")
    ap.add_argument("--hidden", type=int, default=2048, help="D (default 2048)")
    ap.add_argument("--inter", type=int, default=768, help="I, neurons per expert (default 768)")
    ap.add_argument("--qtype", default="Q4_0", help="gate / up type (default Q4_0)")
    ap.add_argument("--down-qtype", default=None, help="W_down's type (default: --qtype)")
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--prompt", default=None, help="prompt chunks of T tokens instead, comma-separated (e.g. 64,256)")
    ap.add_argument("--gap-us", default=None, help="idle gaps between calls instead, in µs, comma-separated")
    args = ap.parse_args(argv)
    E, k, D, I = args.experts, args.k, args.hidden, args.inter
    dq = args.down_qtype or args.qtype
    set_threads(args.threads or os.cpu_count() or 1)

    print(f"building {E} experts [{D} x {I}], gate/up {args.qtype}, down {dq} ...", flush=True)
    gate, up, down = random_experts(E, D, I, args.qtype, dq)
    down_t = QuantMatrix(np.concatenate([quant_cols_t(QuantMatrix(down.data[e * D:(e + 1) * D], dq, (D, I))).data
                                         for e in range(E)]), "Q8_0", (E * I, D))
    packed = packed_experts((gate, up, down))
    rng = np.random.default_rng(0)
    if args.prompt:
        return prompt_table(args, packed, rng)
    x = rng.standard_normal(D).astype(np.float32)
    out = np.zeros(D, np.float32)
    scale = np.zeros(E * I, np.float32)
    if args.gap_us:
        return gap_table(args, packed, x, out, rng)

    def whole(mats):
        def call(ex, coef):
            qexperts(x, ex, coef, *mats, "silu", out=out)
        return call

    def transposed(ex, coef):
        order = np.argsort(ex)
        rows = np.concatenate([np.arange(e * I, (e + 1) * I) for e in ex[order]])
        scale[rows] = np.repeat(coef[order], I)
        qffn_rows(x, rows, up, down_t, "silu", gate, out=out, row_scale=scale)

    ways = [("whole, interleaved", whole(packed), gate.nbytes + up.nbytes + down.nbytes),
            ("whole, GGUF rows", whole((gate, up, down)), gate.nbytes + up.nbytes + down.nbytes),
            ("W_down^T Q8_0", transposed, gate.nbytes + up.nbytes + down_t.nbytes)]
    if not packed[0].interleaved and not packed[2].interleaved:
        ways.pop(0)  # (no interleaved layout for these types)
    times = {}
    for name, call, _ in ways:
        ts = []
        for it in range(args.iters + 5):
            ex = rng.choice(E, k, replace=False)
            coef = np.full(k, 1.0 / k, np.float32)
            t0 = time.perf_counter()
            call(ex, coef)
            ts.append(time.perf_counter() - t0)
        times[name] = float(np.median(ts[5:]))
    ref = times[ways[-1][0]]
    print(f"\n{get_threads()} threads, {k} of {E} experts per token\n")
    print(f"| {'layout':<20} | {'ms / token':>10} | {'MB read':>8} | {'GB/s':>6} | {'MB / expert':>11} | {'speed':>6} |")
    print(f"|{'-' * 22}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 13}|{'-' * 8}|")
    for name, _, nbytes in ways:
        t, per = times[name], nbytes / E
        print(f"| {name:<20} | {t * 1e3:>10.3f} | {k * per / 1e6:>8.2f} | {k * per / t / 1e9:>6.1f} | "
              f"{per / 1e6:>11.2f} | {ref / t:>5.2f}x |")
    return 0


def gap_table(args, mats, x, out, rng) -> int:
    """Median time of one interleaved `qexperts` call (k of E experts) after each idle gap."""
    E, k = args.experts, args.k
    expert_bytes = sum(m.nbytes for m in mats) / E
    coef = np.full(k, 1.0 / k, np.float32)
    qexperts(x, rng.choice(E, k, replace=False), coef, *mats, "silu", out=out)  # compiled, threads started
    print(f"\n{get_threads()} threads, {k} of {E} experts per call ({k * expert_bytes / 1e6:.2f} MB)\n")
    print(f"| {'gap µs':>7} | {'µs / call':>9} | {'p10 µs':>7} | {'GB/s':>6} |")
    print(f"|{'-' * 9}|{'-' * 11}|{'-' * 9}|{'-' * 8}|")
    for gap in (float(g) * 1e-6 for g in args.gap_us.split(",")):
        ts = []
        for _ in range(args.iters + 5):
            ex = rng.choice(E, k, replace=False)
            end = time.perf_counter() + gap
            while time.perf_counter() < end:  # the calling thread busy, the workers idle
                pass
            t0 = time.perf_counter()
            qexperts(x, ex, coef, *mats, "silu", out=out)
            ts.append(time.perf_counter() - t0)
        t = np.asarray(ts[5:])
        med = float(np.median(t))
        print(f"| {gap * 1e6:>7.0f} | {med * 1e6:>9.1f} | {np.percentile(t, 10) * 1e6:>7.1f} | "
              f"{k * expert_bytes / med / 1e9:>6.3g} |")  # 3 significant digits: tiny test shapes on a busy host
    return 0


def prompt_table(args, mats, rng) -> int:
    """--prompt: T tokens' routed experts three ways (see the module docstring)."""
    E, k, D = args.experts, args.k, args.hidden

    def per_token(X, ex, coef):
        out = np.zeros(X.shape, np.float32)
        for t in range(len(X)):
            qexperts(X[t], ex[t], coef[t], *mats, "silu", out=out[t])

    def gemm(X, ex, coef):
        out = np.zeros(X.shape, np.float32)
        for e in np.unique(ex):
            tok, slot = np.nonzero(ex == e)
            out[tok] += qexpert_batch(X[tok], int(e), *mats, "silu", coef[tok, slot])

    def tokens(X, ex, coef):
        qexperts_tokens(X, ex, coef, *mats, "silu")

    ways = [("qexperts per token", per_token), (f"qexpert_batch ({'bf16' if quant.ops.GEMM_BF16 else 'f32'} GEMM)", gemm),
            ("qexperts_tokens", tokens)]
    print(f"\n{get_threads()} threads, {k} of {E} experts per token, ms per prompt chunk (speed against the first)\n")
    print(f"| {'tokens':>6} | {'tokens an expert':>16} | " + " | ".join(f"{n:>26}" for n, _ in ways) + " |")
    print(f"|{'-' * 8}|{'-' * 18}|" + "|".join("-" * 28 for _ in ways) + "|")
    for T in (int(t) for t in args.prompt.split(",")):
        X = rng.standard_normal((T, D)).astype(np.float32)
        ex = np.array([np.sort(rng.choice(E, k, replace=False)) for _ in range(T)])
        coef = rng.random(ex.shape).astype(np.float32)
        times = []
        for _, call in ways:
            call(X, ex, coef)  # warm-up (compilation)
            ts = []
            for _ in range(max(3, args.iters // 10)):
                t0 = time.perf_counter()
                call(X, ex, coef)
                ts.append(time.perf_counter() - t0)
            times.append(float(np.median(ts)))
        print(f"| {T:>6} | {T * k / E:>16.1f} | " + " | ".join(f"{1e3 * t:>17.1f} ({times[0] / t:>4.2f}x)"
                                                           for t in times) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
