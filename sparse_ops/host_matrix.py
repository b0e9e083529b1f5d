"""Host matrices: `HostMatrix` (a row-major [N, D] matrix in host memory, f32 / fp16 / bf16 bits / int8
with a per-row scale, as `cpu`'s kernels read it), its int8 quantiser, huge-page advice for host
tensors and the tiled column gather that builds cold rows of W_down."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch
from numba import njit, prange

KINDS = ("f32", "f16", "bf16", "i8")
_STORAGE = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16, "i8": np.int8}
_FROM_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_TO_DTYPE = {v: k for k, v in _FROM_DTYPE.items()}
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under t's memory (call before the memory is first
    touched). With 4 KiB pages a GEMV streaming a matrix misses the TLB every 4 KiB and the
    prefetchers stop at each page; a cold neuron's ~10 KB rows cross pages. A [15360, 5120] float16
    GEMV read 17.7 GB/s from 4 KiB pages against 24.4 from huge ones on the 2-core Xeon (numpy
    advises its own large arrays; torch does not). Returns whether the advice was taken. Linux has
    the last word: `never` in /sys/kernel/mm/transparent_hugepage/enabled turns huge pages off (loads
    are faster without them while the kernel would compact memory)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = t.data_ptr()
    a, b = (start + _HUGE - 1) // _HUGE * _HUGE, (start + t.numel() * t.element_size()) // _HUGE * _HUGE
    if b <= a:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE) == 0


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor (outside inference mode) with huge pages advised before its first touch."""
    with torch.inference_mode(False):
        t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t)
    return t



_TILE = 128  # columns (and rows) per tile of gather_columns


@njit(parallel=True, nogil=True, cache=True)
def _gather_columns_kernel(src, cols, out):
    # src: [R, C], cols: [K], out: [K, R] = src[:, cols].T; tiles of _TILE columns x _TILE rows, so
    # that the strided reads of a tile's columns stay in cache while its rows are written
    R, K = src.shape[0], cols.shape[0]
    for b in prange((K + _TILE - 1) // _TILE):
        j0, j1 = b * _TILE, min(K, (b + 1) * _TILE)
        for r0 in range(0, R, _TILE):
            r1 = min(R, r0 + _TILE)
            for j in range(j0, j1):
                c = cols[j]
                for r in range(r0, r1):
                    out[j, r] = src[r, c]


def gather_columns(src: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """src[:, cols].T as a new contiguous CPU tensor [K, R] with huge pages advised (host_empty), in
    numba tiles: W_down [D, I] to cold rows [K, D]. torch's copy of a transposed float16 view read
    0.2-0.4 GB/s on the 2-core machine ([4096, 11008]: 206-373 ms), the tiles 1.5 GB/s (60 ms).
    src: contiguous [R, C] on the CPU, any 1-, 2-, 4- or 8-byte dtype; cols: int [K], each in 0..C-1."""
    if src.device.type != "cpu" or src.dim() != 2 or not src.is_contiguous():
        raise ValueError("src must be a contiguous 2-D CPU tensor")
    c = np.ascontiguousarray(cols.cpu().numpy(), dtype=np.int64)
    if c.ndim != 1 or (c.size and (c.min() < 0 or c.max() >= src.shape[1])):
        raise ValueError(f"cols must be a 1-D index into {src.shape[1]} columns")
    out = host_empty((c.size, src.shape[0]), src.dtype)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    if c.size:
        _gather_columns_kernel(src.detach().view(bits).numpy(), c, out.view(bits).numpy())
    return out


def quantize_i8(w: torch.Tensor, block_rows: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8: returns (q int8 [N, D], scale float32 [N]) with w ≈ q * scale[:, None]."""
    w = w.detach().cpu()
    n, d = w.shape
    q = np.empty((n, d), np.int8)
    scale = np.empty(n, np.float32)
    for lo in range(0, n, block_rows):  # bounded temporary memory for big matrices
        b = w[lo:lo + block_rows].float()
        sc = b.abs().amax(dim=1) / 127.0
        inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
        q[lo:lo + block_rows] = (b * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8).numpy()
        scale[lo:lo + block_rows] = sc.numpy()
    return q, scale


class HostMatrix:
    """A row-major [N, D] matrix in host memory, kept for row-gathered access.

    data: float32 [N, D] | uint16 [N, D] holding fp16 or bf16 bits | int8 [N, D]
    kind: "f32" | "f16" | "bf16" | "i8"
    scale: float32 [N] per-row scale, only for "i8" (row ≈ data * scale)
    """

    def __init__(self, data: np.ndarray, kind: str, scale: np.ndarray | None = None):
        if kind not in _STORAGE:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if data.ndim != 2 or data.dtype != _STORAGE[kind] or not data.flags.c_contiguous:
            raise ValueError(f"{kind} data must be a C-contiguous 2-D {np.dtype(_STORAGE[kind])} array, "
                             f"got {data.dtype} {data.shape}")
        if (kind == "i8") != (scale is not None):
            raise ValueError("scale is required for kind 'i8' and only for it")
        if scale is not None and (scale.dtype != np.float32 or scale.shape != (data.shape[0],)):
            raise ValueError(f"scale must be float32 [{data.shape[0]}]")
        self.data, self.kind, self.scale = data, kind, scale
        self._w = data.view(np.int16) if kind == "f16" else data  # kernel dispatch type (see cpu._widen)
        self._s = scale if scale is not None else np.ones(data.shape[0], np.float32)
        self._all_rows: np.ndarray | None = None

    @classmethod
    def from_torch(cls, t: torch.Tensor, kind: str | None = None) -> "HostMatrix":
        """From a 2-D tensor. kind None: from t.dtype; "i8": quantise per row; another kind converts.
        Shares memory with t when t is a contiguous CPU tensor of that dtype."""
        if t.dim() != 2:
            raise ValueError(f"expected a 2-D tensor, got shape {tuple(t.shape)}")
        t = t.detach()
        if kind is None:
            if t.dtype not in _FROM_DTYPE:
                raise ValueError(f"no kind for dtype {t.dtype}; pass kind=")
            kind = _FROM_DTYPE[t.dtype]
        if kind == "i8":
            q, scale = quantize_i8(t)
            return cls(q, "i8", scale)
        if kind not in _TO_DTYPE:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        t = t.to(device="cpu", dtype=_TO_DTYPE[kind]).contiguous()
        data = t.numpy() if kind == "f32" else t.view(torch.uint16).numpy()
        return cls(data, kind)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def row_bytes(self) -> int:
        """Bytes a kernel reads per selected row."""
        return self.data.shape[1] * self.data.itemsize

    def to_torch(self) -> torch.Tensor:
        """Dequantised float32 [N, D] copy (for tests / references)."""
        if self.kind == "f32":
            return torch.from_numpy(self.data.copy())
        if self.kind == "i8":
            return torch.from_numpy(self.data).float() * torch.from_numpy(self.scale)[:, None]
        bits = torch.from_numpy(self.data.view(np.int16))
        return bits.view(_TO_DTYPE[self.kind]).float()

    def __repr__(self) -> str:
        return f"HostMatrix({self.kind}, shape={self.shape}, {self.nbytes / 2**20:.1f} MiB)"
