#!/usr/bin/env python3
"""Throughput of the CPU sparse kernels (hotcold.sparse_ops.cpu) against torch, per storage kind.

For each kind (f32, f16, bf16, i8) prints GB/s of weight bytes actually read by gemv_rows,
axpy_rows and ffn_rows (gated: gate + up + down rows), and for comparison the dense torch matvec
over all rows and torch.index_select + matvec on the selected rows, plus the ratios of the numba
kernels' GB/s to the dense torch matvec. Every repeat uses a fresh random sorted selection, so the
selected rows are not in cache from the previous repeat. Best of --repeats.

    python tools/bench_kernels.py [--rows 32768] [--dim 4096] [--frac 0.125] [--threads 2] [--repeats 10]
                                  [--variants]
    python tools/bench_kernels.py --llama [--layers 2048x8192,4096x4096,4096x11008] [--kinds f16,bf16,f32]
                                  [--threads 2] [--rounds 8] [--tokens 6]

--variants also times the designs that were not kept, so the choice can be re-checked on another
machine: the reduction of axpy_rows split over D (each thread owns a slice of out) instead of
per-thread partial sums over chunks of rows, and ffn_rows as two phases (gemv_rows of gate and up,
activation in numpy, axpy_rows of down) instead of one fused pass.

torch has no int8 matvec: for i8 the torch columns and ratios use the f32 matrix (what one would
run instead), marked with *.

--llama compares the dense one-token GEMV (`cpu.gemv`, what the CPU-placed dense layers run) with
llama.cpp (llama-cpp-python) on the same weight bytes. Per layer shape DxF and kind it writes a
one-layer llama GGUF (hidden D, FFN F, 256-token embedding and head, no tokenizer) and times
llama.cpp's one-token decode of it; ours is the same eight matrices (q, k, v, o [D, D], gate, up
[F, D], down [D, F], head [256, D]) through `cpu.gemv` one after the other. llama.cpp's rate is its
whole decode of that model divided into the matrices' bytes: its token also does the norms, rotary,
attention over a few positions and the sampling bookkeeping of `Llama.eval`, a few per cent of a token
at these sizes, which counts against it. Both sides run in this process, alternating: per round
--tokens tokens of llama.cpp then --tokens of ours (each the best of its tokens), with --settle
seconds between them for the other side's threads to go idle; printed: each side's best GB/s over
the rounds and the median over rounds of ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import tempfile
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


HEAD_VOCAB = 256  # the one-layer GGUF's embedding and head rows: their bytes are noise beside the layer's
_ELEM = {"f32": 4, "f16": 2, "bf16": 2}


def layer_shapes(d: int, f: int) -> list[tuple[str, int, int]]:
    """The matrices of a one-layer llama model with hidden d and FFN f, as (GGUF name, rows, columns)."""
    return ([(f"blk.0.attn_{n}.weight", d, d) for n in ("q", "k", "v", "output")]
            + [("blk.0.ffn_gate.weight", f, d), ("blk.0.ffn_up.weight", f, d), ("blk.0.ffn_down.weight", d, f),
               ("output.weight", HEAD_VOCAB, d)])


def random_matrix(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """N(0, 0.02) weights in kind's storage: float32, float16, or bf16 bits as uint16 (rounded to nearest even)."""
    a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    if kind == "f32":
        return a
    if kind == "f16":
        return a.astype(np.float16)
    b = a.view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def cpu_storage(kind: str):
    """HostMatrix's storage dtype of kind (fp16 bits as uint16)."""
    return np.float32 if kind == "f32" else np.uint16


def write_layer_gguf(path: str, d: int, f: int, kind: str, seed: int = 0) -> None:
    """A one-layer llama GGUF (hidden d, FFN f, d / 128 heads, HEAD_VOCAB tokens, no tokenizer) of kind's weights."""
    import gguf

    heads = max(1, d // 128)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(512)
    w.add_embedding_length(d)
    w.add_block_count(1)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // heads)
    w.add_vocab_size(HEAD_VOCAB)
    w.add_tokenizer_model("no_vocab")
    rng = np.random.default_rng(seed)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, np.ones(d, np.float32))
    for name, rows, cols in [("token_embd.weight", HEAD_VOCAB, d)] + layer_shapes(d, f):
        a = random_matrix(rng, rows, cols, kind)
        if kind == "bf16":
            w.add_tensor(name, a, raw_shape=(rows, cols), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dense_vs_llama(args) -> None:
    """--llama: cpu.gemv against llama.cpp's one-token decode of a one-layer GGUF (see the module docstring)."""
    from llama_cpp import Llama

    threads = args.threads or cpu.get_threads()
    cpu.set_threads(threads)
    print(f"dense one-token GEMV, ours (cpu.gemv) against llama.cpp on a one-layer GGUF, {threads} threads, "
          f"{args.rounds} rounds of {args.tokens} tokens each; GB/s of weight bytes per token")
    hdr = f"{'layer':>11} {'kind':5} {'MB':>6} {'ours':>7} {'llama.cpp':>10} {'ours/llama':>11}   ours per matrix (GB/s)"
    print(hdr)
    print("-" * len(hdr))
    for shape in args.layers.split(","):
        d, f = (int(v) for v in shape.lower().split("x"))
        for kind in args.kinds.split(","):
            if kind not in _ELEM:
                raise SystemExit(f"--llama kinds: f32, f16, bf16; got {kind!r}")
            rng = np.random.default_rng(1)
            mats = [cpu.HostMatrix(random_matrix(rng, r, c, kind).view(cpu_storage(kind)), kind)
                    for _, r, c in layer_shapes(d, f)]
            nbytes = sum(m.data.nbytes for m in mats)
            xs = [rng.standard_normal(m.shape[1], dtype=np.float32) for m in mats]
            outs = [np.empty(m.shape[0], np.float32) for m in mats]
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "layer.gguf")
                write_layer_gguf(path, d, f, kind)
                llm = Llama(path, n_ctx=512, n_batch=32, n_threads=threads, n_threads_batch=threads, verbose=False)

            def ours() -> None:
                for m, x, o in zip(mats, xs, outs):
                    cpu.gemv(m, x, o)

            per = [float("inf")] * len(mats)
            ratios, best_ours, best_llama = [], float("inf"), float("inf")
            ours()
            llm.eval([0])
            for _ in range(args.rounds):
                llm.reset()
                t_l = float("inf")
                for i in range(args.tokens):
                    t0 = time.perf_counter()
                    llm.eval([i % HEAD_VOCAB])
                    t_l = min(t_l, time.perf_counter() - t0)
                time.sleep(args.settle)
                t_o = float("inf")
                for _ in range(args.tokens):
                    t0 = time.perf_counter()
                    for j, (m, x, o) in enumerate(zip(mats, xs, outs)):
                        t1 = time.perf_counter()
                        cpu.gemv(m, x, o)
                        per[j] = min(per[j], time.perf_counter() - t1)
                    t_o = min(t_o, time.perf_counter() - t0)
                time.sleep(args.settle)
                ratios.append(t_l / t_o)
                best_ours, best_llama = min(best_ours, t_o), min(best_llama, t_l)
            del llm
            rates = " ".join(f"{m.data.nbytes / t / 1e9:.1f}" for m, t in zip(mats, per))
            print(f"{shape:>11} {kind:5} {nbytes / 1e6:6.0f} {nbytes / best_ours / 1e9:7.1f} "
                  f"{nbytes / best_llama / 1e9:10.1f} {float(np.median(ratios)):10.2f}x   {rates}")


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
    ap.add_argument("--llama", action="store_true", help="dense GEMV against llama.cpp instead (see above)")
    ap.add_argument("--layers", default="2048x8192,4096x4096,4096x11008",
                    help="--llama: one-layer model shapes, hidden x FFN, comma-separated")
    ap.add_argument("--rounds", type=int, default=8, help="--llama: alternating rounds")
    ap.add_argument("--tokens", type=int, default=6, help="--llama: tokens per side and round")
    args = ap.parse_args()
    if args.llama:
        if args.kinds == ap.get_default("kinds"):
            args.kinds = "f16,bf16,f32"
        return dense_vs_llama(args)

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
