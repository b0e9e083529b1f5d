"""A MoE layer's host side: the routing's host buffers (HostRouting) and the job the CPU worker runs
for one layer's routed host experts over N tokens (MoEJob)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from hotcold.executors.stats import now
from hotcold.executors.weights import ColdFFN
from hotcold.sparse_ops.cpu import ffn_rows, ffn_rows_batch
from hotcold.sparse_ops.quant import qexpert_batch, qexperts_routed, qexperts_tokens, qexperts_trusted
from hotcold.sparse_ops.quant.ops import GEMM_BF16



class HostRouting:
    """Host buffers for the routing (pinned on CUDA), grown on demand: ids int64 [rows, k],
    weights float32 [rows, k], each with a numpy view sharing its memory."""

    def __init__(self, alloc, k: int, rows: int = 1):
        self.alloc, self.k, self.rows = alloc, k, 0
        self.ensure(rows)

    def ensure(self, rows: int) -> "HostRouting":
        if rows > self.rows:
            self.rows = rows
            self.ids, self.weights = self.alloc((rows, self.k), torch.int64), self.alloc((rows, self.k))
            self.ids_np, self.weights_np = self.ids.numpy(), self.weights.numpy()
            self.extra = self.alloc((4 * self.k,), torch.int64)  # the look-ahead's guess (decode)
            self.extra_np = self.extra.numpy()
        return self

    @property
    def nbytes(self) -> int:
        return self.rows * self.k * (8 + 4) + (4 * self.k * 8 if self.rows else 0)


def routed(ids: np.ndarray, here) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(expert, tokens [n], slots [n]) for each expert in ids [N, k] with here(expert), ascending."""
    for e in np.unique(ids).tolist():
        if here(e):
            tok, slot = np.nonzero(ids == e)
            yield e, tok, slot


EXPERT_BATCH_TOKENS = 64 if GEMM_BF16 else 256  # tokens of a chunk routed to one quantised CPU expert
# from which it is decoded once for a torch GEMM (qexpert_batch) rather than computed from its blocks
# with the other experts' tokens in one qexperts_tokens call (a decoded block dotted with up to 8
# tokens' Q8 activations at once). Measured with bfloat16 GEMMs (2-core AMX Xeon, 1 thread, one
# Q4_0 Qwen3-30B-A3B expert): qexperts_tokens 1.5 / 2.8 / 5.6 ms for 32 / 64 / 128 tokens against
# 2.4 / 2.8 / 3.8 ms for qexpert_batch. Without bfloat16 GEMMs (float32, ~3x slower) the threshold
# is an estimate from the same ratio.


@dataclass
class MoEJob:
    """One MoE layer's CPU experts for N tokens, run by the CPUExecutor. x, out: float32 [N, D]; ids:
    int64 [N, k]; weights: float32 [N, k] (host views); ready: the event of their D2H copy (None on
    the CPU). One token: its routed CPU experts in one kernel call, each expert's rows scaled by its
    routing weight (`scale`, the layer's [rows] buffer); several: one batched call per expert."""

    cold: ColdFFN  # the layer's CPU experts, stacked
    pos: np.ndarray  # int64 [E]: position of each expert in `cold`, -1 on the fast tier
    expert_rows: list  # int64 [I] row indices of the expert at each position
    scale: np.ndarray  # float32 [rows of cold]
    x: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    out: np.ndarray
    ready: object = None
    keep: tuple = ()  # device tensors the pending copies read; held until the job is done
    io: object = None  # the HostRows that x and out view
    skip: frozenset = frozenset()  # host experts the fast tier computes this time (found in the expert cache)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    pairs: int = 0  # (token, expert) pairs computed
    cpu_s: float = 0.0  # grouping + kernels
    input_wait_s: float = 0.0  # blocked on `ready`

    def run(self) -> None:
        t0 = now()
        if self.ready is not None:
            self.ready.synchronize()  # releases the GIL
        t1 = now()
        self.out.fill(0.0)
        c = self.cold
        if c.down is not None:  # quantised experts in the file's blocks
            self._run_whole()
        elif len(self.x) == 1:
            chosen = sorted((int(self.pos[e]), float(w)) for e, w in zip(self.ids[0], self.weights[0])
                            if self.pos[e] >= 0 and int(e) not in self.skip)
            for p, w in chosen:
                self.scale[self.expert_rows[p]] = w
            if chosen:
                rows = np.concatenate([self.expert_rows[p] for p, _ in chosen])
                ffn_rows(self.x[0], rows, c.up, c.down_t, c.act, c.gate, out=self.out[0], row_scale=self.scale)
            self.pairs = len(chosen)
        else:
            for e, tok, slot in routed(self.ids, lambda e: self.pos[e] >= 0):
                y = ffn_rows_batch(self.x[tok], self.expert_rows[self.pos[e]], c.up, c.down_t, c.act, c.gate)  # [n, D]
                self.out[tok] += self.weights[tok, slot][:, None] * y  # a token routes to an expert once
                self.pairs += len(tok)
        self.input_wait_s, self.cpu_s = t1 - t0, now() - t1

    def _run_whole(self) -> None:
        """Quantised experts (ColdFFN.down): one token's routed CPU experts in one `qexperts_routed` call;
        several tokens' in one `qexperts_tokens` call, but for an expert routed by at least
        EXPERT_BATCH_TOKENS of them, decoded once for all of them instead (`qexpert_batch`)."""
        c = self.cold
        if len(self.x) == 1 and not self.skip:  # decode: selection and kernel in one call
            self.pairs = qexperts_routed(self.x[0], self.ids[0], self.weights[0], self.pos, c.gate, c.up, c.down, c.act,
                                         self.out[0])
            return
        if len(self.x) == 1:  # decode, some experts found in the expert cache: the rest in one call
            p = self.pos[self.ids[0]]  # [k] positions, -1 on the fast tier
            here = p >= 0
            if self.skip:
                here &= ~np.isin(self.ids[0], list(self.skip))
            if here.any():  # (the layer checked its stacks once; the buffers are its own)
                qexperts_trusted(self.x[0], p[here], self.weights[0][here], c.gate, c.up, c.down, c.act, self.out[0])
            self.pairs = int(here.sum())
            return
        here = self.pos[self.ids] >= 0  # [N, k]: the routed host experts
        if self.skip:
            here &= ~np.isin(self.ids, list(self.skip))
        self.pairs = int(here.sum())
        few = np.where(here, self.pos[self.ids], -1)  # [N, k] their positions, -1 elsewhere
        for e, tok, slot in routed(self.ids, lambda e: self.pos[e] >= 0 and int(e) not in self.skip):
            if len(tok) >= EXPERT_BATCH_TOKENS:
                p = int(self.pos[e])
                self.out[tok] += qexpert_batch(self.x[tok], p, c.gate, c.up, c.down, c.act, self.weights[tok, slot])
                few[tok, slot] = -1
        if (few >= 0).any():
            qexperts_tokens(self.x, few, self.weights, c.gate, c.up, c.down, c.act, out=self.out)

    def again(self, ready) -> "MoEJob":
        """This job, ready to run once more over the same buffers with a new input event (a layer's
        graphed decode step reuses its job: building one costs the host more than a small kernel)."""
        self.ready, self.skip, self.keep, self.error = ready, frozenset(), (), None
        self.pairs, self.cpu_s, self.input_wait_s = 0, 0.0, 0.0
        self.done.clear()
        return self

    def wait(self) -> None:
        """Block until the worker finished this job; re-raise its error here."""
        self.done.wait()
        self.keep = ()
        if self.error is not None:
            raise RuntimeError(f"CPU executor failed: {self.error!r}") from self.error


__all__ = ["EXPERT_BATCH_TOKENS", "HostRouting", "MoEJob", "routed"]
