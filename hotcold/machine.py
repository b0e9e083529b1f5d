"""Facts about this machine that several packages read: its last-level cache and whether other work
is running on it now."""

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
