"""Memory readings for tests (Linux /proc)."""

from __future__ import annotations

import os

HAVE_SMAPS = os.path.exists("/proc/self/smaps")


def mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of the file `path` (/proc/self/smaps)."""
    target = os.path.realpath(path)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                inside = line.rstrip().endswith(target)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def hugepage_advised(t) -> bool:
    """Whether the first 2 MiB-aligned 2 MiB block inside tensor t's memory lies in a mapping that
    carries the huge-page advice (VmFlags `hg`, /proc/self/smaps). t must span at least 4 MiB."""
    huge = 2 << 20
    start = t.data_ptr()
    block = (start + huge - 1) // huge * huge
    assert block + huge <= start + t.numel() * t.element_size(), "t holds no aligned 2 MiB block"
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                lo, hi = (int(v, 16) for v in first.split("-"))
                inside = lo <= block < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False
