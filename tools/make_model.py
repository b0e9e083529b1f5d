#!/usr/bin/env python3
"""Write a large random LLM with planted, realistic activation statistics, as a Hugging Face
folder AND a GGUF file holding the same weights, for benchmarks on models no hub can give us.

    python tools/make_model.py PRESET --out DIR [--dtype f16|bf16|f32|q8_0|q4_0|q4_k] [--seed N]
        [--format hf,gguf] [--sparsity 0.89] [--mass80 0.2] [--expert-skew 0.5]
        [--layers N] [--hidden D] [--ffn I] [--heads H] [--kv-heads K] [--head-dim Dh]
        [--experts E] [--top-k k] [--vocab V] [--context N] [--rope-theta T]
        [--calib-tokens 256] [--shard-size 4GiB] [--check] [--check-layers 4] [--force]
    python tools/make_model.py --list

Writes DIR/hf/ (config.json, generation_config.json, model-0000x-of-0000y.safetensors and
model.safetensors.index.json, tokenizer.json, tokenizer_config.json), DIR/model.gguf and
DIR/make_model.json (the options and what was planted). Run `--help` for the details.

--dtype q8_0, q4_0 or q4_k quantises the GGUF form: its weight matrices (attention, FFN, stacked
experts, output; OPT's position embedding) are written as GGUF blocks of
that type, quantised row by row from the f16 weights with hotcold.sparse_ops.quant.quantize_rows
(Q8_0/Q4_0 by numba kernels that give gguf.quants' bytes, bit-exact with ggml's reference quantiser;
Q4_K with hotcold's round-to-nearest quantiser, valid blocks but not llama.cpp's search-based one,
in threads). Every matrix gets the one type, as `llama-quantize --pure` does (no Q6_K output
layer). Norms, biases and MoE routers (ffn_gate_inp) stay F32, as llama.cpp keeps them; the token embedding stays F16 (see
QUANT_KEEP_FLOAT). A matrix whose input size (columns) is not a multiple of the block size (32; 256
for q4_k) stays F16, and then so do the other expert stacks of its layer; make_model.json lists
each GGUF tensor type. The HF form stays float (f16) so `hotcold profile` and transformers can run it, and
the GGUF's blocks quantise exactly those f16 weights (llama's q/k rows are permuted first).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/makemodel, also when loaded by path

from makemodel.cli import main, make_parser  # noqa: E402
from makemodel.driver import CHECK_WINDOW, Result, check, generate  # noqa: E402
from makemodel.generator import WeightGenerator  # noqa: E402
from makemodel.spec import (OVERRIDES, P_MAX, PRESETS, TOKENIZER_VOCAB, MakeModelError, Spec, build_spec,  # noqa: E402
                            expert_shares, firing_probs, mass_fraction)
from makemodel.tensors import QUANT, STORAGE, Pool, count_params, tensor_plan  # noqa: E402
from makemodel.tokens import load_tokenizer, smollm2_gguf, text_windows, tokenizer_metadata  # noqa: E402
from makemodel.writers import GGUFStreamWriter, SafetensorsWriter, gguf_types  # noqa: E402

__all__ = ["main", "make_parser", "CHECK_WINDOW", "Result", "check", "generate", "WeightGenerator", "OVERRIDES", "P_MAX",
           "PRESETS", "TOKENIZER_VOCAB", "MakeModelError", "Spec", "build_spec", "expert_shares", "firing_probs",
           "mass_fraction", "QUANT", "STORAGE", "Pool", "count_params", "tensor_plan", "load_tokenizer",
           "smollm2_gguf", "text_windows", "tokenizer_metadata", "GGUFStreamWriter", "SafetensorsWriter",
           "gguf_types"]

if __name__ == "__main__":
    sys.exit(main())
