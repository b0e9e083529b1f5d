"""What every part of the bench shares: its constants, `BenchError`, sizes, statistics and number formats."""

from __future__ import annotations

import statistics

ENGINE_KINDS = ("hotcold", "llama.cpp", "transformers")
DEFAULT_ENGINES = "hotcold,llama.cpp,transformers"
METRICS = ("load_s", "prefill_tok_per_s", "decode_tok_per_s", "ttft_s", "peak_ram_bytes", "peak_vram_bytes")
WARMUP_PROMPT = 8  # tokens of the warm-up generation in each child
WARMUP_TOKENS = 2
NOISY = 0.15  # a spread (half range) above this fraction of the median is flagged
BUILD_HINT = ('llama-cpp-python here has no GPU offload; build it with CUDA from the PyPI source package: '
              'CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-binary llama-cpp-python --force-reinstall '
              '--no-deps llama-cpp-python==VERSION (or the carried sdist .tar.gz)')


class BenchError(Exception):
    """A one-line usage or setup error: printed as `error: ...`, exit code 2."""


def vram_size(text: str) -> int:
    """--vram's bytes by hotcold's parse_size ('8GiB', '8G' binary, '8GB' decimal, '512MiB', bytes);
    a BenchError unless it is a positive size."""
    from hotcold.errors import HotcoldError
    from hotcold.planner.sizes import parse_size

    try:
        value = parse_size(text, "--vram")
    except HotcoldError as e:
        raise BenchError(str(e)) from None
    if value <= 0:
        raise BenchError(f"--vram: '{text}' is not a positive size")
    return value


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def _decimals(v: float) -> int:
    a = abs(v)
    return 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 1 else 3


def fmt_num(v: float | None, like: float | None = None) -> str:
    """Three or four significant figures, no exponent: 1234, 127, 17.8, 1.23, 0.311; with `like`,
    as many decimals as `like` gets (a spread printed beside its median)."""
    if v is None:
        return "-"
    return f"{v:.{_decimals(v if like is None else like)}f}"


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×" if r < 100 else f"{r:.0f}×"


def summarise(values: list[float | None]) -> dict | None:
    """Median, min, max and spread (half the range) of one metric over repeats; None if no values."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    return {"median": statistics.median(vals), "min": lo, "max": hi, "spread": (hi - lo) / 2, "n": len(vals)}


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference
