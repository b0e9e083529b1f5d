"""Per-layer neuron predictors: FFN input -> which neurons will be active (DejaVu/PowerInfer style).

A predictor is a low-rank MLP, x [D] -> r -> ReLU -> logits [I], trained with class-weighted BCE on
the profile's (FFN input, active mask) samples; for gated FFNs (active = |h| > threshold) each positive
is weighted by its |h|^2, the squared error its miss adds to the down projection's input. A per-layer
logit threshold is then chosen on held-out samples so that the active neurons are caught with the
target recall. Per-neuron thresholds and an |h|-weighted recall are options (both measured worse on
SmolLM2); per-neuron thresholds are folded into w2's bias, so the decision stays `forward(x) > threshold`
with one scalar.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn


_INIT = threading.Lock()


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
    weighted_recall: float  # of the active neurons' sum |h|, the share predicted active (= recall without |h|)
    precision: float  # of predicted-active neurons, the fraction truly active (held-out)
    predicted_active_fraction: float
    true_active_fraction: float
    threshold: float  # the scalar threshold kept (per-neuron thresholds are folded into w2.bias)
    train_samples: int
    heldout_samples: int


def _split(n: int, heldout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, int(round(n * heldout)))
    return perm[k:], perm[:k]


def threshold_for_recall(logits: torch.Tensor, target: torch.Tensor, recall: float,
                         weight: torch.Tensor | None = None) -> float:
    """The largest logit threshold t such that (logits > t) catches `recall` of the positives, counted
    (weight None) or weighted (weight: [S, I] >= 0, e.g. |h|: the fraction of the positives' total weight)."""
    pos = logits[target].float()
    if pos.numel() == 0:
        return float(logits.max())
    if weight is None:
        k = int(math.floor((1 - recall) * pos.numel()))  # positives we may miss
        if k == 0:
            return float(pos.min()) - 1e-6
        return float(torch.kthvalue(pos, k).values)
    return float(neuron_thresholds(pos[:, None], torch.ones_like(pos[:, None], dtype=torch.bool), recall,
                                   weight[target].float()[:, None], min_positives=1)[0])


def neuron_thresholds(logits: torch.Tensor, target: torch.Tensor, recall: float, weight: torch.Tensor | None = None,
                      min_positives: int = 40, fallback: float | None = None) -> torch.Tensor:
    """Per neuron, the largest t_i such that (logits[:, i] > t_i) catches `recall` of neuron i's positives
    (by count, or by `weight` [S, I]). logits, target: [S, I]. Neurons with fewer than `min_positives`
    positives get `fallback` (default: the largest logit, i.e. never selected when they have none). -> [I]"""
    w = (torch.ones_like(logits) if weight is None else weight.float()) * target  # [S, I], 0 off positives
    z = torch.where(target, logits.float(), torch.inf)
    z, order = z.sort(dim=0)  # positives first, ascending
    cum = w.gather(0, order).cumsum(0)  # [S, I]
    allowed = (1 - recall) * cum[-1]  # [I] weight we may miss
    if weight is None:
        allowed = torch.floor(allowed + 1e-6)
    n_miss = (cum <= allowed[None] + 1e-9 * cum[-1]).sum(0)  # [I] positives below the threshold
    first = z[0] - 1e-6  # [I] just below the smallest positive (inf where none)
    at = z.gather(0, (n_miss - 1).clamp(min=0)[None])[0]  # [I]
    t = torch.where(n_miss > 0, at, first)
    n_pos = target.sum(0)
    few = n_pos < min_positives
    if fallback is None:
        fallback_t = logits.float().max(0).values  # [I]
        t = torch.where(few & (n_pos == 0), fallback_t, t)
    else:
        t = torch.where(few, torch.full_like(t, fallback), t)
    return t


def set_neuron_thresholds(model: NeuronPredictor, t: torch.Tensor) -> None:
    """Fold per-neuron thresholds t [I] into w2's bias, so that `forward(x) > 0` decides (scalar threshold 0)."""
    with torch.no_grad():
        model.w2.bias -= t.to(model.w2.bias)
        model.threshold.fill_(0.0)


def fit_predictor(x: torch.Tensor, active: torch.Tensor, rank: int, weight: torch.Tensor | None = None,
                  epochs: int = 20, lr: float = 5e-3, batch: int = 512, seed: int = 0) -> NeuronPredictor:
    """Train a predictor with class-weighted BCE. x: [S, D] float, active: [S, I] bool; weight: [S, I]
    per-sample loss weights of the positives (see magnitude_loss_weight), or None."""
    with _INIT:  # torch's global generator initialises the weights: one layer at a time (train.py's threads)
        torch.manual_seed(seed)
        model = NeuronPredictor(x.shape[1], active.shape[1], rank).to(x.device)
    # Class weights: a neuron that is rarely active gets its positives weighted up (capped).
    p = (active.sum(0, dtype=torch.float32) / max(1, len(active))).clamp(1e-3, 1 - 1e-3)  # [I]
    pos_weight = ((1 - p) / p).clamp(max=20.0)  # [I]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * max(1, math.ceil(len(x) / batch))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            opt.zero_grad(set_to_none=True)
            yb = active[idx].float()  # per batch: float targets for all samples would be 4x the mask
            pw = pos_weight if weight is None else pos_weight * weight[idx].float()  # [I] or [B, I]
            nn.functional.binary_cross_entropy_with_logits(model(x[idx]), yb, pos_weight=pw).backward()
            opt.step()
            sched.step()
    return model.eval()


def magnitude_loss_weight(magnitude: torch.Tensor, active: torch.Tensor, power: float = 2.0,
                          cap: float = 100.0) -> torch.Tensor:
    """Loss weights for the positives: |h|^power over the neuron's mean active |h|^power, capped; 0 off
    the positives. power 2 (the squared error a miss adds to h) measured better than 1 on SmolLM2.
    [S, I] -> float16 [S, I] (half the memory of float32 for a big layer's samples)."""
    m = magnitude.float() * active
    m = (m / m.amax(0).clamp(min=1e-30)).pow(power)  # scaled to <= 1 first: no overflow for any |h|
    mean = m.sum(0) / active.sum(0).clamp(min=1)  # [I]
    return (m / mean.clamp(min=1e-30)).clamp(max=cap).to(torch.float16)


def layer_metrics(pred: torch.Tensor, truth: torch.Tensor, magnitude: torch.Tensor | None) -> dict:
    """Held-out quality of a mask pred [S, I] against truth [S, I] (magnitude [S, I]: |h|, optional)."""
    tp = float((pred & truth).sum())
    w = magnitude.float() * truth if magnitude is not None else truth.float()
    return dict(recall=round(tp / max(1.0, float(truth.sum())), 4),
                weighted_recall=round(float((w * pred).sum()) / max(1e-12, float(w.sum())), 4),
                precision=round(tp / max(1.0, float(pred.sum())), 4),
                predicted_active_fraction=round(float(pred.float().mean()), 4),
                true_active_fraction=round(float(truth.float().mean()), 4))


def calibrate(model: NeuronPredictor, x: torch.Tensor, active: torch.Tensor, recall: float,
              magnitude: torch.Tensor | None = None, per_neuron: bool = False) -> None:
    """Set the decision threshold(s) on samples x [S, D], active [S, I]: one per layer, or one per neuron
    (folded into w2.bias); recall counted, or weighted by `magnitude` [S, I] when given."""
    with torch.no_grad():
        logits = model(x)  # [S, I]
    thr = threshold_for_recall(logits, active, recall, magnitude)
    if per_neuron:
        set_neuron_thresholds(model, neuron_thresholds(logits, active, recall, magnitude, fallback=thr))
    else:
        model.threshold.fill_(thr)


def train_layer(x: torch.Tensor, active: torch.Tensor, rank: int, layer: int = 0, recall: float = 0.95,
                heldout: float = 0.2, epochs: int = 20, lr: float = 5e-3, batch: int = 512, seed: int = 0,
                magnitude: torch.Tensor | None = None, weighted_recall: bool = False, per_neuron: bool = False,
                weighted_loss: bool = False) -> tuple[NeuronPredictor, LayerMetrics]:
    """Train one layer's predictor. x: [S, D] FFN inputs, active: [S, I] bool; magnitude: [S, I] |h| (needed
    by weighted_recall / weighted_loss, else only reported). Deterministic for a seed."""
    if (weighted_recall or weighted_loss) and magnitude is None:
        raise ValueError("weighted recall or loss needs the samples' |h| (magnitude)")
    x = x.float()
    train_idx, test_idx = _split(len(x), heldout, seed + layer)
    w = magnitude_loss_weight(magnitude[train_idx], active[train_idx]) if weighted_loss else None
    model = fit_predictor(x[train_idx], active[train_idx], rank, w, epochs, lr, batch, seed + layer)
    # The threshold is chosen on one half of the held-out samples and measured on the other.
    val_idx, test_idx = test_idx[: len(test_idx) // 2], test_idx[len(test_idx) // 2 :]
    mag = (lambda idx: magnitude[idx]) if magnitude is not None else (lambda idx: None)
    calibrate(model, x[val_idx], active[val_idx], recall, mag(val_idx) if weighted_recall else None, per_neuron)
    with torch.no_grad():
        pred = model.predict(x[test_idx])
    metrics = LayerMetrics(layer=layer, rank=rank, params=model.n_params(),
                           **layer_metrics(pred, active[test_idx], mag(test_idx)),
                           threshold=float(model.threshold), train_samples=len(train_idx),
                           heldout_samples=len(val_idx) + len(test_idx))
    return model, metrics


def cpu_time_per_token(predictors: dict[int, NeuronPredictor], dim: int, repeats: int = 20) -> float:
    """Seconds to run every layer's predictor for one token on the CPU with torch's threads: the fastest
    of repeats. (On the busy 2-core machine every small op on 2 threads waits milliseconds for the
    other thread: SmolLM2's 30 predictors 250 ms a token, 0.9 ms on one thread.)"""
    x = torch.randn(1, dim)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for p in predictors.values():
                p.predict(x)
            times.append(time.perf_counter() - t)
    return min(times)
