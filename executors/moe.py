"""HybridMoE: one mixture-of-experts layer split between the fast tier and the CPU worker.

The router, the shared expert (and its sigmoid gate) and the plan's GPU experts sit on the fast
tier; the other experts live in host memory stacked in one ColdFFN (gate, up, down transposed:
[E_cpu * I, D] each, one neuron per row, an expert's rows contiguous; quantised experts keep the
file's blocks, W_down untransposed [E_cpu * D, I], see `host_quant_experts`) for the numba kernels,
so a token's routed CPU experts are one kernel call (each expert scaled by its routing weight:
`ffn_rows` with row scales, or `qexperts`). For N tokens (decode: N = 1; prefill: the chunk):
  compute stream  x ─ router ─ w, ids ─┬─ shared expert ──── GPU experts of the routed ids ── y ─┐
  copy stream                          └─ D2H x, w, ids ─ event ┐                               + ─ y
  main thread                                  waits the event ─┼─ reads ids, queues GPU experts │
  CPU worker                                   waits the event ─┴─ cold experts ─ out ── H2D ────┘
The routing crosses to the host once: the worker computes each routed cold expert over its tokens
(scaled by the routing weights, summed into `out`), and the main thread reads the same ids to launch
only the routed GPU experts, so the fast tier never synchronises on data-dependent indexing. The
main thread blocks twice: on the routing copy (while the shared expert runs) and on the CPU result.
x is copied for every token (choosing the CPU-routed ones on the device would need a sync first).
One token on CUDA finds its fast-tier experts on the device (sparse_ops/moe_gpu.py), and so does a
chunk of tokens (sparse_ops/moe_chunk_gpu.py: every routed pair in two kernels), without the routing
sync: a layer with no host experts never waits for the host. With CUDA graphs the router and the
packed host input are replayed with the block's attention (`graph_pre`), the packed input goes down
(`graph_send`), the shared and fast-tier experts are replayed in a second graph (`graph_fast`) while
the CPU experts run (`graph_post`).
For a chunk of prompt tokens with a streamer (prefill.py), the routing reaches the host first and
`moe_prefill_regime` picks where the host experts run: on the CPU worker, or on the fast tier from
their rows streamed through the two slots (a long prompt routes tokens to nearly every expert, and
the worker would re-read each one per token tile); quantised experts stream as their blocks, decoded
on the fast tier (expert_stream.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hotcold.executors.cpu_executor import CPUExecutor, HostRows
from hotcold.executors.expert_stream import ExpertStreamer, Routes, group_products
from hotcold.executors.host_node import HostNode
from hotcold.executors.moe_host import HostRouting, MoEJob, routed
from hotcold.executors.moe_parts import MoEParts
from hotcold.executors.prefill import ColdStreamer, PrefillCosts, cpu_tokens_per_pass, moe_prefill_regime
from hotcold.executors.stats import StatsBook, now
from hotcold.executors.tier import FastTier
from hotcold.models.layers import FFN, route
from hotcold.sparse_ops.fused_gpu import MAX_EXPERTS, fused_ready, route_pack_cuda
from hotcold.sparse_ops.moe_chunk_gpu import chunk_experts, chunk_kernels_ready
from hotcold.sparse_ops.moe_gpu import routed_experts
from hotcold.sparse_ops.quant import check_expert_stacks, qexperts_routed


class Lookahead:
    """Names the experts the next MoE layer (`target`) will likely pick, from this layer's residual:
    `weight` [E, D] (the target's router, or the profile's corrected copy) applied after the
    target's FFN norm; the top m (m <= 4k) experts, on the fast tier."""

    def __init__(self, target: "HybridMoE", norm: nn.Module, weight: torch.Tensor, m: int):
        self.target, self.norm, self.weight, self.m = target, norm, weight, m

    def guess(self, residual: torch.Tensor | None) -> torch.Tensor | None:
        # residual: [.., D] -> int64 [m] expert ids, or None before the first residual
        if residual is None:
            return None
        r = residual.reshape(-1, residual.shape[-1])[-1:]  # [1, D]
        logits = self.norm(r) @ self.weight.T.to(r.dtype)  # [1, E]
        return logits.topk(self.m, dim=-1).indices[0]


# ---------------------------------------------------------------------------------------------
# The layer


class HybridMoE(FFN):
    """forward(x: [B, T, D]) -> [B, T, D], replacing a block's MoEFFN."""

    kind = "hybrid_moe"

    def __init__(self, layer: int, parts: MoEParts, cpu: CPUExecutor, tier: FastTier, book: StatsBook,
                 prefill_io: HostRows, prefill_routing: HostRouting | None = None,
                 streamer: ColdStreamer | ExpertStreamer | None = None, prefill: str = "auto",
                 costs: PrefillCosts | None = None):
        super().__init__()
        self.layer, self.cpu, self.tier, self.book = layer, cpu, tier, book
        self.router, self.shared, self.shared_gate = parts.router, parts.shared, parts.shared_gate
        self.fast, self.cold, self.pos = parts.fast, parts.cold, parts.pos
        self.top_k, self.renormalise = parts.top_k, parts.renormalise
        self.fast_bytes, self.host_bytes = parts.fast_bytes, parts.host_bytes
        self.n_cold = int((parts.pos >= 0).sum())
        self.slot_pos = np.full(len(parts.pos), -1, np.int64)  # expert id -> fast tier slot (-1: on the host)
        self.slot_pos[self.fast.ids] = np.arange(len(self.fast.ids))
        self.dim = self.router.in_features
        I = self.hidden = parts.hidden
        self.streamer, self.prefill, self.costs = streamer, prefill, costs or PrefillCosts()
        self.expert_rows = [np.arange(p * I, (p + 1) * I, dtype=np.int64) for p in range(self.n_cold)]
        self.row_scale = np.zeros(self.n_cold * I, np.float32)  # decode: routing weight per cold row
        self.decode_io = HostRows(tier.host_empty, self.dim, 1 if self.n_cold else 0)
        self.decode_routing = HostRouting(tier.host_empty, self.top_k, 1)
        self._packed_buffers(self.dim + 2 * self.top_k)
        self.prefill_io = prefill_io
        self.prefill_routing = prefill_routing or HostRouting(tier.host_empty, self.top_k, 0)
        self.first = False  # the engine's first hybrid layer counts tokens
        # the expert cache (decode): set by make_hybrid. `ahead` names the next MoE layer's experts
        self.cache = None  # ExpertCache shared by the MoE layers
        self.ahead: Lookahead | None = None
        self.residual: torch.Tensor | None = None  # this layer's residual [.., D], set by a hook on its FFN norm
        self.named: set = set()  # experts of this layer the previous layer's look-ahead named (this step)
        self.ahead_target = False  # a previous layer's look-ahead names this layer's experts
        self._sent = None  # CUDA event of a graphed step's packed input copy (graph_send)
        self._y_cpu = None  # device float32 [1, D]: a decode step's CPU sum, copied in (_receive)
        self._graph_job: MoEJob | None = None  # a graphed decode step's job, reused (graph_post)
        self.host_nodes = False  # a graphed decode step may be one graph, the CPU experts a host node (make_hybrid)
        self.defer = False  # ... and those CPU experts may join the next layer's graph (expert deferral)
        self._node: HostNode | None = None
        self._y_node: torch.Tensor | None = None  # device float32 [1, D]: the host node's sum, copied in
        if self.n_cold and self.cold.down is not None:  # whole quantised experts: checked once, see MoEJob
            check_expert_stacks(self.cold.gate, self.cold.up, self.cold.down, self.cold.act)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, gpu_experts={len(self.fast.ids)}, cpu_experts={self.n_cold}, top_k={self.top_k}"

    def _packed_buffers(self, n: int) -> None:
        """The host buffer of a graphed step's packed input, int32 [n]: x (float32 bits) [D], routing
        weights (float32 bits) [k], expert ids [k], then the look-ahead's guess [n - D - 2k]; numpy
        views of its parts."""
        self.packed = self.tier.host_empty((n,), torch.int32)
        p, D, k = self.packed.numpy(), self.dim, self.top_k
        self.packed_x, self.packed_w = p[:D].view(np.float32)[None], p[D:D + k].view(np.float32)[None]
        self.packed_ids, self.packed_named = p[D + k:D + 2 * k][None], p[D + 2 * k:]

    @property
    def buffer_bytes(self) -> int:
        return self.decode_io.nbytes + self.decode_routing.nbytes + self.row_scale.nbytes + self.packed.nbytes

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [N, D]
        n = x2.shape[0]
        phase = "decode" if n == 1 else "prefill"
        book, tier = self.book, self.tier
        if self.first:
            book.resolve()
            book.add(phase, tokens=n, forwards=1)
        g0 = tier.mark()
        weights, ids = route(self.router(x2), self.top_k, self.renormalise)  # [N, k] fp32, int64
        if self.cache is not None and n == 1:
            return self._forward_cached(x2, weights, ids, g0).reshape(shape)
        if n > 1 and self.n_cold and self._may_stream():
            return self._forward_prefill(x2, weights, ids, g0).reshape(shape)
        late = self.cpu.inline  # an inline job runs when submitted: queue the fast tier's work first
        routing, ready, job = self._send(x2, weights, ids, phase, submit=not late)
        y = self._shared(x2)  # [N, D]
        # one token on CUDA, or a chunk through the chunk kernels: the routing need not reach the host first
        device_side = tier.cuda and (n == 1 or self.chunk_kernels())
        if self.fast.ids and device_side:
            y = y + self._routed_fast(x2, weights, ids).to(y.dtype)
        elif self.fast.ids:
            w0 = now()
            if ready is not None:
                ready.synchronize()  # the routing on the host; the shared expert runs meanwhile
            book.add(phase, wait_s=now() - w0)
            y = self._gpu_experts(x2, weights, routing.ids_np[:n], y, phase)
        book.span(phase, "gpu_s", g0, tier.mark())
        book.add(phase, layer_calls=1)
        if job is not None:
            if late:
                self.cpu.submit(job)
            y = self._receive(job, y, phase)
        if self.fast.ids and device_side and book.enabled:  # count the fast tier's experts (the routing has landed
            ready.synchronize()  # by now: the worker waited for it, or the GPU is past it)
            book.add(phase, experts_gpu=int((self.pos[routing.ids_np[:n]] < 0).sum()))
        return y.reshape(shape)

    def host_decode(self, x: np.ndarray, out: np.ndarray) -> bool:
        """One token on host arrays (FFN.host_decode) where the whole layer is the CPU's (every expert a
        quantised host expert, no shared expert or expert cache, a CPU tier with an inline executor: an
        all-CPU plan), in the calling thread: forward's routing and MoEJob's one-token kernel call,
        without the job, copies and buffers a GPU tier needs (on 2 cores ~0.1 ms a layer)."""
        if (self.tier.cuda or not self.cpu.inline or self.fast.ids or self.cache is not None or self.shared is not None
                or not self.n_cold or self.cold.down is None):
            return False
        book, c = self.book, self.cold
        if self.first:
            book.resolve()
            book.add("decode", tokens=1, forwards=1)
        t0 = now()
        w = self.router.weight
        weights, ids = route(self.router(torch.from_numpy(x)[None].to(w.dtype)), self.top_k, self.renormalise)
        pairs = qexperts_routed(x, ids.numpy()[0], weights.numpy()[0], self.pos, c.gate, c.up, c.down, c.act, out)
        book.add("decode", layer_calls=1, cpu_s=now() - t0, experts_cpu=pairs)
        return True

    def _forward_cached(self, x2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, g0) -> torch.Tensor:
        """One token with the expert cache: routed host experts found in the cache run on the fast
        tier, the rest on the CPU, while the next MoE layer's likely experts are prefetched."""
        book, tier = self.book, self.tier
        ahead_ids = self.ahead.guess(self.residual) if self.ahead is not None else None  # [m] on the fast tier
        routing, ready, job = self._send(x2, weights, ids, "decode", submit=False, extra=ahead_ids)
        y = self._shared(x2)  # [1, D]
        w0 = now()
        if ready is not None:
            ready.synchronize()  # routing (and the look-ahead's guess) on the host
        book.add("decode", wait_s=now() - w0)
        routed_ids = routing.ids_np[0]
        if self.fast.ids and tier.cuda:
            y = y + self._routed_fast(x2, weights, ids).to(y.dtype)
            book.add("decode", experts_gpu=int((self.pos[routed_ids] < 0).sum()))
        elif self.fast.ids:
            y = self._gpu_experts(x2, weights, routing.ids_np[:1], y, "decode")
        named = None if ahead_ids is None else routing.extra_np[: len(ahead_ids)]
        y = self._cache_step(x2, weights, routed_ids, named, job, y)
        book.span("decode", "gpu_s", g0, tier.mark())
        if job is not None:
            if self.cpu.inline:
                self.cpu.submit(job)
            y = self._receive(job, y, "decode")
        return y

    def _cache_step(self, x2: torch.Tensor, weights: torch.Tensor, routed_ids: np.ndarray, named: np.ndarray | None,
                    job: "MoEJob | None", y: torch.Tensor) -> torch.Tensor:
        """The expert cache's part of one token, once its routing is on the host: the routed host
        experts found in the cache are queued on the fast tier (and skipped by the CPU job, which a
        worker gets now), the experts the look-ahead `named` for the next MoE layer are prefetched.
        x2, y: [1, D]; weights: [1, k] on the fast tier; routed_ids: [k] host. Returns y + the hits."""
        book, cache = self.book, self.cache
        routed_ids = [int(e) for e in routed_ids]
        host = [e for e in routed_ids if self.pos[e] >= 0]
        cache.pinned = {(self.layer, e) for e in host}
        for key in cache.pinned:
            cache.routed(key)
        slots = {e: cache.lookup((self.layer, e)) for e in host}
        hits = {e: slot for e, slot in slots.items() if slot is not None}  # expert -> cache slot
        if self.ahead_target:
            book.add("decode", lookahead_named=sum(e in self.named for e in host), lookahead_routed=len(host))
        if job is not None:
            job.skip = frozenset(hits)
            if not self.cpu.inline:  # an inline job runs when submitted: after the fast tier's work is queued
                self.cpu.submit(job)
        if named is not None:  # copies for the next layer start now, beside this layer's compute
            nxt = self.ahead.target
            nxt.named = {int(e) for e in named}
            for e in sorted(nxt.named):
                if nxt.pos[e] >= 0:
                    book.add("decode", experts_prefetched=int(cache.prefetch((nxt.layer, e), nxt.cold,
                                                                             nxt.expert_rows[nxt.pos[e]])))
        for e, slot in hits.items():
            gate, up, down_t = cache.weights(slot)
            h = self.fast.act(x2 @ gate.T) * (x2 @ up.T)  # [1, I]
            k = routed_ids.index(e)
            y = y + (h @ down_t) * weights[:, k, None].to(x2.dtype)
            cache.release(slot)
        book.add("decode", experts_gpu=len(hits), experts_cached=len(hits), layer_calls=1)
        cache.pinned = set()
        return y

    # ------------------------------------------------------------------ one token, its device half in a CUDA graph

    def graph_ready(self) -> bool:
        """Whether a one-token step may run split around CUDA graphs (graph_pre ... graph_post,
        executors/graphs.py): on CUDA."""
        return self.tier.cuda

    def device_only(self) -> bool:
        """On CUDA with every expert on the fast tier and no statistics (a MoE model run whole on a GPU)."""
        return self.tier.cuda and not self._host_half()

    def graph_pre(self, f_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router and the host's input packed in one tensor (graphs.py: captured with the
        attention half; with the expert cache, also the look-ahead's guess for the next MoE layer,
        from the static residual its hook captured). Device ops only. f_in: [1, 1, D] -> (packed
        int32 [D + 2k (+ m)]: see self.packed, routing weights float32 [1, k], ids int64 [1, k])."""
        x2 = f_in.reshape(1, -1)  # [1, D]
        logits = self.router(x2)  # [1, E]
        guess = self.ahead.guess(self.residual) if self.cache is not None and self.ahead is not None else None
        if fused_ready(logits) and logits.shape[-1] <= MAX_EXPERTS:  # one kernel instead of ~10
            packed, weights, ids = route_pack_cuda(logits, x2, self.top_k, self.renormalise,
                                                   0 if guess is None else guess.numel())
            if guess is not None:
                packed[self.dim + 2 * self.top_k:] = guess.to(torch.int32)  # [m]
            return packed, weights, ids
        weights, ids = route(logits, self.top_k, self.renormalise)  # [1, k] fp32, int64
        parts = [x2[0].float().view(torch.int32), weights[0].view(torch.int32), ids[0].to(torch.int32)]
        if guess is not None:
            parts.append(guess.to(torch.int32))  # [m]
        return torch.cat(parts), weights, ids

    def _host_half(self) -> bool:
        """Whether a one-token step has host work after the replays: CPU experts, the expert cache's
        step (it also prefetches for the next layer), or statistics."""
        return bool(self.cache is not None or self.n_cold or self.book.enabled)

    def graph_send(self, pre: tuple) -> object:
        """Queue the packed input's D2H copy (eager, between the two graphs, on the compute stream right
        behind the first graph: no stream switch, and one event per layer reused every step, since
        each torch call costs the host several µs); returns that event (None: no host half, or the
        CPU tier)."""
        packed = pre[0]
        if not self._host_half():
            return None
        if self.packed.numel() != packed.numel():  # the look-ahead's guess rides along
            self._packed_buffers(packed.numel())
        tier = self.tier
        t0 = tier.mark()
        self.packed.copy_(packed, non_blocking=True)
        self.book.span("decode", "transfer_s", t0, tier.mark())
        if not tier.cuda:
            return None
        if self._sent is None:
            self._sent = torch.cuda.Event()
        self._sent.record(tier.compute)  # waited for by this step's job before the next step records it again
        return self._sent

    def graph_fast(self, f_in: torch.Tensor, pre: tuple) -> torch.Tensor:
        """The shared expert and the routed fast-tier experts (graphs.py: the second graph).
        -> y [1, D] in the tier's dtype."""
        _, weights, ids = pre
        x2 = f_in.reshape(1, -1)
        y = self._shared(x2)
        if self.fast.ids:
            y = y + self._routed_fast(x2, weights, ids).to(y.dtype)
        return y

    def graph_post(self, f_in: torch.Tensor, y: torch.Tensor, pre: tuple, ready, marks=(None, None)) -> torch.Tensor:
        """The host half, once graph_send queued the packed input's copy: the routed host experts run
        on the CPU (or, found in the expert cache, on the fast tier), their sum comes back (one copy)
        and is added to y in place. marks: timing marks around the replays. -> [1, 1, D]."""
        book, cache = self.book, self.cache
        _, weights, _ = pre
        if self.first:
            book.resolve()
            book.add("decode", tokens=1, forwards=1)
        book.span("decode", "gpu_s", *marks)
        if cache is None:
            book.add("decode", layer_calls=1)
        if not self._host_half():
            return y.reshape(f_in.shape)
        job = None
        if self.n_cold:
            job = self._graph_job
            if job is None or job.x is not self.packed_x:  # (new packed buffers: the look-ahead's guess rides along)
                job = self._graph_job = MoEJob(self.cold, self.pos, self.expert_rows, self.row_scale, self.packed_x,
                                               self.packed_ids, self.packed_w, self.decode_io.out_np[:1], io=self.decode_io)
            job.again(ready)
        if cache is not None:
            w0 = now()
            if ready is not None:
                ready.synchronize()  # the cache's hits are decided on the host
            book.add("decode", wait_s=now() - w0)
            named = self.packed_named if len(self.packed_named) else None
            y = self._cache_step(f_in.reshape(1, -1), weights, self.packed_ids[0], named, job, y)
        if job is not None:
            if cache is None or self.cpu.inline:  # (with the cache, a worker got it in _cache_step)
                self.cpu.submit(job)
            y = self._receive(job, y, "decode")
        if book.enabled:
            if ready is not None:
                ready.synchronize()
            book.add("decode", experts_gpu=int((self.pos[self.packed_ids[0]] < 0).sum()))
        return y.reshape(f_in.shape)

    # ------------------------------------------------------------------ one token as one graph: the CPU experts a host node

    def host_node_ready(self) -> bool:
        """Whether a graphed one-token step may be one graph with the CPU experts as a host node
        (executors/host_node.py; GraphedBlock's "host" mode): turned on (make_hybrid host_nodes), on
        CUDA, CPU experts quantised whole (`qexperts`), no expert cache (its hits are decided on the
        host), no statistics (a host node cannot time itself)."""
        return bool(self.host_nodes and self.tier.cuda and self.n_cold and self.cold.down is not None
                    and self.cache is None and not self.book.enabled)

    def host_node_setup(self) -> None:
        """Before the first capture: the layer's HostNode over its pinned packed input and output."""
        if self._node is None:
            self._node = HostNode(self.packed_x[0], self.packed_w[0], self.packed_ids[0], self.pos, self.cold.gate,
                                  self.cold.up, self.cold.down, self.cold.act, self.decode_io.out_np[0],
                                  self.cpu.threads)
            self._y_node = torch.empty((1, self.dim), dtype=torch.float32, device=self.tier.device)

    def graph_host(self, pre: tuple) -> torch.Tensor:
        """Inside the capture, on the current stream after graph_pre: the packed input down, the host
        node (the routed CPU experts' sum into the pinned output), the sum up. -> float32 [1, D], static."""
        stream = torch.cuda.current_stream(self.tier.device)
        self.packed.copy_(pre[0], non_blocking=True)
        self._node.launch(stream)
        return self._y_node.copy_(self.decode_io.out[:1], non_blocking=True)

    def defer_host(self) -> bool:
        """Whether a host-node step may leave its CPU experts to the next layer's graph (expert
        deferral, executors/graphs.py): turned on (make_hybrid defer_experts) where host nodes are."""
        return self.defer and self.host_node_ready()

    def host_step(self) -> None:
        """After a host-node step's replay: count it, and raise if the previous step's node met an
        expert id out of range (its result was read since: the engine sampled a token)."""
        if self.first:
            self.book.add("decode", tokens=1, forwards=1)
        self.book.add("decode", layer_calls=1)
        self._node.check()

    # ------------------------------------------------------------------ prefill: the CPU or streamed experts

    def _may_stream(self) -> bool:
        return self.streamer is not None and self.prefill != "cpu" and self.streamer.streams(self.layer)

    def regime(self, ids: np.ndarray) -> str:
        """"cpu" or "stream" for a chunk routed to ids [N, k] (host): see moe_prefill_regime."""
        if not self._may_stream():
            return "cpu"
        if self.prefill == "stream":
            return "stream"
        _, counts = np.unique(ids[self.pos[ids] >= 0], return_counts=True)  # tokens per routed host expert
        c, I = self.costs, self.hidden
        quant = isinstance(self.streamer, ExpertStreamer)  # the CPU's block kernels are compute-bound over a chunk
        return moe_prefill_regime(counts.tolist(), self.cold.nbytes / self.n_cold, self.n_cold, 3 * I * self.dim,
                                  c.cpu_bw, c.pcie_bw, c.gpu_flops, tokens_per_pass=cpu_tokens_per_pass(self.dim),
                                  cuda=self.tier.cuda, cpu_flops=c.cpu_expert_flops if quant else None)

    def _forward_prefill(self, x2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, g0) -> torch.Tensor:
        """Several tokens when the host experts may stream: the routing reaches the host first, then
        the chunk's host experts run on the CPU worker or, streamed, on the fast tier."""
        book, tier, n = self.book, self.tier, x2.shape[0]
        routing, ready, job = self._send(x2, weights, ids, "prefill", submit=False)
        y = self._shared(x2)
        early = self.chunk_kernels()  # the GPU experts need not wait for the routing's copy
        if early:
            y = y + self._routed_fast(x2, weights, ids).to(y.dtype)
        w0 = now()
        if ready is not None:
            ready.synchronize()
        book.add("prefill", wait_s=now() - w0)
        ids_np = routing.ids_np[:n]
        regime = self.regime(ids_np)
        late = self.cpu.inline  # an inline job runs when submitted: queue the fast tier's work first
        if regime == "cpu" and not late:
            self.cpu.submit(job)
        if early and book.enabled:
            book.add("prefill", experts_gpu=int((self.pos[ids_np] < 0).sum()))
        elif self.fast.ids and not early:
            y = self._gpu_experts(x2, weights, ids_np, y, "prefill")
        if regime == "cpu" and late:
            self.cpu.submit(job)
        if regime == "stream":
            y = y + self._streamed(x2, weights, ids_np).to(y.dtype)
        book.span("prefill", "gpu_s", g0, tier.mark())
        book.add("prefill", layer_calls=1)
        if book.enabled:
            book.phases["prefill"].regimes[regime] = book.phases["prefill"].regimes.get(regime, 0) + 1
        return self._receive(job, y, "prefill") if regime == "cpu" else y

    def _streamed(self, x2: torch.Tensor, weights: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
        """The chunk's host experts on the fast tier, from the layer's cold rows streamed chunk by
        chunk (ColdStreamer): each chunk's rows of every routed expert, for that expert's tokens,
        scaled by their routing weights. x2: [N, D]; weights: [N, k]; ids: [N, k] host -> float32 [N, D]."""
        s, I, dev = self.streamer, self.hidden, x2.device
        if isinstance(s, ExpertStreamer):  # whole quantised experts: their blocks, decoded on the fast tier
            y, pairs = s.run(self.layer, x2, weights, ids, self.pos, self.fast.act)
            for a, b in s.take_spans():
                self.book.span("prefill", "transfer_s", a, b)
            self.book.add("prefill", experts_gpu=pairs, rows_streamed=self.cold.n)
            return y
        groups = {int(self.pos[e]): (torch.from_numpy(tok).to(dev), torch.from_numpy(slot).to(dev))
                  for e, tok, slot in routed(ids, lambda e: self.pos[e] >= 0)}  # position -> (tokens, slots)
        y = torch.zeros(x2.shape, dtype=torch.float32, device=dev)
        pairs = 0
        for k in s.chunks(self.layer):
            w = s.acquire(k)
            s.prefetch(k + 1)  # the next chunk, of this layer or the next streamed one
            a, b = s.rows(k)
            for p in range(a // I, (b - 1) // I + 1):  # experts with rows in [a, b)
                if p not in groups:
                    continue
                t, sl = groups[p]
                lo, hi = max(a, p * I) - a, min(b, (p + 1) * I) - a  # the expert's rows in this chunk
                xt = x2[t]  # [n_e, D]
                h = self.fast.act(xt @ w.gate[lo:hi].T) * (xt @ w.up[lo:hi].T)  # [n_e, rows]
                y.index_add_(0, t, ((h @ w.down_t[lo:hi]) * weights[t, sl, None].to(h.dtype)).float())
                if p * I >= a:  # the expert's first row is in this chunk: count its pairs once
                    pairs += len(t)
            s.release(k)
        for a, b in s.take_spans():
            self.book.span("prefill", "transfer_s", a, b)
        self.book.add("prefill", experts_gpu=pairs, rows_streamed=self.cold.n)
        return y

    def _shared(self, x2: torch.Tensor) -> torch.Tensor:
        """The sigmoid-gated shared expert (zeros without one). x2: [N, D] -> [N, D]."""
        if self.shared is None:
            return torch.zeros_like(x2)
        return torch.sigmoid(self.shared_gate(x2)) * self.shared(x2)

    def _routed_fast(self, x2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' routed fast-tier experts, found on the device (no host sync, only the routed
        experts' weights read): one token by routed_experts, a chunk by chunk_experts (chunk_kernels).
        x2: [N, D]; weights, ids: [N, k] on the fast tier -> float32 [N, D]."""
        f = self.fast
        if len(x2) > 1:
            return chunk_experts(x2, ids, weights, f.slot_of, f.gate, f.up, f.down, f.act_name)
        return routed_experts(x2[0], ids[0], weights[0], f.slot_of, f.gate, f.up, f.down, f.act_name)[None]

    def _gpu_experts(self, x2: torch.Tensor, weights: torch.Tensor, ids: np.ndarray, y: torch.Tensor,
                     phase: str) -> torch.Tensor:
        """y + the routed GPU experts' outputs, each scaled by its routing weight, as MoEFFN.mix sums
        them, from the routing on the host (without chunk_kernels). x2, y: [N, D]; weights: [N, k] on
        the fast tier; ids: int64 [N, k] on the host."""
        if len(x2) > 1:
            return y + self._grouped_fast(x2, weights, ids, phase).to(y.dtype)
        out = torch.zeros_like(x2)
        pairs = 0
        for e, tok, slot in routed(ids, lambda e: self.slot_pos[e] >= 0):  # one token: its routed experts
            out += self.fast.expert(int(self.slot_pos[e]), x2) * weights[:, int(slot[0]), None].to(x2.dtype)
            pairs += len(tok)
        self.book.add(phase, experts_gpu=pairs)
        return out + y

    def _grouped_fast(self, x2: torch.Tensor, weights: torch.Tensor, ids: np.ndarray, phase: str) -> torch.Tensor:
        """A chunk's routed fast-tier experts a group of slots at a time, each group's experts in three
        batched products over their tokens (expert_stream.group_products). -> float32 [N, D]."""
        f, step = self.fast, self.fast.group()
        routes = Routes.of(self.slot_pos[ids], len(f.ids))
        out = torch.zeros(x2.shape, dtype=torch.float32, device=x2.device)
        starts = range(0, len(f.ids), step)
        for a, picked in zip(starts, routes.padded([(a, min(len(f.ids), a + step)) for a in starts], weights)):
            if picked is not None:
                s = slice(a, a + step)
                group_products(x2, out, picked, *(f.weight(w, s, x2.dtype) for w in ("gate", "up", "down")), f.act)
        self.book.add(phase, experts_gpu=routes.pairs)
        return out

    def chunk_kernels(self) -> bool:
        """Whether a chunk of tokens runs the fast tier's experts by chunk_experts (CUDA, Triton,
        contiguous stacks): two kernels over every routed pair, without the routing on the host."""
        f = self.fast
        return bool(f.ids) and chunk_kernels_ready(self.tier.device, f.gate, f.up, f.down, f.slot_of)

    # ------------------------------------------------------------------ the CPU side

    def _send(self, x2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, phase: str, submit: bool = True,
              extra: torch.Tensor | None = None):
        """Queue the D2H copies of the routing (and of x, when experts are cold; and of `extra` ids,
        the look-ahead's guess) and hand the cold experts' job to the worker (or return it unsubmitted).
        Returns (routing buffers, copy event, MoEJob or None)."""
        n, tier = x2.shape[0], self.tier
        routing = self.decode_routing if n == 1 else self.prefill_routing.ensure(n)
        io = (self.decode_io if n == 1 else self.prefill_io.ensure(n)) if self.n_cold else None
        xf = x2.float() if io is not None else None  # on the compute stream
        with tier.on_copy_stream():
            t0 = tier.mark(tier.copy)
            if io is not None:
                io.x[:n].copy_(xf, non_blocking=True)
            routing.ids[:n].copy_(ids, non_blocking=True)
            routing.weights[:n].copy_(weights, non_blocking=True)
            if extra is not None:
                routing.extra[: len(extra)].copy_(extra, non_blocking=True)
            self.book.span(phase, "transfer_s", t0, tier.mark(tier.copy))
            ready = tier.event(tier.copy)
        if io is None:
            return routing, ready, None
        job = MoEJob(self.cold, self.pos, self.expert_rows, self.row_scale, io.x_np[:n], routing.ids_np[:n],
                     routing.weights_np[:n], io.out_np[:n], ready=ready, keep=(xf, weights, ids), io=io)
        return routing, ready, self.cpu.submit(job) if submit else job

    def _receive(self, job: MoEJob, y: torch.Tensor, phase: str) -> torch.Tensor:
        """Wait for the worker; when it computed any expert, copy its sum to the fast tier and add."""
        tier, book = self.tier, self.book
        w0 = now()
        job.wait()
        book.add(phase, wait_s=now() - w0, cpu_s=job.cpu_s, cpu_wait_s=job.input_wait_s, experts_cpu=job.pairs)
        if not job.pairs:  # every routed expert was on the fast tier
            return y
        n = job.x.shape[0]
        t0 = tier.mark()
        if n == 1 and tier.cuda:  # decode: into the layer's own device buffer (no allocation)
            if self._y_cpu is None:
                self._y_cpu = torch.empty((1, self.dim), dtype=torch.float32, device=tier.device)
            y_cpu = self._y_cpu.copy_(job.io.out[:1], non_blocking=True)  # [1, D]
        else:
            y_cpu = job.io.out[:n].to(tier.device, non_blocking=True)  # [N, D] float32
        book.span(phase, "transfer_s", t0, tier.mark())
        return y.add_(y_cpu)  # y is this layer's own fresh tensor; the sum is computed in float32


def random_experts(lm_or_config, fraction: float, seed: int = 0) -> dict[int, list[int]]:
    """A random expert placement for tests: per MoE layer, round(fraction * E) experts on the fast tier."""
    config = getattr(lm_or_config, "config", lm_or_config)
    gen = torch.Generator().manual_seed(seed)
    n = getattr(config, "num_experts", 0)
    return {l: torch.randperm(n, generator=gen)[: int(round(fraction * n))].tolist()
            for l in range(config.num_layers) if config.ffn_kind(l) == "moe"}


__all__ = ["HybridMoE", "Lookahead", "random_experts"]
