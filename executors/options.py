"""What the engine builder takes (`executors/engine.py` build_engine): a Placement, where each part
of the model runs (what a plan fixes), and EngineOptions, how the engine executes it (the command's
options and the engine's strategy choices). Both are built once, by `executors/from_plan.py` from
the plan and the command line, or by `make_hybrid`'s keywords (tests, tools)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from hotcold.executors.expert_stream import EXPERT_STREAM_BYTES
from hotcold.executors.prefill import REGIMES, STREAM_SLOTS_BYTES, PrefillCosts
from hotcold.planner.plan import Plan
from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT

CUDA_GRAPHS = (True, False, "step", "layers", "attention")
EXPERT_CACHE_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class Placement:
    """Where each part of the model runs. A layer missing from `hot` / `gpu_experts` keeps every
    neuron / expert in host memory, computed by the CPU worker."""

    hot: Mapping[int, torch.Tensor] = field(default_factory=dict)  # dense/gated layer -> its fast-tier
    #   neuron ids, hottest first
    gpu_experts: Mapping[int, Sequence[int]] = field(default_factory=dict)  # MoE layer -> its fast-tier experts
    attention_cpu: frozenset[int] = frozenset()  # layers whose attention (weights, KV cache) runs on the CPU
    predictor_cpu: frozenset[int] = frozenset()  # layers whose predictor runs on the CPU (numba GEMV)
    predictor_off: frozenset[int] = frozenset()  # layers that ask no predictor: every cold neuron computed
    embed_cpu: bool = False  # the token embedding in host memory (HostEmbedding; a tied head follows it)
    head_cpu: bool = False  # the LM head in host memory (HostHead)
    expert_cache_bytes: int = 0  # fast-tier bytes of the MoE expert cache (0: none)
    gpu_int4: bool = False  # a quantised model's 4-bit matrices stay 4-bit on a CUDA tier (torch's int4
    #   kernels) instead of being expanded to the tier's dtype
    int4_down: bool = INT4_DOWN_DEFAULT  # W_down's hot columns requantised to int4 as well

    @classmethod
    def of_plan(cls, plan: Plan, cuda: bool, gpu_int4: bool) -> "Placement":
        """The placement a plan fixes, run on a CUDA fast tier or (cuda False) on the CPU, where every
        part is in host memory anyway and only the fast tier's neurons and experts stay apart."""
        hybrid = plan.mode == "hybrid"
        down = plan.gpu_int4_down
        return cls(hot={l: torch.from_numpy(n) for l, n in plan.gpu_neurons.items()} if hybrid else {},
                   gpu_experts={l: e.tolist() for l, e in plan.gpu_experts.items()} if hybrid else {},
                   attention_cpu=frozenset(int(l) for l in np.flatnonzero(~plan.attention_gpu)) if cuda else frozenset(),
                   predictor_cpu=frozenset(int(l) for l in np.flatnonzero(~plan.predictor_gpu)) if cuda else frozenset(),
                   predictor_off=frozenset(int(l) for l in np.flatnonzero(plan.predictor_off)),
                   # the planner counts the embedding in host memory, and the LM head where it put it
                   embed_cpu=cuda, head_cpu=cuda and not plan.lm_head_gpu,
                   expert_cache_bytes=plan.expert_cache_bytes if cuda else 0, gpu_int4=gpu_int4,
                   int4_down=INT4_DOWN_DEFAULT if down is None else down)

    def __post_init__(self):
        object.__setattr__(self, "attention_cpu", frozenset(self.attention_cpu))
        object.__setattr__(self, "predictor_cpu", frozenset(self.predictor_cpu))
        object.__setattr__(self, "predictor_off", frozenset(self.predictor_off))
        if self.expert_cache_bytes < 0:
            raise ValueError(f"expert_cache_bytes must be >= 0, got {self.expert_cache_bytes}")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine executes a Placement. The defaults are what `hotcold run` does; the switches
    at the end choose among step implementations that compute the same function (each is on by
    default where it applies; tools/bench_hybrid.py and the tests compare them)."""

    device: torch.device | str | None = None  # the fast tier (default: the model's device)
    dtype: torch.dtype | None = None  # the fast tier's dtype (default: the model's)
    cpu_dtype: str = "bf16"  # storage of float cold rows: f32, bf16, f16 or i8 (a quantised model's host
    #   rows keep their GGUF blocks, W_down transposed as Q8_0: this does not apply)
    threads: int | None = None  # the CPU worker's threads (default: hotcold.machine.default_threads)
    stats: bool = True  # time GPU work and transfers with CUDA events (worker times are always kept)
    prefill: str = "auto"  # "auto" (prefill_regime decides per layer and prompt), "cpu", "dense", "stream"
    costs: PrefillCosts | None = None  # the rates prefill_regime weighs (default: PrefillCosts(); without
    #   a cpu_flops figure torch's CPU GEMM is timed at build, about 10 ms)
    pin_cold: bool | None = None  # page-lock what prefill streams (default: on CUDA)
    stream_slots_bytes: int = STREAM_SLOTS_BYTES  # the two slots prefill streams float cold rows through
    expert_stream_bytes: int = EXPERT_STREAM_BYTES  # the slots and workspace of streamed quantised experts
    #   (on a CPU tier only with prefill="stream", for tests)
    prefetch_experts: int | None = None  # experts of the next MoE layer the look-ahead names per token
    #   (default top-k / 2: PCIe moves an expert in about 1.4x the time the CPU computes it, so a copy
    #   must buy more than one hit)
    expert_cache_policy: str = "lru"  # or "lfu"
    thresholds: Mapping[int, float] = field(default_factory=dict)  # the "oracle" masks' thresholds (tests)
    cuda_graphs: bool | str = True  # on CUDA, replay each block's one-token step as CUDA graphs
    #   (executors/graphs.py) and, where every block's step is captured whole, the whole step as one
    #   (StepGraph); "step": that also over layers whose CPU experts are host nodes; "layers": graphs
    #   per layer only; "attention": the attention half only (the FFNs eager)
    map_experts: bool = False  # a quantised MoE model's CPU experts are read in place from the file's
    #   mapping (no interleaved copy: faster load, host memory shared with the page cache; kernels ~1.2x
    #   slower where arithmetic, not memory, bounds them)
    cpu_inline: bool | None = None  # the CPU parts run in the calling thread, not a worker thread
    #   (default: on a CPU tier, and on CUDA with per-layer graphs, where a graph queues the fast
    #   tier's work of a layer before its CPU part starts: a worker would only add a hand-off)
    int4_hot: bool | None = None  # the split FFNs' hot rows kept int4 (default: gpu_int4 on CUDA). A layer
    #   whose neurons are all hot and whose matrices are all 4-bit then stays whole (HybridEngine.whole);
    #   a MoE layer's fast-tier experts keep their 4-bit blocks (Q4Stack). On a CPU tier: torch's CPU
    #   twin kernels (tests).
    host_nodes: bool = True  # a graphed MoE step runs its CPU experts as a CUDA host node (host_node.py)
    dense_host_nodes: bool = True  # the same for a dense/gated layer's cold rows (FFNHostNode)
    defer_experts: bool = False  # a MoE layer's host-node CPU experts join the residual one layer late,
    #   beside the next layer's GPU work (expert deferral, graphs.py): faster, not exact (opt-in)
    host_blocks: bool = True  # a layer whose attention and predictor are both on the CPU steps as a
    #   HostBlock (host_block.py: the residual stream on the host for its step)
    layer_nodes: bool = True  # such a HostBlock's host share as one compiled call (layer_node.py)
    layer_graphs: bool = True  # on CUDA with graphs, that call is a host node of the layer's own graph

    def __post_init__(self):
        if self.prefill not in ("auto", *REGIMES):
            raise ValueError(f"prefill must be auto or one of {', '.join(REGIMES)}, got {self.prefill!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPHS}, got {self.cuda_graphs!r}")
        if self.expert_cache_policy not in EXPERT_CACHE_POLICIES:
            raise ValueError(f"expert_cache_policy must be lru or lfu, got {self.expert_cache_policy!r}")

    @property
    def per_layer_graphs(self) -> bool:
        """Whether each block's one-token step replays a graph (on a CUDA tier)."""
        return self.cuda_graphs in (True, "layers", "step")


__all__ = ["EngineOptions", "Placement"]
