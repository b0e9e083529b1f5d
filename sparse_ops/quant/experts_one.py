"""One token through whole experts (MoE decode): `qexperts_one_kernel`. Over row-interleaved stacks
each block loop streams several groups at once: an expert's gate and up groups side by side, and
two experts' W_down groups side by side, with software prefetch ahead of every stream."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .activations import _quantize_span, _quantize_x, _sums16, _sums16_span
from .formats import _BLOCK, _INLINE, _JIT, _NAME_OF_ID, Q4_0, Q4_1, Q4_K, Q8_0, X8
from .kernels import _expert_down_span, _expert_h_span, _gated_span
from .tiles import _BLOCKS, WIDE, _prefetch_fn
from .vector import _F32, _I64, _IR_BLOCK_BYTES, _vconst

# ---------------------------------------------------------------------------------------------
# A decode token reads each routed expert's weights once: the kernel is bound by how fast one core
# streams them from DRAM, and the group dot of interleaved.py costs about half of that time again in
# instructions (1 thread, Q4_0 from L2: ~37 GB/s of weights; a plain read of the same bytes from
# DRAM: ~17 GB/s on the 2-core AMX Xeon). Time goes to the sum of the two unless the loads are
# issued far enough ahead. So each block loop here walks S streams (S matrices' group runs, each of
# ng groups: 2 side by side in zmm with AVX-512 VNNI, Q4_K's block 1), its S accumulators independent,
# and prefetches every stream NEAR bytes ahead into L1 and FAR bytes ahead into L2 (the next groups
# of a task, which the same thread reads next). Phase (1), per task of 32 rows of one expert: its
# gate and up groups as two streams; phase (2), per task of 16 output rows: the experts' W_down groups
# two experts at a time. Each stream's per-block arithmetic is the one-token group dot's (the block
# functions under interleaved.py's exact flags), and an output row sums its experts' W_down dots in
# their order, so a token gets bit for bit what `qexperts_tokens` (tiles.py) computes for it.
# 1 thread, 8 routed Q4_0 Qwen3-30B-A3B experts (21 MB) from DRAM: 1.45 ms, where the group dot one
# group a loop took 1.95 and a plain read of the same bytes takes 1.2 (2 threads: 0.81, read 0.71).

NEAR = 1024  # bytes ahead of a stream's block prefetched into L1
FAR = 4096  # bytes ahead prefetched into L2
ROWS = 32  # rows of one expert per phase-1 task: 4 groups, one Q8 block of h
SPAN = 16  # output rows per phase-2 task: 2 groups


def _make_streams(qt, S, ng):
    """Intrinsic (ws, gs, xq, xd, xr, out): for s < S, out[s, :8 ng] = the 8 ng rows of groups gs[s] ..
    gs[s] + ng - 1 of the interleaved matrix ws[s] (type qt) . x_s, x_s the Q8 activations of row
    xr[s] of xq int8 [N, C] / xd float32 [N, C / 16]; ws a UniTuple of S uint8 matrices of the same
    shape, gs and xr UniTuples of S int64."""
    block = _BLOCKS[qt]

    def dot(typingctx, ws, gs, xq, xd, xr, out):
        if not (isinstance(ws, types.UniTuple) and ws.count == S and isinstance(ws.dtype, types.Array)
                and ws.dtype.ndim == 2 and ws.dtype.dtype == types.uint8
                and all(isinstance(t, types.UniTuple) and t.count == S and isinstance(t.dtype, types.Integer)
                        for t in (gs, xr))
                and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == dt
                        for a, dt in ((xq, types.int8), (xd, types.float32), (out, types.float32)))):
            return None

        def codegen(context, bd, sig, args):
            was = [context.make_array(sig.args[0].dtype)(context, bd, v) for v in cgutils.unpack_tuple(bd, args[0], S)]
            gv, rv = (cgutils.unpack_tuple(bd, args[i], S) for i in (1, 4))
            xa, xda, oa = (context.make_array(sig.args[i])(context, bd, args[i]) for i in (2, 3, 5))
            gb = X8 * _IR_BLOCK_BYTES[qt]
            cx, cd = bd.extract_value(xa.shape, 1), bd.extract_value(xda.shape, 1)
            streams = []
            for s in range(S):
                stride = bd.extract_value(was[s].strides, 0)
                g0 = bd.sext(gv[s], _I64) if gv[s].type.width < 64 else gv[s]
                r = bd.sext(rv[s], _I64) if rv[s].type.width < 64 else rv[s]
                rows = tuple(bd.gep(was[s].data, [bd.mul(bd.add(g0, ir.Constant(_I64, k)), stride)]) for k in range(ng))
                xp, xdp = bd.gep(xa.data, [bd.mul(r, cx)]), bd.gep(xda.data, [bd.mul(r, cd)])
                streams.append((rows, xp, xdp, cgutils.alloca_once_value(bd, _vconst(_F32, X8 * ng, 0.0))))
            nb = bd.sdiv(bd.extract_value(was[0].shape, 1), ir.Constant(_I64, gb))
            pf = _prefetch_fn(bd)
            i32 = ir.IntType(32)
            with cgutils.for_range(bd, nb) as loop:
                b = loop.index
                o = bd.mul(b, ir.Constant(_I64, gb))
                for rows, _, _, _ in streams:
                    for r in rows:
                        for ahead, level in ((NEAR, 3), (FAR, 2)):  # (read, locality, data)
                            for k in range(-(-gb // 64)):
                                bd.call(pf, [bd.gep(r, [bd.add(o, ir.Constant(_I64, ahead + 64 * k))]),
                                             ir.Constant(i32, 0), ir.Constant(i32, level), ir.Constant(i32, 1)])
                for rows, xp, xdp, acc in streams:
                    bd.store(block(bd, rows if ng > 1 else rows[0], o, b, xp, xdp, bd.load(acc), chains=2), acc)
            ncol = bd.extract_value(oa.shape, 1)
            for s, (_, _, _, acc) in enumerate(streams):
                dst = bd.gep(oa.data, [bd.mul(ir.Constant(_I64, s), ncol)])
                bd.store(bd.load(acc), bd.bitcast(dst, ir.VectorType(_F32, X8 * ng).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(ws, gs, xq, xd, xr, out), codegen

    dot.__name__ = dot.__qualname__ = f"_{_NAME_OF_ID[qt].lower()}_streams{S}x{ng}"
    return intrinsic(dot)


_NG = {qt: (1 if qt == Q4_K else WIDE) for qt in (Q4_0, Q4_1, Q4_K, Q8_0)}  # groups side by side a stream
_q4_0_s1, _q4_1_s1, _q4_k_s1, _q8_0_s1 = (_make_streams(qt, 1, _NG[qt]) for qt in (Q4_0, Q4_1, Q4_K, Q8_0))
_q4_0_s2, _q4_1_s2, _q4_k_s2, _q8_0_s2 = (_make_streams(qt, 2, _NG[qt]) for qt in (Q4_0, Q4_1, Q4_K, Q8_0))


@njit(**_INLINE)
def _streams2(qt, ws, gs, xq, xd, xr, out):
    if qt == Q4_K:
        _q4_k_s2(ws, gs, xq, xd, xr, out)
    elif qt == Q8_0:
        _q8_0_s2(ws, gs, xq, xd, xr, out)
    elif qt == Q4_1:
        _q4_1_s2(ws, gs, xq, xd, xr, out)
    else:
        _q4_0_s2(ws, gs, xq, xd, xr, out)


@njit(**_INLINE)
def _streams1(qt, ws, gs, xq, xd, xr, out):
    if qt == Q4_K:
        _q4_k_s1(ws, gs, xq, xd, xr, out)
    elif qt == Q8_0:
        _q8_0_s1(ws, gs, xq, xd, xr, out)
    elif qt == Q4_1:
        _q4_1_s1(ws, gs, xq, xd, xr, out)
    else:
        _q4_0_s1(ws, gs, xq, xd, xr, out)


@njit(nogil=True, fastmath=True, cache=True)
def _h_task(qu, gate, up, first, k, I, lo, xq, xd, coef, act, xq_down, h, hs, hq, hd):
    # rows [lo, lo + ROWS) of expert first[k], gate / up interleaved: h = act(g) u coef[k] at k I + lo,
    # its sums of 16 and (xq_down) its Q8 block; gate and up as the two streams of one block loop
    ng = 1 if qu == Q4_K else WIDE
    w = X8 * ng
    o = np.empty((2, w), np.float32)
    g0 = first[k] * (I // X8) + lo // X8
    a = k * I + lo
    for q in range(0, ROWS // X8, ng):
        _streams2(qu, (gate, up), (g0 + q, g0 + q), xq, xd, (0, 0), o)
        _gated_span(o[0], o[1], coef[k], act, h[a + X8 * q:a + X8 * q + w], 0, w)
    _sums16_span(h, a, a + ROWS, hs)
    if xq_down:
        _quantize_span(h, a, a + ROWS, hq, hd)


@njit(nogil=True, cache=True)  # (no fast-math: the sum over experts stays in their order)
def _down_task(qd, down, first, D, lo, hq, hd, out):
    # out[lo:lo + SPAN] += sum over k (in order) of rows [lo, lo + SPAN) of expert first[k]'s
    # interleaved W_down . h_k (Q8 rows of hq / hd), two experts a block loop
    n = first.shape[0]
    ng = 1 if qd == Q4_K else WIDE
    w = X8 * ng
    part = np.empty((2, w), np.float32)
    acc = np.zeros(SPAN, np.float32)
    for q in range(0, SPAN // X8, ng):
        c = lo // X8 + q
        for k in range(0, n - 1, 2):
            _streams2(qd, (down, down), (first[k] * (D // X8) + c, first[k + 1] * (D // X8) + c), hq, hd, (k, k + 1),
                      part)
            for r in range(w):
                acc[X8 * q + r] += part[0, r]
            for r in range(w):
                acc[X8 * q + r] += part[1, r]
        if n % 2:
            _streams1(qd, (down,), (first[n - 1] * (D // X8) + c,), hq, hd, (n - 1,), part)
            for r in range(w):
                acc[X8 * q + r] += part[0, r]
    for r in range(SPAN):
        out[lo + r] += acc[r]


@njit(**_JIT)
def qexperts_one_kernel(x, first, coef, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down, out):
    # One token through n whole experts (MoE decode). Expert k's gate / up rows are [first[k] I,
    # (first[k] + 1) I) of gate / up (type qu); its W_down, as GGUF stores it (blocks along the neuron
    # axis), rows [first[k] D, (first[k] + 1) D) of down (type qd). gu_x8 / d_x8: the matrices are
    # interleaved (pack_rows; Q8 activations). Two parallel phases (each a fork/join of the thread
    # team): (1) per task, 32 rows of one expert: g, u, h = act(g) u coef[k], and h's sums of 16 and
    # Q8 blocks (when xq_down); (2) per task, a span of output rows d: out[d] += the sum over k, in
    # order, of W_down_k[d] . h_k. Interleaved stacks take the streamed block loops above (_h_task,
    # _down_task); GGUF rows the row kernels of kernels.py.
    n, D = first.shape[0], x.shape[0]
    K = n * I
    xs = _sums16(x)
    if xq_up:
        xq, xd = _quantize_x(x)
    else:
        xq, xd = np.empty(0, np.int8), np.empty(0, np.float32)
    g = np.empty(K if not gu_x8 else 0, np.float32)
    u = np.empty(K if not gu_x8 else 0, np.float32)
    h = np.empty(K, np.float32)
    hs = np.empty(K // 16, np.float32)  # I is a multiple of 32: no block straddles two experts
    hq = np.empty(K if xq_down else 0, np.int8)
    hd = np.empty(K // 16 if xq_down else 0, np.float32)
    step = ROWS  # rows per task: a multiple of X8 and of the 32 of a Q8 block
    ni = (I + step - 1) // step
    if gu_x8:
        xq2, xd2 = xq.reshape(1, D), xd.reshape(1, D // 16)
        for t in prange(n * ni):
            _h_task(qu, gate, up, first, t // ni, I, (t % ni) * step, xq2, xd2, coef, act, xq_down, h, hs, hq, hd)
    else:
        for t in prange(n * ni):
            k, c = t // ni, t % ni
            lo, hi = c * step, min(I, (c + 1) * step)
            _expert_h_span(qu, gate, up, gu_x8, first, k, I, lo, hi, x, xs, xq, xd, xq_up, coef, act, xq_down, g, u,
                           h, hs, hq, hd)
    if d_x8:
        hq2, hd2 = hq.reshape(n, I), hd.reshape(n, I // 16)
        for c in prange(D // SPAN):
            _down_task(qd, down, first, D, c * SPAN, hq2, hd2, out)
        return
    part = np.empty(n * D, np.float32)
    sd = 2 * _BLOCK  # output rows per task (a multiple of X8)
    nd = (D + sd - 1) // sd
    for c in prange(nd):
        lo, hi = c * sd, min(D, (c + 1) * sd)
        for k in range(n):
            _expert_down_span(qd, down, d_x8, first, k, D, lo, hi, I, h, hs, hq, hd, xq_down, part)
        for d in range(lo, hi):
            acc = np.float32(0.0)
            for k in range(n):
                acc += part[k * D + d]
            out[d] += acc


@njit(nogil=True, cache=True)
def held_experts(ids, w, pos):
    # One token's routed experts that this host holds, in routing order: (their positions in the
    # stack, their routing weights) for the j with pos[ids[j]] >= 0 (-1: computed elsewhere).
    n = 0
    for j in range(ids.shape[0]):
        if pos[ids[j]] >= 0:
            n += 1
    first = np.empty(n, np.int64)
    coef = np.empty(n, np.float32)
    n = 0
    for j in range(ids.shape[0]):
        p = pos[ids[j]]
        if p >= 0:
            first[n] = p
            coef[n] = w[j]
            n += 1
    return first, coef


@njit(nogil=True, cache=True)
def qexperts_routed_kernel(x, ids, w, pos, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down, out):
    # One token's routed experts that this host holds (MoE decode): out = the sum over j, in routing
    # order, of w[j] * expert pos[ids[j]] (x) over `held_experts`; the selection and the kernel in one
    # call. Returns how many experts were computed.
    first, coef = held_experts(ids, w, pos)
    n = first.shape[0]
    out[:] = 0.0
    if n:
        qexperts_one_kernel(x, first, coef, qu, gate, up, gu_x8, qd, down, d_x8, I, act, xq_up, xq_down, out)
    return n
