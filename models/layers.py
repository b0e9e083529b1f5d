"""Building blocks of the reference forward: norms, rotary embeddings, attention, FFNs.

Parameter names follow models/NAMES.md. The FFN modules (DenseFFN, GatedFFN, MoEFFN) share
one interface, `forward(x: [B, T, D]) -> [B, T, D]`, so later stages replace them per layer
without touching attention code.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hotcold.models.config import ModelConfig, MoEConfig
from hotcold.sparse_ops.attention import decode_attention
from hotcold.sparse_ops.cpu import HostMatrix, gemv
from hotcold.sparse_ops.input_sparse import im_gemv
from hotcold.sparse_ops.fused_gpu import fused_ready, rms_norm_cuda, rope_cuda
from hotcold.sparse_ops.norm import rms_norm
from hotcold.sparse_ops.quant import qgemv

# ----------------------------------------------------------------------------- norms


_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; `plus_one` gives Gemma's x * (1 + w)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ready(x) and self.weight.dtype == x.dtype:
            return rms_norm_cuda(x, self.weight, self.eps, self.plus_one)  # one Triton kernel, rows independent
        if x.numel() == x.shape[-1]:  # one token: a decode step
            return self.rows(x)
        return self._torch(x)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for the rows of one decode step (x: [.., D]; QK-norm: one row per head): float32
        on the CPU in one numba call (sparse_ops.norm) instead of seven torch ops. Prefill keeps
        torch's reduction, so that a token's norm does not depend on how many tokens share a call
        (the profiler's counts are checked against a token-by-token recomputation)."""
        if x.device.type != "cpu" or x.dtype not in _NORM_DTYPES or self.weight.dtype not in _NORM_DTYPES \
                or torch.is_grad_enabled():
            return self._torch(x)
        rows = np.ascontiguousarray(x.detach().reshape(-1, x.shape[-1]).float().numpy())  # [N, D] float32
        y = rms_norm(rows, self.weight.detach().float().numpy(), self.eps, self.plus_one)
        return torch.from_numpy(y).reshape(x.shape).to(x.dtype)  # a half model's rows rounded once


def make_norm(config: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or config.hidden_size
    if config.norm_kind == "layer":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, config.norm_eps, plus_one=config.norm_kind == "rms_plus_one")


# ----------------------------------------------------------------------------- rotary


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for rotary embeddings, with linear or llama3 scaling."""
    # on the CPU even under a meta device context (the loader's): a meta tensor's arithmetic runs
    # torch's Python reference ops, whose first call imports torch._dynamo (~1.4 s of a start-up)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float()
    # llama3: long wavelengths slowed by `factor`, short ones kept, smooth blend between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, blended, out).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (HF layout). x: [B, T, H, Dh]; cos, sin: [T, Dh]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for positions, computed on demand in fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.params = (head_dim, theta, scaling)
        self._key = repr(self.params)  # identifies the tables in _latest
        self.register_buffer("inv_freq", rope_inv_freq(*self.params), persistent=False)

    def reset(self, device) -> None:
        """Recompute the table (after the module was allocated without initialisation)."""
        self.inv_freq = rope_inv_freq(*self.params).to(device)

    _latest: dict = {}  # (params, device, start, T) -> (cos, sin): one forward's tables, shared by layers

    def forward(self, positions: torch.Tensor, start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] (= start .. start + T - 1 when start is given) -> cos, sin: [T, Dh]
        key = (self._key, str(self.inv_freq.device), start, len(positions)) if start is not None else None
        if key is not None and key in Rotary._latest:
            return Rotary._latest[key]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        out = emb.cos(), emb.sin()
        if key is not None:
            if len(Rotary._latest) >= 8:  # a new step: the previous ones are not needed again
                Rotary._latest.clear()
            Rotary._latest[key] = out
        return out


# ----------------------------------------------------------------------------- attention


def attention_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """Boolean mask [T, S]: query at absolute position q_pos[t] may see key s."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


_HALF = (torch.float16, torch.bfloat16)
_HOST: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its data_ptr, HostMatrix over its memory)
# (an entry keeps the memory it views alive until the weight dies or is next used on the CPU: a weight
# moved in place to the GPU after a one-token CPU product holds its old host copy until then)


def half_gemv_ready(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether x @ w.T takes `half_gemv`: one token, on the CPU, w a contiguous float16/bfloat16 matrix,
    and no autograd to record."""
    return (x.device.type == "cpu" and x.numel() == x.shape[-1] and w.dtype in _HALF and w.device.type == "cpu"
            and w.dim() == 2 and w.is_contiguous() and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))


def half_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x @ w.T for one token over w's float16/bfloat16 memory in numba's GEMV (sparse_ops.cpu.gemv:
    the weights widened in registers, float32 sums), where torch's float16 GEMV on the CPU reads at
    half the rate (2-core AVX-512 Xeon, 4096 x 4096: 12 against 25 GB/s; bfloat16 23 against 26).
    w: [N, D] (see half_gemv_ready); x: [..., D] with one token -> float32 [..., N]."""
    entry = _HOST.get(id(w))
    if entry is None or entry[0]() is not w or entry[1] != w.data_ptr():  # (rebuilt if w's memory is replaced)
        if entry is None:
            weakref.finalize(w, _HOST.pop, id(w), None)
        entry = _HOST[id(w)] = (weakref.ref(w), w.data_ptr(), HostMatrix.from_torch(w.detach()))
    y = gemv(entry[2], np.ascontiguousarray(x.reshape(-1).float().numpy()))  # [N]
    return torch.from_numpy(y).reshape(*x.shape[:-1], -1)


def _input_sparse(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(linear(s(x)) when its input-major copy computes it, else None; s(x)): s zeroes the entries of x
    with |x| <= the linear's input threshold. One-token calls count the inputs kept."""
    d = linear.__dict__
    one = x.device.type == "cpu" and x.numel() == x.shape[-1] and not torch.is_grad_enabled()
    im = d.get("input_major")
    if one and im is not None:
        y = torch.from_numpy(im_gemv(im, x.detach().reshape(-1).float().numpy()))
        if getattr(linear, "bias", None) is not None:
            y += linear.bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype), x
    keep = x.abs() > d["input_threshold"]
    if one:
        d["input_counter"] += (int(keep.sum()), x.numel())
    return None, x * keep


def project(linear: nn.Module, x: torch.Tensor, widen: bool = True) -> torch.Tensor:
    """linear(x). On the CPU with float16/bfloat16 weights: one token, a memory-bound GEMV, through
    `half_gemv`; with widen, several float16 tokens in float32 (CPU float16 GEMM ran at 47 GFLOP/s
    against 120 in float32 on a 2-core AVX-512 machine; the FFNs' larger matrices prefill faster
    without widening them per call: a 32-layer 7B shape, 64 tokens, 9.6 against 5.9 tok/s). A linear
    with hooks is always called. A linear given an input threshold (executors/input_sparse.py) sees its
    input zeroed at or below it; one token on the CPU reads only the surviving inputs' weights from
    its input-major copy."""
    if "input_threshold" in linear.__dict__:
        y, x = _input_sparse(linear, x)
        if y is not None:
            return y
    if x.device.type != "cpu" or not isinstance(linear, nn.Linear) or linear._forward_hooks or linear._forward_pre_hooks:
        return linear(x)
    w, b = linear.weight, linear.bias
    if half_gemv_ready(w, x):
        y = half_gemv(w, x)
        if b is not None:
            y += b.float()
        return y.to(x.dtype)
    if not widen or x.dtype != torch.float16 or x.numel() == x.shape[-1]:
        return linear(x)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional biases, QK-norm and rotary (or none, for OPT)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.query_scale
        self.window = c.sliding_window if c.is_sliding(layer) else None
        self.q = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attn_bias)
        self.k = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attn_bias)
        self.v = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attn_bias)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.model_type == "opt")
        if c.qk_norm:
            self.q_norm = make_norm(c, c.head_dim)
            self.k_norm = make_norm(c, c.head_dim)
        self.rotary = None if c.model_type == "opt" else Rotary(c.head_dim, *c.rope_for_layer(layer))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv: tuple | None,
                start: int | None = None) -> torch.Tensor:
        # x: [B, T, D]; positions: [T] absolute, starting at `start` (given as an int, it saves a
        # device sync per layer); cache_kv: (k_buf, v_buf) each [B, Hkv, S_max, Dh] or None
        B, T, _ = x.shape
        if B == T == 1 and x.device.type == "cpu" and cache_kv is not None and \
                cache_kv[0].dtype in (torch.float32, torch.float16):
            return self._decode_cpu(x, positions, cache_kv, start)
        q, k, v = self._qkv(x, positions, start)
        if cache_kv is not None:
            k_buf, v_buf = cache_kv
            start = int(positions[0]) if start is None else start
            k_buf[:, :, start : start + T] = k
            v_buf[:, :, start : start + T] = v
            k, v = k_buf[:, :, : start + T], v_buf[:, :, : start + T]
            if k.device.type == "cpu" and k.dtype == torch.float16:  # a half model's CPU cache (see kv_dtype)
                k, v = k.float(), v.float()
            q = q.to(k.dtype)  # float32 over a half model's CPU cache
            if T > 1 and q.is_cuda and self.window is None:
                return self._attend_chunk(q, k, v, x.dtype)
        return self._attend(q, k, v, positions, x.dtype)

    def forward_static(self, x: torch.Tensor, positions: torch.Tensor, cache_kv: tuple) -> torch.Tensor:
        """forward with the cache, in fixed shapes and without reading positions on the host (so
        that a CUDA graph can capture it): the new keys/values are written at `positions` with
        index_copy_, and the queries attend over the whole cache, masked (the cache must hold no
        NaN/inf beyond the written positions: KVCache zero-fills on CUDA). Same arguments as forward."""
        k_buf, v_buf = cache_kv
        q, k, v = self._qkv(x, positions, None)
        k_buf.index_copy_(2, positions, k.to(k_buf.dtype))
        v_buf.index_copy_(2, positions, v.to(v_buf.dtype))
        return self._attend(q.to(k_buf.dtype), k_buf, v_buf, positions, x.dtype)

    def _decode_cpu(self, x: torch.Tensor, positions: torch.Tensor, cache_kv: tuple, start: int | None) -> torch.Tensor:
        """forward for one token on the CPU with a float32 or float16 cache: rotary, cache write and
        attention in one numba call (sparse_ops.attention) instead of ~30 torch ops. x: [1, 1, D] -> [1, 1, D]."""
        qkv = getattr(self, "qkv", None)  # q, k, v rows in one matrix (models/quantized.py fuse_qkv)
        if qkv is not None:
            if isinstance(qkv, torch.Tensor):  # float16 / bfloat16 rows
                y = half_gemv(qkv, x)  # [1, 1, Nq + 2 Nk] float32
                if self.qkv_bias is not None:
                    y += self.qkv_bias
                y = y.to(x.dtype).reshape(-1)
            else:
                y = torch.from_numpy(qgemv(qkv, np.ascontiguousarray(x.reshape(-1).float().numpy()))).to(x.dtype)
            q, k, v = y.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim])
            q, k, v = q.reshape(self.n_heads, self.head_dim), k.reshape(self.n_kv, -1), v.reshape(self.n_kv, -1)
        else:
            q = project(self.q, x).detach().reshape(self.n_heads, self.head_dim)
            k = project(self.k, x).detach().reshape(self.n_kv, self.head_dim)
            v = project(self.v, x).detach().reshape(self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):  # an RMSNorm's decode-step form takes the heads' rows in one call
            q, k = (getattr(n, "rows", n)(t) for n, t in ((self.q_norm, q), (self.k_norm, k)))
        pos = int(positions[0]) if start is None else start
        cos = sin = None
        if self.rotary is not None:
            cos, sin = (t[0].numpy() for t in self.rotary(positions, start))  # [Dh] each
        f32 = lambda t: np.ascontiguousarray(t.detach().float().numpy())  # noqa: E731
        out = decode_attention(f32(q), f32(k), f32(v), cache_kv[0][0].numpy(), cache_kv[1][0].numpy(), pos,
                               self.scale, cos, sin, self.window)  # [H, Dh]
        return project(self.o, torch.from_numpy(out).reshape(1, 1, -1).to(x.dtype))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, start: int | None):
        # x: [B, T, D] -> q [B, H, T, Dh], k, v [B, Hkv, T, Dh], normed and rotated
        B, T, _ = x.shape
        q = project(self.q, x).view(B, T, self.n_heads, self.head_dim)
        k = project(self.k, x).view(B, T, self.n_kv, self.head_dim)
        v = project(self.v, x).view(B, T, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None and fused_ready(q) and positions.is_cuda:  # one Triton kernel each
            q, k = (rope_cuda(t, positions, self.rotary.inv_freq) for t in (q, k))
        elif self.rotary is not None:
            cos, sin = self.rotary(positions, start)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, k, v, positions, dtype) -> torch.Tensor:
        # q: [B, H, T, Dh]; k, v: [B, Hkv, S, Dh] (key s at absolute position s) -> [B, T, D]
        mask = attention_mask(positions, k.shape[2], self.window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_kv != self.n_heads
        )  # [B, H, T, Dh]
        return self._out(out, dtype)

    def _attend_chunk(self, q, k, v, dtype) -> torch.Tensor:
        """_attend for a prompt chunk on CUDA whose keys are every position up to its last (the cache's
        first S): the causal mask aligned to the keys' end, which the flash and memory-efficient kernels
        apply without writing the [H, T, S] scores a boolean mask costs (512 MiB for 32 heads, a
        1,024-token chunk and 4,096 keys). Those kernels take the queries' heads: GQA's keys and values
        are repeated (2 x H x S x Dh elements)."""
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: ~1 s of every start

        T = q.shape[2]
        if self.n_kv != self.n_heads:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, k.shape[2]), scale=self.scale)
        return self._out(out, dtype)

    def _out(self, out: torch.Tensor, dtype) -> torch.Tensor:
        # the heads' outputs [B, H, T, Dh] through o -> [B, T, D] in dtype
        B, _, T, _ = out.shape
        return project(self.o, out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim).to(dtype))


# ----------------------------------------------------------------------------- FFNs


def activation_fn(name: str):
    if name == "silu":
        return F.silu
    if name == "relu":
        return F.relu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name}")


class FFN(nn.Module):
    """Base of the replaceable per-layer FFN: forward(x: [B, T, D]) -> [B, T, D]."""

    kind = "ffn"

    def host_decode(self, x: np.ndarray, out: np.ndarray) -> bool:
        """One token's FFN on host float32 arrays, x [D] -> out [D], where this FFN can compute it so,
        without its module call (the CPU's fused one-token step calls it, models/cpu_step.py);
        returns False where it cannot, and the caller runs forward instead."""
        return False


class DenseFFN(FFN):
    """Ungated FFN with biases (OPT): down(act(up x + b1)) + b2."""

    kind = "dense"

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=True)
        self.down = nn.Linear(hidden, dim, bias=True)
        self.act = activation_fn(act)
        self.act_name = act

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input h: [B, T, I]."""
        return self.act(project(self.up, x, widen=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down, self.activations(x), widen=False)


class GatedFFN(FFN):
    """Gated FFN (SwiGLU, GeGLU): down(act(gate x) * up x)."""

    kind = "gated"

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.act = activation_fn(act)
        self.act_name = act

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input h: [..., I]."""
        return self.act(project(self.gate, x, widen=False)) * project(self.up, x, widen=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down, self.activations(x), widen=False)


class Experts(nn.Module):
    """E gated experts stored stacked: gate, up [E, I, D]; down [E, D, I]."""

    def __init__(self, n: int, dim: int, hidden: int, act: str, device=None):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n, hidden, dim, device=device))
        self.up = nn.Parameter(torch.empty(n, hidden, dim, device=device))
        self.down = nn.Parameter(torch.empty(n, dim, hidden, device=device))
        self.act_name = act
        self.act = activation_fn(act)

    @property
    def n(self) -> int:
        return self.gate.shape[0]

    def activations(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's down-projection input. x: [N, D] -> h: [N, I]."""
        return self.act(x @ self.gate[e].T) * (x @ self.up[e].T)

    def down_proj(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's down projection. h: [N, I] -> [N, D]."""
        return h @ self.down[e].T

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> [N, D]
        return self.down_proj(e, self.activations(e, x))


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing. logits: [N, E] -> (weights [N, k] fp32, expert ids [N, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


class MoEFFN(FFN):
    """Top-k mixture of experts with an optional sigmoid-gated shared expert (Qwen2-MoE)."""

    kind = "moe"

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = config
        self.top_k, self.renormalise = c.top_k, c.norm_topk_prob
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, c.activation)
        if c.shared_expert_intermediate_size:
            self.shared = GatedFFN(c.hidden_size, c.shared_expert_intermediate_size, c.activation)
            self.shared_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        weights, ids = route(self.router(x), self.top_k, self.renormalise)  # [N, k]
        out = self.mix(x, weights, ids, self.experts.expert)
        return self.add_shared(x, out).reshape(shape)

    @staticmethod
    def mix(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert_fn) -> torch.Tensor:
        """Sum of each token's routed experts' outputs. x: [N, D]; weights, ids: [N, k]; expert_fn(e, x_e)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            y = expert_fn(e, x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        return out

    def add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add the sigmoid-gated shared expert, when the family has one. x, out: [N, D]."""
        if hasattr(self, "shared"):
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


def make_ffn(config: ModelConfig, layer: int) -> FFN:
    kind = config.ffn_kind(layer)
    if kind == "moe":
        return MoEFFN(config)  # type: ignore[arg-type]
    if kind == "dense":
        return DenseFFN(config.hidden_size, config.intermediate_size, config.activation)
    return GatedFFN(config.hidden_size, config.intermediate_size, config.activation)
