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
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hotcold.executors.weights import quant_cols_t
from hotcold.sparse_ops.cpu import get_threads, set_threads
from hotcold.sparse_ops.quant import QuantMatrix, pack_rows, qexperts, qffn_rows, random_matrix


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
    args = ap.parse_args(argv)
    E, k, D, I = args.experts, args.k, args.hidden, args.inter
    dq = args.down_qtype or args.qtype
    set_threads(args.threads or os.cpu_count() or 1)

    print(f"building {E} experts [{D} x {I}], gate/up {args.qtype}, down {dq} ...", flush=True)
    gate = random_matrix(args.qtype, (E * I, D), seed=1, scale=1e-3)  # small weights: silu is rarely exactly 0
    up = random_matrix(args.qtype, (E * I, D), seed=2, scale=1e-3)
    down = random_matrix(dq, (E * D, I), seed=3, scale=1e-3)  # each expert's W_down as GGUF stores it
    down_t = QuantMatrix(np.concatenate([quant_cols_t(QuantMatrix(down.data[e * D:(e + 1) * D], dq, (D, I))).data
                                         for e in range(E)]), "Q8_0", (E * I, D))
    packed = tuple(pack_rows(m) for m in (gate, up, down))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(D).astype(np.float32)
    out = np.zeros(D, np.float32)
    scale = np.zeros(E * I, np.float32)

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


if __name__ == "__main__":
    raise SystemExit(main())
