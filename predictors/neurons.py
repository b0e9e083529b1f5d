"""Per-layer neuron predictors: FFN input -> which neurons will be active (DejaVu/PowerInfer style).

A predictor is a low-rank MLP, x [D] -> r -> ReLU -> logits [I], trained with class-weighted BCE on
the profile's (FFN input, active mask) samples; a per-layer logit threshold is then chosen on
held-out samples so that the active neurons are caught with the target recall.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn


class NeuronPredictor(nn.Module):
    """x: [..., D] -> logits [..., I] through rank r."""

    def __init__(self, dim: int, n_neurons: int, rank: int):
        super().__init__()
        self.w1 = nn.Linear(dim, rank)
        self.w2 = nn.Linear(rank, n_neurons)
        self.register_buffer("threshold", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Active mask: bool [..., I]."""
        return self.forward(x) > self.threshold

    @property
    def rank(self) -> int:
        return self.w1.out_features

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def predictor_params(dim: int, n_neurons: int, rank: int) -> int:
    return rank * (dim + 1) + n_neurons * (rank + 1)


def choose_ranks(dim: int, n_neurons: list[int], active: list[float], mass80: list[float], budget_params: int,
                 lo: int = 16, hi: int = 1024, step: int = 8) -> list[int]:
    """Per-layer ranks within a parameter budget: layers that are denser (more active neurons) and
    less skewed (more neurons carrying 80% of activations) are harder to predict and get more."""
    weights = [max(a, 1e-3) * max(m, 1e-3) for a, m in zip(active, mass80)]
    total = sum(weights)
    ranks = []
    for n, w in zip(n_neurons, weights):
        share = budget_params * w / total
        r = int(share // (dim + n + 1)) // step * step
        ranks.append(max(lo, min(hi, dim, r)))
    return ranks


@dataclass
class LayerMetrics:
    layer: int
    rank: int
    params: int
    recall: float  # of truly active neurons, the fraction predicted active (held-out)
    precision: float  # of predicted-active neurons, the fraction truly active (held-out)
    predicted_active_fraction: float
    true_active_fraction: float
    threshold: float
    train_samples: int
    heldout_samples: int


def _split(n: int, heldout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, int(round(n * heldout)))
    return perm[k:], perm[:k]


def threshold_for_recall(logits: torch.Tensor, target: torch.Tensor, recall: float) -> float:
    """The largest logit threshold t such that (logits > t) catches `recall` of the positives."""
    pos = logits[target].float()
    if pos.numel() == 0:
        return float(logits.max())
    k = int(math.floor((1 - recall) * pos.numel()))  # positives we may miss
    if k == 0:
        return float(pos.min()) - 1e-6
    return float(torch.kthvalue(pos, k).values)


def train_layer(x: torch.Tensor, active: torch.Tensor, rank: int, layer: int = 0, recall: float = 0.95,
                heldout: float = 0.2, epochs: int = 20, lr: float = 5e-3, batch: int = 512, seed: int = 0
                ) -> tuple[NeuronPredictor, LayerMetrics]:
    """Train one layer's predictor. x: [S, D] FFN inputs, active: [S, I] bool. Deterministic for a seed."""
    torch.manual_seed(seed + layer)
    x = x.float()
    train_idx, test_idx = _split(len(x), heldout, seed + layer)
    xt, yt = x[train_idx], active[train_idx].float()
    model = NeuronPredictor(x.shape[1], active.shape[1], rank).to(x.device)
    # Class weights: a neuron that is rarely active gets its positives weighted up (capped).
    p = yt.mean(0).clamp(1e-3, 1 - 1e-3)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=((1 - p) / p).clamp(max=20.0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * max(1, math.ceil(len(xt) / batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    gen = torch.Generator().manual_seed(seed + layer)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=gen).split(batch):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
            sched.step()
    model.eval()
    # The threshold is chosen on one half of the held-out samples and measured on the other.
    val_idx, test_idx = test_idx[: len(test_idx) // 2], test_idx[len(test_idx) // 2 :]
    with torch.no_grad():
        thr = threshold_for_recall(model(x[val_idx]), active[val_idx], recall)
        model.threshold.fill_(thr)
        pred = model(x[test_idx]) > thr
        truth = active[test_idx]
    tp = float((pred & truth).sum())
    metrics = LayerMetrics(
        layer=layer, rank=rank, params=model.n_params(),
        recall=round(tp / max(1.0, float(truth.sum())), 4),
        precision=round(tp / max(1.0, float(pred.sum())), 4),
        predicted_active_fraction=round(float(pred.float().mean()), 4),
        true_active_fraction=round(float(truth.float().mean()), 4),
        threshold=thr, train_samples=len(train_idx), heldout_samples=len(val_idx) + len(test_idx),
    )
    return model, metrics


def cpu_time_per_token(predictors: dict[int, NeuronPredictor], dim: int, repeats: int = 20) -> float:
    """Seconds to run every layer's predictor for one token on the CPU (median of repeats)."""
    x = torch.randn(1, dim)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for p in predictors.values():
                p.predict(x)
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]
