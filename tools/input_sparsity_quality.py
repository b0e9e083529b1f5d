#!/usr/bin/env python3
"""What the profile's input sparsity costs in quality, dense and sparse side by side in one process.

    python tools/input_sparsity_quality.py MODEL --data TEXT [--ctx 512] [--chunks 8] [--tokens 32]

MODEL must have a profile with input sparsity (`hotcold profile MODEL`). --data should be text the
profile did not calibrate or choose its level on (the profile reads Python's documentation by
default), e.g. the GPL text in /usr/share/common-licenses. Prints, and with --json writes:

- perplexity over --chunks windows of --ctx tokens of --data, dense and thresholded;
- for each prompt of a fixed set, whether the first --tokens greedy tokens are identical, and the
  first position where they differ;
- the share of the thresholded projections' inputs skipped while decoding (by weights).

Speed is measured separately, in separate processes: tools/bench.py MODEL --variant
"hotcold-dense=--no-sparse".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "The three most important things to know about photosynthesis are",
    "Once upon a time, in a small village by the sea,",
    "To install the package, run",
    "The capital of France is",
    "Water boils at a lower temperature at high altitude because",
    "Here is a short poem about autumn:",
    "The main differences between TCP and UDP are",
    "In 1969, the first humans",
    "A good breakfast should include",
    "The following SQL query selects all users who",
]


def greedy(lm, prompt: str, n: int) -> list[int]:
    from hotcold.models.generate import Generator
    from hotcold.models.sampling import SamplingParams

    ids = lm.tokenizer.encode(prompt)
    gen = Generator(lm, max_context=len(ids) + n + 8)
    return [e.token_id for e in gen.generate(ids, n, SamplingParams(temperature=0), ignore_eos=True)]


def measure(lm, ids: list[int], ctx: int, chunks: int, tokens: int) -> dict:
    from hotcold.models.perplexity import perplexity

    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    return {"ppl": perplexity(lm.model, ids, ctx, bos, chunks).ppl,
            "greedy": [greedy(lm, p, tokens) for p in PROMPTS]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--data", type=Path, required=True, help="UTF-8 text the profile did not see")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if not a.data.is_file():
        print(f"error: --data {a.data}: no such file", file=sys.stderr)
        return 2

    from hotcold.executors.from_plan import open_for_run
    from hotcold.executors.input_sparse import open_input_sparsity

    setup = open_for_run(a.model, use_plan=False, input_sparse=False)
    lm = setup.lm
    ids = lm.tokenizer.encode(a.data.read_text(encoding="utf-8"))
    dense = measure(lm, ids, a.ctx, a.chunks, a.tokens)
    applied, note = open_input_sparsity(lm, True)
    if applied is None:
        print(f"error: {a.model}: its profile has no input sparsity (run `hotcold profile MODEL`)", file=sys.stderr)
        return 2
    sparse = measure(lm, ids, a.ctx, a.chunks, a.tokens)
    differ = [next((i for i, (x, y) in enumerate(zip(d, s)) if x != y), None)
              for d, s in zip(dense["greedy"], sparse["greedy"])]
    out = {"model": str(a.model), "data": str(a.data), "note": note, "ctx": a.ctx, "chunks": a.chunks,
           "ppl_dense": dense["ppl"], "ppl_sparse": sparse["ppl"], "ppl_rise": sparse["ppl"] / dense["ppl"] - 1,
           "greedy_tokens": a.tokens, "prompts": len(PROMPTS),
           "greedy_identical": sum(d is None for d in differ), "first_difference": differ,
           "decode_inputs_skipped": applied.achieved()}
    print(f"{note}\nperplexity on {a.data.name} ({a.chunks} x {a.ctx}): dense {out['ppl_dense']:.4f}, "
          f"sparse {out['ppl_sparse']:.4f} ({out['ppl_rise']:+.2%})\n"
          f"greedy {a.tokens} tokens identical on {out['greedy_identical']} of {len(PROMPTS)} prompts "
          f"(first differences at {[d for d in differ if d is not None]}); "
          f"inputs skipped while decoding {out['decode_inputs_skipped']:.1%} (by weights)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    setup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
