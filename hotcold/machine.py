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


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(cuda: bool) -> int:
    """One numba thread per physical core on a CPU tier (hyper-threads only contend for memory
    bandwidth). With a CUDA tier, as many but two fewer than the CPUs: decoding's CPU experts run as a
    team led by CUDA's host-node thread, whose idle members spin between the step's layers, and the
    thread driving the GPU (and CUDA's own) needs a CPU beside them; a spinning team that a busy thread
    preempts stalls every region until the member runs again (see `spare_cpus_for_spinning`). On the
    16-core H100 host, a 24-layer Qwen3-30B-A3B-shaped cut decoded at 110-119 tok/s with 8 threads and
    122-124 with 14 (the main thread's team ended, Generator.release_threads), and at 7.7-9.1 with 15."""
    import numba
    import psutil

    n = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    n = min(numba.config.NUMBA_NUM_THREADS, n)
    if cuda and n > 2:
        n = max(1, min(n, available_cpus() - 2))
    return n


def spare_cpus_for_spinning(threads: int) -> bool:
    """Whether a team of `threads` (its leader included) leaves two CPUs to the rest of a CUDA run (the
    thread driving the GPU, CUDA's threads): then its idle members may spin between regions. libgomp
    lets them spin only while the threads of all its pools fit the CPUs; ending another thread's idle
    pool (sparse_ops.selection.release_threads) lets this team spin, which pays where it has room
    (H100 host, 16 CPUs: 94.7 -> 124.3 tok/s at 14 threads) and stalls it where it has none (101 -> 7.7
    tok/s at 15)."""
    return threads + 2 <= available_cpus()
