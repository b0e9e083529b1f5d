"""The one-token step protocol of a split layer: how GraphedBlock (executors/graphs.py) drives a
layer whose FFN is split between the fast tier and the CPU (HybridFFN, HybridMoE), so that the fast
tier's work can be captured in CUDA graphs while the host's work runs between replays or as a host
node inside one.

A step is graph_pre (the fast tier's first part: routing or the predictor's mask, and the copy of
what the host needs), graph_send (the host's job queued, or run), graph_fast (the fast tier's
share, in a graph of its own) and graph_post (the host's share received and added); a step with no
host share at all (`device_only`) is graph_pre and graph_fast alone, in the block's graph. A layer that
can run its host share as a CUDA host node (executors/host_node.py) also implements HostNodeStep:
graph_host records the node inside the capture, host_step does the host's bookkeeping after each
replay, and defer_host says whether the node may run in the next layer's graph instead. `split_step` runs the four parts eagerly: it must equal the layer's forward."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class SplitStep(Protocol):
    def graph_ready(self) -> bool:
        """Whether the one-token step can run in parts now (e.g. not while stats need eager timing)."""

    def device_only(self) -> bool:
        """Whether the step has no host share (every expert on the device, no statistics): the FFN's
        output is then graph_fast(f_in, graph_pre(f_in)), captured with the rest of the block."""

    def graph_pre(self, f_in: torch.Tensor) -> tuple:
        """The fast tier's first part for the FFN input f_in [1, 1, D]; its result is `pre`."""

    def graph_send(self, pre: tuple) -> object:
        """Queue (or run) the host's share; returns what graph_post waits on."""

    def graph_fast(self, f_in: torch.Tensor, pre: tuple) -> torch.Tensor:
        """The fast tier's share [1, D]."""

    def graph_post(self, f_in: torch.Tensor, y: torch.Tensor, pre: tuple, ready, marks=(None, None)) -> torch.Tensor:
        """The host's share received and added to y: the FFN's output [1, 1, D]."""


@runtime_checkable
class HostNodeStep(SplitStep, Protocol):
    def host_node_ready(self) -> bool:
        """Whether the host share can be a CUDA host node of the layer's graph."""

    def host_node_setup(self) -> None:
        """Prepare the host node's buffers and compiled call (before the capture)."""

    def graph_host(self, pre: tuple) -> torch.Tensor:
        """Inside the capture: the host share as a host node between its copies; its sum [1, D] float32."""

    def host_step(self) -> None:
        """After each replay: the host node's bookkeeping (statistics, caches)."""

    def defer_host(self) -> bool:
        """Whether the host share may join the residual one layer late, its host node in the next
        layer's graph (expert deferral: EngineOptions.defer_experts)."""


def split_step(ffn: SplitStep, f_in: torch.Tensor) -> torch.Tensor:
    """A split FFN's one-token step as GraphedBlock runs it, without graphs: it must equal ffn(f_in).
    f_in: [1, 1, D] -> [1, 1, D]."""
    pre = ffn.graph_pre(f_in)
    ready = ffn.graph_send(pre)
    return ffn.graph_post(f_in, ffn.graph_fast(f_in, pre), pre, ready)


__all__ = ["HostNodeStep", "SplitStep", "split_step"]
