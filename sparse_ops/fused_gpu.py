"""Small fused ops for CUDA (Triton): RMSNorm and rotary embedding, one kernel each.

In torch, an RMSNorm is seven kernels (float, pow, mean, add, rsqrt, two multiplies) and rotating q
or k with the rotary tables about a dozen (the tables' product, cos, sin, the halves' negation and
concatenation, casts, multiplies, the sum). A one-token step's graph of a Qwen3-MoE layer ran ~80
kernels, 1-3 µs each on an H200, ~190 µs a layer: its four norms and two rotations were ~45 of them.
Both kernels work row by row, so a row's result does not depend on how many rows share the call;
they compute in float32 and round as the torch ops do (to within the order of a sum, and of
float32's cos/sin). Without Triton (or off CUDA) the callers keep the torch ops.
"""

from __future__ import annotations

import torch

try:  # Triton comes with torch's CUDA builds on Linux
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["fused_ready", "rms_norm_cuda", "rope_cuda"]

MAX_DIM = 16384  # longest row a kernel takes in one block


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
