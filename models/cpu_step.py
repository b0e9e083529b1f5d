"""A block's one-token decode step on the CPU as one numba call.

The module path of a decode step on the CPU (norm, q/k/v, attention, o, norm, gate, up, down) calls
the same numba kernels but goes through ~10 torch modules and ~30 tensor conversions a layer: on
SmolLM2-135M (30 layers, 2 cores) 6 ms of a 10.5 ms token were Python and torch around 4.4 ms of
kernels. Here a block whose weights are host matrices runs its whole step in one call of
`_block_step`, which calls those kernels in order over preallocated float32 buffers:

    x ─ attn_norm ─ q, k, v (one GEMV when fused) ─ (q/k norm) ─ rotary, cache write, attention ─ o
      ─ (post_attn_norm) ─ + x = r ─ ffn_norm ─ act(gate) * up ─ down ─ (post_ffn_norm) ─ + r

or, for OPT (LayerNorm with bias, biases on every projection, no rotary: its positions are added to
the embedding), the same with the FFN down(act(up + b_up)) + b_down, and OPT-350m's post-norm order:

    x ─ q, k, v ─ attention ─ o ─ + x ─ attn_norm = r ─ act(up) ─ down ─ + r ─ ffn_norm

Host matrices are GGUF blocks (QuantLinear, the block kernels) or float32 / float16 / bfloat16 CPU
nn.Linear weights, read in place by `cpu`'s row kernel (sparse_ops/float_rows.py; a half model's
fused q/k/v rows, fuse_qkv, as one matrix); each matrix's kernel is chosen by its type at compile
time. It applies to blocks with Attention whose projections are all host matrices (q, k and v all
biased or none), RMSNorm or LayerNorm norms of one kind (pre-norm, or post-norm without sandwich
norms), and a GatedFFN without biases or a DenseFFN of host matrices; float32 / float16 / bfloat16
activations (computed in float32 inside the step, the output rounded to the input's dtype once), a
float32 or float16 KV cache, and no hooks on any of the block's modules (the look-ahead's residual
hook on ffn_norm and the sparse forward see the module path). Where the FFN is another module (MoE,
a hybrid split) or has hooks (the profiler's probes), the attention half (to r and the FFN's input
f_in) is one call and the FFN runs as its module. `block_step` returns None where it does not
apply (tests patch it out for the module path). The kernels are the module path's own but for
LayerNorm's (sparse_ops/norm.py: two float32 passes, against torch's own reduction order); what
differs is that and the activation's float32 rounding (numba's SiLU/GELU against torch's): a
quantised block's output within ~1e-7 of the module path's (tests/test_cpu_step.py checks 1e-5),
which Q8 activations can turn into a flipped rounding and ~1% of the logits after 30 layers, as any
reordering of float32 sums can. A half model's module path rounds every part's output to its
dtype; the step does not, so it is closer to the float32 computation over the same weights (the test
checks the output's own rounding). On 2 cores SmolLM2 decodes about 1.4x as fast this way as through
the modules; Gemma 3 270M, whose 262k-token head dominates, about 1.15x.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload
from torch import nn

from hotcold.models.layers import FFN, Attention, DenseFFN, GatedFFN, RMSNorm
from hotcold.models.quantized import QuantLinear
from hotcold.sparse_ops.attention import _decode_attention
from hotcold.sparse_ops.cpu import HostMatrix, _gemv_rows_kernel
from hotcold.sparse_ops.selection import ACTS, activate
from hotcold.sparse_ops.input_sparse import F32, InputMajor, im_kernel
from hotcold.sparse_ops.norm import _layer_norm, _rms_norm
from hotcold.sparse_ops import quant
from hotcold.sparse_ops.quant import QuantMatrix, qgemv_rows_kernel, qgemv_x8_kernel


def _dense_mv(m, x, out):  # pragma: no cover - replaced by the overload inside jitted code
    raise NotImplementedError


@overload(_dense_mv, inline="always")
def _dense_mv_impl(m, x, out):
    """out = the matrix m (as _gemv takes it) times x, without input sparsity: GGUF blocks (data uint8)
    by the block kernels, float storage by `cpu`'s row kernel; chosen by m's type at compile time."""
    if m.types[3].dtype == types.uint8:
        def blocks(m, x, out):
            if m[1]:
                qgemv_x8_kernel(m[0], m[3], x, out)
            else:
                qgemv_rows_kernel(m[0], m[3], m[4], x, m[2], out)
        return blocks
    return lambda m, x, out: _gemv_rows_kernel(m[3], m[0], m[4], x, out)


@njit(nogil=True, cache=True)
def _gemv(m, x, out):
    # m: (type id, interleaved, Q8 activations, data uint8 [R, B], rows int64 [R], input sparsity) for
    # GGUF blocks, or (row scales float32 [R], False, False, float storage [R, cols] as HostMatrix holds
    # it, rows, input sparsity) for float weights; x [cols] -> out [R]. Input sparsity
    # (executors/input_sparse.py): InputMajor.args(), with kind >= 0 the
    # input-major kernel's; kind -2: x zeroed at or below the threshold sp[1], then the dense kernel
    # (sp[7] counts the inputs kept); kind -1: none
    sp = m[5]
    if sp[0] >= 0:
        im_kernel(x, out, sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6], sp[7], sp[8])
        return
    if sp[0] == -2:
        xs = np.empty_like(x)
        threshold_into(x, sp[1], sp[7], xs)
        x = xs
    _dense_mv(m, x, out)


@njit(nogil=True, cache=True)
def threshold_into(x, t, counter, out):
    # out = x with the entries |x| <= t zeroed; counter [kept, seen] += this row's (input sparsity's
    # threshold-then-dense kind, one row; models/batch_gemv.py applies it row by row)
    kept = 0
    for j in range(x.shape[0]):
        keep = abs(x[j]) > t
        out[j] = x[j] if keep else np.float32(0.0)
        kept += keep
    counter[0] += kept
    counter[1] += x.shape[0]


@njit(nogil=True, cache=True)
def _norm(x, w, eps, plus_one, out):
    # RMSNorm of one row: x, w, out [D]
    _rms_norm(x.reshape(1, -1), w, eps, plus_one, out.reshape(1, -1))


@njit(nogil=True, cache=True)
def _block_norm(x, w, b, eps, plus_one, layer_norm, out):
    # a block's norm of one row: LayerNorm (weight w, bias b, empty for none) with layer_norm, else
    # RMSNorm (b unread) through _norm, as batch_step's rows call it (the same compiled reduction:
    # a sequence's bits alone and in a batch); x, w, out [D]
    if layer_norm:
        _layer_norm(x.reshape(1, -1), w, b, eps, out.reshape(1, -1))
    else:
        _norm(x, w, eps, plus_one, out)


@njit(nogil=True, cache=True)
def _add_bias(out, b):
    # out += b, where b is not empty (an absent bias is an empty array)
    if b.shape[0]:
        for i in range(out.shape[0]):
            out[i] += b[i]


@njit(nogil=True, cache=True)
def _heads(qkv_row, biases, has_bias, qk_norm, norm_w, eps, plus_one, H, Hkv, Dh):
    # one token's fused q|k|v projection [H Dh + 2 Hkv Dh], in place: + the biases (with has_bias),
    # RMSNorm per q and k head (with qk_norm; norm_w[4], norm_w[5]) -> the head views (q, k, v)
    nq, nk = H * Dh, Hkv * Dh
    if has_bias:
        for i in range(nq):
            qkv_row[i] += biases[0][i]
        for i in range(nk):
            qkv_row[nq + i] += biases[1][i]
            qkv_row[nq + nk + i] += biases[2][i]
    qh = qkv_row[:nq].reshape(H, Dh)
    kh = qkv_row[nq:nq + nk].reshape(Hkv, Dh)
    vh = qkv_row[nq + nk:].reshape(Hkv, Dh)
    if qk_norm:
        for i in range(H):
            _norm(qh[i], norm_w[4], eps, plus_one, qh[i])
        for i in range(Hkv):
            _norm(kh[i], norm_w[5], eps, plus_one, kh[i])
    return qh, kh, vh


@njit(nogil=True, cache=True)
def _residual(x, h, post_norm_w, eps, plus_one, sandwich, out):
    # out = x + (post-norm with sandwich) h, all [D]; h is normalised in place
    if sandwich:
        _norm(h, post_norm_w, eps, plus_one, h)
    for i in range(x.shape[0]):
        out[i] = x[i] + h[i]


@njit(nogil=True, cache=True)
def _ffn_out(r, h, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, y):
    # the block's output from r and the FFN's output h, all [D]: r + (post_ffn_norm) h pre-norm,
    # ffn_norm(r + h) post-norm; h is overwritten
    if pre_norm:
        _residual(r, h, norm_w[3], eps, plus_one, sandwich, y)
    else:
        for i in range(r.shape[0]):
            h[i] += r[i]
        _block_norm(h, norm_w[1], norm_w[7], eps, plus_one, layer_norm, y)


@njit(nogil=True, cache=True)
def _attn_half(x, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, qkv, q, k, v, fused, biases, has_bias,
               qk_norm, H, Hkv, Dh, cos, sin, rotary, k_cache, v_cache, pos, lo, scale, o, buf, r, f_in):
    # x [D] -> r and the FFN's input f_in [D]: pre-norm r = x + attention(attn_norm(x)) and
    # f_in = ffn_norm(r); post-norm (OPT-350m) r = f_in = attn_norm(x + attention(x)). norm_w: (attn,
    # ffn, post-attn, post-ffn, q, k) norm weights, then the (attn, ffn) LayerNorms' biases (empty for
    # none or RMSNorm), float32 (the post-norms only read with sandwich, q/k only with qk_norm);
    # matrices as in _gemv; biases: (q, k, v, o) float32, q/k/v read with has_bias, o where not empty;
    # buf: float32 scratch of at least attn_scratch(...) entries.
    D = x.shape[0]
    nq, nk = H * Dh, Hkv * Dh
    xn = buf[:D]
    qkv_out = buf[D:D + nq + 2 * nk]
    att = buf[D + nq + 2 * nk:D + 2 * nq + 2 * nk]
    h = buf[D + 2 * nq + 2 * nk:2 * D + 2 * nq + 2 * nk]
    scores = buf[2 * D + 2 * nq + 2 * nk:]
    if pre_norm:
        _block_norm(x, norm_w[0], norm_w[6], eps, plus_one, layer_norm, xn)
    else:
        xn[:] = x
    if fused:
        _gemv(qkv, xn, qkv_out)
    else:
        _gemv(q, xn, qkv_out[:nq])
        _gemv(k, xn, qkv_out[nq:nq + nk])
        _gemv(v, xn, qkv_out[nq + nk:])
    qh, kh, vh = _heads(qkv_out, biases, has_bias, qk_norm, norm_w, eps, plus_one, H, Hkv, Dh)
    _decode_attention(qh, kh, vh, cos, sin, rotary, k_cache, v_cache, pos, lo, scale,
                      scores[:H * (pos + 1 - lo)].reshape(H, pos + 1 - lo), att.reshape(H, Dh))
    _gemv(o, att, h)
    _add_bias(h, biases[3])
    if pre_norm:
        _residual(x, h, norm_w[2], eps, plus_one, sandwich, r)
        _block_norm(r, norm_w[1], norm_w[7], eps, plus_one, layer_norm, f_in)
    else:
        for i in range(D):
            h[i] += x[i]
        _block_norm(h, norm_w[0], norm_w[6], eps, plus_one, layer_norm, r)
        f_in[:] = r


@njit(nogil=True, cache=True)
def _ffn_half(f_in, r, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, gate, up, down, gated, fbiases, act,
              buf, y):
    # y = the block's output (see _ffn_out) from the FFN of f_in: gated down(act(gate f_in) * up f_in),
    # else (OPT's DenseFFN) down(act(up f_in + b_up)) + b_down, fbiases = (b_up, b_down) read where not
    # empty (gate unread); all [D]; buf: float32 [2 I + D]
    D, I = f_in.shape[0], up[4].shape[0]
    g, u, h = buf[:I], buf[I:2 * I], buf[2 * I:2 * I + D]
    if gated:
        _gemv(gate, f_in, g)
        _gemv(up, f_in, u)
        for i in range(I):
            g[i] = activate(g[i], act) * u[i]
    else:
        _gemv(up, f_in, g)
        _add_bias(g, fbiases[0])
        for i in range(I):
            g[i] = activate(g[i], act)
    _gemv(down, g, h)
    _add_bias(h, fbiases[1])
    _ffn_out(r, h, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, y)


@njit(nogil=True, cache=True)
def _block_step(x, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, qkv, q, k, v, fused, biases, has_bias,
                qk_norm, H, Hkv, Dh, cos, sin, rotary, k_cache, v_cache, pos, lo, scale, o, abuf, gate, up, down,
                gated, fbiases, act, fbuf, r, f_in, y):
    # the whole block: _attn_half then _ffn_half, in one call
    _attn_half(x, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, qkv, q, k, v, fused, biases, has_bias,
               qk_norm, H, Hkv, Dh, cos, sin, rotary, k_cache, v_cache, pos, lo, scale, o, abuf, r, f_in)
    _ffn_half(f_in, r, norm_w, eps, plus_one, layer_norm, pre_norm, sandwich, gate, up, down, gated, fbiases, act,
              fbuf, y)


def _mat(lin) -> tuple:
    """A matrix as _gemv takes it: a QuantLinear's or QuantMatrix's blocks, or a float nn.Linear's weight
    or a fused float q/k/v tensor (its memory, as a HostMatrix)."""
    if isinstance(lin, (nn.Linear, torch.Tensor)):
        hm = HostMatrix.from_torch((lin.weight if isinstance(lin, nn.Linear) else lin).detach())
        return (_ro(hm._s), False, False, _ro(hm._w), _ro(np.arange(hm.shape[0], dtype=np.int64)), _sparsity(lin))
    m = lin.qweight if isinstance(lin, QuantLinear) else lin  # a QuantMatrix
    return (m.type_id, bool(m.interleaved), bool(m.interleaved or m.qtype in quant.formats.XQ_DEFAULT), _ro(m.data),
            _ro(m.all_rows()), _sparsity(lin))


def _ro(a: np.ndarray) -> np.ndarray:
    """A read-only view of a: the file's mapped blocks are read-only, repacked copies not; as views of
    one kind every matrix has one numba type (one compiled step, and runs of blocks, cpu_run.py)."""
    v = a.view()
    v.setflags(write=False)
    return v


def _sparsity(lin) -> tuple:
    """The input-sparsity member of a matrix's kernel arguments (see _gemv)."""
    d = getattr(lin, "__dict__", {}) if not isinstance(lin, torch.Tensor) else {}
    im = d.get("input_major")
    if im is not None:
        return im.args()
    t = d.get("input_threshold")
    if t is None:
        return _DENSE
    return (-2, np.float32(t), *_DENSE[2:7], d["input_counter"], 1)


_DENSE = (-1, np.float32(0.0), *InputMajor(F32, 1, 1, 0.0, threads=1).args()[2:])  # no input sparsity


def _parts(block) -> tuple:
    """((the block's modules but the FFN's, the FFN's), the modules and weights the decision was made
    on): read through the modules' own dicts (nn.Module's __getattr__ costs ~1 µs a name, 30 layers a
    token)."""
    bm = block._modules
    a, f = bm["attn"], bm["ffn"]
    am, fm = a._modules, f._modules
    lins = (am.get("q"), am.get("k"), am.get("v"), am.get("o"), fm.get("gate"), fm.get("up"), fm.get("down"))
    mods = (block, *(m for n, m in bm.items() if n != "ffn"), *am.values())  # every module but the FFN's
    return (mods, (f, *fm.values())), (a, f, a.__dict__.get("qkv"), *lins, *(getattr(lin, "qweight", None) for lin in lins),
                  quant.formats.XQ_DEFAULT)


@dataclass
class _Plan:
    """What the fused step needs to know of a block besides its weights (read from the modules at each
    step, so that the plan holds no reference to them: a hybrid split frees the replaced FFN)."""

    eps: np.float32
    plus_one: bool
    layer_norm: bool  # nn.LayerNorm norms (OPT), else RMSNorm
    pre_norm: bool  # else OPT-350m's norms after the residual adds
    sandwich: bool
    qk_norm: bool
    fused: bool
    has_bias: bool
    act: int
    heads: tuple[int, int, int]
    scale: np.float32
    window: int | None
    ffn: bool  # the FFN is a GatedFFN or DenseFFN of host matrices: in the same call (else its module runs between)
    gated: bool  # that FFN is a GatedFFN (else a DenseFFN)
    blocks: bool  # what batch_step takes: an RMSNorm pre-norm block without o bias, a GatedFFN, every matrix a
    # QuantLinear's, norms and biases float32


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_NONE = np.zeros(0, np.float32)  # an absent bias or LayerNorm bias (see _add_bias)


def _host_linear(lin) -> bool:
    """Whether the step multiplies by lin itself: a QuantLinear, or an nn.Linear whose weight is a
    float32 / float16 / bfloat16 CPU tensor (read in place through `cpu`'s row kernel)."""
    if type(lin) is QuantLinear:
        return True
    return (type(lin) is nn.Linear and lin.weight.device.type == "cpu" and lin.weight.dtype in _FLOATS
            and (lin.bias is None or lin.bias.dtype in _FLOATS))


def _plan(block) -> _Plan | None:
    """The block's _Plan where models/batch_step.py's several-token step takes it (_Plan.blocks), else None."""
    plan = _host_plan(block)
    return plan if plan is not None and plan.blocks else None


def _norm_kind(norms: list) -> tuple | None:
    """(eps, plus_one, layer_norm) shared by a block's norms, or None where they differ or the step has
    no kernel for them: RMSNorm, or nn.LayerNorm over the last axis with a weight (OPT)."""
    kinds = set()
    for n in norms:
        if type(n) is RMSNorm:
            kinds.add((n.eps, n.plus_one, False))
        elif type(n) is nn.LayerNorm and len(n.normalized_shape) == 1 and n.weight is not None:
            kinds.add((n.eps, False, True))
        else:
            return None
        if any(p.dtype not in _FLOATS for p in n._parameters.values() if p is not None):
            return None
    return kinds.pop() if len(kinds) == 1 else None


def _host_plan(block) -> _Plan | None:
    """The block's _Plan, or None where the fused step does not apply (see the module docstring)."""
    a, f = block.attn, block.ffn
    if type(a) is not Attention or (block.sandwich and not block.pre_norm):
        return None
    qk_norm = hasattr(a, "q_norm")
    norms = ([block.attn_norm, block.ffn_norm] + ([block.post_attn_norm, block.post_ffn_norm] if block.sandwich else [])
             + ([a.q_norm, a.k_norm] if qk_norm else []))
    kind = _norm_kind(norms)
    if kind is None or (kind[2] and (block.sandwich or qk_norm)):  # (the LayerNorm kernel: a block's two norms only)
        return None
    eps, plus_one, layer_norm = kind
    if not all(_host_linear(lin) for lin in (a.q, a.k, a.v, a.o)):
        return None
    biased = [lin.bias is not None for lin in (a.q, a.k, a.v)]
    if any(biased) and not all(biased):
        return None
    qkv = getattr(a, "qkv", None)
    if qkv is not None and not (isinstance(qkv, QuantMatrix) or isinstance(qkv, torch.Tensor)
                                and qkv.device.type == "cpu" and qkv.dtype in _FLOATS and qkv.is_contiguous()):
        return None
    gated = type(f) is GatedFFN
    ffn = getattr(f, "act_name", None) in ACTS and (
        gated and all(_host_linear(lin) and lin.bias is None for lin in (f.gate, f.up, f.down))
        or type(f) is DenseFFN and all(_host_linear(lin) for lin in (f.up, f.down)))
    blocks = (not layer_norm and block.pre_norm and a.o.bias is None and (gated or not ffn)
              and all(type(lin) is QuantLinear for lin in (a.q, a.k, a.v, a.o) + ((f.gate, f.up, f.down) if ffn else ()))
              and all(n.weight.dtype == torch.float32 for n in norms)
              and not (any(biased) and any(lin.bias.dtype != torch.float32 for lin in (a.q, a.k, a.v))))
    return _Plan(np.float32(eps), bool(plus_one), layer_norm, bool(block.pre_norm), bool(block.sandwich), qk_norm,
                 qkv is not None, all(biased), ACTS[f.act_name] if ffn else 0, (a.n_heads, a.n_kv, a.head_dim),
                 np.float32(a.scale), a.window, ffn, ffn and gated, blocks)


def _scratch(block, key: str, need: int) -> np.ndarray:
    buf = block.__dict__.get(key)
    if buf is None or buf.shape[0] < need:
        buf = block.__dict__[key] = np.empty(max(need, 2 * (0 if buf is None else buf.shape[0])), np.float32)
    return buf


def _weights(module, name: str = "weight") -> np.ndarray:
    """A module's parameter (its weight, or name) as float32 numpy: its own memory, or (float16 /
    bfloat16) a copy kept on the module; an absent one (a LayerNorm without bias) is empty."""
    w = module._parameters.get(name)
    if w is None:
        return _NONE
    if w.dtype == torch.float32:
        return w.detach().numpy()
    key = "_f32_" + name
    kept = module.__dict__.get(key)
    if kept is None or kept[0] != (w.data_ptr(), w._version):
        kept = module.__dict__[key] = ((w.data_ptr(), w._version), w.detach().float().numpy())
    return kept[1]


def _bias(lin) -> np.ndarray:
    """A linear's bias as float32 numpy (a float32 one in place; converted once), empty where it has none."""
    return _NONE if lin.bias is None else lin.bias.detach().float().numpy()


_ROTARY: dict = {}  # (rotary's key, position) -> (cos, sin) float32 [Dh]: this step's tables, shared by layers


def _rotary_tables(rotary, positions: torch.Tensor, start: int | None, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """The rotary's cos and sin rows at `pos` as float32 numpy, made once a step for all layers of one
    rotary kind (a layer's own would cost ~8 us: the module call and two conversions)."""
    key = (rotary._key, pos)
    got = _ROTARY.get(key)
    if got is None:
        if len(_ROTARY) >= 8:  # a new step: the previous ones are not needed again
            _ROTARY.clear()
        got = _ROTARY[key] = tuple(t[0].float().numpy() for t in rotary(positions, start))
    return got


def _norm_weights(block, plan: _Plan, aa: tuple) -> tuple:
    """(attn, ffn, post-attn, post-ffn, q, k) norm weights and (attn, ffn) LayerNorm biases as float32
    numpy (see _attn_half), kept on the block while its norms' float32 parameters are the same tensors
    (a float32 one is read in place, so an in-place update shows; a half one is converted by _weights,
    which tracks its version)."""
    bm = block._modules
    names = ("attn_norm", "ffn_norm") + (("post_attn_norm", "post_ffn_norm") if plan.sandwich else ())
    params = tuple(bm[n]._parameters.get(p) for n in names for p in ("weight", "bias"))
    kept = block.__dict__.get("_cpu_norms")
    if kept is not None and kept[1] is aa and all(p is q for p, q in zip(kept[0], params)):
        return kept[2]
    w = _weights(bm["attn_norm"])
    norm_w = (w, _weights(bm["ffn_norm"]), *((_weights(bm["post_attn_norm"]), _weights(bm["post_ffn_norm"]))
                                            if plan.sandwich else (w, w)), *aa[6],
              *((_weights(bm["attn_norm"], "bias"), _weights(bm["ffn_norm"], "bias")) if plan.layer_norm
                else (_NONE, _NONE)))
    if all(p.dtype == torch.float32 for p in params if p is not None):
        block.__dict__["_cpu_norms"] = (params, aa, norm_w)
    return norm_w


def _hooked(mods) -> bool:
    """Whether any of the modules has forward hooks (the profiler's probes, the look-ahead's residual)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def prepared(block) -> tuple | None:
    """(plan, whole, attention's kernel arguments) of a block whose one-token step the fused path takes,
    or None (see the module docstring). whole: the FFN runs in the same call (else as its module, whose
    hooks see it). Checked at every step: a hybrid split, input sparsity or a hook may have changed
    the block since its arguments were made."""
    mods, parts = _parts(block)
    cached = block.__dict__.get("_cpu_step")  # (weak references to the parts, their plan or None)
    if cached is None or len(cached[0]) != len(parts) or any(
            (r() if r is not None else None) is not p for r, p in zip(cached[0], parts)):
        cached = block.__dict__["_cpu_step"] = (tuple(None if p is None else weakref.ref(p) for p in parts),
                                                _host_plan(block))
        for m in (block.attn, block.ffn):
            m.__dict__.pop("_cpu_args", None)
    plan = cached[1]
    if plan is None or _hooked(mods[0]):
        return None
    whole = plan.ffn and not _hooked(mods[1])
    a = block.attn
    # the weights' kernel arguments, kept on the modules that own them (a replaced FFN takes its own)
    aa = a.__dict__.get("_cpu_args")
    if aa is None:
        q, k, v = _mat(a.q), _mat(a.k), _mat(a.v)
        w = _weights(block.attn_norm)
        aa = a.__dict__["_cpu_args"] = (
            _mat(a.qkv) if plan.fused else q, q, k, v, _mat(a.o),
            (*(_bias(lin) for lin in (a.q, a.k, a.v)), _bias(a.o)),
            (_weights(a.q_norm), _weights(a.k_norm)) if plan.qk_norm else (w, w))
    return plan, whole, aa


def ffn_args(ffn) -> tuple:
    """A whole block's FFN as _ffn_half takes it: (gate, up, down) matrices as _gemv takes them (a
    DenseFFN's up in gate's place, unread), (up, down) biases (empty for none); kept on the FFN."""
    fa = ffn.__dict__.get("_cpu_args")
    if fa is None:
        up = _mat(ffn.up)
        gate = _mat(ffn.gate) if type(ffn) is GatedFFN else up
        fa = ffn.__dict__["_cpu_args"] = (gate, up, _mat(ffn.down), (_bias(ffn.up), _bias(ffn.down)))
    return fa


def kv_arrays(cache_kv) -> tuple[np.ndarray, np.ndarray]:
    """A layer's (keys, values) cache as the step's numpy arrays [Hkv, S, Dh] (float16 as int16 bits)."""
    kc, vc = cache_kv[0].numpy()[0], cache_kv[1].numpy()[0]  # (numpy's indexing: a third of torch's time)
    if kc.dtype == np.float16:
        kc, vc = kc.view(np.int16), vc.view(np.int16)
    return kc, vc


def attn_scratch(d: int, H: int, Hkv: int, Dh: int, pos: int) -> int:
    """Entries of _attn_half's float32 scratch at position pos."""
    return 2 * d + 2 * H * Dh + 2 * Hkv * Dh + H * (pos + 1)


def block_step(block, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None) -> torch.Tensor | None:
    """block(x, positions, cache_kv, start) for one token on the CPU as one numba call, or None where
    the fused step does not apply (then the caller runs the module path). x: [1, 1, D] -> [1, 1, D]."""
    if (x.shape[0] != 1 or x.shape[1] != 1 or x.device.type != "cpu" or x.dtype not in _FLOATS
            or cache_kv is None or cache_kv[0].dtype not in (torch.float32, torch.float16) or torch.is_grad_enabled()):
        return None
    got = prepared(block)
    if got is None:
        return None
    plan, whole, aa = got
    a, f = block.attn, block.ffn
    pos = int(positions[0]) if start is None else start
    H, Hkv, Dh = plan.heads
    if a.rotary is not None:
        cos, sin = _rotary_tables(a.rotary, positions, start, pos)
    else:
        cos = sin = np.zeros(Dh, np.float32)
    kc, vc = kv_arrays(cache_kv)
    lo = max(0, pos - plan.window + 1) if plan.window else 0
    if x.dtype == torch.float32 and x.is_contiguous():
        xv = x.detach().numpy().reshape(-1)
    else:
        xv = np.ascontiguousarray(x.detach().reshape(-1).float().numpy())
    d = xv.shape[0]
    norm_w = _norm_weights(block, plan, aa)
    abuf = _scratch(block, "_cpu_attn_buf", attn_scratch(d, H, Hkv, Dh, pos))
    r, f_in = np.empty_like(xv), np.empty_like(xv)
    args = (xv, norm_w, plan.eps, plan.plus_one, plan.layer_norm, plan.pre_norm, plan.sandwich, aa[0], aa[1], aa[2],
            aa[3], plan.fused, aa[5], plan.has_bias, plan.qk_norm, H, Hkv, Dh, cos, sin, a.rotary is not None, kc, vc, pos, lo, plan.scale, aa[4],
            abuf)
    if not whole:  # the attention half in one call, then the FFN's module (MoE, hybrid, hooked)
        _attn_half(*args, r, f_in)
        if isinstance(f, FFN) and not _hooked((f, *f._modules.values())):
            h = np.empty_like(xv)
            if f.host_decode(f_in, h):  # an FFN that computes one token on host arrays (an all-CPU MoE)
                y = np.empty_like(xv)
                _ffn_out(r, h, norm_w, plan.eps, plan.plus_one, plan.layer_norm, plan.pre_norm, plan.sandwich, y)
                out = torch.from_numpy(y.reshape(1, 1, d))
                return out if x.dtype == torch.float32 else out.to(x.dtype)
        h = f(torch.from_numpy(f_in).reshape(x.shape).to(x.dtype))
        if not plan.pre_norm:  # OPT-350m: the FFN's residual add, then ffn_norm
            return block.ffn_norm(torch.from_numpy(r).reshape(x.shape).to(x.dtype) + h)
        if plan.sandwich:
            h = block.post_ffn_norm(h)
        return (torch.from_numpy(r).reshape(x.shape) + h).to(x.dtype)
    fa = ffn_args(f)
    fbuf = _scratch(block, "_cpu_ffn_buf", 2 * fa[0][4].shape[0] + d)
    y = np.empty_like(xv)
    _block_step(*args, fa[0], fa[1], fa[2], plan.gated, fa[3], plan.act, fbuf, r, f_in, y)
    out = torch.from_numpy(y.reshape(1, 1, d))
    return out if x.dtype == torch.float32 else out.to(x.dtype)
