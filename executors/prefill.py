"""Prefill (many tokens at once): where a layer's cold neurons are computed, and the weight streamer.

Over a prompt, the union of the tokens' active neurons is nearly dense, so the cold part is
computed for the union of the predicted masks (every token the same rows), in one of three regimes:
  "cpu"     the worker runs `ffn_rows_batch` over the union's cold rows for the whole chunk (it
            reads the rows once per tile of a few tokens);
  "dense"   the worker runs `ffn_dense`: torch GEMMs over all the cold rows at once, masked to the
            union after the activation (reads them once; compute-bound for long chunks);
  "stream"  the layer's cold weights are copied to the fast tier in chunks of rows through two
            fixed slots (the next chunk's copy overlapping this one's compute), and the fast tier
            computes them.
`prefill_regime` is the one cost function that chooses; the planner's cost model replaces it later.
On the CPU device streaming is meaningless: "cpu" or "dense" (a test may still force "stream").
MoE layers stream their host experts the same way (`moe_prefill_regime` decides from the chunk's
routing; the fast tier computes each routed expert's rows of a chunk for its tokens).
Quantised cold parts (GGUF blocks, `ColdFFN.quantized`) and int8 ones are not streamed nor GEMM'd:
the fast tier has no block kernels, so they always take the "cpu" regime (the worker decodes each block once per chunk
of tokens, `qffn_rows_batch`); the streamer leaves them out (`ColdStreamer.streams`). A MoE layer's
whole quantised experts are the exception: they stream as their blocks and are decoded on the fast
tier (executors/expert_stream.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.executors.tier import FastTier
from hotcold.executors.weights import ColdFFN
from hotcold.sparse_ops import cpu as cpu_ops

REGIMES = ("cpu", "dense", "stream")


@dataclass
class PrefillCosts:
    """Measured rates (bytes/s, FLOP/s). Defaults: an H200 host's (16 threads); cpu_flops
    None: unknown, the "dense" regime is not considered (`measure_cpu_flops` measures it)."""

    cpu_bw: float = 73e9  # weight bytes/s the numba kernels read
    pcie_bw: float = 52e9  # pinned host -> device bytes/s
    gpu_flops: float = 400e12  # effective dense FLOP/s of the fast tier on these shapes
    cpu_flops: float | None = None  # torch GEMM FLOP/s on the CPU in the cold rows' dtype
    cpu_expert_flops: float = 3e11  # FLOP/s of the quantised expert kernels over a prompt chunk (15 threads, H200 host)

    @classmethod
    def from_hardware(cls, hw, kind: str = "bf16") -> "PrefillCosts":
        """From a planner HardwareProfile (read by attribute name): the fused FFN kernel's rate for
        the cold storage kind and the pinned H2D bandwidth; defaults where a field is missing."""
        d = cls()
        ffn = getattr(hw, "cpu_ffn_Bps", None) or {}
        return cls(cpu_bw=ffn.get(kind) or d.cpu_bw, pcie_bw=getattr(hw, "h2d_pinned_Bps", None) or d.pcie_bw,
                   gpu_flops=d.gpu_flops)


def measure_cpu_flops(dtype: torch.dtype, dim: int, threads: int | None = None, tokens: int = 64) -> float:
    """FLOP/s of torch's CPU GEMM [tokens, dim] x [dim, 4 dim] in dtype, in the calling thread (the
    best of four calls, the first a warm-up; about 10 ms for dim 4096 on 2 cores)."""
    import time

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        x = torch.randn(tokens, dim).to(dtype)
        w = torch.randn(4 * dim, dim).to(dtype)
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * tokens * dim * 4 * dim / max(best, 1e-9)
    finally:
        torch.set_num_threads(old)


def cpu_tokens_per_pass(dim: int) -> int:
    """Tokens `ffn_rows_batch` computes per read of the weights (its token tile)."""
    return max(1, getattr(cpu_ops, "_TILE_BYTES", 1 << 16) // (4 * dim))


def prefill_regime(T: int, cold_bytes: int, cpu_bw: float, pcie_bw: float, gpu_flops: float, *,
                   cold_params: int | None = None, tokens_per_pass: int = 4, cuda: bool = True,
                   cpu_flops: float | None = None, selected: float = 1.0) -> str:
    """"cpu", "dense" or "stream" for a layer whose cold part is cold_bytes (cold_params weights) over
    T tokens, the cheapest of:

    cpu:    the rows kernel re-reads the selected share of the cold weights once per token tile:
            ceil(T / tokens_per_pass) passes over selected * cold_bytes.
    dense:  one read of all the cold weights, or 2·T·params FLOPs at cpu_flops if slower (only with
            a cpu_flops figure).
    stream: copy once over PCIe, overlapped with the previous layer, so the slower of the copy and
            the fast tier's 2·T·params FLOPs (only on CUDA).
    """
    if cold_bytes == 0:
        return "cpu"
    params = cold_params if cold_params is not None else cold_bytes // 2
    cost = {"cpu": math.ceil(T / max(1, tokens_per_pass)) * selected * cold_bytes / cpu_bw}
    if cpu_flops:
        cost["dense"] = max(cold_bytes / cpu_bw, 2.0 * T * params / cpu_flops)
    if cuda:
        cost["stream"] = max(cold_bytes / pcie_bw, 2.0 * T * params / gpu_flops)
    return min(cost, key=cost.get)


def moe_prefill_regime(counts: list[int], expert_bytes: float, n_experts: int, expert_params: int, cpu_bw: float,
                       pcie_bw: float, gpu_flops: float, *, tokens_per_pass: int = 4, cuda: bool = True,
                       cpu_flops: float | None = None) -> str:
    """"cpu" or "stream" for a MoE layer's n_experts host experts (expert_bytes, expert_params each)
    when a chunk of tokens routes counts[j] tokens to the j-th routed one of them.

    cpu:    each routed expert's weights are re-read once per token tile: ceil(count / tokens_per_pass).
    stream: every host expert of the layer is copied once (the streamer moves the layer whole), so
            the slower of that copy and the fast tier's 2 * params FLOPs per routed token.
    """
    if not cuda or not counts:
        return "cpu"
    tpp = max(1, tokens_per_pass)
    t_cpu = sum(math.ceil(c / tpp) for c in counts) * expert_bytes / cpu_bw
    if cpu_flops:  # kernels that read each expert once per chunk but are bound by their arithmetic
        t_cpu = max(t_cpu, 2.0 * sum(counts) * expert_params / cpu_flops)
    t_stream = max(n_experts * expert_bytes / pcie_bw, 2.0 * sum(counts) * expert_params / gpu_flops)
    return "stream" if t_stream < t_cpu else "cpu"


# ---------------------------------------------------------------------------------------------
# Streaming cold weights to the fast tier

_STORAGE_TORCH = {"f32": torch.float32, "bf16": torch.int16, "f16": torch.int16, "i8": torch.int8}
_BITS_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}


def _host_tensor(m: cpu_ops.HostMatrix) -> torch.Tensor:
    """The storage of a HostMatrix as a torch tensor sharing its memory (fp16/bf16 bits as int16)."""
    data = m.data.view(np.int16) if m.data.dtype == np.uint16 else m.data
    return torch.from_numpy(data)


PIN_MIN_BYTES = 1 << 20  # smaller matrices may share pages with other allocations: not worth pinning


def pin_host(cold: ColdFFN) -> list[int]:
    """Page-lock the cold matrices in place (cudaHostRegister) so streaming copies run at pinned
    speed; returns the registered pointers. Where registering is unavailable or fails, copies still
    work (at pageable speed).

    Read-only arrays (a model file's or a layout cache's mapping, as `--map-experts` and the split
    cache give) are left pageable: cudaHostRegister refuses read-only pages without a flag not every
    device supports, and a refused registration leaves an error behind that the next kernel launch
    raises as its own ("CUDA error: invalid argument"); pinning them would also hold the file's
    pages in the page cache."""
    try:
        cudart = torch.cuda.cudart()
        register = cudart.cudaHostRegister
    except (AttributeError, RuntimeError):
        return []
    done = []
    for m in cold.mats:
        ptr = m.data.ctypes.data
        if m.data.nbytes >= PIN_MIN_BYTES and m.data.flags.writeable and int(register(ptr, m.data.nbytes, 0)) == 0:
            done.append(ptr)
    cold.pinned = True  # (tried: a second registration would fail)
    return done


def unpin_host(ptrs: list[int]) -> None:
    if ptrs:
        torch.cuda.synchronize()  # no copy may still read them
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)
        ptrs.clear()


class StreamedFFN:
    """A cold part on the fast tier in the compute dtype: up/gate/down_t [C, D], up_bias [C]."""

    def __init__(self, up, gate, down_t, up_bias):
        self.up, self.gate, self.down_t, self.up_bias = up, gate, down_t, up_bias


STREAM_SLOTS_BYTES = 128 << 20  # fast-tier bytes of the streamer's two slots (the planner reserves them)


class ColdStreamer:
    """Cold weights streamed to the fast tier in chunks of rows, through two fixed slots.

    Every streamed layer's cold rows are cut into chunks of `chunk_rows` neurons, in one global
    order (layer by layer, rows in order); chunk k fills slot k % 2. Chunk k+1's copy runs on its own
    stream while chunk k computes (and the first chunk of the next streamed layer while the last of
    this one does), so the fast tier holds `workspace_bytes` however large a layer is.
    chunks(layer) -> chunk ids; acquire(k) -> StreamedFFN; rows(k) -> (a, b); release(k); prefetch(k)."""

    def __init__(self, tier: FastTier, colds: dict[int, ColdFFN], order: list[int],
                 slots_bytes: int = STREAM_SLOTS_BYTES):
        if any(c.quantized for c in colds.values()):
            raise ValueError("quantised cold parts are computed by the CPU worker, not streamed")
        self.tier, self.colds = tier, colds
        ref = max(colds.values(), key=lambda c: c.n)  # every layer has the same D and storage kinds
        self._ref = ref
        self.row_bytes = sum(m.row_bytes() for m in ref.mats) + 4 * 4  # + 3 scales and a bias, float32
        self.chunk_rows = max(1, min(ref.n, slots_bytes // (2 * self.row_bytes)))
        self.order = [(l, a, min(colds[l].n, a + self.chunk_rows))
                      for l in order for a in range(0, colds[l].n, self.chunk_rows)]
        self._chunks: dict[int, range] = {}
        for k, (l, _, _) in enumerate(self.order):
            r = self._chunks.get(l)
            self._chunks[l] = range(k, k + 1) if r is None else range(r.start, k + 1)
        self.stream = torch.cuda.Stream(tier.device) if tier.cuda else None
        self.loaded: list[int | None] = [None, None]  # chunk id in each slot
        self.ready: list = [None, None]
        self.free: list = [None, None]
        self.spans: list = []  # (start, end) marks of copies, collected by the layers' stats
        self.slots: list[dict | None] = [None, None]
        self.bias = {l: torch.from_numpy(c.up_bias) for l, c in colds.items() if c.up_bias is not None}

    def chunks(self, layer: int) -> range:
        return self._chunks[layer]

    def streams(self, layer: int) -> bool:
        """Whether the layer's cold rows go through the streamer (quantised ones do not)."""
        return layer in self._chunks

    def rows(self, k: int) -> tuple[int, int]:
        """Chunk k's cold rows [a, b) within its layer."""
        return self.order[k][1], self.order[k][2]

    def _alloc(self) -> dict:
        ref, n, dev = self._ref, self.chunk_rows, self.tier.device
        d = ref.up.shape[1]
        with torch.inference_mode(False):
            slot = {name: torch.empty((n, d), dtype=_STORAGE_TORCH[m.kind], device=dev)
                    for name, m in (("up", ref.up), ("gate", ref.gate), ("down_t", ref.down_t)) if m is not None}
            slot["scale"] = torch.empty((3, n), dtype=torch.float32, device=dev)
            slot["bias"] = torch.empty(n, dtype=torch.float32, device=dev)
        return slot

    @property
    def workspace_bytes(self) -> int:
        """Fast-tier bytes of the two slots (raw storage), allocated at the first streamed chunk."""
        return 2 * self.chunk_rows * self.row_bytes if self.colds else 0

    def _fetch(self, k: int) -> None:
        i = k % 2
        if self.slots[i] is None:
            self.slots[i] = self._alloc()
        slot, tier = self.slots[i], self.tier
        layer, a, b = self.order[k]
        cold = self.colds[layer]
        ctx = torch.cuda.stream(self.stream) if tier.cuda else contextlib.nullcontext()
        with ctx:
            if self.free[i] is not None:
                self.stream.wait_event(self.free[i])  # the slot's previous chunk is done with it
            t0 = tier.mark(self.stream)
            for j, (name, m) in enumerate((("up", cold.up), ("gate", cold.gate), ("down_t", cold.down_t))):
                if m is None:
                    continue
                slot[name][:b - a].copy_(_host_tensor(m)[a:b], non_blocking=True)
                if m.scale is not None:
                    slot["scale"][j, :b - a].copy_(torch.from_numpy(m.scale[a:b]), non_blocking=True)
            if layer in self.bias:
                slot["bias"][:b - a].copy_(self.bias[layer][a:b], non_blocking=True)
            self.spans.append((t0, tier.mark(self.stream)))
            self.ready[i] = tier.event(self.stream) if tier.cuda else None
        self.loaded[i] = k

    def prefetch(self, k: int | None) -> None:
        """Start copying chunk k (no-op for None, past the last chunk, or when already loaded)."""
        if k is not None and 0 <= k < len(self.order) and self.loaded[k % 2] != k:
            self._fetch(k)

    def acquire(self, k: int) -> StreamedFFN:
        """Chunk k's weights on the fast tier, in the compute dtype, ordered after their copy."""
        i = k % 2
        if self.loaded[i] != k:
            self._fetch(k)
        self.tier.wait(self.ready[i])
        layer, a, b = self.order[k]
        slot, cold, dtype = self.slots[i], self.colds[layer], self.tier.dtype
        n = b - a

        def view(name: str, j: int, m):
            if m is None:
                return None
            raw = slot[name][:n]
            if m.kind == "i8":
                return (raw.float() * slot["scale"][j, :n, None]).to(dtype)
            if m.kind in _BITS_DTYPE:
                raw = raw.view(_BITS_DTYPE[m.kind])
            return raw.to(dtype)

        bias = slot["bias"][:n].to(dtype) if layer in self.bias else None
        return StreamedFFN(view("up", 0, cold.up), view("gate", 1, cold.gate), view("down_t", 2, cold.down_t), bias)

    def release(self, k: int) -> None:
        """Mark chunk k's slot reusable once the compute queued so far has finished."""
        self.free[k % 2] = self.tier.event()

    def take_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans
