#!/usr/bin/env python3
"""CLI smoke run on a CUDA GPU: a tiny random llama with a real tokenizer, through `hotcold run` and
`hotcold perplexity` on --device cuda in every dtype. Prints one line per run.

    python tools/gpu_smoke.py TOKENIZER_DIR     # a folder with tokenizer.json (+ tokenizer_config.json)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers as T


def main() -> None:
    tok_dir = Path(sys.argv[1])
    vocab = len(json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
        T.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
        for f in tok_dir.iterdir():
            shutil.copy(f, model_dir / f.name)
        data = Path(tmp) / "text.txt"
        from pydoc_data.topics import topics

        data.write_text("\n\n".join(topics[k] for k in sorted(topics))[:40_000])
        for dtype in ("float32", "bfloat16", "float16"):
            run = subprocess.run([sys.executable, "-m", "hotcold.cli", "run", str(model_dir), "--device", "cuda",
                                  "--dtype", dtype, "--prompt", "Hello, GPU", "-n", "32", "--temperature", "0",
                                  "--ignore-eos", "--json"], capture_output=True, text=True)
            if run.returncode:
                sys.exit(f"run {dtype} failed: {run.stderr.strip()}")
            out = json.loads(run.stdout)
            ppl = subprocess.run([sys.executable, "-m", "hotcold.cli", "perplexity", str(model_dir), "--device", "cuda",
                                  "--dtype", dtype, "--data", str(data), "--ctx", "256", "--json"],
                                 capture_output=True, text=True)
            if ppl.returncode:
                sys.exit(f"perplexity {dtype} failed: {ppl.stderr.strip()}")
            p = json.loads(ppl.stdout)
            print(f"cuda {dtype:9s} run: {out['completion_tokens']} tokens, ttft {out['ttft_s']:.3f} s, "
                  f"{out['decode_tok_per_s']:.1f} tok/s | perplexity {p['ppl']:.1f} over {p['tokens_scored']} tokens")


if __name__ == "__main__":
    main()
