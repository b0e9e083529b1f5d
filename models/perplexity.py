"""Perplexity the way llama-perplexity computes it: non-overlapping windows, second half scored."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hotcold.errors import HotcoldError
from hotcold.models.transformer import Transformer


BATCH_LOGIT_BYTES = 1 << 30  # float32 logits of a batch of windows at most


@dataclass
class PerplexityResult:
    ppl: float
    nll_sum: float
    tokens_scored: int
    windows: int
    ctx: int


def calibration_text() -> str:
    """Python's own documentation (pydoc_data.topics): ~110k tokens of English prose, no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def window_nll(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[float, int]:
    """Sum of NLL over the second half of one window, as llama-perplexity scores it.

    logits: [N, V] fp32 for tokens: [N], or [N - N // 2, V] for positions N // 2.. only;
    positions first..N-2 predict tokens first+1..N-1.
    """
    n = tokens.shape[0]
    first = n // 2
    at = first if logits.shape[0] == n else 0  # the row of position `first`
    logp = torch.log_softmax(logits[at : at + n - 1 - first].double(), dim=-1)
    target = tokens[first + 1 :]
    nll = -logp.gather(1, target[:, None]).sum()
    return float(nll), int(target.numel())


@torch.inference_mode()
def perplexity(
    model: Transformer,
    ids: list[int],
    ctx: int = 512,
    bos_id: int | None = None,
    max_windows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    batch: int = 1,
) -> PerplexityResult:
    """Split ids into windows of ctx tokens (the first replaced by BOS when the model uses one).
    batch: windows per forward, fewer where their logits would pass BATCH_LOGIT_BYTES (the
    profile's searches evaluate ~10 times: on a quantised model each forward decodes every
    matrix once, and on the busy 2-core machine SmolLM2's 4 windows together took 0.24-0.43 of
    their time one at a time)."""
    if ctx < 4:
        raise HotcoldError(f"--ctx: {ctx} is too small; use at least 4 (default 512)")
    n_windows = len(ids) // ctx
    if max_windows:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        raise HotcoldError(f"text has {len(ids)} tokens, fewer than one window of --ctx {ctx}; give more text or a smaller --ctx")
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    batch = max(1, min(batch, BATCH_LOGIT_BYTES // max(1, 4 * (ctx - ctx // 2) * vocab)))
    nll_sum, scored = 0.0, 0
    for w0 in range(0, n_windows, batch):
        windows = torch.tensor([ids[w * ctx : (w + 1) * ctx] for w in range(w0, min(n_windows, w0 + batch))],
                               device=device)  # [B, ctx]
        if bos_id is not None:
            windows[:, 0] = bos_id
        logits = model(windows, logits_from=ctx // 2)  # [B, ctx - ctx // 2, V]: the scored halves'
        for b, window in enumerate(windows):
            nll, n = window_nll(logits[b], window)
            nll_sum += nll
            scored += n
            if progress:
                progress(w0 + b + 1, n_windows)
    return PerplexityResult(math.exp(nll_sum / scored), nll_sum, scored, n_windows, ctx)
