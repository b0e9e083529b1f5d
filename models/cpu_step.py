"""A quantised block's one-token decode step on the CPU as one numba call.

The module path of a decode step on the CPU (norm, q/k/v, attention, o, norm, gate, up, down) calls
the same numba kernels but goes through ~10 torch modules and ~30 tensor conversions a layer: on
SmolLM2-135M (30 layers, 2 cores) 6 ms of a 10.5 ms token were Python and torch around 4.4 ms of
kernels. Here a block whose weights are GGUF blocks (QuantLinear) runs its whole step in one call of
`_block_step`, which calls those kernels in order over preallocated float32 buffers:

    x ─ attn_norm ─ q, k, v (one GEMV when fused) ─ (q/k norm) ─ rotary, cache write, attention ─ o
      ─ (post_attn_norm) ─ + x = r ─ ffn_norm ─ act(gate) * up ─ down ─ (post_ffn_norm) ─ + r

It applies to pre-norm blocks with RMSNorm, Attention and a GatedFFN whose projections are all
QuantLinear without biases but q/k/v's, float32 activations, a float32 or float16 KV cache, and no
hooks on any of the block's modules (the profiler's probes, the look-ahead's residual hook and the
sparse forward see the module path). `block_step` returns None where it does not apply, and always
with HOTCOLD_CPU_STEP=0. The kernels
are the module path's own; what differs is the order of float32 roundings in a few elementwise
ops (the activation, the residual adds), within 1e-6 of the module path's logits.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from numba import njit

from hotcold.models.layers import Attention, GatedFFN, RMSNorm
from hotcold.models.quantized import QuantLinear
from hotcold.sparse_ops.attention import _decode_attention
from hotcold.sparse_ops.cpu import ACTS, _act
from hotcold.sparse_ops.norm import _rms_norm
from hotcold.sparse_ops.quant import XQ_DEFAULT, QuantMatrix, _qgemv_rows_kernel, _qgemv_x8_kernel


@njit(nogil=True, cache=True)
def _gemv(m, x, out):
    # m: (type id, interleaved, Q8 activations, data uint8 [R, B], rows int64 [R]); x [cols] -> out [R]
    if m[1]:
        _qgemv_x8_kernel(m[0], m[3], x, out)
    else:
        _qgemv_rows_kernel(m[0], m[3], m[4], x, m[2], out)


@njit(nogil=True, cache=True)
def _norm(x, w, eps, plus_one, out):
    # one row: x, w, out [D]
    _rms_norm(x.reshape(1, -1), w, eps, plus_one, out.reshape(1, -1))


@njit(nogil=True, cache=True)
def _block_step(x, norms, eps, plus_one, sandwich, qkv, q, k, v, fused, bias, has_bias, qk_norm, H, Hkv, Dh,
                cos, sin, rotary, k_cache, v_cache, pos, lo, scale, o, gate, up, down, act, buf, y):
    # x [D] -> y [D]. norms: float32 [6, D'] rows attn, ffn, post-attn, post-ffn norm weights (the
    # last two only with sandwich) and q/k norm weights (rows 4, 5, first Dh entries); matrices as in
    # _gemv; bias: float32 [(H + 2 Hkv) Dh] (q, k, v); buf: float32 scratch (see block_step).
    D = x.shape[0]
    nq, nk = H * Dh, Hkv * Dh
    I = gate[4].shape[0]
    xn = buf[:D]
    qkv_out = buf[D:D + nq + 2 * nk]
    att = buf[D + nq + 2 * nk:D + 2 * nq + 2 * nk]
    h = buf[D + 2 * nq + 2 * nk:D + 2 * nq + 2 * nk + D]
    g = buf[2 * D + 2 * nq + 2 * nk:2 * D + 2 * nq + 2 * nk + I]
    u = buf[2 * D + 2 * nq + 2 * nk + I:2 * D + 2 * nq + 2 * nk + 2 * I]
    scores = buf[2 * D + 2 * nq + 2 * nk + 2 * I:]
    _norm(x, norms[0, :D], eps, plus_one, xn)
    if fused:
        _gemv(qkv, xn, qkv_out)
    else:
        _gemv(q, xn, qkv_out[:nq])
        _gemv(k, xn, qkv_out[nq:nq + nk])
        _gemv(v, xn, qkv_out[nq + nk:])
    if has_bias:
        for i in range(nq + 2 * nk):
            qkv_out[i] += bias[i]
    qh = qkv_out[:nq].reshape(H, Dh)
    kh = qkv_out[nq:nq + nk].reshape(Hkv, Dh)
    vh = qkv_out[nq + nk:].reshape(Hkv, Dh)
    if qk_norm:
        for i in range(H):
            _norm(qh[i], norms[4, :Dh], eps, plus_one, qh[i])
        for i in range(Hkv):
            _norm(kh[i], norms[5, :Dh], eps, plus_one, kh[i])
    _decode_attention(qh, kh, vh, cos, sin, rotary, k_cache, v_cache, pos, lo, scale,
                      scores[:H * (pos + 1 - lo)].reshape(H, pos + 1 - lo), att.reshape(H, Dh))
    _gemv(o, att, h)
    if sandwich:
        _norm(h, norms[2, :D], eps, plus_one, h)
    for i in range(D):
        y[i] = x[i] + h[i]
    _norm(y, norms[1, :D], eps, plus_one, xn)
    _gemv(gate, xn, g)
    _gemv(up, xn, u)
    for i in range(I):
        g[i] = _act(g[i], act) * u[i]
    _gemv(down, g, h)
    if sandwich:
        _norm(h, norms[3, :D], eps, plus_one, h)
    for i in range(D):
        y[i] += h[i]


def _mat(lin) -> tuple | None:
    m = lin.qweight if isinstance(lin, QuantLinear) else lin
    if not isinstance(m, QuantMatrix):
        return None
    if m._all_rows is None:
        m._all_rows = np.arange(m.rows, dtype=np.int64)
    return (m._id, bool(m.interleaved), bool(m.interleaved or m.qtype in XQ_DEFAULT), m.data, m._all_rows)


def _hooked(module: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _parts(block) -> tuple:
    """The modules and weights a _Step was built from (it is rebuilt when any is replaced)."""
    a, f = block.attn, block.ffn
    lins = [getattr(a, n, None) for n in ("q", "k", "v", "o")] + [getattr(f, n, None) for n in ("gate", "up", "down")]
    return (a, f, getattr(a, "qkv", None), *lins, *(getattr(lin, "qweight", None) for lin in lins))


class _Refused:
    refused = True

    def __init__(self, parts: tuple):
        self.parts = parts


class _Step:
    """A block's static arguments to _block_step and its scratch buffer."""

    refused = False

    def __init__(self, block, norms, eps, plus_one, mats, bias, qk_norm, act):
        a = block.attn
        self.parts = _parts(block)
        self.norms, self.eps, self.plus_one, self.sandwich = norms, np.float32(eps), plus_one, bool(block.sandwich)
        self.mats, self.bias, self.qk_norm, self.act = mats, bias, qk_norm, act
        self.heads = (a.n_heads, a.n_kv, a.head_dim)
        self.scale, self.window = np.float32(a.scale), a.window
        self.no_rot = np.zeros(a.head_dim, np.float32)
        self.buf = np.empty(0, np.float32)

    def scratch(self, pos: int, d: int, inter: int) -> np.ndarray:
        H, Hkv, Dh = self.heads
        need = 2 * d + 2 * H * Dh + 2 * Hkv * Dh + 2 * inter + H * (pos + 1)
        if self.buf.shape[0] < need:
            self.buf = np.empty(max(need, 2 * self.buf.shape[0]), np.float32)
        return self.buf


def _prepare(block) -> _Step | None:
    """The block's _Step, or None where the fused step does not apply (see the module docstring)."""
    a, f = block.attn, block.ffn
    norms = [block.attn_norm, block.ffn_norm] + ([block.post_attn_norm, block.post_ffn_norm] if block.sandwich else [])
    if not (block.pre_norm and type(a) is Attention and type(f) is GatedFFN
            and all(type(n) is RMSNorm for n in norms) and getattr(f, "act_name", None) in ACTS):
        return None
    qk_norm = hasattr(a, "q_norm")
    if qk_norm and not (type(a.q_norm) is RMSNorm and type(a.k_norm) is RMSNorm):
        return None
    kinds = {(n.eps, n.plus_one) for n in norms + ([a.q_norm, a.k_norm] if qk_norm else [])}
    if len(kinds) != 1:
        return None
    eps, plus_one = kinds.pop()
    lins = [a.q, a.k, a.v, a.o, f.gate, f.up, f.down]
    if not all(type(lin) is QuantLinear for lin in lins) or any(lin.bias is not None for lin in (a.o, f.gate, f.up, f.down)):
        return None
    biased = [lin.bias is not None for lin in (a.q, a.k, a.v)]
    if any(biased) and not all(biased):
        return None
    qkv = getattr(a, "qkv", None)
    mats = [_mat(qkv) if qkv is not None else _mat(a.q)] + [_mat(lin) for lin in lins]
    if any(m is None for m in mats):
        return None
    D, Dh = block.attn_norm.weight.shape[0], a.head_dim
    width = max(D, Dh)
    norms_arr = np.zeros((6, width), np.float32)
    for i, n in enumerate(norms):
        norms_arr[i, :D] = n.weight.detach().float().numpy()
    if qk_norm:
        norms_arr[4, :Dh] = a.q_norm.weight.detach().float().numpy()
        norms_arr[5, :Dh] = a.k_norm.weight.detach().float().numpy()
    bias = (np.concatenate([lin.bias.detach().float().numpy() for lin in (a.q, a.k, a.v)]) if all(biased)
            else np.zeros(1, np.float32))
    step = _Step(block, norms_arr, eps, plus_one, mats, bias, qk_norm, ACTS[f.act_name])
    step.fused, step.has_bias = qkv is not None, all(biased)
    return step


ENABLED = os.environ.get("HOTCOLD_CPU_STEP", "1") != "0"  # HOTCOLD_CPU_STEP=0: always the module path


def block_step(block, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None) -> torch.Tensor | None:
    """block(x, positions, cache_kv, start) for one token on the CPU as one numba call, or None where
    the fused step does not apply (then the caller runs the module path). x: [1, 1, D] -> [1, 1, D]."""
    if (not ENABLED or x.shape[0] != 1 or x.shape[1] != 1 or x.device.type != "cpu" or x.dtype != torch.float32
            or cache_kv is None or cache_kv[0].dtype not in (torch.float32, torch.float16) or torch.is_grad_enabled()):
        return None
    step = block.__dict__.get("_cpu_step")
    if step is None or step.parts != _parts(block):  # first use, or modules replaced since (a split, hooks)
        step = _prepare(block) or _Refused(_parts(block))
        block.__dict__["_cpu_step"] = step
    if step.refused or _hooked(block):
        return None
    a = block.attn
    pos = int(positions[0]) if start is None else start
    if a.rotary is not None:
        cos, sin = (t[0].numpy() for t in a.rotary(positions, start))
    else:
        cos = sin = step.no_rot
    kc, vc = cache_kv[0][0].numpy(), cache_kv[1][0].numpy()
    if kc.dtype == np.float16:
        kc, vc = kc.view(np.int16), vc.view(np.int16)
    lo = max(0, pos - step.window + 1) if step.window else 0
    H, Hkv, Dh = step.heads
    xv = np.ascontiguousarray(x.detach().reshape(-1).numpy())
    m = step.mats
    buf = step.scratch(pos, xv.shape[0], m[5][4].shape[0])
    y = np.empty_like(xv)
    _block_step(xv, step.norms, step.eps, step.plus_one, step.sandwich, m[0], m[1], m[2], m[3], step.fused,
                step.bias, step.has_bias, step.qk_norm, H, Hkv, Dh, cos, sin, a.rotary is not None, kc, vc, pos, lo,
                step.scale, m[4], m[5], m[6], m[7], step.act, buf, y)
    return torch.from_numpy(y).reshape(x.shape)
