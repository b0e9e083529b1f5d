"""llama.cpp's layer offload under a VRAM budget, from a GGUF's layout (gguf's reader)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from benchlib.common import fmt_bytes

# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the routed experts' tensors, searched in tensor names.
LLAMA_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass
class GgufLayout:
    """What llama.cpp's layer offload moves to the GPU, from a GGUF's tensor table."""

    n_layer: int
    layer_bytes: list[int]  # weights of blk.i.*
    output_bytes: int  # output.weight (the tied token_embd copy when absent) + output_norm
    kv_bytes_per_token: list[int]  # per layer, K + V in f16 (llama.cpp's default cache type)
    expert_bytes: list[int] = field(default_factory=list)  # per layer, routed experts (part of layer_bytes)

    @property
    def moe(self) -> bool:
        return any(self.expert_bytes)


def llama_gpu_layers(layout: GgufLayout, n_ctx: int, budget: int) -> int:
    """Largest n_gpu_layers whose weights + KV cache fit in budget bytes.

    llama.cpp offloads the last n_gpu_layers repeating layers, with their KV cache; a value of
    n_layer + 1 also moves the output layer. Compute buffers and the CUDA context come on top.
    """
    best = 0
    for ngl in range(1, layout.n_layer + 2):
        layers = range(layout.n_layer - min(ngl, layout.n_layer), layout.n_layer)
        cost = sum(layout.layer_bytes[i] + layout.kv_bytes_per_token[i] * n_ctx for i in layers)
        if ngl > layout.n_layer:
            cost += layout.output_bytes
        if cost > budget:
            break
        best = ngl
    return best


def llama_cpu_moe_layers(layout: GgufLayout, n_ctx: int, budget: int) -> int | None:
    """Smallest N for llama.cpp's `-ngl all --n-cpu-moe N` that fits in budget bytes; None if even N = n_layer
    does not.

    Everything goes to the GPU (every layer's attention, router and shared weights, the output layer, the
    KV cache for n_ctx) except the routed experts of the first N layers, which stay in host memory and are
    computed by the CPU. Compute buffers and the CUDA context come on top.
    """
    experts = layout.expert_bytes or [0] * layout.n_layer
    rest = (sum(layout.layer_bytes) - sum(experts) + layout.output_bytes
            + sum(layout.kv_bytes_per_token) * n_ctx)
    for n in range(layout.n_layer + 1):
        if rest + sum(experts[n:]) <= budget:
            return n
    return None


def llama_cpu_moe_patterns(n: int) -> list[str]:
    """The tensor-name regexes llama.cpp's `--n-cpu-moe N` installs: the routed experts of layers 0..N-1."""
    return [rf"blk\.{i}{LLAMA_EXPS_REGEX}" for i in range(n)]


@dataclass
class LlamaOffload:
    """How llama.cpp is split between the GPU and the CPU, and the note that says why."""

    n_gpu_layers: int
    n_cpu_moe: int | None  # routed experts of the first N layers on the CPU; None: not an expert split
    note: str


def llama_offload(layout: GgufLayout, n_ctx: int, vram_bytes: int | None, reserve: int,
                  moe_offload: str = "experts") -> LlamaOffload:
    """llama.cpp's placement on a GPU under --vram: for an MoE model (moe_offload "experts") all layers with
    the routed experts of the first N layers on the CPU, like llama.cpp users run it (`-ngl 99 --n-cpu-moe N`);
    ("all") every layer's routed experts on the CPU (`--cpu-moe`, whatever the budget); otherwise, or when
    even every layer's experts on the CPU leave too much, the most whole layers that fit."""
    all_layers = layout.n_layer + 1
    if not vram_bytes:
        return LlamaOffload(all_layers, 0 if layout.moe else None,
                            f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer)")
    budget = max(0, vram_bytes - reserve)
    room = (f"{fmt_bytes(vram_bytes)} less {fmt_bytes(reserve)} for its CUDA context and compute buffers "
            "(hotcold's planner keeps the same out of the budget)")
    prefix = ""
    if layout.moe and moe_offload == "all":
        return LlamaOffload(all_layers, layout.n_layer, (
            f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer) with every layer's routed "
            f"experts on the CPU (--cpu-moe; --llama-moe-offload all)"))
    if layout.moe and moe_offload == "experts":
        n = llama_cpu_moe_layers(layout, n_ctx, budget)
        if n is not None:
            return LlamaOffload(all_layers, n, (
                f"llama.cpp n_gpu_layers={all_layers} of {layout.n_layer} (+1 = output layer) with the routed "
                f"experts of the first {n} layers on the CPU (--n-cpu-moe {n}), the fewest for which the rest "
                f"(attention, routers, output layer, KV cache, the other layers' experts) fits in {room}"))
        prefix = "(MoE, but even with every layer's routed experts on the CPU the rest does not fit: whole layers) "
    elif layout.moe:
        prefix = "(MoE, --llama-moe-offload layers: whole layers) "
    ngl = llama_gpu_layers(layout, n_ctx, budget)
    return LlamaOffload(ngl, None, f"llama.cpp {prefix}n_gpu_layers={ngl} of {layout.n_layer} (+1 = output layer), "
                                   f"the most whose weights + KV fit in {room}")


def gpu_reserve_bytes() -> int:
    """What hotcold's planner keeps out of a --vram budget besides weights and KV cache when it has no
    measured figure (workspace + CUDA context): the peer gets the same room for its own."""
    from hotcold.planner.costs import Constants

    c = Constants()
    return c.workspace_bytes + c.cuda_context_bytes


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except AttributeError:  # older gguf: no contents()
        vals = [f.parts[i].tolist() for i in f.data]
        vals = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in vals]
        return vals[0] if len(vals) == 1 else vals


def read_gguf_layout(path: Path) -> GgufLayout:
    """Per-layer weight bytes (and routed-expert bytes) and KV bytes per token from a GGUF's header (no weights
    read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    n_layer = int(_field(reader, f"{arch}.block_count"))
    layer_bytes, expert_bytes = [0] * n_layer, [0] * n_layer
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        sizes[t.name] = int(t.n_bytes)
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += int(t.n_bytes)
            if re.search(LLAMA_EXPS_REGEX, t.name):
                expert_bytes[int(m.group(1))] += int(t.n_bytes)
    output_bytes = sizes.get("output.weight", sizes.get("token_embd.weight", 0)) + sizes.get("output_norm.weight", 0)
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head = max(n_head) if isinstance(n_head, list) else int(n_head)
    kv = _field(reader, f"{arch}.attention.head_count_kv", n_head)
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * n_layer
    k_len = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    v_len = int(_field(reader, f"{arch}.attention.value_length", hidden // n_head))
    return GgufLayout(n_layer, layer_bytes, output_bytes, [int(h) * (k_len + v_len) * 2 for h in kv], expert_bytes)
