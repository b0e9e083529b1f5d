"""Model configuration: one dataclass per family, built from an HF config.json dict.

GGUF metadata is first translated into the same dict shape (gguf_loader.GGUFFile.hf_config),
so every family has a single constructor, `from_hf`. The base class holds the fields the
shared forward code reads; each family sets its own behaviour flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hotcold.errors import UnsupportedModelError


@dataclass
class ModelConfig:
    """Fields every family has. Behaviour flags (class vars) say how a family differs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attn_bias: bool = False  # q/k/v projections carry a bias
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    activation: str = "silu"  # FFN activation: "silu", "relu" (ReLU-fied models), "gelu_tanh"

    # Behaviour of the family (overridden by subclasses).
    norm_kind: ClassVar[str] = "rms"  # "rms", "rms_plus_one" (gemma: x * (1 + w)), "layer"
    qk_norm: ClassVar[bool] = False
    sandwich_norms: ClassVar[bool] = False  # gemma3: norms after attention and FFN too
    rope_interleaved_gguf: ClassVar[bool] = False

    # ----- derived, read by the forward code -----
    @property
    def query_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def embed_scale(self) -> float | None:
        return None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def rope_for_layer(self, layer: int) -> tuple[float, dict | None]:
        """(theta, scaling) of the rotary embedding used by `layer`."""
        return self.rope_theta, self.rope_scaling

    def ffn_kind(self, layer: int) -> str:
        """'gated', 'dense' (ungated, e.g. OPT) or 'moe'."""
        return "gated"

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        return cls(**_common_fields(d))


# ----------------------------------------------------------------------------- helpers


def _req(d: dict, key: str, *alts: str) -> Any:
    for k in (key, *alts):
        if d.get(k) is not None:
            return d[k]
    raise UnsupportedModelError(f"config: required field '{key}' is missing for model_type '{d.get('model_type')}'")


def _eos_list(d: dict) -> list[int]:
    eos = d.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _rope(d: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """Rotary theta and scaling from either transformers v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"config: rope scaling type '{kind}' is not supported (supported: default, linear, llama3)")
    return theta, dict(scaling, rope_type=kind)


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _activation(d: dict, default: str) -> str:
    name = d.get("hidden_act") or d.get("hidden_activation") or default
    if name not in _ACTIVATIONS:
        known = ", ".join(sorted(_ACTIVATIONS))
        raise UnsupportedModelError(f"config: hidden_act '{name}' is not supported (supported: {known})")
    return _ACTIVATIONS[name]


def _common_fields(d: dict) -> dict:
    hidden = int(_req(d, "hidden_size"))
    heads = int(_req(d, "num_attention_heads"))
    theta, scaling = _rope(d)
    layers = int(_req(d, "num_hidden_layers"))
    return dict(
        model_type=d["model_type"],
        vocab_size=int(_req(d, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_req(d, "intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        norm_eps=float(d.get("rms_norm_eps", d.get("layer_norm_eps", 1e-6)) or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_list(d),
        activation=_activation(d, "silu"),
    )


# ----------------------------------------------------------------------------- dense families


@dataclass
class LlamaConfig(ModelConfig):
    """Llama 2/3, Mistral-style and SmolLM2: RMSNorm, SwiGLU, rotary, GQA."""

    rope_interleaved_gguf: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        f = _common_fields(d)
        f["attn_bias"] = bool(d.get("attention_bias", False))
        if d.get("mlp_bias"):
            raise UnsupportedModelError("config: mlp_bias=true is not supported for llama models")
        _mistral_sliding(d, f)
        return cls(**f)


def _mistral_sliding(d: dict, f: dict) -> None:
    """Mistral-style configs: a sliding_window, when set, applies to every layer."""
    if d.get("sliding_window"):
        f["sliding_window"] = int(d["sliding_window"])
        f["layer_types"] = ["sliding_attention"] * f["num_layers"]


def _qwen_sliding(d: dict, f: dict) -> None:
    """Qwen2/3 use a sliding window only when use_sliding_window is set, from max_window_layers on."""
    if d.get("use_sliding_window") and d.get("sliding_window"):
        f["sliding_window"] = int(d["sliding_window"])
        start = int(d.get("max_window_layers", 0))
        f["layer_types"] = ["sliding_attention" if i >= start else "full_attention" for i in range(f["num_layers"])]


@dataclass
class Qwen2Config(ModelConfig):
    """Qwen2 / Qwen2.5: Llama layout with q/k/v biases."""

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2Config":
        f = _common_fields(d)
        f["attn_bias"] = bool(d.get("qkv_bias", True))
        _qwen_sliding(d, f)
        return cls(**f)


@dataclass
class Qwen3Config(ModelConfig):
    """Qwen3: per-head RMSNorm on q and k (QK-norm), no biases."""

    qk_norm: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        f = _common_fields(d)
        f["attn_bias"] = bool(d.get("attention_bias", False))
        _qwen_sliding(d, f)
        return cls(**f)


@dataclass
class OPTConfig(ModelConfig):
    """OPT: LayerNorm, ReLU FFN with biases, learned positions (offset 2), tied head."""

    norm_kind: ClassVar[str] = "layer"
    word_embed_proj_dim: int = 0
    pre_norm: bool = True  # do_layer_norm_before
    final_norm: bool = True

    def ffn_kind(self, layer: int) -> str:
        return "dense"

    @classmethod
    def from_hf(cls, d: dict) -> "OPTConfig":
        hidden = int(_req(d, "hidden_size"))
        heads = int(_req(d, "num_attention_heads"))
        act = d.get("activation_function", "relu")
        if act != "relu":
            raise UnsupportedModelError(f"config: OPT activation_function '{act}' is not supported (only relu)")
        if not d.get("enable_bias", True) or not d.get("layer_norm_elementwise_affine", True):
            raise UnsupportedModelError("config: OPT without biases or affine layer norms is not supported")
        pre_norm = bool(d.get("do_layer_norm_before", True))
        return cls(
            model_type="opt",
            vocab_size=int(_req(d, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_req(d, "ffn_dim")),
            num_layers=int(_req(d, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            norm_eps=1e-5,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_list(d),
            attn_bias=True,
            activation="relu",
            word_embed_proj_dim=int(d.get("word_embed_proj_dim") or hidden),
            pre_norm=pre_norm,
            final_norm=pre_norm and not d.get("_remove_final_layer_norm", False),
        )


@dataclass
class Gemma3Config(ModelConfig):
    """Gemma 3 (text): GeGLU, sandwich norms, QK-norm, sliding/global layers, scaled tied embeddings."""

    norm_kind: ClassVar[str] = "rms_plus_one"
    qk_norm: ClassVar[bool] = True
    sandwich_norms: ClassVar[bool] = True
    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict | None = None
    final_logit_softcapping: float | None = None

    @property
    def query_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    def rope_for_layer(self, layer: int) -> tuple[float, dict | None]:
        if self.is_sliding(layer):
            return self.rope_local_theta, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, d: dict) -> "Gemma3Config":
        if d.get("model_type") == "gemma3" and "text_config" in d:  # multimodal wrapper: use its text part
            d = dict(d["text_config"], model_type="gemma3_text")
        if d.get("attn_logit_softcapping"):
            raise UnsupportedModelError("config: gemma3 attn_logit_softcapping is not supported")
        f = _common_fields(dict(d, hidden_activation=d.get("hidden_activation") or "gelu_pytorch_tanh"))
        f["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
        f["attn_bias"] = bool(d.get("attention_bias", False))
        n = f["num_layers"]
        types = d.get("layer_types")
        if not types:
            pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        f["layer_types"] = list(types)
        f["sliding_window"] = int(d.get("sliding_window") or 4096)
        f["rope_theta"], f["rope_scaling"] = _rope(d, "full_attention")
        if isinstance(d.get("rope_parameters"), dict) and "sliding_attention" in d["rope_parameters"]:
            local_theta, local_scaling = _rope(d, "sliding_attention")
        else:
            local_theta, local_scaling = float(d.get("rope_local_base_freq", 10000.0)), None
        return cls(
            **f,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or f["head_dim"]),
            rope_local_theta=local_theta,
            rope_local_scaling=local_scaling,
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )


# ----------------------------------------------------------------------------- MoE families


@dataclass
class MoEConfig(ModelConfig):
    """Fields shared by the mixture-of-experts families."""

    num_experts: int = 0
    top_k: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def ffn_kind(self, layer: int) -> str:
        sparse = layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return "moe" if sparse else "gated"

    @classmethod
    def _moe_fields(cls, d: dict, norm_topk_default: bool) -> dict:
        return dict(
            num_experts=int(_req(d, "num_experts", "num_local_experts")),
            top_k=int(_req(d, "num_experts_per_tok")),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d.get("intermediate_size")),
            norm_topk_prob=bool(d.get("norm_topk_prob", norm_topk_default)),
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
        )


@dataclass
class MixtralConfig(MoEConfig):
    """Mixtral: Llama attention, every FFN a top-k MoE of SwiGLU experts (weights renormalised)."""

    rope_interleaved_gguf: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, d: dict) -> "MixtralConfig":
        f = _common_fields(d)
        _mistral_sliding(d, f)
        return cls(**f, **cls._moe_fields(d, True))


@dataclass
class Qwen2MoeConfig(MoEConfig):
    """Qwen2-MoE / Qwen1.5-MoE: q/k/v biases, routed experts plus a sigmoid-gated shared expert."""

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2MoeConfig":
        f = _common_fields(d)
        f["attn_bias"] = bool(d.get("qkv_bias", True))
        _qwen_sliding(d, f)
        moe = cls._moe_fields(d, False)
        moe["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
        return cls(**f, **moe)


@dataclass
class Qwen3MoeConfig(MoEConfig):
    """Qwen3-MoE: Qwen3 attention (QK-norm), routed experts with renormalised top-k weights."""

    qk_norm: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3MoeConfig":
        f = _common_fields(d)
        f["attn_bias"] = bool(d.get("attention_bias", False))
        _qwen_sliding(d, f)
        return cls(**f, **cls._moe_fields(d, True))


# ----------------------------------------------------------------------------- registry

CONFIG_CLASSES: dict[str, type[ModelConfig]] = {
    "llama": LlamaConfig,
    "mistral": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "opt": OPTConfig,
    "gemma3_text": Gemma3Config,
    "gemma3": Gemma3Config,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
}


def config_from_hf(d: dict, source: str = "config.json") -> ModelConfig:
    """Build the family's config dataclass from an HF-style dict; unknown families get a clear error."""
    model_type = d.get("model_type")
    cls = CONFIG_CLASSES.get(model_type)
    if cls is None:
        known = ", ".join(sorted(CONFIG_CLASSES))
        raise UnsupportedModelError(f"{source}: unknown architecture model_type='{model_type}' (supported: {known})")
    try:
        return cls.from_hf(d)
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{source}: invalid field for model_type '{model_type}': {e}") from None
