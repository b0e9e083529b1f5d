"""The chunk kernels of the fast tier's experts (sparse_ops/moe_chunk_gpu.py): `align`'s blocks of
(token, expert) pairs against a brute-force check on the CPU; `chunk_experts` (CUDA, `cuda` tests)
against a float64 loop over tokens and experts, for bf16 stacks and Q4Stack's of every 4-bit type,
mixed too, with routed experts that have no slot and experts with several blocks of pairs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.sparse_ops.moe_chunk_gpu import align, chunk_experts, chunk_kernels_ready
from hotcold.sparse_ops.moe_gpu import Q4Stack
from hotcold.sparse_ops.quant import QuantMatrix
from test_moe_gpu import Q4_TYPES, gguf_dequantize, loop_reference

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def routing(N, E, G, k, seed):
    """ids [N, k] (distinct experts a token), weights [N, k], slot_of [E] with G experts on the tier."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[torch.randperm(E, generator=g)[:G]] = torch.arange(G, dtype=torch.int32)
    return ids, torch.rand(N, k, generator=g), slot_of


@pytest.mark.parametrize("N, E, G, k, block_m", [(1, 8, 3, 2, 16), (7, 10, 6, 3, 16), (200, 16, 16, 4, 16),
                                                  (50, 12, 5, 4, 4), (3, 4, 1, 2, 16)])
def test_align_blocks_every_pair_with_a_slot_once(N, E, G, k, block_m):
    ids, _, slot_of = routing(N, E, G, k, seed=N + G)
    pairs, block_slot = align(ids, slot_of, G, block_m)
    P = N * k
    B = block_slot.numel()
    assert pairs.shape == (B * block_m,) and B == -(-(P + min(G, P) * (block_m - 1)) // block_m)
    flat = slot_of[ids.reshape(-1)]
    real = pairs[pairs < P].long()
    assert sorted(real.tolist()) == [p for p in range(P) if flat[p] >= 0]  # each pair with a slot, once
    blocks = pairs.view(B, block_m)
    for b in range(B):
        inside = blocks[b][blocks[b] < P].long()
        if block_slot[b] < 0:
            assert len(inside) == 0
        else:
            assert len(inside) > 0 and (flat[inside] == block_slot[b]).all()  # one slot a block
    used = block_slot[block_slot >= 0]
    assert (used[1:] >= used[:-1]).all()  # a slot's blocks together, in slot order
    assert (block_slot[len(used):] == -1).all()  # unused blocks last
    counts = torch.bincount(used.long(), minlength=G)
    per_slot = torch.bincount(flat[flat >= 0].long(), minlength=G)
    assert torch.equal(counts, (per_slot + block_m - 1) // block_m)  # the fewest blocks each


def test_chunk_kernels_not_ready_off_cuda():
    ids, w, slot_of = routing(4, 8, 4, 2, seed=1)
    stacks = [torch.zeros(4, 64, 32), torch.zeros(4, 64, 32), torch.zeros(4, 32, 64)]
    assert not chunk_kernels_ready("cpu", *stacks, slot_of)


def stacks(G, I, D, kinds, seed):
    """gate, up [G, I, D], down [G, D, I] on CUDA: each a bf16 tensor ("bf16") or a Q4Stack of the
    4-bit type named; and the float weights each holds."""
    g = torch.Generator().manual_seed(seed)
    out, dense = [], []
    for (n, kk), kind in zip(((I, D), (I, D), (D, I)), kinds):
        w = torch.randn(G, n, kk, generator=g) / kk**0.5
        if kind == "bf16":
            out.append(w.bfloat16().cuda())
            dense.append(w.bfloat16().float())
        else:
            blocks = [QuantMatrix.quantize(w[s].numpy(), kind) for s in range(G)]
            out.append(Q4Stack.from_quant(blocks, "cuda"))
            dense.append(torch.from_numpy(np.stack([gguf_dequantize(b) for b in blocks])))
    return out, dense


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("kinds", [("bf16",) * 3] + [(q,) * 3 for q in Q4_TYPES] + [("Q4_K", "Q4_K", "bf16")])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", [dict(N=5, E=12, G=5, I=96, D=128, k=3),  # I % 64: a partial row tile
                                   dict(N=300, E=128, G=40, I=768, D=2048, k=8)])  # Qwen3-30B-A3B, several blocks an expert
def test_cuda_chunk_experts_match_the_loop(kinds, act, shape):
    N, E, G, I, D, k = (shape[n] for n in ("N", "E", "G", "I", "D", "k"))
    if "Q4_K" in kinds and I % 256:  # a K-quant's rows are whole super-blocks of 256
        I, D = 256, 512
    ids, w, slot_of = routing(N, E, G, k, seed=N + len(kinds[0]))
    (gate, up, down), dense = stacks(G, I, D, kinds, seed=3)
    x = (torch.randn(N, D, generator=torch.Generator().manual_seed(5))).bfloat16()
    assert chunk_kernels_ready("cuda", gate, up, down, slot_of.cuda())
    y = chunk_experts(x.cuda(), ids.cuda(), w.cuda(), slot_of.cuda(), gate, up, down, act).cpu()
    rows = [0, N // 2, N - 1]
    ref = torch.stack([loop_reference(x[t].float(), ids[t], w[t], slot_of, *dense, act) for t in rows]).float()
    assert (y[rows] - ref).abs().max() <= 2e-2 * ref.abs().max()  # bf16 inputs and h
    none = torch.full_like(slot_of, -1).cuda()
    assert torch.count_nonzero(chunk_experts(x.cuda(), ids.cuda(), w.cuda(), none, gate, up, down, act)) == 0
