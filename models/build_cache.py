"""Verified caches of what a load would otherwise rebuild the same way every time (a SentencePiece
vocabulary's merges, ...).

Each entry is one safetensors file under `$HOTCOLD_HOME/cache/<kind>/` (default
`~/.cache/hotcold`), named by a key the caller hashes from everything its content depends on (the
model file's bytes that feed it and the code that builds it): a changed input gives another name,
never a stale hit. The file records that key, the format and the SHA-256 of its tensor bytes; a
read checks all three and the file's exact size, and returns read-only numpy views of a mapping of
the file (no copy). A file that fails a check is rebuilt with one `note:` line on stderr saying
why; a new file is written to a temporary name and renamed, so a process loading at the same time
sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
from pathlib import Path
from typing import Callable

import numpy as np

FORMAT = "hotcold-cache-1"

_DTYPES = {"U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F32": np.float32, "U16": np.uint16}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CacheInvalid(Exception):
    """A cache file that must not be used; the message says why, in a few words."""


class CacheStale(CacheInvalid):
    """A whole cache file made from other inputs (its key differs); `info` is the info string it was
    written with, for the caller to say what changed."""

    def __init__(self, message: str, info: str):
        super().__init__(message)
        self.info = info


def cache_dir(kind: str) -> Path:
    """`$HOTCOLD_HOME/cache/<kind>` (default `~/.cache/hotcold/cache/<kind>`); not created here."""
    home = Path(os.environ.get("HOTCOLD_HOME", Path.home() / ".cache" / "hotcold")).expanduser()
    return home / "cache" / kind


def digest(*parts: bytes | str) -> str:
    """A cache key: SHA-256 (hex, 32 characters) of the parts, each length-prefixed so that no two
    different lists of parts hash alike."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else bytes(p)
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    return h.hexdigest()[:32]


def write_cache(path: Path, key: str, tensors: dict[str, np.ndarray], info: str = "") -> None:
    """Write `tensors` (numpy arrays of the dtypes in _DTYPES) as a safetensors file recording `key`,
    the digest of its data and `info` (a string for the reader, e.g. JSON), through a temporary name
    renamed over `path`."""
    from hotcold.artifacts import atomic_path

    arrays = {n: np.ascontiguousarray(a) for n, a in sorted(tensors.items())}
    header: dict[str, object] = {}
    offset = 0
    h = hashlib.sha256()
    for name, a in arrays.items():
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        h.update(memoryview(a).cast("B"))
    header["__metadata__"] = {"format": FORMAT, "key": key, "sha256": h.hexdigest(), "info": info}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header so the data starts 8-aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(memoryview(a).cast("B"))


def read_cache(path: Path, key: str) -> dict[str, np.ndarray] | None:
    """The tensors of the cache file at `path` as read-only views of its mapping; None when there is
    no such file. Raises CacheInvalid when it is truncated, extended, unparsable, of another format or
    key, or its bytes do not match the digest it recorded. `read_cache_info` also gives its info string."""
    got = read_cache_info(path, key)
    return None if got is None else got[0]


def read_cache_info(path: Path, key: str) -> tuple[dict[str, np.ndarray], str] | None:
    """read_cache's tensors and the info string written with them."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise CacheInvalid(f"is truncated ({size} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    n = struct.unpack("<Q", mm[:8])[0]
    if 8 + n > size:
        raise CacheInvalid("is truncated (inside its header)")
    try:
        header = json.loads(mm[8:8 + n])
        meta = header.pop("__metadata__")
        fields = {name: (_DTYPES[v["dtype"]], tuple(int(d) for d in v["shape"]), v["data_offsets"])
                  for name, v in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheInvalid(f"has an unreadable header ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CacheInvalid(f"is of another format ({meta.get('format') if isinstance(meta, dict) else None})")
    if meta.get("key") != key:
        raise CacheStale("was made from other inputs (its key differs)", str(meta.get("info", "")))
    start = 8 + n
    end = max((int(o[1]) for _, _, o in fields.values()), default=0)
    if start + end != size:
        raise CacheInvalid(f"is {'truncated' if start + end > size else 'longer than its header says'} "
                           f"({size} bytes, its header says {start + end})")
    if hashlib.sha256(memoryview(mm)[start:size]).hexdigest() != meta.get("sha256"):
        raise CacheInvalid("is corrupt (its bytes do not match their recorded digest)")
    out = {}
    for name, (dtype, shape, (lo, hi)) in fields.items():
        count = int(np.prod(shape, dtype=np.int64))
        if hi - lo != count * np.dtype(dtype).itemsize or lo < 0:
            raise CacheInvalid(f"has an unreadable header (tensor {name!r} does not fit its offsets)")
        out[name] = np.frombuffer(mm, dtype, count, start + lo).reshape(shape)
    return out, str(meta.get("info", ""))


def cached(kind: str, key: str, build: Callable[[], dict[str, np.ndarray]], what: str) -> dict[str, np.ndarray]:
    """The tensors cached under `kind`/`key`, or `build()`'s, written to the cache for the next load.
    A cache that fails its checks is rebuilt, with one line on stderr naming `what` and why; a cache
    that cannot be written (a read-only home) only costs the build next time."""
    path = cache_dir(kind) / f"{key}.safetensors"
    try:
        got = read_cache(path, key)
    except (CacheInvalid, OSError) as e:
        print(f"note: the {what} cache {path} {e}; rebuilding it", file=sys.stderr, flush=True)
        got = None
    if got is not None:
        return got
    tensors = build()
    try:
        write_cache(path, key, tensors)
    except OSError:
        pass
    return tensors
