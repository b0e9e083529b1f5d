"""Instrumented FFNs: apply per-layer activation thresholds and count which neurons and experts fire.

`instrumented(model, thresholds, recorder, magnitudes)` swaps every block's FFN for an `InstrumentedFFN` for the
duration of a `with` block. A neuron is *active* on a token when |h| > threshold, where h is the
down projection's input; thresholds are 0 for ReLU models (active = fired), and the calibrated
magnitude threshold for gated (SwiGLU/GeGLU) FFNs, where h is then zeroed below it, so the forward
is the sparse one the runtime computes.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import numpy as np
import torch
from torch import nn

from hotcold.models.layers import FFN, route
from hotcold.models.transformer import Transformer


class Reservoir:
    """A uniform sample of at most `capacity` rows offered in batches: every row carries a random
    key and the rows with the largest keys are kept (memory stays bounded however much is offered)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys = torch.empty(0)
        self.fields: dict[str, torch.Tensor] = {}

    def accepts(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool mask of the offered keys that could enter the sample."""
        if len(self.keys) < self.capacity:
            return torch.ones_like(keys, dtype=torch.bool)
        return keys > self.keys.min()

    def add(self, keys: torch.Tensor, **fields: torch.Tensor) -> None:
        """Offer rows (keys [n], each field [n, ...]); keeps the `capacity` largest keys."""
        if not len(keys):
            return
        all_keys = torch.cat([self.keys, keys])
        keep = torch.topk(all_keys, min(self.capacity, len(all_keys))).indices.sort().values
        self.keys = all_keys[keep]
        for name, value in fields.items():
            old = self.fields.get(name, value[:0])
            self.fields[name] = torch.cat([old, value])[keep]


def pack_bits(active: torch.Tensor) -> torch.Tensor:
    """bool [n, I] -> uint8 [n, ceil(I/8)], little bit order (bit j of byte b is neuron 8b + j)."""
    return torch.from_numpy(np.packbits(active.cpu().numpy(), axis=-1, bitorder="little"))


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [s, ceil(n/8)] -> bool [s, n]."""
    return torch.from_numpy(np.unpackbits(packed.numpy(), axis=-1, count=n, bitorder="little").astype(bool))


class Recorder:
    """Counts per layer: neuron activations (dense/gated), expert routings and per-expert neuron
    activations (MoE); reservoir samples of (FFN input, active mask) and, for MoE, (residual
    stream at layer l, experts chosen by layer l+1) for predictor training."""

    def __init__(self, model: Transformer, samples: int, seed: int = 0):
        c = model.config
        self.kinds = [c.ffn_kind(i) for i in range(c.num_layers)]
        self.tokens = 0
        self.neuron_count: dict[int, torch.Tensor] = {}
        self.expert_count: dict[int, torch.Tensor] = {}
        self.expert_neuron_count: dict[int, torch.Tensor] = {}
        self.samples = {i: Reservoir(samples) for i in range(c.num_layers)} if samples else {}
        self.lookahead = {i: Reservoir(samples) for i in range(c.num_layers - 1)
                          if samples and self.kinds[i + 1] == "moe"}
        self._gen = torch.Generator().manual_seed(seed)
        self._keys = torch.empty(0)
        self._residual: dict[int, torch.Tensor] = {}

    def start_batch(self, n_tokens: int) -> None:
        """Called before each forward with the batch's token count (B*T)."""
        self.tokens += n_tokens
        self._keys = torch.rand(n_tokens, generator=self._gen)  # one key per token, shared by all layers
        self._residual.clear()

    def residual(self, layer: int, r: torch.Tensor) -> None:
        """The residual stream entering layer's FFN norm (r: [N, D]); kept for the look-ahead samples."""
        self._residual[layer] = r

    def dense(self, layer: int, x: torch.Tensor, active: torch.Tensor) -> None:
        # x: [N, D] FFN input; active: [N, I] bool
        count = active.sum(0, dtype=torch.int64)
        self.neuron_count[layer] = self.neuron_count.get(layer, 0) + count
        if self.samples:
            sel = self.samples[layer].accepts(self._keys)
            if sel.any():
                idx = sel.nonzero()[:, 0].to(x.device)
                self.samples[layer].add(self._keys[sel], x=x[idx].to("cpu", torch.float16), active=pack_bits(active[idx]))

    def routed(self, layer: int, ids: torch.Tensor, n_experts: int) -> None:
        # ids: [N, k] experts chosen by this layer's router
        count = torch.bincount(ids.flatten(), minlength=n_experts)
        self.expert_count[layer] = self.expert_count.get(layer, 0) + count
        prev = self._residual.get(layer - 1)
        if prev is not None and layer - 1 in self.lookahead:  # layer-1's residual -> the experts we chose
            sel = self.lookahead[layer - 1].accepts(self._keys)
            if sel.any():
                idx = sel.nonzero()[:, 0].to(ids.device)
                self.lookahead[layer - 1].add(self._keys[sel], hidden=prev[idx].to("cpu", torch.float16),
                                            next_experts=ids[idx].to("cpu", torch.int32))

    def expert(self, layer: int, e: int, active: torch.Tensor, n_experts: int) -> None:
        # active: [n_e, I] bool for the tokens routed to expert e
        if layer not in self.expert_neuron_count:
            self.expert_neuron_count[layer] = torch.zeros(n_experts, active.shape[1], dtype=torch.int64,
                                                          device=active.device)
        self.expert_neuron_count[layer][e] += active.sum(0, dtype=torch.int64)


class MagnitudeSampler:
    """A bounded random subsample of |h| per layer (the down projection's input, all neurons),
    from which per-layer thresholds for any target sparsity are read as quantiles."""

    def __init__(self, per_layer: int, expected_entries: dict[int, int], seed: int = 0):
        self.rate = {l: min(1.0, per_layer / max(1, n)) for l, n in expected_entries.items()}
        self.values: dict[int, list[torch.Tensor]] = {l: [] for l in expected_entries}
        self._gen = torch.Generator().manual_seed(seed)
        self._sorted: dict[int, torch.Tensor] = {}  # layer -> its samples sorted, until more are added

    def add(self, layer: int, magnitude: torch.Tensor) -> None:
        self._sorted.pop(layer, None)
        flat = magnitude.reshape(-1)
        k = min(flat.numel(), math.ceil(flat.numel() * self.rate[layer]))
        idx = torch.randint(flat.numel(), (k,), generator=self._gen).to(flat.device)
        self.values[layer].append(flat[idx].float().cpu())

    def thresholds(self, sparsity: float) -> dict[int, float]:
        """Per layer, the |h| below which a `sparsity` fraction of activations fall. The samples are
        sorted once (the sparsity search reads ~10 sparsities: 2.5 s a read for 30 layers unsorted)."""
        out = {}
        for layer, chunks in self.values.items():
            if layer not in self._sorted:
                self._sorted[layer] = torch.cat(chunks).sort().values
            v = self._sorted[layer]
            out[layer] = float(v[min(len(v) - 1, int(sparsity * len(v)))]) if sparsity > 0 else 0.0
        return out


class InstrumentedFFN(nn.Module):
    """Wraps a block's FFN: zeroes activations with |h| <= threshold, reports to the recorder/sampler."""

    def __init__(self, inner: FFN, layer: int, threshold: float, recorder: Recorder | None,
                 magnitudes: MagnitudeSampler | None):
        super().__init__()
        self.inner, self.layer, self.threshold = inner, layer, threshold
        self.recorder, self.magnitudes = recorder, magnitudes

    def _sparsify(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [N, I] -> (h with inactive entries zeroed, active mask)
        if self.magnitudes is not None:
            self.magnitudes.add(self.layer, h.abs())
        active = h.abs() > self.threshold
        if self.threshold > 0:
            h = h * active
        return h, active

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        if self.inner.kind == "moe":
            return self._moe(x).reshape(shape)
        h, active = self._sparsify(self.inner.activations(x))
        if self.recorder is not None:
            self.recorder.dense(self.layer, x, active)
        return self.inner.down(h).reshape(shape)

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        m = self.inner
        n_experts = m.experts.n
        weights, ids = route(m.router(x), m.top_k, m.renormalise)  # [N, k]
        if self.recorder is not None:
            self.recorder.routed(self.layer, ids, n_experts)

        def expert_fn(e: int, xe: torch.Tensor) -> torch.Tensor:
            h, active = self._sparsify(m.experts.activations(e, xe))
            if self.recorder is not None:
                self.recorder.expert(self.layer, e, active, n_experts)
            return m.experts.down_proj(e, h)

        return m.add_shared(x, m.mix(x, weights, ids, expert_fn))


@contextlib.contextmanager
def instrumented(model: Transformer, thresholds: dict[int, float] | None = None, recorder: Recorder | None = None,
           magnitudes: MagnitudeSampler | None = None) -> Iterator[None]:
    """Within the block, every FFN is an InstrumentedFFN with the given per-layer thresholds (default 0)."""
    thresholds = thresholds or {}
    originals = [block.ffn for block in model.layers]
    hooks = []
    try:
        for i, block in enumerate(model.layers):
            block.ffn = InstrumentedFFN(block.ffn, i, thresholds.get(i, 0.0), recorder, magnitudes)
            if recorder is not None and recorder.lookahead:
                hooks.append(block.ffn_norm.register_forward_pre_hook(
                    lambda mod, args, i=i: recorder.residual(i, args[0].reshape(-1, args[0].shape[-1]))))
        yield
    finally:
        for h in hooks:
            h.remove()
        for block, ffn in zip(model.layers, originals):
            block.ffn = ffn


@torch.inference_mode()
def run_layers(model: Transformer, tokens: torch.Tensor) -> None:
    """The decoder stack on tokens [B, T] without the LM head (the profiler needs no logits)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.embed_tokens(tokens, positions)
    for block in model.layers:
        x = block(x, positions, None)
