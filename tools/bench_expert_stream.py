#!/usr/bin/env python3
"""Prefill's streamed MoE experts (`executors/expert_stream.ExpertStreamer`): one prompt chunk through
L layers whose host experts all stream, and where its time goes.

Every layer holds the same E random quantised experts (one host copy, pinned, interleaved as the
engine stores them); each chunk routes its N tokens to k experts drawn with a skew (expert e's
probability ∝ (e + 1)^-skew, as a profiled model's hot experts are). Rows, each the median over
--repeats chunks:

  whole        `ExpertStreamer.run` layer after layer (copies overlapping compute, as the engine runs)
  copies       only the groups' host-to-device copies, back to back (the PCIe bound)
  decode       only the groups' decode into the workspace (raw bytes already on the device): by the
               Triton kernel on CUDA, and a `decode-torch` row by the torch ops that K-quants take
  products     only the three batched products of each group (weights already decoded)

with tokens per second of the chunk, the PCIe rate of the copies and each part's share of `whole`.

    python tools/bench_expert_stream.py [--layers 28] [--tokens 512] [--experts 128] [--k 8]
        [--hidden 2048] [--inter 768] [--qtype Q4_0] [--skew 0.4] [--repeats 5] [--device cuda] [--workspace-mb 128] [--ops K]

The default shape is Qwen3-30B-A3B's, 28 layers streamed: a 48-layer model at 8 GiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from hotcold.executors.expert_stream import EXPERT_STREAM_BYTES, ExpertStreamer, Routes, group_products
from hotcold.executors.prefill import pin_host, unpin_host
from hotcold.executors.tier import FastTier
from hotcold.executors.weights import ColdFFN
from hotcold.sparse_ops.quant import pack_rows, random_matrix


def host_experts(E: int, D: int, I: int, qtype: str) -> ColdFFN:
    """E random experts as `host_quant_experts` keeps them: gate, up [E*I, D], down [E*D, I], packed."""
    mats = [pack_rows(random_matrix(qtype, shape, seed=s, scale=1e-2))
            for s, shape in enumerate(((E * I, D), (E * I, D), (E * D, I)))]
    return ColdFFN(idx=np.arange(E * I, dtype=np.int64), up=mats[1], gate=mats[0], down_t=None, up_bias=None,
                   act="silu", down=mats[2])


def routing(rng, N: int, E: int, k: int, skew: float) -> np.ndarray:
    p = (np.arange(E) + 1.0) ** -skew
    p /= p.sum()
    return np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(N)])


def sync(tier: FastTier) -> None:
    if tier.cuda:
        torch.cuda.synchronize(tier.device)


def timed(fn, tier: FastTier, repeats: int) -> float:
    fn()  # warm-up (allocations, kernels' first launches)
    out = []
    for _ in range(repeats):
        sync(tier)
        t0 = time.perf_counter()
        fn()
        sync(tier)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--skew", type=float, default=0.4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workspace-mb", type=int, default=EXPERT_STREAM_BYTES >> 20,
                    help="device MiB of the raw slots and the decoded group (the engine's EXPERT_STREAM_BYTES)")
    ap.add_argument("--ops", type=int, default=0, metavar="K",
                    help="also print the K ops of one `whole` chunk that took the most device time (torch.profiler)")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    tier = FastTier(torch.device(a.device), torch.bfloat16)
    cold = host_experts(a.experts, a.hidden, a.inter, a.qtype)
    pinned = pin_host(cold) if tier.cuda else []
    colds = {layer: cold for layer in range(a.layers)}
    s = ExpertStreamer(tier, colds, a.hidden, a.workspace_mb << 20)
    rng = np.random.default_rng(0)
    N, D = a.tokens, a.hidden
    x = (torch.randn(N, D, device=tier.device) * 0.1).to(tier.dtype)
    w = torch.softmax(torch.randn(N, a.k, device=tier.device), -1)
    ids = {layer: routing(rng, N, a.experts, a.k, a.skew) for layer in range(a.layers)}
    pos = np.arange(a.experts, dtype=np.int64)

    def whole():
        for layer in range(a.layers):
            s.run(layer, x, w, ids[layer], pos, F.silu)

    def copies():
        for k in range(len(s.order)):
            s._fetch(k)

    def decode():
        for k in range(len(s.order)):
            s.loaded[k % 2] = k  # the slot's bytes stand for group k's
            s._decode(k)

    dec = s._decode(0)
    picked = {}
    for layer in range(a.layers):
        bounds = [s.order[k][1:] for k in s._groups[layer]]
        picked[layer] = list(zip([hi - lo for lo, hi in bounds],
                                 Routes.of(pos[ids[layer]], a.experts).padded(bounds, w)))
    y = torch.zeros(N, D, dtype=torch.float32, device=tier.device)

    def products():
        for layer in range(a.layers):
            for g, p in picked[layer]:
                if p is not None:
                    group_products(x, y, p, *(dec[m][:g] for m in ("gate", "up", "down")), F.silu)

    times = {name: timed(fn, tier, a.repeats) for name, fn in
             (("whole", whole), ("copies", copies), ("decode", decode), ("products", products))}
    if a.ops:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if tier.cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            whole()
            sync(tier)
        key = "device_time_total" if tier.cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=a.ops))
    if s.kernel is not None:  # the K-quants' decoder, torch ops, on the same blocks
        s.kernel = None
        times["decode-torch"] = timed(decode, tier, a.repeats)
    moved = a.layers * sum(m.nbytes for m in (cold.gate, cold.up, cold.down))
    print(f"{a.layers} layers x {a.experts} experts ({a.qtype}, D {D}, I {a.inter}), chunk of {N} tokens, "
          f"top-{a.k}, skew {a.skew}, group {s.group} experts, {len(s.order)} groups, {tier.device}")
    print(f"{'part':<10} {'ms':>9} {'share':>7}  note")
    for name, t in times.items():
        note = {"whole": f"{N / t:,.0f} tok/s", "copies": f"{moved / t / 1e9:.1f} GB/s of {moved / 1e9:.2f} GB"}
        print(f"{name:<10} {t * 1e3:9.1f} {t / times['whole']:7.2f}  {note.get(name, '')}")
    unpin_host(pinned)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
