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
