"""Where a model's artifacts live (profile, predictors, plan) and how they are written and checked.

Artifacts sit next to the model, in `<model>.hotcold/` (e.g. `llama-7b.hotcold/` beside the folder
`llama-7b/`, `model.hotcold/` beside `model.gguf`). A model reached through a symbolic link keeps
them beside the link, under the name the user gave (a model hub's cache links `model.gguf` to a blob
named by its hash); folders written beside the link's target are still found. When that place is
not writable (a model inside a read-only package), they go to `$HOTCOLD_HOME/<name>-<fingerprint>/`
(default `~/.cache/hotcold`). Every artifact records the model fingerprint; one made for another
model is refused.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from hotcold.errors import HotcoldError


class ArtifactError(HotcoldError):
    """An artifact is missing, unreadable, or made for another model."""


def _beside(model_path: Path, follow_links: bool = False) -> Path:
    model_path = Path(model_path).expanduser()
    model_path = model_path.resolve() if follow_links else Path(os.path.abspath(model_path))
    stem = model_path.stem if model_path.is_file() else model_path.name
    return model_path.parent / f"{stem}.hotcold"


def _cache(model_path: Path, fingerprint: str) -> Path:
    home = Path(os.environ.get("HOTCOLD_HOME", Path.home() / ".cache" / "hotcold")).expanduser()
    model_path = Path(model_path)
    stem = model_path.stem if model_path.is_file() else model_path.name
    return home / f"{stem}-{fingerprint}"


def find_artifact_dir(model_path: Path, fingerprint: str) -> Path | None:
    """The existing artifact folder of this model, or None: beside it (or its link's target) first,
    then the cache."""
    for d in (_beside(model_path), _beside(model_path, follow_links=True), _cache(model_path, fingerprint)):
        if d.is_dir():
            return d
    return None


def artifact_dir(model_path: Path, fingerprint: str, out: Path | None = None) -> Path:
    """The folder to write this model's artifacts to (created): `out`, beside the model, or the cache."""
    if out is not None:
        candidates = [Path(out).expanduser()]
    else:
        candidates = [_beside(model_path), _cache(model_path, fingerprint)]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    raise ArtifactError(f"{candidates[0]}: cannot create or write this folder; pass --out DIR")


@contextlib.contextmanager
def removed_if_left_empty(folder: Path) -> Iterator[Path]:
    """Yield `folder`; if the block fails while the folder is still empty, remove the folder."""
    try:
        yield folder
    except BaseException:
        with contextlib.suppress(OSError):
            folder.rmdir()  # refuses a folder that holds anything
        raise


@contextlib.contextmanager
def atomic_path(dest: Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success it is renamed over `dest`, else removed."""
    dest = Path(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp (and some writers) make 0600; artifacts are ordinary files
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_artifact(path: Path, name: str, fmt: str, fingerprint: str | None, remedy: str,
                  meta_path: Path | None = None, framework: str = "pt", keep=None) -> tuple[dict, dict, dict | None]:
    """Read a safetensors artifact (and the JSON beside it, when `meta_path` is given):
    (header metadata, tensors, JSON or None). Unreadable files, another format version, or another
    model's fingerprint (when `fingerprint` is given) are one-line ArtifactErrors ending in `remedy`."""
    import json

    from safetensors import safe_open

    meta = None
    try:
        if meta_path is not None:
            meta = json.loads(Path(meta_path).read_text())
        with safe_open(str(path), framework) as f:
            header = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys() if keep is None or keep(n)}
    except FileNotFoundError:
        raise ArtifactError(f"{meta_path}: missing beside {Path(path).name}; {remedy}") from None
    except Exception as e:  # OSError, JSON errors, and safetensors' own error type for truncated files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArtifactError(f"{path}: unreadable {name} file ({reason}); {remedy}") from None
    if header.get("format") != fmt:
        raise ArtifactError(f"{path}: {name} format {header.get('format')} is not {fmt}; {remedy}")
    if fingerprint is not None:
        check_fingerprint(header.get("fingerprint"), fingerprint, Path(path))
        if meta is not None:
            check_fingerprint(meta.get("fingerprint"), fingerprint, Path(meta_path))
    return header, tensors, meta


def check_fingerprint(found: str | None, expected: str, what: Path) -> None:
    """Refuse an artifact whose recorded fingerprint is not this model's."""
    if found != expected:
        raise ArtifactError(
            f"{what}: made for another model (fingerprint {found}, this model is {expected}); "
            "re-run `hotcold profile`/`hotcold plan` for this model or point to the right file"
        )
