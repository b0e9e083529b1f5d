"""Input-major copies of a model's projections, built once.

Input sparsity (executors/input_sparse.py) reads a projection's weights input-major: the file's
blocks re-laid out per input channel (sparse_ops/input_sparse.py `input_major`). Building them is a
pass over every thresholded matrix (unpack, transpose, repack): 88 s for a 7B-shaped Q4_0 model on a
2-core machine, every load. The copy depends on the weights alone, not on the thresholds.

`MajorMemo` keeps them in a verified cache file (models/build_cache.py: safetensors, its bytes'
digest checked on every read, written to a temporary name and renamed); later loads take them as
read-only views of a mapping of it, no copy, pages shared through the page cache. One file per model
file under `$HOTCOLD_HOME/cache/input_major_layout/`, named by the model's real path, keyed by the
model file's version and the source of the code that builds the copies; a file that holds fewer
projections than a load uses is rewritten with all of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from hotcold.models.build_cache import CacheInvalid, CacheStale, cache_dir, digest, read_cache_info, write_cache
from hotcold.models.layout_cache import model_version, prune_missing
from hotcold.sparse_ops.input_sparse import InputMajor

KIND = "input_major_layout"
_ARRAYS = ("wf", "wh", "codes", "d", "m")  # InputMajor's arrays (1x1 placeholders are not stored)


class MajorMemo:
    """Input-major copies by projection name: views of the cache file when it holds them, else built
    (and kept for `save`)."""

    def __init__(self, path: Path | None, key: str, model: str, tensors: dict[str, np.ndarray], layout: dict):
        self.path, self.key, self.model = path, key, model
        self.tensors, self.layout = tensors, layout  # what the file held (empty: nothing usable)
        self.used: dict[str, InputMajor] = {}
        self.built = 0  # copies not found in the file

    def get(self, name: str, threshold: float, build: Callable[[], InputMajor | None]) -> InputMajor | None:
        """The input-major copy named `name` with `threshold`: the file's, or build()'s."""
        e = self.layout.get(name)
        im = None
        if e is not None and all(f"{name}.{a}" in self.tensors for a in e["arrays"]):
            im = InputMajor(e["kind"], e["rows"], e["cols"], threshold,
                            **{a: self.tensors[f"{name}.{a}"] for a in e["arrays"]})
        if im is None:
            im = build()
            if im is None:
                return None
            self.built += 1
        self.used[name] = im
        return im

    def save(self) -> None:
        """Rewrite the cache file when this load built any copy (a home that cannot be written: built
        again next load)."""
        if self.path is None or not self.built:
            return
        tensors, layout = {}, {}
        for name, im in self.used.items():
            arrays = [a for a in _ARRAYS if getattr(im, a).size > 1]
            layout[name] = {"kind": im.kind, "rows": im.rows, "cols": im.cols, "arrays": arrays}
            tensors.update({f"{name}.{a}": getattr(im, a) for a in arrays})
        try:
            prune_missing(self.path.parent)
            write_cache(self.path, self.key, tensors, json.dumps({"model": self.model, "layout": layout}))
        except OSError:
            pass


def open_major_memo(lm) -> MajorMemo:
    """The memo of `lm`'s input-major copies (one that caches nothing for a model that is not a file).
    A cache file that fails its checks is announced with one line on stderr and rewritten at `save`;
    one made from another version of the model or of the code is rewritten quietly."""
    path = Path(lm.path) if lm.path is not None else None
    if path is None or not path.is_file():
        return MajorMemo(None, "", "", {}, {})
    model = model_version(path, lm.fingerprint)
    key = digest("input-major-layout-1", model, *_code())
    cache = cache_dir(KIND) / f"{digest(os.path.realpath(path))}.safetensors"
    tensors, layout = {}, {}
    try:
        got = read_cache_info(cache, key)
        if got is not None:
            tensors, layout = got[0], json.loads(got[1])["layout"]
    except CacheStale:
        pass
    except (CacheInvalid, OSError, ValueError, KeyError, TypeError) as e:
        print(f"note: the input-major cache {cache} {e}; rebuilding it", file=sys.stderr, flush=True)
    return MajorMemo(cache, key, model, tensors, layout)


def _code() -> list[bytes]:
    """The source of what builds the copies."""
    from hotcold.sparse_ops import input_sparse, input_sparse_int
    from hotcold.sparse_ops.quant import formats

    files = [Path(input_sparse.__file__), Path(input_sparse_int.__file__), Path(formats.__file__), Path(__file__)]
    return [f.read_bytes() for f in files]
