"""One decode step of several sequences at once on the CPU, each with its own KV slot and position.

The server's continuous batching calls `decode_rows` with the next token of every running sequence.
Decoding is memory-bound: a step's cost is reading the weights, so B sequences that share one read
cost little more than one. Where a block takes the fused one-token step (models/cpu_step.py: pre-norm,
RMSNorm, GGUF-quantised attention and gated FFN), `_block_rows` runs it for the B rows in one numba
call whose GEMVs read each group of weight rows once and dot it with every row's activations while
it is in cache (`_gemv_batch`). Each row's arithmetic is the single-sequence step's, call for call:
the same activation quantisation, the same row spans, the same dot kernels, norm, rotary table and
attention kernel; so a sequence decodes to the same bits alone or in any batch (tests/test_batch_step.py).
Consecutive such blocks go in one call (`_run_rows` over models/cpu_run.py's runs of blocks), as the
one-token step's runs do, so the Python around a block is paid once a run.
Blocks the fused step does not take (float weights, MoE, hooks, a hybrid split) run row by row
through their modules, as a single sequence would; so does the head unless it is a quantised
matrix. Keys and values live in a `SlotCache`: one preallocated [slots, Hkv, L, Dh] buffer per
layer, a sequence owning one slot; `SlotCache.view(s)` is slot s as a one-sequence KVCache, which
the model's own forward (prefill, the row-by-row blocks) writes.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from numba import njit

from hotcold.models import cpu_run, cpu_step, transformer
from hotcold.models.batch_gemv import _gemv_batch
from hotcold.models.cpu_step import _NONE, _bias, _heads, _hooked, _mat, _norm, _parts, _plan, _residual, _weights
from hotcold.models.quantized import QuantEmbedding, QuantLinear
from hotcold.models.transformer import KVCache
from hotcold.sparse_ops.attention import _decode_attention
from hotcold.sparse_ops.selection import activate


class SlotCache(KVCache):
    """KV buffers for `slots` sequences of up to max_len tokens each: layer l's keys and values are
    [slots, Hkv, max_len, Dh] (on the CPU, torch.empty: pages are committed as tokens are written)."""

    def __init__(self, config, slots: int, max_len: int, dtype=torch.float32):
        super().__init__(config, max_len, batch=slots, device="cpu", dtype=dtype)
        self.slots = slots

    def slot_nbytes(self) -> int:
        return self.nbytes() // self.slots

    def view(self, s: int) -> KVCache:
        """Slot s as a one-sequence KVCache (views of this cache's buffers)."""
        v = KVCache.__new__(KVCache)
        v.max_len = self.max_len
        v.layers = [(k[s:s + 1], vv[s:s + 1]) for k, vv in self.layers]
        return v

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot dst's first n positions := slot src's (another sequence's shared prefix)."""
        for k, v in self.layers:
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]


# ----------------------------------------------------------------------------- a block for B rows


@njit(nogil=True, cache=True)
def _block_rows(X, norm_w, eps, plus_one, sandwich, qkv, q, k, v, fused, biases, has_bias, qk_norm, H, Hkv, Dh,
                COS, SIN, rotary, k_pool, v_pool, slots, pos, lo, scale, o, gate, up, down, act, Y):
    # cpu_step._block_step for B rows: X [B, D] -> Y [B, D]; row b attends over slot slots[b] of the
    # pools ([S, Hkv, L, Dh]) at position pos[b] (window from lo[b]) with rotary tables COS[b], SIN[b]
    B, D = X.shape
    nq, nk = H * Dh, Hkv * Dh
    XN = np.empty((B, D), np.float32)
    for b in range(B):
        _norm(X[b], norm_w[0], eps, plus_one, XN[b])
    QKV = np.empty((B, nq + 2 * nk), np.float32)
    if fused:
        _gemv_batch(qkv, XN, QKV)
    else:
        Qo, Ko, Vo = np.empty((B, nq), np.float32), np.empty((B, nk), np.float32), np.empty((B, nk), np.float32)
        _gemv_batch(q, XN, Qo)
        _gemv_batch(k, XN, Ko)
        _gemv_batch(v, XN, Vo)
        QKV[:, :nq], QKV[:, nq:nq + nk], QKV[:, nq + nk:] = Qo, Ko, Vo
    ATT = np.empty((B, nq), np.float32)
    for b in range(B):
        qh, kh, vh = _heads(QKV[b], biases, has_bias, qk_norm, norm_w, eps, plus_one, H, Hkv, Dh)
        n = pos[b] + 1 - lo[b]
        scores = np.empty(H * n, np.float32).reshape(H, n)
        _decode_attention(qh, kh, vh, COS[b], SIN[b], rotary, k_pool[slots[b]], v_pool[slots[b]], pos[b], lo[b],
                          scale, scores, ATT[b].reshape(H, Dh))
    Hs = np.empty((B, D), np.float32)
    _gemv_batch(o, ATT, Hs)
    R = np.empty((B, D), np.float32)
    F = np.empty((B, D), np.float32)
    for b in range(B):
        _residual(X[b], Hs[b], norm_w[2], eps, plus_one, sandwich, R[b])
        _norm(R[b], norm_w[1], eps, plus_one, F[b])
    I = gate[4].shape[0]
    G, U = np.empty((B, I), np.float32), np.empty((B, I), np.float32)
    _gemv_batch(gate, F, G)
    _gemv_batch(up, F, U)
    for b in range(B):
        for i in range(I):
            G[b, i] = activate(G[b, i], act) * U[b, i]
    _gemv_batch(down, G, Hs)
    for b in range(B):
        _residual(R[b], Hs[b], norm_w[3], eps, plus_one, sandwich, Y[b])


@njit(nogil=True, cache=True)
def _run_rows(X, statics, kps, vps, COS, SIN, slots, pos):
    # _block_rows through a run of blocks (models/cpu_run.py's static arguments, one typed List item a
    # block; kps/vps[i] its layer's [S, Hkv, L, Dh] pools; COS/SIN [rotary kinds, B, Dh]): X [B, D] ->
    # the last block's output
    B = X.shape[0]
    cur, nxt = X.copy(), np.empty_like(X)
    lo = np.zeros(B, np.int64)
    for i in range(len(statics)):
        s = statics[i]
        for b in range(B):
            lo[b] = max(0, pos[b] - s[22] + 1) if s[22] > 0 else 0
        _block_rows(cur, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14],
                    COS[s[27]], SIN[s[27]], s[15], kps[i], vps[i], slots, pos, lo, s[16], s[17], s[18], s[19], s[20],
                    s[21], nxt)
        cur, nxt = nxt, cur
    return cur


_ROW_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its runs for the batched step


def row_runs(model) -> list:
    """The runs of consecutive blocks the batched step takes in one call each (cpu_run's runs of
    blocks of GGUF matrices and float32 norms); empty where the fused step is patched out."""
    if transformer.block_step is not cpu_step.block_step or torch.is_grad_enabled():  # (tests patch it out)
        return []
    return cpu_run.current_runs(model, _ROW_RUNS, blocks_only=True)


def _pools(cache_kv) -> tuple[np.ndarray, np.ndarray]:
    """A layer's key and value pools [S, Hkv, L, Dh] as the kernels take them (float16 as int16 bits)."""
    kc, vc = cache_kv[0].numpy(), cache_kv[1].numpy()
    return (kc.view(np.int16), vc.view(np.int16)) if kc.dtype == np.float16 else (kc, vc)


def _rows_of_run(run, x: torch.Tensor, positions: list[int], cache: SlotCache, slots: np.ndarray,
                 pos: np.ndarray) -> torch.Tensor:
    """x [B, 1, D] through the run's blocks in one call."""
    if run.kv is None or run.kv[0] is not cache.layers:
        pools = [_pools(cache.layers[i]) for i in range(run.i0, run.i1)]
        run.kv = (cache.layers, cpu_run._as_list([k for k, _ in pools]), cpu_run._as_list([v for _, v in pools]))
    tables = [_rotary_rows(rot, positions, run.heads[2]) for rot in run.rotaries]
    cos, sin = np.stack([c for c, _ in tables]), np.stack([s for _, s in tables])
    B = x.shape[0]
    y = _run_rows(np.ascontiguousarray(x.reshape(B, -1).numpy()), run.statics, run.kv[1], run.kv[2], cos, sin,
                  slots, pos)
    return torch.from_numpy(y).reshape(B, 1, -1)


def _fused_args(block):
    """(plan, attention args, FFN args, norm weights) where the whole block takes the fused one-token
    step (cpu_step.block_step's conditions, its FFN in the same call), else None."""
    if transformer.block_step is not cpu_step.block_step or torch.is_grad_enabled():  # (tests patch it out)
        return None
    mods, parts = _parts(block)
    cached = block.__dict__.get("_batch_step")
    if cached is None or len(cached[0]) != len(parts) or any(
            (r() if r is not None else None) is not p for r, p in zip(cached[0], parts)):
        cached = block.__dict__["_batch_step"] = (tuple(None if p is None else weakref.ref(p) for p in parts),
                                                  _plan(block))
    plan = cached[1]
    if plan is None or not plan.ffn or _hooked(mods[0]) or _hooked(mods[1]):
        return None
    a, f = block.attn, block.ffn
    q, k, v = _mat(a.q), _mat(a.k), _mat(a.v)
    w = _weights(block.attn_norm)
    aa = (_mat(a.qkv) if plan.fused else q, q, k, v, _mat(a.o), (*(_bias(lin) for lin in (a.q, a.k, a.v)), _NONE),
          (_weights(a.q_norm), _weights(a.k_norm)) if plan.qk_norm else (w, w))
    fa = (_mat(f.gate), _mat(f.up), _mat(f.down))
    norm_w = (w, _weights(block.ffn_norm), *((_weights(block.post_attn_norm), _weights(block.post_ffn_norm))
                                            if plan.sandwich else (w, w)), *aa[6], _NONE, _NONE)  # (cpu_step's types)
    return plan, aa, fa, norm_w


def _rotary_rows(rotary, positions: list[int], Dh: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [B, Dh] float32: row b as the one-token step computes it for position positions[b]."""
    if rotary is None:
        z = np.zeros((len(positions), Dh), np.float32)
        return z, z
    rows = [rotary(torch.tensor([p]), p) for p in positions]
    return (np.ascontiguousarray(np.stack([c[0].numpy() for c, _ in rows])),
            np.ascontiguousarray(np.stack([s[0].numpy() for _, s in rows])))


def _head_matrix(model):
    """The head's quantised matrix as a _gemv_batch argument, or None where the head runs row by row."""
    if hasattr(model, "project_out"):
        return None
    if not model.config.tie_word_embeddings:
        lin = model.lm_head
        ok = type(lin) is QuantLinear and lin.bias is None and not (lin._forward_hooks or lin._forward_pre_hooks)
        return _mat(lin) if ok else None
    return _mat(model.embed.qweight) if type(model.embed) is QuantEmbedding else None


@torch.inference_mode()
def decode_rows(model, tokens: list[int], positions: list[int], cache: SlotCache, slots: list[int]) -> torch.Tensor:
    """Logits [B, V] float32 of B sequences' next tokens: sequence b feeds tokens[b] at positions[b]
    into slot slots[b] of `cache`. Row b equals model(tokens[b], positions[b], cache.view(slots[b]),
    last_only=True) bit for bit."""
    B = len(tokens)
    views = [cache.view(s) for s in slots]
    pos_t = [torch.tensor([p]) for p in positions]
    if hasattr(model, "project_in"):  # a matrix product, whose rounding may depend on the rows it is given
        x = torch.cat([model.embed_tokens(torch.tensor([[t]]), p) for t, p in zip(tokens, pos_t)])  # [B, 1, D]
    else:  # one lookup for all rows (a table row each, scaled, plus its position's row where learned)
        x = model.embed_tokens(torch.tensor(tokens).reshape(B, 1), torch.tensor(positions).reshape(B, 1))
    slots_np, pos_np = np.asarray(slots, np.int64), np.asarray(positions, np.int64)
    tables: dict = {}  # rotary key -> (cos, sin) for this step
    floats = x.dtype == torch.float32 and len(cache.layers) > 0 and cache.layers[0][0].dtype in (torch.float32,
                                                                                                  torch.float16)
    runs = {r.i0: r for r in row_runs(model)} if floats else {}
    i = 0
    while i < len(model.layers):
        if i in runs:
            x, i = _rows_of_run(runs[i], x, positions, cache, slots_np, pos_np), runs[i].i1
            continue
        li, i = i, i + 1
        block = model.layers[li]
        fused = _fused_args(block) if floats else None
        if fused is None:  # the block's module path, row by row, as one sequence runs it
            x = torch.cat([block(x[b:b + 1], pos_t[b], views[b].layers[li], positions[b]) for b in range(B)])
            continue
        plan, aa, fa, norm_w = fused
        a = block.attn
        H, Hkv, Dh = plan.heads
        key = a.rotary._key if a.rotary is not None else None
        if key not in tables:
            tables[key] = _rotary_rows(a.rotary, positions, Dh)
        cos, sin = tables[key]
        kc, vc = _pools(cache.layers[li])
        lo = np.array([max(0, p - plan.window + 1) if plan.window else 0 for p in positions], np.int64)
        X = np.ascontiguousarray(x.reshape(B, -1).numpy())
        Y = np.empty_like(X)
        _block_rows(X, norm_w, plan.eps, plan.plus_one, plan.sandwich, aa[0], aa[1], aa[2], aa[3], plan.fused, aa[5],
                    plan.has_bias, plan.qk_norm, H, Hkv, Dh, cos, sin, a.rotary is not None, kc, vc, slots_np, pos_np,
                    lo, plan.scale, aa[4], fa[0], fa[1], fa[2], plan.act, Y)
        x = torch.from_numpy(Y).reshape(B, 1, -1)
    m = _head_matrix(model) if x.dtype == torch.float32 and hasattr(model, "norm") else None
    if m is None:
        return torch.cat([model.head(x[b:b + 1])[:, -1] for b in range(B)])
    xn = torch.cat([model.norm(x[b:b + 1]) for b in range(B)]).reshape(B, -1)
    out = np.empty((B, m[4].shape[0]), np.float32)
    _gemv_batch(m, np.ascontiguousarray(xn.numpy()), out)
    logits = torch.from_numpy(out)
    if model.softcap:
        logits = torch.cat([torch.tanh(r / model.softcap) * model.softcap for r in logits.split(1)])
    return logits
