"""What a batched decode step costs against one step per sequence, in one run.

    python tools/bench_batch_step.py                 # SmolLM2-135M Q4_1 on the CPU, B = 1, 2, 4, 8
    python tools/bench_batch_step.py MODEL --batch 1,4,16 --position 300

For each B, alternating in rounds (a busy machine's noise falls on both alike): B sequences' next
tokens in one models/batch_step.decode_rows call, and the same B tokens as B one-sequence steps
(the model's forward over each sequence's own cache, as one request at a time decodes). Prints the
fastest of --repeats per form (the least disturbed), tokens per second of each and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    from conftest import smollm2_gguf

    from hotcold.models.batch_step import SlotCache, decode_rows
    from hotcold.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes")
    ap.add_argument("--position", type=int, default=64, help="tokens already in each sequence's cache")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    sizes = [int(b) for b in a.batch.split(",")]
    lm = load_model(a.model or str(smollm2_gguf()), "cpu")
    cache = SlotCache(lm.config, max(sizes), a.position + 8, dtype=lm.dtype)
    for s in range(max(sizes)):  # any keys and values: the cost does not depend on them
        for k, v in cache.layers:
            k[s].normal_()
            v[s].normal_()
    best = {(b, form): float("inf") for b in sizes for form in ("batched", "one by one")}
    tokens = [100 + i for i in range(max(sizes))]
    with torch.inference_mode():
        decode_rows(lm.model, tokens[:2], [a.position] * 2, cache, [0, 1])  # compile
        for _ in range(a.repeats):
            for b in sizes:
                t0 = time.perf_counter()
                decode_rows(lm.model, tokens[:b], [a.position] * b, cache, list(range(b)))
                best[b, "batched"] = min(best[b, "batched"], time.perf_counter() - t0)
                t0 = time.perf_counter()
                for s in range(b):
                    lm.model(torch.tensor([[tokens[s]]]), a.position, cache.view(s), last_only=True)
                best[b, "one by one"] = min(best[b, "one by one"], time.perf_counter() - t0)
    for b in sizes:
        tb, ts = best[b, "batched"], best[b, "one by one"]
        print(f"B={b:<3} batched {1000 * tb:7.1f} ms/step {b / tb:7.1f} tok/s   one by one {1000 * ts:7.1f} ms "
              f"{b / ts:7.1f} tok/s   x{ts / tb:.2f}")


if __name__ == "__main__":
    main()
