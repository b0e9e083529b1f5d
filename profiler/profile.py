"""The profiling run: calibrate thresholds (gated FFNs), count activations, sample for predictors."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from hotcold.models.loader import LoadedModel
from hotcold.models.perplexity import perplexity
from hotcold.profiler.calibrate import GRID, HELDOUT_BATCH, search_sparsity
from hotcold.profiler.data import Calibration
from hotcold.profiler.input_sparsity import applies as input_applies
from hotcold.profiler.input_sparsity import profile_input_sparsity
from hotcold.profiler.instrument import MagnitudeSampler, Recorder, instrumented, run_layers
from hotcold.profiler.report import layer_summary

REFINE = 2  # bisections of the sparsity search after the grid
Progress = Callable[..., None]  # (stage, done, total, unit="tok"): called with done=0 before a stage starts


@dataclass
class ProfileOptions:
    tokens: int = 65536  # tokens to count activations over
    seq_len: int = 512
    sparsity: float | None = None  # fixed target for gated FFNs (else chosen by ppl_budget)
    ppl_budget: float = 0.01  # allowed relative perplexity rise on held-out text
    samples: int = 16384  # reservoir size per layer for predictor training (0: none)
    heldout_tokens: int = 2048  # held-out text for perplexity (gated models)
    calib_tokens: int = 8192  # tokens whose activation magnitudes set the thresholds
    magnitudes_per_layer: int = 1 << 20
    batch_tokens: int = 4096  # tokens per forward
    seed: int = 0
    input_sparsity: bool = True  # gated models: thresholds on every projection's input (profiler/input_sparsity.py)
    input_calib_tokens: int = 1024  # calibration tokens of its magnitudes and greedy allocation


def thresholded_kinds(lm: LoadedModel) -> bool:
    """Whether the model needs magnitude thresholds: a dense or gated FFN layer with a non-ReLU
    activation, whose neurons are split by activity. MoE layers' experts are computed whole (their
    routing is what is counted), so a model of MoE layers only needs none, nor the held-out
    perplexity search that sets them."""
    c = lm.config
    return c.activation != "relu" and any(c.ffn_kind(l) != "moe" for l in range(c.num_layers))


def _batches(seqs: torch.Tensor, batch_tokens: int):
    per = max(1, batch_tokens // seqs.shape[1])
    for i in range(0, len(seqs), per):
        yield seqs[i : i + per]


def _intermediate(lm: LoadedModel, layer: int) -> int:
    c = lm.config
    return c.moe_intermediate_size * c.top_k if c.ffn_kind(layer) == "moe" else c.intermediate_size


def run_profile(lm: LoadedModel, cal: Calibration, opts: ProfileOptions, progress: Progress | None = None
                ) -> tuple[dict[str, torch.Tensor], dict]:
    """Profile `lm` on the calibration data. Returns (tensors for profile.safetensors, profile.json)."""
    progress = progress or (lambda *a: None)
    model, c, dev = lm.model, lm.config, lm.device
    seqs = cal.sequences
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    thresholds: dict[int, float] = {}
    curve, target, dense_ppl = [], 0.0, None

    if thresholded_kinds(lm):
        # 1. activation magnitudes on a dense forward -> thresholds for any sparsity
        calib = seqs[: max(1, math.ceil(opts.calib_tokens / seqs.shape[1]))]
        sampler = MagnitudeSampler(opts.magnitudes_per_layer,
                                   {l: calib.numel() * _intermediate(lm, l) for l in range(c.num_layers)}, opts.seed)
        with instrumented(model, magnitudes=sampler):
            done = 0
            progress("thresholds", 0, calib.numel())
            for batch in _batches(calib, opts.batch_tokens):
                run_layers(model, batch.to(dev))
                done += batch.numel()
                progress("thresholds", done, calib.numel())

        # 2. the sparsity: fixed, or the largest within the perplexity budget
        evals = [0]
        # evaluations of the held-out perplexity: two at a fixed sparsity; the search's most otherwise
        most = 2 if opts.sparsity is not None else 1 + len(GRID) + REFINE

        def ppl_at(s: float) -> float:
            with instrumented(model, sampler.thresholds(s)):
                ppl = perplexity(model, cal.heldout, opts.seq_len, bos, batch=HELDOUT_BATCH).ppl
            evals[0] += 1
            progress("perplexity", evals[0], most, "evaluation")
            return ppl

        if cal.heldout:
            progress("perplexity", 0, most, "evaluation")

        if not cal.heldout:
            if opts.sparsity is None:
                raise ValueError("no held-out text to measure perplexity on")
            target = opts.sparsity
        elif opts.sparsity is not None:
            target = opts.sparsity
            curve = [{"sparsity": 0.0, "ppl": ppl_at(0.0)}, {"sparsity": target, "ppl": ppl_at(target)}]
        else:
            target, points = search_sparsity(ppl_at, opts.ppl_budget, refine=REFINE)
            curve = [{"sparsity": p.sparsity, "ppl": p.ppl} for p in points]
        dense_ppl = curve[0]["ppl"] if curve else None
        thresholds = sampler.thresholds(target)

    # 3. count activations at those thresholds, sample for the predictors
    recorder = Recorder(model, opts.samples, opts.seed)
    start, done = time.perf_counter(), 0
    with instrumented(model, thresholds, recorder):
        progress("counting", 0, seqs.numel())
        for batch in _batches(seqs, opts.batch_tokens):
            recorder.start_batch(batch.numel())
            run_layers(model, batch.to(dev))
            done += batch.numel()
            progress("counting", done, seqs.numel())
    elapsed = time.perf_counter() - start

    tensors, rows = {}, []
    input_meta = None
    if opts.input_sparsity and thresholded_kinds(lm) and cal.heldout and input_applies(model):
        calib = seqs[: max(1, math.ceil(opts.input_calib_tokens / seqs.shape[1]))]
        tensors, input_meta = profile_input_sparsity(lm, calib, cal.heldout, opts.seq_len, opts.ppl_budget,
                                                     progress, opts.seed, dense_ppl=dense_ppl)
    for l in range(c.num_layers):
        kind = c.ffn_kind(l)
        tau = thresholds.get(l, 0.0)
        tensors[f"layers.{l}.threshold"] = torch.tensor([tau], dtype=torch.float32)
        nf = ef = enf = None
        if kind == "moe":
            counts = recorder.expert_count[l].double().cpu()
            ef = (counts / recorder.tokens).float()
            enf = (recorder.expert_neuron_count[l].double().cpu() / counts.clamp_min(1)[:, None]).float()
            tensors[f"layers.{l}.expert_freq"] = ef
            tensors[f"layers.{l}.expert_neuron_freq"] = enf
        else:
            nf = (recorder.neuron_count[l].double().cpu() / recorder.tokens).float()
            tensors[f"layers.{l}.neuron_freq"] = nf
        if l in recorder.samples and "x" in recorder.samples[l].fields:
            tensors[f"layers.{l}.sample_x"] = recorder.samples[l].fields["x"]
            tensors[f"layers.{l}.sample_active"] = recorder.samples[l].fields["active"]
        if l in recorder.lookahead and "hidden" in recorder.lookahead[l].fields:
            tensors[f"layers.{l}.lookahead_hidden"] = recorder.lookahead[l].fields["hidden"]
            tensors[f"layers.{l}.lookahead_experts"] = recorder.lookahead[l].fields["next_experts"]
        rows.append(layer_summary(l, kind, tau, nf, ef, enf))

    meta = {
        "format": 1,
        "fingerprint": lm.fingerprint,
        "model": lm.name,
        "model_path": str(lm.path),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "data": [{"source": s.name, "tokens": s.tokens} for s in cal.sources],
        "data_reused": cal.reused,
        "tokens": recorder.tokens,
        "seq_len": opts.seq_len,
        "mode": "threshold" if thresholds else "relu",
        "sparsity_target": target if thresholds else None,
        "ppl_budget": opts.ppl_budget if thresholds and opts.sparsity is None else None,
        "dense_ppl": dense_ppl,
        "heldout_tokens": len(cal.heldout),
        "curve": curve,
        "samples_per_layer": opts.samples,
        "device": str(dev),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "throughput_tok_s": round(recorder.tokens / elapsed, 1),
        "layers": rows,
        "summary": _summary(rows),
    }
    if input_meta is not None:
        meta["input_sparsity"] = input_meta
    return tensors, meta


def _summary(rows: list[dict]) -> dict:
    def mean(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {"sparsity": mean("sparsity"), "mass80": mean("mass80"), "experts_mass80": mean("experts_mass80")}

