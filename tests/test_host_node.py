"""The host node's compiled function (executors/host_node.py) against the eager step's kernel call."""

import time

import numpy as np
import pytest
import torch

from hotcold.executors.host_node import HostNode
from hotcold.sparse_ops import quant
from test_quant_ops import EXPERT_TYPES, expert_stacks


def _buffers(n_exp: int, d: int, k: int, on_host: list[int], seed: int):
    rng = np.random.default_rng(seed)
    pos = np.full(n_exp, -1, np.int64)
    pos[on_host] = np.arange(len(on_host))
    x = rng.standard_normal(d).astype(np.float32)
    w = rng.random(k).astype(np.float32)
    ids = rng.permutation(n_exp)[:k].astype(np.int32)
    return x, w, ids, pos


@pytest.mark.parametrize("gtype,dtype", EXPERT_TYPES[:3])
@pytest.mark.parametrize("packed", [False, True])
def test_host_node_equals_the_eager_kernel(gtype, dtype, packed):
    """Over several routings (some experts on the fast tier), the cfunc computes exactly what
    MoEJob's qexperts_trusted call computes, overwriting out, and counts the host experts."""
    stacks = expert_stacks(gtype, dtype, n=5)
    gate, up, down = (quant.pack_rows(m) for m in stacks) if packed else stacks
    n_exp, host = 8, [1, 2, 4, 6, 7]  # 5 stacked host experts; 0, 3, 5 on the fast tier
    x, w, ids, pos = _buffers(n_exp, 256, 4, host, 0)
    out = np.full(256, 7.0, np.float32)
    node = HostNode(x, w, ids, pos, gate, up, down, "silu", out, threads=2)
    rng = np.random.default_rng(1)
    wall = 0.0
    for step in range(5):
        x[:] = rng.standard_normal(256)
        w[:] = rng.random(4)
        ids[:] = rng.permutation(n_exp)[:4]
        p = pos[ids]
        want = np.zeros(256, np.float32)
        quant.qexperts_trusted(x, p[p >= 0], w[p >= 0], gate, up, down, "silu", want)
        t0 = time.perf_counter()
        assert node() == int((p >= 0).sum())
        wall += time.perf_counter() - t0
        assert np.array_equal(out, want)
    assert node.calls == 5
    assert 0 < node.busy_s <= wall  # the function times itself (the CPU's busy share in the bench)
    ids[:] = [0, 3, 5, 0]  # all on the fast tier: out is zero
    assert node() == 0 and not out.any()


def test_host_node_reports_a_bad_id_and_bad_buffers():
    gate, up, down = expert_stacks("Q4_0", "Q4_0", n=3, i=64, d=64)
    x, w, ids, pos = _buffers(3, 64, 2, [0, 1, 2], 2)
    out = np.zeros(64, np.float32)
    node = HostNode(x, w, ids, pos, gate, up, down, "silu", out, threads=1)
    ids[:] = [0, 3]
    with pytest.raises(RuntimeError, match="out of range"):
        node()
    with pytest.raises(ValueError, match="ids"):
        HostNode(x, w, ids.astype(np.int64), pos, gate, up, down, "silu", out, threads=1)
    with pytest.raises(ValueError, match="equal shapes"):
        HostNode(x, w, ids, pos, gate, up, down, "silu", out[:32], threads=1)


def test_host_node_sets_the_thread_count_of_the_thread_that_runs_it():
    """numba's thread count is per thread and CUDA runs host functions on a thread of its own: the
    function sets the node's count in whichever thread calls it (here: a new Python thread)."""
    import threading

    import numba

    gate, up, down = expert_stacks("Q4_0", "Q4_0", n=2, i=64, d=64)
    x, w, ids, pos = _buffers(2, 64, 1, [0, 1], 3)
    node = HostNode(x, w, ids, pos, gate, up, down, "silu", np.zeros(64, np.float32), threads=1)
    seen = []

    def run():
        seen.append(numba.get_num_threads())
        node()
        seen.append(numba.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [numba.config.NUMBA_NUM_THREADS, 1] or (numba.config.NUMBA_NUM_THREADS == 1 and seen == [1, 1])


def _cold_ffn(kind: str, gated: bool, act: str, c: int = 96, d: int = 256, seed: int = 0):
    """A ColdFFN of c rows over d: float storage of `kind`, or GGUF blocks ("Q4_0", "Q4_K"; down_t Q8_0)."""
    from hotcold.executors.weights import ColdFFN
    from hotcold.sparse_ops.cpu import HostMatrix

    g = torch.Generator().manual_seed(seed)
    mats = [torch.randn(c, d, generator=g) * 0.05 for _ in range(3)]
    bias = None if gated else torch.randn(c, generator=g).numpy() * 0.1
    if kind in ("f32", "bf16", "f16", "i8"):
        up, gate, down = (HostMatrix.from_torch(m, kind) for m in mats)
    else:
        up, gate = (quant.QuantMatrix(quant.quantize_rows(m.numpy(), kind), kind, (c, d)) for m in mats[:2])
        down = quant.QuantMatrix(quant.quantize_rows(mats[2].numpy(), "Q8_0"), "Q8_0", (c, d))
    return ColdFFN(np.arange(c, dtype=np.int64), up, gate if gated else None, down, bias, act)


@pytest.mark.parametrize("kind,gated,act", [("f32", True, "silu"), ("bf16", True, "silu"), ("f16", False, "relu"),
                                            ("i8", True, "gelu_tanh"), ("Q4_0", True, "silu"),
                                            ("Q4_K", False, "relu")])
def test_ffn_host_node_equals_the_cold_job(kind, gated, act):
    """A dense layer's cold rows as a host node (FFNHostNode) compute exactly what the worker's
    ColdJob computes from the same pinned-style buffers: with a mask (several draws, an empty one)
    and without one (every cold row), overwriting out; its status counts the rows."""
    from hotcold.executors.cpu_executor import ColdJob
    from hotcold.executors.host_node import FFNHostNode, ffn_node_kind
    from hotcold.sparse_ops.cpu import get_threads

    cold = _cold_ffn(kind, gated, act)
    assert ffn_node_kind(cold) == ("quant" if kind.startswith("Q") else kind)
    rng = np.random.default_rng(3)
    x = np.zeros(256, np.float32)
    mask = np.zeros(cold.n, np.bool_)
    out = np.full(256, 5.0, np.float32)
    threads = get_threads()  # the ColdJob's kernels split their sums by the calling thread's count
    node = FFNHostNode(x, mask, cold, out, threads=threads)
    whole = FFNHostNode(x, None, cold, out, threads=threads)
    for step in range(4):
        x[:] = rng.standard_normal(256)
        mask[:] = rng.random(cold.n) < (0.0 if step == 3 else 0.4)
        want = np.zeros((1, 256), np.float32)
        ColdJob(cold, x[None].copy(), mask.copy(), want).run()
        assert node() == int(mask.sum())
        assert np.array_equal(out, want[0])
        ColdJob(cold, x[None].copy(), None, want).run()
        assert whole() == cold.n and np.array_equal(out, want[0]) and out.any()
    assert node.calls == 4 and node.busy_s > 0


def test_ffn_host_node_refuses_what_it_cannot_compute():
    from hotcold.executors.host_node import FFNHostNode, ffn_node_kind
    from hotcold.sparse_ops.cpu import HostMatrix

    cold = _cold_ffn("f32", True, "silu", c=32)
    x, out = np.zeros(256, np.float32), np.zeros(256, np.float32)
    with pytest.raises(ValueError, match="mask has 8 entries"):
        FFNHostNode(x, np.zeros(8, np.bool_), cold, out, threads=1)
    with pytest.raises(ValueError, match="x and out"):
        FFNHostNode(x[:128], None, cold, out[:128], threads=1)
    cold.down_t = HostMatrix.from_torch(torch.zeros(32, 256), "bf16")  # mixed kinds
    assert ffn_node_kind(cold) is None
    with pytest.raises(ValueError, match="no host function"):
        FFNHostNode(x, None, cold, out, threads=1)
