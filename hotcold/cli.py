"""The `hotcold` command line. Errors are one line and exit code 2 unless --debug is given."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from hotcold import __version__
from hotcold.errors import HotcoldError

app = typer.Typer(
    name="hotcold",
    help="Run language models too large for your GPU: hot neurons on the GPU, cold ones on the CPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
_state = {"debug": False}

ModelArg = typer.Argument(None, help="HF model folder or .gguf file (default: the embedded Gemma 3 270M)")
DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)")
DtypeOpt = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on GPU; on CPU "
                                               "float32, for `run` a float16/bfloat16 checkpoint's own dtype)")
ThreadsOpt = typer.Option(None, "--threads", min=1, help="CPU threads, torch's and the CPU kernels' (default: about "
                                                           "one a core; where the model runs split with a GPU, "
                                                           "two fewer than the CPUs at most).")
QuantizeOpt = typer.Option(None, "--quantize", help="Quantise an HF checkpoint's matrices at load: q8_0, q4_0 or q4_k "
                                                    "(GGUF files keep their own quantisation).")
MapExpertsOpt = typer.Option(False, "--map-experts", help="By a plan, read a quantised MoE model's CPU experts in "
                             "place from the file (no repacked copy: faster load, memory shared with the page "
                             "cache; their kernel ~1.2x slower where the CPU's arithmetic, not memory, bounds it).")
DeferExpertsOpt = typer.Option(False, "--defer-experts", help="By a plan on CUDA, add each MoE layer's CPU "
                               "experts to the residual one layer late, so the CPU computes them while the GPU "
                               "runs the next layer (KTransformers' expert deferral): faster decoding, not the "
                               "model's exact function (docs/architecture.md says how far it moves).")
GpuInt4Opt = typer.Option(None, "--gpu-int4/--no-gpu-int4", help="On CUDA, keep a quantised model's Q4_0/Q4_1/Q4_K "
                          "matrices 4-bit on the GPU (torch's int4 kernels) or expand them to --dtype. Default: as "
                          "the plan chose; without a plan, 4-bit where the GPU runs the int4 kernels.")


def _version(value: bool) -> None:
    if value:
        print(f"hotcold {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    _state["debug"] = debug


def _load(model: Optional[Path], device: Optional[str], dtype: Optional[str], threads: Optional[int] = None,
          quantize: Optional[str] = None):
    import torch

    from hotcold.models.loader import default_model_path, load_model

    if threads:
        torch.set_num_threads(threads)
    return load_model(model if model is not None else default_model_path(), device, dtype, quantize=quantize)


SparseOpt = typer.Option(None, "--sparse/--no-sparse",
                         help="--sparse: compute each FFN only over the neurons its predictor expects to fire (needs "
                              "`hotcold profile MODEL` first). --no-sparse: no sparsity at all. Default: the "
                              "profile's input sparsity (every projection skips the weights of its small inputs), "
                              "where the profile chose some.")


def _sparse(lm, sparse: bool):
    """Context in which the model runs predictor-sparse (or a no-op); yields {layer: wrapper} or None."""
    import contextlib

    if not sparse:  # None (the default) or False
        return contextlib.nullcontext(None)
    from hotcold.predictors.artifact import find_predictors, load_predictors
    from hotcold.predictors.sparse import predicted_sparse

    path = find_predictors(lm.path, lm.fingerprint)
    if path is None:
        raise HotcoldError(f"{lm.path}: no predictors for this model; run `hotcold profile {lm.path}` first "
                           "(or drop --sparse)")
    return predicted_sparse(lm.model, load_predictors(path, lm.fingerprint))


def _selected_fraction(wrapped) -> str:
    if not wrapped:
        return ""
    sel = sum(w.selected for w in wrapped.values())
    total = sum(w.tokens * w.predictor.w2.out_features for w in wrapped.values())
    return f", sparse: {sel / max(1, total):.1%} of FFN neurons computed"


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise HotcoldError(f"{path}: no such file; --data takes a UTF-8 .txt file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HotcoldError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@app.command()
def run(
    model: Optional[Path] = ModelArg,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; without it, an interactive chat."),
    chat: bool = typer.Option(False, "--chat", help="Wrap --prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for chat."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, "--temperature", "-t", min=0.0, help="0 for greedy."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(40, "--top-k", min=0, help="0 turns it off."),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context length (default: the model's, up to 4096 in chat)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence (benchmarks)."),
    sparse: Optional[bool] = SparseOpt,
    plan: Optional[Path] = typer.Option(None, "--plan", help="Plan to run by (plan.safetensors or its folder; "
                                                              "default: the model's own, when `hotcold plan` made one)."),
    no_plan: bool = typer.Option(False, "--no-plan", help="Ignore any plan: run the dense model."),
    stats: bool = typer.Option(False, "--stats", help="Per-token time split into the fast tier (the GPU, where "
                                                      "there is one), CPU, transfer and wait, beside the plan's "
                                                      "prediction; and the load's time per stage."),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    quantize: Optional[str] = QuantizeOpt,
    gpu_int4: Optional[bool] = GpuInt4Opt,
    map_experts: bool = MapExpertsOpt,
    defer_experts: bool = DeferExpertsOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", metavar="FILE",
                                               help="Constrain the reply to JSON that follows the JSON schema in "
                                                    "FILE (with --prompt)."),
) -> None:
    """Generate text, streamed to the terminal, or chat interactively without --prompt."""
    from hotcold.models.generate import Generator
    from hotcold.models.sampling import SamplingParams

    if prompt is None and as_json:  # before the model loads
        raise HotcoldError("--json needs --prompt")
    schema = _read_schema(json_schema, prompt) if json_schema is not None else None
    setup = _open(model, plan, no_plan or bool(sparse), device, dtype, threads, stats, quantize, gpu_int4,
                  input_sparse=sparse is None, map_experts=map_experts, defer_experts=defer_experts)
    lm = setup.lm
    try:
        if lm.tokenizer is None:
            raise HotcoldError(f"{lm.path}: no tokenizer.json in the model folder; hotcold run needs a tokenizer")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repeat_penalty)
        gen = Generator(lm, max_context=ctx)
        with _sparse(lm, sparse) as wrapped:
            if prompt is None:
                if as_json:
                    raise HotcoldError("--json needs --prompt")
                _announce(setup)
                _interactive(gen, params, max_tokens, seed, stop, system)
                return
            _complete(gen, prompt, chat, system, params, max_tokens, stop, seed, ignore_eos, as_json, wrapped,
                      lambda: _first_token(setup, stats), schema)
        if stats:
            _print_stats(setup, gen.stats)
    finally:
        setup.close()


def _open(model: Optional[Path], plan: Optional[Path], dense: bool, device, dtype, threads, stats: bool,
          quantize: Optional[str] = None, gpu_int4: Optional[bool] = None, input_sparse: bool = True,
          map_experts: bool = False, defer_experts: bool = False):
    """The model per its plan (or dense), with the notes saying which printed to stderr."""
    import torch

    from hotcold.executors.from_plan import open_for_run
    from hotcold.models.loader import default_model_path

    if threads:
        torch.set_num_threads(threads)
    if dense and plan is not None:
        raise HotcoldError("--plan cannot be combined with --no-plan or --sparse")
    _check_load_options(device, dtype, quantize)
    path = model if model is not None else default_model_path()
    compiling = _compile_note(device)
    with _loading(path):
        setup = open_for_run(path, plan, not dense, device, dtype, threads, stats, quantize, gpu_int4,
                             compile_announced=compiling, input_sparse=input_sparse, map_experts=map_experts,
                             defer_experts=defer_experts)
    return setup


def _compile_note(device) -> bool:
    """On the CPU, before anything loads: whether numba must compile the CPU kernels (its cache is cold:
    a first run on this machine, or after an upgrade), said at once since it takes about half a minute."""
    from hotcold.executors.kernel_cache import COMPILE_NOTE, cold_kernels
    from hotcold.models.loader import resolve_device

    if resolve_device(device).type != "cpu" or not cold_kernels():
        return False
    print(f"note: {COMPILE_NOTE}", file=sys.stderr, flush=True)
    return True


def _check_load_options(device, dtype, quantize) -> None:
    """--device, --dtype and --quantize checked before anything loads."""
    from hotcold.models.loader import resolve_device, resolve_dtype

    resolve_dtype(dtype, resolve_device(device))
    if quantize is not None:
        from hotcold.models.quantized import QUANTIZE_TYPES

        if quantize not in QUANTIZE_TYPES:
            raise HotcoldError(f"--quantize: unknown type '{quantize}' (use {', '.join(QUANTIZE_TYPES)})")


def _loading(path: Path):
    """A transient 'loading' line on stderr while a model loads, where stderr is a terminal (a large
    model takes tens of seconds, a first run longer while it compiles the CPU kernels)."""
    from contextlib import nullcontext

    from rich.console import Console

    err = Console(stderr=True)
    return err.status(f"loading {Path(path).name} ...") if err.is_terminal else nullcontext()


def _announce(setup) -> None:
    """How the model runs (plan or dense), on stderr, once the request is known to be valid."""
    for note in setup.notes:
        print(f"note: {note}", file=sys.stderr)


def _first_token(setup, stats: bool) -> None:
    """At the first token: the notes, and with --stats the engine's counts restarted, so that they
    cover the decode steps the measured rate covers (on CUDA the first step is queued before the
    first token is read; it also compiles or loads the one-token kernels on a fresh machine, which
    had put 104 ms of 'CPU attention/predictors' per token beside a measured 46)."""
    _announce(setup)
    if stats and setup.engine is not None:
        setup.engine.reset_stats()


def _print_stats(setup, gen_stats) -> None:
    """--stats: where a decoded token's time went, and the plan's prediction beside it."""
    from hotcold.executors.stats import huge_page_share

    print(f"[stats] {setup.load_times.line()}", file=sys.stderr)
    measured = 1000 / gen_stats.decode_tok_per_s if gen_stats.decode_tok_per_s else float("nan")
    line = f"[stats] decode {measured:.2f} ms/token measured"
    if setup.engine is not None:
        d = setup.engine.stats()["decode"]
        t = d["per_token"]
        # the fast tier is the GPU only where there is one: on the CPU device both tiers are CPU threads
        fast, slow = ("GPU", "CPU") if setup.engine.tier.cuda else ("fast tier (CPU)", "CPU worker")
        line += (f" ({d['tokens']} steps timed): {fast} {t['gpu_ms']:.2f} ms, {slow} {t['cpu_ms']:.2f} ms, "
                 f"transfer {t['transfer_ms']:.2f} ms, wait {t['wait_ms']:.2f} ms, "
                 f"CPU attention/predictors {t['host_ms']:.2f} ms; rows per token {fast} {t['rows_gpu']:.0f}, "
                 f"{slow} {t['rows_cpu']:.0f}")
        if t.get("experts_gpu") or t.get("experts_cpu"):
            line += f"; experts per token {fast} {t['experts_gpu']:.1f}, {slow} {t['experts_cpu']:.1f}"
            if d.get("cache_hit_rate") is not None:
                line += f"; expert cache hit rate {d['cache_hit_rate']:.0%}"
            if d.get("lookahead_recall") is not None:
                line += f", look-ahead recall {d['lookahead_recall']:.0%}"
        if measured == measured and measured > 0:  # idle: the token's time outside the GPU spans / the worker's compute
            line += (f"; idle {fast} {max(0.0, 1 - t['gpu_ms'] / measured):.0%}, "
                     f"CPU worker {max(0.0, 1 - (t['cpu_ms'] + t['host_ms']) / measured):.0%}")
        eng = setup.engine
        graphed = any(getattr(f, "host_nodes", False) for f in (*eng.moe.values(), *eng.layers.values())) or \
            any(getattr(b, "graphs", False) for b in eng.lm.model.layers)
        if eng.tier.cuda and graphed:
            line += "; timed with the CPU parts run eagerly (without --stats they run as host nodes of CUDA graphs)"
    else:
        line += " (dense: no GPU/CPU split)" if _on_cuda(setup) else " (dense: the whole model on the CPU)"
    achieved = setup.input_sparsity.achieved() if setup.input_sparsity is not None else None
    if achieved is not None:
        line += f"; input sparsity: {achieved:.1%} of the thresholded projections' inputs skipped (by weights)"
    mem = huge_page_share()
    if mem is not None:  # weights copied to 4 KiB pages read slower: a low share explains a slow run
        line += (f"; host memory {mem[0] / 2**30:.1f} GiB resident, {mem[1] / 2**30:.1f} GiB anonymous, "
                 f"{mem[2] / max(mem[1], 1):.0%} of that in huge pages")
    # the steps timed read on average this many cached positions (the plan assumed half its --ctx)
    position = gen_stats.prompt_tokens + gen_stats.completion_tokens / 2
    predicted = setup.predicted_ms_per_token(position)
    if predicted is not None:
        line += f"; plan predicted {predicted:.2f} ms/token at this context ({position:.0f} positions)"
    print(line, file=sys.stderr)


def _on_cuda(setup) -> bool:
    return getattr(setup.lm.device, "type", "cpu") == "cuda"


def _read_schema(path: Path, prompt: Optional[str]) -> dict:
    """--json-schema's file, read and checked before the model loads."""
    from hotcold.server.constrain import check_schema

    if prompt is None:
        raise HotcoldError("--json-schema needs --prompt")
    if not path.is_file():
        raise HotcoldError(f"{path}: no such file; --json-schema takes a JSON schema file")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise HotcoldError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise HotcoldError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                           "--json-schema takes a JSON schema file") from None
    check_schema(schema, f"{path}")
    return schema


def _complete(gen, prompt, chat, system, params, max_tokens, stop, seed, ignore_eos, as_json, wrapped,
              announce=lambda: None, schema: Optional[dict] = None) -> None:
    """One completion of --prompt, streamed (or as one JSON object); with `schema`, JSON that follows it."""
    lm = gen.lm
    tok = lm.tokenizer
    if chat or system:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    constraint = None
    if schema is not None:
        from hotcold.server.constrain import compile_json

        constraint = compile_json(tok, lm.config.vocab_size, schema, "--json-schema").matcher()
    text = []
    for i, event in enumerate(gen.generate(ids, max_tokens, params, stop=stop, seed=seed, ignore_eos=ignore_eos,
                                           constraint=constraint)):
        if i == 0:
            announce()
        text.append(event.text)
        if not as_json:
            print(event.text, end="", flush=True)
    s = gen.stats
    if as_json:
        print(json.dumps({
            "text": "".join(text), "token_ids": s.token_ids, "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens, "finish_reason": s.finish_reason,
            "ttft_s": round(s.ttft_s, 4), "decode_tok_per_s": round(s.decode_tok_per_s, 2),
            "sparse": bool(wrapped),
        }))
    else:
        print(flush=True)
        print(f"[{s.prompt_tokens} prompt tokens, {s.completion_tokens} generated, ttft {s.ttft_s:.2f} s, "
              f"{s.decode_tok_per_s:.1f} tok/s, {s.finish_reason}{_selected_fraction(wrapped)}]", file=sys.stderr)


def _interactive(gen, params, max_tokens: int, seed, stop, system: Optional[str]) -> None:
    """A chat loop on the terminal; the KV cache keeps the conversation so far."""
    tok = gen.lm.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    print(f"hotcold chat with {gen.lm.name} ({tok.template_source} template). Empty line or Ctrl-D to quit.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not line.strip():
            return
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        reply = []
        for event in gen.generate(ids, max_tokens, params, stop=stop, seed=seed):
            reply.append(event.text)
            print(event.text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


@app.command()
def perplexity(
    model: Optional[Path] = ModelArg,
    data: Optional[Path] = typer.Option(None, "--data", help="UTF-8 text file (default: Python's documentation text)."),
    ctx: int = typer.Option(512, "--ctx", min=4, help="Window length in tokens; each window's second half is scored."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Score at most this many windows."),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    sparse: Optional[bool] = SparseOpt,
    threads: Optional[int] = ThreadsOpt,
    quantize: Optional[str] = QuantizeOpt,
    as_json: bool = typer.Option(False, "--json", help='Print {"ppl", "tokens_scored", "ctx"} as JSON.'),
) -> None:
    """Perplexity over non-overlapping windows, as llama-perplexity computes it."""
    from rich.progress import Progress

    from hotcold.models.perplexity import calibration_text, perplexity as compute

    _check_load_options(device, dtype, quantize)
    text = _read_text(data) if data else None  # a bad --data path is reported before the model loads
    lm = _load(model, device, dtype, threads, quantize)
    if lm.tokenizer is None:
        raise HotcoldError(f"{lm.path}: no tokenizer.json in the model folder; perplexity needs a tokenizer")
    if not sparse:
        from hotcold.executors.input_sparse import open_input_sparsity

        note = open_input_sparsity(lm, sparse is None)[1]
        if note and not as_json:
            print(f"note: {note}", file=sys.stderr)
    text = text if text is not None else calibration_text()
    ids = lm.tokenizer.encode(text)
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    with Progress(transient=True, disable=as_json) as bar, _sparse(lm, sparse) as wrapped:
        windows = len(ids) // ctx if chunks is None else min(len(ids) // ctx, chunks)
        task = bar.add_task("perplexity", total=windows or None)  # windows of --ctx tokens, known up front
        result = compute(lm.model, ids, ctx, bos, chunks, lambda done, total: bar.update(task, completed=done, total=total))
    if as_json:
        print(json.dumps({"ppl": result.ppl, "tokens_scored": result.tokens_scored, "ctx": ctx, "windows": result.windows,
                          "sparse": bool(sparse)}))
    else:
        print(f"perplexity {result.ppl:.4f} over {result.tokens_scored} tokens ({result.windows} windows of {ctx})"
              f"{_selected_fraction(wrapped)}")


def _register_stage_commands() -> None:
    """Commands whose code lives with their stage (server/); their heavy imports stay inside them."""
    from hotcold.planner.command import plan, probe
    from hotcold.profiler.command import profile
    from hotcold.server.command import serve

    app.command()(profile)
    app.command()(probe)
    app.command()(plan)
    app.command()(serve)


_register_stage_commands()


def _click_exceptions():
    """click's exception classes as typer raises them (typer >= 0.2x vendors click as typer._click)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def _usage_line(e, ex) -> str:
    """A usage error as one line: the option and what is wrong with its value, or the parser's message
    (typer adds 'Did you mean ...?' to a mistyped command), and where the options are listed."""
    msg = e.format_message()
    if isinstance(e, ex.BadParameter) and not isinstance(e, ex.MissingParameter):
        hint = e.param_hint if e.param_hint is not None else (e.param.get_error_hint() if e.param else None)
        first = (hint.split(" / ") if isinstance(hint, str) else list(hint or [""]))[0]
        name = first.strip("'\"")  # the option's long name, as given in the usage
        msg = f"{name}: {e.message[:1].lower()}{e.message[1:]}" if name else e.message
    msg = " ".join(str(msg).split()).rstrip(".")
    if e.ctx is None:
        return msg
    listed = "options" if e.ctx.parent is not None else "commands"
    return f"{msg} (`{e.ctx.command_path} --help` lists the {listed})"


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point. A usage mistake or a HotcoldError -> one line on stderr, exit 2; an
    unexpected failure -> one line, exit 1; --debug shows the traceback instead."""
    ex = _click_exceptions()
    args = list(sys.argv[1:] if argv is None else argv)
    _state["debug"] = "--debug" in args
    try:
        code = typer.main.get_command(app).main(args, prog_name="hotcold", standalone_mode=False)
    except getattr(ex, "NoArgsIsHelpError", ()) as e:  # `hotcold` alone: the help (click >= 8.2)
        print(e.format_message())
        code = 0
    except ex.UsageError as e:
        if _state["debug"]:
            raise
        print(f"error: {_usage_line(e, ex)}", file=sys.stderr)
        code = 2
    except HotcoldError as e:
        if _state["debug"]:
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except (KeyboardInterrupt, typer.Abort):
        code = 130
    except ex.ClickException as e:
        print(f"error: {e.format_message()}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:  # an unexpected failure: still one line unless --debug
        if _state["debug"]:
            raise
        print(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        code = 1
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
