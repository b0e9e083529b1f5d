"""Open a model the way `hotcold run`/`serve` use it: per its plan and predictors when they exist,
dense otherwise, saying which (never a silent fallback)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hotcold.errors import HotcoldError
from hotcold.machine import default_threads
from hotcold.models.load_times import LoadTimes
from hotcold.models.loader import (LoadedModel, describe_model, gpu_free_bytes, load_model, resolve_device,
                                   resolve_dtype, stored_half_dtype)
from hotcold.models.layout_cache import packed_for_decode

COMPILE_NOTE_S = 5.0  # host functions built for longer than this (compiled, not loaded from cache) get a note


@dataclass
class RunSetup:
    lm: LoadedModel
    engine: object | None = None  # HybridEngine when the model runs split
    plan: object | None = None  # planner.plan.Plan
    notes: list[str] = field(default_factory=list)
    load_times: LoadTimes = field(default_factory=LoadTimes)  # where the load's time went (run --stats)
    input_sparsity: object | None = None  # executors.input_sparse.InputSparsity when the run applies it

    def predicted_ms_per_token(self, position: float | None = None) -> float | None:
        """The plan's predicted decode step, at `position` cached positions if given (Plan.predicted_s_at)."""
        if self.plan is None:
            return None
        return 1000 * self.plan.predicted_s_at(position)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _graphed(lm: LoadedModel, times: LoadTimes) -> LoadedModel:
    """lm, its blocks' one-token attention replayed as CUDA graphs when it runs on CUDA (executors/graphs.py)."""
    if lm.device.type == "cuda":
        from hotcold.executors.graphs import graph_blocks

        with times.stage("graphs"):
            graph_blocks(lm.model)
    return lm


def run_dtype(path: Path, dtype: str | None, device: torch.device) -> torch.dtype:
    """The compute dtype of a run: --dtype, else on the CPU a half-precision checkpoint's own dtype
    (float32 would double the bytes every token reads and the RAM: a 7B-shaped float16 model on 2
    cores decoded 2x slower), else resolve_dtype's default. --quantize keeps float32 on the CPU."""
    if dtype in (None, "auto") and device.type == "cpu":
        half = stored_half_dtype(path)
        if half is not None:
            return half
    return resolve_dtype(dtype, device)


def _load_dense(path: Path, device, dtype, quantize: str | None, gpu_int4: bool, times: LoadTimes) -> LoadedModel:
    """The whole model on `device`: as load_model does, or with gpu_int4 on CUDA, loaded in its
    blocks on the host and moved with its 4-bit matrices kept 4-bit (Int4Linear)."""
    dev = resolve_device(device)
    if not (gpu_int4 and dev.type == "cuda"):
        if dev.type == "cpu" and not quantize:
            dtype = str(run_dtype(path, dtype, dev)).removeprefix("torch.")
        lm = load_model(path, device, dtype, quantize=quantize, times=times)
        if lm.device.type == "cpu":  # a quantised model's matrices interleaved for one-token GEMVs
            with times.stage("repack"):
                packed_for_decode(lm)  # (mapped from the layout cache after the first load)
        return _graphed(lm, times)
    from hotcold.executors.engine import _move_rest

    dt = resolve_dtype(dtype, dev)
    lm = load_model(path, "cpu", str(dt).removeprefix("torch."), quantized=True, quantize=quantize, times=times)
    with torch.no_grad(), times.stage("upload"):
        _move_rest(lm.model, dev, dt, int4=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    lm.device, lm.dtype = dev, dt
    return _graphed(lm, times)


def _whole_moe_applies(info, device) -> bool:
    """Whether a model run whole on `device` takes `_whole_moe`: a MoE model on a CUDA GPU."""
    cfg = info.config
    return resolve_device(device).type == "cuda" and any(cfg.ffn_kind(l) == "moe" for l in range(cfg.num_layers))


def _whole_moe(path: Path, dev: torch.device, dtype: str | None, quantize: str | None, threads: int | None,
               stats: bool, times: LoadTimes, notes: list[str]) -> RunSetup:
    """A MoE model whole on a CUDA GPU, 4-bit, through the split engine with every expert and neuron
    on the fast tier: the experts keep their 4-bit codes (Q4Stack, about the file's bytes) and a
    token's routed experts run in two Triton kernels a layer without the host reading the routing,
    where the dense model would expand every expert to the dtype (3.5x the file) and loop over a
    token's experts in Python behind a host sync each layer. The embedding table goes to the GPU too
    (in the dtype; llama.cpp keeps it on the host): looked up on the host, each step's token would be
    read there first, a sync that leaves the GPU idle while the next step's graph is launched."""
    from hotcold.executors.engine import build_engine
    from hotcold.executors.options import EngineOptions, Placement

    dt = resolve_dtype(dtype, dev)
    lm = load_model(path, "cpu", str(dt).removeprefix("torch."), quantize=quantize, times=times)
    cfg, layers = lm.config, range(lm.config.num_layers)
    placement = Placement(hot={l: torch.arange(cfg.intermediate_size) for l in layers if cfg.ffn_kind(l) != "moe"},
                          gpu_experts={l: list(range(cfg.num_experts)) for l in layers if cfg.ffn_kind(l) == "moe"},
                          gpu_int4=True)
    engine = build_engine(lm, placement, None, EngineOptions(device=dev, dtype=dt, threads=threads, stats=stats), times)
    notes.append("a MoE model whole on the GPU: its experts keep their 4-bit blocks, a token's routed experts "
                 "run in two kernels a layer")
    return RunSetup(lm, engine, notes=notes)


def dense_int4_default(path: Path, quantize: str | None, device: torch.device) -> bool:
    """Whether a run without a plan keeps a quantised model's 4-bit matrices int4 on device by default:
    a GPU that runs torch's int4 kernels, and Q4_0/Q4_1/Q4_K matrices (a GGUF's own, or --quantize
    q4_0|q4_k). They hold 0.31x the VRAM of bfloat16 (a 7B Q4 file fits an 8 GB card only so) and
    multiply one token 1.35-1.6x faster; a long prompt's prefill is slower (sparse_ops/gpu_quant.py)."""
    from hotcold.sparse_ops.gpu_quant import INT4_QTYPES, cuda_int4_available

    if device.type != "cuda" or not cuda_int4_available(device):
        return False
    if quantize:
        return quantize.upper() in INT4_QTYPES
    if not Path(path).is_file():
        return False
    from hotcold.models.gguf_loader import open_gguf

    return any(kept and qtype in INT4_QTYPES for _, qtype, _, _, kept in open_gguf(path).tensor_storage())


def whole_gpu_floor(path: Path, dtype: torch.dtype, quantize: str | None) -> int:
    """The fewest bytes the model's weights take run whole on a GPU: Q4_0/Q4_1/Q4_K matrices kept 4-bit
    (4 bits, and an fp16 scale and zero per 32 weights: 5 bits a weight), every other weight in dtype."""
    from hotcold.sparse_ops.gpu_quant import INT4_QTYPES

    if Path(path).is_file():
        from hotcold.models.gguf_loader import open_gguf

        return sum(n * 5 // 8 if qtype in INT4_QTYPES else n * dtype.itemsize
                   for _, qtype, n, _, _ in open_gguf(path).tensor_storage())
    per = 5 / 8 if quantize and quantize.upper() in INT4_QTYPES else dtype.itemsize
    return int(describe_model(path).params * per)


def check_whole_gpu(path: Path, device: str | None, dtype: str | None, quantize: str | None) -> None:
    """A run without a plan puts the whole model on the GPU: refuse in one line, before loading, a
    model whose weights alone cannot fit the GPU's free memory (a 30B MoE file on a 12 GB card), where
    the load would run for minutes and then fail."""
    dev = resolve_device(device)
    free = gpu_free_bytes(device) if dev.type == "cuda" else None
    if free is None:
        return
    need = whole_gpu_floor(path, resolve_dtype(dtype, dev), quantize)
    if need > free:
        name = Path(path).name
        raise HotcoldError(f"{name}: without a plan the whole model goes on the GPU, and its weights need at least "
                           f"{need / 2**30:.1f} GiB where the GPU has {free / 2**30:.1f} GiB free; split it between "
                           f"GPU and CPU (`hotcold profile {name}`, then `hotcold plan {name} --vram SIZE`), or run "
                           "it on the CPU (--device cpu)")


def _prefill_costs(kind: str):
    """This machine's rates for prefill's cost rule, from its cached hardware profile (`hotcold
    probe`, or the one `hotcold plan` made); None (the defaults) when there is none."""
    from hotcold.executors.prefill import PrefillCosts
    from hotcold.planner.hardware import hardware_path, read_hardware

    path = hardware_path()
    try:
        return PrefillCosts.from_hardware(read_hardware(path), kind) if path.is_file() else None
    except HotcoldError:
        return None


def open_for_run(path: Path, plan: Path | None = None, use_plan: bool = True, device: str | None = None,
                 dtype: str | None = None, threads: int | None = None, stats: bool = False,
                 quantize: str | None = None, gpu_int4: bool | None = None,
                 compile_announced: bool = False, input_sparse: bool = True, map_experts: bool = False,
                 defer_experts: bool = False) -> RunSetup:
    """Load `path` per its plan (`plan` names one; otherwise the model's own, if any). quantize: see
    `load_model` (HF checkpoints quantised at load). gpu_int4: on CUDA, a quantised model's 4-bit
    matrices stay 4-bit on the GPU, the split FFNs' hot rows included (see make_hybrid); a plan made
    with --gpu-int4 turns it on, and says whether W_down's hot columns are requantised too; None
    (default): the plan's choice, or without a plan `dense_int4_default`; False: expanded unless the
    plan counted int4 (its GPU bytes assume it). compile_announced: the caller said up front that the
    CPU kernels are being compiled (kernel_cache.cold_kernels); no second note after the build.
    input_sparse: apply the profile's input sparsity (executors/input_sparse.py) where it chose some, to
    a dense run (a plan's split engine runs without it so far, and says so). map_experts: a plan's CPU
    experts of a quantised MoE model read in place from the file (EngineOptions.map_experts).
    defer_experts: a plan's CPU experts join the residual one layer late (EngineOptions.defer_experts).
    The setup's load_times says where the time went."""
    times = LoadTimes()
    setup = _open_timed(times, path, plan, use_plan, device, dtype, threads, stats, quantize, gpu_int4,
                        compile_announced, map_experts, defer_experts)
    with times.stage("split"):
        _input_sparsity(setup, input_sparse)
    if defer_experts and not (setup.engine is not None and any(m.defer_host() for m in setup.engine.moe.values())):
        setup.notes.append("--defer-experts: no layer defers its experts (that needs a plan's MoE layers with CPU "
                           "experts on CUDA, quantised whole, and no --stats)")
    setup.load_times = times.finish()
    return setup


def _input_sparsity(setup: RunSetup, enabled: bool) -> None:
    """Apply the profile's input sparsity to a dense run, noting what was done (a planned run notes
    that it runs without)."""
    from hotcold.executors.input_sparse import open_input_sparsity

    if setup.engine is not None or (setup.plan is not None and not setup.plan.splits_nothing):
        if enabled and setup.lm.path is not None:
            from hotcold.profiler.artifact import find_profile, load_profile

            path = find_profile(setup.lm.path, setup.lm.fingerprint)
            meta = load_profile(path, setup.lm.fingerprint).meta if path is not None else {}
            if meta.get("input_sparsity", {}).get("chosen", 0) > 0:
                setup.notes.append("the profile's input sparsity is not applied with a plan yet (--no-plan runs it)")
        return
    setup.input_sparsity, note = open_input_sparsity(setup.lm, enabled)
    if note:
        setup.notes.append(note)


def _open_timed(times: LoadTimes, path: Path, plan: Path | None, use_plan: bool, device: str | None,
                dtype: str | None, threads: int | None, stats: bool, quantize: str | None,
                gpu_int4: bool | None, compile_announced: bool, map_experts: bool = False,
                defer_experts: bool = False) -> RunSetup:
    """open_for_run, each stage's time added to `times`."""
    from hotcold.planner.plan import find_plan, load_plan

    with times.stage("parse"):
        info = describe_model(path)
        plan_path = find_plan(info.path, info.fingerprint, plan) if use_plan else None
    if plan_path is None:
        check_whole_gpu(info.path, device, dtype, quantize)
        split = ("`hotcold profile MODEL` then `hotcold plan MODEL --vram SIZE` split it between GPU and CPU"
                 if resolve_device(device).type == "cuda" else
                 "`hotcold profile MODEL` then `hotcold plan MODEL` plan it for this machine's CPU")
        notes = [f"no plan for this model: running dense ({split})"] if use_plan else []
        if gpu_int4 is None:
            gpu_int4 = dense_int4_default(info.path, quantize, resolve_device(device))
            if gpu_int4:
                notes.append("its Q4_0/Q4_1/Q4_K matrices stay 4-bit on the GPU (torch's int4 kernels; "
                             "--no-gpu-int4 expands them)")
        if gpu_int4 and _whole_moe_applies(info, device):
            return _whole_moe(path, resolve_device(device), dtype, quantize, threads, stats, times, notes)
        return RunSetup(_load_dense(path, device, dtype, quantize, gpu_int4, times), notes=notes)
    with times.stage("parse"):
        p = load_plan(plan_path, info.fingerprint)
    dev = resolve_device(device)
    if p.gpu_int4:  # planned with int4 GPU weights: its GPU bytes assume it
        gpu_int4 = True
    gpu_int4 = bool(gpu_int4)
    if p.mode == "gpu":
        if quantize and not gpu_int4:
            raise HotcoldError("--quantize keeps weights in host memory; this model's plan puts all of it on the GPU "
                               "(re-plan, drop --quantize, or add --gpu-int4)")
        notes = [f"plan {plan_path}: the whole model on the GPU"]
        if gpu_int4 and _whole_moe_applies(info, device):
            setup = _whole_moe(path, resolve_device(device), dtype, quantize, threads, stats, times, notes)
            setup.plan = p
            return setup
        return RunSetup(_load_dense(path, device, dtype, quantize, gpu_int4, times), plan=p, notes=notes)
    notes = [f"plan {plan_path}: {p.mode}, predicted {p.predicted_tok_per_s:.1f} tok/s"]
    if p.splits_nothing:  # the dense engine's fused step (and input sparsity) is the faster way to run it
        notes.append("no layer asks a predictor: the model runs whole on the CPU")
        return RunSetup(_load_dense(path, "cpu", dtype, quantize, False, times), plan=p, notes=notes)
    if dev.type == "cuda" and p.mode == "cpu":
        notes.append("the plan is all-CPU; running it on the CPU")
        dev = torch.device("cpu")
    run_threads = threads or default_threads(dev.type == "cuda")
    if p.cpu_threads and p.cpu_threads != run_threads:  # memory-bound kernels read at another rate
        notes.append(f"the plan's CPU rates were measured with {p.cpu_threads} threads and this run takes "
                     f"{run_threads}: its prediction does not hold (`hotcold probe --threads {run_threads} --json "
                     "> hw.json`, then `hotcold plan MODEL --hardware hw.json`)")
    if p.mode == "hybrid" and dev.type != "cuda":
        notes.append("the plan splits between GPU and CPU but no CUDA GPU is in use: the CPU is the fast tier")
    dt = run_dtype(path, dtype, dev) if not quantize else resolve_dtype(dtype, dev)
    # Load on the host in the compute dtype; build_engine moves the fast tier's part to the device.
    lm = load_model(path, "cpu", str(dt).removeprefix("torch."), quantize=quantize, times=times)
    from hotcold.executors import host_node
    from hotcold.executors.engine import build_engine
    from hotcold.executors.options import EngineOptions, Placement
    from hotcold.predictors.artifact import find_predictors, load_predictors

    cuda = dev.type == "cuda"
    placement = Placement.of_plan(p, cuda, gpu_int4)
    with times.stage("parse"):
        pred_path = find_predictors(lm.path, lm.fingerprint)
        preds = load_predictors(pred_path, lm.fingerprint) if pred_path is not None else None
    if preds is None:
        notes.append("no predictors for this model: every cold neuron is computed (run `hotcold profile MODEL`)")
    cpu_dtype = {torch.float16: "f16", torch.float32: "bf16"}.get(dt, "bf16")
    if placement.expert_cache_bytes:
        from hotcold.executors.expert_cache import ExpertCache, slot_kind
        from hotcold.models.quantized import QuantExperts

        quant = any(isinstance(m, QuantExperts) for m in lm.model.modules())
        one = ExpertCache.slot_bytes(lm.config.moe_intermediate_size, lm.config.hidden_size,
                                     slot_kind(cpu_dtype, dt, quant))
        if placement.expert_cache_bytes < one:
            notes.append(f"the plan's expert cache ({placement.expert_cache_bytes} B) holds no expert ({one} B each): "
                         "running without it")
            placement = dataclasses.replace(placement, expert_cache_bytes=0)
        else:
            notes.append(f"expert cache: {placement.expert_cache_bytes // one} experts on the GPU, filled by "
                         "look-ahead prefetch")
    options = EngineOptions(device=dev, dtype=dt, cpu_dtype=cpu_dtype, threads=threads, stats=stats,
                            costs=_prefill_costs(cpu_dtype), map_experts=map_experts, defer_experts=defer_experts,
                            expert_stream_bytes=p.expert_stream_bytes)
    built = host_node.BUILD_S[0]
    engine = build_engine(lm, placement, preds, options, times)
    for why, ls in engine.int4_skipped().items():
        names = ", ".join(map(str, ls[:8])) + (f" ... ({len(ls)} layers)" if len(ls) > 8 else "")
        notes.append(f"--gpu-int4: the hot FFN rows of layer{'s' * (len(ls) > 1)} {names} are expanded to "
                     f"{str(dt).removeprefix('torch.')}: {why}")
    built = host_node.BUILD_S[0] - built
    if built > COMPILE_NOTE_S and not compile_announced:  # numba's cache was cold (and the caller had not said so)
        notes.append(f"compiled the CPU kernels for this machine in {built:.0f} s; later runs load them from "
                     "numba's cache")
    return RunSetup(lm, engine, p, notes)
