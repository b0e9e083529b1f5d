"""HostBlock: a block whose attention and FFN predictor the plan both puts on the CPU, decoding one
token with one crossing down and the FFN's inputs computed where its cold rows are.

Block by block, such a layer sends its activations across PCIe six times a token and returns to the
fast tier between the CPU's parts (attention norm on the GPU, its input down, attention, output up,
residual and FFN norm on the GPU, the FFN input down to the predictor, the mask up, the FFN input
and the cold mask down again for the cold rows, their sum up). HostBlock keeps the layer's
residual stream on the host for the step instead:

  host   x ─ attn_norm ─ attention ─ + x = res ─ ffn_norm = f ─ predictor = mask ─ cold rows(f, mask) ─┐
  fast          (x down once)                       └ f, mask[:H], res up ─ hot rows(f, mask) ─ + ─ + res = out

so the CPU's work runs back to back, the fast tier's hot rows run beside the cold ones, and the
crossings are x down, (f, res) and the hot mask up, and the cold sum up. Prefill (several tokens),
and blocks this does not fit (post-norm blocks, a predictor on the fast tier, MoE layers), run as
the Block does. The host copies of the norms are the block's own, moved to the CPU (a few KB).

Where layer_node_ready admits the block (RMSNorm blocks: Llama, Mistral, Qwen2/3, Gemma 3), the
host's whole share is one compiled call instead (executors/layer_node.py, LayerHostNode: attention,
predictor and cold rows, so f, res and the cold sum come up together after it): on the worker, or on
CUDA with graphs and statistics off as a host node of the layer's own graph (one replay a step, no
host wait). On a CPU fast tier the same call serves every such block of a hybrid run whose attention
is a plain Attention there (cpu_block_ready): its step in one call instead of ~40 torch and numba calls.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from hotcold.executors.cpu_executor import ColdJob
from hotcold.executors.gpu_executor import LearnedMask
from hotcold.executors.host_attention import HostAttention, host_positions
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.layer_node import LayerHostNode, layer_function, layer_node_ready, node_variant
from hotcold.executors.stats import now
from hotcold.executors.wrapper import BlockWrapper
from hotcold.models.layers import Attention
from hotcold.models.transformer import Block, kv_dtype


def host_block_ready(block: nn.Module) -> bool:
    """Whether `block` can decode as a HostBlock: a pre-norm Block whose attention is a HostAttention
    and whose FFN is a HybridFFN predicting on the CPU (a LearnedMask placed there) or not at all."""
    if not isinstance(block, Block) or not block.pre_norm:
        return False
    ffn = block.ffn
    if not isinstance(block.attn, HostAttention) or not isinstance(ffn, HybridFFN):
        return False
    m = ffn.gpu.mask_fn
    return m is None or isinstance(m, LearnedMask) and m.device.type == "cpu"


def cpu_block_ready(block: nn.Module) -> bool:
    """Whether `block` runs wholly on a CPU fast tier (its Attention and HybridFFN there, the predictor
    a host one or none) and can step as one compiled call (layer_node_ready): a HostBlock that only
    takes that path (its other steps are the block's own)."""
    if not isinstance(block, Block) or not block.pre_norm or type(block.attn) is not Attention:
        return False
    ffn = block.ffn
    if not isinstance(ffn, HybridFFN) or ffn.tier.cuda:
        return False
    m = ffn.gpu.mask_fn
    return (m is None or isinstance(m, LearnedMask) and m.device.type == "cpu") and layer_node_ready(block)


class HostBlock(BlockWrapper):
    """A Block (see host_block_ready) whose one-token steps run as the module docstring draws; same
    forward signature as Block; `steps` counts the one-token steps taken this way, `node_steps`
    those of them whose host share ran as one compiled function (node: where layer_node_ready admits
    the block, executors/layer_node.py; False: always the module path)."""

    def __init__(self, block: Block, node: bool = True, graphs: bool = False):
        self.host = host_block_ready(block)  # else a CPU tier's block (cpu_block_ready): the node or the block's own step
        if not (self.host or node and cpu_block_ready(block)):
            raise ValueError("HostBlock needs a pre-norm block with host attention and a CPU or no predictor, "
                             "or one a CPU tier runs whole as a compiled call")
        super().__init__(block)
        dtype = block.attn.dtype if self.host else block.ffn.tier.dtype
        self.use_node = node and layer_node_ready(block)
        if self.host and not self.use_node:  # the module path's norms (_host_half)
            names = ["attn_norm", "ffn_norm"] + (["post_attn_norm"] if block.sandwich else [])
            # the host copies, outside the module tree: the engine's moves leave them alone
            self._norms = {n: copy.deepcopy(getattr(block, n)).to("cpu", dtype) for n in names}
            w = getattr(self._norms["attn_norm"], "weight", None)
            if w is not None:  # compile the norms' one-row kernels now, not in the first token (numba caches them on disk)
                with torch.inference_mode():
                    for norm in self._norms.values():
                        norm(torch.zeros(1, 1, w.shape[-1], dtype=dtype))
        self.steps = self.node_steps = 0
        self._node: LayerHostNode | None = None
        self.graphs = graphs  # on CUDA, a node step is one graph replay (stats off): _graph_step
        self._graph: _Graph | None = None
        if self.use_node:  # compile the function now, not in the first token (numba caches it on disk)
            layer_function(kv_dtype("cpu", dtype), *node_variant(block))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None = None) -> torch.Tensor:
        # x: [B, T, D] on the fast tier
        b = self.block
        if x.shape[0] * x.shape[1] != 1 or cache_kv is None or not (self.use_node or self.host):
            return b(x, positions, cache_kv, start)
        ffn: HybridFFN = b.ffn
        book, tier, H, D = ffn.book, ffn.tier, ffn.gpu.n_hot, x.shape[-1]
        if ffn.first:
            book.resolve()
            book.add("decode", tokens=1, forwards=1)
        if self.use_node:
            if self.graphs and x.is_cuda and not book.enabled:
                return self._graph_step(x, positions, cache_kv)
            return self._node_step(x, int(positions[0]) if start is None else start, cache_kv)
        t0 = now()
        xh = x.to("cpu")  # the one crossing down (it waits for the fast tier's queued work)
        res, f_in, mask = ffn.cpu.call(self._host_half, xh, host_positions(positions, start), cache_kv, start)
        book.add("decode", host_s=now() - t0)
        job = None
        if ffn.cold.n:  # the worker may start on the cold rows while the fast tier's work is queued
            job = ColdJob(ffn.cold, f_in.reshape(1, D).float().numpy(), None if mask is None else mask[0, H:].numpy(),
                          ffn.decode_io.out_np[:1], io=ffn.decode_io)
            if not ffn.cpu.inline:
                ffn.cpu.submit(job)
        g0 = tier.mark()
        up = torch.cat([f_in, res]).to(tier.device, non_blocking=True)  # [2, 1, D]: f and res up together
        y = ffn.gpu.compute(up[0].reshape(1, D), None if mask is None else mask[:, :H].to(tier.device, non_blocking=True))
        book.span("decode", "gpu_s", g0, tier.mark())
        ffn.count_decode(None if mask is None else mask[0, :H])
        if job is not None:
            if ffn.cpu.inline:
                ffn.cpu.submit(job)
            y = ffn._receive(job, y, "decode")  # [1, D]: hot + cold
        h = y.reshape(x.shape).to(x.dtype)
        if b.sandwich:
            h = b.post_ffn_norm(h)
        self.steps += 1
        return up[1:] + h

    def node_for(self, cache_kv) -> LayerHostNode:
        """The block's LayerHostNode over cache_kv's buffers (built again for another cache)."""
        k, v = cache_kv
        n = self._node
        if n is None or n.cache_key != (k.data_ptr(), v.data_ptr(), tuple(k.shape)):
            ffn = self.block.ffn
            self._node = n = LayerHostNode(self.block, cache_kv, ffn.tier.host_empty, ffn.cpu.threads)
        return n

    def _node_step(self, x: torch.Tensor, pos: int, cache_kv) -> torch.Tensor:
        """One token with the host share in one call (LayerHostNode) on the CPU worker: x down, the
        call, [f, res, cold] and the hot mask up, the hot rows, the sum. x: [1, 1, D] on the fast tier."""
        ffn: HybridFFN = self.block.ffn
        book, tier, H, D = ffn.book, ffn.tier, ffn.gpu.n_hot, x.shape[-1]
        node = self.node_for(cache_kv)
        t0, cold0 = now(), node.cold_s
        node.x.copy_(x.reshape(D))  # the one crossing down (it waits for the fast tier's queued work)
        node.pos[0] = pos
        rows = ffn.cpu.call(node)
        t1 = now()
        cold_s = node.cold_s - cold0
        book.add("decode", host_s=t1 - t0 - cold_s, cpu_s=cold_s, rows_cpu=rows)
        g0 = tier.mark()
        up = node.up.to(tier.device, non_blocking=True)  # [3, D] float32: f, res, cold
        hot = None if node.mask is None else node.mask[:H].to(tier.device, non_blocking=True).reshape(1, H)
        y = ffn.gpu.compute(up[0].reshape(1, D).to(x.dtype), hot)  # [1, D]
        book.span("decode", "gpu_s", g0, tier.mark())
        ffn.count_decode(None if node.mask is None else node.mask[:H])
        self.steps += 1
        self.node_steps += 1
        return self._sum(up, y, x)

    def _sum(self, up: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # res + cold + hot (in float32, rounded once), or res + post_ffn_norm(cold + hot) -> x's shape and dtype
        if not self.block.sandwich:
            return (up[1:2] + up[2:3] + y.float()).to(x.dtype).reshape(x.shape)
        h = self.block.post_ffn_norm((up[2:3] + y.float()).to(x.dtype))
        return (up[1:2] + h.float()).to(x.dtype).reshape(x.shape)

    def _graph_step(self, x: torch.Tensor, positions: torch.Tensor, cache_kv) -> torch.Tensor:
        """_node_step as one CUDA graph: x and the position down, the LayerHostNode as a host node,
        [f, res, cold] and the hot mask up, the hot rows, the sum; no host work but the replay (and
        no wait: the next layer's work queues behind it). Returns the graph's static output, valid
        until the next replay (the next block copies it in). x: [1, 1, D] on CUDA."""
        node = self.node_for(cache_kv)
        key = (node.cache_key, x.dtype)
        g = self._graph
        if g is None or g.key != key:
            self._graph = None  # frees the old graph before capturing the new one
            g = self._graph = self._capture(key, node, x, positions)
        else:
            g.x.copy_(x)
            g.positions.copy_(positions)
        g.graph.replay()
        node.check()  # the last completed call (an earlier step's)
        self.steps += 1
        self.node_steps += 1
        return g.out

    def _graph_body(self, node: LayerHostNode, x: torch.Tensor, positions: torch.Tensor, up: torch.Tensor,
                    hot: torch.Tensor | None) -> torch.Tensor:
        # capturable: on the current stream; up [3, D] float32 and hot bool [H] are device buffers
        ffn = self.block.ffn
        H, D = ffn.gpu.n_hot, x.shape[-1]
        node.x.copy_(x.reshape(D).float(), non_blocking=True)
        node.pos.copy_(positions.reshape(1), non_blocking=True)
        node.launch(torch.cuda.current_stream(x.device))
        up.copy_(node.up, non_blocking=True)
        if hot is not None:
            hot.copy_(node.mask[:H], non_blocking=True)
        y = ffn.gpu.compute(up[0].reshape(1, D).to(x.dtype), None if hot is None else hot.reshape(1, H))
        return self._sum(up, y, x)

    def _capture(self, key: tuple, node: LayerHostNode, x: torch.Tensor, positions: torch.Tensor) -> "_Graph":
        from hotcold.executors.graphs import _side_stream

        sx, sp = x.clone(), positions.clone()
        up = torch.empty((3, x.shape[-1]), dtype=torch.float32, device=x.device)
        hot = None if node.mask is None else torch.empty(self.block.ffn.gpu.n_hot, dtype=torch.bool, device=x.device)
        side = _side_stream(x.device)  # warm up outside the capture (it writes this step's key/value, as the replay will)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            self._graph_body(node, sx, sp, up, hot)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._graph_body(node, sx, sp, up, hot)
        return _Graph(key, graph, sx, sp, out, (up, hot))

    def _host_half(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None):
        """On the CPU worker: attention, residual, FFN norm and predictor. x: [1, 1, D] ->
        (res, f_in) [1, 1, D] in x's dtype, mask bool [1, I] hot-first or None."""
        b, n = self.block, self._norms
        attn: HostAttention = b.attn
        h = attn._host(n["attn_norm"](x.to(attn.dtype)), positions, cache_kv, start)  # [1, 1, D]
        if b.sandwich:
            h = n["post_attn_norm"](h)
        res = x + h.to(x.dtype)
        f_in = n["ffn_norm"](res)
        m = b.ffn.gpu.mask_fn
        mask = None if m is None else m._predict(f_in.reshape(1, -1).to(m.device, m.dtype))
        return res, f_in, mask


@dataclass
class _Graph:
    key: tuple
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input [1, 1, D]
    positions: torch.Tensor  # static int64 [1]
    out: torch.Tensor  # static output [1, 1, D]
    keep: tuple  # the device buffers the graph copies into


def host_blocks(model: nn.Module, node: bool = True, graphs: bool = False) -> list[int]:
    """Wrap every block of model.layers that host_block_ready admits (with node, cpu_block_ready
    too) in a HostBlock (node, graphs: see HostBlock); returns their indices."""
    done = []
    for i, block in enumerate(model.layers):
        if host_block_ready(block) or node and cpu_block_ready(block):
            model.layers[i] = HostBlock(block, node, graphs)
            done.append(i)
    return done


__all__ = ["HostBlock", "cpu_block_ready", "host_block_ready", "host_blocks"]
