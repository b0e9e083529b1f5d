"""MoE expert look-ahead: from the residual stream at layer l, guess the experts layer l+1 will pick,
so their weights can be prefetched to the GPU while layer l computes.

The first guess is layer l+1's own router applied to layer l's residual (after layer l+1's norm).
When its top-k recall on held-out samples is below a target, a corrected router, initialised from
it and trained on the profile's look-ahead samples, replaces it if it does better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LookaheadMetrics:
    layer: int  # predicts the experts of layer + 1
    mode: str  # "router" (l+1's router as is) or "trained" (corrected copy)
    router_recall: float  # top-k recall of the plain router guess (held-out)
    recall: float  # top-k recall of the mode kept
    recall_at_2k: float  # recall when 2k experts are prefetched
    samples: int


def topk_recall(logits: torch.Tensor, truth: torch.Tensor, k: int) -> float:
    """Fraction of the true experts (truth: [S, k_true]) among the top-k of logits [S, E]."""
    guess = logits.topk(k, dim=-1).indices  # [S, k]
    hits = (guess[:, :, None] == truth[:, None, :]).any(1).float()  # [S, k_true]
    return float(hits.mean())


def fit_lookahead(hidden: torch.Tensor, experts: torch.Tensor, norm: nn.Module, router: nn.Linear,
                  layer: int = 0, target: float = 0.9, heldout: float = 0.2, epochs: int = 60,
                  lr: float = 1e-3, seed: int = 0) -> tuple[torch.Tensor | None, LookaheadMetrics]:
    """hidden: [S, D] residuals at `layer`; experts: [S, k] chosen by layer+1; norm/router: layer+1's.
    Returns (corrected router weight [E, D] or None to use the router as is, metrics)."""
    k = experts.shape[1]
    n_experts = router.weight.shape[0]
    with torch.no_grad():
        z = norm(hidden.to(router.weight.dtype)).float()  # [S, D]
    perm = torch.randperm(len(z), generator=torch.Generator().manual_seed(seed + layer))
    n_test = max(1, int(len(z) * heldout))
    test, train = perm[:n_test], perm[n_test:]
    w0 = router.weight.detach().float()
    base = topk_recall(z[test] @ w0.T, experts[test], k)
    best_w, best, mode = None, base, "router"
    if base < target and len(train) >= 8:
        w = nn.Parameter(w0.clone())
        opt = torch.optim.Adam([w], lr=lr)
        target_mask = torch.zeros(len(z), n_experts, device=z.device).scatter_(1, experts.long(), 1.0)
        for _ in range(epochs):
            for idx in train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))].split(256):
                opt.zero_grad()
                loss = nn.functional.binary_cross_entropy_with_logits(z[idx] @ w.T, target_mask[idx])
                loss.backward()
                opt.step()
        with torch.no_grad():
            trained = topk_recall(z[test] @ w.T, experts[test], k)
        if trained > best:
            best_w, best, mode = w.detach().to(router.weight.dtype), trained, "trained"
    final = best_w.float() if best_w is not None else w0
    at2k = topk_recall(z[test] @ final.T, experts[test], min(2 * k, n_experts))
    return best_w, LookaheadMetrics(layer, mode, round(base, 4), round(best, 4), round(at2k, 4), len(z))
