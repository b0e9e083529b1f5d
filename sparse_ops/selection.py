"""What the dense (`cpu`) and block (`quant`) kernels share: the activations, the checks of a row
selection, the phase that keeps a one-token FFN's active rows, numba's thread count, and the numpy
helpers that split a selection between the fast tier and the host.

Kept apart from both kernel modules so that neither imports the other's internals.
"""

from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
from numba import njit

ACTS = {"relu": 0, "silu": 1, "gelu_tanh": 2}


@njit(nogil=True, fastmath=True, cache=True)
def activate(z, act):
    # z: float32 scalar; act: 0 relu, 1 silu, 2 gelu_tanh
    if act == 0:
        return z if z > 0 else np.float32(0.0)
    if act == 1:
        if z >= 0:
            return z / (np.float32(1.0) + np.exp(-z))
        e = np.exp(z)
        return z * e / (np.float32(1.0) + e)
    c = np.float32(0.7978845608028654)  # sqrt(2/pi)
    return np.float32(0.5) * z * (np.float32(1.0) + np.tanh(c * (z + np.float32(0.044715) * z * z * z)))


@njit(nogil=True, cache=True)
def rows_in_range(rows, n):
    for j in range(rows.shape[0]):
        if rows[j] < 0 or rows[j] >= n:
            return False
    return True


@njit(nogil=True, fastmath=True, cache=True)
def keep_active(z, rows, bias, use_bias, act):
    # Phase 2 of the one-token FFN kernels: of the selected rows [K] with pre-activations z [K] (+ bias
    # per matrix row when use_bias), the rows whose activation is not exactly 0 and those activations.
    K = rows.shape[0]
    keep = np.empty(K, np.int64)
    h = np.empty(K, np.float32)
    n = 0
    for j in range(K):
        v = z[j] + bias[rows[j]] if use_bias else z[j]
        a = activate(v, act)
        if a != 0.0:
            keep[n] = rows[j]
            h[n] = a
            n += 1
    return keep[:n], h[:n]


def set_threads(n: int) -> None:
    """numba.set_num_threads, clamped to [1, NUMBA_NUM_THREADS]. Thread-local: call it in the thread
    that runs the kernels (a new thread starts with NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def get_threads() -> int:
    """numba's thread count for the calling thread."""
    return numba.get_num_threads()


_pauses: list | None = None  # omp_pause_resource_all of each OpenMP runtime loaded, once resolved


def _openmp_pauses() -> list:
    """omp_pause_resource_all of every OpenMP runtime in the process (Linux: /proc/self/maps). torch
    brings a libgomp of its own beside the system's that numba's omppool links, and which copy
    numba's regions bind to depends on the order of imports; pausing both is harmless."""
    found, pauses = set(), []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                name = os.path.basename(parts[5].strip()) if len(parts) == 6 else ""
                if name.startswith(("libgomp", "libomp", "libiomp")) and ".so" in name:
                    found.add(parts[5].strip())
    except OSError:
        return []
    for path in sorted(found):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # gone, or a runtime before OpenMP 5.0
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        pauses.append(fn)
    return pauses


def release_threads() -> bool:
    """End the calling thread's numba thread team: its idle OpenMP threads exit, and the thread's
    next parallel call starts a new team (~0.1 ms). libgomp counts every thread's idle team against
    the cores, and once they outnumber the cores the threads of every team stop spinning between
    parallel regions and sleep, so each region pays the kernel's wake-ups. A CUDA run decodes its CPU
    work in the driver's host-function thread (executors/host_node.py); the team a prompt's CPU work
    left in the main thread must go first (2 threads on 2 cores: a 45 µs region took 100 beside it),
    where the spinning team has room (hotcold.machine.spare_cpus_for_spinning).
    Returns whether a team could be released (numba's OpenMP layer, loaded; not inside a region)."""
    global _pauses
    if _pauses is None:
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel region has run in this process: no team anywhere
            return False
        _pauses = _openmp_pauses() if layer == "omp" else []
    return any([pause(1) == 0 for pause in _pauses])  # omp_pause_soft, in every runtime


def as_rows(rows: np.ndarray, n: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # int32 is widened (one small copy)
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    if not rows_in_range(rows, n):
        raise IndexError(f"row index out of range [0, {n})")
    return rows


def batch_input(X: np.ndarray, d: int, act: str) -> np.ndarray:
    """Check a batched FFN call's activation name and tokens X [T, d] (ValueError); X as contiguous float32."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    return X


# ---------------------------------------------------------------------------------------------
# Selection helpers (numpy, for the executor's CPU side)

def mask_to_rows(mask: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """Sorted int64 positions of the set entries of mask [N], or of mask[idx] when idx is given
    (positions into a matrix compacted to the rows idx)."""
    m = np.asarray(mask)
    return np.flatnonzero(m if idx is None else m[idx])


def index_map(idx: np.ndarray, n: int) -> np.ndarray:
    """int32 [n]: position of each neuron in idx, -1 for neurons not in idx."""
    pos = np.full(n, -1, np.int32)
    pos[np.asarray(idx)] = np.arange(len(idx), dtype=np.int32)
    return pos


def split_rows(rows: np.ndarray, hot_map: np.ndarray,
               cold_map: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split selected neurons rows [K] into (hot, cold) with hot_map = index_map(hot_idx, N).

    hot: int64 positions in the GPU-compacted arrays. cold: int64 neuron indices not on the GPU,
    or their positions in a CPU-compacted matrix when cold_map = index_map(cold_idx, N) is given.
    Order follows rows.
    """
    rows = np.asarray(rows, dtype=np.int64)
    hp = hot_map[rows]
    is_hot = hp >= 0
    cold = rows[~is_hot]
    if cold_map is not None:
        cold = cold_map[cold].astype(np.int64)
        if cold.size and cold.min() < 0:
            raise ValueError("a selected neuron is in neither hot_map nor cold_map")
    return hp[is_hot].astype(np.int64), cold
