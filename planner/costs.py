"""The cost model: bytes and expected seconds per decode step of every placeable unit of a model.

Units (what the planner places):
  per layer   the attention block with its KV cache (also the router and shared expert of MoE layers,
              the layer's norms and biases), the predictor (dense/gated layers), and the FFN as
              neuron *blocks* in frequency order (dense/gated) or as experts (MoE);
  per model   the lm_head (GPU or CPU); the embedding table always stays on the CPU (a row lookup).

Time of one decode step (batch B tokens, all on the hybrid runtime of docs/architecture.md), per layer l:

    t_l = attention part + predictor part + u_l + LAYER_OVERHEAD
    attention part = A_gpu                            if attention on the GPU
                   = A_cpu + sync                     else (x goes to the CPU and back)
    u_l >= GPU FFN time = launches (if any GPU unit) + sum of GPU units' time + hybrid launches (if any CPU unit)
    u_l >= CPU FFN time = sum of CPU units' expected time + call + sync (if any CPU unit)

The GPU and CPU halves of the FFN overlap (u_l is their max); attention runs before them. Sync is a
small round trip (copy x [and the mask] down, the CPU's partial result up, synchronise) plus one
Python thread hand-off; it is paid once per CPU segment of a layer, only when that layer has CPU work.

  * GPU FFN rows are computed densely: every GPU-resident row of a dense/gated layer is read every
    step (a masked dense product over the hot slice; cheaper than gathering at GPU bandwidth and what
    the GPU executor does). GPU experts are read only when routed (probability expert_freq), all of a
    token's routed GPU experts by one pair of kernels: a fixed number of launches per MoE layer.
  * CPU rows are read only when predicted active: a neuron with activation frequency f costs
    P(active in at least one of B tokens) = 1 - (1 - f')^B rows, f' = f inflated by the predictor's
    over-selection (profile.json `predicted_active_fraction` / mean f) when predictor stats exist.
    CPU experts are computed densely when routed.
  * Bytes are read at the measured rate of the kernel the runtime uses: `ffn_rows` for CPU FFN rows
    (and float experts), `qexperts` for quantised experts (the probe's cpu_expert_Bps), `gemv`
    (dense) for CPU attention, predictors and lm_head, GPU GEMV for the GPU.
  * The predictor of a layer is needed only when its FFN has CPU work (an all-GPU layer computes its
    hot slice densely); on the GPU if the attention is, and otherwise on either side (the planner
    chooses: on the GPU it takes GPU memory but no round trip, since the FFN's input is back there).
  * KV cache: 2 x kv_heads x head_dim x ctx (or the sliding window) x B values per layer, stored
    with the attention; a step reads on average half of the context.
  * All-CPU plans (no CUDA, or --vram 0) pay no sync; all-GPU plans need no predictors. Their layers
    run the one-token CPU step, whose fixed costs the probe measures (planner/probe_step.py): per
    layer (`cpu_layer_s`, in place of counted calls and the layer overhead) and per matrix product
    read whole (`cpu_matrix_fixed_s`: q/k/v and o, each FFN matrix when every row is computed, the head),
    and they sample each token on the CPU (`cpu_sample_s` + vocabulary x `cpu_sample_logit_s`, in fixed_s).

Every constant is in `Constants` below, with its unit; the runtime compares predicted and measured
times against these (plan.json records them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from hotcold.planner.hardware import HardwareProfile
from hotcold.planner.sizes import MiB
from hotcold.planner.weight_format import (FORMATS, INT4_EXPERT_SPEED, INT4_GPU_BYTES_PER_WEIGHT, INT4_GPU_SPEED,
                                           WeightFormat)


@dataclass(frozen=True)
class Constants:
    """Every constant of the cost model. Times in seconds, sizes in bytes, counts are kernel launches
    or Python kernel calls per decode step."""

    # GPU memory the plan keeps free of weights
    workspace_bytes: int = 256 * MiB  # bytes: activations, logits, torch allocator slack (plus per-token below)
    workspace_per_token_bytes_factor: int = 16  # bytes x (hidden + ffn + vocab) per batch token (float32 temporaries)
    cuda_context_bytes: int = 512 * MiB  # bytes: CUDA context + cuBLAS workspace + kernels, when the probe has no figure
    stream_slots_bytes: int = 128 * MiB  # bytes: the two slots prefill streams cold weights through (at most two FFN layers)
    expert_stream_bytes: int = 128 * MiB  # bytes: prefill's streamed host experts (executors/expert_stream.py;
    #   `hotcold plan` sets it from the budget: expert_stream_budget)
    chunk_tokens: int = 1024  # a prompt chunk's tokens (models.generate.PREFILL_CHUNK)
    chunk_block: int = 16  # (token, expert) pairs a block of the GPU experts' chunk kernels (moe_chunk_gpu.BLOCK_M)
    expert_cache_bytes: int = 0  # bytes: the MoE expert cache's slice (`hotcold plan --expert-cache`; MoE models only)
    host_reserve_bytes: int = 1 << 30  # bytes of host RAM for Python, torch, pinned buffers, tokenizer
    # kernel launches on the GPU (each costs `launch_s` from the hardware profile)
    attn_gpu_kernels: int = 12  # norm, q/k/v, rope x2, cache write, sdpa, o, residual, ...
    ffn_gpu_kernels: int = 5  # norm, gate+up, act*mul, down, residual (dense/gated FFN with any GPU rows)
    moe_gpu_kernels: int = 3  # a MoE layer with GPU experts: gate+up+act, down, add (every routed GPU
    #                           expert of a token in one pair of kernels: sparse_ops/moe_gpu.py)
    hybrid_gpu_kernels: int = 4  # a layer with CPU work: D2H copy, wait, H2D copy, add
    predictor_gpu_kernels: int = 3  # two small matmuls and a threshold
    head_gpu_kernels: int = 3  # final norm, lm_head, sampling
    # Python-level kernel calls on the CPU (each costs `cpu_call_s`)
    attn_cpu_calls: int = 8
    ffn_cpu_calls: int = 1  # one fused ffn_rows call
    expert_cpu_calls: int = 1  # per routed CPU expert
    predictor_cpu_calls: int = 2
    head_cpu_calls: int = 2
    # sizes
    predictor_fraction: float = 0.05  # predictor bytes / FFN weight bytes, when profile.json has no predictor params
    predictor_bytes_per_param: float = 2.0  # bytes (fp16 predictor weights)
    predictor_host_bytes_per_param: float = 34 / 32  # a CPU predictor's Q8_0 blocks (executors/gpu_executor.py)
    transfer_bytes_per_value: int = 4  # bytes: activations cross PCIe as float32
    mask_bytes_per_neuron: float = 1.0  # bytes: the predicted-active mask sent to the CPU (uint8)
    # fixed overheads, the same in every plan (they set absolute tokens/s, never the choice)
    step_overhead_s: float = 150e-6  # s per decode step: embedding lookup, sampling, Python
    layer_overhead_s: float = 15e-6  # s per layer: Python dispatch of the layer's modules

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def expert_stream_budget(vram_bytes: int) -> int:
    """GPU bytes for prefill's streamed host experts under a `vram_bytes` budget: a 16th of it, within
    128-512 MiB. A bigger workspace streams bigger groups, fewer launches a chunk: on the H100 host a
    512-token chunk of 28 Qwen3-30B-A3B-shaped layers took 435 ms with 128 MiB (9 experts a group,
    bound by the host's launches) and 199 ms with 512 MiB (36, bound by PCIe); those 384 MiB held ~136 of
    the 8 GiB plan's 2,173 resident experts, its coldest: about 7 of a token's 384 routings."""
    return int(min(max(vram_bytes // 16, 128 * MiB), 512 * MiB))


@dataclass
class LayerStats:
    """What the profile says about one layer: access probabilities per neuron or expert."""

    kind: str  # gated | dense | moe
    freq: np.ndarray  # float64 [I] neuron activation frequency, or [E] expert routing frequency
    predictor_params: int | None = None
    predicted_active_fraction: float | None = None
    # False when the profile's predictors raised held-out perplexity beyond its budget: the layer's
    # CPU rows are then all computed, exactly, and the cost model asks no predictor
    predictor_allowed: bool = True


@dataclass
class LayerCosts:
    """Bytes and expected seconds per step of one layer's units (see the module docstring)."""

    layer: int
    kind: str
    order: np.ndarray  # int64 neuron (or expert) ids, hottest first
    starts: np.ndarray  # int64 [K+1]: unit k is order[starts[k]:starts[k+1]]
    unit_bytes: np.ndarray  # [K] weight bytes on the GPU
    unit_gpu_s: np.ndarray  # [K] seconds per step when on the GPU
    unit_cpu_s: np.ndarray  # [K] expected seconds per step when on the CPU
    unit_freq: np.ndarray  # [K] mean access probability of the unit (greedy's key)
    attn_bytes: float  # weights placed with the attention
    kv_bytes: float  # KV cache for the requested context and batch
    attn_gpu_s: float
    attn_cpu_s: float
    attn_sync_s: float  # extra when the attention is on the CPU in a hybrid plan
    pred_bytes: float  # 0 for MoE layers
    pred_gpu_s: float
    pred_cpu_s: float
    ffn_gpu_fixed_s: float  # launches when any unit (neuron block or expert) is on the GPU
    ffn_cpu_fixed_s: float  # calls when any unit is on the CPU
    hybrid_gpu_s: float  # GPU-side extra when the layer has CPU FFN work (hybrid plans)
    ffn_sync_s: float  # CPU-side sync when the layer has CPU FFN work (hybrid plans)
    # a CPU predictor's round trip in a hybrid plan: the FFN's input down, the mask up, a hand-off
    # (its input is on the GPU after the attention, wherever that ran)
    pred_sync_s: float = 0.0
    unit_host_bytes: np.ndarray | None = None  # [K] weight bytes in host memory (None: unit_bytes)
    attn_host_bytes: float | None = None  # attention weights in host memory (None: attn_bytes)
    pred_host_bytes: float | None = None  # the predictor in host memory (None: pred_bytes)
    # with every unit on the GPU, the FFN kept int4 whole (WeightFormat.whole_int4): its GPU bytes and
    # seconds per step replace the units' sums (None: the units' sums apply)
    whole_bytes: float | None = None
    whole_gpu_s: float | None = None
    # [K] seconds per step when the CPU computes every row of the unit, no predictor asked (None:
    # unit_cpu_s; MoE experts run whole when routed either way)
    unit_all_cpu_s: np.ndarray | None = None
    all_cpu_fixed_s: float = 0.0  # extra seconds when every CPU row is computed: its products' fixed costs
    predictor_allowed: bool = True  # LayerStats.predictor_allowed
    # the KV cache read: seconds per step per cached position on either side (in attn_*_s for
    # kv_pos positions: half the planned context, at most the kv_len positions the cache holds), so a
    # run can set the prediction beside its own context length
    kv_pos_gpu_s: float = 0.0
    kv_pos_cpu_s: float = 0.0
    kv_len: int = 0
    kv_pos: int = 0

    def __post_init__(self):
        if self.unit_host_bytes is None:
            self.unit_host_bytes = self.unit_bytes
        if self.attn_host_bytes is None:
            self.attn_host_bytes = self.attn_bytes
        if self.pred_host_bytes is None:
            self.pred_host_bytes = self.pred_bytes
        if self.unit_all_cpu_s is None:
            self.unit_all_cpu_s = self.unit_cpu_s

    @property
    def n_units(self) -> int:
        return len(self.unit_bytes)

    @property
    def n_items(self) -> int:
        return len(self.order)


@dataclass
class ModelCosts:
    """The whole model's units, ready for the ILP, greedy and evaluation."""

    layers: list[LayerCosts]
    head_bytes: float
    head_gpu_s: float
    head_cpu_s: float
    head_sync_s: float
    tied: bool  # lm_head shares the embedding table (no extra host bytes when the head is on the CPU)
    embed_bytes: float  # host bytes always (embedding table, positions)
    workspace_bytes: float  # GPU bytes always in hybrid and GPU plans
    host_reserve_bytes: float
    fixed_s: float  # per-step time common to every plan
    has_gpu: bool
    constants: Constants = field(default_factory=Constants)
    block_size: int = 0
    batch: int = 1
    ctx: int = 0
    fmt: WeightFormat = FORMATS["bf16"]
    moe_gpu_bytes: float = 0.0  # MoE routers + shared experts, on the GPU in hybrid and GPU plans
    moe_cpu_delta_s: float = 0.0  # extra time when an all-CPU plan computes them on the CPU
    expert_cache_bytes: float = 0.0  # the MoE expert cache's slice (hybrid plans)
    head_host_bytes: float | None = None  # lm_head in host memory (None: head_bytes)

    def __post_init__(self):
        if self.head_host_bytes is None:
            self.head_host_bytes = self.head_bytes

    @property
    def gpu_fixed_bytes(self) -> float:
        """GPU bytes every plan that uses the GPU holds whatever it places: workspace (+ context,
        stream slots) and the MoE routers and shared experts."""
        return self.workspace_bytes + self.moe_gpu_bytes + self.expert_cache_bytes


# ------------------------------------------------------------------------------------------- building
def auto_block_size(num_layers: int, n_neurons: int, target_total: int = 8192) -> int:
    """Neurons per block: about target_total blocks over the model, 16..128 per layer, multiple of 8."""
    per_layer = max(16, min(128, target_total // max(1, num_layers)))
    return max(8, int(math.ceil(n_neurons / per_layer / 8)) * 8)


def _attention_weights(cfg, layer: int, moe_parts: bool = True) -> float:
    """Weights (count) stored with a layer's attention: projections, biases, norms; with moe_parts,
    the MoE router and shared expert (a plan with a GPU keeps those there: see _moe_gpu_weights)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    n = h * (2 * q + 2 * kv)
    if cfg.attn_bias:
        n += q + 2 * kv + h
    n += 4 * h + 2 * hd  # norms (attention, FFN, sandwich) and QK-norm, at most
    if cfg.ffn_kind(layer) == "dense":
        n += h  # down bias of OPT
    if moe_parts:
        n += _moe_gpu_weights(cfg, layer)
    return float(n)


def _moe_gpu_weights(cfg, layer: int) -> float:
    """Weights (count) of a MoE layer's router and shared expert (+ its gate); 0 for other layers.
    The runtime keeps them on the GPU whenever a plan uses one (executors/moe.py)."""
    if cfg.ffn_kind(layer) != "moe":
        return 0.0
    h = cfg.hidden_size
    n = h * cfg.num_experts
    s = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    if s:
        n += 3 * h * s + h
    return float(n)


def _dense_ffn_bytes(cfg) -> float:
    """Weights (count) of the largest dense/gated FFN layer (0 for MoE-only models): what prefill streams."""
    sizes = [(3 if cfg.ffn_kind(l) == "gated" else 2) * cfg.hidden_size * cfg.intermediate_size
             for l in range(cfg.num_layers) if cfg.ffn_kind(l) in ("dense", "gated")]
    return float(max(sizes, default=0))


def _kv_len(cfg, layer: int, ctx: int) -> int:
    if cfg.sliding_window and cfg.is_sliding(layer):
        return min(ctx, cfg.sliding_window)
    return ctx


def build_costs(cfg, stats: list[LayerStats], hw: HardwareProfile, fmt: WeightFormat, ctx: int, batch: int = 1,
                block_size: int = 0, constants: Constants | None = None) -> ModelCosts:
    """The cost of every unit of the model on this hardware. block_size 0: `auto_block_size`."""
    c = constants or Constants()
    B = max(1, int(batch))
    h = cfg.hidden_size
    w, wh, wf = fmt.bytes_per_weight, fmt.host_w, fmt.host_ffn_w  # bytes per weight: GPU, host, host FFN
    has_gpu = bool(hw.cuda and hw.gpu_gemv_Bps)
    gbw = hw.gpu_gemv_Bps if has_gpu else math.inf
    launch = (hw.launch_s or 0.0) if has_gpu else 0.0
    rt = (hw.roundtrip_s or 0.0) if has_gpu else 0.0
    pcie = hw.pcie_Bps() if has_gpu else math.inf
    ffn_bps = hw.cpu_ffn(fmt.cpu_kind)
    expert_bps = hw.cpu_expert(fmt.cpu_kind)  # whole experts (quantised: qexperts; float: the FFN kernel)
    dense_bps = hw.cpu_dense(fmt.cpu_kind)
    pred_bps = hw.cpu_dense("q8_0")  # a CPU predictor's Q8_0 blocks (profiles without q8_0 rates: their float one)
    call = hw.cpu_call_s
    handoff = hw.thread_handoff_s
    # an all-CPU plan's layers run the one-token CPU step: its measured fixed costs per layer and per
    # matrix product replace the counts of calls (None: not measured, the counts apply)
    layer_fixed = hw.cpu_layer_s if not has_gpu else None
    matrix_fixed = (hw.cpu_matrix_fixed_s or 0.0) if layer_fixed is not None else 0.0
    # a MoE block of an all-CPU plan pays more than a fused dense one: its routing in torch between its
    # attention's and its experts' calls (measured the same way; 0 when not measured)
    moe_layer_fixed = max(0.0, hw.cpu_moe_layer_s - layer_fixed) \
        if layer_fixed is not None and hw.cpu_moe_layer_s is not None else 0.0
    # an all-CPU plan samples each token on the CPU too, over the whole vocabulary (a GPU's sampling
    # overlaps its next step)
    sample_s = (hw.cpu_sample_s + cfg.vocab_size * hw.cpu_sample_logit_s) \
        if layer_fixed is not None and hw.cpu_sample_s is not None and hw.cpu_sample_logit_s is not None else 0.0
    tv = c.transfer_bytes_per_value
    if not block_size:
        block_size = auto_block_size(cfg.num_layers, cfg.intermediate_size)
    layers = []
    moe_gpu_bytes = 0.0  # routers and shared experts: on the GPU in every plan that uses one
    moe_cpu_delta_s = 0.0
    for l, st in enumerate(stats):
        kind = st.kind
        whole_bytes = whole_gpu_s = None
        freq = np.clip(np.asarray(st.freq, dtype=np.float64), 0.0, 1.0)
        order = np.argsort(-freq, kind="stable").astype(np.int64)
        f_sorted = freq[order]
        # attention
        kv_len = _kv_len(cfg, l, ctx)
        kv_elem = 2 * cfg.num_kv_heads * cfg.head_dim * fmt.kv_bytes * B
        kv_bytes = float(kv_elem * kv_len)
        kv_pos = min(kv_len, max(1, ctx // 2))
        kv_read = float(kv_elem * kv_pos)
        attn_weights = _attention_weights(cfg, l, moe_parts=not has_gpu)
        attn_bytes, attn_host_bytes = attn_weights * fmt.gpu_attn_w, attn_weights * wh
        attn_gpu_s_extra = 0.0
        if has_gpu:  # router and shared expert on the GPU wherever the attention is: the same time either way
            mb = _moe_gpu_weights(cfg, l) * w
            moe_gpu_bytes += mb
            attn_gpu_s_extra = mb / gbw
            moe_cpu_delta_s += mb / dense_bps - mb / gbw  # an all-CPU plan computes them on the CPU
        attn_gpu_s = (attn_bytes / fmt.gpu_attn_speed + kv_read) / gbw + c.attn_gpu_kernels * launch
        kv_cpu_bps = hw.cpu_dense("f32" if fmt.kv_bytes == 4 else "bf16")
        attn_cpu_s = attn_host_bytes / dense_bps + kv_read / kv_cpu_bps \
            + (c.attn_cpu_calls * call if layer_fixed is None else layer_fixed + 2 * matrix_fixed)
        attn_gpu_s += attn_gpu_s_extra
        attn_cpu_s += attn_gpu_s_extra
        attn_sync_s = rt + 2 * B * h * tv / pcie + handoff
        if kind == "moe":
            n_items = cfg.num_experts
            inter = cfg.moe_intermediate_size
            gu4, dn4 = fmt.experts_int4(l)
            gu_w, dn_w = (INT4_GPU_BYTES_PER_WEIGHT if q4 else w for q4 in (gu4, dn4))
            eb = h * inter * (2 * gu_w + dn_w) + 3 * inter * fmt.row_overhead_bytes
            eb_t = h * inter * sum(x / (INT4_EXPERT_SPEED if q4 else 1.0) for x, q4 in
                                   ((2 * gu_w, gu4), (dn_w, dn4))) + 3 * inter * fmt.row_overhead_bytes
            eb_host = 3 * h * inter * wf + 3 * inter * fmt.row_overhead_bytes
            starts = np.arange(n_items + 1, dtype=np.int64)
            q = 1.0 - (1.0 - np.minimum(1.0, f_sorted)) ** B  # routed for at least one token of the batch
            unit_bytes = np.full(n_items, eb)
            unit_host_bytes = np.full(n_items, eb_host)
            unit_gpu_s = q * eb_t / gbw  # a routed GPU expert costs its bytes: no launches of its own
            unit_cpu_s = unit_all_cpu_s = q * (eb_host / expert_bps + c.expert_cpu_calls * call)
            unit_freq = f_sorted.copy()
            pred_bytes = pred_host_bytes = pred_gpu_s = pred_cpu_s = 0.0
            ffn_gpu_fixed_s = c.moe_gpu_kernels * launch
            ffn_cpu_fixed_s, all_cpu_fixed_s = moe_layer_fixed, 0.0
            mask_bytes = B * cfg.top_k * 8
        else:
            n_items = len(freq)
            n_mats = 3 if kind == "gated" else 2
            extra = n_mats * fmt.row_overhead_bytes + (w if kind == "dense" else 0.0)  # + up bias
            ug, dn = (n_mats - 1) * h * fmt.gpu_ffn_w, h * fmt.gpu_down_w  # up (+ gate) row, W_down column
            rb = ug + dn + extra
            rb_t = ug / fmt.gpu_ffn_speed + dn / fmt.gpu_down_speed + extra  # bytes at the dtype's GEMV rate
            rb_host = n_mats * h * wf + extra
            infl = 1.0
            if st.predicted_active_fraction and freq.mean() > 0:
                infl = max(1.0, st.predicted_active_fraction / freq.mean())
            q = 1.0 - (1.0 - np.minimum(1.0, f_sorted * infl)) ** B
            starts = np.append(np.arange(0, n_items, block_size), n_items).astype(np.int64)
            rows = np.diff(starts).astype(np.float64)
            unit_bytes = rows * rb
            unit_host_bytes = rows * rb_host
            unit_gpu_s = rows * rb_t / gbw
            exp_rows = np.add.reduceat(q, starts[:-1])
            unit_cpu_s = exp_rows * rb_host / ffn_bps
            unit_all_cpu_s = rows * rb_host / ffn_bps
            unit_freq = np.add.reduceat(f_sorted, starts[:-1]) / rows
            if st.predictor_params is not None:
                pred_bytes = float(st.predictor_params) * c.predictor_bytes_per_param
            else:
                pred_bytes = c.predictor_fraction * n_items * (n_mats * h * w + extra)  # of the FFN in the dtype
            pred_host_bytes = pred_bytes * c.predictor_host_bytes_per_param / c.predictor_bytes_per_param
            pred_gpu_s = pred_bytes / gbw + c.predictor_gpu_kernels * launch
            pred_cpu_s = pred_host_bytes / pred_bps + c.predictor_cpu_calls * call
            if not st.predictor_allowed:  # every CPU row computed: no predictor to place or pay for
                unit_cpu_s = unit_all_cpu_s
                pred_bytes = pred_host_bytes = pred_gpu_s = pred_cpu_s = 0.0
            ffn_gpu_fixed_s = c.ffn_gpu_kernels * launch
            ffn_cpu_fixed_s = c.ffn_cpu_calls * call
            all_cpu_fixed_s = n_mats * matrix_fixed  # every row computed: one product per matrix
            mask_bytes = n_items * c.mask_bytes_per_neuron
            if fmt.whole_int4(l):  # every matrix at int4's bytes and speed
                whole_bytes = n_items * (n_mats * h * INT4_GPU_BYTES_PER_WEIGHT + extra)
                whole_gpu_s = n_items * (n_mats * h * INT4_GPU_BYTES_PER_WEIGHT / INT4_GPU_SPEED + extra) / gbw
        layers.append(LayerCosts(
            layer=l, kind=kind, order=order, starts=starts, unit_bytes=np.asarray(unit_bytes, dtype=np.float64),
            unit_gpu_s=np.asarray(unit_gpu_s, dtype=np.float64), unit_cpu_s=np.asarray(unit_cpu_s, dtype=np.float64),
            unit_freq=np.asarray(unit_freq, dtype=np.float64), attn_bytes=attn_bytes, kv_bytes=kv_bytes,
            attn_gpu_s=attn_gpu_s, attn_cpu_s=attn_cpu_s, attn_sync_s=attn_sync_s if has_gpu else 0.0,
            pred_bytes=pred_bytes, pred_gpu_s=pred_gpu_s, pred_cpu_s=pred_cpu_s, ffn_gpu_fixed_s=ffn_gpu_fixed_s,
            ffn_cpu_fixed_s=ffn_cpu_fixed_s, hybrid_gpu_s=c.hybrid_gpu_kernels * launch,
            ffn_sync_s=(rt + (2 * B * h * tv + mask_bytes) / pcie + handoff) if has_gpu else 0.0,
            pred_sync_s=(rt + (B * h * tv + mask_bytes) / pcie + handoff) if has_gpu and pred_bytes else 0.0,
            unit_host_bytes=np.asarray(unit_host_bytes, dtype=np.float64), attn_host_bytes=attn_host_bytes,
            pred_host_bytes=pred_host_bytes, whole_bytes=whole_bytes, whole_gpu_s=whole_gpu_s,
            unit_all_cpu_s=np.asarray(unit_all_cpu_s, dtype=np.float64), all_cpu_fixed_s=all_cpu_fixed_s,
            predictor_allowed=st.predictor_allowed,
            kv_pos_gpu_s=kv_elem / gbw, kv_pos_cpu_s=kv_elem / kv_cpu_bps, kv_len=int(kv_len), kv_pos=int(kv_pos)))
    # kept as the dtype (often the file's widest type, Q6_K), or int4 (a tied head is the embedding's table)
    head_int4 = fmt.gpu_head_int4 and not cfg.tie_word_embeddings
    head_w, head_speed = (INT4_GPU_BYTES_PER_WEIGHT, INT4_GPU_SPEED) if head_int4 else (w, 1.0)
    head_bytes = float(cfg.vocab_size * h * head_w)
    head_host_bytes = float(cfg.vocab_size * h * (fmt.host_embed_w if cfg.tie_word_embeddings else wh))
    embed_bytes = float(cfg.vocab_size * h * fmt.host_embed_w)
    if cfg.model_type == "opt":
        embed_bytes += (cfg.max_position_embeddings + 2) * h * w
    workspace = c.workspace_bytes + B * c.workspace_per_token_bytes_factor * (
        h + max(cfg.intermediate_size, getattr(cfg, "moe_intermediate_size", 0) or 0) + cfg.vocab_size)
    if has_gpu:  # the process's own GPU memory outside the weights: inside the --vram budget too
        ctx_bytes = hw.gpu_context_bytes if hw.gpu_context_bytes is not None else c.cuda_context_bytes
        workspace += ctx_bytes + min(c.stream_slots_bytes, 2 * _dense_ffn_bytes(cfg) * w)
        if cfg.num_kv_heads != cfg.num_heads:  # a prompt chunk's keys and values repeated to the query's heads
            workspace += 2 * cfg.num_heads * ctx * cfg.head_dim * fmt.kv_bytes  # (Attention._attend_chunk)
        if fmt.host_ffn_bytes_per_weight is not None and any(cfg.ffn_kind(l) == "moe" for l in range(cfg.num_layers)):
            # quantised host experts stream for prefill: two raw slots and the decoded group, at most all experts
            expert = 3 * h * cfg.moe_intermediate_size * (2 * wf + w)
            workspace += min(c.expert_stream_bytes, cfg.num_experts * expert)
        if any(cfg.ffn_kind(l) == "moe" for l in range(cfg.num_layers)):
            # a prompt chunk's GPU experts (moe_chunk_gpu.workspace_bytes): act(g) * u of every padded
            # (token, expert) pair in the dtype, each pair's float32 row and their sum, the index arrays
            P, E = min(c.chunk_tokens, ctx) * cfg.top_k, cfg.num_experts  # (no chunk outgrows the context)
            padded = -(-(P + min(E, P) * (c.chunk_block - 1)) // c.chunk_block) * c.chunk_block
            workspace += (padded * cfg.moe_intermediate_size * w + (P + P // cfg.top_k) * h * 4 + 7 * P * 8
                          + padded * 4)
    return ModelCosts(
        layers=layers, head_bytes=head_bytes,
        head_gpu_s=head_bytes / head_speed / gbw + c.head_gpu_kernels * launch,
        head_cpu_s=head_host_bytes / dense_bps + c.head_cpu_calls * call + matrix_fixed, head_host_bytes=head_host_bytes,
        head_sync_s=(rt + B * h * tv / pcie + handoff) if has_gpu else 0.0,
        tied=bool(cfg.tie_word_embeddings), embed_bytes=embed_bytes, workspace_bytes=float(workspace),
        moe_gpu_bytes=moe_gpu_bytes, moe_cpu_delta_s=moe_cpu_delta_s,
        expert_cache_bytes=float(c.expert_cache_bytes) if has_gpu and moe_gpu_bytes else 0.0,
        host_reserve_bytes=float(c.host_reserve_bytes),
        fixed_s=c.step_overhead_s + cfg.num_layers * (c.layer_overhead_s if layer_fixed is None else 0.0)
        + sample_s,
        has_gpu=has_gpu, constants=c, block_size=block_size, batch=B, ctx=ctx, fmt=fmt)
