"""HybridFFN: one dense/gated layer's FFN split between the fast tier and the CPU worker.

Decode (one token), per layer:
  compute stream   x ─ predictor ─ mask ──────── hot FFN (mask[:H]) ──────────── y_hot ─┐
  copy stream                       └ D2H x, mask[H:] ─ event ┐                           + ─ y
  CPU worker                                                   └ rows ─ ffn_rows ─ out ─ H2D ┘
The D2H copies are queued before the hot FFN so they run beside it; the worker waits only for its
copy event; the main thread blocks only when it needs the CPU result, then queues its H2D copy and
the sum on the compute stream. With CUDA graphs (graphs.py) the order is the same: the predictor is
replayed in one graph, the copies queued, the hot FFN replayed in a second. Prefill (N > 1 tokens)
uses the union of the tokens' masks on both sides (see prefill.py) so the result does not depend on
which neurons are hot; its cold part runs in the regime prefill.py's cost rule picks ("cpu" rows,
"dense" GEMMs on the CPU, or "stream" to the fast tier).
"""

from __future__ import annotations

import torch

from hotcold.executors.cpu_executor import ColdJob, CPUExecutor, HostRows
from hotcold.executors.gpu_executor import GPUExecutor
from hotcold.executors.host_node import FFNHostNode, ffn_node_kind
from hotcold.executors.prefill import ColdStreamer, PrefillCosts, cpu_tokens_per_pass, prefill_regime
from hotcold.executors.stats import StatsBook, now
from hotcold.executors.tier import FastTier
from hotcold.executors.weights import ColdFFN
from hotcold.models.layers import FFN
from hotcold.sparse_ops.gpu import hot_ffn


class HybridFFN(FFN):
    """forward(x: [B, T, D]) -> [B, T, D], replacing a block's DenseFFN/GatedFFN."""

    kind = "hybrid"

    def __init__(self, layer: int, gpu: GPUExecutor, cold: ColdFFN, cpu: CPUExecutor, tier: FastTier,
                 book: StatsBook, prefill_io: HostRows, streamer: ColdStreamer | None = None,
                 prefill: str = "auto", costs: PrefillCosts | None = None):
        super().__init__()
        self.layer, self.gpu, self.cold, self.cpu, self.tier, self.book = layer, gpu, cold, cpu, tier, book
        self.dim = gpu.dim
        self.decode_io = HostRows(tier.host_empty, self.dim, 1)
        self.prefill_io = prefill_io
        self.mask_host = tier.host_empty((cold.n,), torch.bool)
        self.mask_np = self.mask_host.numpy()
        self.streamer, self.prefill, self.costs = streamer, prefill, costs or PrefillCosts()
        self.first = False  # the engine's first hybrid layer counts tokens
        self.host_nodes = False  # a graphed decode step may be one graph, the cold rows a host node (make_hybrid)
        self._node: FFNHostNode | None = None
        self._y_node: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, hot={self.gpu.n_hot}, cold={self.cold.n}, act={self.cold.act}"

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [N, D]
        n = x2.shape[0]
        phase = "decode" if n == 1 else "prefill"
        book, tier, H = self.book, self.tier, self.gpu.n_hot
        if self.first:
            book.resolve()
            book.add(phase, tokens=n, forwards=1)
        g0 = tier.mark()
        mask = self.gpu.predict(x2)  # bool [N, I] hot-first, or None
        if mask is not None and n > 1:
            mask = mask.any(0)  # [I]: the union over the chunk
        hot_mask = None if mask is None else mask[..., :H]
        cold_mask = None if mask is None else mask[..., H:].reshape(-1)  # [C]
        regime = self.regime(n, cold_mask) if self.cold.n else None
        late = self.cpu.inline  # an inline job runs when submitted: queue the fast tier's work first
        job = self._send(x2, cold_mask, phase, submit=not late, dense=regime == "dense") \
            if regime in ("cpu", "dense") else None
        y = self.gpu.compute(x2, hot_mask)  # [N, D]
        if regime == "stream":
            y = y + self._streamed(x2, cold_mask, phase)
        book.span(phase, "gpu_s", g0, tier.mark())
        if book.enabled:
            book.add(phase, layer_calls=1, hot_rows=H, cold_rows=self.cold.n)
            if hot_mask is not None and H:
                book.count(phase, "rows_gpu", hot_mask.sum())
            elif H:
                book.add(phase, rows_gpu=H)
            if regime:
                book.phases[phase].regimes[regime] = book.phases[phase].regimes.get(regime, 0) + 1
        if job is not None:
            if late:
                self.cpu.submit(job)
            y = self._receive(job, y, phase)
        return y.reshape(shape)

    def regime(self, n: int, cold_mask: torch.Tensor | None = None) -> str:
        """Where the cold part runs for n tokens (see prefill.py): always "cpu" for one token; "dense"
        only for float cold rows (not GGUF blocks nor int8), "stream" only for streamed ones.
        cold_mask: the chunk's union [C]; on a CPU tier its share of rows is weighed (on CUDA
        counting it would synchronise, so all rows are assumed)."""
        if n == 1 or self.prefill == "cpu":
            return "cpu"
        streams = self.streamer is not None and self.streamer.streams(self.layer)
        gemm = self.cold.gemm_ready
        if self.prefill in ("stream", "dense"):
            return self.prefill if (streams if self.prefill == "stream" else gemm) else "cpu"
        c = self.costs
        selected = 1.0 if cold_mask is None or self.tier.cuda else float(cold_mask.float().mean())
        return prefill_regime(n, self.cold.nbytes, c.cpu_bw, c.pcie_bw, c.gpu_flops,
                              cold_params=self.cold.n * len(self.cold.mats) * self.dim,
                              tokens_per_pass=cpu_tokens_per_pass(self.dim), cuda=self.tier.cuda and streams,
                              cpu_flops=c.cpu_flops if gemm else None, selected=selected)

    # ------------------------------------------------------------------ one token, its device half in a CUDA graph

    def graph_ready(self) -> bool:
        """Whether a one-token step may run split around CUDA graphs (graph_pre ... graph_post,
        executors/graphs.py): on CUDA, with the predictor on the fast tier."""
        m = self.gpu.mask_fn
        return self.tier.cuda and getattr(m, "worker", None) is None

    def device_only(self) -> bool:
        return False  # its cold rows are the host's (a layer whose rows are all hot runs as a plain FFN)

    def graph_pre(self, f_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The predictor and the CPU's inputs (graphs.py: captured with the attention half). Device
        ops only. f_in: [1, 1, D] -> (x float32 [1, D], the predicted mask bool [1, I] hot-first or None)."""
        x2 = f_in.reshape(1, -1)
        return x2.float(), self.gpu.predict(x2)

    def graph_send(self, pre: tuple) -> object:
        """Queue the D2H copies of x and the cold mask on the copy stream (eager, between the two
        graphs); returns their event (None: no cold rows, or the CPU tier)."""
        xf, mask = pre
        if not self.cold.n:
            return None
        tier = self.tier
        with tier.on_copy_stream():
            t0 = tier.mark(tier.copy)
            self.decode_io.x.copy_(xf, non_blocking=True)
            if mask is not None:
                self.mask_host.copy_(mask[0, self.gpu.n_hot:], non_blocking=True)
            self.book.span("decode", "transfer_s", t0, tier.mark(tier.copy))
            return tier.event(tier.copy)

    def graph_fast(self, f_in: torch.Tensor, pre: tuple) -> torch.Tensor:
        """The hot neurons the mask selects (graphs.py: the second graph). -> y [1, D]."""
        _, mask = pre
        return self.gpu.compute(f_in.reshape(1, -1), None if mask is None else mask[:, : self.gpu.n_hot])

    def graph_post(self, f_in: torch.Tensor, y: torch.Tensor, pre: tuple, ready, marks=(None, None)) -> torch.Tensor:
        """The host half, once graph_send queued the copies: the predicted cold rows run on the CPU
        (after `ready`), their sum comes back and is added to y in place. marks: timing marks around
        the replays. -> [1, 1, D]."""
        book, H = self.book, self.gpu.n_hot
        _, mask = pre
        if self.first:
            book.resolve()
            book.add("decode", tokens=1, forwards=1)
        book.span("decode", "gpu_s", *marks)
        self.count_decode(None if mask is None else mask[0, :H])
        if self.cold.n:
            job = ColdJob(self.cold, self.decode_io.x_np, None if mask is None else self.mask_np,
                          self.decode_io.out_np, ready=ready, io=self.decode_io)
            y = self._receive(self.cpu.submit(job), y, "decode")
        return y.reshape(f_in.shape)

    def count_decode(self, hot_mask: torch.Tensor | None) -> None:
        """A one-token step's counts when statistics are on (graph_post, HostBlock): the layer, its
        rows, the cold part's regime. hot_mask: bool [H], the predicted hot neurons, on the device
        (counted there, without a sync) or the host; None: every hot neuron."""
        book, H = self.book, self.gpu.n_hot
        if not book.enabled:
            return
        book.add("decode", layer_calls=1, hot_rows=H, cold_rows=self.cold.n)
        if hot_mask is not None and H:
            if hot_mask.is_cuda:
                book.count("decode", "rows_gpu", hot_mask.sum())
            else:
                book.add("decode", rows_gpu=int(hot_mask.sum()))
        elif H:
            book.add("decode", rows_gpu=H)
        if self.cold.n:
            regimes = book.phases["decode"].regimes
            regimes["cpu"] = regimes.get("cpu", 0) + 1

    # ------------------------------------------------------------------ one token as one graph: the cold rows a host node

    def host_node_ready(self) -> bool:
        """Whether a graphed one-token step may be one graph with the cold rows as a host node
        (executors/host_node.py, FFNHostNode; GraphedBlock's "host" mode): turned on (make_hybrid
        dense_host_nodes), split graphs possible (graph_ready), cold rows of one storage kind, no
        statistics (a host node cannot time its parts for them)."""
        return bool(self.host_nodes and self.cold.n and self.graph_ready() and not self.book.enabled
                    and ffn_node_kind(self.cold) is not None)

    def host_node_setup(self) -> None:
        """Before a capture: the layer's FFNHostNode over its pinned input, mask and output (again if
        a predictor came or went since: the node reads the mask only when there is one)."""
        mask = self.mask_np if self.gpu.mask_fn is not None else None
        if self._node is None or (self._node.keep[1] is None) != (mask is None):
            self._node = FFNHostNode(self.decode_io.x_np[0], mask, self.cold, self.decode_io.out_np[0],
                                     self.cpu.threads)
            self._y_node = torch.empty((1, self.dim), dtype=torch.float32, device=self.tier.device)

    def graph_host(self, pre: tuple) -> torch.Tensor:
        """Inside the capture, on the current stream after graph_pre: x and the cold mask down, the
        host node (the predicted cold rows into the pinned output), the sum up. -> float32 [1, D], static."""
        xf, mask = pre
        self.decode_io.x.copy_(xf, non_blocking=True)
        if mask is not None:
            self.mask_host.copy_(mask[0, self.gpu.n_hot:], non_blocking=True)
        self._node.launch(torch.cuda.current_stream(self.tier.device))
        return self._y_node.copy_(self.decode_io.out[:1], non_blocking=True)

    def defer_host(self) -> bool:
        """False: a dense layer's cold rows are never deferred (expert deferral is for MoE experts)."""
        return False

    def host_step(self) -> None:
        """After a host-node step's replay: count it (the node itself cannot fail on valid buffers)."""
        if self.first:
            self.book.add("decode", tokens=1, forwards=1)
        self.book.add("decode", layer_calls=1)
        self._node.check()

    # ------------------------------------------------------------------ CPU regime

    def _send(self, x2: torch.Tensor, cold_mask: torch.Tensor | None, phase: str, submit: bool = True,
              dense: bool = False) -> ColdJob:
        """Queue the D2H copies of x and the cold mask, and hand the job to the worker (or return it
        unsubmitted); dense: the worker computes it as GEMMs (the "dense" regime)."""
        n, tier = x2.shape[0], self.tier
        io = self.decode_io if n == 1 else self.prefill_io.ensure(n)
        xf = x2.float()  # on the compute stream
        with tier.on_copy_stream():
            t0 = tier.mark(tier.copy)
            io.x[:n].copy_(xf, non_blocking=True)
            if cold_mask is not None:
                self.mask_host.copy_(cold_mask, non_blocking=True)
            self.book.span(phase, "transfer_s", t0, tier.mark(tier.copy))
            ready = tier.event(tier.copy)
        job = ColdJob(self.cold, io.x_np[:n], None if cold_mask is None else self.mask_np, io.out_np[:n],
                      ready=ready, keep=(xf, cold_mask), io=io, dense=dense)
        return self.cpu.submit(job) if submit else job

    def _receive(self, job: ColdJob, y: torch.Tensor, phase: str) -> torch.Tensor:
        """Wait for the worker, copy its result to the fast tier (H2D on the compute stream), add."""
        tier, book = self.tier, self.book
        w0 = now()
        job.wait()
        book.add(phase, wait_s=now() - w0, cpu_s=job.cpu_s, cpu_wait_s=job.input_wait_s, rows_cpu=job.rows)
        n = job.x.shape[0]
        t0 = tier.mark()
        y_cpu = job.io.out[:n].to(tier.device, non_blocking=True)  # [N, D] float32
        book.span(phase, "transfer_s", t0, tier.mark())
        return y.add_(y_cpu)  # y is this layer's own fresh tensor; the sum is computed in float32

    # ------------------------------------------------------------------ streaming regime

    def _streamed(self, x2: torch.Tensor, cold_mask: torch.Tensor | None, phase: str) -> torch.Tensor:
        """The cold part computed on the fast tier from streamed weights, chunk by chunk. x2: [N, D] -> [N, D]."""
        s = self.streamer
        y = None
        for k in s.chunks(self.layer):
            w = s.acquire(k)
            s.prefetch(k + 1)  # the next chunk, of this layer or the next streamed one
            a, b = s.rows(k)
            part = hot_ffn(x2, w.up, w.down_t, self.cold.act, w.gate, w.up_bias,
                           None if cold_mask is None else cold_mask[a:b])  # [N, D]
            y = part if y is None else y.float().add_(part)  # chunks summed in float32
            s.release(k)
        for a, b in s.take_spans():
            self.book.span(phase, "transfer_s", a, b)
        if self.book.enabled:
            if cold_mask is None:
                self.book.add(phase, rows_streamed=self.cold.n)
            else:
                self.book.count(phase, "rows_streamed", cold_mask.sum())
        return y.to(x2.dtype)
