"""The hardware probe: what this machine can do, measured once and cached per host.

`probe()` measures, with the kernels the runtime uses:
  CPU   threads, RAM total/available; with `hotcold.sparse_ops.cpu` (numba): rows gathered per second by
        `gemv_rows` (1/8 of the rows selected), neurons per second by the fused gated `ffn_rows`
        (1/8 selected, 3 rows per neuron) and the dense `gemv` read rate, each per storage kind
        (f32, bf16, f16, i8), and the same for GGUF blocks (`sparse_ops.quant`: q8_0 ... q6_k, the fused
        FFN with W_down as Q8_0, bytes counted as stored), plus whole MoE experts of each block type
        (`qexperts`, EXPERTS_PER_CALL experts a call, as decoding computes a token's CPU experts; this
        also compiles that kernel into numba's cache, ~20 s once, so the first run does not pay
        it); the cost of one kernel call; a Python thread hand-off round trip
        (main thread -> CPU worker -> main thread, what every hybrid layer pays).
  GPU   (CUDA only) name, total and free memory, device copy bandwidth (read + write bytes),
        GEMV weight-stream bandwidth (bf16), host<->device copies pinned and pageable, a small
        round trip (8 KiB there, one op, back, synchronise), launch + synchronise, and the
        per-kernel launch cost when kernels are queued back to back.
Without CUDA the GPU fields are null and plans are all-CPU. Bandwidths are bytes per second, times
seconds. The result is JSON in `$HOTCOLD_HOME/hardware-<host>.json` (default `~/.cache/hotcold`).

The profile's type, the presets of other machines and the cache files are planner/hardware.py's.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from hotcold.errors import HotcoldError
from hotcold.machine import busy, default_threads, llc_bytes
from hotcold.planner.hardware import (KINDS, PRESETS, QKINDS, HardwareProfile, hardware_path, preset,
                                      read_hardware, write_hardware)
from hotcold.planner.probe_step import handoff_s, layer_step_s, matrix_fixed_s, sample_costs
from hotcold.planner.timing import _call_time, _median_time, _rate

EXPERTS_PER_CALL = 4  # CPU experts per qexperts call in the probe: a token's top-8 with about half on the GPU
CONTEXT_MAX_BYTES = 2 << 30  # more than this beside the probe's own memory: other processes use the GPU


def load_hardware(spec: str | Path | None = None, force: bool = False, quick: bool = False,
                  log=None, threads: int | None = None) -> tuple[HardwareProfile, Path | None, bool]:
    """(profile, its file, measured now?). spec: None (this machine: cached, or probed and cached; a
    cached profile that was measured on a busy machine, or with another thread count than `threads`,
    is measured again), a preset name, or a JSON file written by `hotcold probe`. threads: the CPU
    kernels' threads (default: what a run takes here, `run_threads`)."""
    if spec is not None and str(spec) in PRESETS:
        return preset(str(spec)), None, False
    if spec is not None:
        path = Path(spec).expanduser()
        return read_hardware(path), path, False
    path = hardware_path()
    threads = threads or run_threads()
    cached = None
    if path.is_file() and not force:
        try:
            cached = read_hardware(path)
        except HotcoldError:
            if log:
                log(f"{path}: unreadable, measuring again")
        else:
            if cached.cpu_threads != threads and cached.cpu_kernel == "hotcold.sparse_ops.cpu":
                if log:  # memory-bound kernels read at another rate with another thread count
                    log(f"{path} was measured with {cached.cpu_threads} CPU threads; measuring with {threads}")
            elif cached.busy_warning() is None or not _idle_now(cached):
                return cached, path, False
            elif log:  # a busy probe's rates are several times too low; an idle machine measures them right
                log(f"{path} was measured on a busy machine (load average {cached.load_before:.1f}); "
                    "measuring again now that it is idle")
    hw = probe(quick=quick, log=log, threads=threads)
    if cached is not None:  # work that started during this probe cannot undo what the last one measured
        hw = hw.best_of(cached)
    write_hardware(hw, path)
    return hw, path, True


def _idle_now(hw: HardwareProfile) -> bool:
    """Whether this machine is idle now by the measure `busy_warning` applies to a profile."""
    return not busy(hw.cpu_threads)


def _probe_cpu(hw: HardwareProfile, quick: bool, log) -> None:
    import numpy as np
    import psutil
    import torch

    vm = psutil.virtual_memory()
    hw.ram_total_bytes, hw.ram_available_bytes = int(vm.total), int(vm.available)
    rows_n, d = (2048, 1024) if quick else (32768, 4096)
    min_time = 0.03 if quick else 0.25
    hw.cpu_row_len = d
    rng = np.random.default_rng(0)
    sels = [np.sort(part).astype(np.int64) for part in np.array_split(rng.permutation(rows_n), 8)]
    sel = sels[0]  # 1/8 of the rows
    # small enough that every row's activation is non-zero: the fused FFN kernels skip the up and
    # down rows of a neuron whose SiLU underflows to 0 (x ~ N(0, 1) did that for every row of the
    # uniform Q4_0 pool, which then measured "52 GB/s" on 2 cores)
    x = (rng.standard_normal(d) / (8 * d)).astype(np.float32)
    try:
        from hotcold.sparse_ops import cpu
    except ImportError:  # pragma: no cover - the kernels ship with hotcold
        cpu = None
    if cpu is None:
        hw.cpu_kernel = "numpy-fallback"
        hw.cpu_threads = os.cpu_count() or 1
        src = torch.randn(rows_n, d, generator=torch.Generator().manual_seed(0))
        for kind, dt in (("f32", np.float32), ("f16", np.float16)):
            m = src.numpy().astype(dt)
            t = _rate(lambda: m[sel] @ x, min_time)
            hw.cpu_gather_rows_per_s[kind] = len(sel) / t
            hw.cpu_gather_Bps[kind] = len(sel) * d * m.itemsize / t
            t = _rate(lambda: m @ x, min_time)
            hw.cpu_dense_Bps[kind] = m.nbytes / t
        return
    hw.cpu_kernel = "hotcold.sparse_ops.cpu"
    hw.cpu_threads = cpu.get_threads()
    # Every timed call reads another matrix of a pool larger than the last-level cache, as decoding
    # reads each layer's weights once per token: one matrix read again and again partly stays in
    # the cache (the 16-core H200 host's dense rate read 140 GB/s from one 256 MiB matrix, 66-83
    # GB/s as the engine's CPU attention). The quick probe (tests) uses one small matrix.
    f32_bytes = rows_n * d * 4
    pool_bytes = f32_bytes if quick else max(1 << 30, 4 * llc_bytes(), 2 * f32_bytes)
    pool_bytes = min(pool_bytes, max(f32_bytes, int(vm.available) // 8))
    raw = np.full(pool_bytes, 0x3C, np.uint8)  # 0x3C3C.. is a normal number as f32, f16 and bf16
    out_rows = np.empty(len(sel), np.float32)
    out_all = np.empty(rows_n, np.float32)
    out_ffn = np.zeros(d, np.float32)
    for kind in KINDS:
        mats = _matrix_pool(cpu, raw, kind, rows_n, d)
        pool = itertools.cycle(mats)
        # (up, gate, down_t, selection): 8 disjoint selections, so a cycle reads the whole pool once;
        # the FFN's three matrices are three of the pool (one matrix three times had its second and
        # third passes read from the cache the first had filled)
        n = len(mats)
        picks = itertools.cycle([(m, mats[(i + 1) % n], mats[(i + 2) % n], s) for s in sels for i, m in enumerate(mats)])
        rb = mats[0].row_bytes()
        _measure_kind(hw, kind, len(sel), rows_n, rb, 3 * rb, min_time, log,
                      gather=lambda: cpu.gemv_rows((p := next(picks))[0], p[3], x, out_rows),
                      ffn=lambda: cpu.ffn_rows(x, (p := next(picks))[3], p[0], p[2], "silu", gate=p[1], out=out_ffn),
                      dense=lambda: cpu.gemv(next(pool), x, out_all))
        if kind == "f32":
            one = sel[:1].copy()
            out1 = np.empty(1, np.float32)
            m1 = next(pool)
            hw.cpu_call_s = _call_time(lambda: cpu.gemv_rows(m1, one, x, out1), 200 if quick else 2000)
    _probe_quant(hw, raw, rows_n, d, sels, x, min_time, log)
    hw.cpu_matrix_fixed_s = matrix_fixed_s(raw, hw.cpu_dense_Bps["q4_0"], hw.cpu_call_s, min_time)
    hw.cpu_layer_s = layer_step_s(min_time)
    hw.cpu_moe_layer_s = layer_step_s(min_time, moe=True)
    hw.cpu_sample_s, hw.cpu_sample_logit_s = sample_costs(min_time)
    if log:
        log(f"CPU fixed costs: {'-' if hw.cpu_layer_s is None else f'{hw.cpu_layer_s * 1e6:.1f}'} µs a layer "
            f"({'-' if hw.cpu_moe_layer_s is None else f'{hw.cpu_moe_layer_s * 1e6:.1f}'} µs a MoE one), "
            f"{hw.cpu_matrix_fixed_s * 1e6:.1f} µs a small product")


def _probe_quant(hw: HardwareProfile, raw, rows_n: int, d: int, sels: list, x, min_time: float, log) -> None:
    """The QKINDS rates, over pools of QuantMatrix views of `raw` (0x3C bytes: valid blocks, normal
    scales): gather = qgemv_rows, ffn = qffn_rows (gate/up of the kind, down_t Q8_0, as executors
    store a quantised model's cold rows), dense = qgemv over all rows, interleaved where run time
    interleaves a matrix read whole (`pack_rows`; equal blocks interleave to the same bytes, so the
    pool's views serve as they are); experts = qexperts over stacks of the kind (`_expert_pool`).
    Bytes as stored."""
    import numpy as np

    from hotcold.sparse_ops import quant

    out_rows = np.empty(len(sels[0]), np.float32)
    out_all = np.empty(rows_n, np.float32)
    out_ffn = np.zeros(d, np.float32)
    downs = _quant_pool(quant, raw, "Q8_0", rows_n, d)
    for kind in QKINDS:
        mats = _quant_pool(quant, raw, kind.upper(), rows_n, d)
        pool = itertools.cycle(_quant_pool(quant, raw, kind.upper(), rows_n, d, dense=True))
        # (up, gate, selection): gate another matrix of the pool, as above (the same matrix for both
        # had Q4_0's FFN at 62 GB/s on 2 cores whose DRAM gives 29)
        picks = itertools.cycle([(m, mats[(i + 1) % len(mats)], s) for s in sels for i, m in enumerate(mats)])
        rb = mats[0].row_bytes()
        dn = itertools.cycle(downs)
        _measure_kind(hw, kind, len(out_rows), rows_n, rb, 2 * rb + downs[0].row_bytes(), min_time, log,
                      gather=lambda: quant.qgemv_rows((p := next(picks))[0], p[2], x, out_rows),
                      ffn=lambda: quant.qffn_rows(x, (p := next(picks))[2], p[0], next(dn), "silu", gate=p[1],
                                                  out=out_ffn),
                      dense=lambda: quant.qgemv(next(pool), x, out_all))
        _measure_experts(hw, quant, raw, kind.upper(), d, x, min_time, log)


def _measure_experts(hw: HardwareProfile, quant, raw, qtype: str, d: int, x, min_time: float, log) -> None:
    """cpu_expert_Bps[kind]: `qexperts` computing EXPERTS_PER_CALL whole experts ([d/4, d] gate and
    up, [d, d/4] down, all of qtype and interleaved where run time interleaves them), each call
    other experts of a stack larger than the last-level cache where `raw` allows."""
    import numpy as np

    n = EXPERTS_PER_CALL
    gate, up, down = _expert_pool(quant, raw, qtype, d, d // 4)
    e = gate.rows // (d // 4)
    calls = itertools.cycle([np.arange(n * j, n * j + n, dtype=np.int64) % e for j in range(max(1, e // n))])
    coef = np.full(n, 1.0 / n, np.float32)
    out = np.zeros(d, np.float32)
    t = _rate(lambda: quant.qexperts(x, next(calls), coef, gate, up, down, "silu", out=out), min_time)
    expert_bytes = (gate.nbytes + up.nbytes + down.nbytes) / e
    hw.cpu_expert_Bps[qtype.lower()] = n * expert_bytes / t
    if log:
        log(f"CPU {qtype.lower()} experts: {hw.cpu_expert_Bps[qtype.lower()] / 1e9:.1f} GB/s")


def _expert_pool(quant, raw, qtype: str, d: int, inter: int) -> tuple:
    """(gate, up [E*inter, d], down [E*d, inter]) QuantMatrix views of qtype over three thirds of the
    byte buffer `raw` (at least EXPERTS_PER_CALL experts), interleaved where pack_rows would
    interleave such a matrix (its blocks are equal, so the bytes serve as they are)."""
    _, bs, ts = quant.QTYPES[qtype]
    expert = inter * d // bs * ts  # bytes of one expert's gate (= up = down)
    e = max(EXPERTS_PER_CALL, len(raw) // (3 * expert))
    if 3 * e * expert > len(raw):
        raise HotcoldError(f"probe buffer of {len(raw)} bytes too small for {qtype} experts")
    thirds = [raw[i * e * expert:(i + 1) * e * expert] for i in range(3)]
    return (_quant_view(quant, thirds[0], qtype, e * inter, d, True),
            _quant_view(quant, thirds[1], qtype, e * inter, d, True),
            _quant_view(quant, thirds[2], qtype, e * d, inter, True))


def _measure_kind(hw: HardwareProfile, kind: str, n_sel: int, rows_n: int, row_bytes: int, neuron_bytes: int,
                  min_time: float, log, gather, ffn, dense) -> None:
    """Time one storage kind's three calls (n_sel selected rows; all rows_n for dense) and record
    rows/s and bytes/s (row_bytes per gathered row, neuron_bytes per FFN neuron)."""
    t0 = time.perf_counter()
    t = _rate(gather, min_time)
    hw.cpu_gather_rows_per_s[kind] = n_sel / t
    hw.cpu_gather_Bps[kind] = n_sel * row_bytes / t
    t = _rate(ffn, min_time)
    hw.cpu_ffn_neurons_per_s[kind] = n_sel / t
    hw.cpu_ffn_Bps[kind] = n_sel * neuron_bytes / t
    hw.cpu_dense_Bps[kind] = rows_n * row_bytes / _rate(dense, min_time)
    if log:
        log(f"CPU {kind}: gather {hw.cpu_gather_Bps[kind] / 1e9:.1f} GB/s, ffn {hw.cpu_ffn_Bps[kind] / 1e9:.1f} GB/s, "
            f"dense {hw.cpu_dense_Bps[kind] / 1e9:.1f} GB/s ({time.perf_counter() - t0:.1f} s)")


def _quant_pool(quant, raw, qtype: str, rows_n: int, d: int, dense: bool = False) -> list:
    """QuantMatrix views [rows_n, d] of qtype over consecutive slices of the byte buffer `raw`;
    dense: interleaved where pack_rows would interleave a matrix of qtype."""
    _, bs, ts = quant.QTYPES[qtype]
    size = rows_n * (d // bs * ts)
    return [_quant_view(quant, raw[i * size:(i + 1) * size], qtype, rows_n, d, dense)
            for i in range(max(1, len(raw) // size))]


def _quant_view(quant, buf, qtype: str, rows: int, cols: int, dense: bool):
    """A QuantMatrix [rows, cols] of qtype over the bytes buf; dense: interleaved where pack_rows
    would interleave such a matrix (the pool's blocks are equal, so its bytes serve as they are)."""
    _, bs, ts = quant.QTYPES[qtype]
    rb = cols // bs * ts
    x8 = dense and quant.pack_rows(quant.QuantMatrix(buf[:8 * rb].reshape(8, rb), qtype, (8, cols))).interleaved
    return quant.QuantMatrix(buf.reshape((rows // 8, 8 * rb) if x8 else (rows, rb)), qtype, (rows, cols),
                             interleaved=x8)


def _matrix_pool(cpu, raw, kind: str, rows_n: int, d: int) -> list:
    """HostMatrix views [rows_n, d] of `kind` over consecutive slices of the byte buffer `raw`."""
    import numpy as np

    dt = {"f32": np.float32, "bf16": np.uint16, "f16": np.uint16, "i8": np.int8}[kind]
    size = rows_n * d * np.dtype(dt).itemsize
    scale = np.ones(rows_n, np.float32) if kind == "i8" else None
    return [cpu.HostMatrix(raw[i * size:(i + 1) * size].view(dt).reshape(rows_n, d), kind, scale)
            for i in range(max(1, len(raw) // size))]


def _probe_cuda(hw: HardwareProfile, quick: bool, log) -> None:
    import torch

    if not torch.cuda.is_available():
        hw.cuda = False
        return
    dev = torch.device("cuda")
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    hw.cuda, hw.gpu_name = True, torch.cuda.get_device_name()
    hw.gpu_total_bytes, hw.gpu_free_bytes = int(total), int(free)
    sync = torch.cuda.synchronize

    def timed(fn, reps):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    nbytes = (64 if quick else 512) << 20
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    hw.gpu_copy_Bps = 2 * nbytes / timed(lambda: b.copy_(a), 20)
    del a, b
    cols = 8192
    w = torch.randn(nbytes // 2 // cols, cols, device=dev, dtype=torch.bfloat16)
    v = torch.randn(cols, device=dev, dtype=torch.bfloat16)
    hw.gpu_gemv_Bps = w.numel() * 2 / timed(lambda: torch.mv(w, v), 20)
    del w, v
    copy_bytes = (32 if quick else 256) << 20
    dbuf = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(copy_bytes, dtype=torch.uint8)
    hw.h2d_pinned_Bps = copy_bytes / timed(lambda: dbuf.copy_(pinned, non_blocking=True), 5)
    hw.d2h_pinned_Bps = copy_bytes / timed(lambda: pinned.copy_(dbuf, non_blocking=True), 5)
    hw.h2d_pageable_Bps = copy_bytes / timed(lambda: dbuf.copy_(pageable), 3)
    hw.d2h_pageable_Bps = copy_bytes / timed(lambda: pageable.copy_(dbuf), 3)
    del dbuf, pinned, pageable
    hx = torch.zeros(2048, pin_memory=True)  # 8 KiB of float32
    hy = torch.empty_like(hx).pin_memory()
    dx = torch.empty(2048, device=dev)

    def roundtrip():
        dx.copy_(hx, non_blocking=True)
        dx.add_(1.0)
        hy.copy_(dx, non_blocking=True)
        sync()

    def launch_sync():
        dx.add_(1.0)
        sync()

    reps = 50 if quick else 300
    hw.roundtrip_s = _median_time(roundtrip, reps)
    hw.launch_sync_s = _median_time(launch_sync, reps)
    hw.launch_s = timed(lambda: dx.add_(1.0), 2000)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    context = int(total - free - torch.cuda.memory_reserved())  # also counts other processes' memory
    hw.gpu_context_bytes = context if 0 <= context <= CONTEXT_MAX_BYTES else None
    if log:
        log(f"GPU {hw.gpu_name}: GEMV {hw.gpu_gemv_Bps / 1e9:.0f} GB/s, H2D pinned {hw.h2d_pinned_Bps / 1e9:.1f} GB/s, "
            f"round trip {hw.roundtrip_s * 1e6:.0f} µs")


def run_threads() -> int:
    """The CPU threads a run on this machine takes by default (hotcold.machine.default_threads): the
    probe measures the CPU kernels with as many, so that the plan's rates are the run's."""
    import torch

    return default_threads(cuda=torch.cuda.is_available())


def probe(quick: bool = False, log=None, threads: int | None = None) -> HardwareProfile:
    """Measure this machine (about 10 s on 2 cores; `quick` uses small sizes, for tests), the CPU
    kernels with `threads` numba threads (default: run_threads)."""
    t0 = time.perf_counter()
    hw = HardwareProfile(hostname=socket.gethostname(), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         load_before=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    try:
        from hotcold.sparse_ops.cpu import get_threads, set_threads
    except ImportError:  # pragma: no cover - the kernels ship with hotcold
        get_threads = set_threads = None
    before = get_threads() if get_threads else None
    if set_threads:
        set_threads(threads or run_threads())
    try:
        _probe_cpu(hw, quick, log)
    finally:
        if set_threads:
            set_threads(before)
    hw.thread_handoff_s = handoff_s(quick)
    try:
        _probe_cuda(hw, quick, log)
    except Exception as e:  # e.g. a GPU already full: say so rather than plan as if there were none
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HotcoldError(f"measuring the GPU failed ({msg}); free some GPU memory and run `hotcold probe --force`, "
                           "or plan with --hardware FILE|h200|rtx4090") from None
    hw.probe_s = time.perf_counter() - t0
    return hw
