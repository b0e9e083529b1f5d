"""The dense reference forward shared by every family, and its preallocated KV cache."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hotcold.models.config import Gemma3Config, ModelConfig, OPTConfig
from hotcold.models import cpu_run
from hotcold.models.cpu_step import block_step
from hotcold.models.layers import FFN, Attention, half_gemv, half_gemv_ready, make_ffn, make_norm, project


def kv_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model computing in `dtype` on `device`: the model's on a GPU; on the
    CPU float32 for a float32 model, else float16, half the bytes a decode step reads (the CPU's
    one-token attention kernel reads float16 as fast as float32 per element: 13 layers of a 13B
    shape at position 300 read 160 MB per token in float32). Torch's half-precision attention on
    the CPU is ~10x slower than its float32 one, so several tokens attend in float32 over a copy."""
    if torch.device(device).type != "cpu":
        return dtype
    return torch.float32 if dtype == torch.float32 else torch.float16


class KVCache:
    """Preallocated keys and values per layer: each [B, Hkv, max_len, Dh], on `device` or, for layer l,
    on layer_devices[l] (where that layer's attention runs); dtype per kv_dtype; zero-filled on CUDA."""

    def __init__(self, config: ModelConfig, max_len: int, batch: int = 1, device="cpu", dtype=torch.float32,
                 layer_devices: list | None = None):
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        self.max_len = max_len
        self.layers = []
        for l in range(config.num_layers):
            dev = layer_devices[l] if layer_devices is not None else device
            dt = kv_dtype(dev, dtype)
            alloc = torch.zeros if torch.device(dev).type == "cuda" else torch.empty  # see Attention.forward_static
            self.layers.append((alloc(shape, device=dev, dtype=dt), alloc(shape, device=dev, dtype=dt)))

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


class Block(nn.Module):
    """One decoder layer: attention and a replaceable FFN, with the family's norm placement."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config, layer)
        self.ffn_norm = make_norm(config)
        self.ffn: FFN = make_ffn(config, layer)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.post_attn_norm = make_norm(config)
            self.post_ffn_norm = make_norm(config)
        self.pre_norm = getattr(config, "pre_norm", True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache_kv, start: int | None = None) -> torch.Tensor:
        # x: [B, T, D]
        if x.shape[1] == 1 and x.device.type == "cpu":  # a quantised block's decode step in one numba call
            y = block_step(self, x, positions, cache_kv, start)
            if y is not None:
                return y
        if not self.pre_norm:  # OPT-350m style: norm after the residual add
            x = self.attn_norm(x + self.attn(x, positions, cache_kv, start))
            return self.ffn_norm(x + self.ffn(x))
        h = self.attn(self.attn_norm(x), positions, cache_kv, start)
        if self.sandwich:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.ffn(self.ffn_norm(x))
        if self.sandwich:
            h = self.post_ffn_norm(h)
        return x + h


def _embedding(n: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialised (the loader fills every weight): initialising a meta
    tensor, as the loader builds the model, runs torch's Python reference ops, whose first call
    imports torch._dynamo (~1.4 s of a start-up)."""
    return nn.Embedding(n, dim, _weight=torch.empty(n, dim))


class OneTokenStep(Protocol):
    """What an executor attaches to run a whole one-token step in place of the blocks."""

    def ready(self, tokens: torch.Tensor, cache: "KVCache | None") -> bool:
        """Whether this step (tokens [1, 1]) can be run by it."""

    def __call__(self, tokens: torch.Tensor, start_pos: int, cache: "KVCache") -> torch.Tensor:
        """logits [1, 1, V] float32."""


class Transformer(nn.Module):
    """Decoder-only LM: tokens [B, T] at absolute positions start..start+T-1 -> logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        embed_dim = c.word_embed_proj_dim if isinstance(c, OPTConfig) else c.hidden_size
        self.embed = _embedding(c.vocab_size, embed_dim)
        if isinstance(c, OPTConfig):
            self.embed_positions = _embedding(c.max_position_embeddings + 2, c.hidden_size)
            if embed_dim != c.hidden_size:
                self.project_in = nn.Linear(embed_dim, c.hidden_size, bias=False)
                self.project_out = nn.Linear(c.hidden_size, embed_dim, bias=False)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        if getattr(c, "final_norm", True):
            self.norm = make_norm(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(embed_dim, c.vocab_size, bias=False)
        self.softcap = c.final_logit_softcapping if isinstance(c, Gemma3Config) else None
        self.one_token_step: OneTokenStep | None = None  # an executor's whole one-token step (attach_step)

    def attach_step(self, step: "OneTokenStep | None") -> None:
        """Let an executor run whole one-token steps (executors/graphs.py StepGraph: the step as one
        CUDA graph); forward asks it first for every one-token call. None detaches it."""
        self.one_token_step = step

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # tokens: [B, T] -> x: [B, T, D]
        x = self.embed(tokens)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if hasattr(self, "project_in"):
            x = self.project_in(x)
        if hasattr(self, "embed_positions"):
            x = x + self.embed_positions(positions + 2)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D] -> logits: [B, T, V] fp32
        if hasattr(self, "norm"):
            x = self.norm(x)
        if hasattr(self, "project_out"):
            x = self.project_out(x)
        if not self.config.tie_word_embeddings:
            logits = project(self.lm_head, x, widen=False).float()
        elif hasattr(self.embed, "logits"):  # QuantEmbedding: the tied head multiplies from its blocks
            logits = self.embed.logits(x)
        elif half_gemv_ready(self.embed.weight, x):  # one token, a half-precision table on the CPU
            logits = half_gemv(self.embed.weight, x)
        else:
            logits = (x @ self.embed.weight.T).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(
        self, tokens: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None, last_only: bool = False,
        logits_from: int = 0,
    ) -> torch.Tensor:
        """tokens: [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only; [B, T - logits_from, V] for
        positions logits_from.. only: perplexity scores a window's second half), fp32."""
        T = tokens.shape[1]
        step = self.one_token_step
        if step is not None and T == 1 and step.ready(tokens, cache):
            return step(tokens, start_pos, cache)
        positions = torch.arange(start_pos, start_pos + T, device=tokens.device)
        x = self.embed_tokens(tokens, positions)
        if T == 1 and cpu_run.applies(x, cache):  # runs of fused blocks in one numba call each
            x = cpu_run.run_step(self, x, positions, cache, start_pos)
        else:
            for i, block in enumerate(self.layers):
                x = block(x, positions, cache.layers[i] if cache is not None else None, start_pos)
        if last_only:
            x = x[:, -1:]
        elif logits_from:
            x = x[:, logits_from:]
        return self.head(x)
