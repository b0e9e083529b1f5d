"""The CPU layout a dense load of a GGUF file computes from its blocks, done once.

`pack_for_decode` interleaves the matrices one-token decoding reads whole and fuses each attention's
q, k and v (models/quantized.py): an anonymous copy of most of the file, rebuilt by every load.
`packed_for_decode` keeps that result in a verified cache file (models/build_cache.py: safetensors,
its bytes' digest checked on every read, written to a temporary name and renamed) and later loads
set the same matrices as read-only views of a mapping of it: no copy, no interleaving pass, and
pages that every process running the model shares through the page cache.

One file per model file under `$HOTCOLD_HOME/cache/layout/`, named by the model's real path; its
key covers the file's size, mtime and inode, the model's fingerprint, and the source of the code
that computes the layout (models/quantized.py and sparse_ops/quant/), so a changed model or a
changed layout rebuilds it: a changed, truncated or damaged cache file or model file with one line
saying so, a new version of the packing code quietly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

from hotcold.models.build_cache import CacheInvalid, CacheStale, cache_dir, digest, read_cache_info, write_cache

if TYPE_CHECKING:
    from hotcold.models.loader import LoadedModel


def packed_for_decode(lm: "LoadedModel") -> int:
    """`pack_for_decode(lm.model)`, from the layout cache when it holds this model's layout; a GGUF
    file's layout is written there for the next load. Returns the bytes interleaved (or mapped)."""
    from hotcold.models.quantized import fuse_qkv, pack_for_decode

    path = Path(lm.path)
    if not path.is_file():  # an HF folder: its matrices are not blocks of a file
        return pack_for_decode(lm.model)
    key, model = layout_key(path, lm.fingerprint), model_version(path, lm.fingerprint)
    cache = cache_dir("layout") / f"{digest(os.path.realpath(path))}.safetensors"
    try:
        got = read_cache_info(cache, key)
        if got is not None:
            done = _apply(lm.model, got[0], json.loads(got[1])["layout"])
            fuse_qkv(lm.model)  # float16 / bfloat16 attentions (not cached: their weights are copies anyway)
            return done
    except CacheStale as e:  # made by other packing code (or an older cache format): rebuilt without a word
        if _recorded_model(e.info) not in (None, model):
            print(f"note: the layout cache {cache} was made for another version of {path.name}; rebuilding it",
                  file=sys.stderr, flush=True)
    except (CacheInvalid, OSError, ValueError, KeyError, TypeError) as e:
        print(f"note: the layout cache {cache} {e}; rebuilding it", file=sys.stderr, flush=True)
    done = pack_for_decode(lm.model)
    tensors, layout = _collect(lm.model)
    if tensors:
        try:
            write_cache(cache, key, tensors, json.dumps({"model": model, "layout": layout}))
            prune_missing(cache.parent)
        except OSError:
            pass  # a read-only home: the next load packs again
    return done


def prune_missing(folder: Path) -> None:
    """Remove the cache files in `folder` whose info names (as "model", a `model_version`) a model file
    that no longer exists (a layout file is about the size of its model's matrices; models in
    temporary folders would leave theirs behind). Reads headers only."""
    for f in folder.glob("*.safetensors"):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                info = json.loads(fh.read(n))["__metadata__"]["info"] if n < 1 << 24 else ""
            recorded = _recorded_model(info)
            if recorded is not None and not os.path.exists(json.loads(recorded)[0]):
                f.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            continue  # another process's file in the middle of its rename, or not ours to judge


def layout_key(path: Path, fingerprint: str) -> str:
    """What the cached layout depends on: the model file's version (`model_version`), the packing
    code and its settings."""
    from hotcold.models import quantized
    from hotcold.sparse_ops import quant
    from hotcold.sparse_ops.quant import formats

    code_files = sorted(Path(quant.__file__).parent.glob("*.py")) + [Path(quantized.__file__)]
    # (settings tests patch: formats' defaults are read at call time)
    settings = repr((quantized.HEAD_XQ, sorted(formats.XQ_DEFAULT), sorted(formats.PACK_DEFAULT), formats.X8))
    return digest("layout-1", model_version(path, fingerprint), settings, *(f.read_bytes() for f in code_files))


def model_version(path: Path, fingerprint: str) -> str:
    """The model file as far as the cache can tell without reading it: real path, size, mtime, inode
    and the fingerprint of its headers."""
    st = os.stat(path)
    return json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino, fingerprint])


def _recorded_model(info: str) -> str | None:
    try:
        return json.loads(info)["model"]
    except (ValueError, KeyError, TypeError):
        return None


def _collect(model: nn.Module) -> tuple[dict[str, np.ndarray], list[dict]]:
    """The interleaved matrices pack_for_decode made (arrays to cache) and where each goes: a module's
    `qweight` or an attention's `qkv`, or rows [start, stop) of a fused qkv for q, k and v."""
    from hotcold.sparse_ops.quant import QuantMatrix

    tensors: dict[str, np.ndarray] = {}
    layout: list[dict] = []
    in_qkv: set[str] = set()
    for name, m in model.named_modules():
        qkv = getattr(m, "qkv", None)
        if isinstance(qkv, QuantMatrix):
            tensors[f"{name}.qkv"] = qkv.data
            layout.append(_entry(name, "qkv", qkv, f"{name}.qkv", None))
            a = 0
            for part in ("q", "k", "v"):
                w = getattr(m, part).qweight
                layout.append(_entry(f"{name}.{part}", "qweight", w, f"{name}.qkv", (a, a + len(w.data))))
                in_qkv.add(f"{name}.{part}")
                a += len(w.data)
    for name, m in model.named_modules():
        w = getattr(m, "qweight", None)
        if isinstance(w, QuantMatrix) and w.interleaved and name not in in_qkv:
            tensors[f"{name}.qweight"] = w.data
            layout.append(_entry(name, "qweight", w, f"{name}.qweight", None))
    return tensors, layout


def _entry(module: str, attr: str, w, tensor: str, rows: tuple[int, int] | None) -> dict:
    return {"module": module, "attr": attr, "qtype": w.qtype, "shape": list(w.shape), "tensor": tensor,
            "rows": None if rows is None else list(rows)}


def _apply(model: nn.Module, tensors: dict[str, np.ndarray], layout: list[dict]) -> int:
    """Set each cached matrix in place, after checking that every one fits the model as loaded (its
    module exists, holds a matrix of that type and shape, not yet interleaved): a cache that does not
    fit is refused as a whole (CacheInvalid) and the model is left as it was."""
    from hotcold.sparse_ops.quant import QuantMatrix

    try:
        todo = []
        for e in layout:
            m = model.get_submodule(e["module"])
            data = tensors[e["tensor"]]
            if e["rows"] is not None:
                data = data[e["rows"][0]:e["rows"][1]]
            new = QuantMatrix(data, e["qtype"], tuple(e["shape"]), interleaved=True)
            if e["attr"] == "qweight":
                old = getattr(m, "qweight", None)
                if not isinstance(old, QuantMatrix) or old.interleaved or (old.qtype, old.shape) != (new.qtype, new.shape):
                    raise ValueError(f"{e['module']} holds another matrix")
            elif e["attr"] != "qkv" or getattr(m, "qkv", None) is not None:
                raise ValueError(f"{e['module']}.{e['attr']} cannot be set")
            todo.append((m, e["attr"], new))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheInvalid(f"does not fit this model ({e})") from None
    for m, attr, new in todo:
        setattr(m, attr, new)
    return sum(v.nbytes for v in tensors.values())
