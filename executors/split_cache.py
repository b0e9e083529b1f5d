"""What a plan's split builds for the CPU tier, done once.

Splitting a quantised FFN by its plan (executors/weights.py) builds, per layer, W_down's cold columns
transposed and requantised to Q8_0 (`quant_cols_t`: a dequantise, transpose and requantise pass
over the whole matrix), the cold rows of W_up / W_gate where they are not the file's own rows in
the file's order (a hybrid plan's subset, or a gate requantised to up's type), and each CPU
predictor quantised to Q8_0 blocks and interleaved (gpu_executor.py `_host_predictor`). For a
7B-shaped CPU plan that is most of its load, and the same bytes every time.

`SplitMemo` keeps them in a verified cache file (models/build_cache.py: safetensors, its bytes'
digest checked on every read, written to a temporary name and renamed) and later loads take them as
read-only views of a mapping of it: no copy, no requantisation, pages shared through the page cache
by every process running the plan. A CPU plan's cold W_up / W_gate rows are all the rows in the
file's order: the split takes the file's own matrices, in neither copy nor cache.

One file per model file under `$HOTCOLD_HOME/cache/split/`, named by the model's real path; its key
covers the model file's version (size, mtime, inode, fingerprint), the plan's hot neurons per layer,
the predictors file's version and the source of the code that builds the parts, so a changed model,
plan or predictors file rebuilds it with one line saying which, a new version of the code quietly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hotcold.models.build_cache import CacheInvalid, CacheStale, cache_dir, digest, read_cache_info, write_cache
from hotcold.models.layout_cache import model_version, prune_missing
from hotcold.sparse_ops.quant import QuantMatrix

KIND = "split"


class SplitMemo:
    """The CPU tier's parts of a split by name: views of the cache file when it holds them, else
    built (read-only, as the views are, so the kernels see one kind of array either way) and written
    to it by `save`."""

    def __init__(self, path: Path, key: str, recorded: dict, tensors: dict[str, np.ndarray], layout: dict):
        self.path, self.key, self.recorded = path, key, recorded
        self.tensors, self.layout = tensors, layout  # what the file held (empty: nothing usable)
        self.used: dict[str, QuantMatrix] = {}
        self.built = 0  # parts not found in the file
        self.predictors = recorded.get("predictors") is not None  # whether the key covers the predictors

    def matrix(self, name: str, build: Callable[[], QuantMatrix]) -> QuantMatrix:
        """The QuantMatrix named `name`: the cache file's, or build()'s."""
        e = self.layout.get(name)
        m = None
        if e is not None and name in self.tensors:
            try:
                m = QuantMatrix(self.tensors[name], e["qtype"], tuple(e["shape"]), interleaved=e["interleaved"])
            except (ValueError, KeyError, TypeError):
                m = None  # (a file written by this key always fits; anything else is built)
        if m is None:
            m = build()
            m.data.setflags(write=False)
            self.built += 1
        self.used[name] = m
        return m

    def save(self) -> int:
        """Write the parts this load used to the cache file when any was built; returns the bytes
        written (0: nothing new, or a home that cannot be written, which only costs the build next time)."""
        if not self.built:
            return 0
        layout = {n: {"qtype": m.qtype, "shape": list(m.shape), "interleaved": m.interleaved}
                  for n, m in self.used.items()}
        try:
            write_cache(self.path, self.key, {n: m.data for n, m in self.used.items()},
                        json.dumps({**self.recorded, "layout": layout}))
            prune_missing(self.path.parent)
        except OSError:
            return 0
        return sum(m.nbytes for m in self.used.values())


def open_split_memo(lm, hot: dict[int, torch.Tensor], predictors) -> SplitMemo | None:
    """The split memo of `lm` split by `hot` (the placement's hot neurons per layer) with `predictors`
    (a PredictorSet, "oracle" or None), or None when its parts are not blocks of a model file (an HF
    folder; a predictor set not read from a file caches nothing of its own, see below). A cache file
    that fails its checks or was made from another model, plan or predictors file is announced with
    one line on stderr and rebuilt at `save`."""
    path = Path(lm.path) if lm.path is not None else None
    if path is None or not path.is_file():
        return None
    model = model_version(path, lm.fingerprint)
    # a PredictorSet without a source file (built in memory): its parts are built every time
    source = getattr(predictors, "source", None) if predictors is not None and predictors != "oracle" else None
    recorded = {"model": model, "plan": _plan_digest(hot), "predictors": source}
    key = digest("split-1", json.dumps(recorded), *_code())
    cache = cache_dir(KIND) / f"{digest(os.path.realpath(path))}.safetensors"
    tensors, layout = {}, {}
    try:
        got = read_cache_info(cache, key)
        if got is not None:
            tensors, layout = got[0], json.loads(got[1])["layout"]
    except CacheStale as e:
        changed = _changed(e.info, recorded, path.name)
        if changed:
            print(f"note: the split cache {cache} was made for {changed}; rebuilding it", file=sys.stderr, flush=True)
    except (CacheInvalid, OSError, ValueError, KeyError, TypeError) as e:
        print(f"note: the split cache {cache} {e}; rebuilding it", file=sys.stderr, flush=True)
    return SplitMemo(cache, key, recorded, tensors, layout)


def _plan_digest(hot: dict[int, torch.Tensor]) -> str:
    """The hot neurons of every layer, in the plan's order: what the cold parts and the predictors'
    row order follow."""
    parts = []
    for l in sorted(hot):
        parts += [str(int(l)), torch.as_tensor(hot[l], dtype=torch.int64).cpu().contiguous().numpy().tobytes()]
    return digest("hot", *parts)


def _code() -> list[bytes]:
    """The source of what builds the cached parts, and the settings it reads at call time."""
    from hotcold.executors import gpu_executor, weights
    from hotcold.sparse_ops import quant
    from hotcold.sparse_ops.quant import formats

    files = sorted(Path(quant.__file__).parent.glob("*.py")) + [Path(weights.__file__), Path(gpu_executor.__file__),
                                                                Path(__file__)]
    settings = repr((sorted(formats.XQ_DEFAULT), sorted(formats.PACK_DEFAULT), formats.X8))
    return [settings.encode(), *(f.read_bytes() for f in files)]


def _changed(info: str, now: dict, name: str) -> str | None:
    """What a stale file was made for, in words, when its model, plan or predictors differ (None: the
    code changed, which rebuilds without a word)."""
    try:
        was = json.loads(info)
        was = {k: was[k] for k in ("model", "plan", "predictors")}
    except (ValueError, KeyError, TypeError):
        return None  # an older format of this cache
    if was["model"] != now["model"]:
        return f"another version of {name}"
    if was["plan"] != now["plan"]:
        return f"another plan of {name}"
    if was["predictors"] != now["predictors"]:
        return f"other predictors of {name}"
    return None
