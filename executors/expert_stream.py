"""Prefill of quantised host experts on the fast tier: their blocks streamed, decoded where they land.

A prompt chunk routes its tokens to nearly every expert of a layer, and the CPU's quantised expert
kernels are compute-bound over a chunk; the GPU multiplies a chunk of tokens by an expert in a
fraction of the time the expert's bytes take to cross PCIe. So, as llama.cpp does for batches of
prompt tokens, a MoE layer whose experts live in host memory may copy them to the fast tier for the
chunk instead (HybridMoE's "stream" regime, chosen by `moe_prefill_regime`).

What crosses is the bytes the CPU kernels read (`host_quant_experts`: the file's blocks, or their
row-interleaved copy), from pinned host memory, so no second copy is kept anywhere. The streamed
layers' experts are cut into groups of `group` experts in one global order (layer by layer); group
k fills raw slot k % 2 on a copy stream while group k - 1 computes, and the first group of the next
streamed layer is copied while the last of this one computes. On the compute stream a group is
decoded into one bf16 (the tier's dtype) workspace, Q4_0 / Q4_1 / Q8_0 by one Triton kernel a matrix
(sparse_ops/blocks_gpu.py), the K-quants by torch ops (sparse_ops/blocks_torch.py), then
its experts run for their tokens as three batched products over the group, tokens padded to the
group's busiest expert (padding carries a zero routing weight):
    X [g, T, D] = x[tokens]; h = act(X gate^T) * (X up^T) [g, T, I]; y[tokens] += w * (h down^T)
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from hotcold.executors.tier import FastTier
from hotcold.executors.weights import ColdFFN
from hotcold.sparse_ops.blocks_torch import DECODABLE, dequantize

EXPERT_STREAM_BYTES = 128 << 20  # fast-tier bytes of the two raw slots plus the decoded group (the planner reserves them)
DECODE_PIECE = 1 << 24  # weights decoded per torch call: bounds the temporaries (~4 bytes a weight in bf16)


def streamable(cold: ColdFFN) -> bool:
    """Whether a MoE layer's host experts can stream: whole quantised experts of decodable types."""
    return (cold is not None and cold.quantized and cold.down is not None
            and all(m.qtype in DECODABLE for m in (cold.gate, cold.up, cold.down)))


class ExpertStreamer:
    """The streamed MoE layers' host experts (layer -> ColdFFN of whole quantised experts), copied to
    the fast tier in groups through two raw slots and decoded into one workspace. `run` computes a
    layer's routed host experts for a chunk of tokens."""

    def __init__(self, tier: FastTier, colds: dict[int, ColdFFN], dim: int, slots_bytes: int = EXPERT_STREAM_BYTES):
        bad = [l for l, c in colds.items() if not streamable(c)]
        if bad:
            raise ValueError(f"layers {bad}: only whole quantised experts of {sorted(DECODABLE)} stream")
        self.tier, self.colds, self.dim = tier, colds, dim
        self.n_experts = {l: c.down.rows // dim for l, c in colds.items()}
        first = next(iter(colds))
        self.hidden = colds[first].up.rows // self.n_experts[first]
        I, D = self.hidden, dim
        self.mat_bytes = {name: max(getattr(c, name).nbytes // self.n_experts[l] for l, c in colds.items())
                          for name in ("gate", "up", "down")}  # one expert's bytes of each matrix
        self.raw_bytes = sum(self.mat_bytes.values())
        self.decoded_bytes = 3 * I * D * torch.tensor([], dtype=tier.dtype).element_size()  # one expert, decoded
        per_expert = 2 * self.raw_bytes + self.decoded_bytes
        self.group = max(1, min(max(self.n_experts.values()), slots_bytes // per_expert))
        self.order = [(l, a, min(self.n_experts[l], a + self.group))
                      for l in sorted(colds) for a in range(0, self.n_experts[l], self.group)]
        self._groups: dict[int, range] = {}
        for k, (l, _, _) in enumerate(self.order):
            r = self._groups.get(l)
            self._groups[l] = range(k, k + 1) if r is None else range(r.start, k + 1)
        self.stream = torch.cuda.Stream(tier.device) if tier.cuda else None
        self.loaded: list[int | None] = [None, None]
        self.ready: list = [None, None]
        self.free: list = [None, None]
        self.slots: list[dict | None] = [None, None]
        self.decoded: dict | None = None
        self.spans: list = []  # (start, end) marks of copies, collected by the layers' stats
        self.kernel = _triton_decoder() if tier.cuda else None  # one-pass decode of Q4_0 / Q4_1 / Q8_0

    def streams(self, layer: int) -> bool:
        return layer in self._groups

    @property
    def workspace_bytes(self) -> int:
        """Fast-tier bytes of the two raw slots and the decoded group (allocated at the first use)."""
        return self.group * (2 * self.raw_bytes + self.decoded_bytes)

    # ------------------------------------------------------------------ copies

    def _spans(self, layer: int, a: int, b: int) -> dict[str, tuple[np.ndarray, int]]:
        """Experts [a, b) of a layer: each matrix's raw bytes (a host view) and its logical rows."""
        c, I, D = self.colds[layer], self.hidden, self.dim
        out = {}
        for name, m, n in (("gate", c.gate, I), ("up", c.up, I), ("down", c.down, D)):
            per = m.data.shape[0] // self.n_experts[layer]  # data rows an expert holds (groups of 8 when interleaved)
            out[name] = (m.data[a * per:b * per], (b - a) * n)
        return out

    def _fetch(self, k: int) -> None:
        i = k % 2
        layer, a, b = self.order[k]
        spans = self._spans(layer, a, b)
        if self.slots[i] is None:  # one buffer of a group's raw bytes, a view per matrix
            with torch.inference_mode(False):
                flat = torch.empty(self.group * self.raw_bytes, dtype=torch.uint8, device=self.tier.device)
            self.slots[i] = dict(zip(self.mat_bytes, flat.split([self.group * n for n in self.mat_bytes.values()])))
        slot, tier = self.slots[i], self.tier
        ctx = torch.cuda.stream(self.stream) if tier.cuda else contextlib.nullcontext()
        with ctx:
            if self.free[i] is not None:
                self.stream.wait_event(self.free[i])  # the slot's previous group is done with it
            t0 = tier.mark(self.stream)
            for name, (data, _) in spans.items():
                slot[name][:data.nbytes].copy_(torch.from_numpy(data).reshape(-1), non_blocking=True)
            self.spans.append((t0, tier.mark(self.stream)))
            self.ready[i] = tier.event(self.stream) if tier.cuda else None
        self.loaded[i] = k

    def _prefetch(self, k: int) -> None:
        if 0 <= k < len(self.order) and self.loaded[k % 2] != k:
            self._fetch(k)

    def _decode(self, k: int) -> dict[str, torch.Tensor]:
        """Group k's experts on the fast tier in its dtype: gate, up [g, I, D]; down [g, D, I]."""
        i = k % 2
        if self.loaded[i] != k:
            self._fetch(k)
        self.tier.wait(self.ready[i])
        layer, a, b = self.order[k]
        g, I, D, c = b - a, self.hidden, self.dim, self.colds[layer]
        if self.decoded is None:
            with torch.inference_mode(False):
                self.decoded = {name: torch.empty((self.group, *shape), dtype=self.tier.dtype, device=self.tier.device)
                                for name, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I)))}
        out = {}
        for name, (data, rows) in self._spans(layer, a, b).items():
            m = getattr(c, name)
            raw = self.slots[i][name][:data.nbytes].view(data.shape)
            dst = self.decoded[name][:g].view(rows, m.cols)
            if self.kernel is not None and m.qtype in self.kernel.TYPES:
                self.kernel.dequantize(raw, m.qtype, (rows, m.cols), m.interleaved, out=dst)
            else:
                step = max(8, DECODE_PIECE // m.cols // 8 * 8)  # whole interleaved groups of 8 rows
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    src = raw[r0 // 8:r1 // 8] if m.interleaved else raw[r0:r1]  # data rows: groups of 8, or rows
                    dequantize(src, m.qtype, (r1 - r0, m.cols), m.interleaved, out=dst[r0:r1])
            out[name] = self.decoded[name][:g]
        self.free[i] = self.tier.event()  # the raw slot may be refilled once the decode is done
        return out

    def take_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans

    # ------------------------------------------------------------------ compute

    def run(self, layer: int, x2: torch.Tensor, weights: torch.Tensor, ids: np.ndarray, pos: np.ndarray,
            act) -> tuple[torch.Tensor, int]:
        """The chunk's routed host experts of `layer`, each scaled by its routing weight and summed.
        x2: [N, D]; weights: [N, k] on the fast tier; ids: int [N, k] on the host; pos: expert id ->
        host position (-1: not a host expert); act: the activation. -> (float32 [N, D], pairs)."""
        routes = Routes.of(pos[ids], self.n_experts[layer])
        y = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
        groups = self._groups[layer]
        picks = routes.padded([self.order[k][1:] for k in groups], weights)
        for k, picked in zip(groups, picks):
            w = self._decode(k) if picked is not None else None  # (none routed: its copy, if queued, goes unused)
            self._prefetch(k + 1)  # the next group, of this layer or the next streamed one
            if w is not None:
                group_products(x2, y, picked, w["gate"], w["up"], w["down"], act)
        return y, routes.pairs


def _triton_decoder():
    """sparse_ops.blocks_gpu (imported only for a CUDA tier: it imports Triton), or None without Triton."""
    try:
        from hotcold.sparse_ops import blocks_gpu
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return blocks_gpu


class Routes:
    """A chunk's routed (token, slot) pairs grouped by the position of their expert in a stack.
    where: int [N, k], each routed expert's position (-1: not in the stack); n: the stack's size."""

    def __init__(self, tok: np.ndarray, slot: np.ndarray, counts: np.ndarray):
        self.tok, self.slot, self.counts = tok, slot, counts
        self.starts = np.concatenate([[0], np.cumsum(counts)])

    @classmethod
    def of(cls, where: np.ndarray, n: int) -> "Routes":
        tok, slot = np.nonzero(where >= 0)
        p = where[tok, slot]
        order = np.argsort(p, kind="stable")
        return cls(tok[order], slot[order], np.bincount(p, minlength=n))

    @property
    def pairs(self) -> int:
        return len(self.tok)

    def padded(self, bounds: list[tuple[int, int]], weights: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per range [a, b) of positions: tokens int64 [b - a, T] and their routing weights float32
        [b - a, T] (weights: [N, k], on the device the result lands on), T the range's busiest
        position's count (padding: token 0, weight 0); None where none is routed. All ranges cross
        to the device in one copy (from pinned memory on CUDA, not waited for: a copy per range would
        make the host wait for the device each time), and their weights are gathered in one op."""
        widths = np.array([self.counts[a:b].max(initial=0) for a, b in bounds], np.int64)
        sizes = np.array([b - a for a, b in bounds], np.int64) * widths
        ends = np.cumsum(sizes)
        base = np.full(len(self.counts), -1, np.int64)  # each position's first element in the flat copy
        for (a, b), w, end, size in zip(bounds, widths, ends, sizes):
            base[a:b] = end - size + np.arange(b - a) * w
        p = np.repeat(np.arange(len(self.counts)), self.counts)  # each pair's position
        at = base[p] + np.arange(len(p)) - self.starts[p]
        kept = base[p] >= 0  # pairs in one of the ranges
        idx = np.zeros((3, int(ends[-1]) if len(ends) else 0), np.int64)
        idx[0, at[kept]], idx[1, at[kept]], idx[2, at[kept]] = self.tok[kept], self.slot[kept], 1
        t = torch.from_numpy(idx)
        if weights.device.type == "cuda":
            t = t.pin_memory().to(weights.device, non_blocking=True)
        coef = weights[t[0], t[1]].float() * t[2]  # [P]: padding 0
        out = []
        for (a, b), w, end, size in zip(bounds, widths, ends, sizes):
            out.append((t[0, end - size:end].view(b - a, int(w)), coef[end - size:end].view(b - a, int(w))) if w else None)
        return out


def group_products(x2: torch.Tensor, y: torch.Tensor, picked: tuple, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, act) -> None:
    """y[tokens] += routing weight * expert(x[tokens]) for a group of g experts at once (three batched
    products). x2: [N, D]; y: float32 [N, D]; picked: one of `Routes.padded`; gate, up: [g, I, D];
    down: [g, D, I]."""
    t_idx, coef = picked
    xg = x2[t_idx].to(gate.dtype)  # [g, T, D]
    h = act(torch.bmm(xg, gate.transpose(1, 2))) * torch.bmm(xg, up.transpose(1, 2))  # [g, T, I]
    o = torch.bmm(h, down.transpose(1, 2)).float() * coef[..., None]  # [g, T, D]
    y.index_add_(0, t_idx.reshape(-1), o.reshape(-1, o.shape[-1]))
