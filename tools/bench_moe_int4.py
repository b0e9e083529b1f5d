#!/usr/bin/env python3
"""A MoE layer's routed GPU experts for one token, both ways: bf16 stacks (the file's blocks expanded
at load) against 4-bit stacks (`Q4Stack`: the file's own codes, one fp16 scale and zero per 32
weights) — `hotcold.sparse_ops.moe_gpu.routed_experts`, two Triton kernels either way.

Per case: the kernel time of one call (median, CUDA events, L2 flushed before each call so the
experts come from HBM), the bytes of the k routed experts' weights it reads and their rate, the VRAM
one expert holds, the speed-up of 4 bits over bf16, and the relative difference of the two outputs
(a sanity check: the same weights up to bf16 rounding). A third row keeps W_down in bf16 beside
4-bit gate/up (as a Q4_K_M file's Q6_K down experts are expanded).

    python tools/bench_moe_int4.py [--experts 128] [--gpu 40] [--hidden 2048] [--inter 768] [--k 8]
        [--qtype Q4_K] [--iters 200]

The default shape is Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top-8). CUDA only.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_gpu_quant import FLUSH_BYTES, time_cuda  # tools/: the same L2-flushed CUDA-event timing

from hotcold.sparse_ops.moe_gpu import Q4Stack, routed_experts, triton_available
from hotcold.sparse_ops.quant import qdequantize, random_matrix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128, help="E, experts of the layer (default 128)")
    ap.add_argument("--gpu", type=int, default=40, help="G, of them on the GPU (default 40)")
    ap.add_argument("--hidden", type=int, default=2048, help="D (default 2048)")
    ap.add_argument("--inter", type=int, default=768, help="I, neurons per expert (default 768)")
    ap.add_argument("--k", type=int, default=8, help="routed experts per token, all on the GPU (default 8)")
    ap.add_argument("--qtype", default="Q4_K", help="Q4_0 | Q4_1 | Q4_K (default Q4_K)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not triton_available("cuda"):
        print("error: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    E, G, D, I, k = args.experts, args.gpu, args.hidden, args.inter, args.k
    if not k <= G <= E:
        print("error: need --k <= --gpu <= --experts", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    mats = {w: [random_matrix(args.qtype, shape, seed=3 * g + i) for g in range(G)]
            for i, (w, shape) in enumerate((("gate", (I, D)), ("up", (I, D)), ("down", (D, I))))}
    q4 = {w: Q4Stack.from_quant(m, dev) for w, m in mats.items()}
    bf = {w: torch.stack([torch.from_numpy(qdequantize(q)) for q in m]).to(dev, torch.bfloat16)
          for w, m in mats.items()}
    gen = torch.Generator().manual_seed(0)
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    on = torch.randperm(E, generator=gen)[:G]
    slot_of[on] = torch.arange(G, dtype=torch.int32)
    ids = on[torch.randperm(G, generator=gen)[:k]].to(dev)
    weights = torch.rand(k, generator=gen).to(dev)
    slot_of = slot_of.to(dev)
    x = torch.randn(D, generator=gen).to(dev, torch.bfloat16)
    flush = torch.zeros(FLUSH_BYTES // 4, device=dev)
    cases = {
        "bf16": (bf["gate"], bf["up"], bf["down"]),
        "4-bit": (q4["gate"], q4["up"], q4["down"]),
        "4-bit gate/up, bf16 down": (q4["gate"], q4["up"], bf["down"]),
    }
    print(f"{torch.cuda.get_device_name(dev)}: {k} routed of {G} GPU experts ({E} in the layer), "
          f"D {D}, I {I}, {args.qtype}; kernel time per token, L2 flushed")
    print(f"| stacks | us | weight MB read | GB/s | MB per expert | speed-up | rel. diff |")
    print("|---|---|---|---|---|---|---|")
    ref = None
    base_t = None
    for name, (g, u, d) in cases.items():
        y = routed_experts(x, ids, weights, slot_of, g, u, d, "silu")
        ref = y if ref is None else ref
        t = time_cuda(lambda: routed_experts(x, ids, weights, slot_of, g, u, d, "silu"), args.warmup, args.iters, flush)
        base_t = base_t or t
        per = sum((s.nbytes if isinstance(s, Q4Stack) else s.numel() * s.element_size()) for s in (g, u, d)) / G
        diff = float((y - ref).norm() / ref.norm())
        print(f"| {name} | {t * 1e6:.1f} | {k * per / 1e6:.1f} | {k * per / t / 1e9:.0f} | {per / 1e6:.2f} "
              f"| {base_t / t:.2f}x | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
