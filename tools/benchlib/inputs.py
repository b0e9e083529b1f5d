"""Inputs: model paths, engines and their arguments."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from benchlib.common import ENGINE_KINDS, BenchError

@dataclass
class ModelPaths:
    hf: Path | None  # HF folder (config.json + weights)
    gguf: Path | None  # GGUF for llama.cpp
    hotcold: Path  # what hotcold (and the tokenizer) reads
    label: str


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model(model: str, gguf: str | None) -> ModelPaths:
    """MODEL (HF folder, make_model folder or .gguf) and --gguf -> the paths each engine reads."""
    path = Path(model).expanduser()
    if not path.exists():
        raise BenchError(f"MODEL: {path}: no such file or folder; pass an HF folder, a make_model folder or a .gguf")
    hf = None
    default_gguf = None
    if path.is_dir():
        if (path / "config.json").is_file():
            hf = path
            default_gguf = next((p for p in (path.parent / "model.gguf", path / "model.gguf") if p.is_file()), None)
        elif (path / "hf" / "config.json").is_file():
            hf = path / "hf"
            default_gguf = path / "model.gguf" if (path / "model.gguf").is_file() else None
        elif (path / "model.gguf").is_file():  # a make_model folder in the GGUF form only
            default_gguf = path / "model.gguf"
        else:
            raise BenchError(f"MODEL: {path}: not an HF model folder (no config.json) nor a make_model folder "
                             "(no hf/config.json or model.gguf)")
    elif not _is_gguf(path):
        raise BenchError(f"MODEL: {path}: not a GGUF file (no GGUF magic) nor a folder")
    else:
        default_gguf = path
    if gguf is not None:
        g = Path(gguf).expanduser()
        if not g.is_file():
            raise BenchError(f"--gguf: {g}: no such file")
        if not _is_gguf(g):
            raise BenchError(f"--gguf: {g}: not a GGUF file (no GGUF magic)")
        default_gguf = g
    label = (f"{hf} + {default_gguf.name}" if hf and default_gguf else str(hf or default_gguf))
    return ModelPaths(hf, default_gguf, hf if hf is not None else default_gguf or path, label)


@dataclass
class BenchEngine:
    name: str  # row name
    kind: str  # one of ENGINE_KINDS
    args: list[str] = field(default_factory=list)  # extra hotcold options (variants)


def hotcold_options(args: list[str], device: str, dtype: str | None) -> argparse.Namespace:
    """The options a hotcold row takes (--hotcold-args, --variant). Add runtime options here."""
    p = argparse.ArgumentParser(prog="hotcold variant", add_help=False, exit_on_error=False)
    p.add_argument("--device", default=device)
    p.add_argument("--dtype", default=dtype)
    p.add_argument("--plan", default=None)  # plan.safetensors or its folder (default: the model's own)
    p.add_argument("--no-plan", action="store_true")  # the dense reference engine
    p.add_argument("--no-sparse", action="store_true")  # without the profile's input sparsity
    p.add_argument("--map-experts", action="store_true")  # a plan's CPU experts read in place from the file
    p.add_argument("--defer-experts", action="store_true")  # a plan's CPU experts one layer late (not exact)
    p.add_argument("--env", action="append", default=[])  # NAME=VALUE for the row's process (engine switches)
    try:
        ns, extra = p.parse_known_args(args)
    except argparse.ArgumentError as e:
        raise BenchError(f"hotcold options {shlex.join(args)!r}: {e}") from None
    if extra:
        raise BenchError(f"hotcold options: unknown {shlex.join(extra)!r} (known: --device, --dtype, --plan, "
                         "--no-plan, --no-sparse, --map-experts, --defer-experts, --env)")
    for kv in ns.env:
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", kv):
            raise BenchError(f"hotcold options: --env {kv!r} is not NAME=VALUE")
    ns.env = dict(kv.split("=", 1) for kv in ns.env)
    return ns


def parse_engines(text: str, variants: list[str], hotcold_args: str, device: str, dtype: str | None) -> list[BenchEngine]:
    """--engines plus --variant NAME=ARGS rows (placed after 'hotcold' unless --engines names them)."""
    defined: dict[str, BenchEngine] = {k: BenchEngine(k, k) for k in ENGINE_KINDS}
    defined["hotcold"].args = shlex.split(hotcold_args or "")
    extra: list[str] = []
    for v in variants:
        name, sep, args = v.partition("=")
        name = name.strip()
        if not sep or not name or not re.fullmatch(r"[\w.+-]+", name):
            raise BenchError(f"--variant: '{v}' is not NAME=ARGS (e.g. \"hotcold-bf16=--dtype bfloat16\")")
        if name in defined:
            raise BenchError(f"--variant: name '{name}' is taken")
        defined[name] = BenchEngine(name, "hotcold", defined["hotcold"].args + shlex.split(args))
        extra.append(name)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--engines: empty; use e.g. hotcold,llama.cpp,transformers")
    for n in names:
        if n not in defined:
            raise BenchError(f"--engines: unknown engine '{n}' (known: {', '.join(defined)})")
    if len(set(names)) != len(names):
        raise BenchError(f"--engines: '{text}' names an engine twice")
    for n in extra:
        if n not in names:
            names.insert(names.index("hotcold") + 1 if "hotcold" in names else 0, n)
    engines = [defined[n] for n in names]
    for e in engines:
        if e.kind == "hotcold":
            hotcold_options(e.args, device, dtype)  # validate now, one line
    return engines


def reference_engine(engines: list[BenchEngine]) -> str | None:
    """llama.cpp when it runs, else the first peer (not hotcold), else None."""
    names = [e.name for e in engines]
    if "llama.cpp" in names:
        return "llama.cpp"
    peers = [e.name for e in engines if e.kind != "hotcold"]
    return peers[0] if peers else None
