"""Tiny random models of every supported family, made with transformers and saved with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
)


def tiny_configs() -> dict:
    import transformers as T

    return {
        "llama": T.LlamaConfig(**COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32}),
        "llama_relu": T.LlamaConfig(**COMMON, hidden_act="relu"),  # ReLU-fied llama (ProSparse, ReluLLaMA)
        "mistral": T.MistralConfig(**COMMON, sliding_window=8),
        "qwen2": T.Qwen2Config(**COMMON),
        "qwen3": T.Qwen3Config(**COMMON, head_dim=24),
        "opt": T.OPTConfig(vocab_size=160, hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                           max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.1),
        # OPT-350m's layout: norms after the residual adds, embeddings projected in and out of the blocks' width
        "opt_post": T.OPTConfig(vocab_size=160, hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                                max_position_embeddings=256, word_embed_proj_dim=48, init_std=0.1,
                                do_layer_norm_before=False),
        "gemma3": T.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "mixtral": T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": T.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      head_dim=16, norm_topk_prob=True),
    }


def make_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """Write the family's tiny random model to folder/family and return that path."""
    import transformers as T

    out = folder / family
    if not (out / "config.json").exists():
        torch.manual_seed(seed)
        model = T.AutoModelForCausalLM.from_config(tiny_configs()[family])
        model.save_pretrained(out)
    return out


FAMILIES = ["llama", "llama_relu", "mistral", "qwen2", "qwen3", "opt", "opt_post", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]


def add_tiny_tokenizer(folder: Path, vocab_size: int = 160) -> Path:
    """Train a small BPE tokenizer (vocabulary <= the tiny models' 160) on Python's documentation
    and save it beside a tiny model, so text-driven commands (profile, run) work on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hotcold.models.perplexity import calibration_text

    if not (folder / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=80)
        tok.train_from_iterator([calibration_text()[:200_000]], trainer)
        assert tok.get_vocab_size() <= vocab_size
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(
            '{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}')
    return folder


def quantised_tiny(folder: Path, family: str, kind: str, fused: bool = False):
    """A tiny random model of `family` loaded on the CPU with its matrices quantised to `kind`; fused:
    q, k and v interleaved and fused into one [q; k; v] matrix, as the GGUF loader leaves them."""
    from hotcold.models.loader import load_model
    from hotcold.models.quantized import fuse_qkv, quantize_model
    from hotcold.sparse_ops.quant import pack_rows

    lm = load_model(make_tiny(family, folder), "cpu", "float32")
    quantize_model(lm.model, kind)
    if fused:
        for blk in lm.model.layers:
            for name in ("q", "k", "v"):
                lin = getattr(blk.attn, name)
                lin.qweight = pack_rows(lin.qweight)
        fuse_qkv(lm.model)
    return lm
