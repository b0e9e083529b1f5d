"""numba's cache of hotcold's kernels is keyed on all of their sources (sparse_ops/quant/jit_cache.py):
a kernel that compiles in another module's kernels (the fused one-token steps compile in the
quantised GEMVs) must be rebuilt when that module changes, not only when its own file does; and a
cached caller of a cached parallel kernel starts numba's threading layer when it loads."""

from __future__ import annotations

import os
import subprocess
import sys

from hotcold.executors import layer_node
from hotcold.models import batch_step, cpu_step
from hotcold.sparse_ops import quant
from hotcold.sparse_ops.quant import jit_cache


def test_every_kernel_source_is_in_the_stamp():
    rel = {os.path.relpath(p, jit_cache._ROOT) for p in jit_cache._SOURCES}
    for f in ("models/cpu_step.py", "models/batch_step.py", "models/batch_gemv.py", "executors/layer_node.py",
              "executors/host_node.py", "sparse_ops/quant/interleaved.py", "sparse_ops/quant/vector.py",
              "sparse_ops/quant/tiles.py", "sparse_ops/selection.py", "sparse_ops/attention.py"):
        assert f in rel, f
    assert "executors/engine.py" not in rel  # no numba function of its own: its edits recompile nothing


def test_kernels_outside_the_quant_package_take_the_shared_stamp():
    for kernel in (cpu_step._block_step, batch_step._block_rows, quant.qgemv_x8_kernel):
        locator = kernel._cache._impl._locator
        assert isinstance(locator, jit_cache.PackageCacheLocator), kernel
        assert locator.get_source_stamp() == jit_cache.sources_stamp()
    assert any(isinstance(getattr(layer_node, n), type(cpu_step._block_step)) for n in dir(layer_node))


def test_the_stamp_follows_every_source(tmp_path, monkeypatch):
    """An edit of one kernel source (interleaved.py, a copy of it standing in) changes the stamp."""
    copy = tmp_path / "interleaved.py"
    src = next(p for p in jit_cache._SOURCES if p.endswith(os.path.join("quant", "interleaved.py")))
    copy.write_bytes(open(src, "rb").read())
    monkeypatch.setattr(jit_cache, "_SOURCES", [p if p != src else str(copy) for p in jit_cache._SOURCES])
    unedited = jit_cache.sources_stamp()
    assert unedited == jit_cache.sources_stamp()  # a pure function of the files
    copy.write_bytes(copy.read_bytes() + b"\n# an edit\n")
    assert jit_cache.sources_stamp() != unedited


_NESTED = '''
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def inner(x, out):
    for i in prange(x.shape[0]):
        out[i] = 2 * x[i]


@njit(cache=True)
def outer(x, out):
    inner(x, out)
    out[0] += 1
'''

_CALL = '''
import sys
sys.path.insert(0, sys.argv[1])
import hotcold.sparse_ops  # noqa: F401  (jit_cache: what every hotcold process imports first)
import numpy as np
import nested
x = np.arange(64, dtype=np.float32)
out = np.zeros_like(x)
f = getattr(nested, sys.argv[2])
f(x, out)
print(float(out.sum()), f.stats.cache_hits[f.signatures[0]])
'''


def _call(tmp_path, name):
    return subprocess.run([sys.executable, "-c", _CALL, str(tmp_path), name], capture_output=True, text=True,
                          timeout=300)


def test_a_cached_caller_of_a_cached_parallel_kernel_starts_the_threads(tmp_path):
    """A process compiles a parallel kernel (cached), a second compiles a caller of it against that
    cached build (cached too), a third loads the caller alone from the cache: it must start numba's
    threading layer before the caller's machine code is linked, or the caller calls a null pointer (the
    float fused step's segfault). jit_cache keeps the kernel's reload_init on its cached library."""
    (tmp_path / "nested.py").write_text(_NESTED)
    want = str(2.0 * sum(range(64)) + 1)
    first = _call(tmp_path, "inner")
    assert first.returncode == 0, first.stderr
    second = _call(tmp_path, "outer")
    assert second.returncode == 0 and second.stdout.split() == [want, "0"], (second.stdout, second.stderr)
    third = _call(tmp_path, "outer")  # outer from the cache, nothing else compiled or loaded before it
    assert third.returncode == 0, f"rc {third.returncode}: {third.stderr[-2000:]}"
    assert third.stdout.split() == [want, "1"], third.stdout
