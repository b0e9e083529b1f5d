"""hotcold.executors: the hybrid FFN runtime (dense, gated and MoE layers).

options        Placement (where each part runs: what a plan fixes), EngineOptions (how it executes)
engine         build_engine(lm, placement, predictors, options) -> HybridEngine (stats(), close());
               make_hybrid(lm, hot, predictors, **keywords) builds the two from keywords (tests, tools)
step           SplitStep, HostNodeStep: the one-token step protocol of a split layer (graphs drive it)
hybrid         HybridFFN: a block's FFN split between the fast tier and the CPU worker
moe            HybridMoE: a block's MoE split: router, shared and GPU experts on the fast tier, the rest on the CPU
moe_parts      split_moe -> MoEParts: a MoE layer's weights split between the tiers
moe_host       MoEJob: one MoE layer's routed host experts for N tokens, run by the CPU worker
expert_cache   ExpertCache: fast-tier slots for host experts, filled by the look-ahead's prefetch (decode)
host_attention HostAttention, HostLinear: attention and dense products the plan puts on the CPU (run on the worker)
gpu_executor   GPUExecutor: a layer's predictor and hot neurons on the fast tier; mask sources
cpu_executor   CPUExecutor: the worker thread running the numba kernels over cold rows; host buffers
weights        split_ffn: hot rows compacted on the fast tier, cold rows as HostMatrix (or, for a quantised
               model, QuantMatrix GGUF blocks) in host memory
prefill        prefill_regime (the cost rule), ColdStreamer (cold rows streamed in chunks through two slots)
tier           FastTier: device, streams, events, pinned buffers ("GPU" may be the CPU device)
stats          StatsBook: time in GPU work, CPU work, transfers, waiting; rows on each side
"""

from hotcold.executors.cpu_executor import CPUExecutor, ColdJob
from hotcold.executors.engine import HybridEngine, build_engine, make_hybrid, random_hot
from hotcold.executors.gpu_executor import GPUExecutor, LearnedMask, OracleMask
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.moe import HybridMoE, random_experts
from hotcold.executors.prefill import ColdStreamer, PrefillCosts, prefill_regime
from hotcold.executors.weights import ColdFFN, HotFFN, split_ffn

__all__ = ["build_engine", "make_hybrid", "HybridEngine", "HybridFFN", "GPUExecutor", "CPUExecutor", "ColdJob", "LearnedMask",
           "OracleMask", "prefill_regime", "PrefillCosts", "ColdStreamer", "split_ffn", "HotFFN", "ColdFFN",
           "random_hot", "HybridMoE", "random_experts"]
