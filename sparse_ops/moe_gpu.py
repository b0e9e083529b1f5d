"""The fast tier's routed experts for one token, without the host knowing the routing.

A MoE layer keeps G of its E experts on the fast tier, stacked: gate, up [G, I, D], down [G, D, I],
and `slot_of` [E] (int32: the slot of each expert, -1 for those elsewhere). For one token routed to
experts ids [k] with weights [k], `routed_experts` returns

    y = sum_j [slot_of[ids[j]] >= 0] * weights[j] * down[s_j] @ (act(gate[s_j] @ x) * (up[s_j] @ x))

entirely on the device: the routing never crosses to the host first, so the launching thread does
not wait for it, and only the routed experts' weights are read. On CUDA with Triton it is two
kernels (gate and up with the activation and routing weight; then down, summed over the k experts
in the kernel, so the result is deterministic); elsewhere a torch version gathers the k experts'
weights first (three times their bytes; used on the CPU tier and as the reference in tests).

Each of the two kernels also has a 4-bit twin that reads a `Q4Stack` in place of a bf16 stack (gate
and up together, down on its own: a Q4_K_M file often has 4-bit gate/up experts and Q6_K down): the
file's own Q4_0 / Q4_1 / Q4_K codes, 16 bytes per group of 32 weights as Q4_0 packs them, and one fp16
(scale, zero) pair per group, dequantised in registers (5 bits a weight against bf16's 16, so about
3x the experts fit in the same VRAM).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.sparse_ops.gpu import activation
from hotcold.sparse_ops.gpu_quant import GROUP_SIZE, int4_type, split_blocks, unpack_halves
from hotcold.sparse_ops.quant import QTYPES

triton = None
if torch.cuda.is_available():  # the kernels run on CUDA only: a CPU run does not pay Triton's import
    try:  # Triton comes with torch's CUDA builds on Linux; without it the torch version runs
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - depends on the install
        triton = None

__all__ = ["ACT_CODES", "Q4Stack", "routed_experts", "routed_experts_torch", "triton_available"]

ACT_CODES = {"silu": 0, "gelu_tanh": 1, "relu": 2}


def triton_available(device) -> bool:
    """Whether routed_experts runs its Triton kernels on this device."""
    return triton is not None and torch.device(device).type == "cuda"


@dataclass
class Q4Stack:
    """G matrices [N, K] in 4 bits, groups of 32 along K: codes uint8 [G, N, K / 2] (per group, byte i
    holds element i in its low nibble and element i + 16 in its high one), scale, zero fp16 [G, N, K / 32];
    w = (code - 8) * scale + zero (gpu_quant.split_blocks: exact for Q4_0 and Q4_1 up to the fp16
    rounding of zero, for Q4_K up to that of scale and zero)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @classmethod
    def from_quant(cls, mats, device) -> "Q4Stack":
        """Stack QuantMatrix's of one 4-bit type (Q4_0 | Q4_1 | Q4_K) and one shape on device: their blocks
        cross as they are, STACK_CHUNK matrices a copy, and split into codes, scales and zeros there by
        torch ops (gpu_quant.split_blocks)."""
        mats = list(mats)
        n, k = mats[0].shape if mats else (0, GROUP_SIZE)
        if k % GROUP_SIZE:
            raise ValueError(f"a Q4Stack needs K divisible by {GROUP_SIZE}, got {k}")
        qtype = int4_type(mats[0].qtype if mats else "Q4_0")
        with torch.inference_mode(False):
            out = cls(torch.empty((len(mats), n, k // 2), dtype=torch.uint8, device=device),
                      *(torch.empty((len(mats), n, k // GROUP_SIZE), dtype=torch.float16, device=device)
                        for _ in range(2)))
        _, bs, ts = QTYPES[qtype]
        for a in range(0, len(mats), STACK_CHUNK):
            part = mats[a:a + STACK_CHUNK]
            raw = torch.empty((len(part), n, k // bs, ts), dtype=torch.uint8, device=device)
            for g, m in enumerate(part):
                if m.shape != (n, k) or m.qtype != qtype:
                    raise ValueError(f"Q4Stack matrices differ in shape or type: {m.qtype} {m.shape} and {qtype} {(n, k)}")
                data = np.ascontiguousarray(m.row_data())  # (quant.pack_rows' layout: the GGUF rows, a copy)
                with warnings.catch_warnings():  # a view of a read-only file mapping: only read
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    raw[g].copy_(torch.from_numpy(data).view(n, k // bs, ts))
            codes, scale, zero = split_blocks(raw, qtype)  # (scale and zero rounded to fp16 as they are stored)
            s = slice(a, a + len(part))
            out.codes[s], out.scale[s], out.zero[s] = codes.reshape(len(part), n, -1), scale.reshape(len(part), n, -1), \
                zero.reshape(len(part), n, -1)
        return out

    @property
    def shape(self) -> tuple[int, int, int]:
        G, N, half = self.codes.shape
        return G, N, 2 * half

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def is_contiguous(self) -> bool:
        return all(t.is_contiguous() for t in (self.codes, self.scale, self.zero))

    @property
    def kernel_decode(self) -> bool:
        """Whether `dequantize` runs one Triton kernel (CUDA) rather than torch ops with float32 temporaries."""
        return triton_available(self.device)

    def dequantize(self, s, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Matrices s (an int, a slice or an index tensor [k]) as floats: [N, K] or [k, N, K]."""
        if self.kernel_decode:
            from hotcold.sparse_ops.blocks_gpu import dequantize_halves

            return dequantize_halves(self.codes[s], self.scale[s], self.zero[s], dtype)
        q = unpack_halves(self.codes[s]).float() - 8  # [..., N, K / 32, 32]
        w = q * self.scale[s].float()[..., None] + self.zero[s].float()[..., None]
        return w.flatten(-2).to(dtype)  # [..., N, K]


STACK_CHUNK = 16  # matrices whose blocks cross to the device in one piece (bounds the raw bytes held beside the stack)


def _weights(stack, s, dtype) -> torch.Tensor:
    # stack[s] as floats (a Q4Stack dequantised)
    return stack.dequantize(s, dtype) if isinstance(stack, Q4Stack) else stack[s]


def routed_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                         gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """routed_experts by gathering the k experts' weights (torch only). Returns float32 [D]."""
    f = activation(act)
    s = slot_of[ids].long()  # [k]
    w = torch.where(s >= 0, weights.float(), torch.zeros_like(weights, dtype=torch.float32))  # [k]
    s = s.clamp(min=0)
    dt = x.dtype if isinstance(gate, Q4Stack) else gate.dtype
    xk = x.reshape(1, -1, 1).to(dt)  # [1, D, 1]
    h = f(torch.matmul(_weights(gate, s, dt), xk).float()) * torch.matmul(_weights(up, s, dt), xk).float()  # [k, I, 1]
    wd = _weights(down, s, dt)  # [k, D, I]
    h = (h * w[:, None, None]).to(wd.dtype)
    return torch.matmul(wd, h).float().sum(0).reshape(-1)  # [D]


def kernels_ready(device, gate, up, down, slot_of) -> bool:
    """Whether routed_experts runs its Triton kernels on these stacks (else its torch twin): CUDA,
    at least one expert, every stack contiguous (the kernels index them as such)."""
    return (triton_available(device) and gate.shape[0] > 0
            and all(t.is_contiguous() for t in (gate, up, down, slot_of)))


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                   gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One token's routed fast-tier experts (see the module docstring). x: [D]; ids: int [k];
    weights: [k]; slot_of: int32 [E]; gate, up: [G, I, D] (both tensors, or both Q4Stack);
    down: [G, D, I] (a tensor or a Q4Stack) -> float32 [D]."""
    if act not in ACT_CODES:
        raise ValueError(f"act must be one of {tuple(ACT_CODES)}, got {act!r}")
    q4_gu = isinstance(gate, Q4Stack)
    if q4_gu != isinstance(up, Q4Stack):
        raise ValueError("gate and up must both be Q4Stack or both tensors")
    if not kernels_ready(x.device, gate, up, down, slot_of):
        return routed_experts_torch(x, ids, weights, slot_of, gate, up, down, act)
    G, I, D = gate.shape
    k = ids.numel()
    x = x.reshape(-1).contiguous()
    ids = ids.reshape(-1).contiguous()
    weights = weights.reshape(-1).float().contiguous()
    h = torch.empty((k, I), dtype=torch.float32, device=x.device)
    y = torch.empty(D, dtype=torch.float32, device=x.device)
    if q4_gu:
        _gate_up_q4_kernel[(k, triton.cdiv(I, _Q4_GU_ROWS))](
            x, ids, weights, slot_of, gate.codes, gate.scale, gate.zero, up.codes, up.scale, up.zero, h, I, D,
            ACT=ACT_CODES[act], BLOCK_N=_Q4_GU_ROWS, GROUPS=_Q4_GU_GROUPS)
    else:
        _gate_up_kernel[(k, triton.cdiv(I, _GU_ROWS))](
            x, ids, weights, slot_of, gate, up, h, I, D, ACT=ACT_CODES[act], BLOCK_N=_GU_ROWS, BLOCK_K=_GU_COLS)
    if isinstance(down, Q4Stack):
        _down_q4_kernel[(triton.cdiv(D, _Q4_DOWN_ROWS),)](
            h, ids, slot_of, down.codes, down.scale, down.zero, y, k, I, D,
            BLOCK_N=_Q4_DOWN_ROWS, GROUPS=_Q4_DOWN_GROUPS)
    else:
        _down_kernel[(triton.cdiv(D, _DOWN_ROWS),)](
            h, ids, slot_of, down, y, k, I, D, BLOCK_N=_DOWN_ROWS, BLOCK_K=_DOWN_COLS)
    return y


# Tile sizes: rows of a weight matrix per program x columns per step. A decode GEMV is bound by
# memory, so the grid must cover every SM many times over: k * I/8 programs for gate/up (8 * 96 for
# Qwen3-30B-A3B), D/2 for down (1024), each streaming 16 KB (gate/up) / 4 KB tiles. Swept on the H200
# (8 routed experts of that shape, bf16, L2 flushed): 37.6 us a token where 32 x 128 and 16 x 256 took 80.
_GU_ROWS, _GU_COLS = 8, 1024
_DOWN_ROWS, _DOWN_COLS = 2, 1024
# The 4-bit twins: rows x groups of 32 weights per step (16 bytes of codes each). Swept on the H200
# (8 routed Qwen3-30B-A3B experts, Q4_K, L2 flushed): gate/up 8 x 16 and down 2 x 32 take 36 us a
# token where 32 x 8 and 16 x 8 took 68: small tiles, many programs in flight. About bf16's time
# (37.7 us) for 0.31x its bytes: 4 bits buy VRAM (3.2x the experts), not speed.
_Q4_GU_ROWS, _Q4_GU_GROUPS = 8, 16
_Q4_DOWN_ROWS, _Q4_DOWN_GROUPS = 2, 32

if triton is not None:

    @triton.jit
    def triton_act(z, ACT: tl.constexpr):
        if ACT == 0:  # silu
            return z / (1.0 + tl.exp(-z))
        elif ACT == 1:  # gelu (tanh approximation); tanh(u) = 2 sigmoid(2u) - 1
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            return 0.5 * z * (2.0 / (1.0 + tl.exp(-2.0 * u)))
        else:  # relu
            return tl.maximum(z, 0.0)

    @triton.jit
    def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, slot_ptr, gate_ptr, up_ptr, h_ptr, I, D,
                        ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (j, b): h[j, rows] = w_j * act(gate[s_j, rows] @ x) * (up[s_j, rows] @ x), rows the
        # b-th BLOCK_N of I; zeros when expert ids[j] has no slot (its loads are masked off: not read)
        j = tl.program_id(0)
        s = tl.load(slot_ptr + tl.load(ids_ptr + j))
        valid = s >= 0
        base = tl.maximum(s, 0).to(tl.int64) * I * D
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rmask = rows < tl.where(valid, I, 0)  # (one comparison: a bool mask in Triton's interpreter too)
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            cmask = cols < D
            xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            off = base + rows[:, None].to(tl.int64) * D + cols[None, :]  # [BLOCK_N, BLOCK_K]
            m = rmask[:, None] & cmask[None, :]
            g = tl.load(gate_ptr + off, mask=m, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + off, mask=m, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * xv[None, :], axis=1)
            acc_u += tl.sum(u * xv[None, :], axis=1)
        w = tl.where(valid, tl.load(w_ptr + j), 0.0)
        tl.store(h_ptr + j * I + rows, triton_act(acc_g, ACT) * acc_u * w, mask=rows < I)

    @triton.jit
    def _down_kernel(h_ptr, ids_ptr, slot_ptr, down_ptr, y_ptr, K, I, D,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program b: y[rows] = sum_j down[s_j, rows] @ h[j], rows the b-th BLOCK_N of D
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(K):
            s = tl.load(slot_ptr + tl.load(ids_ptr + j))
            rmask = rows < tl.where(s >= 0, D, 0)
            base = tl.maximum(s, 0).to(tl.int64) * D * I
            for k0 in range(0, I, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < I
                hv = tl.load(h_ptr + j * I + cols, mask=cmask, other=0.0)
                m = rmask[:, None] & cmask[None, :]
                w = tl.load(down_ptr + base + rows[:, None].to(tl.int64) * I + cols[None, :], mask=m, other=0.0)
                acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
        tl.store(y_ptr + rows, acc, mask=rows < D)

    @triton.jit
    def _q4_dot(q_ptr, s_ptr, z_ptr, base, rows, rmask, v_ptr, grp, gmask, K, GROUPS: tl.constexpr):
        # sum over the GROUPS groups `grp` of K of w[rows, :] * v, w a Q4Stack matrix at element offset
        # base (its codes at base / 2, scale and zero at base / 32): -> float32 [BLOCK_N]
        ii = tl.arange(0, 16)
        col = grp[:, None] * 32 + ii[None, :]  # [GROUPS, 16]: the low nibbles' elements
        vmask = gmask[:, None]
        vl = tl.load(v_ptr + col, mask=vmask, other=0.0).to(tl.float32)
        vh = tl.load(v_ptr + col + 16, mask=vmask, other=0.0).to(tl.float32)
        m3 = (rmask[:, None, None] & gmask[None, :, None]) & (ii < 16)[None, None, :]  # [BLOCK_N, GROUPS, 16]
        qoff = base // 2 + rows[:, None, None].to(tl.int64) * (K // 2) + (grp[:, None] * 16 + ii[None, :])[None, :, :]
        b = tl.load(q_ptr + qoff, mask=m3, other=0)  # uint8 [BLOCK_N, GROUPS, 16]
        lo = (b & 15).to(tl.float32) - 8.0
        hi = (b >> 4).to(tl.float32) - 8.0
        dot = tl.sum(lo * vl[None, :, :] + hi * vh[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        vs = tl.sum(vl + vh, axis=1)  # [GROUPS]
        m2 = rmask[:, None] & gmask[None, :]
        soff = base // 32 + rows[:, None].to(tl.int64) * (K // 32) + grp[None, :]
        sc = tl.load(s_ptr + soff, mask=m2, other=0.0).to(tl.float32)
        zr = tl.load(z_ptr + soff, mask=m2, other=0.0).to(tl.float32)
        return tl.sum(sc * dot + zr * vs[None, :], axis=1)

    @triton.jit
    def _gate_up_q4_kernel(x_ptr, ids_ptr, w_ptr, slot_ptr, gq_ptr, gs_ptr, gz_ptr, uq_ptr, us_ptr, uz_ptr, h_ptr,
                           I, D, ACT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        # _gate_up_kernel over Q4Stack gate and up (D % 32 == 0)
        j = tl.program_id(0)
        s = tl.load(slot_ptr + tl.load(ids_ptr + j))
        valid = s >= 0
        base = tl.maximum(s, 0).to(tl.int64) * I * D  # the expert's first element
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < tl.where(valid, I, 0)  # (one comparison: a bool mask in Triton's interpreter too)
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        n_groups = D // 32
        for g0 in range(0, n_groups, GROUPS):
            grp = g0 + tl.arange(0, GROUPS)
            gmask = grp < n_groups
            acc_g += _q4_dot(gq_ptr, gs_ptr, gz_ptr, base, rows, rmask, x_ptr, grp, gmask, D, GROUPS)
            acc_u += _q4_dot(uq_ptr, us_ptr, uz_ptr, base, rows, rmask, x_ptr, grp, gmask, D, GROUPS)
        w = tl.where(valid, tl.load(w_ptr + j), 0.0)
        tl.store(h_ptr + j * I + rows, triton_act(acc_g, ACT) * acc_u * w, mask=rows < I)

    @triton.jit
    def _down_q4_kernel(h_ptr, ids_ptr, slot_ptr, dq_ptr, ds_ptr, dz_ptr, y_ptr, K, I, D,
                        BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        # _down_kernel over a Q4Stack down (I % 32 == 0)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        n_groups = I // 32
        for j in range(K):
            s = tl.load(slot_ptr + tl.load(ids_ptr + j))
            rmask = rows < tl.where(s >= 0, D, 0)
            base = tl.maximum(s, 0).to(tl.int64) * D * I
            for g0 in range(0, n_groups, GROUPS):
                grp = g0 + tl.arange(0, GROUPS)
                acc += _q4_dot(dq_ptr, ds_ptr, dz_ptr, base, rows, rmask, h_ptr + j * I, grp, grp < n_groups, I,
                               GROUPS)
        tl.store(y_ptr + rows, acc, mask=rows < D)
