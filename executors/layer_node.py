"""LayerHostNode: the host's whole share of one token's step through a layer whose attention and
predictor the plan puts on the CPU, as one compiled function (a numba cfunc, no Python, no GIL).

HostBlock's module path does that share in ~40 torch and numba calls a layer, each with its Python
and dispatch around kernels of 50-500 µs: a 13B-shaped CPU-attention layer spends about a fifth of
its time between its parts (5.8-6.0 ms where the parts take 4.8-5.0 on a 16-core host). Here one
call does

    x ─ attn_norm ─ q/k/v GEMV(s) (+ bias) ─ rotary, cache write, attention ─ o (+ bias) ─ + x = res
      ─ ffn_norm = f ─ predictor: relu(W1 f + b1) → W2 · + b2 > threshold = mask (hot-first)
      ─ cold rows (mask[H:]) = cold

over fixed host buffers: `x` and the position in, `up` = [f, res, cold] and `mask` out. The fast tier
then computes the hot rows of f (mask[:H]) and adds: out = res + hot + cold. HostBlock calls the
function on the CPU worker (`__call__`) or, on CUDA with graphs, records it as a host node between
the D2H copy of x and the H2D copy of `up` (`launch`), so the layer is one graph replay.

On CUDA the graphed call (the default) and the eager one (EngineOptions.layer_graphs off, and what --stats
runs) decode at the same rate within the spread between runs. As a host node the call runs on CUDA's
callback thread, whose numba OpenMP team sits beside the main thread's; that second team costs less
than the spread between runs.

The kernels are the module path's own (`gemv`'s row kernel or the GGUF block kernels, the decode
attention kernel, RMSNorm, the cold FFN rows of FFNHostNode); norms and the residual are float32
throughout (the module path rounds them to the model's dtype between parts). It applies to pre-norm
blocks with RMSNorm (one eps and kind; QK-norm after the biases, a sandwich block's post-attention
norm before the residual, its post-FFN norm on the fast tier), whose matrices are host matrices of
any kind (each is dispatched on its storage at run time: MODES), with a float32 or float16 KV cache
(`layer_node_ready`). The function compiled for a layer leaves out the kernels it cannot call: the
GGUF block kernels where no matrix is in blocks, the cold rows of other storage (`layer_function`).

Control block: the cold FFN's slots of FFNHostNode (0..22, so its row functions read them), then the
layer's (below), then six matrices of 8 slots each (q or the fused q/k/v, k, v, o, predictor W1, W2).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from torch import nn

from hotcold.executors import host_node as hn
from hotcold.executors.host_node import (F_C, F_D, F_OUT, F_X, KIND_CODES, THREADS, _end, _ffn_float, _ffn_quant, _Node,
                                         _now_ns, _set_num_threads, _void_ptr, cold_slots)
from hotcold.models.layers import Attention, RMSNorm
from hotcold.sparse_ops.attention import _decode_attention
from hotcold.sparse_ops.cpu import HostMatrix, _gemv_rows_kernel
from hotcold.sparse_ops.norm import _rms_norm
from hotcold.sparse_ops import quant as block_quant  # its XQ_DEFAULT read when a node is built (tests patch it)
from hotcold.sparse_ops.quant import QuantMatrix, qgemv_rows_kernel, qgemv_x8_kernel

# the layer's slots
(L_X, L_POS, L_S, L_RES, L_MASK, L_I, L_FP, L_NA, L_NF, L_PLUS1, L_H, L_HKV, L_DH, L_KC, L_VC, L_COS, L_SIN,
 L_ROT, L_WIN, L_BUF, L_BUF_N, L_QB, L_KB, L_VB, L_OB, L_P1B, L_P2B, L_PRED, L_COLD_NS, L_ROWS,
 L_QN, L_KN, L_PAN) = range(23, 56)
# a matrix's slots (offsets): data, row scales (float kinds), data's two dims, output rows, GGUF type id,
# storage (MODES), Q8 activations
M_ADDR, M_SCALE, M_R0, M_R1, M_N, M_QID, M_MODE, M_XQ = range(8)
L_Q, L_K, L_V, L_O, L_P1, L_P2 = range(56, 104, 8)
N_LCTL = 104
FP_EPS, FP_SCALE, FP_THRESHOLD = range(3)
# storage of a matrix or of the cold rows: HostMatrix kinds, GGUF rows (host_node's codes), GGUF rows
# interleaved (pack_rows)
MODES = {**KIND_CODES, "interleaved": 5}


@numba.njit(nogil=True, cache=True)
def _begin(user):
    ctl = numba.carray(user, (N_LCTL,), np.int64)
    t0 = _now_ns()
    _set_num_threads(ctl[THREADS])
    return ctl, t0


@numba.njit(nogil=True, cache=True)
def _float_mv(ctl, m, dt, rows, x, out):
    r0 = ctl[m + M_R0]
    w = numba.carray(_void_ptr(ctl[m + M_ADDR]), (r0, ctl[m + M_R1]), dt)
    _gemv_rows_kernel(w, numba.carray(_void_ptr(ctl[m + M_SCALE]), (r0,), np.float32), rows, x, out)


@numba.njit(nogil=True, cache=True)
def _mv(ctl, m, x, out, quant):
    # out[:N] = the matrix at slots m.. times x (x float32 [cols] -> out float32 [N]); quant None: the
    # GGUF block branch is pruned at compile time (numba drops `is None` branches on a None argument).
    # Callers pass slot numbers (here and to _norm, _bias) as np.int64(slot): a literal one would compile
    # a copy of the function per slot
    n, mode = ctl[m + M_N], ctl[m + M_MODE]
    rows = numba.carray(_void_ptr(ctl[L_ROWS]), (n,), np.int64)  # 0 .. n-1
    if mode == 0:
        _float_mv(ctl, m, np.float32, rows, x, out)
    elif mode == 1:
        _float_mv(ctl, m, np.uint16, rows, x, out)  # bfloat16 bits
    elif mode == 2:
        _float_mv(ctl, m, np.int16, rows, x, out)  # float16 bits
    elif mode == 3:
        _float_mv(ctl, m, np.int8, rows, x, out)
    elif quant is not None:
        data = numba.carray(_void_ptr(ctl[m + M_ADDR]), (ctl[m + M_R0], ctl[m + M_R1]), np.uint8)
        if mode == 4:
            qgemv_rows_kernel(ctl[m + M_QID], data, rows, x, ctl[m + M_XQ] != 0, out)
        else:
            qgemv_x8_kernel(ctl[m + M_QID], data, x, out)


@numba.njit(nogil=True, cache=True)
def _bias(ctl, slot, out):
    if ctl[slot] != 0:
        b = numba.carray(_void_ptr(ctl[slot]), (out.shape[0],), np.float32)
        for i in range(out.shape[0]):
            out[i] += b[i]


@numba.njit(nogil=True, cache=True)
def _norm(ctl, slot, x, out):
    # RMSNorm of one row x [D] with the weights at slot -> out [D]
    fp = numba.carray(_void_ptr(ctl[L_FP]), (3,), np.float32)
    w = numba.carray(_void_ptr(ctl[slot]), (x.shape[0],), np.float32)
    _rms_norm(x.reshape(1, -1), w, fp[FP_EPS], ctl[L_PLUS1] != 0, out.reshape(1, -1))


@numba.njit(nogil=True, cache=True)
def _layer(ctl, ct, quant, quant_cold, cold):
    # the module docstring's step; ct: the cache's storage (float32, int16 float16 bits); quant: None
    # where no matrix is in GGUF blocks; cold rows in GGUF blocks (quant_cold not None) or as a float
    # or int8 kind (cold: its numpy type; else None) -> cold rows computed, or -1 (a position outside
    # the cache). numba prunes an `is None` branch on a None argument before typing it: each variant
    # compiles only the kernels it can call
    D, S = ctl[F_D], ctl[L_S]
    H, Hkv, Dh = ctl[L_H], ctl[L_HKV], ctl[L_DH]
    nq, nk = H * Dh, Hkv * Dh
    pos = numba.carray(_void_ptr(ctl[L_POS]), (1,), np.int64)[0]
    if pos < 0 or pos >= S:
        return -1
    fp = numba.carray(_void_ptr(ctl[L_FP]), (3,), np.float32)
    x = numba.carray(_void_ptr(ctl[L_X]), (D,), np.float32)
    buf = numba.carray(_void_ptr(ctl[L_BUF]), (ctl[L_BUF_N],), np.float32)
    xn, qkv, att, h = buf[:D], buf[D:D + nq + 2 * nk], buf[D + nq + 2 * nk:D + 2 * nq + 2 * nk], buf[D + 2 * nq + 2 * nk:2 * D + 2 * nq + 2 * nk]
    rest = buf[2 * D + 2 * nq + 2 * nk:]
    _norm(ctl, np.int64(L_NA), x, xn)
    if ctl[L_K] == 0:  # q/k/v rows in one matrix
        _mv(ctl, np.int64(L_Q), xn, qkv, quant)
    else:
        _mv(ctl, np.int64(L_Q), xn, qkv[:nq], quant)
        _mv(ctl, np.int64(L_K), xn, qkv[nq:nq + nk], quant)
        _mv(ctl, np.int64(L_V), xn, qkv[nq + nk:], quant)
    _bias(ctl, np.int64(L_QB), qkv[:nq])
    _bias(ctl, np.int64(L_KB), qkv[nq:nq + nk])
    _bias(ctl, np.int64(L_VB), qkv[nq + nk:])
    if ctl[L_QN] != 0:  # QK-norm: each head's row of q and of k
        for i in range(H):
            _norm(ctl, np.int64(L_QN), qkv[i * Dh:(i + 1) * Dh], qkv[i * Dh:(i + 1) * Dh])
        for i in range(Hkv):
            _norm(ctl, np.int64(L_KN), qkv[nq + i * Dh:nq + (i + 1) * Dh], qkv[nq + i * Dh:nq + (i + 1) * Dh])
    rotary = ctl[L_ROT] != 0
    if rotary:
        cos = numba.carray(_void_ptr(ctl[L_COS]), (S, Dh), np.float32)[pos]
        sin = numba.carray(_void_ptr(ctl[L_SIN]), (S, Dh), np.float32)[pos]
    else:
        cos = sin = np.zeros(Dh, np.float32)
    win = ctl[L_WIN]
    lo = max(0, pos - win + 1) if win > 0 else 0
    k_cache = numba.carray(_void_ptr(ctl[L_KC]), (Hkv, S, Dh), ct)
    v_cache = numba.carray(_void_ptr(ctl[L_VC]), (Hkv, S, Dh), ct)
    n = pos + 1 - lo
    _decode_attention(qkv[:nq].reshape(H, Dh), qkv[nq:nq + nk].reshape(Hkv, Dh), qkv[nq + nk:].reshape(Hkv, Dh),
                      cos, sin, rotary, k_cache, v_cache, pos, lo, fp[FP_SCALE], rest[:H * n].reshape(H, n),
                      att.reshape(H, Dh))
    _mv(ctl, np.int64(L_O), att, h, quant)
    _bias(ctl, np.int64(L_OB), h)
    if ctl[L_PAN] != 0:  # sandwich norms: the attention's output normed before the residual
        _norm(ctl, np.int64(L_PAN), h, h)
    res = numba.carray(_void_ptr(ctl[L_RES]), (D,), np.float32)
    f = numba.carray(_void_ptr(ctl[F_X]), (D,), np.float32)
    for i in range(D):
        res[i] = x[i] + h[i]
    _norm(ctl, np.int64(L_NF), res, f)
    if ctl[L_PRED] != 0:  # the predictor: its hidden layer in rest[:r], its scores after
        r, m = ctl[L_P1 + M_N], ctl[L_I]
        z, y = rest[:r], rest[r:r + m]
        _mv(ctl, np.int64(L_P1), f, z, quant)
        _bias(ctl, np.int64(L_P1B), z)
        for i in range(r):
            if z[i] < 0:
                z[i] = 0.0
        _mv(ctl, np.int64(L_P2), z, y, quant)
        _bias(ctl, np.int64(L_P2B), y)
        mask = numba.carray(_void_ptr(ctl[L_MASK]), (m,), np.uint8)
        for i in range(m):
            mask[i] = 1 if y[i] > fp[FP_THRESHOLD] else 0
    t1 = _now_ns()
    done = 0
    if ctl[F_C] == 0:
        out = numba.carray(_void_ptr(ctl[F_OUT]), (D,), np.float32)
        out[:] = 0.0
    else:
        if quant_cold is not None:  # (numba compiles only the branch whose argument is not None)
            done = _ffn_quant(ctl)
        if cold is not None:
            done = _ffn_float(ctl, cold)
    ctl[L_COLD_NS] += _now_ns() - t1
    return done


# A cfunc's types are fixed when it compiles: one host function per cache storage, per "any matrix in
# GGUF blocks" and per cold-row storage, each compiling only the kernels it can call (on 2 cores the
# function for every storage took ~100 s to compile the first time; one for float16 weights ~30 s)
_CACHE = {torch.float32: np.float32, torch.float16: np.int16}  # float16 as its bits
_COLD = {"f32": np.float32, "bf16": np.uint16, "f16": np.int16, "i8": np.int8, "quant": None}


@functools.lru_cache(maxsize=None)
def _body(ct, quant, quant_cold, cold):
    # the cfunc's body for one variant (its closure holds numpy types, ints and None: numba caches each
    # variant on disk)
    def body(user):
        ctl, t0 = _begin(user)
        _end(ctl, t0, _layer(ctl, ct, quant, quant_cold, cold))
    return body


def layer_function(cache_dtype: torch.dtype, quant: bool, cold: str):
    """The compiled function of a layer whose host KV cache is cache_dtype (float32 or float16), with
    (quant) or without matrices in GGUF blocks, whose cold rows are stored as `cold` (KIND_CODES)."""
    return hn._compiled(_body(_CACHE[cache_dtype], 1 if quant else None, 1 if cold == "quant" else None, _COLD[cold]))


def node_variant(block) -> tuple[bool, str]:
    """(quant, cold) of layer_function for a block that layer_node_ready admits: whether any of its
    node's matrices is GGUF blocks, and its cold rows' storage kind (f32 where it has none)."""
    quant = any(isinstance(m, QuantMatrix) for m in _matrices(block).values())
    cold = block.ffn.cold
    return quant, (hn.ffn_node_kind(cold) if cold.n else "f32")


_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def _matrix(m) -> HostMatrix | QuantMatrix | None:
    """The host matrix behind a HostLinear, a QuantLinear, a CPU nn.Linear or a fused q/k/v entry (a
    half tensor or a QuantMatrix), sharing its memory; None where there is none."""
    if isinstance(m, (HostMatrix, QuantMatrix)):
        return m
    if isinstance(m, nn.Linear):
        m = m.weight
    if isinstance(m, torch.Tensor):
        ok = m.device.type == "cpu" and m.dtype in _FLOAT and m.dim() == 2 and m.is_contiguous()
        return HostMatrix.from_torch(m) if ok else None
    host = getattr(m, "host", getattr(m, "qweight", None))
    return host if isinstance(host, (HostMatrix, QuantMatrix)) else None


def _attention(block) -> nn.Module:
    """The block's Attention (a HostAttention's inner one)."""
    return getattr(block.attn, "attn", block.attn)


def _matrices(block) -> dict[int, object]:
    """The node's matrix slots and their host matrices (None where one has none)."""
    attn, pred = _attention(block), block.ffn.gpu.mask_fn
    qkv = getattr(attn, "qkv", None)
    lins = {L_Q: qkv, L_O: attn.o} if qkv is not None else {L_Q: attn.q, L_K: attn.k, L_V: attn.v, L_O: attn.o}
    if pred is not None:
        lins.update({L_P1: pred.l1, L_P2: pred.l2})
    return {slot: _matrix(lin) for slot, lin in lins.items()}


def _norms(block) -> dict[int, nn.Module]:
    """The norms the node applies, by slot (the post-FFN norm of sandwich blocks runs on the fast tier)."""
    attn = _attention(block)
    norms = {L_NA: block.attn_norm, L_NF: block.ffn_norm}
    if block.sandwich:
        norms[L_PAN] = block.post_attn_norm
    if hasattr(attn, "q_norm"):
        norms.update({L_QN: attn.q_norm, L_KN: attn.k_norm})
    return norms


def layer_node_ready(block) -> bool:
    """Whether a HostBlock's block (see host_block_ready) can step as a LayerHostNode: RMSNorms of one
    eps and kind (QK-norm and sandwich norms too), an Attention whose projections have host matrices
    (any HostMatrix kind or GGUF blocks), cold rows a host function computes (ffn_node_kind)."""
    attn = _attention(block)
    if type(attn) is not Attention:
        return False
    norms = _norms(block)
    if not all(type(n) is RMSNorm for n in norms.values()) or len({(n.eps, n.plus_one) for n in norms.values()}) != 1:
        return False
    cold = block.ffn.cold
    return all(m is not None for m in _matrices(block).values()) and (not cold.n or hn.ffn_node_kind(cold) is not None)


_TABLES: dict = {}


def _rotary_tables(rotary, S: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [S, Dh] for positions 0..S-1 (the layer's Rotary on the host; shared by the
    layers of one rotary kind)."""
    key = (rotary._key, S)
    if key not in _TABLES:
        if len(_TABLES) > 8:
            _TABLES.clear()
        with torch.no_grad():
            cos, sin = rotary(torch.arange(S, device=rotary.inv_freq.device))
        _TABLES[key] = tuple(np.ascontiguousarray(t.to("cpu", torch.float32).numpy()) for t in (cos, sin))
    return _TABLES[key]


def _f32(t) -> np.ndarray | None:
    return None if t is None else np.ascontiguousarray(t.detach().to("cpu", torch.float32).numpy().reshape(-1))


def _addr(a: np.ndarray | None) -> int:
    return 0 if a is None else hn._addr(a)


class LayerHostNode(_Node):
    """One CPU-attention layer's host share of a one-token step (see the module docstring), over the
    block's own host weights and KV cache buffers (cache_kv: this layer's (k, v) [1, Hkv, S, Dh] on the
    CPU). Buffers (pinned on CUDA, tier.host_empty): `x` float32 [D] and `pos` int64 [1] in, `up`
    float32 [3, D] (f, res, cold) and `mask` bool [I] (hot-first; None without a predictor) out."""

    def __init__(self, block, cache_kv, host_empty, threads: int):
        if not layer_node_ready(block):
            raise ValueError("this block cannot step as a LayerHostNode (see layer_node_ready)")
        attn, ffn = _attention(block), block.ffn
        k_buf, v_buf = cache_kv
        if k_buf.device.type != "cpu" or k_buf.dtype not in _CACHE or k_buf.shape[0] != 1 \
                or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("a LayerHostNode needs a contiguous float32 or float16 host KV cache of batch 1")
        D, cold, pred = ffn.dim, ffn.cold, ffn.gpu.mask_fn
        Hkv, S, Dh = k_buf.shape[1:]
        H, I = attn.n_heads, ffn.gpu.n_hot + cold.n
        self.x, self.pos = host_empty((D,), torch.float32), host_empty((1,), torch.int64)
        self.up = host_empty((3, D), torch.float32)  # f, res, cold
        self.mask = host_empty((I,), torch.bool) if pred is not None else None
        f_np, res_np, out_np = (self.up[i].numpy() for i in range(3))
        mask_np = None if self.mask is None else self.mask.numpy()
        c = self.ctl = np.zeros(N_LCTL, np.int64)
        cold_keep = ()
        if cold.n:
            _, cold_keep = cold_slots(c, f_np, None if mask_np is None else mask_np[ffn.gpu.n_hot:], cold, out_np)
        else:
            c[F_X], c[F_D], c[F_OUT] = hn._addr(f_np), D, hn._addr(out_np)
        mats = _matrices(block)
        fused = L_K not in mats
        for slot, m in mats.items():
            self._matrix_slots(slot, m)
        width = max(m.shape[0] for m in mats.values())
        rows = np.arange(width, dtype=np.int64)
        biases = {}
        if fused:
            qb = getattr(attn, "qkv_bias", None)
            if qb is not None:
                qb = _f32(qb)
                nq, nk = H * Dh, Hkv * Dh
                biases = {L_QB: qb[:nq], L_KB: qb[nq:nq + nk], L_VB: qb[nq + nk:]}
        else:
            biases = {L_QB: _f32(attn.q.bias), L_KB: _f32(attn.k.bias), L_VB: _f32(attn.v.bias)}
        biases[L_OB] = _f32(attn.o.bias)
        if pred is not None:
            b1, b2, threshold = pred._one
            biases.update({L_P1B: b1, L_P2B: b2})
        for slot, b in biases.items():
            c[slot] = _addr(b)
        norms = {slot: _f32(n.weight) for slot, n in _norms(block).items()}
        for slot, w in norms.items():
            c[slot] = hn._addr(w)
        n0 = block.attn_norm
        fp = np.zeros(3, np.float32)
        fp[FP_EPS], fp[FP_SCALE] = n0.eps, attn.scale
        if pred is not None:
            fp[FP_THRESHOLD] = threshold
        cos = sin = None
        if attn.rotary is not None:
            cos, sin = _rotary_tables(attn.rotary, S)
        rank = c[L_P1 + M_N] if pred is not None else 0
        buf = np.empty(2 * D + 2 * H * Dh + 2 * Hkv * Dh + max(H * S, rank + I), np.float32)
        kc, vc = k_buf[0].numpy(), v_buf[0].numpy()
        c[L_X], c[L_POS], c[L_S], c[L_RES] = hn._addr(self.x.numpy()), hn._addr(self.pos.numpy()), S, hn._addr(res_np)
        c[L_MASK], c[L_I], c[L_FP] = _addr(mask_np), I, hn._addr(fp)
        c[L_PLUS1] = n0.plus_one
        c[L_H], c[L_HKV], c[L_DH], c[L_KC], c[L_VC] = H, Hkv, Dh, hn._addr(kc), hn._addr(vc)
        c[L_COS], c[L_SIN], c[L_ROT], c[L_WIN] = _addr(cos), _addr(sin), cos is not None, attn.window or 0
        c[L_BUF], c[L_BUF_N], c[L_PRED], c[L_ROWS] = hn._addr(buf), buf.shape[0], pred is not None, hn._addr(rows)
        self.keep = (cold_keep, mats, rows, biases, norms, fp, cos, sin, buf, kc, vc, cache_kv)
        self.cache_key = (k_buf.data_ptr(), v_buf.data_ptr(), tuple(k_buf.shape))
        self._threads(threads)
        self.failure = f"CPU attention (layer host node): position out of range [0, {S})"
        self.fn = layer_function(k_buf.dtype, *node_variant(block))

    def _matrix_slots(self, slot: int, m: HostMatrix | QuantMatrix) -> None:
        c = self.ctl
        if isinstance(m, QuantMatrix):
            c[slot + M_ADDR], (c[slot + M_R0], c[slot + M_R1]) = hn._addr(m.data), m.data.shape
            c[slot + M_MODE] = MODES["interleaved" if m.interleaved else "quant"]
            c[slot + M_QID], c[slot + M_XQ] = m._id, m.interleaved or m.qtype in block_quant.formats.XQ_DEFAULT
        else:
            c[slot + M_ADDR], c[slot + M_SCALE] = hn._addr(m._w), hn._addr(m._s)
            c[slot + M_R0], c[slot + M_R1] = m.data.shape
            c[slot + M_MODE] = MODES[m.kind]
        c[slot + M_N] = m.shape[0]

    @property
    def cold_s(self) -> float:
        """Seconds the function spent on the cold rows over all its calls (the rest is attention and predictor)."""
        return float(self.ctl[L_COLD_NS]) * 1e-9


__all__ = ["LayerHostNode", "layer_function", "layer_node_ready", "node_variant"]
