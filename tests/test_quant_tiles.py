"""The several-token expert kernel over row-interleaved stacks (sparse_ops/quant/tiles.py) against the
one-token kernel (bit for bit with silu, the MoE models' activation) and gguf's float64 weights."""

from __future__ import annotations

import numpy as np
import pytest

from hotcold.sparse_ops import quant
from test_quant_ops import assert_within, expert_stacks, ref_experts

# (gate / up, down): gate / up interleaved (the tiled path); down interleaved too, or in GGUF rows
# (Q6_K: a Q4_K_M file's W_down, computed pair by pair)
TILE_TYPES = [("Q4_0", "Q4_0"), ("Q4_1", "Q8_0"), ("Q8_0", "Q4_1"), ("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")]


def routing(T: int, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """experts int [T, k] distinct per token over experts 0 .. n - 2, expert n - 1 routed by token 1
    alone; some -1 (skipped) and one token with none; coef float32 [T, k]."""
    rng = np.random.default_rng(seed)
    experts = np.array([rng.permutation(n - 1)[:k] for _ in range(T)])
    experts[1, 0] = n - 1  # an expert with one token
    experts[3, 1] = -1
    experts[T - 2] = -1
    return experts, rng.random(experts.shape).astype(np.float32)


@pytest.mark.parametrize("gtype,dtype", TILE_TYPES)
@pytest.mark.parametrize("T", [1, 2, 37])
def test_tiles_equal_one_token_kernel(gtype, dtype, T):
    """Each token gets exactly what `qexperts` computes for it (its experts in ascending order): ~T / 2
    tokens an expert (tiles of up to TILE tokens, split evenly), an expert with one token, skipped
    experts, a token with none (left as it was); out accumulates; and the float64 reference within
    the Q8 activations' rounding."""
    n, k = 5, 2
    plain = expert_stacks(gtype, dtype, n=n, i=256, d=256, seed=40)
    gate, up, down = (quant.pack_rows(m, xq=True) for m in plain)
    assert gate.interleaved and up.interleaved and down.interleaved == (dtype != "Q6_K")
    experts, coef = routing(max(T, 4), n, k, seed=41)
    experts, coef = experts[:T], coef[:T]
    X = np.random.default_rng(42).standard_normal((T, gate.cols)).astype(np.float32)
    out0 = np.random.default_rng(43).standard_normal(X.shape).astype(np.float32)
    out = out0.copy()
    assert quant.qexperts_tokens(X, experts, coef, gate, up, down, "silu", out=out) is out
    for t in range(T):
        order = np.argsort(experts[t])
        order = order[experts[t][order] >= 0]
        one = np.zeros(gate.cols, np.float32)
        if len(order):
            quant.qexperts(X[t], experts[t][order], coef[t][order], gate, up, down, "silu", out=one)
        assert np.array_equal(out[t], out0[t] + one), f"token {t}: {np.abs(out[t] - out0[t] - one).max():.3g}"
        if len(order):
            want = ref_experts(X[t], experts[t][order], coef[t][order], *plain, "silu")[0]
            assert_within(out[t] - out0[t], want, 0.03 * np.abs(want).max())


def test_tiles_down_in_gguf_rows():
    """Interleaved gate / up with a W_down left in the GGUF layout (Q8 h, pair by pair) equals the
    one-token kernel exactly."""
    plain = expert_stacks("Q4_0", "Q4_0", n=4, i=64, d=96, seed=47)
    gate, up = (quant.pack_rows(m) for m in plain[:2])
    down = plain[2]
    assert gate.interleaved and not down.interleaved
    experts, coef = routing(13, 4, 2, seed=48)
    X = np.random.default_rng(49).standard_normal((13, 96)).astype(np.float32)
    out = quant.qexperts_tokens(X, experts, coef, gate, up, down, "silu")
    for t in range(13):
        order = np.argsort(experts[t])
        order = order[experts[t][order] >= 0]
        one = np.zeros(96, np.float32)
        if len(order):
            quant.qexperts(X[t], experts[t][order], coef[t][order], gate, up, down, "silu", out=one)
        assert np.array_equal(out[t], one)


@pytest.mark.parametrize("act", ["relu", "gelu_tanh"])
def test_tiles_other_activations(act):
    """The tiled path with the other activations equals the one-token kernel within float rounding
    (the products are the same; h can round differently where LLVM compiles the activation into
    another loop: gelu's by an ulp, seen here)."""
    gate, up, down = (quant.pack_rows(m, xq=True) for m in expert_stacks("Q4_0", "Q4_0", n=4, i=64, d=96, seed=44))
    experts, coef = routing(11, 4, 2, seed=45)
    X = np.random.default_rng(46).standard_normal((11, 96)).astype(np.float32)
    out = quant.qexperts_tokens(X, experts, coef, gate, up, down, act)
    for t in range(11):
        order = np.argsort(experts[t])
        order = order[experts[t][order] >= 0]
        one = np.zeros(96, np.float32)
        if len(order):
            quant.qexperts(X[t], experts[t][order], coef[t][order], gate, up, down, act, out=one)
        assert_within(out[t], one, 1e-6 * max(np.abs(one).max(), 1e-30))
