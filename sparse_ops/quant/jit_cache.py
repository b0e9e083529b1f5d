"""numba's on-disk cache for this package, invalidated by an edit of any of its kernel sources.

numba keys a cached kernel on its own source file only, but a kernel here inlines intrinsics and
kernels of sibling modules (kernels.py compiles in vector.py's, kquants.py's and interleaved.py's
code, and `selection`'s activation). Left to numba, an edit of vector.py would leave kernels.py's
cached machine code in use, built from the old intrinsics. The locator below gives every numba
function of these files one stamp, the hash of all of them, so an edit of one recompiles the
package's kernels (once) and never runs stale code. Imported by the package before any kernel is
defined.
"""

from __future__ import annotations

import hashlib
import os

from numba.core import caching

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = sorted([os.path.join(_HERE, f) for f in os.listdir(_HERE) if f.endswith(".py")]
                  + [os.path.join(os.path.dirname(_HERE), "selection.py")])


def sources_stamp() -> bytes:
    """sha256 over the package's sources (and `selection`'s), in name order."""
    h = hashlib.sha256()
    for path in _SOURCES:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    return h.digest()


_STAMP = sources_stamp()  # of the sources this process imports (the package's modules follow at once)


class PackageCacheLocator(caching.InTreeCacheLocator):
    """numba's in-tree locator (cache files in the package's __pycache__) with the package-wide stamp."""

    def get_source_stamp(self):
        return _STAMP

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _HERE:
            return None
        return super().from_function(py_func, py_file)


if PackageCacheLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes.insert(0, PackageCacheLocator)
