"""A MoE layer's CPU experts, or a dense layer's cold FFN rows, as a host node of its CUDA graph.

A graphed decode step of a MoE layer with CPU experts otherwise returns to Python between its two
replays: the host queues the packed input's copy, runs the CPU experts, copies their sum up and adds
it (graphs.py), ~20 torch calls and their Python a layer: 250-400 µs of host time around about 200
µs of kernel on a 16-core host. Here the whole step is one graph:

    attention half ─ router, pack ─ D2H packed ─ host node: CPU experts ─ H2D sum ─┐
                                 └ (forked) shared + fast-tier experts ──────────── + ─ res + h

The host node is `cuLaunchHostFunc` recorded into the capture: CUDA's own callback thread calls a
numba `cfunc` (compiled C, no Python, no GIL) with one int64 control block per layer that holds the
addresses and shapes of the layer's buffers and expert stacks. The cfunc reads the routing, picks the
routed experts held on the host and runs the same `qexperts` kernel the eager step runs. Nothing in it
can raise: an id out of range sets the block's status to -1 and `HostNode.check` raises on the main
thread (HybridMoE.host_step calls it after each replay; the previous step's node has finished by
then, its token having been read). `tools/bench_moe_decode.py --host-nodes no,yes` compares it with
the split graphs.

FFNHostNode does the same for a dense or gated layer (HybridFFN): its pinned input and cold mask come
down, the function turns the mask into rows and runs the kernel the worker's ColdJob runs (`ffn_rows`
for float/int8 rows, one compiled function per storage kind; `qffn_rows` for GGUF blocks), and the
sum goes up (EngineOptions.dense_host_nodes, default on;
`tools/bench_hybrid.py --host-nodes no,yes` compares it with the split graphs).

Each function times itself (CLOCK_MONOTONIC around its work, `busy_s`): the CPU's busy share of a
token without a host-side timer (tools/bench_moe_decode.py --idle).

numba's thread count is per calling thread, so the function sets it on every call (a thread-local
store, through the threading layer's C symbol): CUDA runs host functions on a driver thread of its
own, which is not promised to be the same one for every graph or stream (on numba's default count,
every core, the kernel's threads would contend with the thread that drives the GPU).
"""

from __future__ import annotations

import ctypes
import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from hotcold.sparse_ops.cpu import ACTS, HostMatrix, _ffn_one_kernel
from hotcold.sparse_ops import quant as block_quant  # its XQ_DEFAULT read when a node is built (tests patch it)
from hotcold.sparse_ops.quant import QuantMatrix, held_experts, qexperts_one_kernel, qffn_one_kernel

# the control block: int64 [N_CTL]; every node's starts with THREADS, STATUS, CALLS, BUSY_NS
THREADS, STATUS, CALLS, BUSY_NS = range(4)
# a MoE layer's CPU experts (HostNode)
(X, D, W, IDS, K, POS, E, GATE, GATE_R, GATE_C, UP, UP_R, UP_C, DOWN, DOWN_R, DOWN_C, QU, QD, GU_X8, D_X8,
 HIDDEN, ACT, XQ_UP, XQ_DOWN, OUT) = range(4, 29)
# a dense layer's cold FFN rows (FFNHostNode): the mask's rows of up/gate/down_t, as ColdJob computes them
(F_X, F_D, F_MASK, F_C, F_ROWS, F_UP, F_UP_S, F_UP_C, F_GATE, F_GATE_S, F_DOWN, F_DOWN_S, F_DOWN_C, F_QU, F_QD,
 F_BIAS, F_ACT, F_XQ, F_OUT) = range(4, 23)
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


@numba.njit(nogil=True, cache=True)
def _begin(user):
    # -> (the control block int64 [N_CTL], the start time); the caller's numba thread count set
    ctl = numba.carray(user, (N_CTL,), np.int64)
    t0 = _now_ns()
    _set_num_threads(ctl[THREADS])
    return ctl, t0


@numba.njit(nogil=True, cache=True)
def _end(ctl, t0, status):
    # a completed call: its status (rows or experts computed), counted and timed
    ctl[STATUS] = status
    ctl[CALLS] += 1
    ctl[BUSY_NS] += _now_ns() - t0


def _host_experts(user):
    # user: the control block. One token's routed host experts, as MoEJob._run_whole computes them.
    ctl, t0 = _begin(user)
    x = numba.carray(_void_ptr(ctl[X]), (ctl[D],), np.float32)
    w = numba.carray(_void_ptr(ctl[W]), (ctl[K],), np.float32)
    ids = numba.carray(_void_ptr(ctl[IDS]), (ctl[K],), np.int32)
    pos = numba.carray(_void_ptr(ctl[POS]), (ctl[E],), np.int64)
    out = numba.carray(_void_ptr(ctl[OUT]), (ctl[D],), np.float32)
    gate = numba.carray(_void_ptr(ctl[GATE]), (ctl[GATE_R], ctl[GATE_C]), np.uint8)
    up = numba.carray(_void_ptr(ctl[UP]), (ctl[UP_R], ctl[UP_C]), np.uint8)
    down = numba.carray(_void_ptr(ctl[DOWN]), (ctl[DOWN_R], ctl[DOWN_C]), np.uint8)
    out[:] = 0.0
    for j in range(ids.shape[0]):  # a router's id outside the table: the step fails, nothing is read
        if ids[j] < 0 or ids[j] >= pos.shape[0]:
            ctl[STATUS] = -1
            return
    first, coef = held_experts(ids, w, pos)
    n = first.shape[0]
    if n:
        qexperts_one_kernel(x, first, coef, ctl[QU], gate, up, ctl[GU_X8] != 0, ctl[QD], down, ctl[D_X8] != 0,
                             ctl[HIDDEN], ctl[ACT], ctl[XQ_UP] != 0, ctl[XQ_DOWN] != 0, out)
    _end(ctl, t0, n)


# ------------------------------------------------------------------ a dense layer's cold FFN rows

@numba.njit(nogil=True, cache=True)
def _ffn_call_args(ctl):
    # -> (x [D], rows [n]: the mask's set positions (all C rows without a mask), out [D] zeroed)
    c = ctl[F_C]
    x = numba.carray(_void_ptr(ctl[F_X]), (ctl[F_D],), np.float32)
    out = numba.carray(_void_ptr(ctl[F_OUT]), (ctl[F_D],), np.float32)
    rows = numba.carray(_void_ptr(ctl[F_ROWS]), (c,), np.int64)
    out[:] = 0.0
    n = 0
    if ctl[F_MASK] == 0:
        for j in range(c):
            rows[j] = j
        n = c
    else:
        mask = numba.carray(_void_ptr(ctl[F_MASK]), (c,), np.uint8)
        for j in range(c):
            if mask[j]:
                rows[n] = j
                n += 1
    return x, numba.carray(_void_ptr(ctl[F_ROWS]), (n,), np.int64), out  # rows[:n], typed C-contiguous


@numba.njit(nogil=True, cache=True)
def _ffn_bias(ctl):
    if ctl[F_BIAS] != 0:
        return numba.carray(_void_ptr(ctl[F_BIAS]), (ctl[F_C],), np.float32)
    return np.zeros(1, np.float32)


@numba.njit(nogil=True, cache=True)
def _ffn_float(ctl, dt):
    # up/gate/down_t [C, D] stored as dt (float32, uint16 bf16 bits, int16 f16 bits, int8) -> rows computed
    x, rows, out = _ffn_call_args(ctl)
    c = ctl[F_C]
    shape = (c, ctl[F_D])
    up = numba.carray(_void_ptr(ctl[F_UP]), shape, dt)
    gate = numba.carray(_void_ptr(ctl[F_GATE]), shape, dt)
    down = numba.carray(_void_ptr(ctl[F_DOWN]), shape, dt)
    us = numba.carray(_void_ptr(ctl[F_UP_S]), (c,), np.float32)
    gs = numba.carray(_void_ptr(ctl[F_GATE_S]), (c,), np.float32)
    ds = numba.carray(_void_ptr(ctl[F_DOWN_S]), (c,), np.float32)
    n = rows.shape[0]
    if n:
        _ffn_one_kernel(x, rows, up, us, gate, gs, _ffn_bias(ctl), down, ds, ctl[F_ACT], ctl[F_GATE] != ctl[F_UP],
                        ctl[F_BIAS] != 0, min(ctl[THREADS], n), out)
    return n


@numba.njit(nogil=True, cache=True)
def _ffn_quant(ctl):
    # GGUF blocks: up/gate of type F_QU, down_t of type F_QD (rows as the file has them) -> rows computed
    x, rows, out = _ffn_call_args(ctl)
    c = ctl[F_C]
    up = numba.carray(_void_ptr(ctl[F_UP]), (c, ctl[F_UP_C]), np.uint8)
    gate = numba.carray(_void_ptr(ctl[F_GATE]), (c, ctl[F_UP_C]), np.uint8)
    down = numba.carray(_void_ptr(ctl[F_DOWN]), (c, ctl[F_DOWN_C]), np.uint8)
    n = rows.shape[0]
    if n:
        qffn_one_kernel(x, rows, ctl[F_QU], up, gate, ctl[F_QD], down, ctl[F_ACT], ctl[F_GATE] != ctl[F_UP],
                         ctl[F_XQ] != 0, _ffn_bias(ctl), ctl[F_BIAS] != 0, np.zeros(1, np.float32), False,
                         min(ctl[THREADS], n), out)
    return n


KIND_CODES = {"f32": 0, "bf16": 1, "f16": 2, "i8": 3, "quant": 4}  # storage kinds as control-block codes (layer_node.MODES)


# one host function per storage kind: a cfunc's types are fixed when it compiles
def _host_ffn_f32(user):
    ctl, t0 = _begin(user)
    _end(ctl, t0, _ffn_float(ctl, np.float32))


def _host_ffn_bf16(user):  # bfloat16 bits
    ctl, t0 = _begin(user)
    _end(ctl, t0, _ffn_float(ctl, np.uint16))


def _host_ffn_f16(user):  # float16 bits
    ctl, t0 = _begin(user)
    _end(ctl, t0, _ffn_float(ctl, np.int16))


def _host_ffn_i8(user):
    ctl, t0 = _begin(user)
    _end(ctl, t0, _ffn_float(ctl, np.int8))


def _host_ffn_quant(user):
    ctl, t0 = _begin(user)
    _end(ctl, t0, _ffn_quant(ctl))


_FFN_BODIES = {"quant": _host_ffn_quant, "f32": _host_ffn_f32, "bf16": _host_ffn_bf16, "f16": _host_ffn_f16,
               "i8": _host_ffn_i8}
_CFUNCS: dict = {}
BUILD_S = [0.0]  # seconds spent building host functions in this process (compiling them, or loading numba's cache)


def _compiled(body):
    """body as a host function (void(void*), a numba cfunc, cached on disk), built on first use."""
    if body not in _CFUNCS:
        t = time.perf_counter()
        _launch_threads()  # numba's thread pool and its symbols, which the function links to
        _CFUNCS[body] = numba.cfunc(types.void(types.voidptr), nopython=True, cache=True)(body)
        BUILD_S[0] += time.perf_counter() - t
    return _CFUNCS[body]


def host_function():
    """The compiled host function of a MoE layer's CPU experts."""
    return _compiled(_host_experts)


def ffn_host_function(kind: str):
    """The compiled host function of a cold FFN of storage `kind` ("quant", "f32", "bf16", "f16", "i8")."""
    return _compiled(_FFN_BODIES[kind])


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


class _Node:
    """A host function over a control block `ctl` (int64 [N_CTL]) and the arrays it points into,
    which the node keeps alive (`keep`)."""

    ctl: np.ndarray
    fn: object
    keep: tuple
    failure = "failed"

    def __call__(self) -> int:
        """Run the function in this thread (tests, CPU): returns its status (rows or experts computed)."""
        call = self.__dict__.get("_call")
        if call is None:
            call = self._call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.fn.address)
        call(_addr(self.ctl))  # (ctypes lets go of the GIL for the call)
        self.check()
        return int(self.ctl[STATUS])

    def launch(self, stream) -> None:
        """Queue the function on a CUDA stream (torch.cuda.Stream); inside a graph capture it is
        recorded as a host node."""
        rc = _driver().cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(self.fn.address),
                                        ctypes.c_void_p(_addr(self.ctl)))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {rc}")

    def check(self) -> None:
        """Raise if the last completed call failed."""
        if self.ctl[STATUS] < 0:
            raise RuntimeError(self.failure)

    @property
    def calls(self) -> int:
        return int(self.ctl[CALLS])

    @property
    def busy_s(self) -> float:
        """Seconds spent in the function over all its calls (the CPU's busy time for this layer)."""
        return float(self.ctl[BUSY_NS]) * 1e-9

    def _threads(self, threads: int) -> None:
        self.ctl[THREADS] = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))


def _check_vector(name: str, a: np.ndarray, dt) -> None:
    if a.dtype != dt or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous 1-D {np.dtype(dt)} array")


class HostNode(_Node):
    """One MoE layer's CPU experts for one token, as a host function over fixed buffers.

    x: float32 [D], weights: float32 [k], ids: int32 [k] (views of the layer's pinned packed input),
    pos: int64 [E] (each expert's position in the stacks, -1 on the fast tier), gate/up/down: the
    stacked QuantMatrix experts (checked once by the layer), out: float32 [D] (pinned). The arrays
    must outlive the node; it keeps references to them."""

    def __init__(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, pos: np.ndarray, gate: QuantMatrix,
                 up: QuantMatrix, down: QuantMatrix, act: str, out: np.ndarray, threads: int):
        for name, a, dt in (("x", x, np.float32), ("weights", weights, np.float32), ("ids", ids, np.int32),
                            ("pos", pos, np.int64), ("out", out, np.float32)):
            _check_vector(name, a, dt)
        if x.shape != out.shape or weights.shape != ids.shape:
            raise ValueError("x and out, weights and ids must have equal shapes")
        self.keep = (x, weights, ids, pos, gate, up, down, out)
        c = self.ctl = np.zeros(N_CTL, np.int64)
        c[X], c[D], c[W], c[IDS], c[K] = _addr(x), x.shape[0], _addr(weights), _addr(ids), ids.shape[0]
        c[POS], c[E], c[OUT] = _addr(pos), pos.shape[0], _addr(out)
        for i, m in ((GATE, gate), (UP, up), (DOWN, down)):
            c[i], c[i + 1], c[i + 2] = _addr(m.data), *m.data.shape
        c[QU], c[QD], c[GU_X8], c[D_X8], c[HIDDEN] = up._id, down._id, up.interleaved, down.interleaved, down.cols
        c[ACT], c[XQ_UP] = ACTS[act], up.interleaved or up.qtype in block_quant.formats.XQ_DEFAULT
        c[XQ_DOWN] = down.interleaved or down.qtype in block_quant.formats.XQ_DEFAULT
        self._threads(threads)
        self.failure = f"CPU experts (host node): an expert id out of range [0, {pos.shape[0]}) was routed"
        self.fn = host_function()


def ffn_node_kind(cold) -> str | None:
    """The FFNHostNode kind of a cold FFN (executors/weights.ColdFFN), or None where no host function
    computes it: mixed storage, or quantised rows interleaved (whole-matrix layouts)."""
    mats = [m for m in (cold.up, cold.gate, cold.down_t) if m is not None]
    if cold.down_t is None or cold.down is not None:
        return None
    if all(isinstance(m, QuantMatrix) and not m.interleaved for m in mats):
        return "quant"
    if all(isinstance(m, HostMatrix) for m in mats) and len({m.kind for m in mats}) == 1:
        return mats[0].kind
    return None


def cold_slots(c: np.ndarray, x: np.ndarray, mask: np.ndarray | None, cold, out: np.ndarray) -> tuple[str, tuple]:
    """Fill a control block's cold-FFN slots (F_X .. F_OUT) for the rows of `cold` that `mask` selects
    (all without one), x -> out; returns (the storage kind, the arrays the block points into)."""
    kind = ffn_node_kind(cold)
    if kind is None:
        raise ValueError("no host function for this cold FFN's storage (mixed kinds or interleaved rows)")
    _check_vector("x", x, np.float32)
    _check_vector("out", out, np.float32)
    if mask is not None:
        _check_vector("mask", mask, np.bool_)
        if mask.shape[0] != cold.n:
            raise ValueError(f"mask has {mask.shape[0]} entries for {cold.n} cold rows")
    up, gate, down = cold.up, cold.gate if cold.gate is not None else cold.up, cold.down_t
    if x.shape != out.shape or x.shape[0] != up.shape[1]:
        raise ValueError(f"x and out must be [{up.shape[1]}]")
    rows = np.empty(cold.n, np.int64)
    bias = None if cold.gate is not None or cold.up_bias is None else np.ascontiguousarray(cold.up_bias, np.float32)
    c[F_X], c[F_D], c[F_MASK], c[F_C], c[F_ROWS] = _addr(x), x.shape[0], 0 if mask is None else _addr(mask), cold.n, _addr(rows)
    c[F_OUT], c[F_ACT], c[F_BIAS] = _addr(out), ACTS[cold.act], 0 if bias is None else _addr(bias)
    if kind == "quant":
        c[F_UP], c[F_UP_C], c[F_GATE] = _addr(up.data), up.data.shape[1], _addr(gate.data)
        c[F_DOWN], c[F_DOWN_C], c[F_QU], c[F_QD] = _addr(down.data), down.data.shape[1], up._id, down._id
        c[F_XQ] = up.qtype in block_quant.formats.XQ_DEFAULT
    else:
        c[F_UP], c[F_UP_S], c[F_GATE], c[F_GATE_S] = _addr(up._w), _addr(up._s), _addr(gate._w), _addr(gate._s)
        c[F_DOWN], c[F_DOWN_S] = _addr(down._w), _addr(down._s)
    return kind, (x, mask, cold, out, rows, bias)


class FFNHostNode(_Node):
    """A dense or gated layer's cold FFN rows for one token, as a host function: the rows the mask
    selects (all of them without one) computed as `ColdJob.run` computes them (`ffn_rows` /
    `qffn_rows` over up, gate and down_t), written to out.

    x: float32 [D], mask: bool [C] or None (both pinned views the layer's copies fill), cold: the
    layer's ColdFFN (`ffn_node_kind` must name it), out: float32 [D] (pinned)."""

    def __init__(self, x: np.ndarray, mask: np.ndarray | None, cold, out: np.ndarray, threads: int):
        self.ctl = np.zeros(N_CTL, np.int64)
        self.kind, self.keep = cold_slots(self.ctl, x, mask, cold, out)
        self._threads(threads)
        self.fn = ffn_host_function(self.kind)


__all__ = ["FFNHostNode", "HostNode", "KIND_CODES", "cold_slots", "ffn_host_function", "ffn_node_kind", "host_function"]
