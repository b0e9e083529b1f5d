#!/usr/bin/env python3
"""Throughput of the GGUF-quantised CPU kernels (hotcold.sparse_ops.quant) against the f16 kernel and torch.

Per type, on an FFN of --rows neurons x --dim (llama-7B: 11008 x 4096), 1/8 of the rows selected:
  qgemv    qgemv_rows over up [I, D] (float x; for the types that have them also with Q8 activations, "xq")
  qaxpy    qaxpy_rows over down_t [I, D] (W_down [D, I] transposed, as the sparse down projection reads it)
  qffn     qffn_rows, SiLU-gated, same type for gate / up / down_t (gate / up with the type's default x,
           and "xq" with Q8 activations where they are not the default)
and on the same run and shape the f16 kernels (cpu.gemv_rows / axpy_rows / ffn_rows on a HostMatrix)
and torch's dense f32 / f16 matvec over all rows. GB/s counts the bytes actually read (quantised
bytes for the quantised kernels); Mrows/s is rows per second (selected rows; all rows for torch).
Best of --repeats, a fresh random sorted selection for every call; the numba kernels take turns
within a repeat, so that other processes' load hits them alike. With --flush-mb (e.g. 128, beyond
the L3 cache) the caches are evicted before each call, as when decoding a model larger than the L3.
Weights are random blocks (sane fp16 scales): speed does not depend on values.

    python tools/bench_quant.py [--rows 11008] [--dim 4096] [--frac 0.125] [--threads 2] [--repeats 10]
                                [--types Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K] [--flush-mb 0]
    python tools/bench_quant.py --baseline OLD_QUANT_DIR ...
        (e.g. mkdir /tmp/old && git archive HEAD sparse_ops/quant | tar -x -C /tmp/old: /tmp/old/sparse_ops/quant)
    python tools/bench_quant.py --requant [--gguf MODEL.gguf]
    python tools/bench_quant.py --xq-error [--rows 4096]

--baseline times an older copy of the sparse_ops/quant package on the same blocks, taking turns with the
current kernels (rows marked "(base)"): an A/B comparison that the machine's load hits alike.

--requant measures instead what `transpose_quantized` costs in accuracy: W_down [D, I] is quantised
as TYPE (our quantiser, from Gaussian weights), then transposed to [I, D] and requantised as the same
type or as Q8_0; relative RMS errors against the dequantised original ("extra") and against the float
weights ("total", next to the original quantisation's "orig"). With --gguf, the same on the real
ffn_down tensors of a GGUF file (their llama.cpp quantisation is the reference; no float weights).

--xq-error measures what Q8 activations cost: y = W x over Gaussian weights quantised as TYPE, x
Gaussian or with 8 outlier channels (x30); relative RMS error of y with xq against float x on the same
stored weights, and the total errors against the float weights (the rule for XQ_DEFAULT: xq only where
its error is lost in the weights' own).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np
import torch

from hotcold.sparse_ops import cpu, quant


def best_times(cases, sels, flush=None) -> list[float]:
    """Best wall time of each case's fn(selection). The cases take turns within each repeat, so that
    load from other processes hits them alike, each call with a selection of its own (a case that
    re-read the rows its neighbour just read would find them in the cache); one warm-up call each
    first (compilation). flush: an array summed before each timed call, to evict the caches."""
    for c in cases:
        c["fn"](sels[0])
    best = [float("inf")] * len(cases)
    for r in range(len(sels) // len(cases)):
        for i, c in enumerate(cases):
            s = sels[r * len(cases) + i]
            if flush is not None:
                flush.sum()
            t0 = time.perf_counter()
            c["fn"](s)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def row(name: str, nbytes: int, k: int, t: float) -> str:
    return f"{name:28} {nbytes / t / 1e9:8.1f} {k / t / 1e6:9.2f} {t * 1e6:10.0f}"


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    """RMS of a - b relative to the RMS of b."""
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b.astype(np.float64) ** 2)))


def requant(args) -> None:
    d, i = args.dim, 2048
    w = np.random.default_rng(0).standard_normal((d, i)).astype(np.float32) * 0.02
    print(f"W_down [{d}, {i}] Gaussian, quantised as TYPE, transposed with transpose_quantized "
          f"(relative RMS errors; extra = vs the dequantised original)")
    hdr = (f"{'type':5} {'orig':>7} {'same: extra':>12} {'total':>7} {'Q8_0: extra':>12} {'total':>7} "
           f"{'s / 4096x11008':>15}")
    print(hdr)
    print("-" * len(hdr))
    for name in args.types.split(","):
        m = quant.QuantMatrix.quantize(w, name)
        a = m.dequantize().T
        cells = [f"{rel_rms(a, w.T):7.4f}"]
        for kind in ("same", "Q8_0"):
            t0 = time.perf_counter()
            b = quant.transpose_quantized(m, kind).dequantize()
            dt = (time.perf_counter() - t0) * (4096 * 11008) / (d * i)
            cells += [f"{rel_rms(b, a):12.4f}", f"{rel_rms(b, w.T):7.4f}"]
        print(f"{name:5} {' '.join(cells)} {dt:15.1f}")
    if args.gguf:
        import gguf

        reader = gguf.GGUFReader(args.gguf)
        print(f"\n{args.gguf}: ffn_down tensors (extra relative RMS error of the transposed copy)")
        print(f"{'tensor':24} {'type':5} {'[D, I]':>12} {'same':>8} {'Q8_0':>8}")
        for t in [t for t in reader.tensors if "ffn_down" in t.name][: args.layers]:
            name = t.tensor_type.name
            if name not in quant.QTYPES:
                continue
            m = quant.QuantMatrix.from_gguf(t)
            a = m.dequantize().T
            cells = []
            for kind in ("same", "Q8_0"):
                try:
                    cells.append(f"{rel_rms(quant.transpose_quantized(m, kind).dequantize(), a):8.4f}")
                except ValueError:  # D not a multiple of the type's block size
                    cells.append(f"{'n/a':>8}")
            print(f"{t.name:24} {name:5} {str(list(m.shape)):>12} {' '.join(cells)}")


def xq_error(args) -> None:
    """What Q8 activations cost in accuracy, per type with xq kernels: y = W x over quantised Gaussian
    weights W [--rows, --dim], x Gaussian or with outlier channels; relative RMS errors of y."""
    n, d = args.rows, args.dim
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, d)).astype(np.float32) * 0.02
    x_gauss = rng.standard_normal(d).astype(np.float32)
    x_out = x_gauss.copy()
    x_out[rng.choice(d, d // 512, replace=False)] *= 30  # 8 channels of 4096 at 30x, as LLM activations have
    print(f"W [{n}, {d}] Gaussian quantised as TYPE, y = W x; relative RMS errors of y: xq vs float x on the "
          f"stored weights, and total against the float weights with float x / with xq (Gaussian x | outlier "
          f"channels)")
    hdr = f"{'type':5} {'xq vs stored':>14} {'total float x':>15} {'total xq':>15}"
    print(hdr)
    print("-" * len(hdr))
    for name in args.types.split(","):
        if name not in xq_types(quant):
            continue
        m = quant.QuantMatrix.quantize(w, name)
        cells = [[], [], []]
        for x in (x_gauss, x_out):
            y = w.astype(np.float64) @ x
            yf, yq = quant.qgemv(m, x, xq=False), quant.qgemv(m, x, xq=True)
            cells[0].append(rel_rms(yq, yf))
            cells[1].append(rel_rms(yf, y))
            cells[2].append(rel_rms(yq, y))
        print(f"{name:5} " + " ".join(f"{c[0]:7.4f}|{c[1]:<6.4f}".rjust(n) for c, n in zip(cells, (14, 15, 15))))


def load_baseline(path: str):
    """An older copy of the sparse_ops/quant package (its directory), imported as a package of its own
    (for A/B runs; its modules import each other relatively, so they load from the copy)."""
    spec = importlib.util.spec_from_file_location("hotcold_quant_baseline", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # numba's cache looks kernels' modules up by name
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=11008, help="I, FFN neurons (rows of up / down_t)")
    ap.add_argument("--dim", type=int, default=4096, help="D, hidden size (row length)")
    ap.add_argument("--frac", type=float, default=1 / 8, help="fraction of rows selected")
    ap.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: numba's)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--types", default=",".join(quant.QTYPES))
    ap.add_argument("--no-ffn", action="store_true", help="skip qffn_rows")
    ap.add_argument("--settle", type=float, default=0.5, help="seconds to let torch's threads go idle")
    ap.add_argument("--flush-mb", type=int, default=0,
                    help="read this many MiB before each timed call (> the L3 cache: rows come from DRAM)")
    ap.add_argument("--baseline", default=None, metavar="QUANT_DIR",
                    help="also time the kernels of this copy of an older sparse_ops/quant package, turn about")
    ap.add_argument("--requant", action="store_true", help="measure transpose_quantized's error instead")
    ap.add_argument("--xq-error", action="store_true", help="measure the error of Q8 activations (xq) instead")
    ap.add_argument("--gguf", default=None, help="with --requant: also a GGUF file's ffn_down tensors")
    ap.add_argument("--layers", type=int, default=4, help="with --gguf: how many ffn_down tensors")
    args = ap.parse_args()
    if args.requant:
        requant(args)
        return
    if args.xq_error:
        xq_error(args)
        return

    if args.threads:
        cpu.set_threads(args.threads)
        torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline) if args.baseline else None
    n, d = args.rows, args.dim
    k = max(1, round(n * args.frac))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(d, dtype=np.float32)
    coeff = rng.standard_normal(k, dtype=np.float32)
    out_k = np.empty(k, np.float32)
    out_d = np.zeros(d, np.float32)

    print(f"I={n} D={d} K={k} ({args.frac:.3g} selected), threads numba={cpu.get_threads()} "
          f"torch={torch.get_num_threads()}, best of {args.repeats}")
    cases = []  # dicts: section, name, bytes (read per call), rows (per call), fn(selection)
    f16 = [cpu.HostMatrix.from_torch((torch.randn(n, d) * 0.02).half()) for _ in range(3)]  # up, down_t, gate
    rb = f16[0].row_bytes()
    ref = "f16 (fp16 bits in a HostMatrix, cpu.py)"
    cases.append(dict(section=ref, name="f16 gemv_rows", bytes=k * rb, rows=k,
                      fn=lambda s: cpu.gemv_rows(f16[0], s, x, out_k)))
    cases.append(dict(section=ref, name="f16 axpy_rows", bytes=k * rb, rows=k,
                      fn=lambda s: cpu.axpy_rows(f16[1], s, coeff, out_d)))
    if not args.no_ffn:
        cases.append(dict(section=ref, name="f16 ffn_rows (x3 rows)", bytes=3 * k * rb, rows=k,
                          fn=lambda s: cpu.ffn_rows(x, s, f16[0], f16[1], "silu", gate=f16[2], out=out_d)))
    for name in args.types.split(","):
        cases += type_cases(name, args, k, x, coeff, out_k, out_d, baseline)
    sels = [np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
            for _ in range(args.repeats * (len(cases) + 2))]  # + the 2 torch cases below
    flush = np.ones(args.flush_mb << 18, np.float32) if args.flush_mb else None
    time.sleep(args.settle)  # torch's OpenMP threads spin a while after an op and slow numba's down
    best = best_times(cases, sels, flush)

    with torch.inference_mode():  # after the numba kernels, for the same reason
        w32 = torch.randn(n, d) * 0.02
        for dt in (torch.float32, torch.float16):
            wt, xt = w32.to(dt), torch.from_numpy(x).to(dt)
            cases.append(dict(section="torch dense matvec over all rows", name=f"torch mv {str(dt)[6:]}",
                              bytes=wt.numel() * wt.element_size(), rows=n,
                              fn=lambda s, wt=wt, xt=xt: torch.mv(wt, xt)))
        best += best_times(cases[len(best):], sels, flush)

    section = None
    for c, t in zip(cases, best):
        if c["section"] != section:
            section = c["section"]
            print(f"\n{section}")
            print(HDR)
            print("-" * len(HDR))
        print(row(c["name"], c["bytes"], c["rows"], t))


HDR = f"{'kernel':28} {'GB/s':>8} {'Mrows/s':>9} {'µs':>10}"


def type_cases(name, args, k, x, coeff, out_k, out_d, baseline=None) -> list[dict]:
    n, d = args.rows, args.dim
    up, down_t, gate = (quant.random_matrix(name, (n, d), seed=i) for i in (1, 2, 3))
    rb = up.row_bytes()
    sec = f"{name}: {rb} bytes per row of {d} ({8 * rb / d:.2f} bits/weight)"
    impls = [("", quant, up, down_t, gate)]
    if baseline is not None:  # the same blocks, wrapped in the baseline module's QuantMatrix
        impls.append((" (base)", baseline)
                     + tuple(baseline.QuantMatrix(m.data, name, m.shape) for m in (up, down_t, gate)))
    kernels = [("qgemv_rows", 1, lambda q, u, dt, g: lambda s: q.qgemv_rows(u, s, x, out_k, xq=False))]
    kernels.append(("qgemv_rows xq", 1, lambda q, u, dt, g: lambda s: q.qgemv_rows(u, s, x, out_k, xq=True)))
    kernels.append(("qaxpy_rows (down_t)", 1, lambda q, u, dt, g: lambda s: q.qaxpy_rows(dt, s, coeff, out_d)))
    if not args.no_ffn:  # gate / up with the type's default x (float or Q8, quant.formats.XQ_DEFAULT), and with Q8
        kernels.append(("qffn_rows (x3 rows)", 3,  # where that is not the default
                        lambda q, u, dt, g: lambda s: q.qffn_rows(x, s, u, dt, "silu", gate=g, out=out_d)))
        if name not in quant.formats.XQ_DEFAULT:
            kernels.append(("qffn_rows xq (x3 rows)", 3, lambda q, u, dt, g: lambda s: q.qffn_rows(
                x, s, u, dt, "silu", gate=g, out=out_d, xq=True)))
    return [dict(section=sec, name=kname + label, bytes=mult * k * rb, rows=k, fn=make(*impl))
            for kname, mult, make in kernels for label, *impl in impls
            if "xq" not in kname or name in xq_types(impl[0])]


def xq_types(q) -> tuple[str, ...]:
    """Types with Q8-activation kernels in a quant module (older copies: Q8_0 and Q4_0)."""
    return getattr(q, "_XQ_TYPES", ("Q8_0", "Q4_0"))


if __name__ == "__main__":
    main()
