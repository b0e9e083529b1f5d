"""`hotcold serve`: start uvicorn at once, load the model in the background, serve the OpenAI API."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Optional

import typer

from hotcold.errors import HotcoldError

log = logging.getLogger("hotcold.server")


def serve(
    model: Optional[Path] = typer.Argument(None, help="HF model folder or .gguf file "
                                                      "(default: the embedded Gemma 3 270M)"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for all interfaces)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="HOTCOLD_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    max_concurrency: int = typer.Option(8, "--max-concurrency", min=1,
                                        help="Most requests admitted (running + waiting); more get 429."),
    parallel: Optional[int] = typer.Option(None, "--parallel", min=1, help="Requests decoded together (continuous "
                                           "batching, on the CPU; a model on a GPU runs one at a time). Default: "
                                           "the plan's batch (`hotcold plan --batch N`), else 4."),
    cache_slots: Optional[int] = typer.Option(None, "--cache-slots", min=1, help="KV slots of --ctx tokens kept "
                                              "as a prefix cache, running ones included (default: 2 x --parallel; "
                                              "memory is committed as they fill)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on "
                                                             "GPU; on CPU float32, or a float16/bfloat16 "
                                                             "checkpoint's own dtype)"),
    ctx: Optional[int] = typer.Option(None, "--ctx", min=16, help="Context length (default: the model's, up to 4096)."),
    plan: Optional[Path] = typer.Option(None, "--plan", help="Plan to run by (default: the model's own, if any)."),
    no_plan: bool = typer.Option(False, "--no-plan", help="Ignore any plan: serve the dense model."),
    model_name: Optional[str] = typer.Option(None, "--model-name",
                                             help="Model id in /v1/models (default: the model file or folder name)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="Quantise an HF checkpoint's matrices at load: "
                                                                    "q8_0, q4_0 or q4_k."),
    gpu_int4: Optional[bool] = typer.Option(None, "--gpu-int4/--no-gpu-int4", help="On CUDA, keep a quantised "
                                            "model's 4-bit matrices 4-bit on the GPU or expand them (default: as "
                                            "the plan chose; without a plan, 4-bit where the GPU runs the int4 "
                                            "kernels)."),
    map_experts: bool = typer.Option(False, "--map-experts", help="By a plan, read a quantised MoE model's CPU "
                                     "experts in place from the file (no repacked copy: faster load, memory "
                                     "shared with the page cache; their kernel ~1.2x slower where the CPU's "
                                     "arithmetic, not memory, bounds it)."),
    defer_experts: bool = typer.Option(False, "--defer-experts", help="By a plan on CUDA, add each MoE layer's "
                                       "CPU experts to the residual one layer late, beside the next layer's GPU "
                                       "work (expert deferral): faster decoding, not the model's exact function."),
    no_sparse: bool = typer.Option(False, "--no-sparse", help="Without the profile's input sparsity (by default "
                                   "each projection skips the weights of its small inputs where the profile chose "
                                   "some): the model's exact function."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, models, health, metrics)."""
    import uvicorn

    from hotcold.models.loader import default_model_path, describe_model, resolve_device, resolve_dtype
    from hotcold.server.app import create_app
    from hotcold.server.engine import ServingEngine

    from hotcold.planner.plan import find_plan, read_plan_json

    path = (model if model is not None else default_model_path()).expanduser()
    info = describe_model(path)  # a missing, foreign or cut-off model file, said before the server starts
    resolve_dtype(dtype, resolve_device(device))  # bad options fail before the server starts
    if plan is not None:
        from hotcold.planner.plan import check_plan_path

        if no_plan:
            raise HotcoldError("--plan cannot be combined with --no-plan")
        check_plan_path(plan)
    if quantize is not None:
        from hotcold.models.quantized import QUANTIZE_TYPES

        if quantize not in QUANTIZE_TYPES:  # before the server starts
            raise HotcoldError(f"--quantize: unknown type '{quantize}' (use {', '.join(QUANTIZE_TYPES)})")
    plan_path = None if no_plan else find_plan(info.path, info.fingerprint, plan)
    parallel, warning = resolve_parallel(parallel, read_plan_json(plan_path) if plan_path is not None else None)
    name = model_name or (path.stem if path.is_file() else path.name)
    sock = _listen(host, port)

    _log_to_console()
    if warning:
        log.warning("%s", warning)
    log.info("serving %s as '%s' on http://%s:%d/v1 once it has loaded", path, name, host, sock.getsockname()[1])
    engine = ServingEngine(lambda: _open(path, plan, no_plan, device, dtype, quantize, gpu_int4, map_experts,
                                         input_sparse=not no_sparse, defer_experts=defer_experts),
                           max_concurrency, ctx, parallel=parallel, cache_slots=cache_slots)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, name, api_key), host=host, port=sock.getsockname()[1],
                                           log_level="info", timeout_graceful_shutdown=5))
    engine.start(on_fatal=lambda: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    if engine.load_error:
        raise HotcoldError(engine.load_error)


def resolve_parallel(parallel: Optional[int], plan_meta: Optional[dict]) -> tuple[int, Optional[str]]:
    """(sequences decoded together, a warning or None): --parallel where given, else the batch the
    plan was made for (`plan --batch N`), else DEFAULT_PARALLEL. The plan's budget holds the KV caches
    of its batch only (one sequence when made without --batch): a --parallel beyond it is warned of."""
    from hotcold.planner.plan import planned_batch
    from hotcold.server.engine import DEFAULT_PARALLEL

    if plan_meta is None:
        return parallel or DEFAULT_PARALLEL, None
    planned = planned_batch(plan_meta)
    if parallel is None:
        return planned or DEFAULT_PARALLEL, None
    held = planned or int(plan_meta.get("budget", {}).get("batch", 1))
    if parallel <= held:
        return parallel, None
    kv = f"the plan's budget holds the KV cache{'s' if held > 1 else ''} of {held} sequence{'s' if held > 1 else ''}"
    if plan_meta.get("mode") == "cpu":
        return parallel, (f"--parallel {parallel}: {kv}; {parallel} may not fit its RAM (`hotcold plan --batch "
                          f"{parallel}` accounts them)")
    return parallel, (f"--parallel {parallel}: {kv} in VRAM, so {parallel} may not fit there (`hotcold plan --batch "
                      f"{parallel}` accounts them); a model on a GPU runs one sequence at a time so far")


def _open(path: Path, plan: Optional[Path], no_plan: bool, device, dtype, quantize: Optional[str] = None,
          gpu_int4: Optional[bool] = None, map_experts: bool = False, input_sparse: bool = True,
          defer_experts: bool = False):
    """The model per its plan (hybrid) or dense, saying which in the log: the RunSetup, which the
    server's ServingEngine keeps until it stops (the hybrid engine must outlive the loading)."""
    from hotcold.executors.from_plan import open_for_run

    setup = open_for_run(path, plan, not no_plan, device, dtype, quantize=quantize, gpu_int4=gpu_int4,
                         map_experts=map_experts, input_sparse=input_sparse, defer_experts=defer_experts)
    for note in setup.notes:
        log.info("%s", note)
    return setup


def _log_to_console() -> None:
    """The server's own log lines, formatted like uvicorn's."""
    from uvicorn.logging import DefaultFormatter

    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket here so a taken port is a one-line error, not a uvicorn traceback."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise HotcoldError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
