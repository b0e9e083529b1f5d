"""The host node's compiled function (executors/host_node.py) against the eager step's kernel call."""

import time

import numpy as np
import pytest

from hotcold.executors.host_node import HostNode
from hotcold.sparse_ops import quant
from tests.test_quant_ops import EXPERT_TYPES, expert_stacks


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
