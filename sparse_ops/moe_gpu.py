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
"""

from __future__ import annotations

import torch

from hotcold.sparse_ops.gpu import activation

try:  # Triton comes with torch's CUDA builds on Linux; without it the torch version runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["routed_experts", "routed_experts_torch", "triton_available"]

_ACT_CODE = {"silu": 0, "gelu_tanh": 1, "relu": 2}


def triton_available(device) -> bool:
    """Whether routed_experts runs its Triton kernels on this device."""
    return triton is not None and torch.device(device).type == "cuda"


def routed_experts_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                         gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """routed_experts by gathering the k experts' weights (torch only). Returns float32 [D]."""
    f = activation(act)
    s = slot_of[ids].long()  # [k]
    w = torch.where(s >= 0, weights.float(), torch.zeros_like(weights, dtype=torch.float32))  # [k]
    s = s.clamp(min=0)
    xk = x.reshape(1, -1, 1).to(gate.dtype)  # [1, D, 1]
    h = f(torch.matmul(gate[s], xk).float()) * torch.matmul(up[s], xk).float()  # [k, I, 1]
    h = (h * w[:, None, None]).to(down.dtype)
    return torch.matmul(down[s], h).float().sum(0).reshape(-1)  # [D]


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
                   gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One token's routed fast-tier experts (see the module docstring). x: [D]; ids: int [k];
    weights: [k]; slot_of: int32 [E]; gate, up: [G, I, D]; down: [G, D, I] -> float32 [D]."""
    if act not in _ACT_CODE:
        raise ValueError(f"act must be one of {tuple(_ACT_CODE)}, got {act!r}")
    if not triton_available(x.device) or gate.shape[0] == 0 or not all(
            t.is_contiguous() for t in (gate, up, down, slot_of)):  # the kernels index contiguous stacks
        return routed_experts_torch(x, ids, weights, slot_of, gate, up, down, act)
    G, I, D = gate.shape
    k = ids.numel()
    x = x.reshape(-1).contiguous()
    ids = ids.reshape(-1).contiguous()
    weights = weights.reshape(-1).float().contiguous()
    h = torch.empty((k, I), dtype=torch.float32, device=x.device)
    y = torch.empty(D, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(k, triton.cdiv(I, _GU_ROWS))](
        x, ids, weights, slot_of, gate, up, h, I, D, ACT=_ACT_CODE[act], BLOCK_N=_GU_ROWS, BLOCK_K=_GU_COLS)
    _down_kernel[(triton.cdiv(D, _DOWN_ROWS),)](
        h, ids, slot_of, down, y, k, I, D, BLOCK_N=_DOWN_ROWS, BLOCK_K=_DOWN_COLS)
    return y


# Tile sizes: rows of a weight matrix per program x columns per step. A decode GEMV is bound by
# memory, so the grid must cover every SM: k * I/32 programs for gate/up (8 * 24 for Qwen3-30B-A3B),
# D/16 for down (128), each streaming 8-16 KB tiles.
_GU_ROWS, _GU_COLS = 32, 128
_DOWN_ROWS, _DOWN_COLS = 16, 256

if triton is not None:

    @triton.jit
    def _act(z, ACT: tl.constexpr):
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
        rmask = (rows < I) & valid
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
        tl.store(h_ptr + j * I + rows, _act(acc_g, ACT) * acc_u * w, mask=rows < I)

    @triton.jit
    def _down_kernel(h_ptr, ids_ptr, slot_ptr, down_ptr, y_ptr, K, I, D,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program b: y[rows] = sum_j down[s_j, rows] @ h[j], rows the b-th BLOCK_N of D
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rmask = rows < D
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(K):
            s = tl.load(slot_ptr + tl.load(ids_ptr + j))
            valid = s >= 0
            base = tl.maximum(s, 0).to(tl.int64) * D * I
            for k0 in range(0, I, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cmask = cols < I
                hv = tl.load(h_ptr + j * I + cols, mask=cmask, other=0.0)
                m = (rmask[:, None] & cmask[None, :]) & valid
                w = tl.load(down_ptr + base + rows[:, None].to(tl.int64) * I + cols[None, :], mask=m, other=0.0)
                acc += tl.sum(w.to(tl.float32) * hv[None, :], axis=1)
        tl.store(y_ptr + rows, acc, mask=rmask)
