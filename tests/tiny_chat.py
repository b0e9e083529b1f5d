"""Tiny random chat models for structured outputs and tool calls: a byte-level BPE vocabulary (any
JSON can be spelled), the special tokens of the Qwen, Llama 3 and Mistral chat formats, and a chat
template of each family's tool-call syntax (tests/chat_templates/).

The weights are random, so the model knows nothing of JSON: without a grammar its reply is not JSON.
One thing is not random: the output layer favours tokens that end in `"`, `}` or `]` (and open
nothing new) and the end of the turn (through a residual dimension held constant), so strings, arrays and objects close within
a few tokens and a test's reply stays short; what is allowed next is still up to the grammar.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import tiny_configs

VOCAB = 512
TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", "<s>", "</s>",
            "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # Qwen's are not special
# family -> (architecture in tiny_models, template, bos, eos)
FAMILIES = {
    "qwen": ("qwen2", "hermes", None, "<|im_end|>"),
    "llama3": ("llama", "llama3", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("mistral", "mistral", "<s>", "</s>"),
    "plain": ("qwen2", None, None, "<|im_end|>"),  # no template: the built-in ChatML, which renders no tools
}
CLOSERS = ('"', "}", "]")


def _corpus() -> list[str]:
    records = [{"name": "Ada", "age": 36, "tags": ["math", "engines"], "email": "ada@example.com"},
               {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2, "price": 1.5}], "status": "paid"},
               {"city": "Paris", "unit": "celsius", "temperature": 21.5, "when": "2025-01-02T10:00:00Z"},
               {"ok": True, "value": None, "count": 0, "ratio": -0.25, "url": "https://example.com/a?b=1"}]
    text = [json.dumps(r) for r in records] + [json.dumps(r, separators=(",", ":")) for r in records]
    text += ["The weather in Paris is sunny today. Call the function with its arguments."] * 3
    return text * 20


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED), special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens(ADDED)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))


def _closes(text: str) -> bool:
    """A token that ends a string, array or object and starts nothing new."""
    return text.endswith(CLOSERS) and not any(c in text for c in ",:{[")


def _bias_closers(model, tokenizer_file: Path, eos: str) -> None:
    """Residual dimension 0: constant in every embedding, never written by a layer; the output
    layer reads it only for the closing tokens and the end of the turn."""
    tok = json.loads(tokenizer_file.read_text())
    vocab = tok["model"]["vocab"]
    from tokenizers import decoders

    dec = decoders.ByteLevel()
    texts = {i: dec.decode([t]) for t, i in vocab.items()}
    quotes = [i for i, t in texts.items() if _closes(t) and t.endswith('"')]  # strongest: strings end first
    closers = [i for i, t in texts.items() if _closes(t) and not t.endswith('"')]
    closers.append(next(a["id"] for a in tok["added_tokens"] if a["content"] == eos))
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[closers, 0] = 2.0
        head[quotes, 0] = 3.0


def make_chat_tiny(family: str, root: Path, seed: int = 0) -> Path:
    """root/family: a tiny random model of the family's architecture with its chat format."""
    import transformers as T

    arch, template, bos, eos = FAMILIES[family]
    out = root / f"chat_{family}"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True)
    _tokenizer(out)
    config = tiny_configs()[arch]
    config.vocab_size = VOCAB
    config.max_position_embeddings = 8192  # room for tool listings
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config)
    _bias_closers(model, out / "tokenizer.json", eos)
    model.save_pretrained(out)
    config_json = {"eos_token": eos, "add_bos_token": bos is not None}
    if template:
        config_json["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    if bos:
        config_json["bos_token"] = bos
    (out / "tokenizer_config.json").write_text(json.dumps(config_json))
    return out
