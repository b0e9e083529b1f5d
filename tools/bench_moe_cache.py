#!/usr/bin/env python3
"""Hit rate of the MoE expert cache and recall of the look-ahead, by cache size and eviction policy.

Decodes real text (Python's documentation) greedily through a MoE model's hybrid engine with the
expert cache on, for each --slots and --policies, and prints per configuration the share of routed
host experts found in the cache, the experts copied per token, and the look-ahead's recall (the
share of routed host experts it had named one layer ahead). No expert is pinned on the fast tier, so
the cache alone decides what the GPU computes. Speed is not measured here: on a machine without
CUDA the fast tier is the CPU and the copies are host-to-host; the hit rate is what the GPU's share
of expert work would be.

    python tools/make_model.py qwen3-30b-a3b --layers 4 --out /tmp/q3 --format hf
    python tools/bench_moe_cache.py /tmp/q3/hf --slots 32,128,256 --policies lru,lfu --tokens 64
"""

from __future__ import annotations

import argparse
import time

import torch

from hotcold.executors import make_hybrid
from hotcold.executors.expert_cache import ExpertCache
from hotcold.models.loader import load_model
from hotcold.models.transformer import KVCache


def prompt_ids(lm, n: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))[: 40 * n]
    ids = lm.tokenizer.encode(text)[:n] if lm.tokenizer is not None else list(range(3, 3 + n))
    return torch.tensor([ids])


def run(path: str, slots: int, policy: str, prefetch: int | None, tokens: int, prompt: int, device: str,
        threads: int | None) -> dict:
    lm = load_model(path, device="cpu", dtype="bfloat16")
    c = lm.config
    one = ExpertCache.slot_bytes(c.moe_intermediate_size, c.hidden_size, "bf16")
    ids = prompt_ids(lm, prompt + tokens)
    with make_hybrid(lm, {}, None, device=device, dtype=torch.bfloat16, cpu_dtype="bf16", threads=threads,
                     expert_cache_bytes=slots * one, expert_cache_policy=policy, prefetch_experts=prefetch,
                     prefill="cpu") as eng:
        cache = KVCache(c, prompt + tokens + 1, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
        t0 = time.perf_counter()
        with torch.inference_mode():
            lm.model(ids[:, :prompt].to(lm.device), 0, cache)  # prefill: no cache use
            eng.reset_stats()
            for i in range(prompt, prompt + tokens):  # teacher-forced decode of the text
                lm.model(ids[:, i:i + 1].to(lm.device), i, cache)
        st = eng.stats()["decode"]
        secs = time.perf_counter() - t0
    return dict(slots=slots, policy=policy, prefetch=prefetch or max(1, c.top_k // 2), hit_rate=st["cache_hit_rate"] or 0.0,
                recall=st["lookahead_recall"] or 0.0, copied=st["per_token"]["experts_prefetched"],
                host_experts=st["per_token"]["experts_cached"] + st["per_token"]["experts_cpu"], seconds=secs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a MoE model (HF folder or GGUF)")
    ap.add_argument("--slots", default="32,128", help="comma-separated cache sizes, in experts")
    ap.add_argument("--policies", default="lru,lfu")
    ap.add_argument("--prefetch", default="", help="comma-separated experts named per layer (default top-k / 2)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps (teacher-forced on the text)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens before decoding")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rows = [run(args.model, int(s), p, int(m) if m else None, args.tokens, args.prompt, args.device, args.threads)
            for s in args.slots.split(",") for p in args.policies.split(",") for m in args.prefetch.split(",")]
    print(f"\n{args.model}: {args.tokens} decode steps, fast tier {args.device}, no expert pinned on it")
    print(f"{'slots':>6} {'policy':>6} {'named':>6} {'hit rate':>9} {'look-ahead recall':>18} {'copied/token':>13} "
          f"{'host experts/token':>19}")
    for r in rows:
        print(f"{r['slots']:>6} {r['policy']:>6} {r['prefetch']:>6} {r['hit_rate']:>9.1%} {r['recall']:>18.1%} {r['copied']:>13.1f} "
              f"{r['host_experts']:>19.1f}")


if __name__ == "__main__":
    main()
