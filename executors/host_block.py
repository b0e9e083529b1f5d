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
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hotcold.executors.cpu_executor import ColdJob
from hotcold.executors.gpu_executor import LearnedMask
from hotcold.executors.host_attention import HostAttention, host_positions
from hotcold.executors.hybrid import HybridFFN
from hotcold.executors.stats import now
from hotcold.executors.wrapper import BlockWrapper
from hotcold.models.transformer import Block


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


class HostBlock(BlockWrapper):
    """A Block (see host_block_ready) whose one-token steps run as the module docstring draws; same
    forward signature as Block; `steps` counts the one-token steps taken this way."""

    def __init__(self, block: Block):
        if not host_block_ready(block):
            raise ValueError("HostBlock needs a pre-norm block with host attention and a CPU or no predictor")
        super().__init__(block)
        dtype = block.attn.dtype
        names = ["attn_norm", "ffn_norm"] + (["post_attn_norm"] if block.sandwich else [])
        # the host copies, outside the module tree: the engine's moves leave them alone
        self._norms = {n: copy.deepcopy(getattr(block, n)).to("cpu", dtype) for n in names}
        w = getattr(self._norms["attn_norm"], "weight", None)
        if w is not None:  # compile the norms' one-row kernels now, not in the first token (numba caches them on disk)
            with torch.inference_mode():
                for norm in self._norms.values():
                    norm(torch.zeros(1, 1, w.shape[-1], dtype=dtype))
        self.steps = 0

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None = None) -> torch.Tensor:
        # x: [B, T, D] on the fast tier
        b = self.block
        if x.shape[0] * x.shape[1] != 1 or cache_kv is None:
            return b(x, positions, cache_kv, start)
        ffn: HybridFFN = b.ffn
        book, tier, H, D = ffn.book, ffn.tier, ffn.gpu.n_hot, x.shape[-1]
        if ffn.first:
            book.resolve()
            book.add("decode", tokens=1, forwards=1)
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


def host_blocks(model: nn.Module) -> list[int]:
    """Wrap every block of model.layers that host_block_ready admits in a HostBlock; returns their indices."""
    done = []
    for i, block in enumerate(model.layers):
        if host_block_ready(block):
            model.layers[i] = HostBlock(block)
            done.append(i)
    return done


__all__ = ["HostBlock", "host_block_ready", "host_blocks"]
