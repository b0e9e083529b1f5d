"""Byte sizes on the command line: `8GiB`, `512MiB`, `8G`, `1.5GB`, `4096`, `0`.

`K/M/G/T` alone and `KiB/MiB/GiB/TiB` are powers of 1024 (as in llama.cpp and docker); `KB/MB/GB/TB` are
powers of 1000. A bare number is bytes. Case does not matter.
"""

from __future__ import annotations

import re

from hotcold.errors import HotcoldError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, what: str = "size") -> int:
    """Bytes from '8GiB', '512MiB', '8G', '0'...; a clear one-line error otherwise."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise HotcoldError(f"{what}: cannot read size '{text}' (examples: 8GiB, 512MiB, 8G, 0)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """'8.00 GiB', '512.0 MiB', '12 B'."""
    n = float(n)
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{int(n)} B"


def size_arg(n: float) -> str:
    """A size as the user would type it to get at least n bytes (rounded up to 0.01 GiB or 1 MiB)."""
    import math

    if n >= GiB:
        return f"{math.ceil(n / GiB * 100) / 100:g}GiB"
    if n >= MiB:
        return f"{math.ceil(n / MiB)}MiB"
    return f"{max(1, math.ceil(n / KiB))}KiB"
