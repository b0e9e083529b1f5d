"""The predictor-driven sparse forward of the reference model: each dense/gated FFN computes only the
neurons its predictor expects to be active. A quality reference (it computes all and masks), not the
fast path; the executors compute only the selected rows."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from hotcold.models.layers import FFN
from hotcold.models.transformer import Transformer
from hotcold.predictors.artifact import PredictorSet
from hotcold.predictors.neurons import NeuronPredictor


class PredictedFFN(nn.Module):
    """FFN whose down projection sees only the predicted-active neurons; counts what it selected."""

    def __init__(self, inner: FFN, predictor: NeuronPredictor):
        super().__init__()
        self.inner, self.predictor = inner, predictor
        self.selected = 0  # neurons selected, summed over tokens
        self.tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]
        mask = self.predictor.predict(x.float())  # [B, T, I]
        self.selected += int(mask.sum())
        self.tokens += mask[..., 0].numel()
        return self.inner.down(self.inner.activations(x) * mask.to(x.dtype))


@contextlib.contextmanager
def predicted_sparse(model: Transformer, preds: PredictorSet) -> Iterator[dict[int, PredictedFFN]]:
    """Within the block, layers with a predictor run predictor-sparse; yields the wrappers (stats)."""
    device = next(model.parameters()).device
    originals = {}
    wrapped = {}
    try:
        for l, p in preds.neurons.items():
            block = model.layers[l]
            originals[l] = block.ffn
            wrapped[l] = block.ffn = PredictedFFN(block.ffn, p.to(device))
        yield wrapped
    finally:
        for l, ffn in originals.items():
            model.layers[l].ffn = ffn
