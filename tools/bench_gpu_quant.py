#!/usr/bin/env python3
"""4-bit weights on the GPU, both ways: dequantised to bf16 at load (dense `F.linear(x, w)` = `x @ w.T`)
against kept int4 (`hotcold.sparse_ops.gpu_quant.Int4Matrix.mm`, torch's tinygemm kernel).

Per weight shape K x N (in x out) and token count M, the median time of each, the effective GB/s of
the weight bytes each reads (bf16: 2 N K; int4: N K / 2 codes + 4 N K / 32 of bf16 scale and zero),
the speed-up of int4 over bf16, the VRAM each holds, and the relative RMS difference of their outputs
(a sanity check: the same weights up to bf16 rounding). Weights are random GGUF blocks of --qtype
(speed does not depend on values; every type is group 32 for the kernel).

    python tools/bench_gpu_quant.py [--shapes 4096x4096,...] [--m 1,4,128] [--qtype Q4_K] [--iters 50]
    python tools/bench_gpu_quant.py --device cpu --shapes 2048x768 --iters 5      # the _for_cpu ops

CUDA timing: CUDA events around each call, after --warmup calls; before every timed call a 256 MiB
buffer is written so that the weights come from HBM, not the 50-60 MB L2 (decode reads cold expert
and layer weights), and the GPU has queued work while the call is launched, so the events measure
the kernel, not Python's launch overhead. --hot keeps the L2 warm instead: the GPU spins
(torch.cuda._sleep) before each timed call in place of the flush. CPU: wall time, median, no flush.
--wall adds each path's wall time per call over --iters calls back to back (host launch overhead
included, L2 warm: what an eager decode loop without CUDA graphs pays when its kernels are short).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hotcold.sparse_ops import quant
from hotcold.sparse_ops.gpu_quant import Int4Matrix, decode_int4, int4_unsupported_reason

SHAPES = "4096x4096,4096x11008,11008x4096,2048x768,5120x13824"  # K x N; 2048x768: a Qwen3-30B-A3B expert
FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 200_000  # --hot: ~100 us of GPU spin ahead of each timed call


def dense_weight(q: quant.QuantMatrix, device: torch.device) -> torch.Tensor:
    """q dequantised to bf16 [N, K] on device, as the dequantise-at-load path holds it."""
    p, scale, zero = decode_int4(q, device)
    codes = torch.stack([p >> 4, p & 15], dim=-1).reshape(q.rows, q.cols).float()  # [N, K]
    s = scale.repeat_interleave(32, dim=1)
    z = zero.repeat_interleave(32, dim=1)
    return ((codes - 8) * s + z).to(torch.bfloat16)


def time_cuda(fn, warmup: int, iters: int, flush: torch.Tensor | None) -> float:
    """Median seconds of fn() over iters calls, each between its own CUDA events; before each, flush
    is rewritten (L2 flushed) or, when None, the GPU spins (L2 kept)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.add_(1)  # evicts the weights from L2; also queues work ahead of the timed call
        else:
            torch.cuda._sleep(SLEEP_CYCLES)  # queued work ahead of the timed call, L2 untouched
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3


def time_wall(fn, iters: int, cuda: bool) -> float:
    """Wall seconds per call of fn() over iters calls back to back (after one call)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def time_cpu(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        raise SystemExit(f"error: --shapes: expected KxN[,KxN...], got {text!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--shapes", default=SHAPES, help=f"K x N list (default {SHAPES})")
    ap.add_argument("--m", default="1,4,128", help="tokens per call (default 1,4,128: decode and prefill)")
    ap.add_argument("--qtype", default="Q4_K", help="Q4_0 | Q4_1 | Q4_K (default Q4_K)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (default 100 CUDA, 5 CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10 CUDA, 1 CPU)")
    ap.add_argument("--hot", action="store_true", help="CUDA: do not flush the L2 between calls")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads")
    ap.add_argument("--wall", action="store_true", help="add wall time per call, calls back to back")
    ap.add_argument("--inner-k-tiles", type=int, default=None,
                    help="CUDA int4 layout: 2 | 4 | 8 (default: the largest that fits)")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(f"error: --device {args.device}: torch sees no CUDA GPU here; use --device cpu", file=sys.stderr)
            return 2
        if dev.index is not None:
            torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        print(f"error: --device {args.device}: expected cuda[:N] or cpu", file=sys.stderr)
        return 2
    cuda = dev.type == "cuda"
    iters = args.iters or (100 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = parse_shapes(args.shapes)
    ms = [int(v) for v in args.m.split(",")]
    for k, n in shapes:
        why = int4_unsupported_reason(args.qtype, dev, (n, k), args.inner_k_tiles)
        if why is not None:
            print(f"error: {args.qtype} {k}x{n} on {dev}: {why}", file=sys.stderr)
            return 2

    flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device=dev) if cuda and not args.hot else None
    name = torch.cuda.get_device_name(dev) if cuda else f"CPU, {torch.get_num_threads()} threads"
    tiles = f", inner_k_tiles {args.inner_k_tiles}" if args.inner_k_tiles else ""
    print(f"{name}, torch {torch.__version__}, {args.qtype} -> tinygemm int4 group 32{tiles}; "
          f"median of {iters} ({'L2 warm' if not cuda or args.hot else 'L2 flushed'})")
    hdr = (f"{'K x N':>12} {'M':>4} | {'bf16 us':>9} {'GB/s':>7} | {'int4 us':>9} {'GB/s':>7} | "
           f"{'speed-up':>8} | {'bf16 MiB':>8} {'int4 MiB':>8} | {'rel diff':>8}"
           + (f" | {'wall bf16':>9} {'int4 us':>7}" if args.wall else ""))
    print(hdr)
    print("-" * len(hdr))
    for k, n in shapes:
        q = quant.random_matrix(args.qtype, (n, k), seed=k + n)
        im = Int4Matrix.from_quant(q, dev, args.inner_k_tiles)
        w = dense_weight(q, dev)  # [N, K] bf16
        wbytes = w.numel() * w.element_size()
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)  # x: [M, K]
            dense, int4 = (lambda: F.linear(x, w)), (lambda: im.mm(x))  # x: [M, K] -> [M, N]
            y_dense, y_int4 = dense(), int4()
            diff = float((y_int4.float() - y_dense.float()).norm() / y_dense.float().norm())
            if cuda:
                t_dense = time_cuda(dense, warmup, iters, flush)
                t_int4 = time_cuda(int4, warmup, iters, flush)
            else:
                t_dense = time_cpu(dense, warmup, iters)
                t_int4 = time_cpu(int4, warmup, iters)
            wall = (f" | {time_wall(dense, iters, cuda) * 1e6:9.1f} {time_wall(int4, iters, cuda) * 1e6:7.1f}"
                    if args.wall else "")
            print(f"{f'{k}x{n}':>12} {m:>4} | {t_dense * 1e6:9.1f} {wbytes / t_dense / 1e9:7.1f} | "
                  f"{t_int4 * 1e6:9.1f} {im.nbytes / t_int4 / 1e9:7.1f} | {t_dense / t_int4:7.2f}x | "
                  f"{wbytes / 2**20:8.1f} {im.nbytes / 2**20:8.1f} | {diff:8.4f}{wall}")
        w = im = None  # free before the next shape
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
