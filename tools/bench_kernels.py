#!/usr/bin/env python3
"""Throughput of the CPU sparse kernels (hotcold.sparse_ops.cpu) against torch, per storage kind.

For each kind (f32, f16, bf16, i8) prints GB/s of weight bytes actually read by gemv_rows,
axpy_rows and ffn_rows (gated: gate + up + down rows), and for comparison the dense torch matvec
over all rows and torch.index_select + matvec on the selected rows, plus the ratios of the numba
kernels' GB/s to the dense torch matvec. Every repeat uses a fresh random sorted selection, so the
selected rows are not in cache from the previous repeat. Best of --repeats.

    python tools/bench_kernels.py [--rows 32768] [--dim 4096] [--frac 0.125] [--threads 2] [--repeats 10]
                                  [--variants]

--variants also times the designs that were not kept, so the choice can be re-checked on another
machine: the reduction of axpy_rows split over D (each thread owns a slice of out) instead of
per-thread partial sums over chunks of rows, and ffn_rows as two phases (gemv_rows of gate and up,
activation in numpy, axpy_rows of down) instead of one fused pass.

torch has no int8 matvec: for i8 the torch columns and ratios use the f32 matrix (what one would
run instead), marked with *.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from hotcold.sparse_ops import cpu


@numba.njit(parallel=True, nogil=True, fastmath=True, cache=True)
def axpy_rows_split_d(w, s, rows, coeff, nt, out):
    """Variant not kept: out[D] += Σ_j coeff[j] * w[rows[j]], each thread owning a slice of D."""
    K, D = rows.shape[0], w.shape[1]
    blk = ((D + nt - 1) // nt + 15) // 16 * 16
    for b in numba.prange((D + blk - 1) // blk):
        lo, hi = b * blk, min(D, b * blk + blk)
        for j in range(K):
            r = rows[j]
            a = coeff[j] * s[r]
            for i in range(lo, hi):
                out[i] += a * cpu._widen(w[r, i])


def ffn_two_phase(x, rows, up, down, gate, out):
    """Variant not kept: gemv_rows of gate and up, silu in numpy, then axpy_rows of down."""
    a = cpu.gemv_rows(gate, rows, x)
    h = a / (1 + np.exp(-a)) * cpu.gemv_rows(up, rows, x)
    return cpu.axpy_rows(down, rows, h, out)


def best_time(fn, inputs) -> float:
    """Best wall time of fn(inp) over the inputs, after one warm-up call (compilation)."""
    fn(inputs[0])
    best = float("inf")
    for inp in inputs:
        t0 = time.perf_counter()
        fn(inp)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32768, help="N, rows of the matrix (neurons)")
    ap.add_argument("--dim", type=int, default=4096, help="D, row length (hidden size)")
    ap.add_argument("--frac", type=float, default=1 / 8, help="fraction of rows selected")
    ap.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: numba's)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kinds", default="f32,f16,bf16,i8")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds to sleep after torch work before timing numba kernels: torch's OpenMP "
                         "threads keep spinning a while after an op and slow numba's threads down")
    ap.add_argument("--variants", action="store_true", help="also time the designs not kept (see above)")
    args = ap.parse_args()

    if args.threads:
        cpu.set_threads(args.threads)
        torch.set_num_threads(args.threads)
    n, d = args.rows, args.dim
    k = max(1, round(n * args.frac))
    rng = np.random.default_rng(0)
    sels = [np.sort(rng.choice(n, k, replace=False)).astype(np.int64) for _ in range(args.repeats)]
    sels_t = [torch.from_numpy(s) for s in sels]
    x = rng.standard_normal(d, dtype=np.float32)
    coeff = rng.standard_normal(k, dtype=np.float32)
    # One matrix of N rows per role; gate/up/down distinct so ffn_rows reads 3 different row sets.
    base = [torch.randn(n, d) * 0.02 for _ in range(3)]

    print(f"N={n} D={d} K={k} ({args.frac:.3g} selected), threads numba={cpu.get_threads()} "
          f"torch={torch.get_num_threads()}, best of {args.repeats}, GB/s of weight bytes read")
    hdr = (f"{'kind':5} {'gemv_rows':>10} {'axpy_rows':>10} {'ffn_rows':>10} {'torch dense':>12} "
           f"{'torch idx+mv':>13} {'gemv/dense':>11} {'ffn/dense':>10} {'ffn µs':>9}")
    print(hdr)
    print("-" * len(hdr))
    variants = []
    for kind in args.kinds.split(","):
        mats = [cpu.HostMatrix.from_torch(b, kind) for b in base]
        gate, up, down = mats
        sel_bytes = k * up.row_bytes()
        tdtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i8": torch.float32}[kind]
        wt = base[0].to(tdtype)
        xt = torch.from_numpy(x).to(tdtype)
        out_k = np.empty(k, np.float32)
        out_d = np.zeros(d, np.float32)

        time.sleep(args.settle)  # let torch's OpenMP threads, busy after the conversions, go idle
        t_gemv = best_time(lambda s: cpu.gemv_rows(up, s, x, out_k), sels)
        t_axpy = best_time(lambda s: cpu.axpy_rows(down, s, coeff, out_d), sels)
        t_ffn = best_time(lambda s: cpu.ffn_rows(x, s, up, down, "silu", gate=gate, out=out_d), sels)
        if args.variants:
            t_split = best_time(lambda s: axpy_rows_split_d(down._w, down._s, s, coeff, cpu.get_threads(), out_d),
                                sels)
            t_two = best_time(lambda s: ffn_two_phase(x, s, up, down, gate, out_d), sels)
        with torch.inference_mode():
            t_dense = best_time(lambda s: torch.mv(wt, xt), sels)
            t_idx = best_time(lambda s: torch.mv(torch.index_select(wt, 0, s), xt), sels_t)
        dense_bytes = wt.numel() * wt.element_size()
        idx_bytes = k * d * wt.element_size()
        g = {"gemv": sel_bytes / t_gemv, "axpy": sel_bytes / t_axpy, "ffn": 3 * sel_bytes / t_ffn,
             "dense": dense_bytes / t_dense, "idx": idx_bytes / t_idx}
        g = {key: v / 1e9 for key, v in g.items()}
        star = "*" if kind == "i8" else " "
        print(f"{kind:5} {g['gemv']:10.1f} {g['axpy']:10.1f} {g['ffn']:10.1f} {g['dense']:11.1f}{star} "
              f"{g['idx']:12.1f}{star} {g['gemv'] / g['dense']:10.2f}x {g['ffn'] / g['dense']:9.2f}x "
              f"{t_ffn * 1e6:9.0f}")
        if args.variants:
            variants.append(f"{kind:5} axpy_rows {g['axpy']:.1f} GB/s, split over D {sel_bytes / t_split / 1e9:.1f};"
                            f"  ffn_rows fused {g['ffn']:.1f} GB/s, two phases {3 * sel_bytes / t_two / 1e9:.1f}")
        del mats, gate, up, down, wt
    if variants:
        print("\nvariants (GB/s):")
        print("\n".join(variants))


if __name__ == "__main__":
    main()
