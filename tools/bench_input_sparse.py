"""Input-sparse GEMV against the dense kernel, alternating within one run (issue 37).

For each GGUF block type, one matrix [rows, cols] is multiplied by a token whose smallest |x| entries
(a given share: the sparsity) are zero, by
  dense  the dense kernel on the row-interleaved matrix with Q8 activations (what decode runs),
  int    the integer input-major kernel (sparse_ops/input_sparse_int.py),
  float  the float32 input-major kernel (sparse_ops/input_sparse.py's Q4 / Q8 kinds),
in rounds that take every (variant, sparsity) once in turn; an entry's time in a round is that of
--calls calls in one jitted loop (as decode calls them: no Python dispatch, which is several
microseconds of an 11-argument call, more than a small matrix's product), divided by --calls; the
table shows the best round (on a shared machine the least disturbed one, for dense and sparse alike). The matrix is read from the cache after the first call (the
last-level cache of the 2-core VM this was written on holds 480 MiB: more than a model). The break-even
is the sparsity where the sparse kernel's time crosses the dense kernel's (linear between measured points).

  python tools/bench_input_sparse.py --types Q4_1,Q8_0 --threads 1 --sparsity 0,0.2,0.3,0.5,0.7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1].parent))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--types", default="Q4_0,Q4_1,Q8_0")
    p.add_argument("--sparsity", default="0,0.2,0.3,0.4,0.5,0.7")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls per entry and round, in one jitted loop")
    p.add_argument("--variants", default="dense,int,float")
    a = p.parse_args(argv)
    types_ = a.types.split(",")
    bad = [t for t in types_ if t not in ("Q4_0", "Q4_1", "Q8_0")]
    if bad:
        p.exit(2, f"error: --types: {bad[0]} is not one of Q4_0, Q4_1, Q8_0\n")
    try:
        sp = [float(s) for s in a.sparsity.split(",")]
    except ValueError:
        p.exit(2, f"error: --sparsity: '{a.sparsity}' is not a comma-separated list of numbers\n")
    if any(not 0 <= s < 1 for s in sp):
        p.exit(2, "error: --sparsity: each value must be in [0, 1)\n")
    variants = a.variants.split(",")
    if any(v not in ("dense", "int", "float") for v in variants) or "dense" not in variants:
        p.exit(2, "error: --variants: a comma-separated subset of dense,int,float that includes dense\n")
    if a.cols % 32 or a.rows < 1 or a.threads < 1 or a.rounds < 1 or a.calls < 1:
        p.exit(2, "error: --cols must be a multiple of 32; --rows, --threads, --rounds, --calls >= 1\n")
    return a, types_, sp, variants


def _crossing(sp, sparse, dense):
    # the sparsity where sparse(s) == dense (linear between points), or None if it never gets there
    d = [s - dense for s in sparse]
    if d[0] <= 0:
        return sp[0]
    for i in range(1, len(sp)):
        if d[i] <= 0:
            return sp[i - 1] + (sp[i] - sp[i - 1]) * d[i - 1] / (d[i - 1] - d[i])
    return None


def _loops():
    from numba import njit

    from hotcold.sparse_ops.input_sparse import im_kernel
    from hotcold.sparse_ops.quant import qgemv_x8_kernel

    @njit(nogil=True)
    def dense(n, qt, w, x, out):
        for _ in range(n):
            qgemv_x8_kernel(qt, w, x, out)

    @njit(nogil=True)
    def sparse(n, x, out, kind, thr, wf, wh, codes, d, m, counter, tasks):
        for _ in range(n):
            im_kernel(x, out, kind, thr, wf, wh, codes, d, m, counter, tasks)

    return dense, sparse


def main(argv=None) -> int:
    a, types_, sps, variants = _args(argv)
    from hotcold.sparse_ops.cpu import set_threads
    from hotcold.sparse_ops.input_sparse import input_major
    from hotcold.sparse_ops.quant import QuantMatrix, pack_rows

    dense_loop, sparse_loop = _loops()

    set_threads(a.threads)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(a.cols).astype(np.float32)
    xs = {}
    for s in sps:
        x = x0.copy()
        x[np.argsort(np.abs(x))[: int(round(s * a.cols))]] = 0.0
        xs[s] = x
    out = np.empty(a.rows, np.float32)
    print(f"{a.rows}x{a.cols}, {a.threads} thread(s), {a.rounds} rounds x {a.calls} calls")
    for qt in types_:
        w = rng.standard_normal((a.rows, a.cols)).astype(np.float32)
        base = QuantMatrix.quantize(w, qt)
        dm = pack_rows(QuantMatrix.quantize(w, qt), xq=True)
        ims = {v: input_major(base, 0.0, integer=v == "int") for v in variants if v != "dense"}
        nbytes = dm.data.nbytes

        def call(v, x, n):
            if v == "dense":
                dense_loop(n, dm._id, dm.data, x, out)
            else:
                sparse_loop(n, x, out, *ims[v].args())

        entries = [("dense", None)] + [(v, s) for v in variants if v != "dense" for s in sps]
        for v, s in entries:  # compile and warm
            call(v, xs[s if s is not None else 0.0], 2)
        times = {e: [] for e in entries}
        for _ in range(a.rounds):
            for e in entries:
                v, s = e
                x = xs[s if s is not None else 0.0]
                t = time.perf_counter()
                call(v, x, a.calls)
                times[e].append((time.perf_counter() - t) / a.calls)
        med = {e: min(t) for e, t in times.items()}
        dense = med[("dense", None)]
        print(f"\n{qt}: dense {dense * 1e3:.3f} ms ({nbytes / dense / 1e9:.1f} GB/s of its {nbytes / 1e6:.1f} MB)")
        print("  sparsity " + "".join(f"{s:>8.0%}" for s in sps))
        for v in variants:
            if v == "dense":
                continue
            row = [med[(v, s)] for s in sps]
            cross = _crossing(sps, row, dense)
            print(f"  {v:<6} ms " + "".join(f"{t * 1e3:8.3f}" for t in row))
            print(f"  {v:<6} x  " + "".join(f"{dense / t:8.2f}" for t in row)
                  + f"   break-even {'none measured' if cross is None else f'{cross:.0%}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
