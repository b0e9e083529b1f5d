"""numba's on-disk cache for hotcold's kernels, invalidated by an edit of any kernel source.

numba keys a cached kernel on its own source file only, but hotcold's kernels compile in kernels of
other modules: kernels.py inlines vector.py's, kquants.py's and interleaved.py's intrinsics, and the
fused one-token steps (models/cpu_step.py, models/batch_step.py, executors/layer_node.py) compile in
the quantised GEMV kernels. Left to numba, an edit of interleaved.py would leave cpu_step.py's cached
machine code in use, built from the old block arithmetic (a checkout that pulled a kernel change ran
the old one). The locator below gives every numba function of the kernel sources (sparse_ops and
the modules that define numba functions) one stamp, the hash of all of them, so an edit of one
recompiles the kernels (once) and never runs stale code. Imported by `hotcold.sparse_ops` before any kernel is defined.
"""

from __future__ import annotations

import hashlib
import re
import os

from numba.core import caching

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))  # where hotcold's subpackages lie (sparse_ops, models, ...)
_PACKAGES = ("executors", "models", "planner", "predictors", "profiler", "server", "sparse_ops")


def _kernel_sources() -> list[str]:
    """Every module of sparse_ops (the kernels and the intrinsics they inline), and the modules of the
    other subpackages that define numba functions."""
    out = []
    for pkg in _PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(_ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]  # numba's cache files: thousands, no source
            for f in files:
                path = os.path.join(folder, f)
                if f.endswith(".py"):
                    with open(path, "rb") as fh:
                        if pkg == "sparse_ops" or re.search(rb"@njit|\bnjit\(|\bintrinsic\b", fh.read()):
                            out.append(path)
    return sorted(out)


_SOURCES = _kernel_sources()
_FOLDERS = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in _PACKAGES)


def sources_stamp() -> bytes:
    """sha256 over the kernel sources (their paths below hotcold's root and contents), in path order."""
    h = hashlib.sha256()
    for path in _SOURCES:
        with open(path, "rb") as f:
            h.update(os.path.relpath(path, _ROOT).encode() + b"\0" + f.read() + b"\0")
    return h.digest()


_STAMP = sources_stamp()  # of the sources this process imports (the kernels' modules follow at once)


class PackageCacheLocator(caching.InTreeCacheLocator):
    """numba's in-tree locator (cache files in each module's __pycache__) with the kernels' stamp."""

    def get_source_stamp(self):
        return _STAMP

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.abspath(py_file).startswith(_FOLDERS):
            return None
        return super().from_function(py_func, py_file)


if PackageCacheLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes.insert(0, PackageCacheLocator)
