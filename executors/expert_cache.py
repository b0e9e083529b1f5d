"""The GPU expert cache: a fixed fast-tier slice of expert slots, filled ahead of need.

While MoE layer l computes, the look-ahead (layer l+1's router, or the profile's corrected copy of it,
applied to layer l's residual after layer l+1's norm) names the experts layer l+1 will likely pick.
Those that live in host memory are copied, on the copy stream, into free or least-recently-used
slots. At layer l+1, a routed expert found in the cache is computed on the fast tier (its copy is
ordered before the use by an event, never by blocking the host); the others run on the CPU worker.

    layer l:   route ─ look-ahead logits ─ D2H ids ┐            compute ...
    copy stream:                                   └ H2D experts of l+1 → slots
    layer l+1: route ─ cached? ── yes: fast tier (waits on the slot's copy event)
                                 └─ no: CPU worker

Slots hold the host storage as is (fp16/bf16 bits, f32, or int8 with row scales) and are widened to
the compute dtype when used. Quantised host experts (GGUF blocks) are decoded on the host, by the
thread that prefetches, into the compute dtype's storage (see `slot_kind`): the fast tier has no
block kernels. Every key is (layer, expert).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from hotcold.executors.tier import FastTier
from hotcold.executors.weights import ColdFFN
from hotcold.sparse_ops.quant import QuantMatrix, qdequantize

_STORAGE_TORCH = {"f32": torch.float32, "bf16": torch.int16, "f16": torch.int16, "i8": torch.int8}
_BITS_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}
MATS = ("gate", "up", "down_t")


POLICIES = ("lru", "lfu")
_KIND_OF_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def slot_kind(cpu_kind: str, dtype: torch.dtype, quantized: bool) -> str:
    """The storage kind of the cache's slots: the host experts' (cpu_kind), or for quantised host
    experts the compute dtype's (they are decoded when copied)."""
    return _KIND_OF_DTYPE.get(dtype, "f32") if quantized else cpu_kind


class ExpertCache:
    """`slots` experts of `hidden` neurons x `dim` on the fast tier. policy "lru" evicts the least
    recently used expert; "lfu" the least often routed one (counted by `routed`), ties least recent.

    prefetch(key, cold, rows) starts copying an expert's rows of a layer's stacked ColdFFN;
    lookup(key) -> slot or None; weights(slot) -> (gate, up, down_t) [I, D] in the compute dtype,
    ordered after the copy; release(slot) after the compute that reads it has been queued."""

    def __init__(self, tier: FastTier, slots: int, hidden: int, dim: int, kind: str, policy: str = "lru"):
        if slots < 1:
            raise ValueError("an expert cache needs at least one slot")
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.uses: dict = {}  # key -> times routed (every expert of the host, cached or not)
        self.tier, self.kind, self.n_slots, self.hidden, self.dim = tier, kind, slots, hidden, dim
        with torch.inference_mode(False):
            self.store = {m: torch.empty((slots, hidden, dim), dtype=_STORAGE_TORCH[kind], device=tier.device)
                          for m in MATS}
            self.scale = torch.ones((slots, 3, hidden), dtype=torch.float32, device=tier.device)
        self.slot_of: OrderedDict = OrderedDict()  # key -> slot, least recently used first
        self.key_of: list = [None] * slots
        self.ready: list = [None] * slots  # copy-done events
        self.free: list = [None] * slots  # last-use events: a copy into the slot waits for it
        self.pinned: set = set()  # keys needed by the layer being computed: never evicted for a prefetch
        self.copied = 0  # experts copied since the last take_counts()

    @staticmethod
    def slot_bytes(hidden: int, dim: int, kind: str) -> int:
        """Fast-tier bytes of one slot."""
        return 3 * hidden * dim * torch.empty((), dtype=_STORAGE_TORCH[kind]).element_size() + 3 * hidden * 4

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes(self.hidden, self.dim, self.kind)

    def lookup(self, key) -> int | None:
        """The key's slot (and mark it recently used), or None."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
        return slot

    def prefetch(self, key, cold: ColdFFN, rows: np.ndarray) -> bool:
        """Start copying rows [I] of cold's matrices into a slot for key (no-op when cached). Returns
        whether a copy started; False when every slot holds a pinned key."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return False
        slot = self._victim()
        if slot is None:
            return False
        old = self.key_of[slot]
        if old is not None:
            del self.slot_of[old]
        a, b = int(rows[0]), int(rows[-1]) + 1  # an expert's rows are contiguous
        tier = self.tier
        with tier.on_copy_stream():
            if self.free[slot] is not None:
                tier.copy.wait_event(self.free[slot])  # the slot's previous expert is no longer read
            for j, name in enumerate(MATS):
                m = getattr(cold, name)
                if name == "down_t" and cold.down is not None:  # quantised whole experts: W_down [D, I] per expert
                    self.store[name][slot].copy_(self._down_t(cold, a, b), non_blocking=True)
                    continue
                self.store[name][slot].copy_(self._host_rows(m, a, b), non_blocking=True)
                if getattr(m, "scale", None) is not None:
                    self.scale[slot, j].copy_(torch.from_numpy(m.scale[a:b]), non_blocking=True)
            self.ready[slot] = tier.event(tier.copy)
        self.slot_of[key], self.key_of[slot] = slot, key
        self.copied += 1
        return True

    def _down_t(self, cold: ColdFFN, a: int, b: int) -> torch.Tensor:
        """The W_down of the expert whose neurons are rows [a, b) of cold, from cold.down's blocks,
        transposed: [I, D] in the slots' storage (a fresh pageable tensor, as _host_rows)."""
        d, p = cold.up.cols, a // (b - a)
        w = torch.from_numpy(qdequantize(cold.down, np.arange(p * d, (p + 1) * d, dtype=np.int64))).T  # [I, D]
        return self._stored(w.contiguous())

    def _stored(self, w: torch.Tensor) -> torch.Tensor:
        # float32 [I, D] decoded from blocks -> the slots' storage
        if self.kind == "i8":
            raise ValueError("quantised host experts need a float cache kind (see slot_kind)")
        return w.to(_BITS_DTYPE[self.kind]).view(torch.int16) if self.kind in _BITS_DTYPE else w

    def _host_rows(self, m, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of a host matrix in the slots' storage, on the host: a HostMatrix's own memory,
        or a QuantMatrix's rows decoded (a fresh pageable tensor: a copy from pageable memory has
        read its source when it returns)."""
        if isinstance(m, QuantMatrix):
            return self._stored(torch.from_numpy(qdequantize(m, np.arange(a, b, dtype=np.int64))))  # [I, D]
        data = m.data.view(np.int16) if m.data.dtype == np.uint16 else m.data
        return torch.from_numpy(data[a:b])

    def routed(self, key) -> None:
        """Count a routing of key (the LFU policy's frequency)."""
        self.uses[key] = self.uses.get(key, 0) + 1

    def _victim(self) -> int | None:
        for slot in range(self.n_slots):  # an empty slot first
            if self.key_of[slot] is None:
                return slot
        free = [(key, slot) for key, slot in self.slot_of.items() if key not in self.pinned]  # least recent first
        if not free:
            return None
        if self.policy == "lfu":
            return min(free, key=lambda ks: self.uses.get(ks[0], 0))[1]  # min keeps the first of equals
        return free[0][1]

    def weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slot's (gate, up, down_t), each [I, D] in the compute dtype, after its copy."""
        self.tier.wait(self.ready[slot])
        dtype = self.tier.dtype
        out = []
        for j, name in enumerate(MATS):
            raw = self.store[name][slot]
            if self.kind == "i8":
                out.append((raw.float() * self.scale[slot, j, :, None]).to(dtype))
            else:
                out.append((raw.view(_BITS_DTYPE[self.kind]) if self.kind in _BITS_DTYPE else raw).to(dtype))
        return out[0], out[1], out[2]

    def release(self, slot: int) -> None:
        """The compute that reads the slot has been queued: a later copy into it must wait for it."""
        self.free[slot] = self.tier.event()

    def take_copied(self) -> int:
        n, self.copied = self.copied, 0
        return n


__all__ = ["ExpertCache", "slot_kind"]
