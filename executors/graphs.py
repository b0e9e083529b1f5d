"""CUDA graphs for one-token decode steps: the attention half of each block, and what else can join it.

Decoding one token in eager PyTorch launches ~100 kernels per layer (norms, projections, rotary,
cache write, attention), each costing the launching thread 5-15 µs: on a Qwen3-30B-A3B-shaped
layer the H200 computed for ~0.25 ms of the 1.7 ms a layer took. `GraphedBlock` wraps a pre-norm
Block and, for one-token steps on CUDA, replays a captured graph of

    x ─ attn_norm ─ attention (cache write at a device-side position) ─ (post_attn_norm) ─ + x = res
    res ─ ffn_norm = f_in

so the layer costs one graph launch and two small copies before its FFN. A hybrid FFN or MoE layer
that offers a split one-token step (`graph_ready()` and four calls, HybridFFN and HybridMoE) has its
device half captured too, in two graphs, so that the CPU's share starts as soon as its input exists
and runs beside the fast tier's:

    graph 1   attention half ─ graph_pre(f_in) = pre (predictor or router; what the host needs)
    eager     graph_send(pre) = ready: pre's host part queued down on the copy stream, its event
    graph 2   graph_fast(f_in, pre) = y (the fast tier's neurons or experts)
    eager     graph_post(f_in, y, pre, ready): waits `ready`, the CPU's share, one copy up, + y

(`split_step` runs the same four calls without graphs, for tests). A MoE layer whose CPU experts
are quantised whole (HybridMoE.host_node_ready) is instead one graph, "host" mode: the CPU experts
are a CUDA host node (executors/host_node.py: a compiled function CUDA's own thread calls, no
Python), so the host does one replay a layer:

    attention half ─ graph_pre ─ D2H packed ─ host node: CPU experts ─ H2D sum ─┐
                              └ (forked stream) graph_fast ─────────────────────── + ─ res + h

With expert deferral (EngineOptions.defer_experts, opt-in), a "host" layer followed by another one
leaves its CPU experts to the next layer's graph ("defer" mode), where they run on a third stream
beside that layer's attention, routing and fast experts, and their sum joins that layer's output:

    layer L     attention half ─ graph_pre ─ graph_fast ───────────────────── + carry of L-1 ─ out_L
    layer L+1   ┌ D2H packed_L ─ host node: L's CPU experts ─ H2D ─────────┐
                └ attention half ─ graph_pre ─ graph_fast ──────────────── + ─ out_L+1

so the GPU no longer idles while the CPU computes a layer's experts. Layer L+1's attention and
routing then see the residual without L's CPU experts (later layers see it whole): KTransformers'
expert deferral, an approximation, unlike every other mode here. The last such layer, prefill and
blocks with sandwich norms are exact.

A HybridFFN with dense_host_nodes on takes the same "host" mode, its cold rows the host node. A dense
or gated FFN wholly on the device (a dense run on the GPU, a layer kept int4 whole), and a split FFN
with no host share (`device_only`: a MoE layer whose experts are all on the GPU) are captured whole
with the attention half (then the whole layer is one graph); other FFNs run eagerly after the
replay. Prefill (several tokens), CPU tiers, blocks whose attention runs on the host (HostAttention)
and post-norm blocks (OPT) run the block as before. A graph belongs to one KV cache (its buffers' addresses are baked
in): a new cache re-captures it, dropping the old one. The graphs of all layers share one memory
pool, replayed in the order they were captured.

Where every block's step is captured whole on the device ("whole"), StepGraph replays the whole
one-token step (all blocks, the head) as one graph, from the second step with a KV cache.

Forward pre-hooks on `ffn_norm` (the expert look-ahead's residual hook) fire while capturing and then
hold the graph's static `res`, which every replay refreshes in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hotcold.executors.step import HostNodeStep, SplitStep, split_step
from hotcold.executors.wrapper import BlockWrapper
from hotcold.models.layers import Attention, DenseFFN, GatedFFN
from hotcold.models.transformer import Block


@dataclass
class _Captured:
    key: tuple
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input [B, 1, D]
    positions: torch.Tensor  # static int64 [1]
    res: torch.Tensor  # static outputs: the residual after attention, and the FFN's input
    f_in: torch.Tensor
    pre: tuple | None = None  # static outputs of the FFN's graph_pre (None: the FFN runs eagerly)
    h: torch.Tensor | None = None  # static output of a device FFN captured whole
    fast: torch.cuda.CUDAGraph | None = None  # the second graph of a split FFN: graph_fast
    y: torch.Tensor | None = None  # its static output
    out: torch.Tensor | None = None  # the block's output when the whole step is one graph ("host")
    carry: "GraphedBlock | None" = None  # the previous block, whose deferred CPU experts this graph runs
    carry_src: "_Captured | None" = None  # that block's capture whose packed input this graph reads


class GraphedBlock(BlockWrapper):
    """A Block whose one-token steps on CUDA replay a graph of the attention half and, where the FFN
    offers one, of its device half (see the module docstring); same forward signature as Block.
    `block` keeps the modules (and their names)."""

    def __init__(self, block: Block, pool=None, ffn: bool = True):
        super().__init__(block)
        self.pool = pool  # a graph memory pool shared by the layers (torch.cuda.graph_pool_handle())
        self.ffn_in_graph = ffn  # False: the FFN always runs eagerly after the attention half (to compare)
        self.captured: _Captured | None = None
        self.replays = 0
        self._device_ffn: bool | None = None
        # the neighbouring GraphedBlocks (graph_blocks links them; set past nn.Module's registration,
        # which would make them submodules): expert deferral hands a layer's CPU experts to the next
        object.__setattr__(self, "prev_block", None)
        object.__setattr__(self, "next_block", None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None = None) -> torch.Tensor:
        b = self.block
        if not self.graphable(x, cache_kv):
            return b(x, positions, cache_kv, start)
        split = self.mode(x.shape[0])
        carry = None
        if split == "host":
            carry = self.prev_block if self.prev_block is not None and self.prev_block.defers() else None
            if carry is not None or self.defers():
                split = "defer"
        key = (cache_kv[0].data_ptr(), tuple(cache_kv[0].shape), tuple(x.shape), x.dtype, split)
        c = self.captured
        if c is None or c.key != key or c.carry is not carry or (carry is not None and c.carry_src is not carry.captured):
            self.captured = None  # frees the old graph before capturing the new one
            c = self.captured = self._capture(key, x, positions, cache_kv, split, carry)
        else:
            c.x.copy_(x)
            c.positions.copy_(positions)
        if c.out is not None:  # the whole step in one graph, the CPU experts a host node; its output
            # is the graph's static tensor, which the next block copies in (valid until the next replay)
            c.graph.replay()
            b.ffn.host_step()  # (a deferred node is checked by its own layer's next host_step)
            self.replays += 1
            return c.out
        if c.h is not None:
            c.graph.replay()
            h = c.h
        elif c.pre is None:
            c.graph.replay()
            h = b.ffn(c.f_in)
        else:
            ffn = b.ffn
            g0 = ffn.tier.mark()
            c.graph.replay()
            ready = ffn.graph_send(c.pre)
            c.fast.replay()
            h = ffn.graph_post(c.f_in, c.y, c.pre, ready, marks=(g0, ffn.tier.mark()))
        self.replays += 1
        if b.sandwich:
            h = b.post_ffn_norm(h)
        return c.res + h

    def mode(self, batch: int = 1) -> bool | str:
        """How a one-token step of `batch` sequences is captured: "whole" (the FFN in the graph with the
        attention half), "host" (one graph, the CPU share a host node), True (split graphs) or False
        (the FFN eager); deferral may turn "host" into "defer" (forward)."""
        split = batch == 1 and self.split_ffn()  # the split steps take one token
        if split and self.block.ffn.device_only():
            return "whole"  # its parts in one graph with the attention half
        if split and self.host_ffn():
            return "host"
        if not split and self.device_ffn():
            return "whole"
        return split

    def defers(self) -> bool:
        """Whether this block's one-token step leaves its CPU experts to the next block's graph
        (expert deferral, see the module docstring): its FFN allows it (HostNodeStep.defer_host), both
        blocks step as one graph with a host node, and neither has sandwich norms."""
        nxt, ffn = self.next_block, self.block.ffn
        return bool(nxt is not None and step_kinds(ffn)[1] and ffn.defer_host()
                    and self.block_graphable() and nxt.block_graphable() and not self.block.sandwich
                    and not nxt.block.sandwich and self.mode() == "host" and nxt.mode() == "host")

    def graphable(self, x: torch.Tensor, cache_kv) -> bool:
        return (x.is_cuda and x.shape[1] == 1 and cache_kv is not None and cache_kv[0].is_cuda
                and self.block_graphable())

    def block_graphable(self) -> bool:
        """Whether the block's kind can be graphed at all (pre-norm, attention on the device)."""
        return self.block.pre_norm and isinstance(self.block.attn, Attention)

    def split_ffn(self) -> bool:
        """Whether the FFN's device half joins the graph (see the module docstring)."""
        ffn = self.block.ffn
        return self.ffn_in_graph and step_kinds(ffn)[0] and ffn.graph_ready()

    def host_ffn(self) -> bool:
        """Whether the split FFN's host half can be a host node of the graph (executors/step.py)."""
        return step_kinds(self.block.ffn)[1] and self.block.ffn.host_node_ready()

    def device_ffn(self) -> bool:
        """Whether the FFN is a plain dense/gated one with every weight on the device (captured whole;
        decided at the first step: the FFN does not change once the blocks are wrapped)."""
        if self._device_ffn is None:
            ffn = self.block.ffn
            self._device_ffn = self.ffn_in_graph and isinstance(ffn, (DenseFFN, GatedFFN)) and _on_cuda(ffn)
        return self._device_ffn

    def _attention_half(self, x: torch.Tensor, positions: torch.Tensor, cache_kv) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, 1, D] -> (res, f_in) [B, 1, D]
        b = self.block
        h = b.attn.forward_static(b.attn_norm(x), positions, cache_kv)
        if b.sandwich:
            h = b.post_attn_norm(h)
        res = x + h
        return res, b.ffn_norm(res)

    def _body(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, split: bool | str):
        # what the (first) graph holds: the attention half, then the FFN's graph_pre when split, or
        # the whole FFN ("whole")
        res, f_in = self._attention_half(x, positions, cache_kv)
        if split == "whole":
            ffn = self.block.ffn
            if step_kinds(ffn)[0]:  # device_only: no host share
                return res, f_in, None, ffn.graph_fast(f_in, ffn.graph_pre(f_in)).reshape(f_in.shape)
            return res, f_in, None, ffn(f_in)
        return res, f_in, self.block.ffn.graph_pre(f_in) if split else None, None

    def step_mode(self, cache_kv) -> str | None:
        """How this block's one-token step was last captured for cache_kv: "host" or "whole" (the
        whole step is device work and host nodes, so a larger graph can hold it: StepGraph), another
        mode ("defer" among them: its graph leans on its neighbour's), or None (not captured for this
        cache)."""
        c = self.captured
        if c is None or c.key[0] != cache_kv[0].data_ptr() or c.key[1] != tuple(cache_kv[0].shape):
            return None
        return c.key[-1] if isinstance(c.key[-1], str) else "split" if c.key[-1] else "attention"

    def step_body(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, mode: str) -> torch.Tensor:
        """The block's whole one-token step in capturable ops (mode "host" or "whole", see step_mode),
        for StepGraph's capture. x: [1, 1, D] -> [1, 1, D]."""
        if mode == "host":
            return self._host_body(x, positions, cache_kv)[-1]
        res, _, _, h = self._body(x, positions, cache_kv, "whole")
        if self.block.sandwich:
            h = self.block.post_ffn_norm(h)
        return res + h

    def _host_body(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, defer: bool = False,
                   carry: "GraphedBlock | None" = None) -> tuple:
        # the "host" graph: the attention half, graph_pre, then graph_fast on a forked stream while
        # the main stream copies the packed input down, runs the host node and copies its sum up;
        # joined, added, and the block's output. defer: this block's host node is left to the next
        # block's graph; carry: the previous block's host node runs here, on a third stream from the
        # start, and its sum is added too. -> (res, f_in, pre, y, out) [.., D]
        b, ffn = self.block, self.block.ffn
        main = torch.cuda.current_stream(x.device)
        late = None
        if carry is not None:
            back = _side_stream(x.device, "host")
            back.wait_stream(main)
            with torch.cuda.stream(back):
                late = carry.block.ffn.graph_host(carry.captured.pre)  # [1, D] float32
        res, f_in = self._attention_half(x, positions, cache_kv)
        pre = ffn.graph_pre(f_in)
        side = _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = ffn.graph_fast(f_in, pre)  # [1, D]
        y_cpu = None
        if not defer:
            if late is not None:
                main.wait_stream(back)  # one host node at a time: the CPU runs one team of threads
            y_cpu = ffn.graph_host(pre)  # [1, D] float32
        main.wait_stream(side)
        h = y if y_cpu is None else y.add_(y_cpu)
        if late is not None:
            main.wait_stream(back)
            h = h.add_(late)
        h = h.reshape(f_in.shape)
        if b.sandwich:
            h = b.post_ffn_norm(h)
        return res, f_in, pre, y, res + h

    def _capture(self, key: tuple, x: torch.Tensor, positions: torch.Tensor, cache_kv, split: bool | str,
                 carry: "GraphedBlock | None" = None) -> _Captured:
        sx, sp = x.clone(), positions.clone()
        # warm up on a side stream (lazy initialisations, Triton compilation, must not happen inside
        # the capture); it writes this step's key/value at its position, as the replay will again
        side = _side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        ffn = self.block.ffn
        with torch.cuda.stream(side):
            _, f_in, pre, _ = self._body(sx, sp, cache_kv, split)
            if pre is not None:
                ffn.graph_fast(f_in, pre)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if split in ("host", "defer"):
            ffn.host_node_setup()
            with torch.cuda.graph(graph, pool=self.pool):
                res, f_in, pre, y, out = self._host_body(sx, sp, cache_kv, split == "defer" and self.defers(), carry)
            return _Captured(key, graph, sx, sp, res, f_in, pre, y=y, out=out, carry=carry,
                             carry_src=None if carry is None else carry.captured)
        with torch.cuda.graph(graph, pool=self.pool):
            res, f_in, pre, h = self._body(sx, sp, cache_kv, split)
        c = _Captured(key, graph, sx, sp, res, f_in, pre, h)
        if pre is not None:  # the fast tier's share, in a graph of its own (see the module docstring)
            c.fast = torch.cuda.CUDAGraph()
            with torch.cuda.graph(c.fast, pool=self.pool):
                c.y = ffn.graph_fast(f_in, pre)
        return c


_STEP_KINDS: dict[type, tuple[bool, bool]] = {}


def step_kinds(ffn) -> tuple[bool, bool]:
    """(ffn is a SplitStep, ffn is a HostNodeStep), decided once per class: an isinstance check against a
    runtime-checkable Protocol looks up every method (5-15 µs each on a 2-core EPYC), and a one-token
    step asks several times a block."""
    kinds = _STEP_KINDS.get(type(ffn))
    if kinds is None:
        kinds = _STEP_KINDS[type(ffn)] = (isinstance(ffn, SplitStep), isinstance(ffn, HostNodeStep))
    return kinds


def _on_cuda(module: nn.Module) -> bool:
    """Every weight of module on a CUDA device: parameters, buffers and int4 matrices (`qweight`; a
    host QuantMatrix has no device)."""
    quant = [m.qweight for m in module.modules() if hasattr(m, "qweight")]
    return (all(t.is_cuda for t in (*module.parameters(), *module.buffers()))
            and all(getattr(getattr(q, "device", None), "type", None) == "cuda" for q in quant))


_SIDE: dict[tuple, torch.cuda.Stream] = {}


def _side_stream(device: torch.device, use: str = "fast") -> torch.cuda.Stream:
    """One warm-up (and forked "fast") stream per device for every capture: cuBLAS keeps a workspace
    per stream it ran on (32 MiB on an H200), so a new stream per layer held 0.68 GiB more VRAM on a
    20-layer 13B shape; and one "host" stream for deferred host nodes (copies and the node only)."""
    key = (torch.device(device), use)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device)
    return _SIDE[key]


@dataclass
class _Step:
    key: tuple
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input: the embedded token [1, 1, D]
    positions: torch.Tensor  # static int64 [1]
    out: torch.Tensor  # static output: logits [1, 1, V] float32, or the last block's output (head eager)
    head: bool  # the head is in the graph
    hosts: list  # the FFNs whose CPU experts are host nodes (their host_step runs after each replay)


class StepGraph:
    """A whole one-token decode step as one CUDA graph: every block (each captured whole: "host" or
    "whole", see GraphedBlock.step_mode) and, when its weights are on the device, the final norm and
    head. The embedding runs eagerly (it may be a host table, HostEmbedding) into the graph's static
    input. Removes the per-layer host work between layers (a copy of x and of the positions into each
    block's buffers, one replay and Python per layer: ~1 ms a token on a 6-layer MoE, H200 host).
    Attached by graph_blocks as the model's one-token step (Transformer.attach_step), which
    Transformer.forward calls for one token:
    the first step with a new cache runs block by block (capturing each block, which warms every
    kernel up), the next one captures the whole step, later ones replay it.

    A model wholly on the GPU decodes faster this way (a 16-layer dense bf16 model, about 8% on an
    H200), but a MoE model whose layers' CPU experts are host nodes decodes slower with the whole step
    in one graph (its layers' graphs take about twice as long inside it; the cause is unknown), so
    blocks in "host" mode are held only with host_nodes=True (to compare)."""

    def __init__(self, model: nn.Module, pool=None, host_nodes: bool = False):
        self.model, self.pool = model, pool
        self.modes = ("host", "whole") if host_nodes else ("whole",)  # block steps it may hold
        self.captured: _Step | None = None
        self.refused: tuple | None = None  # the cache key whose captured blocks cannot all join (not asked again)
        self.replays = 0

    def ready(self, tokens: torch.Tensor, cache) -> bool:
        """Whether this one-token step can replay (or capture) the whole-step graph."""
        if tokens.shape != (1, 1) or not tokens.is_cuda or cache is None:
            return False
        key, c = self._key(cache), self.captured
        if c is not None and c.key == key:
            return True
        if self.refused == key:
            return False
        layers = self.model.layers
        if not all(isinstance(b, GraphedBlock) and b.block_graphable() for b in layers):
            self.refused = key
            return False
        modes = [b.step_mode(cache.layers[i]) for i, b in enumerate(layers)]
        if None in modes:  # some block not captured for this cache yet: ask again next step
            return False
        if all(m in self.modes for m in modes):
            return True
        self.refused = key  # a block's mode does not change for a cache: one check, not one a step
        return False

    def __call__(self, tokens: torch.Tensor, start_pos: int, cache) -> torch.Tensor:
        """tokens [1, 1] at start_pos -> logits [1, 1, V] float32 (a fresh tensor)."""
        m, c = self.model, self.captured
        key = self._key(cache)
        if c is None or c.key != key:
            self.captured = None
            positions = torch.full((1,), start_pos, dtype=torch.int64, device=tokens.device)
            c = self.captured = self._capture(key, m.embed_tokens(tokens, positions), positions, cache)
        else:
            c.positions.fill_(start_pos)
            c.x.copy_(m.embed_tokens(tokens, c.positions))
        c.graph.replay()
        for ffn in c.hosts:
            ffn.host_step()
        for b in m.layers:
            b.replays += 1
        self.replays += 1
        return c.out.clone() if c.head else m.head(c.out)

    @staticmethod
    def _key(cache) -> tuple:
        k = cache.layers[0][0]
        return k.data_ptr(), tuple(k.shape), k.dtype

    def _capture(self, key: tuple, x: torch.Tensor, positions: torch.Tensor, cache) -> _Step:
        m = self.model
        modes = [b.step_mode(cache.layers[i]) for i, b in enumerate(m.layers)]
        tied = getattr(m.config, "tie_word_embeddings", False)
        head = all(_on_cuda(mod) for mod in (getattr(m, "norm", None), m.embed if tied else getattr(m, "lm_head", None))
                   if mod is not None)  # (a tied head reads the embedding)
        sx, sp = x.clone(), positions.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            h = sx
            for i, (b, mode) in enumerate(zip(m.layers, modes)):
                h = b.step_body(h, sp, cache.layers[i], mode)
            out = m.head(h) if head else h
        hosts = [b.ffn for b, mode in zip(m.layers, modes) if mode == "host"]
        return _Step(key, graph, sx, sp, out, head, hosts)


def graph_blocks(model: nn.Module, ffn: bool = True, step: bool | str = True) -> list[int]:
    """Wrap every Block of model.layers in a GraphedBlock sharing one graph memory pool (CUDA only;
    blocks that cannot be graphed still run eagerly through the wrapper; ffn=False keeps every FFN
    out of the graphs) and, with step (and ffn), install a StepGraph for whole one-token steps
    (step="host": also over blocks whose CPU experts are host nodes). Returns the wrapped layers."""
    if not torch.cuda.is_available():
        return []
    pool = torch.cuda.graph_pool_handle()
    done = []
    for i, block in enumerate(model.layers):
        if isinstance(block, Block):
            model.layers[i] = GraphedBlock(block, pool, ffn)
            done.append(i)
    for a, b in zip(model.layers, list(model.layers)[1:]):  # neighbours, for expert deferral
        if isinstance(a, GraphedBlock) and isinstance(b, GraphedBlock):
            object.__setattr__(a, "next_block", b)
            object.__setattr__(b, "prev_block", a)
    if step and ffn:
        model.attach_step(StepGraph(model, pool, host_nodes=step == "host"))
    return done


__all__ = ["GraphedBlock", "StepGraph", "graph_blocks", "split_step", "step_kinds"]  # split_step: executors/step.py
