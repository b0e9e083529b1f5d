#!/usr/bin/env python3
"""How closely hotcold's next-token distributions follow llama.cpp's on the same GGUF file and ids.

    python tools/agreement.py MODEL.gguf [--tokens 256] [--decode 32] [--no-plan] [--dense]
        [--defer-experts] [--exact] [--device cpu|cuda] [--threads N] [--llama-gpu-layers N]
        [--llama-repack] [--json OUT]

The ids are Python's documentation text cut to --tokens by hotcold's tokenizer (as tools/bench.py
makes its prompt). llama.cpp evaluates them in one batch with every position's logits kept. hotcold
computes them twice, as its engines do when they generate: the whole sequence in one prefill
forward, and the first --decode positions one token at a time over the KV cache (the decode path:
on CUDA the graphed step). Each is run by the model's plan (hybrid or CPU engine: what `hotcold run`
does; --no-plan: the dense model), and with --dense also dense, for the plan's own cost; with --defer-experts also by the plan with expert
deferral (`run --defer-experts`: it changes the decode path only), compared with llama.cpp and with
the plan's exact decode. With
--exact both are also compared with the exact function they approximate: the file's weights
dequantised to float32 and run without quantised activations (needs the model in float32 in RAM).

Per comparison, over the positions: top-1 agreement (the same argmax), top-1 in the reference's top
5, the mean and largest KL divergence KL(reference || ours) in nats, and the largest absolute logit
difference relative to the reference's logit range. Random generated models have flat
distributions, where near-ties flip the argmax more often than on a trained model, and MoE routers
with near-tied experts turn either engine's rounding into a different expert: read the KL beside
the top-1 figure, and --exact says which engine is the closer to the exact function. Exit status 0; 2 on bad input (one line).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/benchlib, also when loaded by path
from benchlib.children import NO_REPACK, llama_model_params  # noqa: E402


def prompt_ids(model: Path, n: int) -> list[int]:
    from hotcold.models.perplexity import calibration_text
    from hotcold.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(_metadata(model))
    text, chars = calibration_text(), 4 * n
    while True:
        ids = tok.encode(text[:chars])
        if len(ids) >= n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise SystemExit(f"error: the calibration text has only {len(ids)} tokens; lower --tokens")
    return ids[:n]


def _metadata(model: Path) -> dict:
    from hotcold.models.gguf_loader import GGUFFile

    return GGUFFile(model).metadata


def llama_logits(model: Path, ids: list[int], threads: int, gpu_layers: int, repack: bool) -> np.ndarray:
    """[T, V] float32: llama.cpp's logits at every position, one batch, computed in a child process
    (llama.cpp's CUDA build and torch's in one process crashed: a segmentation fault on the H100 host)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_llama_logits, (model, ids, threads, gpu_layers, repack))


def _llama_logits(model: Path, ids: list[int], threads: int, gpu_layers: int, repack: bool) -> np.ndarray:
    from llama_cpp import Llama

    with llama_model_params(**({} if repack else NO_REPACK)):
        llm = Llama(str(model), n_ctx=len(ids) + 8, n_batch=len(ids), n_ubatch=min(512, len(ids)), n_threads=threads,
                    n_threads_batch=threads, n_gpu_layers=gpu_layers, logits_all=True, verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def hotcold_logits(model: Path, ids: list[int], use_plan: bool, device: str | None, threads: int,
                   decode: int, defer: bool = False) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """([T, V] prefill logits, [decode, V] one-token-step logits, the setup's notes), float32."""
    import torch

    from hotcold.executors.from_plan import open_for_run
    from hotcold.models.transformer import KVCache

    setup = open_for_run(model, use_plan=use_plan, device=device, threads=threads, defer_experts=defer)
    lm, notes = setup.lm, list(setup.notes)
    try:
        toks = torch.tensor([ids], dtype=torch.long, device=lm.device)

        def cache():
            return KVCache(lm.config, len(ids) + 8, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)

        with torch.inference_mode():
            full = lm.model(toks, 0, cache())[0].float().cpu().numpy()
            c, steps = cache(), []
            for i in range(min(decode, len(ids))):
                steps.append(lm.model(toks[:, i: i + 1], i, c)[0, -1].float().cpu().numpy())
        return full, np.stack(steps) if steps else np.zeros((0, full.shape[1]), np.float32), notes
    finally:
        setup.close()


def exact_logits(model: Path, ids: list[int]) -> np.ndarray:
    """[T, V] float32: the file's weights dequantised to float32 and run by the dense reference forward
    (no quantised activations: what both engines approximate)."""
    import torch

    from hotcold.models.loader import load_model
    from hotcold.models.quantized import dequantize_model

    lm = load_model(model, "cpu", "float32")
    with torch.inference_mode():
        dequantize_model(lm.model, torch.device("cpu"), torch.float32)
        return lm.model(torch.tensor([ids]))[0].float().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, ours: np.ndarray) -> dict:
    """Agreement of ours [T, V] with ref [T, V'] over their first min(V, V') logits (llama.cpp may
    pad its vocabulary)."""
    v = min(ref.shape[1], ours.shape[1])
    ref, ours = ref[:, :v], ours[:, :v]
    lr, lo = _log_softmax(ref), _log_softmax(ours)
    kl = (np.exp(lr) * (lr - lo)).sum(axis=1)
    top5 = np.argsort(-ref, axis=1)[:, :5]
    a_ours = ours.argmax(axis=1)
    spread = (ref.max(axis=1) - ref.min(axis=1)).clip(min=1e-9)
    return {
        "positions": int(len(ref)),
        "top1_agreement": float((ref.argmax(axis=1) == a_ours).mean()),
        "top1_in_ref_top5": float((top5 == a_ours[:, None]).any(axis=1).mean()),
        "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
        "max_rel_logit_diff": float((np.abs(ref - ours).max(axis=1) / spread).max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a GGUF file")
    ap.add_argument("--tokens", type=int, default=256, help="positions compared (default 256)")
    ap.add_argument("--decode", type=int, default=32, help="of them, through the one-token step (default 32)")
    ap.add_argument("--no-plan", action="store_true", help="hotcold dense, ignoring the model's plan")
    ap.add_argument("--dense", action="store_true", help="also hotcold dense beside the planned run")
    ap.add_argument("--defer-experts", action="store_true", help="also by the plan with expert deferral")
    ap.add_argument("--exact", action="store_true", help="also compare both with the dequantised float32 model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="hotcold's device (default: as run)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of both (default: every core)")
    ap.add_argument("--llama-gpu-layers", type=int, default=None,
                    help="llama.cpp's n_gpu_layers (default 99 with --device cuda, else 0)")
    ap.add_argument("--llama-repack", action="store_true",
                    help="let llama.cpp repack weights for its extra CPU kernels (off: it crashed on some CPUs)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    a = ap.parse_args(argv)
    if not a.model.is_file() or a.model.suffix != ".gguf":
        print(f"error: {a.model}: not a GGUF file", file=sys.stderr)
        return 2
    if a.tokens < 2 or not 0 <= a.decode <= a.tokens:
        print("error: --tokens must be >= 2 and --decode between 0 and --tokens", file=sys.stderr)
        return 2
    if importlib.util.find_spec("llama_cpp") is None:
        print("error: llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    import os

    threads = a.threads or os.cpu_count() or 1
    gpu_layers = a.llama_gpu_layers if a.llama_gpu_layers is not None else (99 if a.device == "cuda" else 0)
    ids = prompt_ids(a.model, a.tokens)
    ref = llama_logits(a.model, ids, threads, gpu_layers, a.llama_repack)
    runs = ([("run", not a.no_plan, False)] + ([("dense", False, False)] if a.dense and not a.no_plan else [])
            + ([("deferred", True, True)] if a.defer_experts and not a.no_plan else []))
    report = {"model": str(a.model), "tokens": a.tokens, "decode": a.decode, "llama_gpu_layers": gpu_layers, "runs": {}}
    decoded = {}
    for name, use_plan, defer in runs:
        full, steps, notes = hotcold_logits(a.model, ids, use_plan, a.device, threads, a.decode, defer)
        r = {"notes": notes, "prefill": compare(ref, full)}
        if len(steps):
            r["decode"] = compare(ref[: len(steps)], steps)
            decoded[name] = steps
            if defer:
                r["decode vs the plan's exact decode"] = compare(decoded["run"], steps)
        report["runs"][name] = r
        for path, c in ((k, r[k]) for k in ("prefill", "decode", "decode vs the plan's exact decode") if k in r):
            against = "" if path.startswith("decode vs") else " vs llama.cpp"
            print(f"hotcold ({name}) {path}{against} over {c['positions']} positions: top-1 "
                  f"{c['top1_agreement']:.1%} (in its top 5: {c['top1_in_ref_top5']:.1%}), KL mean "
                  f"{c['kl_mean']:.2e} max {c['kl_max']:.2e} nats, logits within {c['max_rel_logit_diff']:.1%} "
                  "of their range")
        for n in notes:
            print(f"  note: {n}")
    if a.exact:
        exact = exact_logits(a.model, ids)
        report["exact"] = {"llama.cpp": compare(exact, ref)}
        for name, use_plan, defer in runs:
            full, steps, _ = hotcold_logits(a.model, ids, use_plan, a.device, threads, a.decode, defer)
            report["exact"][f"hotcold ({name}) prefill"] = compare(exact, full)
            if len(steps):
                report["exact"][f"hotcold ({name}) decode"] = compare(exact[: len(steps)], steps)
        for who, c in report["exact"].items():
            print(f"{who} vs the exact float32 function over {c['positions']} positions: top-1 "
                  f"{c['top1_agreement']:.1%}, KL mean {c['kl_mean']:.2e} max {c['kl_max']:.2e} nats")
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
