"""The integer input-major kernel (sparse_ops/input_sparse_int.py): its layout against the file's
weights, and its product against the dense kernel's on the thresholded input (which quantises that
input per 32-block the same way) and against a float64 reference of the same arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from hotcold.sparse_ops.cpu import get_threads, set_threads
from hotcold.sparse_ops.input_sparse import QI4_0, QI4_1, QI8_0, im_gemv, input_major
from hotcold.sparse_ops.input_sparse_int import ROW_OF_BYTE, available, pack_int, unpack_int
from hotcold.sparse_ops.quant import QuantMatrix, pack_rows, qgemv

pytestmark = pytest.mark.skipif(not available(), reason="the integer kernel needs AVX-512 VNNI")
RNG = np.random.default_rng(7)
KIND = {"Q4_0": QI4_0, "Q4_1": QI4_1, "Q8_0": QI8_0}


def _x(cols: int) -> np.ndarray:
    x = RNG.standard_normal(cols).astype(np.float32)
    x[RNG.integers(0, cols, 3)] *= 20  # outlier channels, as hidden states have
    x[:5] = 0.0
    if cols >= 64:
        x[32:64] = 0.01  # a block that a threshold drops whole
    return x


def _quantised_reference(w: np.ndarray, x: np.ndarray, thr: float) -> np.ndarray:
    # float64 W @ (the thresholded x, quantised per 32-block: dx = max |x| / 127, q = round(x / dx))
    xs = np.where(np.abs(x) > thr, x, 0.0).astype(np.float32).reshape(-1, 32)
    dx = np.abs(xs).max(axis=1) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), dx, out=np.zeros_like(dx), where=dx > 0)
    return w @ (np.round(xs * inv[:, None]) * dx[:, None]).reshape(-1).astype(np.float64)


def test_row_permutation_is_the_unpacks_order():
    """Byte 16 q + 4 k + i of a chunk is lane 4 q + i of vector k after vpunpck{l,h}bw then
    vpunpck{l,h}wd of four chunks (per 128-bit lane), so it must hold row 16 k + 4 q + i."""
    a = np.arange(64)
    lo_b, hi_b = [np.concatenate([a[16 * q + 8 * h:16 * q + 8 * h + 8] for q in range(4)]) for h in (0, 1)]
    vectors = []
    for half in (lo_b, hi_b):  # the word unpack of (ab, cd) keeps a's byte order per lane
        vectors += [np.concatenate([half[8 * q + 4 * h:8 * q + 4 * h + 4] for q in range(4)]) for h in (0, 1)]
    for k, v in enumerate(vectors):
        assert ROW_OF_BYTE[v].tolist() == list(range(16 * k, 16 * k + 16))
    assert sorted(ROW_OF_BYTE.tolist()) == list(range(64))


@pytest.mark.parametrize("nibbles", [True, False])
def test_layout_round_trip(nibbles):
    q = RNG.integers(0, 16 if nibbles else 256, (300, 96)).astype(np.uint8)
    d = RNG.standard_normal((300, 3)).astype(np.float16)
    codes, db, mb = pack_int(q, d, d, nibbles)
    assert codes.shape == (96, 384 // 2 if nibbles else 384) and db.shape == (3, 384)
    assert np.array_equal(unpack_int(codes, 300, nibbles), q)
    assert np.array_equal(db.view(np.float16)[:, :300], d.T) and not db[:, 300:].any()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, cols", [(64, 96), (600, 256), (1030, 64), (129, 32), (576, 1536)])
def test_integer_kernel_equals_the_dense_kernel_on_the_thresholded_input(qtype, rows, cols):
    """The file's weights exactly; the product equals the dense integer kernel's on the thresholded
    input and the float64 product of the block-quantised thresholded input within float32 summation
    noise, and the float product of the thresholded input within the int8 activations' error."""
    m = QuantMatrix.quantize(RNG.standard_normal((rows, cols)).astype(np.float32), qtype)
    w = m.dequantize().astype(np.float64)
    x = _x(cols)
    for thr in (0.0, 0.3, float(np.quantile(np.abs(x), 0.5)), float(np.quantile(np.abs(x), 0.8)), 1e9):
        im = input_major(m, thr, integer=True)
        assert im.kind == KIND[qtype]
        assert np.array_equal(im.dense(), m.dequantize())
        got = im_gemv(im, x)
        xs = np.where(np.abs(x) > thr, x, 0.0).astype(np.float32)
        scale = max(1.0, float(np.abs(w).sum(axis=1).max() * np.abs(xs).max()))
        assert np.abs(got - _quantised_reference(w, x, thr)).max() <= 1e-5 * scale, (qtype, thr)
        assert np.abs(got - w @ xs).max() <= 0.02 * scale  # int8 activations: ~1/254 of each block's max
        if rows % 8 == 0:  # the dense kernel (row-interleaved, Q8 activations) on the thresholded input
            dense = qgemv(pack_rows(m, xq=True), xs)
            assert np.abs(got - dense).max() <= 1e-5 * scale, (qtype, thr)
        assert im.counter.tolist() == [int((np.abs(x) > thr).sum()), cols]
        if thr == 1e9:
            assert not got.any()


def test_tasks_split_the_rows_without_changing_the_product():
    m = QuantMatrix.quantize(RNG.standard_normal((1100, 256)).astype(np.float32), "Q4_1")
    x = _x(256)
    one, three = input_major(m, 0.2, integer=True), input_major(m, 0.2, integer=True)
    one.tasks, three.tasks = 1, 3  # 9 tiles: one task, or 3 uneven ones side by side
    old = get_threads()
    try:
        set_threads(2)
        assert np.array_equal(im_gemv(one, x), im_gemv(three, x))
    finally:
        set_threads(old)
