"""Input sparsity at run time: the profile's thresholds on every projection's input (TEAL).

`apply_input_sparsity(model, thresholds)` gives each projection of a thresholded group (q/k/v, o,
gate/up, down; profiler/input_sparsity.py) its threshold, and on the CPU its weights input-major
(`sparse_ops.input_sparse.InputMajor`) where the weight format has that form (float32, float16,
Q4_0, Q4_1, Q8_0). Then:

- a one-token product on the CPU reads only the weights of the inputs above the threshold (the fused
  quantised block step, models/cpu_step.py, and the module path, models/layers.py `project`);
- every other product (prefill, other formats, CUDA) zeroes the inputs at or below the threshold and
  multiplies dense, so every path computes the same thresholded model the profile measured.

The input-major copy is kept beside the row-major weights, which prefill (several tokens) reads whole:
RAM holds the thresholded matrices twice (a model's prefill is compute-bound, its decode reads the
input-major copy alone).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hotcold.machine import busy as machine_busy, llc_bytes
from hotcold.profiler.input_sparsity import GROUPS, group_modules


@dataclass
class InputSparsity:
    """What apply_input_sparsity did: per projection (its rows, its counter [inputs kept, inputs seen]),
    and the projections multiplied dense after thresholding (no input-major form)."""

    counters: list[tuple[int, np.ndarray]] = field(default_factory=list)
    input_major: int = 0  # projections with an input-major copy
    dense: list[str] = field(default_factory=list)  # "layer.group: why" of the others
    extra_bytes: int = 0  # host bytes of the input-major copies

    def achieved(self) -> float | None:
        """Share of the thresholded projections' weights skipped on the one-token products so far
        (each projection's skipped inputs weighted by its rows); None before any."""
        seen = sum(rows * int(c[1]) for rows, c in self.counters)
        if not seen:
            return None
        return 1.0 - sum(rows * int(c[0]) for rows, c in self.counters) / seen

    def reset(self) -> None:
        for _, c in self.counters:
            c[:] = 0


def thresholds_from_profile(profile) -> dict[int, dict[str, float]] | None:
    """{layer: {group: threshold}} from a loaded profile, or None when it has none above 0."""
    if not profile.input_threshold or profile.meta.get("input_sparsity", {}).get("chosen", 0) <= 0:
        return None
    return {l: {g: float(t[i]) for i, g in enumerate(GROUPS)} for l, t in profile.input_threshold.items()}


def sparsities_from_profile(profile) -> dict[int, dict[str, float]] | None:
    """{layer: {group: sparsity}} of the chosen level's allocation in a profile, or None."""
    im = profile.meta.get("input_sparsity", {})
    rows = im.get("allocation", {}).get(str(im.get("chosen")))
    return None if rows is None else {l: dict(zip(GROUPS, r)) for l, r in enumerate(rows)}


def _unfuse_qkv(attn) -> None:
    """Drop a fused q/k/v matrix (models/quantized.py fuse_qkv): the one-token step then multiplies q, k
    and v apart, each from its own input-major copy (their weights are views of its rows: nothing is freed)."""
    for name in ("qkv", "qkv_bias"):
        if name in attn.__dict__:
            del attn.__dict__[name]
        elif name in attn._parameters or name in attn._buffers:
            delattr(attn, name)


def _cold_time(f, repeats: int = 5) -> float:
    """f's best time over `repeats` calls, each after reading a buffer twice the last-level cache's
    size (its lines evict f's data: f reads from memory, as decode does once a model outgrows it)."""
    flush = _flush_buffer()
    f()
    best = float("inf")
    for _ in range(repeats):
        flush.sum()
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


_FLUSH: list = []


def _flush_buffer() -> np.ndarray:
    # made once a process: fresh memory's first touch is slow on some VMs (0.3 GB/s)
    if not _FLUSH:
        _FLUSH.append(np.ones(max(2 * llc_bytes(), 64 << 20) // 8, np.float64))
    return _FLUSH[0]


def _best_time(f, repeats: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


# From memory a product must time this much faster from its input-major copy, one call after an
# evicted cache, to be chosen: in a whole decode step its scattered per-channel reads fare worse than
# alone. 7B-shaped gated Q4_0 model, 2-core AMD EPYC, every projection thresholded: alone 1.36-1.49x
# (gate, down, o at 50%), 1.13-1.31x at 40%; the whole step 96.5 ms at 49% of the weights skipped
# against 80-112 ms dense (the machine's memory rate swung between runs), 126.5 against 77-113 at 38%.
COLD_MARGIN = 1.5

_CALLS = 16  # products per timed jitted loop: one small matrix's product takes a few microseconds,
# about Python's dispatch of an 11-argument kernel call


def input_major_pays(lin, im, sparsity: float, cold: bool = False) -> bool:
    """Whether lin's one-token product is faster from its input-major copy `im` at `sparsity` than from
    its own weights, timed here on an input with that share of entries at or below the threshold.
    Quantised weights are timed as the fused step calls them: cache-hot in a jitted loop, or with
    `cold` (a model whose projections do not fit the last-level cache, so decode reads every matrix
    from memory) one call at a time after evicting the cache. Cache-hot, the integer kernels of
    Q4_0 / Q4_1 break even at ~5-40% sparsity on 4096-wide matrices and later on SmolLM2's 576-wide
    ones, whose products take a few microseconds and pay the kernel's fixed per-call cost
    (tools/bench_input_sparse.py); from memory, where the dense kernel waits on bytes, earlier
    (11008 x 4096 Q4_0 on a 2-core AMD EPYC: cache-hot 35%). float16's pays at none."""
    from hotcold.models.quantized import QuantLinear
    from hotcold.sparse_ops.input_sparse import im_repeat, qdense_repeat
    from hotcold.sparse_ops.quant.formats import XQ_DEFAULT

    x = np.random.default_rng(0).standard_normal(im.cols).astype(np.float32)
    x[np.argsort(np.abs(x))[: int(sparsity * im.cols)]] = 0.0  # the inputs the threshold drops
    out = np.empty(im.rows, np.float32)
    args = im.args()
    sparse_args = (*args[:7], np.zeros(2, np.int64), args[8])
    if isinstance(lin, QuantLinear):
        q = lin.qweight
        dense_args = (q.type_id, bool(q.interleaved), bool(q.interleaved or q.qtype in XQ_DEFAULT), q.data, q.all_rows())
        if cold:
            return _cold_time(lambda: im_repeat(1, x, out, *sparse_args)) * COLD_MARGIN < \
                _cold_time(lambda: qdense_repeat(1, *dense_args, x, out))
        t_im, t_dense = float("inf"), float("inf")
        for _ in range(2):  # alternating, the best of each
            t_im = min(t_im, _best_time(lambda: im_repeat(_CALLS, x, out, *sparse_args), 3))
            t_dense = min(t_dense, _best_time(lambda: qdense_repeat(_CALLS, *dense_args, x, out), 3))
        return t_im < t_dense
    from hotcold.models.layers import project
    from hotcold.sparse_ops.input_sparse import im_kernel

    t_im = _best_time(lambda: im_kernel(x, out, *sparse_args))
    xt = torch.from_numpy(x).reshape(1, 1, -1).to(lin.weight.dtype)
    d = lin.__dict__
    saved = {k: d.pop(k) for k in ("input_threshold", "input_major", "input_counter") if k in d}
    try:
        with torch.inference_mode():
            t_dense = _best_time(lambda: project(lin, xt))
    finally:
        d.update(saved)
    return t_im < t_dense


def apply_input_sparsity(model, thresholds: dict[int, dict[str, float]], input_major: bool = True,
                         sparsities: dict[int, dict[str, float]] | None = None,
                         integer: bool | None = None, timed: dict | None = None, memo=None) -> InputSparsity:
    """Set the thresholds on model's projections (see the module docstring). input_major: build the
    input-major copies for the CPU's one-token products (False: threshold and multiply dense).
    sparsities: each group's expected sparsity (the profile's allocation); given, only projections
    whose input-major product `input_major_pays` at it are thresholded, the others stay dense and
    exact (thresholding them would cost quality and save nothing), and `dense` says why. integer:
    quantised weights' input-major kind (sparse_ops.input_sparse.input_major; None: its default).
    timed: input_major_pays's answers by (matrix type, shape, sparsity, from memory) (`_pays`), given
    and extended (see `open_input_sparsity`: kept per machine, model and code); a projection whose
    kind of matrix does not pay is not built. memo: an input-major cache (executors/input_major_cache.py)
    the copies are taken from and kept in."""
    from hotcold.models.quantized import QuantLinear
    from hotcold.sparse_ops.input_sparse import input_major as make_im

    out = InputSparsity()
    timed = {} if timed is None else timed
    cold = _weight_bytes(model, thresholds) > (llc_bytes() or 32 << 20)  # decode reads them from memory
    for l, per in thresholds.items():
        block = model.layers[l]
        mods = group_modules(block)
        chosen = []  # (group, linear, threshold, input-major copy or None)
        for g, t in per.items():
            if t <= 0:
                continue
            for i, lin in enumerate(mods[g]):
                im, why = None, "not on the CPU"
                quant = isinstance(lin, QuantLinear)
                key = None if sparsities is None else _pays_key(lin, sparsities[l][g], cold)
                if input_major and timed.get(key, True) and (quant or lin.weight.device.type == "cpu"):
                    w = lin.qweight if quant else lin.weight
                    build = (lambda w=w, t=t: make_im(w, t, integer)) if quant else (lambda w=w, t=t: make_im(w, t))
                    im = build() if memo is None else memo.get(f"{l}.{g}.{i}", t, build)
                    why = f"{w.qtype if quant else str(w.dtype).removeprefix('torch.')} has no input-major form here"
                if key is not None and (im is not None and not _pays(lin, im, key, timed) or timed.get(key) is False):
                    im, why = None, f"its dense kernel is faster at {sparsities[l][g]:.0%} sparsity"
                    if memo is not None:
                        memo.used.pop(f"{l}.{g}.{i}", None)
                if im is None and input_major:
                    out.dense.append(f"layer {l} {g}: {why}")
                if im is not None or sparsities is None:
                    chosen.append((g, lin, t, im))
        if any(g == "qkv" for g, *_ in chosen):
            _unfuse_qkv(block.attn)
        for g, lin, t, im in chosen:
            lin.__dict__["input_threshold"] = float(t)
            lin.__dict__["input_counter"] = np.zeros(2, np.int64)
            if im is not None:
                lin.__dict__["input_major"] = im
                out.input_major += 1
                out.extra_bytes += im.nbytes
                out.counters.append((im.rows, im.counter))
            else:
                lin.__dict__.pop("input_major", None)
                out.counters.append((_rows(lin), lin.__dict__["input_counter"]))
        for m in (block, block.attn, block.ffn):  # cpu_step's cached kernel arguments
            for key in ("_cpu_step", "_cpu_args"):
                m.__dict__.pop(key, None)
    return out


def _pays_key(lin, sparsity: float, cold: bool) -> tuple:
    """input_major_pays's answer is kept per kind of matrix, sparsity and cache regime (a model's layers
    repeat a few shapes: SmolLM2's 210 projections are 4 shapes at 3 sparsities)."""
    w = getattr(lin, "qweight", None)
    return (type(lin).__name__, w.qtype if w is not None else str(lin.weight.dtype),
            *(w.shape if w is not None else lin.weight.shape), round(float(sparsity), 4), cold)


def _pays(lin, im, key: tuple, timed: dict) -> bool:
    if key not in timed:
        timed[key] = input_major_pays(lin, im, key[-2], key[-1])
    return timed[key]


def _weight_bytes(model, thresholds: dict) -> int:
    """Bytes of the weights of every projection that `thresholds` names (their row-major form)."""
    total = 0
    for l, per in thresholds.items():
        mods = group_modules(model.layers[l])
        for g in per:
            for lin in mods[g]:
                w = getattr(lin, "qweight", None)
                total += w.data.nbytes if w is not None else lin.weight.nbytes
    return total


def _rows(lin) -> int:
    return int(getattr(lin, "out_features", 0) or lin.weight.shape[0])


def remove_input_sparsity(model) -> None:
    """Undo apply_input_sparsity (the fused q/k/v matrix is not rebuilt)."""
    for block in model.layers:
        for mods in group_modules(block).values():
            for lin in mods:
                for key in ("input_threshold", "input_counter", "input_major"):
                    lin.__dict__.pop(key, None)
        for m in (block, block.attn, block.ffn):
            for key in ("_cpu_step", "_cpu_args"):
                m.__dict__.pop(key, None)


def open_input_sparsity(lm, enabled: bool = True) -> tuple[InputSparsity | None, str | None]:
    """Apply the profile's input sparsity to a loaded model, if it has one and `enabled`. Returns
    (what was applied or None, a note for the user or None)."""
    from hotcold.profiler.artifact import find_profile, load_profile
    from hotcold.profiler.input_sparsity import applies

    if not applies(lm.model):
        return None, None
    path = find_profile(lm.path, lm.fingerprint)
    if path is None:
        return None, None
    profile = load_profile(path, lm.fingerprint)
    thresholds = thresholds_from_profile(profile)
    if thresholds is None:
        return None, None
    level = profile.meta["input_sparsity"]["chosen"]
    rise = next((p["rise"] for p in profile.meta["input_sparsity"]["curve"] if p["sparsity"] == level), None)
    if not enabled:
        return None, f"input sparsity off (--no-sparse); the profile chose {level:.0%}"
    head = (f"input sparsity: the profile chose {level:.0%} of the weights (held-out perplexity "
            f"{rise:+.2%}; --no-sparse turns it off)" if rise is not None else
            f"input sparsity: the profile chose {level:.0%} of the weights (--no-sparse turns it off)")
    if lm.device.type != "cpu":
        return None, f"{head}; not applied on {lm.device.type}: no sparse kernel there yet (thresholds alone cost " \
                     "quality and save nothing)"
    from hotcold.executors.input_major_cache import open_major_memo

    decisions, memo = PaysCache.open(lm), open_major_memo(lm)
    applied = apply_input_sparsity(lm.model, thresholds, sparsities=sparsities_from_profile(profile),
                                   timed=decisions.timed, memo=memo)
    decisions.save()
    memo.save()
    total = applied.input_major + len(applied.dense)
    if not applied.counters:
        remove_input_sparsity(lm.model)
        why = applied.dense[0] if applied.dense else "nothing to threshold"
        return None, (f"{head}; not applied: no projection's sparse product is faster here than its dense one "
                      f"at its sparsity ({why}{', ...' if len(applied.dense) > 1 else ''}), so the run stays dense")
    note = (f"{head}; applied to the {applied.input_major} of {total} projections whose sparse product is "
            f"faster here, the others stay dense" + (f" ({applied.dense[0]}, ...)" if applied.dense else ""))
    return applied, note



class PaysCache:
    """`input_major_pays`'s answers for one model on this machine, kept from load to load: timing them
    took most of SmolLM2's load (0.37 -> ~1.0 s). One file per model file under
    `$HOTCOLD_HOME/cache/input_major/` (models/build_cache.py, the answers in its info string),
    keyed by this machine (host, CPU, numba's thread count), the model file's version and the source
    of the kernels timed, so another machine, model or kernel times them again. Answers timed on a
    busy machine (load average at least half its CPUs, as the hardware probe counts it) are timed
    again once it is idle."""

    KIND = "input_major"

    def __init__(self, path: Path | None, key: str, timed: dict, busy: bool):
        self.path, self.key, self.timed, self.busy = path, key, timed, busy
        self._known = dict(timed)

    @classmethod
    def open(cls, lm) -> "PaysCache":
        from hotcold.models.build_cache import CacheInvalid, CacheStale, cache_dir, digest, read_cache_info
        from hotcold.models.layout_cache import model_version

        busy = machine_busy()
        path = Path(lm.path) if lm.path is not None else None
        if path is None or not path.is_file():  # an HF folder: no file version to key by
            return cls(None, "", {}, busy)
        key = digest("input-major-2", _machine(), model_version(path, lm.fingerprint), *_code())
        cache = cache_dir(cls.KIND) / f"{digest(os.path.realpath(path))}.safetensors"
        timed: dict = {}
        try:
            got = read_cache_info(cache, key)
            if got is not None:
                info = json.loads(got[1])
                if not (info["busy"] and not busy):
                    timed = {tuple(k): bool(v) for k, v in info["pays"]}
        except CacheStale:
            pass  # another machine, model version or kernel: timed again
        except (CacheInvalid, OSError, ValueError, KeyError, TypeError) as e:
            print(f"note: the input-sparsity cache {cache} {e}; timing again", file=sys.stderr, flush=True)
        return cls(cache, key, timed, busy)

    def save(self) -> None:
        """Write the answers when this load timed any (a home that cannot be written: timed next load)."""
        from hotcold.models.build_cache import write_cache

        if self.path is None or self.timed == self._known:
            return
        try:
            write_cache(self.path, self.key, {}, json.dumps({"busy": self.busy,
                                                             "pays": [[list(k), v] for k, v in self.timed.items()]}))
        except OSError:
            pass


def _machine() -> str:
    """This machine as far as the kernels' speed goes: host, CPU model and count, numba's threads."""
    import platform
    import socket

    from hotcold.sparse_ops.cpu import get_threads

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return json.dumps([socket.gethostname(), platform.machine(), model or platform.processor(), os.cpu_count(),
                       get_threads()])


def _code() -> list[bytes]:
    """The source of the kernels input_major_pays times and of the timing itself."""
    from hotcold.sparse_ops import input_sparse, input_sparse_int, quant

    files = [Path(__file__), Path(input_sparse.__file__), Path(input_sparse_int.__file__),
             *sorted(Path(quant.__file__).parent.glob("*.py"))]
    return [f.read_bytes() for f in files]
