#!/usr/bin/env python3
"""What requantising the hot W_down columns to int4 costs in accuracy: the measurement behind
`hotcold.sparse_ops.gpu_quant.INT4_DOWN_DEFAULT` (issue 10).

Under `--gpu-int4` the hot up/gate rows keep their own GGUF blocks, but W_down's blocks run along
its input (neuron) axis, 32 consecutive neurons each: the hot columns [D, H], in the plan's order,
group other neurons together, so they can be int4 only when requantised: asymmetric min/max groups
of 32 along H (`quantize_int4`). Per layer of a quantised GGUF, on real FFN inputs (--tokens tokens of
Python's documentation through the file's own model), relative RMS against the FFN output y = h @ W_q.T
(W_q: the file's W_down) of

  f=F        h_hot @ (W_rq - W_q[:, hot]).T for a random fraction F of the neurons in random order
             (a plan's: hottest first, unrelated to the index)
  f=F sort   the same neurons in ascending order (groups closer to the file's blocks)
  bf16       h @ (bf16(W_q) - W_q).T: what W_down expanded to bf16 costs
  own        y_q - y_f, the whole FFN: the file's own quantisation (--float only)
  own_down   h_f @ (W_q - W_f).T against y_f: W_down's share of it

--float names the model's float weights (an HF folder, e.g. the `hf/` that tools/make_model.py
writes beside a quantised GGUF). --ppl adds perplexities (3 windows of 256 tokens, as docs/quantization.md's
table): the dense file, and the hybrid engine with every neuron hot on the CPU tier, int4 hot rows
(torch's CPU int4 kernels), W_down in float32 or requantised (random and ascending order).

    python tools/int4_down_error.py MODEL.gguf [--float HF_DIR] [--tokens 256] [--hot 0.25,0.5,1] [--ppl]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from hotcold.models.layers import DenseFFN, GatedFFN
from hotcold.models.loader import load_model
from hotcold.models.perplexity import calibration_text, perplexity
from hotcold.sparse_ops.gpu_quant import GROUP_SIZE, quantize_int4


def requantised(w: torch.Tensor) -> torch.Tensor:
    """w [D, I] float32 through quantize_int4 (groups of 32 along I) and back, float32."""
    packed, scale, zero = quantize_int4(w.numpy())
    p = torch.from_numpy(packed)
    codes = torch.stack([p >> 4, p & 15], dim=-1).reshape(w.shape).float()  # [D, I]
    rep = lambda a: torch.from_numpy(a).repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
    return (codes - 8) * rep(scale) + rep(zero)


def rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    return float(err.double().norm() / ref.double().norm())


def ffn_inputs(lm, ids: list[int]) -> dict[int, torch.Tensor]:
    """Per dense/gated layer, its FFN's input for the tokens ids: [T, D] float32."""
    xs, hooks = {}, []
    for l, block in enumerate(lm.model.layers):
        if isinstance(block.ffn, (DenseFFN, GatedFFN)):
            hooks.append(block.ffn.register_forward_pre_hook(
                lambda m, args, l=l: xs.__setitem__(l, args[0].reshape(-1, args[0].shape[-1]).float())))
    with torch.inference_mode():
        lm.model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return xs


def weights(ffn) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(W_up [I, D], W_gate or None, W_down [D, I], up bias or None), float32 (QuantLinear decoded)."""
    gate = ffn.gate.weight.float() if isinstance(ffn, GatedFFN) else None
    bias = None if isinstance(ffn, GatedFFN) else ffn.up.bias.float()
    return ffn.up.weight.float(), gate, ffn.down.weight.float(), bias


def activations(ffn, x: torch.Tensor, up, gate, bias) -> torch.Tensor:
    # x: [T, D] -> h: [T, I]
    if gate is not None:
        return ffn.act(x @ gate.T) * (x @ up.T)
    return ffn.act(x @ up.T + bias)


def layer_errors(ffn, x: torch.Tensor, fracs: list[float], ref_ffn=None, seed: int = 0) -> dict[str, float]:
    up, gate, wd, bias = weights(ffn)
    h = activations(ffn, x, up, gate, bias)  # [T, I]
    y = h @ wd.T  # [T, D]
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for f in fracs:
        n = int(round(f * wd.shape[1])) // GROUP_SIZE * GROUP_SIZE
        hot = torch.randperm(wd.shape[1], generator=gen)[:n]
        for name, cols in ((f"f={f:g}", hot), (f"f={f:g} sort", hot.sort().values)):
            w = wd[:, cols]  # [D, H]
            out[name] = rel(h[:, cols] @ (requantised(w) - w).T, y)
    out["bf16"] = rel(h @ (wd.bfloat16().float() - wd).T, y)
    if ref_ffn is not None:
        fu, fg, fd, fb = weights(ref_ffn)
        hf = activations(ffn, x, fu, fg, fb)
        yf = hf @ fd.T
        out.update(own=rel(y - yf, yf), own_down=rel(hf @ (wd - fd).T, yf))
    return out


def hybrid_ppl(path: str, ids: list[int], bos, int4_down: bool, order: str) -> float:
    """Perplexity with every neuron hot on the CPU tier, int4 hot rows, W_down as int4_down says,
    the hot neurons in random or ascending order."""
    from hotcold.executors import make_hybrid, random_hot

    lm = load_model(path, "cpu", "float32")
    hot = random_hot(lm, 1.0)
    if order == "sorted":
        hot = {l: h.sort().values for l, h in hot.items()}
    with make_hybrid(lm, hot, None, threads=2, int4_hot=True, int4_down=int4_down) as eng:
        assert all(f.gpu.hot.int4 for f in eng.layers.values()), eng.int4_skipped()
        return perplexity(lm.model, ids, 256, bos, 3).ppl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a quantised GGUF file")
    ap.add_argument("--float", dest="float_dir", help="the same model's float weights (HF folder)")
    ap.add_argument("--tokens", type=int, default=256, help="FFN inputs: this many tokens of text (default 256)")
    ap.add_argument("--hot", default="0.25,0.5,1", help="hot fractions to requantise (default 0.25,0.5,1)")
    ap.add_argument("--ppl", action="store_true", help="also perplexities with int4 hot rows, W_down float / int4")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(args.model, "cpu", "float32")
    ref = load_model(args.float_dir, "cpu", "float32") if args.float_dir else None
    fracs = [float(f) for f in args.hot.split(",")]
    text = calibration_text()
    xs = ffn_inputs(lm, lm.tokenizer.encode(text[:20 * args.tokens])[: args.tokens])
    rows = {l: layer_errors(lm.model.layers[l].ffn, x, fracs, ref and ref.model.layers[l].ffn, seed=l)
            for l, x in xs.items()}
    keys = list(next(iter(rows.values())))
    print(f"{args.model}: relative RMS of the FFN output per layer, {args.tokens} tokens")
    print(f"{'layer':>5} " + " ".join(f"{k:>10}" for k in keys))
    for l, r in rows.items():
        print(f"{l:>5} " + " ".join(f"{r[k]:10.4f}" for k in keys))
    print(f"{'mean':>5} " + " ".join(f"{np.mean([r[k] for r in rows.values()]):10.4f}" for k in keys))
    if args.ppl:
        ids = lm.tokenizer.encode(text[30_000:60_000])
        bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
        print(f"perplexity (3 x 256 tokens): dense file {perplexity(lm.model, ids, 256, bos, 3).ppl:.3f}; every "
              f"neuron hot, int4 up/gate: W_down float {hybrid_ppl(args.model, ids, bos, False, 'random'):.3f}, "
              f"int4 {hybrid_ppl(args.model, ids, bos, True, 'random'):.3f} (random order), "
              f"{hybrid_ppl(args.model, ids, bos, True, 'sorted'):.3f} (ascending)")


if __name__ == "__main__":
    main()
