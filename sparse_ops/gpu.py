"""GPU-side sparse ops in plain torch (device-agnostic: the same code runs on CPU tensors).

The GPU keeps only its hot neurons, compacted: up/gate rows [H, D] and down transposed [H, D].
A predictor's mask over all N neurons is gathered to the hot ones with `split_mask` /
`split_rows`, and `hot_ffn` computes the masked FFN of the hot part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def hot_ffn(x: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor, act: str,
            gate: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """FFN over the hot (compacted) neurons. x: [T, D] (or [D]); up/gate/down_t: [H, D]; up_bias: [H];
    mask: bool [T, H] (or [H]) or None. h = act(x@gate.T) * (x@up.T) if gate is given (bias ignored)
    else act(x@up.T + up_bias); h is zeroed where mask is False; returns h @ down_t: [T, D]."""
    f = activation(act)
    if gate is not None:
        h = f(F.linear(x, gate)) * F.linear(x, up)  # [T, H]
    else:
        h = f(F.linear(x, up, up_bias))  # [T, H]
    if mask is not None:
        h = h.masked_fill(~mask, 0)  # not h * mask: an inf/nan in a dropped neuron must not leak
    return h @ down_t  # [T, D]


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
