"""hotcold.sparse_ops against dense torch references (float64), for every kind, shape and selection."""

from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hotcold.sparse_ops import cpu, gpu
from hotcold.sparse_ops.cpu import HostMatrix

KINDS = ["f32", "f16", "bf16", "i8"]
ACTS = ["relu", "silu", "gelu_tanh"]
SHAPES = [(64, 40), (200, 100), (33, 17)]  # D = 40: multiple of 8 not 16; 100 and 17: neither
TIGHT = 2e-5  # float32 accumulation, relative to the largest |reference| entry (or to Σ|w·x|)
LOOSE = {"f32": 2e-5, "f16": 5e-3, "bf16": 2e-2, "i8": 4e-2}  # against the original float32 weights
ROUNDING = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}  # relative rounding of one stored weight
TORCH_ACT = {"relu": torch.relu, "silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def weights(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) / d ** 0.5  # so that dot products with randn x are O(1)


def host(w: torch.Tensor, kind: str) -> HostMatrix:
    return HostMatrix.from_torch(w if kind in ("f32", "i8") else w.to(gpu_dtype(kind)), kind)


def gpu_dtype(kind: str) -> torch.dtype:
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]


def selection(n: int, how: str, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if how == "empty":
        return np.zeros(0, dtype)
    if how == "full":
        return np.arange(n, dtype=dtype)
    if how == "one":
        return np.array([n - 1], dtype)
    if how == "unsorted":
        return rng.permutation(n)[: n // 2].astype(dtype)
    return np.sort(rng.choice(n, max(1, n // 3), replace=False)).astype(dtype)


def assert_close(got, want, tol: float) -> None:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape
    if want.size == 0:
        return
    err = np.abs(got - want).max()
    scale = max(np.abs(want).max(), 1e-3)
    assert err <= tol * scale, f"max error {err:.3g} > {tol:g} * {scale:.3g}"


def assert_within(got, want, bound) -> None:
    """Elementwise |got - want| <= bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), f"error {err.flat[worst]:.3g} > bound {np.asarray(bound).flat[worst]:.3g}"


def weight_error_bound(w: torch.Tensor, m: HostMatrix, sel, x: np.ndarray) -> np.ndarray:
    """Bound on |Σ_d (w - stored)_jd x_d| per row j of w[sel]: storage rounding (f16/bf16), or
    scale/2 per element (i8), plus float32 accumulation. -> [K]"""
    a = w.double()[sel].abs().numpy()  # [K, D]
    ax = np.abs(x.astype(np.float64))
    if m.kind == "i8":
        return m.scale[sel.numpy()].astype(np.float64) / 2 * ax.sum() + TIGHT * (a @ ax)
    return (ROUNDING[m.kind] + TIGHT) * (a @ ax)


def ref_ffn(X, rows, up, down_t, act, gate=None, bias=None) -> np.ndarray:
    """Dense float64 reference on the selected rows. X [T, D], weights torch [N, D] -> [T, D]."""
    X = torch.as_tensor(X, dtype=torch.float64)
    sel = torch.as_tensor(rows, dtype=torch.long)
    u = X @ up.double()[sel].T
    if gate is not None:
        h = TORCH_ACT[act](X @ gate.double()[sel].T) * u
    else:
        h = TORCH_ACT[act](u + (bias.double()[sel] if bias is not None else 0))
    return (h @ down_t.double()[sel]).numpy()


# --------------------------------------------------------------------------------------------
# HostMatrix

@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
def test_from_torch_is_zero_copy(kind):
    w = weights(16, 24, 1).to(gpu_dtype(kind))
    m = HostMatrix.from_torch(w)
    assert m.kind == kind and m.shape == (16, 24) and m.nbytes == w.numel() * w.element_size()
    assert m.data.ctypes.data == w.data_ptr()
    x = np.ones(24, np.float32)
    before = cpu.gemv_rows(m, np.array([3]), x)[0]
    w[3] += 1.0  # the kernel must see the tensor's new values
    after = cpu.gemv_rows(m, np.array([3]), x)[0]
    assert after == pytest.approx(before + 24, rel=1e-2)
    assert torch.equal(m.to_torch(), w.float())


def test_from_torch_converts_kind_and_layout():
    w = weights(10, 12, 2)
    m = HostMatrix.from_torch(w.T, "bf16")  # non-contiguous source, other dtype: converted copy
    assert m.kind == "bf16" and m.shape == (12, 10) and m.data.dtype == np.uint16
    assert torch.equal(m.to_torch(), w.T.bfloat16().float())


@pytest.mark.parametrize("n,d", SHAPES)
def test_i8_quantisation_error_within_half_scale(n, d):
    w = weights(n, d, 3)
    w[5] = 0.0  # an all-zero row must not divide by zero
    m = HostMatrix.from_torch(w, "i8")
    assert m.data.dtype == np.int8 and m.scale.dtype == np.float32 and m.scale.shape == (n,)
    assert m.scale[5] == 0 and not m.data[5].any()
    assert np.abs(m.data).max() <= 127
    err = (w - m.to_torch()).abs().amax(dim=1).numpy()
    assert np.all(err <= m.scale / 2 * (1 + 1e-5) + 1e-12)
    assert np.allclose(m.scale, w.abs().amax(dim=1).numpy() / 127, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("how", ["all", "some", "none", "one"])
@pytest.mark.parametrize("shape", [(300, 260), (7, 5), (129, 1)])  # tiles of 128: edges on both sides
def test_gather_columns_is_the_transposed_selection(dtype, how, shape):
    r, c = shape
    g = torch.Generator().manual_seed(r * c)
    src = (torch.randn(r, c, generator=g) * 50).to(dtype)
    cols = {"all": torch.arange(c), "some": torch.randperm(c, generator=g)[: c // 2 + 1],
            "none": torch.zeros(0, dtype=torch.int64), "one": torch.tensor([c - 1])}[how]
    got = cpu.gather_columns(src, cols)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == (len(cols), r)
    assert torch.equal(got, src[:, cols].T)
    with pytest.raises(ValueError, match="cols"):
        cpu.gather_columns(src, torch.tensor([c]))
    with pytest.raises(ValueError, match="contiguous"):
        cpu.gather_columns(torch.cat([src, src], 1)[:, ::2], cols)


def test_hostmatrix_rejects_bad_input():
    with pytest.raises(ValueError):
        HostMatrix(np.zeros((2, 3), np.float64), "f32")
    with pytest.raises(ValueError):
        HostMatrix(np.zeros((2, 3), np.int8), "i8")  # no scale
    with pytest.raises(ValueError):
        HostMatrix.from_torch(torch.zeros(3), "f32")


# --------------------------------------------------------------------------------------------
# gemv_rows / axpy_rows

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("how", ["empty", "one", "some", "unsorted", "full"])
@pytest.mark.parametrize("rdtype", [np.int32, np.int64])
def test_gemv_rows(kind, n, d, how, rdtype):
    w = weights(n, d, 4)
    m = host(w, kind)
    rows = selection(n, how, rdtype)
    x = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    got = cpu.gemv_rows(m, rows, x)
    assert got.dtype == np.float32 and got.shape == rows.shape
    sel = torch.as_tensor(rows, dtype=torch.long)
    xt = torch.from_numpy(x).double()
    deq = m.to_torch().double()[sel]
    assert_within(got, (deq @ xt).numpy(), TIGHT * (deq.abs() @ xt.abs()).numpy())
    assert_within(got, (w.double()[sel] @ xt).numpy(), weight_error_bound(w, m, sel, x))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("how", ["empty", "one", "some", "unsorted", "full"])
@pytest.mark.parametrize("rdtype", [np.int32, np.int64])
def test_axpy_rows(kind, n, d, how, rdtype):
    w = weights(n, d, 6)
    m = host(w, kind)
    rows = selection(n, how, rdtype)
    rng = np.random.default_rng(7)
    coeff = rng.standard_normal(rows.size).astype(np.float32)
    out0 = rng.standard_normal(d).astype(np.float32)
    out = out0.copy()
    assert cpu.axpy_rows(m, rows, coeff, out) is out
    sel = torch.as_tensor(rows, dtype=torch.long)
    c = torch.from_numpy(coeff).double()
    deq = m.to_torch().double()[sel]
    slack = 1e-6 * np.abs(out0)  # rounding of out0 + delta in float32
    assert_within(out - out0, (c @ deq).numpy(), TIGHT * (c.abs() @ deq.abs()).numpy() + slack)
    if kind == "i8":
        bound = np.abs(coeff * m.scale[rows]).sum() / 2
    else:
        bound = ROUNDING[kind] * (c.abs() @ w.double()[sel].abs()).numpy()
    assert_within(out - out0, (c @ w.double()[sel]).numpy(), bound + TIGHT * (c.abs() @ deq.abs()).numpy() + slack)
    if how == "empty":
        assert np.array_equal(out, out0)


def test_gemv_out_and_dense_gemv():
    w = weights(50, 30, 8)
    m = HostMatrix.from_torch(w)
    x = np.random.default_rng(9).standard_normal(30).astype(np.float32)
    out = np.full(50, 7.0, np.float32)
    assert cpu.gemv_rows(m, np.arange(50), x, out) is out  # overwritten, not accumulated
    assert_close(out, (w.double() @ torch.from_numpy(x).double()).numpy(), TIGHT)
    assert_close(cpu.gemv(m, x), out, 1e-6)


def test_rows_out_of_range_raise():
    m = HostMatrix.from_torch(weights(8, 4, 0))
    for bad in ([8], [-1], [0, 3, 9]):
        with pytest.raises(IndexError):
            cpu.gemv_rows(m, np.array(bad), np.zeros(4, np.float32))
    with pytest.raises(IndexError):
        cpu.axpy_rows(m, np.array([8]), np.ones(1, np.float32), np.zeros(4, np.float32))


# --------------------------------------------------------------------------------------------
# fused FFN

def ffn_case(kind: str, variant: str, n: int = 96, d: int = 40, seed: int = 10):
    ws = [weights(n, d, seed + i) for i in range(3)]
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.5
    mats = [host(wi, kind) for wi in ws]
    gate = (ws[2], mats[2]) if variant == "gated" else (None, None)
    b = bias if variant == "bias" else None
    return ws[0], ws[1], gate, b, mats


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("variant", ["gated", "bias", "nobias"])
@pytest.mark.parametrize("T", [1, 5])
def test_ffn_rows(kind, act, variant, T):
    up_w, down_w, (gate_w, gate_m), bias, (up_m, down_m, _) = ffn_case(kind, variant)
    rows = selection(96, "some", np.int32, seed=T)
    X = np.random.default_rng(11).standard_normal((T, 40)).astype(np.float32)
    out0 = np.random.default_rng(12).standard_normal((T, 40)).astype(np.float32)
    bias_np = None if bias is None else bias.numpy()
    if T == 1:
        out = out0[0].copy()
        got = cpu.ffn_rows(X[0], rows, up_m, down_m, act, gate=gate_m, up_bias=bias_np, out=out)
        assert got is out
        got = (got - out0[0])[None]
    else:
        out = out0.copy()
        got = cpu.ffn_rows_batch(X, rows, up_m, down_m, act, gate=gate_m, up_bias=bias_np, out=out) - out0
    deq = lambda w: None if w is None else host(w, kind).to_torch()  # noqa: E731
    want = ref_ffn(X, rows, deq(up_w), deq(down_w), act, deq(gate_w), bias)
    assert_close(got, want, 5 * TIGHT)
    assert_close(got, ref_ffn(X, rows, up_w, down_w, act, gate_w, bias), 2 * LOOSE[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["empty", "one", "full"])
def test_ffn_rows_selection_edges(kind, how):
    up_w, down_w, (gate_w, gate_m), _, (up_m, down_m, _) = ffn_case(kind, "gated", n=33, d=17)
    rows = selection(33, how, np.int64)
    x = np.random.default_rng(13).standard_normal(17).astype(np.float32)
    got = cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)  # out None: zeros
    deq = lambda w: host(w, kind).to_torch()  # noqa: E731
    assert_close(got[None], ref_ffn(x[None], rows, deq(up_w), deq(down_w), "silu", deq(gate_w)), 5 * TIGHT)
    if how == "empty":
        assert not got.any()
    X = np.stack([x, -x, 2 * x])
    got_b = cpu.ffn_rows_batch(X, rows, up_m, down_m, "silu", gate=gate_m)
    assert got_b.shape == (3, 17)
    assert_close(got_b[0], got, 1e-6)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("variant", ["gated", "bias", "nobias"])
@pytest.mark.parametrize("how", ["empty", "one", "some", "full", None])
def test_ffn_dense_equals_the_rows_kernel_over_the_mask(kind, act, variant, how):
    """ffn_dense (torch GEMMs over all rows, in the rows' dtype, masked after the activation) computes
    the selected rows' FFN: against the float64 reference on the stored weights, and close to
    ffn_rows_batch; it adds into out; an empty mask leaves out as it was."""
    up_w, down_w, (gate_w, gate_m), bias, (up_m, down_m, _) = ffn_case(kind, variant)
    rows = np.arange(96) if how is None else selection(96, how, np.int64, seed=3)
    mask = None if how is None else np.isin(np.arange(96), rows)
    X = np.random.default_rng(14).standard_normal((7, 40)).astype(np.float32)
    out0 = np.random.default_rng(15).standard_normal((7, 40)).astype(np.float32)
    out = out0.copy()
    bias_np = None if bias is None else bias.numpy()
    got = cpu.ffn_dense(X, mask, up_m, down_m, act, gate=gate_m, up_bias=bias_np, out=out)
    assert got is out
    got = got - out0
    deq = lambda w: None if w is None else host(w, kind).to_torch()  # noqa: E731
    want = ref_ffn(X, rows, deq(up_w), deq(down_w), act, deq(gate_w), bias)
    if how == "empty":
        assert not got.any()
        return
    # activations rounded to the rows' dtype (and h after the activation): f16 / bf16 rounding
    assert_close(got, want, {"f32": 5 * TIGHT, "f16": 4e-3, "bf16": 3e-2}[kind])
    rows_k = cpu.ffn_rows_batch(X, rows, up_m, down_m, act, gate=gate_m, up_bias=bias_np)
    assert_close(got, rows_k, {"f32": 5 * TIGHT, "f16": 4e-3, "bf16": 3e-2}[kind])
    with pytest.raises(ValueError, match="X must be"):
        cpu.ffn_dense(X[:, :5], mask, up_m, down_m, act, gate=gate_m)
    with pytest.raises(ValueError, match="i8"):
        cpu.ffn_dense(X, mask, host(up_w, "i8"), host(down_w, "i8"), act)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 4])
def test_ffn_rows_row_scale(kind, T):
    """row_scale multiplies each row's activation: equal to the dense reference with down rows scaled
    (two stacked "experts" with different routing weights)."""
    up_w, down_w, (gate_w, gate_m), _, (up_m, down_m, _) = ffn_case(kind, "gated", n=64, d=24)
    rows = np.concatenate([np.arange(0, 16), np.arange(40, 64)])  # expert 0's rows 0-15, expert 1's 40-63
    scale = np.full(64, np.nan, np.float32)  # rows not selected are never read
    scale[:16], scale[40:] = 0.7, 0.25
    X = np.random.default_rng(16).standard_normal((T, 24)).astype(np.float32)
    got = cpu.ffn_rows_batch(X, rows, up_m, down_m, "silu", gate=gate_m, row_scale=scale)
    deq = lambda w: host(w, kind).to_torch()  # noqa: E731
    scaled_down = deq(down_w) * torch.from_numpy(np.nan_to_num(scale))[:, None]
    assert_close(got, ref_ffn(X, rows, deq(up_w), scaled_down, "silu", deq(gate_w)), 5 * TIGHT)
    plain = cpu.ffn_rows_batch(X, rows, up_m, down_m, "silu", gate=gate_m)
    assert np.abs(got - plain).max() > 1e-3  # the scale did something
    with pytest.raises(ValueError, match="row_scale"):
        cpu.ffn_rows_batch(X, rows, up_m, down_m, "silu", gate=gate_m, row_scale=scale[:10])


def test_ffn_rows_batch_many_tokens_tiles():
    """More tokens than one tile (tile = 64 KiB / (4 D)): the token loop must cover all of them."""
    d = 1024  # tile of 16 tokens
    up_w, down_w = weights(40, d, 20), weights(40, d, 21)
    up_m, down_m = HostMatrix.from_torch(up_w), HostMatrix.from_torch(down_w)
    rows = selection(40, "some", np.int64)
    X = np.random.default_rng(14).standard_normal((37, d)).astype(np.float32)
    got = cpu.ffn_rows_batch(X, rows, up_m, down_m, "relu")
    assert_close(got, ref_ffn(X, rows, up_w, down_w, "relu"), 5 * TIGHT)


def test_ffn_rows_bad_args():
    up_w, down_w = weights(20, 12, 30), weights(20, 12, 31)
    up_m, down_m = HostMatrix.from_torch(up_w), HostMatrix.from_torch(down_w)
    rows = np.array([1, 4, 19])
    x = np.random.default_rng(15).standard_normal(12).astype(np.float32)
    with pytest.raises(ValueError):
        cpu.ffn_rows(x, rows, up_m, down_m, "tanh")
    with pytest.raises(ValueError):
        cpu.ffn_rows(x, rows, up_m, HostMatrix.from_torch(weights(20, 13, 0)), "relu")
    with pytest.raises(ValueError):
        cpu.ffn_rows(x[:5], rows, up_m, down_m, "relu")


def test_results_independent_of_thread_count_and_run_in_worker_thread():
    up_w, down_w, (gate_w, gate_m), _, (up_m, down_m, _) = ffn_case("bf16", "gated", n=200, d=100)
    rows = selection(200, "some", np.int64)
    x = np.random.default_rng(16).standard_normal(100).astype(np.float32)
    before = cpu.get_threads()
    try:
        cpu.set_threads(1)
        one = cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)
        cpu.set_threads(numba.config.NUMBA_NUM_THREADS)
        many = cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)
    finally:
        cpu.set_threads(before)
    assert_close(many, one, 1e-5)
    res = {}
    worker = threading.Thread(target=lambda: res.update(y=cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)))
    worker.start()
    worker.join()
    assert_close(res["y"], one, 1e-5)
    for kernel in (cpu._gemv_rows_kernel, cpu._axpy_rows_kernel, cpu._ffn_rows_kernel):
        assert kernel.targetoptions["nogil"] and kernel.targetoptions["parallel"]


def test_set_threads_clamps():
    before = cpu.get_threads()
    try:
        cpu.set_threads(10**6)
        assert cpu.get_threads() == numba.config.NUMBA_NUM_THREADS
        cpu.set_threads(0)
        assert cpu.get_threads() == 1
    finally:
        cpu.set_threads(before)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="a team of one thread has no idle threads")
def test_release_threads_ends_the_calling_threads_team():
    up_w, down_w, (gate_w, gate_m), _, (up_m, down_m, _) = ffn_case("bf16", "gated", n=200, d=100)
    rows = selection(200, "some", np.int64)
    x = np.random.default_rng(17).standard_normal(100).astype(np.float32)
    seen = {}

    def settle(cond) -> int:  # released threads leave the barrier and then exit: wait for /proc to agree
        for _ in range(200):
            n = _tasks()
            if cond(n):
                return n
            time.sleep(0.01)
        return _tasks()

    def thread():  # a thread of its own, as CUDA's host-function thread: its team is the one released
        cpu.set_threads(numba.config.NUMBA_NUM_THREADS)
        seen["ref"] = cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)
        seen["with team"] = _tasks()
        seen["released"] = cpu.release_threads()
        seen["after"] = settle(lambda n: n < seen["with team"])
        seen["again"] = cpu.ffn_rows(x, rows, up_m, down_m, "silu", gate=gate_m)
        seen["team again"] = _tasks()
        cpu.release_threads()

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    if numba.threading_layer() != "omp":
        assert not seen["released"]  # only OpenMP keeps a team per calling thread
        return
    assert seen["released"]
    assert seen["after"] <= seen["with team"] - (numba.config.NUMBA_NUM_THREADS - 1)
    assert seen["team again"] > seen["after"]  # the next parallel call starts a new team
    assert_close(seen["again"], seen["ref"], 0)


# --------------------------------------------------------------------------------------------
# selection helpers

def test_cpu_selection_helpers():
    n = 12
    mask = np.zeros(n, bool)
    mask[[0, 3, 4, 9, 11]] = True
    assert cpu.mask_to_rows(mask).tolist() == [0, 3, 4, 9, 11]
    hot_idx = np.array([9, 3, 7])
    cold_idx = np.setdiff1d(np.arange(n), hot_idx)
    assert cpu.mask_to_rows(mask, cold_idx).tolist() == [0, 3, 8]  # positions of 0, 4, 11 in cold_idx
    hot_map, cold_map = cpu.index_map(hot_idx, n), cpu.index_map(cold_idx, n)
    assert hot_map.dtype == np.int32 and hot_map[9] == 0 and hot_map[7] == 2 and hot_map[0] == -1
    hot, cold = cpu.split_rows(np.array([0, 3, 4, 9, 11], np.int32), hot_map)
    assert hot.tolist() == [1, 0] and cold.tolist() == [0, 4, 11]
    hot, cold = cpu.split_rows(np.array([0, 3, 4, 9, 11]), hot_map, cold_map)
    assert cold_idx[cold].tolist() == [0, 4, 11]
    with pytest.raises(ValueError):
        cpu.split_rows(np.array([5]), hot_map, cpu.index_map(np.array([0]), n))


# --------------------------------------------------------------------------------------------
# GPU-side ops (CPU tensors here; CUDA variants marked)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("variant", ["gated", "bias"])
@pytest.mark.parametrize("T", [1, 5])
def test_hot_ffn(device, act, variant, T):
    n, d = 64, 40
    up_w, down_w, gate_w = (weights(n, d, 40 + i) for i in range(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    hot_idx = torch.tensor([60, 2, 17, 33, 5, 41])  # any order: the plan's order
    mask = torch.rand(T, len(hot_idx), generator=torch.Generator().manual_seed(T)) > 0.4
    X = torch.randn(T, d, generator=torch.Generator().manual_seed(4))
    dev = lambda t: t.to(device)  # noqa: E731
    gate = dev(gpu.compact_rows(gate_w, hot_idx)) if variant == "gated" else None
    b = dev(bias[hot_idx]) if variant == "bias" else None
    got = gpu.hot_ffn(dev(X), dev(gpu.compact_rows(up_w, hot_idx)), dev(gpu.compact_rows(down_w, hot_idx)),
                      act, gate=gate, up_bias=b, mask=dev(mask)).cpu()
    assert got.shape == (T, d)
    want = np.zeros((T, d))
    for t in range(T):
        rows = hot_idx[mask[t]].numpy()
        want[t] = ref_ffn(X[t:t + 1].numpy(), rows, up_w, down_w, act,
                          gate_w if variant == "gated" else None, bias if variant == "bias" else None)[0]
    assert_close(got.numpy(), want, 1e-5 if device == "cpu" else 2e-3)  # CUDA: TF32 matmuls possible


@pytest.mark.parametrize("device", DEVICES)
def test_hot_ffn_no_mask_and_empty(device):
    d = 8
    x = torch.randn(3, d, device=device)
    up, down = torch.randn(4, d, device=device), torch.randn(4, d, device=device)
    want = torch.relu(x @ up.T) @ down
    torch.testing.assert_close(gpu.hot_ffn(x, up, down, "relu"), want)
    empty = torch.zeros(0, d, device=device)
    assert torch.equal(gpu.hot_ffn(x, empty, empty, "silu", gate=empty), torch.zeros(3, d, device=device))
    h = torch.full((1, 4), float("inf"), device=device)  # masked-out neurons must not leak inf/nan
    up_inf = torch.zeros(4, d, device=device)
    got = gpu.hot_ffn(torch.zeros(1, d, device=device), up_inf, down, "relu", up_bias=h[0],
                      mask=torch.tensor([[False] * 4], device=device))
    assert torch.equal(got, torch.zeros(1, d, device=device))
    with pytest.raises(ValueError):
        gpu.hot_ffn(x, up, down, "swish")


@pytest.mark.parametrize("device", DEVICES)
def test_gpu_selection_helpers(device):
    n = 12
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    mask[[0, 3, 4, 9, 11]] = True
    rows = gpu.mask_to_rows(mask)
    assert rows.dtype == torch.int32 and rows.tolist() == [0, 3, 4, 9, 11]
    assert gpu.mask_to_rows(torch.zeros(5, dtype=torch.bool, device=device)).numel() == 0
    hot_idx = torch.tensor([9, 3, 7], device=device)
    cold_idx = torch.tensor([i for i in range(n) if i not in (9, 3, 7)], device=device)
    hot_map = gpu.index_map(hot_idx, n)
    assert hot_map.dtype == torch.int32 and hot_map.cpu().tolist() == [-1, -1, -1, 1, -1, -1, -1, 2, -1, 0, -1, -1]
    hot, cold = gpu.split_rows(rows, hot_map)
    assert hot.tolist() == [1, 0] and cold.tolist() == [0, 4, 11]
    hm, cm = gpu.split_mask(mask[None].expand(2, n), hot_idx, cold_idx)
    assert hm.shape == (2, 3) and hm[0].tolist() == [True, True, False]
    assert gpu.mask_to_rows(cm[0]).tolist() == [0, 3, 8]
    w = torch.arange(24.0, device=device).reshape(12, 2)
    assert gpu.compact_rows(w, torch.tensor([3, 1], dtype=torch.int32)).tolist() == [[6, 7], [2, 3]]


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_hybrid_split_equals_dense_masked_ffn(kind):
    """GPU hot part (hot_ffn) + CPU cold part (ffn_rows on the cold-compacted matrix) = whole masked FFN."""
    n, d = 80, 24
    up_w, down_w, gate_w = (weights(n, d, 50 + i) for i in range(3))
    if kind == "bf16":
        up_w, down_w, gate_w = (w.bfloat16().float() for w in (up_w, down_w, gate_w))
    hot_idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:30]
    cold_idx = torch.from_numpy(np.setdiff1d(np.arange(n), hot_idx.numpy()))
    mask = torch.rand(n, generator=torch.Generator().manual_seed(2)) > 0.5
    x = torch.randn(d, generator=torch.Generator().manual_seed(3))
    hot_mask, cold_mask = gpu.split_mask(mask, hot_idx, cold_idx)
    y_gpu = gpu.hot_ffn(x[None], gpu.compact_rows(up_w, hot_idx), gpu.compact_rows(down_w, hot_idx), "silu",
                        gate=gpu.compact_rows(gate_w, hot_idx), mask=hot_mask[None])[0]
    cold = [HostMatrix.from_torch(gpu.compact_rows(w, cold_idx), kind) for w in (up_w, down_w, gate_w)]
    y_cpu = cpu.ffn_rows(x.numpy(), gpu.mask_to_rows(cold_mask).numpy(), cold[0], cold[1], "silu", gate=cold[2])
    want = ref_ffn(x[None].numpy(), torch.nonzero(mask).flatten().numpy(), up_w, down_w, "silu", gate_w)[0]
    assert_close(y_gpu.numpy() + y_cpu, want, 1e-5)
