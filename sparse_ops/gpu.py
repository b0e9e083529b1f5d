"""GPU-side sparse ops in plain torch (device-agnostic: the same code runs on CPU tensors).

The GPU keeps only its hot neurons, compacted: up/gate rows [H, D] and down transposed [H, D]
(or kept int4: `Int4Matrix`, sparse_ops/gpu_quant.py; see hot_ffn). A predictor's mask over all N
neurons is gathered to the hot ones with `split_mask` / `split_rows`, and `hot_ffn` computes the
masked FFN of the hot part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from hotcold.sparse_ops.gpu_quant import Int4Matrix

__all__ = ["ACTIVATIONS", "activation", "compact_rows", "hot_ffn", "mask_to_rows", "index_map",
           "split_mask", "split_rows"]

ACTIVATIONS = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
}


def activation(name: str):
    """The torch function for an activation name: relu | silu | gelu_tanh."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"act must be one of {tuple(ACTIVATIONS)}, got {name!r}") from None


def compact_rows(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """w[rows].contiguous(), on w's device. w: [N, ...], rows: int [K] -> [K, ...]."""
    return w.index_select(0, rows.to(device=w.device, dtype=torch.long)).contiguous()


def hot_ffn(x: torch.Tensor, up: torch.Tensor | Int4Matrix, down_t: torch.Tensor | Int4Matrix, act: str,
            gate: torch.Tensor | Int4Matrix | None = None, up_bias: torch.Tensor | None = None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """FFN over the hot (compacted) neurons. x: [T, D] (or [D]); up/gate/down_t: [H, D]; up_bias: [H];
    mask: bool [T, H] (or [H]) or None. h = act(x@gate.T) * (x@up.T) if gate is given (bias ignored)
    else act(x@up.T + up_bias); h is zeroed where mask is False; returns h @ down_t: [T, D].

    Kept int4 (Int4Matrix): up/gate [H', D] and up_bias [H'], H' >= H counting zero padding neurons
    (h = 0 there, which the mask leaves alone); down_t a tensor [H, D] or an Int4Matrix [D, H']."""
    f = activation(act)
    if gate is not None:
        h = f(_linear(x, gate)) * _linear(x, up)  # [T, H']
    else:
        h = f(_linear(x, up, up_bias))  # [T, H']
    if mask is not None:  # not h * mask: an inf/nan in a dropped neuron must not leak
        h = h.masked_fill(~mask, 0) if mask.shape[-1] == h.shape[-1] else _mask_prefix(h, mask)
    if not isinstance(down_t, torch.Tensor):
        return down_t.mm(h)  # [T, D]
    if h.shape[-1] != down_t.shape[0]:
        h = h[..., : down_t.shape[0]]  # int4 up/gate, down in dtype: the padding neurons dropped
    return h @ down_t  # [T, D]


def _linear(x: torch.Tensor, w: torch.Tensor | Int4Matrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias): w a float tensor or an Int4Matrix [H, D]. x: [..., D] -> [..., H]."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    y = w.mm(x)
    return y if bias is None else y + bias


def _mask_prefix(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """h [..., H'] with its first H columns zeroed where mask [..., H] is False (in place: h is fresh)."""
    h[..., : mask.shape[-1]].masked_fill_(~mask, 0)
    return h


def mask_to_rows(mask: torch.Tensor) -> torch.Tensor:
    """bool [N] -> sorted int32 indices of the True entries (synchronises on CUDA)."""
    if mask.dim() != 1:
        raise ValueError(f"mask must be 1-D, got shape {tuple(mask.shape)}")
    return torch.nonzero(mask).flatten().to(torch.int32)


def index_map(idx: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [n] on idx's device: position of each neuron in idx, -1 for neurons not in idx."""
    pos = torch.full((n,), -1, dtype=torch.int32, device=idx.device)
    pos[idx.long()] = torch.arange(idx.numel(), dtype=torch.int32, device=idx.device)
    return pos


def split_mask(mask: torch.Tensor, hot_idx: torch.Tensor,
               cold_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """mask: bool [..., N] over all neurons -> (mask[..., hot_idx] [..., H], mask[..., cold_idx] or None).
    The hot part is hot_ffn's mask; mask_to_rows of the cold part gives CPU-compacted rows."""
    hot = mask.index_select(-1, hot_idx.long())
    cold = None if cold_idx is None else mask.index_select(-1, cold_idx.long())
    return hot, cold


def split_rows(rows: torch.Tensor, hot_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected neuron indices rows [K] -> (positions of the hot ones in the GPU-compacted arrays,
    neuron indices of the cold ones), with hot_map = index_map(hot_idx, N). Order follows rows;
    both int64. (Boolean indexing: synchronises on CUDA.)"""
    rows = rows.long()
    hp = hot_map[rows].long()
    is_hot = hp >= 0
    return hp[is_hot], rows[~is_hot]
