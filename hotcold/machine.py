"""Facts about this machine that several packages read: its last-level cache, whether other work is
running on it now, and how many threads a run gives its CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def llc_bytes() -> int:
    """The CPUs' last-level (L3) cache in bytes, summed over the caches that sysfs lists (0: unknown)."""
    seen, total = set(), 0
    for idx in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (idx / "level").read_text().strip() != "3":
                continue
            shared = (idx / "shared_cpu_list").read_text().strip()
            if shared in seen:
                continue
            seen.add(shared)
            size = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            total += int(size.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
    return total


def busy(cpus: int | None = None) -> bool:
    """Whether other work is running: the 1-minute load average is at least half of `cpus` (default:
    this machine's CPUs). Timings taken then are kept only until an idle machine can redo them."""
    cpus = cpus or os.cpu_count() or 1
    return hasattr(os, "getloadavg") and os.getloadavg()[0] >= 0.5 * cpus


def default_threads(cuda: bool) -> int:
    """One numba thread per physical core on a CPU tier (hyper-threads only contend for memory
    bandwidth). With a CUDA tier, half of them: its CPU parts run on CUDA's host-node thread and on the
    thread driving the GPU, numba's OpenMP layer keeps a thread team per calling thread, and libgomp
    counts both teams together: once they outnumber the cores, idle threads stop spinning and every
    parallel region wakes its team through the kernel. On the 16-core H100 host the 8 GiB
    Qwen3-30B-A3B-shaped plan's CPU experts took 9.9 ms a token with 8 threads and 18.2 with 15
    (decode 43.0 and 41.1 tok/s); on the H200 host 8 threads read 37 GB/s where 15 read 23."""
    import numba
    import psutil

    n = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    n = min(numba.config.NUMBA_NUM_THREADS, n)
    return max(1, n // 2) if cuda and n > 2 else n
