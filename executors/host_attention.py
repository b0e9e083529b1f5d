"""Work the plan puts on the CPU beside a GPU: a block's attention (HostAttention) and the dense
single-token matrix-vector products it needs (HostLinear, numba's `gemv`, the kernel the planner's
cost model assumes for CPU attention and predictors).

The block's norms, residual and FFN stay where they are; only the normed input [B, T, D] crosses to
the host and the attention output comes back (2 x D values per token, one synchronising copy each
way). The weights and this layer's KV cache live in host memory (the cache in float16 for a
half-precision model, per `kv_dtype`), so they take no GPU memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hotcold.executors.stats import now
from hotcold.models.layers import Attention, Rotary
from hotcold.models.quantized import QuantLinear, fuse_qkv
from hotcold.sparse_ops.cpu import HostMatrix, gemv, set_threads


def host_positions(positions: torch.Tensor, start: int | None) -> torch.Tensor:
    """The step's positions [T] on the CPU: built from `start` when the caller gave it (Transformer
    does), which saves a synchronising copy from the device per layer."""
    if start is None:
        return positions.to("cpu")
    return torch.arange(start, start + positions.shape[0])


class HostLinear(nn.Module):
    """A CPU nn.Linear whose one-token products run in numba's `gemv` over the same memory (float32,
    fp16 or bf16 weights; a QuantLinear's GGUF blocks, which `gemv` hands to the block kernels);
    several tokens go through torch (a QuantLinear's own chunked dequantise + matmul)."""

    def __init__(self, linear: nn.Linear | QuantLinear, threads: int):
        super().__init__()
        self.quant = linear if isinstance(linear, QuantLinear) else None
        self.bias = linear.bias  # [N] or None
        if self.quant is not None:
            self.host = linear.qweight  # QuantMatrix [N, D]
        else:
            self.weight = linear.weight  # [N, D]
            self.host = HostMatrix.from_torch(self.weight.data)  # shares the weight's memory
        self.threads = threads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D] -> [..., N]
        if x.numel() != x.shape[-1]:
            return self.quant(x) if self.quant is not None else F.linear(x, self.weight, self.bias)
        set_threads(self.threads)  # numba's count is per calling thread
        y = torch.from_numpy(gemv(self.host, x.reshape(-1).float().numpy()))  # [N] float32
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class HostAttention(nn.Module):
    """forward(x, positions, cache_kv, start) like Attention, with the work done on the CPU.

    With a `worker` (the engine's CPUExecutor) the work runs on that thread: numba's and torch's
    OpenMP thread teams belong to the thread that starts them, and a second team in the main thread
    spinning beside the worker's slowed both (8 13B-shaped layers with every attention on the CPU,
    16-core H200 host: 106.7 ms per token from the main thread, 59.3 on the worker). `book` (a
    StatsBook) gets the time as `host_s`."""

    def __init__(self, attn: Attention, dtype: torch.dtype, threads: int, worker=None, book=None):
        super().__init__()
        self.attn = attn.to("cpu", dtype)  # quantised projections stay in their blocks
        qkv = getattr(self.attn, "qkv", None)  # fused half q/k/v rows (fuse_qkv) of another dtype: again
        if isinstance(qkv, torch.Tensor) and (qkv.dtype != dtype or qkv.data_ptr() != self.attn.q.weight.data_ptr()):
            self.attn.qkv = None
            fuse_qkv(self.attn)
        self.dtype = dtype
        for name in ("q", "k", "v", "o"):
            setattr(self.attn, name, HostLinear(getattr(self.attn, name), threads))
        for m in self.attn.modules():
            if isinstance(m, Rotary):  # its tables are recomputed on the host
                m.reset("cpu")
        self.worker, self.book, self.threads = worker, book, threads

    def _host(self, *args) -> torch.Tensor:
        set_threads(self.threads)  # numba's count is per calling thread (a fused q/k/v GEMV: attn.qkv)
        return self.attn(*args)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None = None) -> torch.Tensor:
        # x: [B, T, D] on the fast tier -> [B, T, D] there; cache_kv: host buffers
        t0 = now()
        args = (x.to("cpu", self.dtype), host_positions(positions, start), cache_kv, start)
        y = self.worker.call(self._host, *args) if self.worker is not None else self._host(*args)
        y = y.to(x.device, x.dtype)
        if self.book is not None and self.book.enabled:
            self.book.add("decode" if x.shape[0] * x.shape[1] == 1 else "prefill", host_s=now() - t0)
        return y


class HostEmbedding(nn.Module):
    """The token embedding kept in host memory, where the planner counts it: rows are looked up on
    the CPU and sent to `device`; as a tied LM head (`logits`), the product runs on the CPU too
    (a QuantEmbedding's block kernels, or torch) and the logits go to x's device."""

    def __init__(self, embed: nn.Module, device, threads: int):
        super().__init__()
        self.embed, self.device, self.threads = embed, torch.device(device), threads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [B, T] -> [B, T, D] on device
        return self.embed(tokens.cpu()).to(self.device)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D] -> [B, T, V] float32, on x's device
        set_threads(self.threads)
        xc = x.cpu()
        y = self.embed.logits(xc) if hasattr(self.embed, "logits") else (xc @ self.embed.weight.T).float()
        return y.to(x.device)


class HostHead(nn.Module):
    """An untied LM head kept in host memory (the plan's `lm_head_gpu` false): x goes to the CPU,
    one token multiplies with numba's kernels (HostLinear), several with torch; logits come back."""

    def __init__(self, linear: nn.Linear | QuantLinear, threads: int):
        super().__init__()
        self.linear = HostLinear(linear, threads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D] -> [..., V] on x's device
        return self.linear(x.cpu()).to(x.device)


__all__ = ["HostAttention", "HostEmbedding", "HostHead", "HostLinear", "host_positions"]
