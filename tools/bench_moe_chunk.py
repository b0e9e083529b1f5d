#!/usr/bin/env python3
"""A prompt chunk through a MoE layer's GPU experts: the chunk kernels (`hotcold.sparse_ops.moe_chunk_gpu`)
with each tile configuration asked, against the engine's default tiles and, as the path they
replaced, each group of 12 experts decoded to bf16 and three batched products (`group_products`).

Per chunk length (--tokens) and configuration: the kernel time of one chunk (median, CUDA events, L2
flushed before each call), the useful TFLOP/s (2 x 3 x pairs x D x I over that time), the rate of
the experts' 4-bit bytes read once, and the largest difference from the default tiles' output
relative to its largest value (a sanity check: only the summation order differs).

    python tools/bench_moe_chunk.py [--tokens 128,512,2048] [--experts 128] [--hidden 2048] [--inter 768]
        [--k 8] [--tiles "16,64,64,4,4;32,128,64,4,4,3;..."] [--iters 20]

A tile configuration is bm,bn_gu,bn_d,gk,warps[,stages] (moe_chunk_gpu.Tiles): pairs a block, rows of
gate/up and of down a program, 32-weight groups a K step, warps, pipeline stages. Every expert is on
the GPU and routed uniformly at random (the default shape is Qwen3-30B-A3B's). CUDA only.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_gpu_quant import FLUSH_BYTES, time_cuda  # tools/: the same L2-flushed CUDA-event timing

from hotcold.executors.expert_stream import Routes, group_products
from hotcold.sparse_ops.gpu import activation
from hotcold.sparse_ops.moe_chunk_gpu import TILES, Tiles, chunk_experts, chunk_kernels_ready
from hotcold.sparse_ops.moe_gpu import Q4Stack

GROUP = 12  # experts a group of the replaced path (its decode workspace)


def parse_tiles(spec: str) -> list[Tiles]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        v = [int(a) for a in part.split(",")]
        if len(v) not in (5, 6):
            raise ValueError(f"a tile configuration is bm,bn_gu,bn_d,gk,warps[,stages], got {part!r}")
        out.append(Tiles(bm=v[0], bn_gu=v[1], bn_d=v[2], gk=v[3], warps=v[4], stages=v[5] if len(v) == 6 else None))
    return out


def random_stack(E: int, n: int, k: int, gen: torch.Generator, dev) -> Q4Stack:
    """E matrices [n, k] of random 4-bit codes with small fp16 scales and zeros (speed does not depend on them)."""
    codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(E, n, k // 32, generator=gen) * 0.02 / k**0.5).half()
    zero = (torch.randn(E, n, k // 32, generator=gen) * 0.002 / k**0.5).half()
    return Q4Stack(codes.to(dev), scale.to(dev), zero.to(dev))


def grouped(x, ids, weights, gate: Q4Stack, up: Q4Stack, down: Q4Stack, act) -> torch.Tensor:
    """The replaced path: the routing on the host, GROUP experts decoded at a time, batched products."""
    E = gate.shape[0]
    routes = Routes.of(ids.cpu().numpy(), E)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    starts = range(0, E, GROUP)
    for a, picked in zip(starts, routes.padded([(a, min(E, a + GROUP)) for a in starts], weights)):
        if picked is not None:
            s = slice(a, a + GROUP)
            group_products(x, out, picked, *(m.dequantize(s, x.dtype) for m in (gate, up, down)), act)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,512,2048", help="chunk lengths (default 128,512,2048)")
    ap.add_argument("--experts", type=int, default=128, help="E, the layer's experts, all on the GPU (default 128)")
    ap.add_argument("--hidden", type=int, default=2048, help="D (default 2048)")
    ap.add_argument("--inter", type=int, default=768, help="I, neurons per expert (default 768)")
    ap.add_argument("--k", type=int, default=8, help="routed experts per token (default 8)")
    ap.add_argument("--tiles", default="", help="tile configurations to time beside the default, ';'-separated")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        configs = [TILES] + [t for t in parse_tiles(args.tiles) if t != TILES]
        lengths = [int(t) for t in args.tokens.split(",")]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    E, D, I, k = args.experts, args.hidden, args.inter, args.k
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    gate, up, down = random_stack(E, I, D, gen, dev), random_stack(E, I, D, gen, dev), random_stack(E, D, I, gen, dev)
    slot_of = torch.arange(E, dtype=torch.int32, device=dev)
    if not chunk_kernels_ready(dev, gate, up, down, slot_of):
        print("error: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    act = activation("silu")
    flush = torch.zeros(FLUSH_BYTES // 4, device=dev)
    weight_bytes = sum(m.nbytes for m in (gate, up, down))
    print(f"{torch.cuda.get_device_name(dev)}: {E} experts on the GPU, D {D}, I {I}, top-{k}, 4-bit; "
          f"kernel time per chunk, L2 flushed; {weight_bytes / 1e6:.0f} MB of experts")
    print("| tokens | path | ms | TFLOP/s | weights GB/s | rel. diff |")
    print("|---|---|---|---|---|---|")
    for N in lengths:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(dev)
        weights = torch.rand(N, k, generator=gen).to(dev)
        x = (torch.randn(N, D, generator=gen) / D**0.5).to(dev, torch.bfloat16)
        flops = 2 * 3 * N * k * D * I
        ref = chunk_experts(x, ids, weights, slot_of, gate, up, down, "silu", TILES)
        scale = ref.abs().max().item()
        rows = [(f"chunk {'default ' if t == TILES else ''}{t.bm},{t.bn_gu},{t.bn_d},{t.gk},{t.warps}"
                 + (f",{t.stages}" if t.stages else ""),
                 lambda t=t: chunk_experts(x, ids, weights, slot_of, gate, up, down, "silu", t)) for t in configs]
        rows.append((f"grouped ({GROUP} decoded a group)", lambda: grouped(x, ids, weights, gate, up, down, act)))
        for name, fn in rows:
            try:
                diff = (fn() - ref).abs().max().item() / scale
                t = time_cuda(fn, args.warmup, args.iters, flush)
            except Exception as e:  # a configuration Triton cannot build (shared memory, say): say so, go on
                print(f"| {N} | {name} | failed: {str(e).splitlines()[0][:80]} | | | |")
                continue
            print(f"| {N} | {name} | {1e3 * t:.3f} | {flops / t / 1e12:.1f} | {weight_bytes / t / 1e9:.0f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
