"""A MoE layer's weights split for the hybrid engine: the fast tier's experts (FastExperts: stacked
float, or 4-bit Q4Stack for the Triton kernels), the router and shared expert moved to the fast
tier, and the host's experts stacked in one ColdFFN (`split_moe` -> MoEParts)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hotcold.executors.weights import ColdFFN, host_experts, host_quant_experts, mapped_quant_experts
from hotcold.models.layers import MoEFFN, activation_fn
from hotcold.models.quantized import QUANT_MODULES, QuantExperts, dequantize_model, dequantize_module, quant_bytes
from hotcold.sparse_ops.gpu_quant import GROUP_SIZE, INT4_QTYPES
from hotcold.sparse_ops.moe_gpu import Q4Stack
from hotcold.sparse_ops.quant import qdequantize


# experts a chunk's batched products take together where the chunk kernels do not run (no Triton,
# the CPU tier): float stacks are read in place (the padded activations bound the group); 4-bit ones
# are decoded for the group first by torch ops through float32 temporaries (fewer at a time)
FAST_GROUP, FAST_GROUP_INT4 = 16, 4


@dataclass
class FastExperts:
    """The plan's GPU experts, stacked on the fast tier: gate, up [G, I, D]; down [G, D, I], each a
    tensor in the compute dtype or (int4, see split_moe) a Q4Stack of the file's 4-bit codes."""

    ids: list[int]  # expert ids, plan order (slot g holds expert ids[g])
    gate: torch.Tensor | Q4Stack
    up: torch.Tensor | Q4Stack
    down: torch.Tensor | Q4Stack
    act: object  # torch activation function
    act_name: str = "silu"
    slot_of: torch.Tensor | None = None  # int32 [E] on the fast tier: each expert's slot, -1 elsewhere

    def weight(self, which: str, g, dtype: torch.dtype) -> torch.Tensor:
        """Slot g's gate | up [I, D] or down [D, I] (a Q4Stack's dequantised to dtype); g a slice or an
        index tensor: [g, I, D] / [g, D, I]."""
        w = getattr(self, which)
        return w.dequantize(g, dtype) if isinstance(w, Q4Stack) else w[g]

    def expert(self, g: int, x: torch.Tensor) -> torch.Tensor:
        """Slot g's expert, computed as Experts.expert does. x: [n, D] -> [n, D]."""
        gate, up, down = (self.weight(w, g, x.dtype) for w in ("gate", "up", "down"))
        return (self.act(x @ gate.T) * (x @ up.T)) @ down.T

    def group(self) -> int:
        """Experts a group of a chunk's batched products (HybridMoE._grouped_fast)."""
        return FAST_GROUP_INT4 if self.int4 else FAST_GROUP

    @property
    def int4(self) -> tuple[str, ...]:
        """The stacks held as Q4Stack ("gate", "up", "down")."""
        return tuple(w for w in ("gate", "up", "down") if isinstance(getattr(self, w), Q4Stack))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes if isinstance(t, Q4Stack) else t.numel() * t.element_size()
                   for t in (self.gate, self.up, self.down))


def check_experts(ids, n: int) -> list[int]:
    """Validate a plan's GPU expert list: unique ints in [0, n)."""
    out = [int(e) for e in torch.as_tensor(ids, dtype=torch.int64).flatten().tolist()]
    if any(not 0 <= e < n for e in out):
        raise ValueError(f"GPU expert index out of range [0, {n})")
    if len(set(out)) != len(out):
        raise ValueError("GPU expert indices repeat")
    return out


def int4_experts_reason(ex, which: str) -> str | None:
    """Why experts' `which` (gate_up | down) cannot stay 4-bit on the fast tier as a Q4Stack; None if they can."""
    if not isinstance(ex, QuantExperts):
        return "its experts are not quantised"
    mats = (ex.qgate, ex.qup) if which == "gate_up" else (ex.qdown,)
    bad = sorted({m.qtype for m in mats} - set(INT4_QTYPES))
    if bad:
        return f"{which} experts are {'/'.join(bad)}, not a 4-bit type ({', '.join(INT4_QTYPES)})"
    k = ex.dim if which == "gate_up" else ex.hidden
    if k % GROUP_SIZE:
        return f"{which} experts' rows of {k} are not whole groups of {GROUP_SIZE}"
    return None


def _stack(ex, which: str, ids: list[int], device, dtype, int4: bool = False) -> torch.Tensor | Q4Stack:
    """Experts ids' `which` (gate | up: [I, D]; down: [D, I]) stacked on device in dtype, one expert
    at a time (QuantExperts: each expert's blocks decoded; with int4 their 4-bit codes kept as a
    Q4Stack). -> [G, I, D] or [G, D, I]."""
    if int4:
        return Q4Stack.from_quant((ex.matrix(which, e) for e in ids), device)
    quant = isinstance(ex, QuantExperts)
    if quant:
        shape = (ex.dim, ex.hidden) if which == "down" else (ex.hidden, ex.dim)
    else:
        shape = getattr(ex, which).shape[1:]
    with torch.inference_mode(False):
        out = torch.empty((len(ids), *shape), dtype=dtype, device=device)
    for g, e in enumerate(ids):
        w = torch.from_numpy(qdequantize(ex.matrix(which, e))) if quant else getattr(ex, which)[e]
        out[g] = w.to(device, dtype)
    return out


def _to_tier(m: nn.Module | None, device, dtype) -> nn.Module | None:
    """m on device in dtype (in place where it can be). Off the CPU, quantised (sub)modules are
    dequantised; on the CPU they stay in their blocks."""
    if m is None:
        return None
    if torch.device(device).type != "cpu":
        if isinstance(m, QUANT_MODULES):
            m = dequantize_module(m, device, dtype)
        else:
            dequantize_model(m, device, dtype)
    return m.to(device=device, dtype=dtype)


@dataclass
class MoEParts:
    """A MoE layer split by the plan (see split_moe)."""

    router: nn.Linear
    shared: nn.Module | None  # GatedFFN
    shared_gate: nn.Linear | None
    fast: FastExperts
    cold: ColdFFN | None  # the other experts stacked in host memory: expert at position p has rows [p*I, (p+1)*I)
    pos: np.ndarray  # int64 [E]: each expert's position in `cold`, -1 for those on the fast tier
    hidden: int  # I, neurons per expert
    top_k: int
    renormalise: bool

    @property
    def fast_bytes(self) -> int:
        mods = [m for m in (self.router, self.shared, self.shared_gate) if m is not None]
        return self.fast.nbytes + sum(p.numel() * p.element_size() for m in mods for p in m.parameters()) \
            + sum(quant_bytes(m) for m in mods)  # blocks of quantised modules on a CPU tier

    @property
    def host_bytes(self) -> int:
        return self.cold.nbytes if self.cold is not None else 0


@torch.no_grad()
def split_moe(moe: MoEFFN, gpu_experts, act: str, device, dtype, cpu_kind: str = "bf16",
              int4: bool = False, mapped: bool = False) -> MoEParts:
    """Split a MoEFFN: router, shared expert and the GPU experts to device (dtype), the other experts
    to host memory in cpu_kind. Quantised experts (QuantExperts) stay quantised on the host
    (`host_quant_experts`; cpu_kind does not apply) and are dequantised for the fast tier, or with
    int4 kept 4-bit there (Q4Stack) where `int4_experts_reason` allows: gate and up together, down on
    its own. mapped: quantised host experts are read in place from the model file
    (`mapped_quant_experts`: every expert keeps its position, those on the fast tier are never read)
    where its blocks serve as they are. The caller drops `moe` afterwards; the parts share no memory
    with its experts but for mapped ones (router and shared expert are the same modules, moved, or
    their dequantised copies off the CPU)."""
    ex = moe.experts
    quant = isinstance(ex, QuantExperts)
    n_exp, hidden = (ex.n, ex.hidden) if quant else ex.gate.shape[:2]  # gate: [E, I, D]
    on_gpu = check_experts(gpu_experts, n_exp)
    cold_ids = [e for e in range(n_exp) if e not in on_gpu]
    cold = None
    pos = np.full(n_exp, -1, np.int64)
    if cold_ids and quant and mapped:
        cold = mapped_quant_experts(ex, act)  # None where the file's blocks do not serve as they are
    if cold is not None:
        pos[cold_ids] = cold_ids
    elif cold_ids:
        cold = host_quant_experts(ex, cold_ids, act) if quant else \
            host_experts(ex.gate, ex.up, ex.down, cold_ids, act, cpu_kind)
        pos[cold_ids] = np.arange(len(cold_ids))
    slot_of = torch.full((n_exp,), -1, dtype=torch.int32)
    slot_of[on_gpu] = torch.arange(len(on_gpu), dtype=torch.int32)
    q4 = {w: int4 and int4_experts_reason(ex, "down" if w == "down" else "gate_up") is None
          for w in ("gate", "up", "down")}
    fast = FastExperts(on_gpu, *(_stack(ex, w, on_gpu, device, dtype, q4[w]) for w in ("gate", "up", "down")),
                       act=activation_fn(act), act_name=act, slot_of=slot_of.to(device))
    router, shared, shared_gate = (_to_tier(getattr(moe, k, None), device, dtype)
                                   for k in ("router", "shared", "shared_gate"))
    return MoEParts(router, shared, shared_gate, fast, cold, pos, hidden, moe.top_k, moe.renormalise)


__all__ = ["FastExperts", "MoEParts", "check_experts", "int4_experts_reason", "split_moe"]
