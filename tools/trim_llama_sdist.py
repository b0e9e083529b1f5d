#!/usr/bin/env python3
"""Trim llama-cpp-python's source package to what a CUDA build on the GPU host needs.

The PyPI sdist (~77 MB) holds llama.cpp's models, docs, tests, examples, web UI, git history and
every ggml backend; a device call carries at most 64 MiB of files. The CPU and CUDA backends, the
library, `common` and the Python package are kept (~5 MB compressed), which `tools/bench.py
--llama-cpp-src` builds with CUDA (LLAVA off, as bench.py configures it):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d dl
    python tools/trim_llama_sdist.py dl/llama_cpp_python-0.3.36.tar.gz .devdata/llama_cpp_python-0.3.36-trimmed.tar.gz
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
from pathlib import PurePosixPath

# paths under the package's top folder that the build never reads
DROP = ("vendor/llama.cpp/" + p for p in (
    "models", "docs", "media", "benches", "tests", "examples", "pocs", "gguf-py", "conversion", "scripts",
    "tools/ui", "tools/server", "app", ".git", ".github",
    *(f"ggml/src/ggml-{b}" for b in ("virtgpu", "cann", "openvino", "webgpu", "et", "metal", "hexagon", "sycl",
                                     "vulkan", "opencl", "musa", "zdnn", "rpc"))))
DROP_TOP = (".git", ".github", "docker", "examples", "docs")


def dropped(name: str, drop: tuple[str, ...]) -> bool:
    parts = PurePosixPath(name).parts[1:]  # below the package's top folder
    rel = "/".join(parts)
    return bool(parts) and (parts[0] in DROP_TOP or any(rel == d or rel.startswith(d + "/") for d in drop))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sdist", help="llama_cpp_python-VERSION.tar.gz from PyPI")
    ap.add_argument("out", help="the trimmed .tar.gz to write")
    a = ap.parse_args(argv)
    drop = tuple(DROP)
    try:
        src = tarfile.open(a.sdist, "r:gz")
    except (OSError, tarfile.TarError) as e:
        print(f"error: {a.sdist}: not a readable .tar.gz ({e})", file=sys.stderr)
        return 2
    kept = skipped = 0
    tmp = a.out + ".tmp"
    with src, tarfile.open(tmp, "w:gz") as dst:
        for m in src:
            if dropped(m.name, drop):
                skipped += 1
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            kept += 1
    os.replace(tmp, a.out)
    print(f"{a.out}: kept {kept} entries, dropped {skipped} ({os.path.getsize(a.out) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
