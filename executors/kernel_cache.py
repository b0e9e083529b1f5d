"""Whether numba's on-disk cache holds this machine's build of the CPU kernels every run starts with.

The CPU kernels (sparse_ops, models/cpu_step.py) are numba functions compiled on first use and cached
on disk (`cache=True`), per machine (CPU model and features) and per version of their source file. A
run whose cache is cold compiles them during its first tokens: about 30 s for Gemma 3 270M on the
2-core development machine (ttft 11 s, then 20 s more over the next two steps), against well under a
second to load them from the cache. `cold_kernels` tells a run beforehand, so that it can say so up
front instead of looking hung.
"""

from __future__ import annotations

COMPILE_NOTE = ("compiling the CPU kernels for this machine, once: about half a minute (later runs load them "
                "from numba's cache)")


def _entry_points() -> dict:
    """The kernels every CPU decode of a dense or quantised model calls: the quantised block step, the
    attention step, RMSNorm and the block dequantisation (the embedding row)."""
    from hotcold.models import cpu_step
    from hotcold.sparse_ops import attention, norm, quant

    return {"block step": cpu_step._block_step, "attention": attention._decode_attention,
            "RMSNorm": norm._rms_norm, "dequantisation": quant.qdequant_kernel}


def cached_for_this_machine(dispatcher) -> bool | None:
    """Whether numba's cache index of `dispatcher` holds a build of its current source for this
    machine's CPU; None where that cannot be told (no cache, another numba)."""
    try:
        cache = dispatcher._cache
        index = cache._cache_file._load_index()  # {} when missing or stale (its source file changed)
        codegen = dispatcher.targetctx.codegen()
        key = cache._index_key(None, codegen)  # (signature, machine, source hashes)
    except Exception:
        return None
    return any(k[1:] == key[1:] for k in index)


def cold_kernels() -> list[str]:
    """Names of the entry-point kernels numba would have to compile now (empty when all are cached or
    it cannot be told)."""
    try:
        points = _entry_points()
    except Exception:
        return []
    return [name for name, d in points.items() if cached_for_this_machine(d) is False]
