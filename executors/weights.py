"""One FFN's weights split by the plan: hot neurons compacted on the fast tier, cold ones in host memory.

A neuron is one row of W_up (and W_gate) and one column of W_down; both halves keep W_down
transposed so each neuron's weights are rows ([n, D]). Cold rows are `HostMatrix`es in the CPU
storage kind (f32 | bf16 | f16 | i8), contiguous per neuron, for the numba kernels. Conversion goes
in blocks of rows, so building never holds more than one extra block beside the original. A MoE
expert on the CPU is a ColdFFN of all its neurons (`host_expert`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from hotcold.models.layers import DenseFFN, GatedFFN
from hotcold.sparse_ops.cpu import HostMatrix, quantize_i8

CPU_KINDS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i8": None}
BLOCK_ROWS = 2048


@dataclass
class HotFFN:
    """Hot neurons on the fast tier. up/gate/down_t: [H, D]; up_bias: [H] (ungated FFNs)."""

    idx: torch.Tensor  # int64 [H] neuron indices, plan order (hottest first)
    up: torch.Tensor
    gate: torch.Tensor | None
    down_t: torch.Tensor
    up_bias: torch.Tensor | None

    @property
    def n(self) -> int:
        return int(self.idx.numel())

    @property
    def nbytes(self) -> int:
        ts = [self.up, self.gate, self.down_t, self.up_bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class ColdFFN:
    """Cold neurons in host memory. up/gate/down_t: HostMatrix [C, D]; up_bias: float32 [C]."""

    idx: np.ndarray  # int64 [C] neuron indices, ascending
    up: HostMatrix
    gate: HostMatrix | None
    down_t: HostMatrix
    up_bias: np.ndarray | None
    act: str

    @property
    def n(self) -> int:
        return len(self.idx)

    @property
    def mats(self) -> list[HostMatrix]:
        return [m for m in (self.up, self.gate, self.down_t) if m is not None]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats) + (self.up_bias.nbytes if self.up_bias is not None else 0)

    @property
    def neuron_bytes(self) -> int:
        """Weight bytes read per computed neuron."""
        return sum(m.row_bytes() for m in self.mats)


def _host_rows(w: torch.Tensor, rows: torch.Tensor, kind: str) -> HostMatrix:
    """w[rows] as a host matrix of `kind`, converted BLOCK_ROWS rows at a time. w: [N, D] (any device)."""
    blocks = (w.index_select(0, rows[a:a + BLOCK_ROWS]) for a in range(0, len(rows), BLOCK_ROWS))
    return _host_matrix(blocks, len(rows), w.shape[1], kind)


def _host_matrix(parts, n: int, d: int, kind: str) -> HostMatrix:
    """A host matrix [n, D] of `kind` filled from `parts` (tensors [k, D] on any device, n rows in
    all), converting one part at a time so that no second copy of the whole matrix is held."""
    if kind == "i8":
        q, scale = np.empty((n, d), np.int8), np.empty(n, np.float32)
        a = 0
        for w in parts:
            q[a:a + len(w)], scale[a:a + len(w)] = quantize_i8(w)
            a += len(w)
        return HostMatrix(q, "i8", scale)
    with torch.inference_mode(False):
        out = torch.empty((n, d), dtype=CPU_KINDS[kind])
    advise_hugepages(out)  # before the first touch
    a = 0
    for w in parts:
        out[a:a + len(w)] = w.to("cpu", out.dtype)
        a += len(w)
    return HostMatrix.from_torch(out, kind)  # shares out's memory


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under t's memory (call before the memory is first
    touched). A cold neuron's rows are ~10 KB scattered over a large matrix: with 4 KiB pages every
    row crosses pages, where the CPU's prefetchers stop and the TLB misses. Returns whether the
    advice was taken; HOTCOLD_HUGEPAGES=0 turns it off."""
    if not sys.platform.startswith("linux") or os.environ.get("HOTCOLD_HUGEPAGES", "1") == "0":
        return False
    start = t.data_ptr()
    a, b = (start + _HUGE - 1) // _HUGE * _HUGE, (start + t.numel() * t.element_size()) // _HUGE * _HUGE
    if b <= a:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE) == 0


def _device_rows(w: torch.Tensor, rows: torch.Tensor, device, dtype) -> torch.Tensor:
    """w[rows] on device in dtype, [K, D]."""
    with torch.inference_mode(False):
        out = torch.empty((len(rows), w.shape[1]), dtype=dtype, device=device)
    for a in range(0, len(rows), BLOCK_ROWS):
        out[a:a + BLOCK_ROWS] = w.index_select(0, rows[a:a + BLOCK_ROWS]).to(device, dtype)
    return out


def check_hot(hot_idx, n: int) -> torch.Tensor:
    """Validate a plan's neuron index list: int64 [H], unique, in [0, n)."""
    idx = torch.as_tensor(hot_idx, dtype=torch.int64).flatten().cpu()
    if idx.numel() and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"hot neuron index out of range [0, {n})")
    if idx.unique().numel() != idx.numel():
        raise ValueError("hot neuron indices repeat")
    return idx


@torch.no_grad()
def split_ffn(ffn: DenseFFN | GatedFFN, hot_idx, act: str, device, dtype,
              cpu_kind: str = "bf16") -> tuple[HotFFN, ColdFFN, torch.Tensor | None]:
    """Split an FFN into (hot part on device, cold part in host memory, down bias on device or None).

    The caller drops `ffn` afterwards; the returned parts share no memory with it (except a cold
    f32 part of an f32 CPU model, which is a fresh compacted copy too)."""
    if cpu_kind not in CPU_KINDS:
        raise ValueError(f"cpu_dtype must be one of {tuple(CPU_KINDS)}, got {cpu_kind!r}")
    up = ffn.up.weight  # [I, D]
    n = up.shape[0]
    hot = check_hot(hot_idx, n)
    is_hot = torch.zeros(n, dtype=torch.bool)
    is_hot[hot] = True
    cold = torch.nonzero(~is_hot).flatten()
    gated = isinstance(ffn, GatedFFN)
    mats = {"up": up, "gate": ffn.gate.weight if gated else None, "down_t": ffn.down.weight.t()}  # each [I, D]
    src_dev = up.device
    hot_d, cold_d = hot.to(src_dev), cold.to(src_dev)
    hot_part = HotFFN(
        idx=hot.to(device),
        **{k: None if w is None else _device_rows(w, hot_d, device, dtype) for k, w in mats.items()},
        up_bias=None if gated else ffn.up.bias[hot_d].to(device, dtype),
    )
    cold_part = ColdFFN(
        idx=cold.numpy().astype(np.int64),
        **{k: None if w is None else _host_rows(w, cold_d, cpu_kind) for k, w in mats.items()},
        up_bias=None if gated else ffn.up.bias[cold_d].float().cpu().numpy().copy(),
        act=act,
    )
    down_bias = None if gated else ffn.down.bias.to(device, dtype).clone()
    return hot_part, cold_part, down_bias


@torch.no_grad()
def host_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ids: list[int], act: str,
                 cpu_kind: str) -> ColdFFN:
    """MoE experts `ids` stacked in host memory, expert p's neurons at rows [p*I, (p+1)*I) of each
    matrix, so one kernel call computes several experts. gate, up: [E, I, D]; down: [E, D, I]."""
    if cpu_kind not in CPU_KINDS:
        raise ValueError(f"cpu_dtype must be one of {tuple(CPU_KINDS)}, got {cpu_kind!r}")
    n, d = len(ids) * up.shape[1], up.shape[2]
    mats = {k: _host_matrix((w(e) for e in ids), n, d, cpu_kind)
            for k, w in (("gate", lambda e: gate[e]), ("up", lambda e: up[e]), ("down_t", lambda e: down[e].t()))}
    return ColdFFN(idx=np.arange(n, dtype=np.int64), up_bias=None, act=act, **mats)
