"""A MoE layer's CPU experts as a host node of its CUDA graph.

A graphed decode step of a MoE layer with CPU experts otherwise returns to Python between its two
replays: the host queues the packed input's copy, runs the CPU experts, copies their sum up and adds
it (graphs.py), ~20 torch calls and their Python a layer, 250-400 µs of host time on the H200's host
against 200 µs of kernel (session 14's timeline). Here the whole step is one graph:

    attention half ─ router, pack ─ D2H packed ─ host node: CPU experts ─ H2D sum ─┐
                                 └ (forked) shared + fast-tier experts ──────────── + ─ res + h

The host node is `cuLaunchHostFunc` recorded into the capture: CUDA's own callback thread calls a
numba `cfunc` (compiled C, no Python, no GIL) with one int64 control block per layer that holds the
addresses and shapes of the layer's buffers and expert stacks. The cfunc reads the routing, picks the
routed experts held on the host and runs the same `qexperts` kernel the eager step runs. Nothing in it
can raise: an id out of range sets the block's status to -1 and `HostNode.check` raises on the main
thread (HybridMoE.host_step calls it after each replay; the previous step's node has finished by
then, its token having been read). H200, 6-layer Qwen3-30B-A3B shape, 20% of the experts on the GPU,
15 threads: decode 218-225 -> 236-275 tok/s against the split graphs (tools/bench_moe_decode.py).

numba's thread count is per calling thread, so the function sets it on every call (a thread-local
store, through the threading layer's C symbol): CUDA runs host functions on a driver thread of its
own, which is not promised to be the same one for every graph or stream (on numba's default count,
every core, the kernel's threads would contend with the thread that drives the GPU).
"""

from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from hotcold.sparse_ops.cpu import ACTS
from hotcold.sparse_ops.quant import XQ_DEFAULT, QuantMatrix, _qexperts_one_kernel

# the control block: int64 [N_CTL]
(X, D, W, IDS, K, POS, E, GATE, GATE_R, GATE_C, UP, UP_R, UP_C, DOWN, DOWN_R, DOWN_C, QU, QD, GU_X8, D_X8,
 HIDDEN, ACT, XQ_UP, XQ_DOWN, OUT, THREADS, STATUS, CALLS, BUSY_NS) = range(29)
N_CTL = 29


@intrinsic
def _set_num_threads(typingctx, n):
    """numba's thread count for the calling thread, through the threading layer's `set_num_threads`
    symbol (numba registers it with LLVM when its threads start). numba.set_num_threads in jitted code
    would call it through a ctypes pointer, a dynamic global that keeps the function out of the cache."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "set_num_threads")
        builder.call(fn, [builder.trunc(args[0], ir.IntType(32))])
        return context.get_dummy_value()

    return types.void(n), codegen


@intrinsic
def _void_ptr(typingctx, addr):
    """An integer address as a void pointer (nopython)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(addr), codegen


@intrinsic
def _now_ns(typingctx):
    """CLOCK_MONOTONIC in ns, through libc's clock_gettime (a vDSO call, ~20 ns)."""

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.LiteralStructType([i64, i64]))  # struct timespec
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ts.type])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        builder.call(fn, [ir.Constant(ir.IntType(32), 1), ts])  # 1: CLOCK_MONOTONIC
        sec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 0))
        nsec = builder.load(cgutils.gep_inbounds(builder, ts, 0, 1))
        return builder.add(builder.mul(sec, ir.Constant(i64, 1_000_000_000)), nsec)

    return types.int64(), codegen


def _host_experts(user):
    # user: the control block. One token's routed host experts, as MoEJob._run_whole computes them.
    ctl = numba.carray(user, (N_CTL,), np.int64)
    t0 = _now_ns()
    _set_num_threads(ctl[THREADS])
    x = numba.carray(_void_ptr(ctl[X]), (ctl[D],), np.float32)
    w = numba.carray(_void_ptr(ctl[W]), (ctl[K],), np.float32)
    ids = numba.carray(_void_ptr(ctl[IDS]), (ctl[K],), np.int32)
    pos = numba.carray(_void_ptr(ctl[POS]), (ctl[E],), np.int64)
    out = numba.carray(_void_ptr(ctl[OUT]), (ctl[D],), np.float32)
    gate = numba.carray(_void_ptr(ctl[GATE]), (ctl[GATE_R], ctl[GATE_C]), np.uint8)
    up = numba.carray(_void_ptr(ctl[UP]), (ctl[UP_R], ctl[UP_C]), np.uint8)
    down = numba.carray(_void_ptr(ctl[DOWN]), (ctl[DOWN_R], ctl[DOWN_C]), np.uint8)
    out[:] = 0.0
    n = 0
    for j in range(ids.shape[0]):
        e = ids[j]
        if e < 0 or e >= pos.shape[0]:
            ctl[STATUS] = -1
            return
        if pos[e] >= 0:
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
    if n:
        _qexperts_one_kernel(x, first, coef, ctl[QU], gate, up, ctl[GU_X8] != 0, ctl[QD], down, ctl[D_X8] != 0,
                             ctl[HIDDEN], ctl[ACT], ctl[XQ_UP] != 0, ctl[XQ_DOWN] != 0, out)
    ctl[STATUS] = n
    ctl[CALLS] += 1
    ctl[BUSY_NS] += _now_ns() - t0


_CFUNC = None


def host_function():
    """The compiled host function (void(void*), a numba cfunc, cached on disk), built on first use."""
    global _CFUNC
    if _CFUNC is None:
        _launch_threads()  # numba's thread pool and its symbols, which the function links to
        _CFUNC = numba.cfunc(types.void(types.voidptr), nopython=True, cache=True)(_host_experts)
    return _CFUNC


_CUDA = None


def _driver():
    global _CUDA
    if _CUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuLaunchHostFunc.restype = ctypes.c_int
        _CUDA = lib
    return _CUDA


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class HostNode:
    """One MoE layer's CPU experts for one token, as a host function over fixed buffers.

    x: float32 [D], weights: float32 [k], ids: int32 [k] (views of the layer's pinned packed input),
    pos: int64 [E] (each expert's position in the stacks, -1 on the fast tier), gate/up/down: the
    stacked QuantMatrix experts (checked once by the layer), out: float32 [D] (pinned). The arrays
    must outlive the node; it keeps references to them."""

    def __init__(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, pos: np.ndarray, gate: QuantMatrix,
                 up: QuantMatrix, down: QuantMatrix, act: str, out: np.ndarray, threads: int):
        for name, a, dt in (("x", x, np.float32), ("weights", weights, np.float32), ("ids", ids, np.int32),
                            ("pos", pos, np.int64), ("out", out, np.float32)):
            if a.dtype != dt or a.ndim != 1 or not a.flags.c_contiguous:
                raise ValueError(f"{name} must be a C-contiguous 1-D {np.dtype(dt)} array")
        if x.shape != out.shape or weights.shape != ids.shape:
            raise ValueError("x and out, weights and ids must have equal shapes")
        self.keep = (x, weights, ids, pos, gate, up, down, out)
        c = self.ctl = np.zeros(N_CTL, np.int64)
        c[X], c[D], c[W], c[IDS], c[K] = _addr(x), x.shape[0], _addr(weights), _addr(ids), ids.shape[0]
        c[POS], c[E], c[OUT] = _addr(pos), pos.shape[0], _addr(out)
        for i, m in ((GATE, gate), (UP, up), (DOWN, down)):
            c[i], c[i + 1], c[i + 2] = _addr(m.data), *m.data.shape
        c[QU], c[QD], c[GU_X8], c[D_X8], c[HIDDEN] = up._id, down._id, up.interleaved, down.interleaved, down.cols
        c[ACT], c[XQ_UP] = ACTS[act], up.interleaved or up.qtype in XQ_DEFAULT
        c[XQ_DOWN] = down.interleaved or down.qtype in XQ_DEFAULT
        c[THREADS] = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))
        self.fn = host_function()

    def __call__(self) -> int:
        """Run the function in this thread (tests, CPU): returns the host experts computed."""
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.fn.address)(_addr(self.ctl))
        self.check()
        return int(self.ctl[STATUS])

    def launch(self, stream) -> None:
        """Queue the function on a CUDA stream (torch.cuda.Stream); inside a graph capture it is
        recorded as a host node."""
        rc = _driver().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(self.fn.address),
                                        ctypes.c_void_p(_addr(self.ctl)))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}")

    @property
    def calls(self) -> int:
        return int(self.ctl[CALLS])

    @property
    def busy_s(self) -> float:
        """Seconds spent in the function over all its calls (the CPU's busy time for this layer)."""
        return float(self.ctl[BUSY_NS]) * 1e-9

    def check(self) -> None:
        """Raise if the last completed call met an expert id out of range."""
        if self.ctl[STATUS] < 0:
            raise RuntimeError(f"CPU experts (host node): an expert id out of range [0, {self.ctl[E]}) was routed")


__all__ = ["HostNode", "host_function"]
