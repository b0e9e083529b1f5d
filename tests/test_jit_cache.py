"""numba's cache of hotcold's kernels is keyed on all of their sources (sparse_ops/quant/jit_cache.py):
a kernel that compiles in another module's kernels (the fused one-token steps compile in the
quantised GEMVs) must be rebuilt when that module changes, not only when its own file does."""

from __future__ import annotations

import os

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
