"""Build the hybrid engine from a loaded model and a plan: `make_hybrid(...) -> HybridEngine`.

Every dense/gated block's FFN becomes a HybridFFN (hot neurons on `device`, cold ones in host
memory for the CPU worker), or, all its neurons hot under int4, stays whole with int4 matrices;
every MoE block's FFN a HybridMoE (router, shared expert and the plan's GPU experts on `device`,
the other experts in host memory for the CPU worker); everything else
(attention, norms, embeddings, lm_head) moves to `device`. The original FFN parameters are dropped
layer by layer as they are split, so host memory holds each weight once. `engine.lm` is the same
LoadedModel, now on `device`: pass it to `hotcold.models.generate.Generator`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from typing import Literal

import torch
from torch import nn

from hotcold.executors.cpu_executor import CPUExecutor, HostRows, default_threads
from hotcold.executors.graphs import graph_blocks
from hotcold.executors.gpu_executor import HOST_PREDICTOR_QTYPE, GPUExecutor, LearnedMask, OracleMask, predictor_dtype
from hotcold.executors.host_attention import HostAttention, HostEmbedding, HostHead
from hotcold.executors.host_block import host_blocks
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.expert_cache import ExpertCache, slot_kind
from hotcold.executors.expert_stream import EXPERT_STREAM_BYTES, ExpertStreamer, streamable
from hotcold.executors.moe import HostRouting, HybridMoE, Lookahead, check_experts, split_moe
from hotcold.executors.prefill import (REGIMES, STREAM_SLOTS_BYTES, ColdStreamer, PrefillCosts, measure_cpu_flops,
                                      pin_host, unpin_host)
from hotcold.executors.stats import StatsBook
from hotcold.executors.tier import FastTier
from hotcold.executors.weights import check_hot, split_ffn, whole_int4, whole_int4_reason
from hotcold.models.layers import DenseFFN, GatedFFN, MoEFFN, Rotary
from hotcold.models.load_times import LoadTimes
from hotcold.models.loader import LoadedModel
from hotcold.models.quantized import (HalfEmbedding, QuantEmbedding, QuantLinear, dequantize_model,
                                      drop_module_pages, pack_for_decode, quant_bytes)
from hotcold.predictors.artifact import PredictorSet
from hotcold.sparse_ops.cpu import torch_view
from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT


class HybridEngine:
    """A model whose FFNs run hybrid (`layers`: dense/gated, `moe`: MoE). Use `lm` with Generator;
    close() stops the worker."""

    def __init__(self, lm: LoadedModel, layers: dict[int, HybridFFN], cpu: CPUExecutor, tier: FastTier,
                 book: StatsBook, streamer: ColdStreamer | None, pinned: list[int],
                 moe: dict[int, HybridMoE] | None = None, whole: dict[int, nn.Module] | None = None,
                 experts_streamer: ExpertStreamer | None = None):
        self.lm, self.layers, self.cpu, self.tier, self.book = lm, layers, cpu, tier, book
        self.moe = moe or {}
        self.whole = whole or {}  # dense/gated FFNs kept int4 whole on the fast tier (not split)
        self.streamer = streamer
        self.experts_streamer = experts_streamer  # quantised host experts streamed for prefill
        # pinned host memory must be unregistered before it is freed: at close() or when collected
        self._unpin = weakref.finalize(self, unpin_host, pinned)

    def stats(self) -> dict:
        """Per phase ("decode", "prefill"): sums and per-token means of GPU/CPU/transfer/wait time
        and of rows (MoE: routed experts) computed on each side (synchronises on CUDA)."""
        return self.book.summary()

    def reset_stats(self) -> None:
        self.book.reset()

    def set_stats(self, enabled: bool) -> None:
        """Turn statistics on or off (off: no CUDA events, no device-side row counts)."""
        self.book.resolve(block=True)
        self.book.enabled = self.tier.timing = enabled

    def memory(self) -> dict:
        """Bytes held: fast tier (hot rows + predictors + biases; MoE: router, shared expert, GPU
        experts), host (cold rows; MoE: CPU experts), host buffers; the MoE share of each side apart."""
        ffns, moes = self.layers.values(), self.moe.values()
        first = next(iter([*ffns, *moes]), None)
        fast_moe, host_moe = sum(m.fast_bytes for m in moes), sum(m.host_bytes for m in moes)
        return {
            "fast_ffn_bytes": sum(f.gpu.nbytes for f in ffns) + fast_moe + sum(map(quant_bytes, self.whole.values())),
            "host_ffn_bytes": sum(f.cold.nbytes for f in ffns) + host_moe,
            "fast_moe_bytes": fast_moe,
            "host_moe_bytes": host_moe,
            "host_buffer_bytes": sum(f.decode_io.nbytes + f.cold.n for f in ffns) + sum(m.buffer_bytes for m in moes)
            + (first.prefill_io.nbytes if first is not None else 0)
            + (next(iter(moes)).prefill_routing.nbytes if moes else 0),
            "stream_workspace_bytes": sum(s.workspace_bytes for s in (self.streamer, self.experts_streamer) if s),
            "expert_cache_bytes": next((m.cache.nbytes for m in moes if m.cache is not None), 0),
        }

    def int4_skipped(self) -> dict[str, list[int]]:
        """Layers whose hot rows were asked to stay int4 but were expanded (HotFFN.int4_skipped), by reason."""
        out: dict[str, list[int]] = {}
        for l, f in self.layers.items():
            if f.gpu.hot.int4_skipped:
                out.setdefault(f.gpu.hot.int4_skipped, []).append(l)
        return out

    def close(self) -> None:
        """Stop the CPU worker and unpin host memory; the model cannot run hybrid layers after this."""
        self.cpu.close()
        self._unpin()

    def __enter__(self) -> "HybridEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _move_rest(model: nn.Module, device: torch.device, dtype: torch.dtype, int4: bool = False) -> None:
    """Everything left in the model to device; floating parameters to dtype (rotary tables stay fp32).

    Quantised modules (QuantLinear / QuantEmbedding, models/quantized.py) are dequantised onto a
    CUDA tier (int4: 4-bit QuantLinears become Int4Linear where torch's int4 kernels take them); on a
    CPU tier they stay in their blocks and compute with the block kernels (qgemv)."""
    if device.type != "cpu":
        dequantize_model(model, device, dtype, int4)
    model.to(device)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset(device)
        elif isinstance(m, (QuantEmbedding, HalfEmbedding)):
            m.dtype = dtype  # the rows it looks up come out in the tier's dtype


@torch.no_grad()
def make_hybrid(lm: LoadedModel, hot: dict[int, torch.Tensor], predictors: PredictorSet | Literal["oracle"] | None,
                device: str | torch.device | None = None, dtype: torch.dtype | None = None, cpu_dtype: str = "bf16",
                threads: int | None = None, thresholds: dict[int, float] | None = None, prefill: str = "auto",
                costs: PrefillCosts | None = None, stats: bool = True, pin_cold: bool | None = None,
                attention_cpu: set[int] | frozenset = frozenset(),
                predictor_cpu: set[int] | frozenset = frozenset(),
                gpu_experts: dict[int, list[int] | torch.Tensor] | None = None,
                stream_slots_bytes: int = STREAM_SLOTS_BYTES, expert_stream_bytes: int = EXPERT_STREAM_BYTES,
                expert_cache_bytes: int = 0,
                prefetch_experts: int | None = None, expert_cache_policy: str = "lru",
                cuda_graphs: bool | str = True, gpu_int4: bool = False, cpu_inline: bool | None = None,
                embed_cpu: bool = False, head_cpu: bool = False,
                int4_hot: bool | None = None, int4_down: bool = INT4_DOWN_DEFAULT,
                host_nodes: bool | None = None, dense_host_nodes: bool | None = None,
                host_block_steps: bool | None = None, layer_nodes: bool | None = None,
                times: LoadTimes | None = None) -> HybridEngine:
    """Convert lm in place into a hybrid engine and return it.

    hot: per layer, the neuron indices placed on the fast tier (hottest first); a missing layer has none.
    predictors: a PredictorSet (layers without a predictor compute every neuron), "oracle" (the true
      active set |h| > thresholds[l], default 0; tests only), or None (every neuron, dense).
    device / dtype: the fast tier (default: lm's). cpu_dtype: storage of cold rows, f32 | bf16 | f16 | i8
      (a quantised model's cold rows keep their GGUF blocks, W_down transposed as Q8_0: cpu_dtype does not apply).
    threads: numba threads of the CPU worker. prefill: "auto" (prefill_regime decides per layer and
      prompt length), "cpu", "dense" or "stream". costs: the rates prefill_regime weighs (default:
      H200 host); without a cpu_flops figure, torch's CPU GEMM is timed here (about 10 ms).
    stats: time GPU work and transfers with CUDA events (worker times and CPU rows are always kept).
    pin_cold: page-lock cold weights for streaming (default: on CUDA unless prefill="cpu").
    attention_cpu: layers whose attention (weights and KV cache) stays in host memory and runs on the CPU.
    predictor_cpu: layers whose predictor runs on the CPU (numba gemv; the mask crosses to the fast tier).
    gpu_experts: per MoE layer, the experts placed on the fast tier; a missing layer has none (all on the CPU).
    stream_slots_bytes: fast-tier bytes of the two slots prefill streams cold rows through (the
      planner reserves the default, planner.costs.Constants.stream_slots_bytes).
    expert_stream_bytes: fast-tier bytes through which prefill streams quantised host experts (two
      raw slots and the decoded group, executors/expert_stream.py; on a CPU tier only with
      prefill="stream", for tests).
    expert_cache_bytes: fast-tier bytes for the MoE expert cache (0: none); prefetch_experts: how
      many experts of the next MoE layer the look-ahead names per token (default top-k / 2: naming
      more copies more experts per hit, and PCIe moves an expert in about 1.4x the time the CPU
      computes it, so a copy must buy more than one hit); the
      look-ahead is the PredictorSet's corrected router where the profile trained one, else the
      next layer's router; expert_cache_policy: "lru" or "lfu" eviction.
    cuda_graphs: on CUDA, replay each block's attention half, and the device half of its hybrid FFN
      or MoE layer, as a CUDA graph in one-token steps (executors/graphs.py), and where every block's
      step is captured whole on the device, the whole step as one graph (StepGraph); "step": that
      also over layers whose CPU experts are host nodes (measured slower, see StepGraph); "layers":
      graphs per layer only; "attention": the attention half only (the FFNs eager): to compare.
    gpu_int4: a quantised model's 4-bit matrices stay 4-bit on a CUDA tier (torch's int4 kernels)
      instead of being expanded to dtype: outside the split FFNs (attention, LM head) as Int4Linear,
      and the split FFNs' hot up/gate rows as Int4Matrix (see int4_hot).
    int4_hot: whether the split FFNs' hot rows are kept int4 (executors/weights.py `_hot_int4`;
      a layer whose rows cannot be says why in HotFFN.int4_skipped); None: gpu_int4 on a CUDA tier.
      A layer whose neurons are all hot and whose up/gate/down are all 4-bit is then not split: its
      FFN stays whole with Int4Linear matrices on the fast tier (`whole_int4`; engine.whole). A MoE
      layer's fast-tier experts keep their 4-bit gate/up and down as Q4Stack (executors/moe.py
      `split_moe`; the Triton expert kernels read them). True on a CPU tier runs torch's CPU twin
      kernels (for tests; its experts are dequantised per call). int4_down: W_down's hot columns
      requantised to int4 as well (default INT4_DOWN_DEFAULT, sparse_ops/gpu_quant.py: kept in dtype).
    embed_cpu / head_cpu: keep the token embedding / the LM head in host memory and compute them on
      the CPU (HostEmbedding, HostHead; a tied head follows the embedding), as a plan counts them.
    cpu_inline: run the CPU parts in the calling thread rather than a worker (default: on a CPU tier,
      and on CUDA with cuda_graphs=True, where a graph queues the fast tier's work of a layer before
      its CPU part starts, so a worker thread would only add a hand-off and a second OpenMP team).
    host_nodes: with cuda_graphs=True, a MoE layer's graphed decode step is one graph whose CPU
      experts run as a CUDA host node (executors/host_node.py; quantised host experts, no expert
      cache, stats=False); default: on unless the environment sets HOTCOLD_HOST_NODES=0.
    dense_host_nodes: the same for a dense or gated layer's cold rows (FFNHostNode); default: on
      unless the environment sets HOTCOLD_DENSE_HOST_NODES=0 (tools/bench_hybrid.py --host-nodes no,yes
      compares the two).
    host_block_steps: a layer whose attention and predictor are both on the CPU decodes as a
      HostBlock (executors/host_block.py: the residual stream on the host for its step, one crossing
      down); default: on unless the environment sets HOTCOLD_HOST_BLOCKS=0.
    layer_nodes: such a HostBlock runs its host share of a step as one compiled call where it can
      (executors/layer_node.py, LayerHostNode); default: on unless the environment sets
      HOTCOLD_LAYER_NODES=0. On CUDA with cuda_graphs=True the call is a host node of the layer's
      own graph unless the environment sets HOTCOLD_LAYER_GRAPHS=0.
    times: each stage's seconds (split, upload, repack, pin, kernels, graphs) are added to it.
    """
    times = times if times is not None else LoadTimes()
    if prefill not in ("auto", *REGIMES):
        raise ValueError(f"prefill must be auto, cpu or stream, got {prefill!r}")
    model = lm.model
    device = torch.device(device) if device is not None else lm.device
    dtype = dtype or lm.dtype
    tier = FastTier(device, dtype, timing=stats)
    if tier.cuda:  # as the loader does: cuDNN attention rebuilds its graph at every decode step
        torch.backends.cuda.enable_cudnn_sdp(False)
    act = lm.config.activation
    thresholds = thresholds or {}
    layers = [i for i, b in enumerate(model.layers) if isinstance(b.ffn, (DenseFFN, GatedFFN))]
    if predictors is not None and predictors != "oracle" and not isinstance(predictors, PredictorSet):
        raise TypeError("predictors must be a PredictorSet, 'oracle' or None")
    if any(not 0 <= l < len(model.layers) for l in attention_cpu):
        raise ValueError(f"attention_cpu names a layer outside 0..{len(model.layers) - 1}")
    unknown = sorted(set(hot) - set(layers))
    if unknown:
        raise ValueError(f"hot neurons given for layer {unknown[0]}, which has no dense or gated FFN")
    gpu_experts = gpu_experts or {}
    moe_layers = [i for i, b in enumerate(model.layers) if isinstance(b.ffn, MoEFFN)]
    unknown = sorted(set(gpu_experts) - set(moe_layers))
    if unknown:
        raise ValueError(f"GPU experts given for layer {unknown[0]}, which has no MoE FFN")
    gpu_experts = {l: check_experts(e, lm.config.num_experts) for l, e in gpu_experts.items()}  # before the worker

    cpu_threads = threads or default_threads(tier.cuda)  # the worker's, CPU attention's and CPU predictors'
    # every CPU part of the plan runs on this one thread (see HostAttention); on a CPU fast tier, the
    # calling thread itself (nothing to overlap with: a worker only added hand-offs and a second
    # OpenMP team on the same cores); on CUDA with the FFNs' device half in graphs, the calling thread
    # too, after each graph's replay (`HOTCOLD_CPU_WORKER=1`: a worker thread, to compare)
    layer_graphs = cuda_graphs in (True, "layers", "step")  # each block's one-token step replays a graph
    if cpu_inline is None:
        cpu_inline = not tier.cuda or (layer_graphs and os.environ.get("HOTCOLD_CPU_WORKER") != "1")
    cpu = CPUExecutor(cpu_threads, inline=cpu_inline)
    if int4_hot is None:
        int4_hot = gpu_int4 and tier.cuda
    book = StatsBook(enabled=stats)
    parts = {}
    whole: dict[int, nn.Module] = {}
    t_split = time.perf_counter()
    for l in layers:
        ffn = model.layers[l].ffn
        n = ffn.up.out_features  # I (a QuantLinear's weight property would decode it all)
        hot_idx = check_hot(hot.get(l, torch.zeros(0, dtype=torch.int64)), n)
        if int4_hot and hot_idx.numel() == n and whole_int4_reason(ffn, device) is None:
            whole_int4(ffn, device, dtype)  # every neuron hot: no split, the FFN int4 as it is
            whole[l] = ffn
            continue
        is_hot = torch.zeros(n, dtype=torch.bool)
        is_hot[hot_idx] = True
        perm = torch.cat([hot_idx, torch.nonzero(~is_hot).flatten()])  # hot-first order
        if predictors == "oracle":
            mask_fn = OracleMask(ffn, perm, act, float(thresholds.get(l, 0.0)), device, dtype)
        elif predictors is not None and l in predictors.neurons and hot_idx.numel() < n:  # all hot: nothing to skip
            on_cpu = l in predictor_cpu
            # on the CPU (placed there, or the CPU tier): numba's kernels over Q8_0 blocks (float32
            # where cpu_dtype asks for f32): a 4-layer 7B shape's 43 MB of predictors take 2.0 ms a token
            # as Q8_0 blocks against 9.1 through torch's bfloat16 GEMV
            mask_fn = LearnedMask(predictors.neurons[l], perm, "cpu" if on_cpu else device, predictor_dtype(dtype),
                                  host_threads=cpu_threads if on_cpu or not tier.cuda else None,
                                  host_qtype=None if cpu_dtype == "f32" else HOST_PREDICTOR_QTYPE,
                                  worker=cpu if on_cpu else None, book=book)
        else:
            mask_fn = None
        hot_part, cold_part, down_bias = split_ffn(ffn, hot_idx, act, device, dtype, cpu_dtype, int4_hot, int4_down)
        drop_module_pages(ffn)  # a GGUF's blocks were copied into the parts: one copy in RAM
        model.layers[l].ffn = nn.Identity()  # the original FFN's parameters go with the last reference
        del ffn
        parts[l] = (GPUExecutor(hot_part, down_bias, mask_fn, act, lm.config.hidden_size), cold_part)
    moe_parts = {}
    for l in moe_layers:
        moe_ffn = model.layers[l].ffn
        moe_parts[l] = split_moe(moe_ffn, gpu_experts.get(l, ()), act, device, dtype, cpu_dtype, int4=int4_hot)
        drop_module_pages(moe_ffn)
        model.layers[l].ffn = nn.Identity()  # the stacked experts go with the last reference
        del moe_ffn
    if tier.cuda:  # the copies queued: timed as they finish
        torch.cuda.synchronize(device)
    times.add("split", time.perf_counter() - t_split)
    with times.stage("repack"):
        for l in attention_cpu:  # its matrices interleaved for one-token GEMVs (quantised models)
            pack_for_decode(model.layers[l].attn)
    host_attn = {l: HostAttention(model.layers[l].attn, dtype, cpu_threads, worker=cpu, book=book)
                 for l in sorted(attention_cpu)}
    for l in host_attn:  # kept out of the move below: their weights never visit the fast tier
        model.layers[l].attn = nn.Identity()
    tied = lm.config.tie_word_embeddings
    embed = model.embed if embed_cpu or (head_cpu and tied) else None
    head = model.lm_head if head_cpu and not tied else None
    if embed is not None:
        model.embed = nn.Identity()  # out of the move, like the host attention
    if head is not None:
        model.lm_head = nn.Identity()
    with times.stage("upload"):
        _move_rest(model, device, dtype, gpu_int4)
        if tier.cuda:
            torch.cuda.synchronize(device)
    t_pack = time.perf_counter()
    if embed is not None:  # (a model loaded on the device brings its float weights back)
        if isinstance(embed, (QuantEmbedding, HalfEmbedding)):
            embed.dtype = dtype
        else:
            embed.to("cpu", dtype)
        pack_for_decode(embed, tied)
        model.embed = HostEmbedding(embed, device, cpu_threads)
    if head is not None:
        if not isinstance(head, QuantLinear):
            head.to("cpu", dtype)
        pack_for_decode(head, is_head=True)
        model.lm_head = HostHead(head, cpu_threads)
    if not tier.cuda:  # the split FFNs have their rows: the rest can be interleaved
        pack_for_decode(model)
    times.add("repack", time.perf_counter() - t_pack)
    for l, a in host_attn.items():
        model.layers[l].attn = a
    if host_attn:
        lm.layer_devices = [torch.device("cpu") if l in host_attn else device for l in range(len(model.layers))]

    colds = {l: c for l, (_, c) in parts.items() if c.n and not c.quantized}  # quantised: never streamed
    colds.update({l: mp.cold for l, mp in moe_parts.items() if mp.cold is not None and not mp.cold.quantized})
    streamer = ColdStreamer(tier, colds, sorted(colds), stream_slots_bytes) \
        if colds and prefill in ("auto", "stream") else None
    costs = costs or PrefillCosts()
    gemm = [c for _, c in parts.values() if c.n and c.gemm_ready]
    if costs.cpu_flops is None and prefill == "auto" and gemm:  # the "dense" regime's rate, in the rows' dtype
        costs = dataclasses.replace(costs, cpu_flops=measure_cpu_flops(torch_view(gemm[0].up).dtype,
                                                                       lm.config.hidden_size, cpu_threads))
    qcolds = {l: mp.cold for l, mp in moe_parts.items() if streamable(mp.cold)}
    experts_streamer = ExpertStreamer(tier, qcolds, lm.config.hidden_size, expert_stream_bytes) \
        if qcolds and prefill in ("auto", "stream") and (tier.cuda or prefill == "stream") else None
    pinned: list[int] = []
    t_pin = time.perf_counter()
    if tier.cuda and (pin_cold if pin_cold is not None else True):  # what streams, page-locked
        for c in [*(colds.values() if streamer else ()), *(qcolds.values() if experts_streamer else ())]:
            pinned += pin_host(c)
    times.add("pin", time.perf_counter() - t_pin)
    prefill_io = HostRows(tier.host_empty, lm.config.hidden_size, 0)
    hybrid: dict[int, HybridFFN] = {}
    for l, (gpu, cold) in parts.items():
        hybrid[l] = model.layers[l].ffn = HybridFFN(l, gpu, cold, cpu, tier, book, prefill_io, streamer, prefill, costs)
    moe: dict[int, HybridMoE] = {}
    prefill_routing = HostRouting(tier.host_empty, lm.config.top_k, 0) if moe_parts else None
    for l, mp in moe_parts.items():
        moe[l] = model.layers[l].ffn = HybridMoE(l, mp, cpu, tier, book, prefill_io, prefill_routing,
                                                 experts_streamer if l in qcolds else streamer, prefill, costs)
    if host_nodes is None:
        host_nodes = os.environ.get("HOTCOLD_HOST_NODES", "1") != "0"
    for m in moe.values():
        m.host_nodes = bool(host_nodes and layer_graphs)
    if dense_host_nodes is None:
        dense_host_nodes = os.environ.get("HOTCOLD_DENSE_HOST_NODES", "1") != "0"
    for h in hybrid.values():
        h.host_nodes = bool(dense_host_nodes and layer_graphs)
    every = {**hybrid, **moe}
    if every:
        every[min(every)].first = True
    if expert_cache_bytes and moe:
        looks = predictors.lookahead if isinstance(predictors, PredictorSet) else {}
        with times.stage("pin"):
            pinned += _expert_cache(model, moe, tier, cpu_dtype, expert_cache_bytes, looks, prefetch_experts,
                                    expert_cache_policy)
    if host_block_steps is None:
        host_block_steps = os.environ.get("HOTCOLD_HOST_BLOCKS", "1") != "0"
    if layer_nodes is None:
        layer_nodes = os.environ.get("HOTCOLD_LAYER_NODES", "1") != "0"
    if host_block_steps:  # before graph_blocks, which wraps only the plain Blocks left
        with times.stage("kernels"):
            host_blocks(model, node=layer_nodes,
                        graphs=tier.cuda and layer_graphs and os.environ.get("HOTCOLD_LAYER_GRAPHS", "1") != "0")
    if tier.cuda and cuda_graphs:
        with times.stage("graphs"):
            graph_blocks(model, ffn=cuda_graphs != "attention",
                         step="host" if cuda_graphs == "step" else cuda_graphs is True)
    lm.device, lm.dtype = device, dtype
    return HybridEngine(lm, hybrid, cpu, tier, book, streamer, pinned, moe, whole, experts_streamer)


def _expert_cache(model, moe: dict[int, HybridMoE], tier: FastTier, kind: str, nbytes: int,
                  lookahead: dict[int, torch.Tensor], m: int | None, policy: str = "lru") -> list[int]:
    """Give the MoE layers one ExpertCache of nbytes and chain look-aheads between consecutive MoE
    layers; page-lock their host experts on CUDA (returns the pointers to unpin). Slots store `kind`,
    or the tier dtype for quantised host experts (see slot_kind)."""
    any_cold = [h for h in moe.values() if h.cold is not None]
    if not any_cold:
        return []
    kind = slot_kind(kind, tier.dtype, any_cold[0].cold.quantized)
    hidden, dim = len(any_cold[0].expert_rows[0]), any_cold[0].dim
    slots = nbytes // ExpertCache.slot_bytes(hidden, dim, kind)
    if slots < 1:
        raise ValueError(f"expert_cache_bytes {nbytes} holds no expert ({ExpertCache.slot_bytes(hidden, dim, kind)} "
                         "bytes each)")
    cache = ExpertCache(tier, int(slots), hidden, dim, kind, policy)
    order = sorted(moe)
    for l in order:
        moe[l].cache = cache
    for a, b in zip(order, order[1:]):
        src, dst = moe[a], moe[b]
        k = dst.top_k
        weight = lookahead.get(a, dst.router.weight).detach().to(tier.device, tier.dtype)  # [E, D]
        dst.ahead_target = True
        src.ahead = Lookahead(dst, model.layers[b].ffn_norm, weight, min(4 * k, m or max(1, k // 2), weight.shape[0]))
        model.layers[a].ffn_norm.register_forward_pre_hook(
            lambda mod, args, h=src: setattr(h, "residual", args[0]))
    pinned = []
    if tier.cuda:
        for h in any_cold:
            if not h.cold.pinned:  # the prefill streamer may have pinned it already
                pinned += pin_host(h.cold)
    return pinned


def random_hot(lm_or_config, fraction: float, seed: int = 0) -> dict[int, torch.Tensor]:
    """A random plan for tests and benchmarks: per dense/gated layer, round(fraction * I) neurons."""
    config = getattr(lm_or_config, "config", lm_or_config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for l in range(config.num_layers):
        if config.ffn_kind(l) in ("dense", "gated"):
            n = config.intermediate_size
            out[l] = torch.randperm(n, generator=gen)[: int(round(fraction * n))]
    return out


__all__ = ["HybridEngine", "make_hybrid", "random_hot"]
