"""Small fused ops for CUDA (Triton): RMSNorm, rotary embedding and MoE routing, one kernel each.

In torch, an RMSNorm is seven kernels (float, pow, mean, add, rsqrt, two multiplies) and rotating q
or k with the rotary tables about a dozen (the tables' product, cos, sin, the halves' negation and
concatenation, casts, multiplies, the sum). A one-token step's graph of a Qwen3-MoE layer ran ~80
kernels, 1-3 µs each on an H200, ~190 µs a layer: its four norms and two rotations were ~45 of them.
Both kernels work row by row, so a row's result does not depend on how many rows share the call;
they compute in float32 and round as the torch ops do (to within the order of a sum, and of
float32's cos/sin). A one-token MoE routing (softmax, top-k, renormalising, and packing the
routing with the FFN input for the host: ~10 kernels, 2-5 µs each) is one kernel as well. Without
Triton (or off CUDA) the callers keep the torch ops.
"""

from __future__ import annotations

import torch

triton = None
if torch.cuda.is_available():  # the kernels run on CUDA only: a CPU run does not pay Triton's import (~0.1 s)
    try:  # Triton comes with torch's CUDA builds on Linux
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = None

__all__ = ["fused_ready", "rms_norm_cuda", "rope_cuda", "route_pack_cuda", "MAX_EXPERTS"]

MAX_DIM = 16384  # longest row a kernel takes in one block
MAX_EXPERTS = 1024  # most experts route_pack_cuda takes (one block)


def fused_ready(x: torch.Tensor) -> bool:
    """Whether the kernels run for x: a CUDA tensor, Triton present, no autograd."""
    return triton is not None and x.is_cuda and x.shape[-1] <= MAX_DIM and not torch.is_grad_enabled()


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr):
        # one row per program: x [N, D] -> out [N, D] in x's dtype, as RMSNorm._torch rounds
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if PLUS_ONE:
            y = x * r * (1.0 + w)
        else:  # torch: weight * (x * r) rounded to x's dtype first
            y = (x * r).to(dt).to(tl.float32) * w
        tl.store(out_ptr + row * D + offs, y.to(dt), mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, T, H, DH: tl.constexpr, BLOCK: tl.constexpr):
        # one row (b, t, h) per program: x [B, T, H, Dh] -> out, the halves rotated by angle
        # positions[t] * inv_freq[i % (Dh / 2)] (HF layout: out = x cos + (-x2, x1) sin)
        row = tl.program_id(0).to(tl.int64)
        t = (row // H) % T
        half: tl.constexpr = DH // 2
        offs = tl.arange(0, BLOCK)
        m = offs < DH
        i = offs % half
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + i, mask=m, other=0.0)
        x = tl.load(x_ptr + row * DH + offs, mask=m, other=0.0).to(tl.float32)
        partner = tl.where(offs < half, offs + half, offs - half)
        xp = tl.load(x_ptr + row * DH + partner, mask=m, other=0.0).to(tl.float32)
        rot = tl.where(offs < half, -xp, xp)
        y = x * tl.cos(ang) + rot * tl.sin(ang)
        tl.store(out_ptr + row * DH + offs, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _route_pack_kernel(logit_ptr, x_ptr, packed_ptr, w_ptr, ids_ptr, E, D, RENORM: tl.constexpr,
                           K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
        # programs 0 .. cdiv(D, BLOCK_D) - 1: x [D] as float32 bits into packed[0:D]; the last one: the
        # routing, softmax over logits [E] in float32, the top K (lowest index among equals), their
        # weights renormalised when RENORM -> w [K] float32, ids [K] int64, packed[D:D+K] (weight
        # bits), packed[D+K:D+2K] (ids)
        pid = tl.program_id(0)
        if pid * BLOCK_D < D:
            xo = pid * BLOCK_D + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + xo, mask=xo < D, other=0.0).to(tl.float32)
            tl.store(packed_ptr + xo, x.to(tl.int32, bitcast=True), mask=xo < D)
        else:
            offs = tl.arange(0, BLOCK_E)
            m = offs < E
            z = tl.load(logit_ptr + offs, mask=m, other=-float("inf")).to(tl.float32)
            e = tl.exp(z - tl.max(z, axis=0))
            p = tl.where(m, e / tl.sum(e, axis=0), -1.0)
            ks = tl.arange(0, K)
            w = tl.zeros((K,), tl.float32)
            ids = tl.zeros((K,), tl.int32)
            for j in tl.static_range(K):
                v = tl.max(p, axis=0)
                i = tl.min(tl.where(p == v, offs, BLOCK_E), axis=0)
                w = tl.where(ks == j, v, w)
                ids = tl.where(ks == j, i, ids)
                p = tl.where(offs == i, -1.0, p)
            if RENORM:
                w = w / tl.sum(w, axis=0)
            tl.store(w_ptr + ks, w)
            tl.store(ids_ptr + ks, ids.to(tl.int64))
            tl.store(packed_ptr + D + ks, w.to(tl.int32, bitcast=True))
            tl.store(packed_ptr + D + K + ks, ids)


def rms_norm_cuda(x: torch.Tensor, w: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    """RMSNorm of each row of x [.., D] (CUDA): x * rsqrt(mean(x²) + eps) in float32, rounded to x's
    dtype, times w (plus_one, Gemma's: times 1 + w in float32). w: [D]. -> x's shape and dtype."""
    D = x.shape[-1]
    rows = x.reshape(-1, D).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, w.contiguous(), out, D, float(eps), PLUS_ONE=bool(plus_one),
                                           BLOCK=triton.next_power_of_2(D))
    return out.reshape(x.shape)


def rope_cuda(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate halves, as models.layers.apply_rope with Rotary's tables) in one kernel,
    the angles computed in place. x: [B, T, H, Dh] (CUDA); positions: int [T]; inv_freq: float32
    [Dh / 2] -> x's shape and dtype."""
    B, T, H, Dh = x.shape
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if xc.numel():
        _rope_kernel[(B * T * H,)](xc, positions.contiguous(), inv_freq.float().contiguous(), out, T, H, DH=Dh,
                                   BLOCK=triton.next_power_of_2(Dh))
    return out


def route_pack_cuda(logits: torch.Tensor, x: torch.Tensor, top_k: int, renormalise: bool,
                    extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's MoE routing in one kernel, as models.layers.route (softmax in float32, the top
    k, renormalised when asked), packed with the FFN input for the host. logits: [1, E] (E ≤
    MAX_EXPERTS); x: [1, D] (CUDA) -> (packed int32 [D + 2k + extra]: x as float32 bits, the weights'
    bits, the ids, then `extra` entries left for the caller; weights float32 [1, k]; ids int64 [1, k]).
    Among equal probabilities the lower expert index wins."""
    E, D = logits.shape[-1], x.shape[-1]
    if logits.numel() != E or x.numel() != D or not 0 < top_k <= E or E > MAX_EXPERTS:
        raise ValueError(f"route_pack_cuda takes one token's logits [1, E ≤ {MAX_EXPERTS}] and x [1, D] with "
                         f"0 < top_k ≤ E; got {tuple(logits.shape)}, {tuple(x.shape)}, top_k={top_k}")
    dev = x.device
    K = triton.next_power_of_2(top_k)  # tl.arange needs a power of two: route K, keep the first top_k
    packed = torch.empty(D + 2 * K + extra, dtype=torch.int32, device=dev)
    weights = torch.empty((1, K), dtype=torch.float32, device=dev)
    ids = torch.empty((1, K), dtype=torch.int64, device=dev)
    block_d = min(1024, triton.next_power_of_2(D))
    grid = (triton.cdiv(D, block_d) + 1,)
    _route_pack_kernel[grid](logits.contiguous(), x.contiguous(), packed, weights, ids, E, D,
                             RENORM=bool(renormalise and K == top_k), K=K, BLOCK_E=triton.next_power_of_2(E),
                             BLOCK_D=block_d)
    if K == top_k:
        return packed, weights, ids
    w, i = weights[:, :top_k], ids[:, :top_k]  # (picks past E, when K > E, are dropped here)
    if renormalise:
        w = w / w.sum(-1, keepdim=True)
    out = packed[:D + 2 * top_k + extra]
    out[D:D + top_k] = w[0].view(torch.int32)
    out[D + top_k:D + 2 * top_k] = i[0].to(torch.int32)
    return out, w.contiguous(), i.contiguous()
