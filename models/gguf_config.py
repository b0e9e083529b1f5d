"""GGUF metadata translated into a Hugging Face `config.json`-style dict (`hf_config_from_metadata`),
with the rope scaling llama.cpp keeps as a tensor recovered (`llama3_rope_scaling`); the file itself is
read by models/gguf_loader.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hotcold.errors import ModelFileError, UnsupportedModelError

# GGUF general.architecture -> HF model_type (llama with experts becomes "mixtral").
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

def one_line(text: Any) -> str:
    """Collapse any whitespace (newlines included) so a message stays on one line."""
    return " ".join(str(text).split())


def _uniform(value: Any, key: str, source: str) -> Any:
    """A per-layer list whose entries are all equal -> that entry; a scalar -> itself."""
    if not isinstance(value, list):
        return value
    if value and all(v == value[0] for v in value):
        return value[0]
    raise UnsupportedModelError(
        f"{source}: metadata {key} varies per layer ({one_line(value[:8])}...); "
        "hotcold needs the same value for every layer"
    )


class Meta:
    """Reads `{arch}.*` keys of a metadata dict, raising a one-line error when one is missing."""

    def __init__(self, metadata: dict[str, Any], arch: str, source: str):
        self.md, self.arch, self.source = metadata, arch, source

    def get(self, key: str, default: Any = None) -> Any:
        full = f"{self.arch}.{key}"
        value = self.md.get(full, default)
        return default if value is None else _uniform(value, full, self.source)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(
                f"{self.source}: metadata key {self.arch}.{key} is missing; "
                "the file is incomplete or came from an unsupported converter, re-convert it"
            )
        return value


def llama3_rope_scaling(
    freq_factors: np.ndarray, rope_theta: float, head_dim: int, original_context: int = 8192
) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's `rope_freqs` tensor.

    freq_factors: [Dh/2], the divisor llama.cpp applies to each rotary frequency:
    1 for short wavelengths, `factor` for long ones and a blend in between, where
    smooth = (original_context / wavelength - low) / (high - low) and
    divisor = 1 / ((1 - smooth) / factor + smooth). The blend is linear in
    1 / wavelength, so a line fit through the blended entries gives low and high
    (Meta's 1 and 4 when fewer than two entries are blended). Returns None when no
    frequency is scaled; raises UnsupportedModelError when the factors do not
    follow the llama3 rule.
    """
    f = np.asarray(freq_factors, dtype=np.float64)  # [Dh/2]
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [Dh/2]
    x = original_context * inv_freq / (2 * math.pi)  # original_context / wavelength
    blended = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    low, high = 1.0, 4.0
    if blended.sum() >= 2:
        smooth = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[blended], smooth, 1)
        low = round(float(-intercept / slope), 4)
        high = round(float(low + 1 / slope), 4)
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original_context),
    }
    if f.shape != inv_freq.shape or not np.allclose(_llama3_divisors(scaling, inv_freq), f, rtol=1e-3):
        raise UnsupportedModelError(
            "tensor rope_freqs.weight does not follow the llama3 rope-scaling rule; "
            "this rope scaling is not supported"
        )
    return scaling


def _llama3_divisors(scaling: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    """Per-frequency divisors [Dh/2] implied by HF llama3 rope_scaling (HF's formula)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (ctx / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, blend))


def _rope_scaling(
    meta: Meta, head_dim: int, rope_theta: float, rope_freqs: np.ndarray | None
) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` keys or a llama3 `rope_freqs` tensor."""
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    original = meta.get("rope.scaling.original_context_length")
    legacy_linear = meta.get("rope.scale_linear")  # pre-2024 files
    if kind is None and legacy_linear not in (None, 1.0):
        kind, factor = "linear", legacy_linear
    if kind == "linear" and factor not in (None, 1.0):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if kind not in (None, "none", "linear"):
        raise UnsupportedModelError(
            f"{meta.source}: rope scaling type {kind!r} ({meta.arch}.rope.scaling.type) "
            "is not supported; use a model without it"
        )
    if rope_freqs is not None:
        try:
            return llama3_rope_scaling(rope_freqs, rope_theta, head_dim, original or 8192)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{meta.source}: {e}") from None
    return None


def _dim(tensor_shapes: dict[str, tuple[int, ...]], name: str, axis: int) -> int | None:
    """Size of `axis` of a tensor's [out, in]-order shape, or None when it is absent."""
    shape = tensor_shapes.get(name)
    return None if shape is None else int(shape[axis])


def hf_config_from_metadata(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
    source: str = "model.gguf",
) -> dict[str, Any]:
    """Translate GGUF metadata into an HF config.json-style dict.

    tensor_shapes: GGUF tensor name -> shape in PyTorch order (e.g. token_embd [V, D]);
    used for tie_word_embeddings, attention biases and sizes missing from metadata.
    rope_freqs: llama.cpp's `rope_freqs.weight` values [Dh/2] when the file has them.
    """
    arch = metadata.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: general.architecture {arch!r} is not supported; "
            f"hotcold reads GGUF models of: {', '.join(sorted(MODEL_TYPES))}"
        )
    meta = Meta(metadata, arch, source)
    n_experts = int(meta.get("expert_count", 0))
    model_type = "mixtral" if arch == "llama" and n_experts > 0 else MODEL_TYPES[arch]

    hidden = int(meta.need("embedding_length"))
    n_layers = int(meta.need("block_count"))
    n_heads = int(meta.need("attention.head_count"))
    n_kv_heads = int(meta.get("attention.head_count_kv", n_heads))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    expert_ffn = meta.get("expert_feed_forward_length") or _dim(tensor_shapes, "blk.0.ffn_gate_exps.weight", 1)
    ffn = meta.get("feed_forward_length") or expert_ffn
    if ffn is None:
        meta.need("feed_forward_length")
    vocab = meta.get("vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else _dim(tensor_shapes, "token_embd.weight", 0)
        if vocab is None:
            meta.need("vocab_size")
    rope_theta = float(meta.get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10_000.0))

    cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [HF_ARCHITECTURES[model_type]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(meta, head_dim, rope_theta, rope_freqs),
        "max_position_embeddings": int(meta.need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "sliding_window": meta.get("attention.sliding_window"),
    }
    if arch == "gemma3":
        cfg.update(_gemma3_fields(meta, n_layers, hidden, n_heads, head_dim))
    else:
        # Generated benchmark models (tools/make_model.py) are ReLU-fied llamas; llama.cpp ignores this key.
        cfg["hidden_act"] = metadata.get("hotcold.hidden_act", "silu")
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe"):
        cfg["use_sliding_window"] = False
        cfg["max_window_layers"] = n_layers
    if model_type == "mixtral":
        cfg["num_local_experts"] = n_experts
        cfg["num_experts_per_tok"] = int(meta.need("expert_used_count"))
    if arch in ("qwen2moe", "qwen3moe"):
        cfg.update(_qwen_moe_fields(meta, arch, n_experts, expert_ffn, tensor_shapes))
    return cfg


def _gemma3_fields(meta: Meta, n_layers: int, hidden: int, n_heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma-3-only config fields (interleaved sliding/full attention)."""
    pattern = meta.md.get(f"{meta.arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one bool per layer, True = sliding
        layer_types = ["sliding_attention" if s else "full_attention" for s in pattern]
        pattern = next((i + 1 for i, s in enumerate(pattern) if not s), len(pattern))
    else:  # every `pattern`-th layer is global
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
        ]
    # Queries are scaled by 1/sqrt(head_dim), except Gemma 3 27B (62 layers) which uses
    # hidden/heads (HF query_pre_attn_scalar 168); llama.cpp makes the same exception.
    scalar = hidden // n_heads if n_layers == 62 else head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": float(meta.get("rope.freq_base_swa", 10_000.0)),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "attention_bias": False,
    }


def _qwen_moe_fields(
    meta: Meta, arch: str, n_experts: int, expert_ffn: int | None, tensor_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE config fields (every layer sparse)."""
    if n_experts <= 0:
        meta.need("expert_count")
    fields: dict[str, Any] = {
        "num_experts": n_experts,
        "num_local_experts": n_experts,
        "num_experts_per_tok": int(meta.need("expert_used_count")),
        "moe_intermediate_size": int(expert_ffn if expert_ffn is not None else meta.need("expert_feed_forward_length")),
        "norm_topk_prob": arch == "qwen3moe",  # llama.cpp renormalises top-k for qwen3moe only
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        shared = meta.get("expert_shared_feed_forward_length") or _dim(tensor_shapes, "blk.0.ffn_up_shexp.weight", 0)
        fields["shared_expert_intermediate_size"] = int(shared) if shared is not None else 0
    return fields


__all__ = ["HF_ARCHITECTURES", "MODEL_TYPES", "Meta", "hf_config_from_metadata", "llama3_rope_scaling", "one_line"]
