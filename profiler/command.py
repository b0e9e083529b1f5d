"""`hotcold profile`: which neurons and experts fire, written beside the model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from hotcold.errors import HotcoldError


def profile(
    model: Optional[Path] = typer.Argument(None, help="HF model folder or .gguf file (default: the embedded Gemma 3 270M)"),
    data: list[Path] = typer.Option([], "--data", help="Calibration text: .txt, or .jsonl with a 'text' field "
                                                       "(repeatable; default: Python's documentation)."),
    tokens: int = typer.Option(65536, "--tokens", min=1, help="Tokens to count activations over."),
    seq_len: int = typer.Option(512, "--seq-len", min=8, help="Tokens per calibration sequence."),
    sparsity: Optional[float] = typer.Option(None, "--sparsity", min=0.0, max=0.99,
                                             help="Gated FFNs: fixed target sparsity (instead of --ppl-budget)."),
    ppl_budget: Optional[float] = typer.Option(None, "--ppl-budget", min=0.0001, max=1.0,
                                               help="Gated FFNs: largest sparsity whose held-out perplexity rises "
                                                    "by at most this fraction (default 0.01)."),
    samples: int = typer.Option(16384, "--samples", min=0,
                                help="Predictor-training samples kept per layer (fewer if all layers' samples "
                                     "would take over a third of the free RAM)."),
    heldout: int = typer.Option(2048, "--heldout-tokens", min=0, help="Held-out tokens for perplexity."),
    predictors: bool = typer.Option(True, "--predictors/--no-predictors",
                                    help="Train the activation predictors (and MoE look-ahead) after profiling."),
    recall: float = typer.Option(0.95, "--recall", min=0.5, max=1.0, help="Predictors: target recall per layer."),
    predictor_budget: float = typer.Option(0.04, "--predictor-budget", min=0.001, max=1.0,
                                           help="Predictors: total size as a fraction of the FFN parameters "
                                                "(every byte of it is read per token)."),
    input_sparsity: bool = typer.Option(True, "--input-sparsity/--no-input-sparsity",
                                        help="Gated models: choose thresholds on every projection's input "
                                             "(q/k/v, o, gate/up, down) within --ppl-budget (TEAL)."),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="Artifact folder (default: MODEL.hotcold beside the model)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="CPU threads for torch and the block kernels (one count for both pools)."),
) -> None:
    """Stream calibration text through the model and record which neurons and experts fire."""
    import time

    began = time.perf_counter()
    import torch
    from rich.console import Console

    from hotcold.artifacts import artifact_dir, removed_if_left_empty
    from hotcold.models.loader import (default_model_path, describe_model, gpu_free_bytes, load_model, resolve_device,
                                       resolve_dtype)
    from hotcold.profiler.artifact import write_profile
    from hotcold.profiler.data import default_source, read_source, tokenise
    from hotcold.profiler.profile import ProfileOptions, run_profile, thresholded_kinds
    from hotcold.profiler.report import plot, print_table

    if sparsity is not None and ppl_budget is not None:
        raise HotcoldError("give either --sparsity or --ppl-budget, not both")
    # what can be checked from the config alone, before the model loads (minutes for a large one)
    path = model if model is not None else default_model_path()
    info = describe_model(path)  # a missing or unreadable model file, said first
    if out is not None and out.expanduser().exists() and not out.expanduser().is_dir():
        raise HotcoldError(f"--out: {out} is a file; pass a folder for the profile's files")
    if sparsity is None and heldout < seq_len and info.config.activation != "relu":
        raise HotcoldError(f"--heldout-tokens {heldout} is less than one --seq-len window ({seq_len}); "
                           "the perplexity budget needs held-out text (or give --sparsity)")
    device, note = profile_device(device, dtype, info.params, gpu_free_bytes(device))
    if note:
        print(note, file=sys.stderr)
    resolve_dtype(dtype, resolve_device(device))
    sources = [read_source(p) for p in data] or [default_source()]
    if threads:  # torch's GEMMs and numba's block kernels take turns: two pools of different sizes contend
        from hotcold.sparse_ops.selection import set_threads

        torch.set_num_threads(threads)
        set_threads(threads)
    console = Console(stderr=True)
    lm = load_model(path, device, dtype)
    if lm.tokenizer is None:
        raise HotcoldError(f"{lm.path}: no tokenizer.json in the model folder; profiling needs a tokenizer")
    folder = artifact_dir(lm.path, lm.fingerprint, out)
    with removed_if_left_empty(folder):  # a failed or stopped profile leaves no empty folder behind
        gated = thresholded_kinds(lm)
        if not gated and (sparsity is not None or ppl_budget is not None):
            why = ("ReLU model: neurons are active when they fire" if lm.config.activation == "relu" else
                   "every FFN is a MoE layer, whose experts run whole")
            console.print(f"note: {why}; --sparsity/--ppl-budget do not apply")
        samples = _sample_cap(lm, samples, console)
        opts = ProfileOptions(tokens=tokens, seq_len=seq_len, sparsity=sparsity if gated else None,
                              ppl_budget=ppl_budget if ppl_budget is not None else 0.01, samples=samples,
                              heldout_tokens=heldout if gated else 0, seed=seed, input_sparsity=input_sparsity)
        cal = tokenise(lm.tokenizer, sources, tokens, seq_len, opts.heldout_tokens)
        if cal.reused:
            have = sum(s.tokens for s in sources) - len(cal.heldout)
            console.print(f"note: the data has {have} tokens for counting, fewer than --tokens {tokens}; "
                          "reusing it with shifted windows")
        counted = cal.sequences.numel()
        if predictors and 0 < counted < samples:  # the reservoir keeps at most one sample per token counted
            console.print(f"note: {counted:,} tokens counted give each layer {counted:,} predictor-training samples, "
                          f"fewer than the {samples:,} its reservoir holds; the predictors train on those "
                          f"(--tokens {samples} or more fills it)")
        clock = StageClock()
        with _progress(console, clock) as update:
            tensors, meta = run_profile(lm, cal, opts, update)
        paths = write_profile(folder, tensors, meta, lambda p: plot(
            {r["layer"]: tensors.get(f"layers.{r['layer']}.neuron_freq", tensors.get(f"layers.{r['layer']}.expert_freq"))
             for r in meta["layers"]}, meta, p))
        if "input_sparsity" in meta:
            paths.append(_plot_input_sparsity(folder, meta))
        if predictors and samples:
            check = (cal.heldout, seq_len, opts.ppl_budget) if gated and cal.heldout else None
            paths += _train_predictors(lm, paths, recall, predictor_budget, console, check, clock)
            meta = json.loads(paths[1].read_text())
        print_table(meta, console)
        print(clock.summary(time.perf_counter() - began), file=sys.stderr)
        for p in paths:
            print(p)
        sys.stdout.flush()


GPU_FIT = 0.9  # of the GPU's free memory the weights may take (the rest: activations, CUDA's workspace)


def profile_device(device: str | None, dtype: str | None, params: int, cuda_free: int | None) -> tuple[str, str | None]:
    """Where to profile: on a GPU the whole model is expanded to its dtype (bfloat16 by default), so
    where its `params` weights would not fit `cuda_free` bytes the profile runs on the CPU (a GGUF's
    quantised blocks read in place from the file, as `run --device cpu` reads them) when no device
    was given, and a given `--device cuda` is refused in one line. -> (device, note or None)."""
    import torch

    from hotcold.models.loader import resolve_dtype

    if cuda_free is None or (device not in (None, "auto") and not device.startswith("cuda")):
        return device or "cpu", None
    dt = resolve_dtype(dtype, torch.device("cuda"))
    need = params * dt.itemsize
    if need <= GPU_FIT * cuda_free:
        return device or "cuda", None
    what = (f"the weights need {need / 2**30:.1f} GiB of GPU memory in {str(dt).removeprefix('torch.')} and "
            f"the GPU has {cuda_free / 2**30:.1f} GiB free")
    if device is None or device == "auto":
        return "cpu", f"note: {what}: profiling on the CPU"
    raise HotcoldError(f"--device {device}: {what}; leave --device out (or use --device cpu) to profile on the CPU")


def _plot_input_sparsity(folder: Path, meta: dict) -> Path:
    from hotcold.artifacts import atomic_path
    from hotcold.profiler.input_sparsity import plot_curve

    path = Path(folder) / "input_sparsity.png"
    with atomic_path(path) as tmp:
        plot_curve(meta["input_sparsity"], meta["model"], tmp)
    return path


def sample_row_bytes(config) -> tuple[int, int]:
    """Host bytes one reservoir row takes in every layer together (FFN input in float16 plus the packed
    mask, or for MoE the look-ahead residual plus the next layer's experts), and in the largest layer
    alone (a reservoir's update copies one layer's rows at a time)."""
    rows = [2 * config.hidden_size + (4 * config.top_k if config.ffn_kind(l) == "moe"
                                      else -(-config.intermediate_size // 8)) for l in range(config.num_layers)]
    return sum(rows), max(rows, default=0)


def _sample_cap(lm, samples: int, console) -> int:
    """`samples`, lowered so that the reservoirs of all layers, with one layer's update copy, fit in
    a third of the free RAM (the model is loaded by then)."""
    import psutil

    total, largest = sample_row_bytes(lm.config)
    cap = int(psutil.virtual_memory().available // 3 // max(total + largest, 1))
    if samples > cap:
        console.print(f"note: keeping {cap} predictor-training samples per layer instead of {samples}: "
                      f"{samples} would take {samples * (total + largest) / 2**30:.1f} GiB of RAM "
                      f"(fewer samples give less precise predictors)")
        return cap
    return samples


def _train_predictors(lm, paths, recall: float, budget: float, console, check=None, clock=None) -> list[Path]:
    """Train predictors from the profile just written; save them and add their metrics to profile.json.
    check: (held-out ids, window, perplexity budget) of a gated model: the predictor-sparse held-out
    perplexity is measured, recorded and printed beside the dense one."""
    from hotcold.artifacts import atomic_path
    from hotcold.predictors.artifact import save_predictors
    from hotcold.predictors.train import train_predictors
    from hotcold.profiler.artifact import load_profile

    profile = load_profile(paths[0], lm.fingerprint)
    with _progress(console, clock) as update:
        preds, metrics = train_predictors(lm, profile, recall=recall, budget=budget, device=lm.device, progress=update)
        if check is not None:
            ppl = _sparse_ppl(lm, preds, *check[:2], update)
    if check is not None:
        dense = profile.meta["dense_ppl"]
        rise = ppl / dense - 1.0
        metrics.update(heldout_ppl=ppl, heldout_ppl_rise=rise)
        hint = (f"; above the {check[2]:.0%} budget: a larger --predictor-budget (up to 0.08) or --recall may help"
                if rise > check[2] else "")
        console.print(f"predictor-sparse held-out perplexity {dense:.3f} -> {ppl:.3f} ({rise:+.2%}){hint}")
    out = save_predictors(paths[0].with_name("predictors.safetensors"), preds)
    meta = dict(profile.meta, predictors=metrics)
    with atomic_path(paths[1]) as tmp:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
    return [out]


def _sparse_ppl(lm, preds, ids, window: int, update=None) -> float:
    """Perplexity of ids with every predicted layer's FFN restricted to its predicted neurons (the
    progress stage 'sparse ppl' counts its windows)."""
    from hotcold.models.perplexity import perplexity
    from hotcold.predictors.sparse import predicted_sparse
    from hotcold.profiler.calibrate import HELDOUT_BATCH

    update = update or (lambda *a: None)
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    update("sparse ppl", 0, len(ids) // window, "window")
    with predicted_sparse(lm.model, preds):
        return perplexity(lm.model, ids, window, bos, batch=HELDOUT_BATCH,
                          progress=lambda done, total: update("sparse ppl", done, total, "window")).ppl


class _progress:
    """A rich progress bar per stage: done of total in the stage's unit (tokens, evaluations, layers),
    its rate since the stage began (tok/s; s per evaluation or layer), and the time left; each
    update also goes to `clock` (a StageClock, shared between bars), which says where the time went."""

    def __init__(self, console, clock: "StageClock | None" = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console, transient=True)
        self.tasks: dict[str, int] = {}
        self.clock = clock if clock is not None else StageClock()

    def __enter__(self):
        self.bar.__enter__()
        return self.update

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def update(self, stage: str, done: int, total: int, unit: str = "tok") -> None:
        self.clock.update(stage, done)
        if stage not in self.tasks:  # stages report done=0 as they start: the clock starts there
            self.tasks[stage] = self.bar.add_task(stage, total=total or None, rate="")
        task = self.tasks[stage]
        self.bar.update(task, completed=done, total=total or None, rate=rate_text(
            done, self.bar.tasks[task].elapsed or 0.0, unit))


class StageClock:
    """Where a profile's time went: the time between two progress reports is the work the later one
    reports (a stage's start report, done=0, ends time spent outside any stage: loading, writing)."""

    def __init__(self, now=None):
        import time

        self.now = now or time.perf_counter
        self.last = self.now()
        self.spent: dict[str, float] = {}

    def update(self, stage: str, done: int) -> None:
        t = self.now()
        if done > 0:
            name = "allocation" if stage.startswith("allocation ") else stage  # its levels added up
            self.spent[name] = self.spent.get(name, 0.0) + t - self.last
        self.last = t

    def summary(self, total: float) -> str:
        """'profiled in 2 min 31 s: thresholds 4 s, perplexity 40 s, ..., other 12 s' (other: the rest)."""
        times = dict(self.spent, other=max(0.0, total - sum(self.spent.values())))
        whole = f"{int(total // 60)} min {total % 60:.0f} s" if total >= 60 else f"{total:.0f} s"
        return f"profiled in {whole}: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())


def rate_text(done: int, elapsed: float, unit: str) -> str:
    """'1,234 tok/s', or for slower units the seconds each took: '12.3 s/layer'; '' before the first."""
    if done <= 0 or elapsed <= 0:
        return ""
    if unit == "tok":
        return f"{done / elapsed:,.0f} tok/s"
    return f"{elapsed / done:.1f} s/{unit}" if elapsed >= done else f"{done / elapsed:.1f} {unit}s/s"
