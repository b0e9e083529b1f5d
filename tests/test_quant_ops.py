"""hotcold.sparse_ops.quant against gguf.quants.dequantize + float64 numpy, for every GGUF type."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hotcold.sparse_ops import quant
from hotcold.sparse_ops.quant import QuantMatrix

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
K_TYPES = {"Q4_K", "Q5_K", "Q6_K"}
XQ_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]  # with Q8-activation kernels (all)
TIGHT = 2e-5  # float32 accumulation, relative to Σ|w·x| (or Σ|c·w|)
HOWS = ["empty", "one", "some", "unsorted", "full"]
TORCH_ACT = {"relu": torch.relu, "silu": F.silu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}


def shapes(qtype: str) -> list[tuple[int, int]]:
    """(rows, cols): cols a multiple of the block size, one and several blocks; rows not a multiple of 8."""
    return [(19, 256), (45, 768)] if qtype in K_TYPES else [(19, 32), (45, 160)]


def random_q(qtype: str, shape, seed: int, how: str = "bytes") -> QuantMatrix:
    """Random bytes with sane fp16 scales, or quantised random normal floats."""
    if how == "bytes":
        return quant.random_matrix(qtype, shape, seed=seed)
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[1])
    return QuantMatrix.quantize(w, qtype)


def selection(n: int, how: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.int32 if seed % 2 else np.int64
    if how == "empty":
        return np.zeros(0, dtype)
    if how == "one":
        return np.array([n - 1], dtype)
    if how == "full":
        return np.arange(n, dtype=dtype)
    if how == "unsorted":
        return rng.permutation(n)[: n // 2 + 3].astype(dtype)
    return np.sort(rng.choice(n, n // 3, replace=False)).astype(dtype)


def deq(m: QuantMatrix) -> np.ndarray:
    """Reference weights: gguf.quants.dequantize of the raw blocks, float64 [R, C]."""
    w = gguf.quants.dequantize(m.data, gguf.GGMLQuantizationType[m.qtype])
    return np.asarray(w, np.float64).reshape(m.shape)


def real_tensors(path, qtype: str, n: int = 6):
    """The first n 2-D tensors of qtype in a GGUF file (llama.cpp's quantiser): (QuantMatrix, gguf's
    dequantisation of it)."""
    reader = gguf.GGUFReader(path)
    tensors = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType[qtype] and len(t.shape) == 2]
    assert tensors
    for t in tensors[:n]:
        m = QuantMatrix.from_gguf(t)
        yield m, deq(m)


def assert_within(got, want, bound) -> None:
    """Elementwise |got - want| <= bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bound = np.broadcast_to(bound, err.shape)
    worst = int(np.argmax(err - bound)) if err.size else 0
    assert np.all(err <= bound), f"error {err.flat[worst]:.3g} > bound {bound.flat[worst]:.3g}"


# --------------------------------------------------------------------------------------------
# QuantMatrix

@pytest.mark.parametrize("qtype", TYPES)
def test_quantmatrix_properties_and_type_names(qtype):
    bs, ts = quant.QTYPES[qtype][1:]
    r, c = shapes(qtype)[1]
    m = random_q(qtype, (r, c), 0)
    assert (m.rows, m.cols, m.shape, m.qtype) == (r, c, (r, c), qtype)
    assert m.nbytes == r * c // bs * ts == m.data.nbytes and m.row_bytes() == c // bs * ts
    ggml = gguf.GGMLQuantizationType[qtype]
    assert gguf.GGML_QUANT_SIZES[ggml] == (bs, ts)
    for name in (ggml, int(ggml), qtype.lower()):
        assert QuantMatrix(m.data, name, (r, c)).qtype == qtype
    np.testing.assert_array_equal(m.dequantize([2, 0]), deq(m)[[2, 0]].astype(np.float32))


def test_quantmatrix_rejects_bad_input():
    data = np.zeros((4, 34), np.uint8)
    QuantMatrix(data, "Q8_0", (4, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantMatrix(np.zeros((4, 144), np.uint8), "Q4_K", (4, 128))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantMatrix(data, "Q8_0", (4, 48))
    with pytest.raises(ValueError, match="uint8 array of shape"):
        QuantMatrix(data, "Q8_0", (4, 64))  # bytes do not match the shape
    with pytest.raises(ValueError, match="uint8"):
        QuantMatrix(data.astype(np.int8), "Q8_0", (4, 32))
    with pytest.raises(ValueError, match="unsupported"):
        QuantMatrix(data, "Q2_K", (4, 32))
    with pytest.raises(ValueError, match="unsupported"):
        QuantMatrix(data, gguf.GGMLQuantizationType.F16, (4, 32))
    with pytest.raises(ValueError, match="C-contiguous"):
        QuantMatrix(np.zeros((4, 68), np.uint8)[:, ::2], "Q8_0", (4, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.random_matrix("Q6_K", (2, 96))


def test_memmap_and_gguf_reader_are_not_copied(tmp_path):
    m = random_q("Q4_K", (24, 512), 1)
    path = tmp_path / "w.bin"
    m.data.tofile(path)
    mm = np.memmap(path, np.uint8, "r", shape=m.data.shape)
    qm = QuantMatrix(mm, "Q4_K", m.shape)
    assert np.shares_memory(qm.data, mm)
    x = np.random.default_rng(2).standard_normal(512).astype(np.float32)
    np.testing.assert_array_equal(quant.qgemv(qm, x), quant.qgemv(m, x))

    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")  # through gguf's own reader, as the loader does
    w.add_tensor("blk.0.ffn_down.weight", m.data, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    qg = QuantMatrix.from_gguf(reader.tensors[0])
    assert qg.shape == (24, 512) and qg.qtype == "Q4_K"
    assert np.shares_memory(qg.data, reader.data)
    np.testing.assert_array_equal(quant.qgemv(qg, x), quant.qgemv(m, x))


# --------------------------------------------------------------------------------------------
# qgemv_rows / qgemv / qaxpy_rows

@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape_i", [0, 1])
@pytest.mark.parametrize("how", HOWS)
def test_qgemv_rows(qtype, shape_i, how):
    r, c = shapes(qtype)[shape_i]
    for src in ("bytes", "floats"):
        m = random_q(qtype, (r, c), 3 + shape_i, src)
        rows = selection(r, how, seed=shape_i)
        x = np.random.default_rng(4).standard_normal(c).astype(np.float32)
        got = quant.qgemv_rows(m, rows, x, xq=False)
        assert got.dtype == np.float32 and got.shape == rows.shape
        w = deq(m)[rows.astype(np.int64)]
        assert_within(got, w @ x, TIGHT * (np.abs(w) @ np.abs(x)))


@pytest.mark.parametrize("qtype", TYPES)
def test_qgemv_dense_and_out(qtype):
    r, c = shapes(qtype)[1]
    m = random_q(qtype, (r, c), 5)
    x = np.random.default_rng(6).standard_normal(c).astype(np.float32)
    out = np.full(r, 7.0, np.float32)
    assert quant.qgemv_rows(m, np.arange(r), x, out, xq=False) is out  # overwritten, not accumulated
    w = deq(m)
    assert_within(out, w @ x, TIGHT * (np.abs(w) @ np.abs(x)))
    np.testing.assert_allclose(quant.qgemv(m, x, xq=False), out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES)
def test_xq_default_policy(qtype):
    """xq=None means Q8 activations for the types in XQ_DEFAULT (Q4_0, Q4_1, Q4_K), float x for the others."""
    assert quant.formats.XQ_DEFAULT == {"Q4_0", "Q4_1", "Q4_K"}
    r, c = shapes(qtype)[1]
    m = random_q(qtype, (r, c), 5, "floats")
    x = np.random.default_rng(6).standard_normal(c).astype(np.float32)
    rows = selection(r, "unsorted")
    use = qtype in quant.formats.XQ_DEFAULT
    np.testing.assert_array_equal(quant.qgemv_rows(m, rows, x), quant.qgemv_rows(m, rows, x, xq=use))
    np.testing.assert_array_equal(quant.qgemv(m, x), quant.qgemv(m, x, xq=use))
    g = random_q(qtype, (r, c), 7, "floats")
    np.testing.assert_array_equal(quant.qffn_rows(x, rows, m, g, "silu", gate=g),
                                  quant.qffn_rows(x, rows, m, g, "silu", gate=g, xq=use))
    if qtype in XQ_TYPES:  # the two paths really differ
        assert not np.array_equal(quant.qgemv(m, x, xq=True), quant.qgemv(m, x, xq=False))


@pytest.mark.parametrize("qtype", XQ_TYPES)
@pytest.mark.parametrize("how", ["one", "some", "unsorted", "full"])
def test_qgemv_rows_q8_activations(qtype, how):
    r, c = 45, 512 if qtype in K_TYPES else 160
    m = random_q(qtype, (r, c), 7, "floats")
    rows = selection(r, how, seed=1)
    x = np.random.default_rng(8).standard_normal(c).astype(np.float32)
    got = quant.qgemv_rows(m, rows, x, xq=True)
    w = deq(m)[rows.astype(np.int64)]
    # x is rounded to int8 per 32-block: |x - x̂| <= amax(block) / 254 per element
    dx = np.repeat(np.abs(x).reshape(-1, 32).max(axis=1) / 254, 32)
    bound = np.abs(w) @ dx * (1 + 1e-3) + TIGHT * (np.abs(w) @ np.abs(x))
    assert_within(got, w @ x, bound)
    assert np.abs(got - w @ x).max() > 0  # really the quantised-x path, not the float one


def xhat(x: np.ndarray) -> np.ndarray:
    """x as the Q8-activation kernels see it: rounded to int8 per 32-block (`_quantize_x`), float64."""
    xq, xd = quant.activations._quantize_x(x)
    return (xq.reshape(-1, 32).astype(np.float64) * xd[0::2, None]).ravel()


def q4_1_min_term(m: QuantMatrix, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Σ over the blocks of a Q4_1 row of its min m times the block's sum of x, for the selected rows."""
    mins = m.data.reshape(m.rows, -1, 20)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return mins[rows.astype(np.int64)] @ x.reshape(-1, 32).sum(axis=1)


@pytest.mark.parametrize("src", ["bytes", "floats"])
@pytest.mark.parametrize("how", HOWS)
def test_q4_1_q8_activations(src, how):
    """Q4_1 with Q8 activations (per block d dx Σ q xq + m dx Σ xq) against gguf's decoded weights times
    x as rounded to int8, to float32 rounding: qgemv_rows, and qffn_rows with Q4_1 gate / up / down_t
    (whose down projection is qaxpy_rows over Q4_1 rows, also checked alone). The min term alone is
    beyond the bound, so a kernel that dropped it fails."""
    for shape_i, (r, c) in enumerate(shapes("Q4_1")):
        up, gate, down_t = (random_q("Q4_1", (r, c), 40 + 3 * shape_i + k, src) for k in range(3))
        rows = selection(r, how, seed=shape_i)
        x = np.random.default_rng(41).standard_normal(c).astype(np.float32)
        xh = xhat(x)
        U = deq(up)
        w = U[rows.astype(np.int64)]
        got = quant.qgemv_rows(up, rows, x, xq=True)
        assert got.dtype == np.float32 and got.shape == rows.shape
        bound = TIGHT * (np.abs(w) @ np.abs(x))
        assert_within(got, w @ xh, bound)
        assert rows.size == 0 or np.any(np.abs(q4_1_min_term(up, rows, xh)) > bound)
        np.testing.assert_array_equal(quant.qgemv_rows(up, rows, x), got)  # the default for Q4_1
        coeff = np.random.default_rng(42).standard_normal(rows.size).astype(np.float32)
        D = deq(down_t)
        wd = D[rows.astype(np.int64)]
        out = quant.qaxpy_rows(down_t, rows, coeff, np.zeros(c, np.float32))
        assert_within(out, coeff @ wd, TIGHT * (np.abs(coeff) @ np.abs(wd)))
        for act, g in (("silu", gate), ("relu", None)):
            want = ref_ffn(xh, rows, U, D, act, None if g is None else deq(g))
            got = quant.qffn_rows(x, rows, up, down_t, act, gate=g, xq=True)
            assert_within(got, want, 10 * TIGHT * max(np.abs(want).max(), 1e-3))
            if how == "empty":
                assert not got.any()


def test_real_gguf_q4_1_tensors_q8_activations(smollm2_path):
    """SmolLM2-135M's Q4_1 tensors (llama.cpp's quantiser, real mins): GEMV with Q8 activations against
    gguf's decoder times the rounded x."""
    rng = np.random.default_rng(32)
    for m, want in real_tensors(smollm2_path, "Q4_1"):
        x = rng.standard_normal(m.cols).astype(np.float32)
        rows = selection(m.rows, "unsorted", seed=7)
        w = want[rows.astype(np.int64)]
        assert_within(quant.qgemv_rows(m, rows, x, xq=True), w @ xhat(x), TIGHT * (np.abs(w) @ np.abs(x)))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape_i", [0, 1])
@pytest.mark.parametrize("how", HOWS)
def test_qaxpy_rows(qtype, shape_i, how):
    r, c = shapes(qtype)[shape_i]
    m = random_q(qtype, (r, c), 9 + shape_i, "bytes" if shape_i else "floats")
    rows = selection(r, how, seed=2 + shape_i)
    rng = np.random.default_rng(10)
    coeff = rng.standard_normal(rows.size).astype(np.float32)
    coeff[::5] = 0.0  # rows with a zero coefficient may be skipped
    out0 = rng.standard_normal(c).astype(np.float32)
    out = out0.copy()
    assert quant.qaxpy_rows(m, rows, coeff, out) is out
    w = deq(m)[rows.astype(np.int64)]
    slack = 1e-6 * np.abs(out0)  # rounding of out0 + delta in float32
    assert_within(out - out0, coeff @ w, TIGHT * (np.abs(coeff) @ np.abs(w)) + slack)
    if how == "empty":
        assert np.array_equal(out, out0)


_PORTABLE_CHILD = """
import sys
import numpy as np
from hotcold.sparse_ops import quant
assert not quant.vector._VNNI
res = {}
rng = np.random.default_rng(0)
for qt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"):
    c = 512 if qt.endswith("K") else 160
    m = quant.random_matrix(qt, (45, c), seed=3)
    rows = np.array([44, 0, 7, 8, 9, 30, 31], np.int64)
    x = rng.standard_normal(c).astype(np.float32)
    res[qt + "_x"] = x
    res[qt + "_gemv"] = quant.qgemv_rows(m, rows, x, xq=False)
    res[qt + "_gemv_xq"] = quant.qgemv_rows(m, rows, x, xq=True)
    coeff = np.linspace(-1, 1, 7).astype(np.float32)
    res[qt + "_axpy"] = quant.qaxpy_rows(m, rows, coeff, np.zeros(c, np.float32))
for qt in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):  # the interleaved layout's GEMV
    m = quant.random_matrix(qt, (48, 512), seed=3)
    res[qt + "_x8x"] = x = rng.standard_normal(512).astype(np.float32)
    res[qt + "_x8"] = quant.qgemv(quant.pack_rows(m, xq=True), x)
np.savez(sys.argv[1], **res)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 CPU name")
def test_portable_ir_kernels(tmp_path):
    """The IR kernels (every type) without the AVX-512 VNNI intrinsics and with 4 rows
    side by side (numba compiling for a generic AVX2 CPU, in a subprocess with a cache of its own) give
    the same results as gguf's decoder and, with Q8 activations, as the kernels of this process."""
    env = dict(os.environ, NUMBA_CPU_NAME="x86-64-v3", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = tmp_path / "res.npz"
    subprocess.run([sys.executable, "-c", _PORTABLE_CHILD, str(out)], env=env, check=True, timeout=900)
    res = np.load(out)
    rows = np.array([44, 0, 7, 8, 9, 30, 31], np.int64)
    coeff = np.linspace(-1, 1, 7).astype(np.float32)
    for qt in TYPES:
        m = quant.random_matrix(qt, (45, 512 if qt in K_TYPES else 160), seed=3)
        w, x = deq(m)[rows], res[qt + "_x"]
        assert_within(res[qt + "_gemv"], w @ x, TIGHT * (np.abs(w) @ np.abs(x)))
        if qt in XQ_TYPES:
            assert_within(res[qt + "_gemv_xq"], quant.qgemv_rows(m, rows, x, xq=True),
                          TIGHT * (np.abs(w) @ np.abs(x)))
        assert_within(res[qt + "_axpy"], coeff @ w, TIGHT * (np.abs(coeff) @ np.abs(w)))
    for qt in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):
        m = quant.random_matrix(qt, (48, 512), seed=3)
        w, x = deq(m), res[qt + "_x8x"]
        assert_within(res[qt + "_x8"], quant.qgemv(m, x, xq=True), TIGHT * (np.abs(w) @ np.abs(x)))


def test_bad_arguments_raise():
    m = random_q("Q4_0", (8, 64), 0)
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="float32"):
        quant.qgemv_rows(m, [0], x.astype(np.float64))
    with pytest.raises(ValueError, match="shape"):
        quant.qgemv_rows(m, [0], np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="out"):
        quant.qgemv_rows(m, [0, 1], x, out=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="rows must be 1-D"):
        quant.qgemv_rows(m, np.zeros((1, 1), np.int64), x)
    with pytest.raises(ValueError, match="QuantMatrix"):
        quant.qgemv(np.zeros((8, 64), np.float32), x)
    for bad in ([8], [-1], [0, 3, 9]):
        with pytest.raises(IndexError):
            quant.qgemv_rows(m, np.array(bad), x)
        with pytest.raises(IndexError):
            quant.qaxpy_rows(m, np.array(bad), np.ones(len(bad), np.float32), np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="coeff"):
        quant.qaxpy_rows(m, [0, 1], np.ones(3, np.float32), np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="out"):
        quant.qaxpy_rows(m, [0], np.ones(1, np.float32), np.zeros(64, np.float64))
    with pytest.raises(ValueError, match="act"):
        quant.qffn_rows(x, [0], m, m, "tanh")
    with pytest.raises(ValueError, match="down_t"):
        quant.qffn_rows(x, [0], m, random_q("Q4_0", (8, 96), 0), "relu")
    with pytest.raises(ValueError, match="gate"):
        quant.qffn_rows(x, [0], m, m, "silu", gate=random_q("Q8_0", (8, 64), 0))


# --------------------------------------------------------------------------------------------
# fused FFN

def ref_ffn(x, rows, up, down_t, act, gate=None) -> np.ndarray:
    """Float64 reference on the selected rows of dequantised [I, D] weights."""
    sel = rows.astype(np.int64)
    xt = torch.from_numpy(x.astype(np.float64))
    u = torch.from_numpy(up[sel]) @ xt
    h = TORCH_ACT[act](torch.from_numpy(gate[sel]) @ xt) * u if gate is not None else TORCH_ACT[act](u)
    return (h @ torch.from_numpy(down_t[sel])).numpy()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("act,gated", [("relu", False), ("silu", True), ("gelu_tanh", True)])
@pytest.mark.parametrize("how", ["empty", "one", "some", "unsorted", "full"])
def test_qffn_rows(qtype, act, gated, how):
    n, d = 45, 256 if qtype in K_TYPES else 96
    up, down_t = random_q(qtype, (n, d), 11, "floats"), random_q(qtype, (n, d), 12, "floats")
    gate = random_q(qtype, (n, d), 13, "floats") if gated else None
    rows = selection(n, how, seed=3)
    x = np.random.default_rng(14).standard_normal(d).astype(np.float32)
    out0 = np.random.default_rng(15).standard_normal(d).astype(np.float32)
    out = out0.copy()
    assert quant.qffn_rows(x, rows, up, down_t, act, gate=gate, out=out, xq=False) is out
    U, D, G = deq(up), deq(down_t), deq(gate) if gated else None
    want = ref_ffn(x, rows, U, D, act, G)
    scale = max(np.abs(want).max(), np.abs(out0).max(), 1e-3)
    assert_within(out - out0, want, 10 * TIGHT * scale)
    if how == "empty":
        assert np.array_equal(out, out0)
    got = quant.qffn_rows(x, rows, up, down_t, act, gate=gate, xq=False)  # out None: zeros
    assert_within(got, want, 10 * TIGHT * max(np.abs(want).max(), 1e-3))
    if qtype in XQ_TYPES:  # Q8 activations: x's rounding (~1% of |h|) on top
        got = quant.qffn_rows(x, rows, up, down_t, act, gate=gate, xq=True)
        assert_within(got, want, 0.03 * max(np.abs(want).max(), 1e-3))


@pytest.mark.parametrize("qtype,down_type", [("Q4_K", "Q8_0"), ("Q4_0", "Q8_0"), ("Q6_K", "Q4_K"),
                                             ("Q5_0", "Q8_0"), ("Q8_0", "Q5_1"), ("Q5_1", "Q5_0"),
                                             ("Q4_1", "Q8_0")])
def test_qffn_rows_down_of_another_type(qtype, down_type):
    n, d = 40, 256
    up, gate = random_q(qtype, (n, d), 16, "floats"), random_q(qtype, (n, d), 17, "floats")
    down_t = random_q(down_type, (n, d), 18, "floats")
    rows = selection(n, "unsorted", seed=4)
    x = np.random.default_rng(19).standard_normal(d).astype(np.float32)
    got = quant.qffn_rows(x, rows, up, down_t, "silu", gate=gate, xq=False)
    want = ref_ffn(x, rows, deq(up), deq(down_t), "silu", deq(gate))
    assert_within(got, want, 10 * TIGHT * np.abs(want).max())
    x_q = quant.qffn_rows(x, rows, up, down_t, "silu", gate=gate, xq=True)  # Q8 x only for XQ_TYPES
    assert_within(x_q, want, (0.02 if qtype in XQ_TYPES else 10 * TIGHT) * np.abs(want).max())


# --------------------------------------------------------------------------------------------
# Whole experts (MoE): gate / up rows and W_down in their own blocks, untransposed

EXPERT_TYPES = [("Q4_0", "Q4_0"), ("Q4_K", "Q6_K"), ("Q4_1", "Q8_0"), ("Q5_0", "Q5_1"), ("Q8_0", "Q4_K"),
                ("Q5_K", "Q4_1")]  # (gate / up, down): a Q4_K_M file's experts are Q4_K / Q6_K


def expert_stacks(gtype: str, dtype: str, n: int = 5, i: int = 256, d: int = 256, seed: int = 30):
    """n experts: gate, up [n*I, D] of gtype, down [n*D, I] of dtype (each expert's W_down as GGUF
    stores it)."""
    return (random_q(gtype, (n * i, d), seed, "floats"), random_q(gtype, (n * i, d), seed + 1, "floats"),
            random_q(dtype, (n * d, i), seed + 2, "floats"))


def ref_experts(X, experts, coef, gate, up, down, act) -> np.ndarray:
    """Float64 reference: X [T, D] -> sum_k coef[.., k] * down_e act(gate_e x) (up_e x), e = experts[k]."""
    G, U, W = deq(gate), deq(up), deq(down)
    d = gate.cols
    i = gate.rows // (down.rows // d)
    X = torch.from_numpy(np.atleast_2d(X).astype(np.float64))
    coef = np.broadcast_to(np.asarray(coef, np.float64), (X.shape[0], len(experts)))
    out = torch.zeros(X.shape, dtype=torch.float64)
    for k, e in enumerate(experts):
        h = TORCH_ACT[act](X @ torch.from_numpy(G[e * i:(e + 1) * i]).T) * (X @ torch.from_numpy(U[e * i:(e + 1) * i]).T)
        out += torch.from_numpy(coef[:, k:k + 1].copy()) * (h @ torch.from_numpy(W[e * d:(e + 1) * d]).T)
    return out.numpy()


@pytest.mark.parametrize("gtype,dtype", EXPERT_TYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_qexperts_one_token(gtype, dtype, packed):
    """One token through several whole experts equals gguf's weights within the Q8 activations'
    rounding, and the same products composed from qgemv (same rounding) tightly; the row-interleaved
    layout gives the same result; out accumulates."""
    plain = expert_stacks(gtype, dtype)
    gate, up, down = (quant.pack_rows(m) for m in plain) if packed else plain
    assert gate.interleaved == (packed and gtype in quant.PACK_DEFAULT and gtype in quant.formats.XQ_DEFAULT)
    rng = np.random.default_rng(31)
    x = rng.standard_normal(gate.cols).astype(np.float32)
    experts, coef = np.array([3, 0, 4]), np.array([0.5, 0.3, 0.2], np.float32)
    out0 = rng.standard_normal(gate.cols).astype(np.float32)
    out = out0.copy()
    assert quant.qexperts(x, experts, coef, gate, up, down, "silu", out=out) is out
    want = ref_experts(x, experts, coef, *plain, "silu")[0]
    xq = gtype in quant.formats.XQ_DEFAULT or dtype in quant.formats.XQ_DEFAULT
    assert_within(out - out0, want, (0.03 if xq else 1e-4) * np.abs(want).max())
    # the same rounding, composed: each matrix of each expert through qgemv (its default activations)
    composed = np.zeros_like(x)
    d, i = gate.cols, gate.rows // 5
    for e, c in zip(experts, coef):
        z, u = (quant.qgemv(quant.QuantMatrix(m.row_data(np.arange(e * i, (e + 1) * i)), m.qtype, (i, d)), x,
                            xq=m.interleaved or None) for m in (gate, up))
        h = (z / (1 + np.exp(-z)) * u * c).astype(np.float32)
        w_e = quant.QuantMatrix(down.row_data(np.arange(e * d, (e + 1) * d)), down.qtype, (d, i))
        composed += quant.qgemv(w_e, h, xq=down.interleaved or None)
    assert_within(out - out0, composed, 1e-4 * np.abs(composed).max())
    empty = out0.copy()
    quant.qexperts(x, np.zeros(0, np.int64), np.zeros(0, np.float32), gate, up, down, "silu", out=empty)
    assert np.array_equal(empty, out0)


@pytest.mark.parametrize("gtype,dtype,packed", [("Q4_0", "Q4_0", True), ("Q4_K", "Q6_K", True), ("Q5_0", "Q5_1", False)])
def test_qexperts_routed(gtype, dtype, packed):
    """The decode step's call (selection and kernel in one) equals `qexperts` over the routed experts
    held here, in routing order; experts elsewhere (-1) are skipped; out is overwritten; none held
    leaves out zero."""
    plain = expert_stacks(gtype, dtype)
    gate, up, down = (quant.pack_rows(m) for m in plain) if packed else plain
    x = np.random.default_rng(33).standard_normal(gate.cols).astype(np.float32)
    pos = np.array([-1, 4, -1, 0, 2, -1, 1, 3], np.int64)  # 8 experts, 5 of them here
    ids, w = np.array([6, 0, 4, 1, 3], np.int64), np.array([0.3, 0.25, 0.2, 0.15, 0.1], np.float32)
    want = np.zeros(gate.cols, np.float32)  # ids 6, 4, 1, 3 are here, at positions 1, 2, 4, 0
    quant.qexperts(x, np.array([1, 2, 4, 0]), np.array([0.3, 0.2, 0.15, 0.1], np.float32), gate, up, down, "silu",
                   out=want)
    out = np.full(gate.cols, 7.0, np.float32)
    assert quant.qexperts_routed(x, ids, w, pos, gate, up, down, "silu", out) == 4
    assert np.array_equal(out, want)
    assert quant.qexperts_routed(x, np.array([0, 2], np.int64), w[:2], pos, gate, up, down, "silu", out) == 0
    assert not out.any()


@pytest.mark.parametrize("gtype,dtype", EXPERT_TYPES)
@pytest.mark.parametrize("packed", [False, True])
def test_qexperts_tokens(gtype, dtype, packed):
    """Several tokens through their routed experts in one call equal one `qexperts` call per token
    (experts in ascending order) up to the rounding of the final sum, and the float64 reference within
    the Q8 activations' rounding; -1 skips an expert; a token with none is left as it was; out accumulates."""
    plain = expert_stacks(gtype, dtype, n=6)
    gate, up, down = (quant.pack_rows(m) for m in plain) if packed else plain
    rng = np.random.default_rng(32)
    T = 7
    X = rng.standard_normal((T, gate.cols)).astype(np.float32)
    experts = np.array([rng.permutation(6)[:3] for _ in range(T)])
    experts[2, 1] = -1
    experts[5] = -1
    coef = rng.random(experts.shape).astype(np.float32)
    out0 = rng.standard_normal(X.shape).astype(np.float32)
    out = out0.copy()
    assert quant.qexperts_tokens(X, experts, coef, gate, up, down, "silu", out=out) is out
    assert np.array_equal(out[5], out0[5])
    xq = gtype in quant.formats.XQ_DEFAULT or dtype in quant.formats.XQ_DEFAULT
    for t in range(T):
        k = np.argsort(experts[t])
        k = k[experts[t][k] >= 0]
        one = np.zeros(gate.cols, np.float32)
        if len(k):
            quant.qexperts(X[t], experts[t][k], coef[t][k], gate, up, down, "silu", out=one)
        assert_within(out[t] - out0[t], one, 1e-6 * max(np.abs(one).max(), 1e-30))
        want = ref_experts(X[t], experts[t][k], coef[t][k], *plain, "silu")[0] if len(k) else one
        assert_within(out[t] - out0[t], want, (0.03 if xq else 1e-4) * max(np.abs(want).max(), 1e-30))


def test_qexperts_tokens_bad_arguments():
    gate, up, down = expert_stacks("Q4_0", "Q4_0", n=3, i=64, d=64)
    X = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="distinct"):
        quant.qexperts_tokens(X, np.array([[1, 1], [0, 2]]), np.ones((2, 2), np.float32), gate, up, down, "silu")
    with pytest.raises(IndexError):
        quant.qexperts_tokens(X, np.array([[0, 3], [0, 2]]), np.ones((2, 2), np.float32), gate, up, down, "silu")
    with pytest.raises(ValueError, match=r"\[2, k\]"):
        quant.qexperts_tokens(X, np.array([0, 1]), np.ones(2, np.float32), gate, up, down, "silu")
    with pytest.raises(ValueError, match="X must be"):
        quant.qexperts_tokens(X[:, :32], np.zeros((2, 1), np.int64), np.ones((2, 1), np.float32), gate, up, down, "silu")
    ok = quant.qexperts_tokens(X, np.array([[-1, -1], [0, -1]]), np.ones((2, 2), np.float32), gate, up, down, "silu")
    assert ok.shape == (2, 64)


@pytest.mark.parametrize("gtype,dtype", EXPERT_TYPES[:3])
def test_qexpert_batch(gtype, dtype, monkeypatch):
    """Several tokens through one expert, its blocks decoded once (float32 GEMMs here), equal the
    float64 reference; the routing weights scale each token; interleaved stacks decode the same."""
    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    gate, up, down = expert_stacks(gtype, dtype, seed=40)
    X = np.random.default_rng(41).standard_normal((6, gate.cols)).astype(np.float32)
    coef = np.linspace(0.1, 1, 6).astype(np.float32)
    for g, u, w in ((gate, up, down), tuple(quant.pack_rows(m) for m in (gate, up, down))):
        got = quant.qexpert_batch(X, 2, g, u, w, "gelu_tanh", coef)
        want = ref_experts(X, [2], coef[:, None], gate, up, down, "gelu_tanh")
        assert_within(got, want, 1e-4 * np.abs(want).max())
        plain = quant.qexpert_batch(X, 4, g, u, w, "relu")
        assert_within(plain, ref_experts(X, [4], 1.0, gate, up, down, "relu"), 1e-4 * np.abs(plain).max())


def test_qexperts_bad_arguments():
    gate, up, down = expert_stacks("Q4_0", "Q4_0", n=3, i=64, d=64)
    x, one = np.zeros(64, np.float32), np.ones(1, np.float32)
    with pytest.raises(ValueError, match="distinct"):
        quant.qexperts(x, np.array([1, 1]), np.ones(2, np.float32), gate, up, down, "silu")
    with pytest.raises(IndexError):
        quant.qexperts(x, np.array([3]), one, gate, up, down, "silu")
    with pytest.raises(ValueError, match="experts"):
        quant.qexperts(x, np.array([0]), one, gate, up, random_q("Q4_0", (3 * 64, 96), 1), "silu")
    with pytest.raises(ValueError, match="gate and up"):
        quant.qexperts(x, np.array([0]), one, gate, random_q("Q8_0", (3 * 64, 64), 1), down, "silu")
    with pytest.raises(ValueError, match="act"):
        quant.qexperts(x, np.array([0]), one, gate, up, down, "tanh")
    with pytest.raises(IndexError):
        quant.qexpert_batch(np.zeros((2, 64), np.float32), 3, gate, up, down, "silu")


# --------------------------------------------------------------------------------------------
# quantising and the transposed W_down

# RMS error of our quantisers relative to the RMS of the weights; measured on Gaussian 256 x 4096:
# Q8_0 0.0053, Q4_0 0.086, Q4_1 0.078, Q5_0 0.043, Q5_1 0.038, Q4_K 0.078, Q5_K 0.038, Q6_K 0.019.
# Bounds with ~30% margin.
RMS_BOUND = {"Q8_0": 0.008, "Q4_0": 0.11, "Q4_1": 0.105, "Q5_0": 0.056, "Q5_1": 0.05, "Q4_K": 0.105,
             "Q5_K": 0.05, "Q6_K": 0.026}


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_rows_round_trip(qtype):
    rng = np.random.default_rng(20)
    w = rng.standard_normal((16, 512)).astype(np.float32) * rng.uniform(0.1, 3, (16, 1)).astype(np.float32)
    w[3] = 0.0  # an all-zero row: no division by zero, decodes to zeros
    w[5, :256] += 2.0  # a block far from zero: the min / offset path
    m = QuantMatrix.quantize(w, qtype)
    assert m.qtype == qtype and m.shape == w.shape and m.data.dtype == np.uint8
    back = deq(m)  # decoded by gguf, so the block format must be right
    assert not back[3].any()
    rel = np.sqrt(((back - w) ** 2).mean(axis=1)) / np.sqrt((w ** 2).mean(axis=1).clip(1e-12))
    rel[3] = 0.0
    assert rel.max() <= RMS_BOUND[qtype], f"relative RMS error {rel.max():.4f}"
    # elementwise: never worse than 1.5 steps of the coarsest grid of the row
    levels = {"Q8_0": 254, "Q4_0": 15, "Q4_1": 15, "Q5_0": 31, "Q5_1": 31, "Q4_K": 15, "Q5_K": 31,
              "Q6_K": 62}[qtype]
    span = np.abs(w).max(axis=1, keepdims=True) * 2 + 2.0 * (np.arange(16) == 5)[:, None]
    assert np.all(np.abs(back - w) <= 1.5 * span / levels + 1e-6)


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_rows_matches_gguf_reference_where_it_exists(qtype):
    if qtype in K_TYPES:
        with pytest.raises(NotImplementedError):
            gguf.quants.quantize(np.zeros((1, 256), np.float32), gguf.GGMLQuantizationType[qtype])
        return
    w = np.random.default_rng(21).standard_normal((4, 64)).astype(np.float32)
    ref = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(quant.quantize_rows(w, qtype), ref)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_numba_quantisers_give_gguf_bytes(qtype):
    """quantize_rows' numba Q8_0 / Q4_0 kernels against gguf.quants' numpy quantiser, byte for byte,
    on blocks with the cases where an order of float operations or a tie rule would show: all zeros, a
    single spike, the largest magnitude twice with both signs, values exactly on rounding boundaries
    (x / d + 8.5 and |x / d| + 0.5 integers), fp16-rounded weights, tiny and huge scales."""
    rng = np.random.default_rng(23)
    w = rng.standard_normal((48, 1024)).astype(np.float32) * rng.uniform(0.01, 3, (48, 1)).astype(np.float32)
    w[0, :64] = 0.0
    w[1, :32] = 0.0
    w[1, 7] = -3.0
    w[2, :32] = 1.0
    w[2, 3] = -1.0  # the first largest magnitude decides Q4_0's sign
    w[3, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves; Q8_0's d = 127 / 127 below
    w[3, 0] = 127.0
    w[4, :32] = np.arange(32, dtype=np.float32) / 2 - 8.0  # Q4_0's d = 1: x + 8.5 on .0 and .5
    w[4, 0] = -8.0
    w[5] *= np.float32(1e-30)
    w[6] *= np.float32(1e4)
    w[7:24] = w[7:24].astype(np.float16).astype(np.float32)
    ref = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(quant.quantize_rows(w, qtype), ref)
    ts = quant.QTYPES[qtype][2]  # a strided view of columns 64..319: blocks 2..9 of each row
    np.testing.assert_array_equal(quant.quantize_rows(w[:, 64:320], qtype), ref[:, 2 * ts:10 * ts])


@pytest.mark.parametrize("qtype", sorted(K_TYPES))
def test_k_quantiser_bytes_do_not_depend_on_chunks(qtype, monkeypatch):
    """The K quantisers run over chunks of blocks in threads: the bytes are those of one call."""
    from hotcold.sparse_ops.quant import quantise

    w = np.random.default_rng(24).standard_normal((40, 1024)).astype(np.float32)
    whole = quantise._K_QUANTISERS[qtype](w.reshape(-1, 256)).reshape(40, -1)
    monkeypatch.setattr(quantise, "_K_CHUNK", 7)  # 160 blocks: 23 chunks, the last one short
    np.testing.assert_array_equal(quant.quantize_rows(w, qtype), whole)


# Extra RMS error of transposing (dequantise + requantise), relative to the RMS of the weights.
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kind", ["same", "Q8_0"])
def test_transpose_quantized(qtype, kind):
    d, i = 256, 512 + (256 if qtype in K_TYPES else 32)  # W_down [D, I]; I not a multiple of the strip
    w = np.random.default_rng(22).standard_normal((d, i)).astype(np.float32) * 0.05
    m = QuantMatrix.quantize(w, qtype)
    t = quant.transpose_quantized(m, kind, strip=256)
    want_type = qtype if kind == "same" else "Q8_0"
    assert t.qtype == want_type and t.shape == (i, d)
    a, b = deq(m).T, deq(t)
    extra = np.sqrt(((b - a) ** 2).mean()) / np.sqrt((a ** 2).mean())
    bound = RMS_BOUND[want_type]
    assert extra <= bound, f"requantising added {extra:.4f} relative RMS error"
    back = quant.transpose_quantized(t, qtype if kind == "same" else "Q8_0", strip=512)  # one strip
    assert back.shape == (d, i) and back.qtype == want_type
    assert np.sqrt(((deq(back) - deq(m)) ** 2).mean()) / np.sqrt((a ** 2).mean()) <= 1.5 * bound


def test_transpose_quantized_default_and_errors():
    m = QuantMatrix.quantize(np.random.default_rng(23).standard_normal((64, 256)).astype(np.float32), "Q4_K")
    t = quant.transpose_quantized(m)
    assert t.qtype == quant.DOWN_T_DEFAULT and t.shape == (256, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.transpose_quantized(m, "same")  # its rows would have 64 elements
    with pytest.raises(ValueError, match="strip"):
        quant.transpose_quantized(m, "Q8_0", strip=100)


# --------------------------------------------------------------------------------------------
# a real GGUF: the embedded Gemma 3 270M Q4_K_M stores attention q/k/v and FFN gate/up as Q5_0

def test_real_gguf_q5_0_tensors_decode_as_gguf_does(gemma3_path):
    reader = gguf.GGUFReader(gemma3_path)
    tensors = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q5_0 and len(t.shape) == 2]
    names = {t.name.split(".", 2)[-1] for t in tensors}
    assert {"ffn_gate.weight", "ffn_up.weight", "attn_q.weight"} <= names, names
    for t in tensors[:12]:
        m = QuantMatrix.from_gguf(t)
        assert m.qtype == "Q5_0" and np.shares_memory(m.data, reader.data)
        np.testing.assert_array_equal(quant.qdequantize(m), deq(m).astype(np.float32))


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K"])
def test_real_gguf_tensors(gemma3_path, qtype):
    """Gemma 3 270M's Q5_0 / Q4_K / Q6_K tensors (llama.cpp's quantiser): GEMV with float x and with Q8
    activations, and axpy (an odd number of rows), against gguf's decoder."""
    rng = np.random.default_rng(31)
    for m, want in real_tensors(gemma3_path, qtype):
        x = rng.standard_normal(m.cols).astype(np.float32)
        assert_within(quant.qgemv(m, x, xq=False), want @ x, TIGHT * (np.abs(want) @ np.abs(x)))
        # with Q8 activations: w · x̂, x̂ the dequantised xq
        assert_within(quant.qgemv(m, x, xq=True), want @ xhat(x), TIGHT * (np.abs(want) @ np.abs(x)))
        rows = selection(m.rows, "unsorted", seed=6)
        assert rows.size % 2
        coeff = rng.standard_normal(rows.size).astype(np.float32)
        out = quant.qaxpy_rows(m, rows, coeff, np.zeros(m.cols, np.float32))
        w = want[rows.astype(np.int64)]
        assert_within(out, coeff @ w, TIGHT * (np.abs(coeff) @ np.abs(w)) + 1e-7)


# --------------------------------------------------------------------------------------------
# Row-interleaved Q4_0 (pack_rows)

X8_CASES = [("Q4_0", (8, 32)), ("Q4_0", (48, 160)), ("Q4_0", (1032, 4096)),
            ("Q4_K", (8, 256)), ("Q4_K", (48, 768)), ("Q4_K", (1032, 4096)),
            ("Q8_0", (8, 32)), ("Q8_0", (48, 352)), ("Q8_0", (1032, 4096)),
            ("Q4_1", (8, 32)), ("Q4_1", (48, 576)), ("Q4_1", (1032, 4096))]


@pytest.mark.parametrize("qtype,shape", X8_CASES)
def test_interleaved_matrix_holds_the_same_rows(qtype, shape):
    """pack_rows moves bytes only: every row comes back in the GGUF layout; dequantising (float32
    and bfloat16, as prefill does) equals the original's; gguf decodes what row_data gives."""
    m = random_q(qtype, shape, 1)
    p = quant.pack_rows(m, xq=True)  # Q8_0: only when asked (it is not in XQ_DEFAULT)
    assert p.interleaved and p.shape == m.shape and p.nbytes == m.nbytes and p.row_bytes() == m.row_bytes()
    assert p.data.shape == (shape[0] // 8, 8 * m.data.shape[1])
    assert np.array_equal(p.row_data(), m.data)
    rows = selection(shape[0], "unsorted", 3)
    assert np.array_equal(p.row_data(rows), m.data[rows])
    np.testing.assert_array_equal(p.dequantize(rows), deq(m)[rows].astype(np.float32))
    np.testing.assert_array_equal(quant.qdequantize(p, rows), quant.qdequantize(m, rows))
    np.testing.assert_array_equal(quant.qdequantize(p, bf16=True), quant.qdequantize(m, bf16=True))
    whole = np.arange(8, shape[0], dtype=np.int64)  # whole groups: decoded in place, as prefill's chunks
    np.testing.assert_array_equal(quant.qdequantize(p, whole), quant.qdequantize(m, whole))
    assert quant.pack_rows(p) is p


@pytest.mark.parametrize("qtype,shape", X8_CASES)
@pytest.mark.parametrize("how", ["bytes", "normal"])
def test_interleaved_gemv(qtype, shape, how):
    """One-token GEMV over all rows of the interleaved layout = the row kernel with Q8 activations
    (same integer products, summed in another order) and gguf's weights times x within Q8's error."""
    m = random_q(qtype, shape, 2, how)
    p = quant.pack_rows(m, xq=True)
    x = np.random.default_rng(5).standard_normal(shape[1]).astype(np.float32)
    x[::7] *= 30  # outlier channels
    w = deq(m)
    got = quant.qgemv(p, x)
    assert_within(got, quant.qgemv(m, x, xq=True), TIGHT * (np.abs(w) @ np.abs(x)))
    assert_within(got, w @ x, 0.02 * (np.abs(w) @ np.abs(x)))  # Q8 activations: ~1/254 per weight
    out = np.full(shape[0], np.nan, np.float32)
    assert quant.qgemv(p, x, out) is out and np.array_equal(out, got)


def test_interleaving_applies_only_where_it_is_defined(monkeypatch):
    """Other types, row counts that are not a multiple of 8, and Q4_0 without Q8 activations (the
    exact-comparison setting) are left as they are; row selections refuse an interleaved matrix."""
    assert quant.pack_rows(random_q("Q5_1", (16, 64), 0), xq=True).interleaved is False
    assert quant.pack_rows(random_q("Q6_K", (16, 256), 0), xq=True).interleaved is False
    assert quant.pack_rows(random_q("Q8_0", (16, 64), 0)).interleaved is False  # not in XQ_DEFAULT
    assert quant.pack_rows(random_q("Q4_0", (20, 64), 0)).interleaved is False
    monkeypatch.setattr(quant.formats, "XQ_DEFAULT", frozenset())
    assert quant.pack_rows(random_q("Q4_0", (16, 64), 0)).interleaved is False
    monkeypatch.undo()
    p = quant.pack_rows(random_q("Q4_0", (16, 64), 0))
    x, rows = np.ones(64, np.float32), np.array([1, 2])
    for call in (lambda: quant.qgemv_rows(p, rows, x), lambda: quant.qgemv(p, x, xq=False),
                 lambda: quant.qaxpy_rows(p, rows, np.ones(2, np.float32), np.zeros(64, np.float32)),
                 lambda: quant.qffn_rows(x, rows, p, p, "relu"), lambda: quant.transpose_quantized(p)):
        with pytest.raises(ValueError, match="interleaved"):
            call()
    with pytest.raises(ValueError, match="interleaved layout"):
        QuantMatrix(p.data, "Q5_0", (16, 64), interleaved=True)


def test_pack_rows_writes_into_a_given_slice():
    """pack_rows(m, out=part) fills part with the bytes pack_rows(m) returns (a stack's slice is
    filled in place at load); a slice of the wrong shape is refused."""
    from hotcold.sparse_ops.quant import QuantMatrix, pack_rows, quantize_rows

    w = np.random.default_rng(5).normal(size=(16, 64)).astype(np.float32)
    m = QuantMatrix(quantize_rows(w, "Q4_0"), "Q4_0", w.shape)
    want = pack_rows(m)
    assert want.interleaved
    stack = np.zeros((3 * want.data.shape[0], want.data.shape[1]), np.uint8)
    got = pack_rows(m, out=stack[want.data.shape[0]:2 * want.data.shape[0]])
    assert got.interleaved and np.shares_memory(got.data, stack)
    assert np.array_equal(stack[want.data.shape[0]:2 * want.data.shape[0]], want.data)
    assert not stack[: want.data.shape[0]].any() and not stack[2 * want.data.shape[0]:].any()
    with pytest.raises(ValueError, match="out must be"):
        pack_rows(m, out=stack[:1])
