"""Several tokens through whole experts in the row-interleaved layout (MoE prefill): each decoded
block of 8 rows is dotted with a tile of up to `TILE` tokens' Q8 activations held in registers."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .activations import _quantize_span, _sums16_span
from .formats import _INLINE, _JIT, _NAME_OF_ID, Q4_0, Q4_1, Q4_K, Q8_0, X8
from .interleaved import _x8_q4_block, _x8_q4_k_block, _x8_q8_0_block
from .kernels import _expert_down_span, _gated_span
from .vector import _F32, _I64, _IR_BLOCK_BYTES, _IR_ROWS, _VNNI, _vconst

# ---------------------------------------------------------------------------------------------
# A 128-token chunk of a model with 128 experts, 8 routed per token, gives an expert ~8 tokens
# (~32 at 512). The one-token group dot of interleaved.py spends much of its work on the block, not
# on the token: loading and unpacking the nibbles, the 8 rows' scales. Here a block is decoded once
# for a tile of up to TILE tokens and dotted with each (per token and 32-block: 8 vpdpbusd against
# its broadcast Q8 values and 5 float operations), the tile's accumulators in registers; with
# AVX-512 VNNI two groups side by side (16 rows, zmm). Each token's per-block arithmetic is the
# one-token kernel's own block function (inlined once per token; LLVM merges the token-independent
# loads and unpacking) under interleaved.py's exact flags, so each token gets bit for bit the
# products `qexperts` computes for it. 1 thread, a group pair from L1, Q4_0 [16, 2048]: 2.5 ns a
# token per 8-row block for the one-token dot, 1.56 in tiles of 4 tokens, 1.39 of 8 (the vpdpbusd
# port's bound at ~3 GHz is 1.33).

TILE = 8  # the most tokens a decoded block is dotted with (8 float accumulators, 8 unpacked chunks, the
# scales and the integer dot in flight fit AVX-512's 32 registers)
WIDE = 2 if _VNNI and _IR_ROWS == 8 else 1  # groups a call dots side by side (Q4_K's block: one)
PREFETCH = 1024  # bytes ahead of a group's block prefetched into L1 for the MoE prefill (the weights come
# from DRAM; 1 thread, 128 tokens: gate / up dots 34 -> 28 ms); callers give their own distance

_BLOCKS = {Q4_0: lambda *a, chains: _x8_q4_block(*a, Q4_0, chains),
           Q4_1: lambda *a, chains: _x8_q4_block(*a, Q4_1, chains), Q4_K: _x8_q4_k_block, Q8_0: _x8_q8_0_block}
_I8P, _I32T = ir.PointerType(ir.IntType(8)), ir.IntType(32)


def _prefetch_fn(bd):
    return bd.module.declare_intrinsic("llvm.prefetch", [_I8P],
                                       fnty=ir.FunctionType(ir.VoidType(), [_I8P, _I32T, _I32T, _I32T]))


def _make_tile_dot(qt, n, ng):
    """Intrinsic (w, g, xq, xd, xrows, j0, out, orow, ocol, ahead): for i < n, out[orow + i, ocol:ocol + 8 ng] =
    the 8 ng rows of groups g .. g + ng - 1 of the interleaved matrix w (type qt) . x_i, x_i the Q8
    activations of row xrows[j0 + i] of xq int8 [N, C] / xd float32 [N, C / 16] (as _quantize_span
    writes them); each block's bytes `ahead` bytes further on are prefetched into L1 on the way."""
    block = _BLOCKS[qt]

    def dot(typingctx, w, g, xq, xd, xrows, j0, out, orow, ocol, ahead):
        arrays = ((xq, 2, types.int8), (xd, 2, types.float32), (xrows, 1, types.int64), (out, 2, types.float32))
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8
                and all(isinstance(a, types.Array) and a.ndim == nd and a.layout == "C" and a.dtype == dt
                        for a, nd, dt in arrays)
                and all(isinstance(i, types.Integer) for i in (g, j0, orow, ocol, ahead))):
            return None
        sig = types.void(w, types.int64, xq, xd, xrows, types.int64, out, types.int64, types.int64, types.int64)

        def codegen(context, bd, sig, args):
            wa, xa, xda, ra, oa = (context.make_array(sig.args[i])(context, bd, args[i]) for i in (0, 2, 3, 4, 6))
            g, j0, orow, ocol, ahead = (args[i] for i in (1, 5, 7, 8, 9))
            gb = X8 * _IR_BLOCK_BYTES[qt]
            stride = bd.extract_value(wa.strides, 0)
            rows = tuple(bd.gep(wa.data, [bd.mul(bd.add(g, ir.Constant(_I64, k)), stride)]) for k in range(ng))
            row = rows if ng > 1 else rows[0]
            nb = bd.sdiv(bd.extract_value(wa.shape, 1), ir.Constant(_I64, gb))
            cx, cd = bd.extract_value(xa.shape, 1), bd.extract_value(xda.shape, 1)
            xps, accs = [], []
            for i in range(n):
                r = bd.load(bd.gep(ra.data, [bd.add(j0, ir.Constant(_I64, i))]))
                xps.append((bd.gep(xa.data, [bd.mul(r, cx)]), bd.gep(xda.data, [bd.mul(r, cd)])))
                accs.append(cgutils.alloca_once_value(bd, _vconst(_F32, X8 * ng, 0.0)))
            pf = _prefetch_fn(bd)
            with cgutils.for_range(bd, nb) as loop:
                b = loop.index
                o = bd.mul(b, ir.Constant(_I64, gb))
                o_ahead = bd.add(o, ahead)
                for r in rows:  # the group's block `ahead` bytes on into L1 (read, locality 3, data)
                    for k in range(-(-gb // 64)):
                        bd.call(pf, [bd.gep(r, [bd.add(o_ahead, ir.Constant(_I64, 64 * k))]),
                                     ir.Constant(_I32T, 0), ir.Constant(_I32T, 3), ir.Constant(_I32T, 1)])
                for (xp, xdp), acc in zip(xps, accs):
                    bd.store(block(bd, row, o, b, xp, xdp, bd.load(acc), chains=1 if n > 1 else 2), acc)
            ncol = bd.extract_value(oa.shape, 1)
            for i, acc in enumerate(accs):
                dst = bd.gep(oa.data, [bd.add(bd.mul(bd.add(orow, ir.Constant(_I64, i)), ncol), ocol)])
                bd.store(bd.load(acc), bd.bitcast(dst, ir.VectorType(_F32, X8 * ng).as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    dot.__name__ = dot.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_tile{n}x{ng}_dot"
    return intrinsic(dot)


@intrinsic
def _prefetch_groups(typingctx, w, g, n):
    """Groups g .. g + n - 1 of the interleaved matrix w into L2 (prefetcht1 every 64 bytes): an
    expert's next span of W_down while the current one is computed (the spans of successive experts
    lie apart, where the hardware prefetchers start over; 1 thread, 128 tokens: 22.5 -> 19.2 ms)."""
    if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8
            and isinstance(g, types.Integer) and isinstance(n, types.Integer)):
        return None
    sig = types.void(w, types.int64, types.int64)

    def codegen(context, bd, sig, args):
        wa = context.make_array(sig.args[0])(context, bd, args[0])
        pf = _prefetch_fn(bd)
        stride = bd.extract_value(wa.strides, 0)
        start = bd.gep(wa.data, [bd.mul(args[1], stride)])
        with cgutils.for_range(bd, bd.sdiv(bd.mul(args[2], stride), ir.Constant(_I64, 64))) as loop:
            bd.call(pf, [bd.gep(start, [bd.mul(loop.index, ir.Constant(_I64, 64))]), ir.Constant(_I32T, 0),
                         ir.Constant(_I32T, 2), ir.Constant(_I32T, 1)])
        return context.get_dummy_value()

    return sig, codegen


def _dispatch(qt, ng):
    """njit (n, w, g, xq, xd, xrows, j0, out, orow, ocol, ahead): `_make_tile_dot`'s intrinsic for qt, ng and
    min(n, TILE) tokens."""
    t1, t2, t3, t4, t5, t6, t7, t8 = (_make_tile_dot(qt, n, ng) for n in range(1, TILE + 1))

    @njit(**_INLINE)
    def run(n, w, g, xq, xd, xrows, j0, out, orow, ocol, ahead):
        if n >= 8:
            t8(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 7:
            t7(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 6:
            t6(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 5:
            t5(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 4:
            t4(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 3:
            t3(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        elif n == 2:
            t2(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)
        else:
            t1(w, g, xq, xd, xrows, j0, out, orow, ocol, ahead)

    return run


_q4_0_tiles, _q4_1_tiles, _q4_k_tiles, _q8_0_tiles = (_dispatch(qt, 1) for qt in (Q4_0, Q4_1, Q4_K, Q8_0))
_q4_0_wide, _q4_1_wide, _q8_0_wide = (_dispatch(qt, WIDE) for qt in (Q4_0, Q4_1, Q8_0))


@njit(nogil=True, fastmath=True, cache=True)
def _tile_rows(qt, w, g, ng, xq, xd, xrows, lo, hi, out, orow, ocol, ahead):
    # out[orow + j - lo, ocol:ocol + 8 ng] = groups g .. g + ng - 1 (ng 1 or 2) of w . the activations
    # of row xrows[j], for j in [lo, hi): the fewest tiles of at most TILE tokens, of near-equal sizes
    # (a block is decoded once a tile), each block's bytes `ahead` bytes on prefetched into L1. (One
    # compiled function for all callers: 56 intrinsics.)
    nt = (hi - lo + TILE - 1) // TILE
    for i in range(nt):
        j0 = lo + (hi - lo) * i // nt
        n, r = lo + (hi - lo) * (i + 1) // nt - j0, orow + j0 - lo
        if ng == WIDE and qt != Q4_K:
            if qt == Q8_0:
                _q8_0_wide(n, w, g, xq, xd, xrows, j0, out, r, ocol, ahead)
            elif qt == Q4_1:
                _q4_1_wide(n, w, g, xq, xd, xrows, j0, out, r, ocol, ahead)
            else:
                _q4_0_wide(n, w, g, xq, xd, xrows, j0, out, r, ocol, ahead)
            continue
        for k in range(ng):
            if qt == Q4_K:
                _q4_k_tiles(n, w, g + k, xq, xd, xrows, j0, out, r, ocol + X8 * k, ahead)
            elif qt == Q8_0:
                _q8_0_tiles(n, w, g + k, xq, xd, xrows, j0, out, r, ocol + X8 * k, ahead)
            elif qt == Q4_1:
                _q4_1_tiles(n, w, g + k, xq, xd, xrows, j0, out, r, ocol + X8 * k, ahead)
            else:
                _q4_0_tiles(n, w, g + k, xq, xd, xrows, j0, out, r, ocol + X8 * k, ahead)


@njit(**_JIT)
def _tiles_h_kernel(X, tok, first, coef, starts, qu, gate, up, I, act, xq_down):
    # (0) every token's Q8 activations, once; (1) per task, 32 rows (4 groups) of one expert: its gate
    # / up groups dotted with all its pairs' tokens, a tile at a time, then h = act(g) u coef and h's
    # Q8 block (xq_down) or sums of 16 -> (h, hq, hd, hs), one row per pair
    T, D = X.shape
    P = tok.shape[0]
    xq = np.empty((T, D), np.int8)
    xd = np.empty((T, D // 16), np.float32)
    for t in prange(T):
        _quantize_span(X[t], 0, D, xq[t], xd[t])
    h = np.empty((P, 0 if xq_down else I), np.float32)  # (float h only for a down in GGUF rows)
    hq = np.empty((P, I if xq_down else 0), np.int8)
    hd = np.empty((P, I // 16 if xq_down else 0), np.float32)
    hs = np.empty((P, 0 if xq_down else I // 16), np.float32)
    step = 32  # rows per task: 4 groups, one Q8 block of h
    ni = I // step
    n = starts.shape[0] - 1
    for task in prange(n * ni):
        k, c = task // ni, task % ni
        s0, s1 = starts[k], starts[k + 1]
        lo = c * step
        g0 = first[s0] * (I // X8) + lo // X8
        g = np.empty((s1 - s0, step), np.float32)  # this task's rows of gate x, up x, h for its pairs
        u = np.empty((s1 - s0, step), np.float32)
        for q in range(0, step // X8, 2):
            _tile_rows(qu, gate, g0 + q, 2, xq, xd, tok, s0, s1, g, 0, X8 * q, PREFETCH)
            _tile_rows(qu, up, g0 + q, 2, xq, xd, tok, s0, s1, u, 0, X8 * q, PREFETCH)
        for j in range(s0, s1):
            hj = g[j - s0]
            _gated_span(hj, u[j - s0], coef[j], act, hj, 0, step)
            if xq_down:
                _quantize_span(hj, 0, step, hq[j, lo:lo + step], hd[j, lo // 16:lo // 16 + 2])
            else:
                h[j, lo:lo + step] = hj
                _sums16_span(h[j], lo, lo + step, hs[j])
    return h, hq, hd, hs


@njit(**_JIT)
def _tiles_down_kernel(tok, first, starts, h, hq, hd, hs, qd, down, d_x8, xq_down, out):
    # (2) per task, 32 output rows: for each expert in turn, its down groups (d_x8: interleaved, tiled
    # over its pairs; else the GGUF rows, pair by pair) against its pairs' h, summed per token in
    # expert order, then added to out[token]
    T, D = out.shape
    P, I = tok.shape[0], (hq.shape[1] if xq_down else h.shape[1])
    n = starts.shape[0] - 1
    pairs = np.arange(P)
    most = 0  # the most pairs of an expert
    for k in range(n):
        most = max(most, starts[k + 1] - starts[k])
    sd = 32  # output rows per task
    nd = (D + sd - 1) // sd
    for c in prange(nd):
        lo, hi = c * sd, min(D, (c + 1) * sd)
        acc = np.zeros((T, sd), np.float32)
        part = np.empty((most, 2 * X8), np.float32)
        pf = np.empty(D if not d_x8 else 0, np.float32)
        for k in range(n):
            s0, s1 = starts[k], starts[k + 1]
            if d_x8:
                g0 = first[s0] * (D // X8)
                if k + 1 < n:
                    _prefetch_groups(down, first[s1] * (D // X8) + lo // X8, (hi - lo) // X8)
                for q in range(lo // X8, hi // X8, 2):
                    ng = min(2, hi // X8 - q)
                    _tile_rows(qd, down, g0 + q, ng, hq, hd, pairs, s0, s1, part, 0, 0, PREFETCH)
                    for j in range(s0, s1):
                        for r in range(X8 * ng):
                            acc[tok[j], X8 * q - lo + r] += part[j - s0, r]
            else:
                for j in range(s0, s1):  # (as pair 0 of a one-pair list: pf holds one pair's rows)
                    _expert_down_span(qd, down, False, first[j:j + 1], 0, D, lo, hi, I, h[j], hs[j], hq[j], hd[j],
                                      xq_down, pf)
                    for d in range(lo, hi):
                        acc[tok[j], d - lo] += pf[d]
        for t in range(T):
            for d in range(lo, hi):
                out[t, d] += acc[t, d - lo]


def qexperts_tiles(X, tok, first, coef, starts, qu, gate, up, qd, down, d_x8, I, act, xq_down, out):
    """Several tokens through whole experts (MoE prefill), gate / up interleaved (Q8 activations):
    out[tok[j]] += coef[j] * expert first[j] (X[tok[j]]) over the pairs j, grouped by expert in ascending
    order, group k = pairs [starts[k], starts[k+1]) (tokens ascending); two kernels (`_tiles_h_kernel`,
    `_tiles_down_kernel`). Each token's sum over its experts runs in ascending expert order."""
    h, hq, hd, hs = _tiles_h_kernel(X, tok, first, coef, starts, qu, gate, up, I, act, xq_down)
    _tiles_down_kernel(tok, first, starts, h, hq, hd, hs, qd, down, d_x8, xq_down, out)
