"""A chunk of tokens through the fast tier's experts in two kernels, the routing never on the host.

The fast tier keeps G of a MoE layer's experts stacked as in moe_gpu.py (gate, up [G, I, D], down
[G, D, I]: bf16 tensors or Q4Stack, `slot_of` [E] int32, -1 for experts elsewhere). For N tokens
routed to ids [N, k] with weights [N, k], `chunk_experts` returns

    y[t] = sum_j [slot_of[ids[t, j]] >= 0] * weights[t, j] * down[s] @ (act(gate[s] @ x[t]) * (up[s] @ x[t]))

the way vLLM's fused MoE computes a batch: the N * k (token, expert) pairs are sorted by slot on the
device and cut into blocks of BLOCK_M pairs of one expert each, an expert's last block padded
(`align`); the first kernel multiplies a block's tokens by its expert's gate and up rows (4-bit codes
dequantised in registers, never written out) and stores act(g) * u, the second multiplies that by
down, scales each pair by its routing weight and stores the pair's row; a sum over the k pairs of a
token gives y (no atomics: deterministic). Every launch has a fixed grid (as many blocks as the
padded pairs could need; unused blocks return at once), so the launching thread never waits for the
routing and the chunk can be captured or queued behind the router.
Against decoding a group of experts into a bf16 workspace and three batched products per group
(expert_stream.group_products), an expert's bytes are read once per block of its pairs and nothing
is decoded to memory.

A Q4Stack row holds group g's 32 weights in 16 bytes (element i in the low nibble of byte i, element
i + 16 in the high one): the kernels multiply the low nibbles by x's columns g*32 + i and the high
ones by g*32 + 16 + i, so the codes need no interleaving in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hotcold.sparse_ops.moe_gpu import ACT_CODES, Q4Stack

triton = None
if torch.cuda.is_available():  # CUDA only (a CPU run does not pay Triton's import)
    try:
        import triton
        import triton.language as tl

        from hotcold.sparse_ops.moe_gpu import triton_act
    except ImportError:  # pragma: no cover - depends on the install
        triton = None

__all__ = ["TILES", "Tiles", "align", "chunk_experts", "chunk_kernels_ready", "workspace_bytes"]



@dataclass(frozen=True)
class Tiles:
    """The kernels' tiles: bm pairs a block (align's blocks), bn_gu / bn_d rows of gate/up and of down a
    program, up to gk 32-weight groups (4-bit) or bk weights (16-bit) a K step; warps and pipeline
    stages a program (stages None: Triton's default). tools/bench_moe_chunk.py times alternatives."""

    bm: int = 16  # the tensor cores' smallest M; a 512-token chunk of Qwen3-30B-A3B gives ~32 pairs an expert
    bn_gu: int = 128  # 128/128 against 64/64 on the H100 at Qwen3-30B-A3B's shape, 4-bit: 1.2-1.4x
    bn_d: int = 128  # (0.85 against 1.01 ms for 128 tokens, 1.44 against 1.90 for 512, 3.98 against 5.63 for 2048)
    gk: int = 4
    bk: int = 64
    warps: int = 4
    stages: int | None = None


TILES = Tiles()
BLOCK_M = TILES.bm


def chunk_kernels_ready(device, gate, up, down, slot_of) -> bool:
    """Whether chunk_experts runs on these stacks: CUDA with Triton, at least one expert, contiguous
    stacks, gate and up of one kind."""
    if triton is None or torch.device(device).type != "cuda" or slot_of is None or gate.shape[0] == 0:
        return False
    if isinstance(gate, Q4Stack) != isinstance(up, Q4Stack):
        return False
    return all(t.is_contiguous() for t in (gate, up, down, slot_of))  # (a Q4Stack's K is whole groups of 32)


def workspace_bytes(tokens: int, top_k: int, experts: int, dim: int, hidden: int, itemsize: int) -> int:
    """Device bytes chunk_experts allocates for `tokens` tokens over a layer's `experts` fast-tier
    experts: act(g) * u for every padded pair (itemsize bytes a weight), each pair's float32 row and
    their sum, align's index arrays (the planner reserves this: planner/costs.py)."""
    P = tokens * top_k
    B = -(-(P + min(experts, P) * (BLOCK_M - 1)) // BLOCK_M)
    return B * BLOCK_M * hidden * itemsize + (P + tokens) * dim * 4 + 7 * P * 8 + B * BLOCK_M * 4


def _operands(m) -> tuple:
    # a stack as the kernels take it: a Q4Stack's codes, scales and zeros, or a tensor three times
    return (m.codes, m.scale, m.zero) if isinstance(m, Q4Stack) else (m, m, m)


def _groups(k: int, most: int = TILES.gk) -> int:
    # 32-weight groups a K step of the 4-bit kernels (a power of two dividing k / 32, at most `most`)
    g = most
    while g > 1 and (k // 32) % g:
        g //= 2
    return g


def align(ids: torch.Tensor, slot_of: torch.Tensor, G: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of ids [N, k] sorted by slot, in blocks of block_m pairs of one slot,
    by torch ops of fixed shapes on ids' device (no synchronisation).

    Returns pairs int32 [B * block_m] (the pair index t * k + j, or N * k for padding and for pairs
    whose expert has no slot) and block_slot int32 [B] (the block's slot, -1 for unused blocks), where
    B = ceil((N * k + min(G, N * k) * (block_m - 1)) / block_m) bounds the blocks any routing needs."""
    P = ids.numel()
    dev = ids.device
    s = slot_of[ids.reshape(-1)].long()
    s = torch.where(s >= 0, s, G)  # pairs of experts elsewhere sort last and are dropped
    order = torch.argsort(s, stable=True)  # pair indices by slot
    counts = torch.bincount(s, minlength=G + 1)[:G]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts_padded, starts = ends - padded, torch.cumsum(counts, 0) - counts
    B = -(-(P + min(G, P) * (block_m - 1)) // block_m)
    ss = s[order]
    sc = ss.clamp(max=G - 1)
    dest = starts_padded[sc] + torch.arange(P, device=dev) - starts[sc]
    dest = torch.where(ss < G, dest, B * block_m)  # dropped pairs go to the spare last entry
    pairs = torch.full((B * block_m + 1,), P, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_slot = torch.searchsorted(ends, torch.arange(B, device=dev) * block_m, right=True)
    block_slot = torch.where(block_slot < G, block_slot, -1).to(torch.int32)
    return pairs[:-1], block_slot


def chunk_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                  gate: torch.Tensor | Q4Stack, up: torch.Tensor | Q4Stack, down: torch.Tensor | Q4Stack,
                  act: str, tiles: Tiles = TILES) -> torch.Tensor:
    """The chunk's routed fast-tier experts (see the module docstring). x: [N, D]; ids: int [N, k] and
    weights [N, k] on x's device; slot_of: int32 [E]; gate, up: [G, I, D]; down: [G, D, I] (tensors in
    x's dtype or Q4Stack) -> float32 [N, D]. chunk_kernels_ready must hold."""
    if act not in ACT_CODES:
        raise ValueError(f"act must be one of {tuple(ACT_CODES)}, got {act!r}")
    G, I, D = gate.shape
    N, k = ids.shape
    x = x.contiguous()
    t = tiles
    pairs, block_slot = align(ids, slot_of, G, t.bm)
    B = block_slot.numel()
    w = weights.reshape(-1).float().contiguous()
    h = torch.empty((B * t.bm, I), dtype=x.dtype, device=x.device)
    out = torch.zeros((N * k, D), dtype=torch.float32, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 weights multiply exactly, as torch's do
    launch = dict(num_warps=t.warps, **({"num_stages": t.stages} if t.stages else {}))
    q4_gu, q4_d = isinstance(gate, Q4Stack), isinstance(down, Q4Stack)
    g, u, d = (_operands(m) for m in (gate, up, down))
    gk_gu, gk_d = _groups(D, t.gk), _groups(I, t.gk)
    _gate_up[(B, triton.cdiv(I, t.bn_gu))](
        x, pairs, block_slot, *g, *u, h, N * k, k, I, D, ACT=ACT_CODES[act], BM=t.bm, BN=t.bn_gu, GK=gk_gu, BK=t.bk,
        KS=32 * gk_gu if q4_gu else t.bk, Q4=q4_gu, PREC=prec, **launch)
    _down[(B, triton.cdiv(D, t.bn_d))](
        h, pairs, block_slot, w, *d, out, N * k, I, D, BM=t.bm, BN=t.bn_d, GK=gk_d, BK=t.bk,
        KS=32 * gk_d if q4_d else t.bk, Q4=q4_d, PREC=prec, **launch)
    return out.view(N, k, D).sum(1)


if triton is not None:

    @triton.jit
    def _q4_tiles(q_ptr, s_ptr, z_ptr, row0, rows, rmask, g0, K, BN: tl.constexpr, GK: tl.constexpr, DT: tl.constexpr):
        # rows [BN] of a Q4Stack matrix (row0: the expert's first row) over groups g0 .. g0 + GK:
        # the low nibbles' weights and the high ones', each [BN, GK * 16] in DT
        grp = g0 + tl.arange(0, GK)
        ii = tl.arange(0, 16)
        r64 = row0 + rows.to(tl.int64)
        qoff = r64[:, None, None] * (K // 2) + (grp[:, None] * 16 + ii[None, :])[None, :, :]
        b = tl.load(q_ptr + qoff, mask=rmask[:, None, None], other=0)  # uint8 [BN, GK, 16]
        soff = r64[:, None] * (K // 32) + grp[None, :]
        sc = tl.load(s_ptr + soff, mask=rmask[:, None], other=0.0).to(tl.float32)[:, :, None]
        zr = tl.load(z_ptr + soff, mask=rmask[:, None], other=0.0).to(tl.float32)[:, :, None]
        lo = ((b & 15).to(tl.float32) - 8.0) * sc + zr
        hi = ((b >> 4).to(tl.float32) - 8.0) * sc + zr
        return tl.reshape(lo, (BN, GK * 16)).to(DT), tl.reshape(hi, (BN, GK * 16)).to(DT)

    @triton.jit
    def _halves_cols(g0, GK: tl.constexpr):
        # the columns the low nibbles of groups g0 .. g0 + GK multiply: g * 32 + i, [GK * 16]
        grp = g0 + tl.arange(0, GK)
        return tl.reshape(grp[:, None] * 32 + tl.arange(0, 16)[None, :], (GK * 16,))

    @triton.jit
    def _block(pairs_ptr, block_ptr, P, BM: tl.constexpr):
        # this program's block: its slot (-1: unused) and its pairs [BM] (P: padding), valid mask
        b = tl.program_id(0)
        slot = tl.load(block_ptr + b)
        m = b * BM + tl.arange(0, BM)
        pair = tl.load(pairs_ptr + m)
        return slot, m, pair, pair < P

    @triton.jit
    def _a_tiles(a_ptr, arow, amask, k0, K, Q4: tl.constexpr, GK: tl.constexpr, BK: tl.constexpr):
        # A's rows (at a_ptr + arow, element offsets; amask where real) at the K step from column k0:
        # with Q4 the columns the low and the high nibbles of groups k0 / 32 .. + GK multiply, each
        # [BM, GK * 16]; else columns k0 .. k0 + BK twice
        if Q4:
            cols = _halves_cols(k0 // 32, GK)
            lo = tl.load(a_ptr + arow[:, None] + cols[None, :], mask=amask[:, None], other=0.0)
            hi = tl.load(a_ptr + arow[:, None] + cols[None, :] + 16, mask=amask[:, None], other=0.0)
        else:
            c = k0 + tl.arange(0, BK)
            lo = tl.load(a_ptr + arow[:, None] + c[None, :], mask=amask[:, None] & (c < K)[None, :], other=0.0)
            hi = lo
        return lo, hi

    @triton.jit
    def _w_dot(a_lo, a_hi, w0, w1, w2, row0, n, nmask, k0, K, Q4: tl.constexpr, BN: tl.constexpr,
               GK: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        # A's tiles (_a_tiles) . W[row0 + n] over the K step from k0 -> float32 [BM, BN]: W a Q4Stack
        # matrix (w0, w1, w2: codes, scale, zero) with Q4, its codes dequantised in registers, else a
        # matrix in A's dtype (w0)
        if Q4:
            wl, wh = _q4_tiles(w0, w1, w2, row0, n, nmask, k0 // 32, K, BN, GK, a_lo.dtype)
            d = tl.dot(a_lo, tl.trans(wl), input_precision=PREC) + tl.dot(a_hi, tl.trans(wh), input_precision=PREC)
        else:
            c = k0 + tl.arange(0, BK)
            wt = tl.load(w0 + ((row0 + n.to(tl.int64)) * K)[:, None] + c[None, :],
                         mask=nmask[:, None] & (c < K)[None, :], other=0.0)
            d = tl.dot(a_lo, tl.trans(wt), input_precision=PREC)
        return d

    @triton.jit(do_not_specialize=["P"])  # one build for every chunk length
    def _gate_up(x_ptr, pairs_ptr, block_ptr, ga, gb, gc, ua, ub, uc, h_ptr, P, K_TOP, I, D, ACT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, GK: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr,
                 Q4: tl.constexpr, PREC: tl.constexpr):
        # h[m, n] = act(x[tok] . gate[slot, n]) * (x[tok] . up[slot, n]) for the block's pairs m, rows n;
        # x's tiles load once a K step (KS columns) for both products
        slot, m, pair, valid = _block(pairs_ptr, block_ptr, P, BM)
        if slot < 0:
            return
        xrow = tl.where(valid, pair // K_TOP, 0).to(tl.int64) * D
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < I
        row0 = slot.to(tl.int64) * I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, KS):
            a_lo, a_hi = _a_tiles(x_ptr, xrow, valid, k0, D, Q4, GK, BK)
            acc_g += _w_dot(a_lo, a_hi, ga, gb, gc, row0, n, nmask, k0, D, Q4, BN, GK, BK, PREC)
            acc_u += _w_dot(a_lo, a_hi, ua, ub, uc, row0, n, nmask, k0, D, Q4, BN, GK, BK, PREC)
        hv = triton_act(acc_g, ACT) * acc_u
        tl.store(h_ptr + m.to(tl.int64)[:, None] * I + n[None, :], hv.to(h_ptr.dtype.element_ty), mask=nmask[None, :])

    @triton.jit(do_not_specialize=["P"])  # one build for every chunk length
    def _down(h_ptr, pairs_ptr, block_ptr, w_ptr, da, db, dc, out_ptr, P, I, D, BM: tl.constexpr, BN: tl.constexpr,
              GK: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, Q4: tl.constexpr, PREC: tl.constexpr):
        # out[pair, n] = weight[pair] * (h[m] . down[slot, n]) for the block's pairs m, rows n of D
        slot, m, pair, valid = _block(pairs_ptr, block_ptr, P, BM)
        if slot < 0:
            return
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < D
        hrow, row0 = m.to(tl.int64) * I, slot.to(tl.int64) * D
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, KS):
            a_lo, a_hi = _a_tiles(h_ptr, hrow, m >= 0, k0, I, Q4, GK, BK)
            acc += _w_dot(a_lo, a_hi, da, db, dc, row0, n, nmask, k0, I, Q4, BN, GK, BK, PREC)
        wt = tl.load(w_ptr + pair, mask=valid, other=0.0)
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * D + n[None, :], acc * wt[:, None],
                 mask=valid[:, None] & nmask[None, :])
