"""The whole user workflow on a small random ReLU llama, through the CLI: profile -> probe -> plan -> run.

    python tools/workflow_smoke.py [--device cuda] [--vram 64MiB] [--hidden 256 --ffn 1024 --layers 4] [--work DIR]

For checking a machine (e.g. the GPU host) end to end without any model download: the model is
made with transformers and a tokenizer trained on Python's documentation. Exits non-zero at the
first failing step.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def make(folder: Path, hidden: int, ffn: int, layers: int) -> Path:
    import torch
    import transformers as T
    from tiny_models import add_tiny_tokenizer

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=160, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                            hidden_act="relu",
                            max_position_embeddings=1024, initializer_range=0.05)
        T.LlamaForCausalLM(cfg).save_pretrained(folder)
    return add_tiny_tokenizer(folder)


def step(*args: str) -> None:
    cmd = [sys.executable, "-m", "hotcold.cli", *args]
    print("$ hotcold", " ".join(args), flush=True)
    t = time.perf_counter()
    r = subprocess.run(cmd)
    print(f"  ({time.perf_counter() - t:.1f} s, exit {r.returncode})", flush=True)
    if r.returncode:
        sys.exit(r.returncode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vram", default="64MiB")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="hotcold-smoke-")))
    args = ap.parse_args()
    model = make(args.work / "relu-llama", args.hidden, args.ffn, args.layers)
    step("profile", str(model), "--tokens", "8192", "--seq-len", "256", "--samples", "1024", "--device", args.device)
    step("probe", "--quick")
    step("plan", str(model), "--vram", args.vram, "--workspace", "1MiB", "--explain")
    step("run", str(model), "--prompt", "The value of", "-n", "32", "--temperature", "0", "--ignore-eos", "--stats",
         "--device", args.device)
    step("run", str(model), "--prompt", "The value of", "-n", "32", "--temperature", "0", "--ignore-eos", "--no-plan",
         "--device", args.device)


if __name__ == "__main__":
    main()
