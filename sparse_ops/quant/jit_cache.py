"""numba's on-disk cache for hotcold's kernels, invalidated by an edit of any kernel source.

numba keys a cached kernel on its own source file only, but hotcold's kernels compile in kernels of
other modules: kernels.py inlines vector.py's, kquants.py's and interleaved.py's intrinsics, and the
fused one-token steps (models/cpu_step.py, models/batch_step.py, executors/layer_node.py) compile in
the quantised GEMV kernels. Left to numba, an edit of interleaved.py would leave cpu_step.py's cached
machine code in use, built from the old block arithmetic (a checkout that pulled a kernel change ran
the old one). The locator below gives every numba function of the kernel sources (sparse_ops and
the modules that define numba functions) one stamp, the hash of all of them, so an edit of one
recompiles the kernels (once) and never runs stale code. Imported by `hotcold.sparse_ops` before any kernel is defined.

A cached build of a function that calls a parallel (prange) kernel needs numba's threading layer
started before its machine code is linked into a process: that build records "start the threading
layer" (its reload_init) and numba's cache loader runs it first. numba (0.68) records it only when the
parallel callee was compiled in the same process; when the callee came from the cache, the caller's
build records nothing (numba issues 8578, 9938). A later process that loads that caller first, before
anything has started the threads, leaves the threading layer's symbols unresolved in it and calls a
null pointer: the fused one-token step of a float model, compiled by a test process whose parallel
GEMV kernels were cached by an earlier one, segfaulted every later `hotcold run` that loaded it.
`_keep_reload_init` gives a library loaded from the cache the reload_init it was saved with, so that a
caller compiled against it inherits it, as it does from a callee compiled in-process.
"""

from __future__ import annotations

import hashlib
import re
import os

from numba.core import caching, compiler

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


def _keep_reload_init(rebuild):
    """numba's CompileResult._rebuild that also records the result's reload_init on its library (where
    a caller's library inherits it when it links this one in; see the module docstring)."""

    def rebuilt(cls, target_context, *payload):
        cres = rebuild(cls, target_context, *payload)
        cres.library._reload_init.update(cres.reload_init or ())
        return cres

    rebuilt._keeps_reload_init = True
    return rebuilt


if not getattr(compiler.CompileResult._rebuild, "_keeps_reload_init", False):
    compiler.CompileResult._rebuild = classmethod(_keep_reload_init(compiler.CompileResult._rebuild.__func__))
