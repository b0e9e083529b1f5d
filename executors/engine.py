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
import time
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from hotcold.executors.cpu_executor import CPUExecutor, HostRows
from hotcold.executors.graphs import graph_blocks
from hotcold.executors.gpu_executor import HOST_PREDICTOR_QTYPE, GPUExecutor, LearnedMask, OracleMask, predictor_dtype
from hotcold.executors.host_attention import HostAttention, HostEmbedding, HostHead
from hotcold.executors.host_block import host_blocks
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.expert_cache import ExpertCache, slot_kind
from hotcold.executors.expert_stream import EXPERT_STREAM_BYTES, ExpertStreamer, streamable
from hotcold.executors.moe import HybridMoE, Lookahead
from hotcold.executors.moe_host import HostRouting
from hotcold.executors.moe_parts import MoEParts, check_experts, split_moe
from hotcold.executors.options import EngineOptions, Placement
from hotcold.executors.prefill import (STREAM_SLOTS_BYTES, ColdStreamer, PrefillCosts, measure_cpu_flops,
                                      pin_host, unpin_host)
from hotcold.executors.split_cache import open_split_memo
from hotcold.executors.stats import StatsBook
from hotcold.executors.tier import FastTier
from hotcold.executors.weights import check_hot, split_ffn, whole_int4, whole_int4_reason
from hotcold.machine import default_threads
from hotcold.models.gguf_loader import drop_file_pages
from hotcold.models.layers import DenseFFN, GatedFFN, MoEFFN, Rotary
from hotcold.models.load_times import LoadTimes
from hotcold.models.loader import LoadedModel
from hotcold.models.quantized import (HalfEmbedding, QuantEmbedding, QuantLinear, dequantize_model,
                                      drop_module_pages, pack_for_decode, quant_bytes)
from hotcold.predictors.artifact import PredictorSet
from hotcold.sparse_ops.cpu import torch_view
from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT
from hotcold.sparse_ops.quant import QuantMatrix


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
                predictor_off: set[int] | frozenset = frozenset(),
                gpu_experts: dict[int, list[int] | torch.Tensor] | None = None,
                stream_slots_bytes: int = STREAM_SLOTS_BYTES, expert_stream_bytes: int = EXPERT_STREAM_BYTES,
                expert_cache_bytes: int = 0,
                prefetch_experts: int | None = None, expert_cache_policy: str = "lru",
                cuda_graphs: bool | str = True, gpu_int4: bool = False, cpu_inline: bool | None = None,
                embed_cpu: bool = False, head_cpu: bool = False,
                int4_hot: bool | None = None, int4_down: bool = INT4_DOWN_DEFAULT,
                host_nodes: bool = True, dense_host_nodes: bool = True, defer_experts: bool = False,
                host_block_steps: bool = True, layer_nodes: bool = True, layer_graphs: bool = True,
                map_experts: bool = False, times: LoadTimes | None = None) -> HybridEngine:
    """build_engine from keywords (tests and tools): `hot`, `gpu_experts`, `attention_cpu`,
    `predictor_cpu`, `predictor_off`, `embed_cpu`, `head_cpu`, `expert_cache_bytes`, `gpu_int4` and `int4_down` make
    the Placement, the rest the EngineOptions (executors/options.py says what each means;
    host_block_steps is EngineOptions.host_blocks)."""
    placement = Placement(hot=hot, gpu_experts=gpu_experts or {}, attention_cpu=attention_cpu,
                          predictor_cpu=predictor_cpu, predictor_off=predictor_off, embed_cpu=embed_cpu, head_cpu=head_cpu,
                          expert_cache_bytes=expert_cache_bytes, gpu_int4=gpu_int4, int4_down=int4_down)
    options = EngineOptions(device=device, dtype=dtype, cpu_dtype=cpu_dtype, threads=threads, stats=stats,
                            prefill=prefill, costs=costs, pin_cold=pin_cold, stream_slots_bytes=stream_slots_bytes,
                            expert_stream_bytes=expert_stream_bytes, prefetch_experts=prefetch_experts,
                            expert_cache_policy=expert_cache_policy, thresholds=thresholds or {},
                            cuda_graphs=cuda_graphs, cpu_inline=cpu_inline, int4_hot=int4_hot,
                            host_nodes=host_nodes, dense_host_nodes=dense_host_nodes, defer_experts=defer_experts,
                            host_blocks=host_block_steps,
                            layer_nodes=layer_nodes, layer_graphs=layer_graphs, map_experts=map_experts)
    return build_engine(lm, placement, predictors, options, times)


@dataclass
class _Build:
    """What the build's parts share: the model, the fast tier, the CPU worker and the statistics."""

    lm: LoadedModel
    placement: Placement
    options: EngineOptions
    tier: FastTier
    cpu: CPUExecutor
    book: StatsBook
    threads: int
    int4_hot: bool
    times: LoadTimes

    @property
    def model(self) -> nn.Module:
        return self.lm.model


@torch.no_grad()
def build_engine(lm: LoadedModel, placement: Placement, predictors: PredictorSet | Literal["oracle"] | None,
                 options: EngineOptions = EngineOptions(), times: LoadTimes | None = None) -> HybridEngine:
    """Convert lm in place into a hybrid engine by `placement`, executed as `options` say.

    predictors: a PredictorSet (layers without a predictor compute every neuron), "oracle" (the true
    active set |h| > options.thresholds[l], default 0; tests only), or None (every cold neuron).
    times: each stage's seconds (split, upload, repack, pin, kernels, graphs) are added to it."""
    times = times if times is not None else LoadTimes()
    device = torch.device(options.device) if options.device is not None else lm.device
    dtype = options.dtype or lm.dtype
    tier = FastTier(device, dtype, timing=options.stats)
    gpu_experts = _check(lm, placement, predictors)  # before the worker starts
    if tier.cuda:  # as the loader does: cuDNN attention rebuilds its graph at every decode step
        torch.backends.cuda.enable_cudnn_sdp(False)
    threads = options.threads or default_threads(tier.cuda)  # the worker's, CPU attention's and CPU predictors'
    # every CPU part of the plan runs on this one executor (see HostAttention): inline on a CPU tier
    # (nothing to overlap with: a worker only added hand-offs and a second OpenMP team on the same
    # cores) and on CUDA with the FFNs' device half in per-layer graphs (a worker where asked: on the
    # H100 host, 48 Qwen3-30B-A3B-shaped layers decoded at 63-65 tok/s inline, 60-65 with a worker)
    inline = options.cpu_inline if options.cpu_inline is not None else (not tier.cuda or options.per_layer_graphs)
    b = _Build(lm, placement, options, tier, CPUExecutor(threads, inline=inline),
               StatsBook(enabled=options.stats),
               threads, options.int4_hot if options.int4_hot is not None else placement.gpu_int4 and tier.cuda,
               times)
    t_split = time.perf_counter()
    parts, whole = _split_dense(b, predictors)
    moe_parts = {l: _split_moe_layer(b, l, gpu_experts.get(l, ())) for l in _layers_of(lm, MoEFFN)}
    if tier.cuda:  # the copies queued: timed as they finish
        torch.cuda.synchronize(device)
    times.add("split", time.perf_counter() - t_split)
    _place_rest(b)
    hybrid, moe, streamer, experts_streamer, pinned = _hybrid_layers(b, parts, moe_parts)
    if placement.expert_cache_bytes and moe:
        looks = predictors.lookahead if isinstance(predictors, PredictorSet) else {}
        with times.stage("pin"):
            pinned += _expert_cache(b.model, moe, tier, options.cpu_dtype, placement.expert_cache_bytes, looks,
                                    options.prefetch_experts, options.expert_cache_policy)
    _wrap_steps(b, hybrid, moe)
    lm.device, lm.dtype = device, dtype
    return HybridEngine(lm, hybrid, b.cpu, tier, b.book, streamer, pinned, moe, whole, experts_streamer)


def _layers_of(lm: LoadedModel, *kinds) -> list[int]:
    return [i for i, blk in enumerate(lm.model.layers) if isinstance(blk.ffn, kinds)]


def _check(lm: LoadedModel, placement: Placement, predictors) -> dict[int, list[int]]:
    """Refuse a placement that does not fit the model; returns its GPU experts checked."""
    n_layers = len(lm.model.layers)
    if predictors is not None and predictors != "oracle" and not isinstance(predictors, PredictorSet):
        raise TypeError("predictors must be a PredictorSet, 'oracle' or None")
    if any(not 0 <= l < n_layers for l in placement.attention_cpu):
        raise ValueError(f"attention_cpu names a layer outside 0..{n_layers - 1}")
    unknown = sorted(set(placement.hot) - set(_layers_of(lm, DenseFFN, GatedFFN)))
    if unknown:
        raise ValueError(f"hot neurons given for layer {unknown[0]}, which has no dense or gated FFN")
    unknown = sorted(set(placement.gpu_experts) - set(_layers_of(lm, MoEFFN)))
    if unknown:
        raise ValueError(f"GPU experts given for layer {unknown[0]}, which has no MoE FFN")
    return {l: check_experts(e, lm.config.num_experts) for l, e in placement.gpu_experts.items()}


def _split_dense(b: _Build, predictors) -> tuple[dict[int, tuple[GPUExecutor, object]], dict[int, nn.Module]]:
    """Each dense/gated FFN split into its fast-tier executor and its cold rows (or, every neuron hot
    under int4, kept whole); the original FFN is dropped layer by layer, so host memory holds each
    weight once."""
    o, device, dtype = b.options, b.tier.device, b.tier.dtype
    act = b.lm.config.activation
    parts, whole = {}, {}
    layers = _layers_of(b.lm, DenseFFN, GatedFFN)
    # the CPU tier's parts of a quantised FFN from (or, on a first load, into) the split cache
    quantized = any(isinstance(b.model.layers[l].ffn.up, QuantLinear) for l in layers)
    memo = open_split_memo(b.lm, b.placement.hot, predictors) if quantized else None
    for l in layers:
        ffn = b.model.layers[l].ffn
        n = ffn.up.out_features  # I (a QuantLinear's weight property would decode it all)
        hot_idx = check_hot(b.placement.hot.get(l, torch.zeros(0, dtype=torch.int64)), n)
        if b.int4_hot and hot_idx.numel() == n and whole_int4_reason(ffn, device) is None:
            whole_int4(ffn, device, dtype)  # every neuron hot: no split, the FFN int4 as it is
            whole[l] = ffn
            continue
        is_hot = torch.zeros(n, dtype=torch.bool)
        is_hot[hot_idx] = True
        perm = torch.cat([hot_idx, torch.nonzero(~is_hot).flatten()])  # hot-first order
        if predictors == "oracle":
            mask_fn = OracleMask(ffn, perm, act, float(o.thresholds.get(l, 0.0)), device, dtype)
        elif (predictors is not None and l in predictors.neurons and hot_idx.numel() < n  # all hot: nothing to skip
              and l not in b.placement.predictor_off):
            on_cpu = l in b.placement.predictor_cpu
            # on the CPU (placed there, or the CPU tier): numba's kernels over Q8_0 blocks (float32
            # where cpu_dtype asks for f32): a 4-layer 7B shape's 43 MB of predictors take 2.0 ms a token
            # as Q8_0 blocks against 9.1 through torch's bfloat16 GEMV
            mask_fn = LearnedMask(predictors.neurons[l], perm, "cpu" if on_cpu else device, predictor_dtype(dtype),
                                  host_threads=b.threads if on_cpu or not b.tier.cuda else None,
                                  host_qtype=None if o.cpu_dtype == "f32" else HOST_PREDICTOR_QTYPE,
                                  worker=b.cpu if on_cpu else None, book=b.book,
                                  memo=memo if memo is not None and memo.predictors else None,
                                  name=f"layers.{l}.predictor")
        else:
            mask_fn = None
        hot_part, cold_part, down_bias = split_ffn(ffn, hot_idx, act, device, dtype, o.cpu_dtype, b.int4_hot,
                                                   b.placement.int4_down, memo, f"layers.{l}.cold")
        kept = {id(m.data) for m in cold_part.mats if isinstance(m, QuantMatrix)}  # the file's own rows
        for m in ffn.modules():  # a GGUF's blocks were copied into the parts: one copy in RAM
            if isinstance(m, QuantLinear) and id(m.qweight.data) not in kept:
                drop_file_pages(m.qweight.data)
        b.model.layers[l].ffn = nn.Identity()  # the original FFN's parameters go with the last reference
        del ffn
        parts[l] = (GPUExecutor(hot_part, down_bias, mask_fn, act, b.lm.config.hidden_size), cold_part)
    if memo is not None:
        memo.save()
    return parts, whole


def _split_moe_layer(b: _Build, l: int, gpu_experts) -> MoEParts:
    """Layer l's MoE split: router, shared expert and gpu_experts on the fast tier, the rest in host memory."""
    moe_ffn = b.model.layers[l].ffn
    parts = split_moe(moe_ffn, gpu_experts, b.lm.config.activation, b.tier.device, b.tier.dtype,
                      b.options.cpu_dtype, int4=b.int4_hot, mapped=b.options.map_experts)
    in_place = parts.cold is not None and parts.cold.up is getattr(moe_ffn.experts, "qup", None)
    if not in_place:  # copied into the parts: one copy in RAM (mapped experts keep their pages)
        drop_module_pages(moe_ffn)
    b.model.layers[l].ffn = nn.Identity()  # the stacked experts go with the last reference
    return parts


def _place_rest(b: _Build) -> None:
    """Attention the placement keeps on the CPU becomes HostAttention, the embedding / LM head kept in
    host memory HostEmbedding / HostHead; everything else moves to the fast tier."""
    model, tier, threads = b.model, b.tier, b.threads
    with b.times.stage("repack"):
        for l in b.placement.attention_cpu:  # its matrices interleaved for one-token GEMVs (quantised models)
            pack_for_decode(model.layers[l].attn)
    host_attn = {l: HostAttention(model.layers[l].attn, tier.dtype, threads, worker=b.cpu, book=b.book)
                 for l in sorted(b.placement.attention_cpu)}
    for l in host_attn:  # kept out of the move below: their weights never visit the fast tier
        model.layers[l].attn = nn.Identity()
    tied = b.lm.config.tie_word_embeddings
    embed = model.embed if b.placement.embed_cpu or (b.placement.head_cpu and tied) else None
    head = model.lm_head if b.placement.head_cpu and not tied else None
    if embed is not None:
        model.embed = nn.Identity()  # out of the move, like the host attention
    if head is not None:
        model.lm_head = nn.Identity()
    with b.times.stage("upload"):
        _move_rest(model, tier.device, tier.dtype, b.placement.gpu_int4)
        if tier.cuda:
            torch.cuda.synchronize(tier.device)
    with b.times.stage("repack"):
        if embed is not None:  # (a model loaded on the device brings its float weights back)
            if isinstance(embed, (QuantEmbedding, HalfEmbedding)):
                embed.dtype = tier.dtype
            else:
                embed.to("cpu", tier.dtype)
            pack_for_decode(embed, tied)
            model.embed = HostEmbedding(embed, tier.device, threads)
        if head is not None:
            if not isinstance(head, QuantLinear):
                head.to("cpu", tier.dtype)
            pack_for_decode(head, is_head=True)
            model.lm_head = HostHead(head, threads)
        if not tier.cuda:  # the split FFNs have their rows: the rest can be interleaved
            pack_for_decode(model)
    for l, a in host_attn.items():
        model.layers[l].attn = a
    if host_attn:
        b.lm.layer_devices = [torch.device("cpu") if l in host_attn else tier.device for l in range(len(model.layers))]


def _hybrid_layers(b: _Build, parts: dict, moe_parts: dict[int, MoEParts]):
    """The split layers as HybridFFN / HybridMoE modules, with the prefill streamers of their host
    parts (page-locked on CUDA). -> (hybrid, moe, streamer, experts_streamer, pinned pointers)"""
    o, tier, model, cfg = b.options, b.tier, b.model, b.lm.config
    streams = o.prefill in ("auto", "stream")
    colds = {l: c for l, (_, c) in parts.items() if c.n and not c.quantized}  # quantised: never streamed
    colds.update({l: mp.cold for l, mp in moe_parts.items() if mp.cold is not None and not mp.cold.quantized})
    streamer = ColdStreamer(tier, colds, sorted(colds), o.stream_slots_bytes) if colds and streams else None
    costs = o.costs or PrefillCosts()
    gemm = [c for _, c in parts.values() if c.n and c.gemm_ready]
    if costs.cpu_flops is None and o.prefill == "auto" and gemm:  # the "dense" regime's rate, in the rows' dtype
        costs = dataclasses.replace(costs, cpu_flops=measure_cpu_flops(torch_view(gemm[0].up).dtype,
                                                                       cfg.hidden_size, b.threads))
    qcolds = {l: mp.cold for l, mp in moe_parts.items() if streamable(mp.cold)}
    experts_streamer = ExpertStreamer(tier, qcolds, cfg.hidden_size, o.expert_stream_bytes) \
        if qcolds and streams and (tier.cuda or o.prefill == "stream") else None
    pinned: list[int] = []
    with b.times.stage("pin"):
        if tier.cuda and (o.pin_cold if o.pin_cold is not None else True):  # what streams, page-locked
            for c in [*(colds.values() if streamer else ()), *(qcolds.values() if experts_streamer else ())]:
                pinned += pin_host(c)
    prefill_io = HostRows(tier.host_empty, cfg.hidden_size, 0)
    hybrid: dict[int, HybridFFN] = {}
    for l, (gpu, cold) in parts.items():
        hybrid[l] = model.layers[l].ffn = HybridFFN(l, gpu, cold, b.cpu, tier, b.book, prefill_io, streamer,
                                                    o.prefill, costs)
    moe: dict[int, HybridMoE] = {}
    routing = HostRouting(tier.host_empty, cfg.top_k, 0) if moe_parts else None
    for l, mp in moe_parts.items():
        moe[l] = model.layers[l].ffn = HybridMoE(l, mp, b.cpu, tier, b.book, prefill_io, routing,
                                                 experts_streamer if l in qcolds else streamer, o.prefill, costs)
    every = {**hybrid, **moe}
    if every:
        every[min(every)].first = True
    return hybrid, moe, streamer, experts_streamer, pinned


def _wrap_steps(b: _Build, hybrid: dict[int, HybridFFN], moe: dict[int, HybridMoE]) -> None:
    """How each block's one-token step runs: host nodes inside the split layers' graphs, HostBlocks
    for the blocks whose attention and predictor are on the CPU, CUDA graphs over the rest."""
    o, tier = b.options, b.tier
    graphs = tier.cuda and o.per_layer_graphs  # on a CPU tier nothing is captured
    for m in moe.values():
        m.host_nodes = bool(o.host_nodes and o.per_layer_graphs)
        m.defer = bool(m.host_nodes and o.defer_experts)
    for h in hybrid.values():
        h.host_nodes = bool(o.dense_host_nodes and o.per_layer_graphs)
    if o.host_blocks:  # before graph_blocks, which wraps only the plain Blocks left
        with b.times.stage("kernels"):
            host_blocks(b.model, node=o.layer_nodes, graphs=graphs and o.layer_graphs)
    if tier.cuda and o.cuda_graphs:
        with b.times.stage("graphs"):
            graph_blocks(b.model, ffn=o.cuda_graphs != "attention",
                         step="host" if o.cuda_graphs == "step" else o.cuda_graphs is True)


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


__all__ = ["HybridEngine", "build_engine", "make_hybrid", "random_hot"]
