"""A machine's hardware profile (what `hotcold probe` measures: planner/probe.py), the profiles of
other machines (`PRESETS`: an H200 host and a gaming PC, so that a plan can be made for a machine
other than this one, `hotcold plan --hardware h200`) and the cached profile files
(`$HOTCOLD_HOME/hardware-<host>.json`, default `~/.cache/hotcold`). Bandwidths are bytes per second,
times seconds; without CUDA the GPU fields are null."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hotcold.errors import HotcoldError

FORMAT = "8"  # 2: the quantised kernels' rates (QKINDS); 3: FFN rates over three distinct matrices;
# 4: dense rates of Q4_0 / Q4_K over their interleaved layout, as run time reads them (pack_rows);
# 5: whole MoE experts' rates (cpu_expert_Bps); 6: AVX2 machines' Q8-activation kernels ~1.8x faster;
# 7: a CPU layer's and a small matrix product's fixed costs (cpu_layer_s, cpu_matrix_fixed_s), sampling
# 8: a CPU MoE layer's fixed cost (cpu_moe_layer_s)
KINDS = ("f32", "bf16", "f16", "i8")
# GGUF block types the CPU kernels compute on (sparse_ops/quant/), measured as the runtime uses them:
# gate/up rows of the type, W_down transposed as Q8_0 (executors/weights.py); rates in quantised bytes.
QKINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


@dataclass
class HardwareProfile:
    """One machine's measured (or preset) capabilities. Bandwidths in bytes/s, times in seconds."""

    hostname: str = ""
    source: str = "measured"  # "measured" or "preset:<name>"
    created: str = ""
    format: str = FORMAT
    probe_s: float = 0.0  # how long the probe took
    load_before: float | None = None  # the 1-minute load average when the probe began (None: unknown)
    # --- CPU
    cpu_threads: int = 1  # numba threads the kernels ran with
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    cpu_kernel: str = "hotcold.sparse_ops.cpu"  # or "numpy-fallback" when the numba kernels are missing
    cpu_row_len: int = 4096  # row length (elements) of the measurements below
    cpu_gather_rows_per_s: dict[str, float] = field(default_factory=dict)  # gemv_rows, by kind
    cpu_gather_Bps: dict[str, float] = field(default_factory=dict)  # the same as weight bytes read per s
    cpu_ffn_neurons_per_s: dict[str, float] = field(default_factory=dict)  # fused gated ffn_rows, by kind
    cpu_ffn_Bps: dict[str, float] = field(default_factory=dict)  # the same as weight bytes read per s
    cpu_dense_Bps: dict[str, float] = field(default_factory=dict)  # gemv over all rows, by kind
    cpu_expert_Bps: dict[str, float] = field(default_factory=dict)  # whole MoE experts (qexperts), by block kind
    cpu_call_s: float = 5e-6  # one small kernel call from Python
    thread_handoff_s: float = 30e-6  # main -> worker thread -> main round trip
    # a CPU layer's one-token step beyond its weights' bytes (the fused block call, kernel set-ups,
    # norms, a short attention), and a small matrix product's beyond its bytes at the dense rate
    # (planner/probe_step.py); None: not measured (the cost model counts calls instead)
    cpu_layer_s: float | None = None
    cpu_moe_layer_s: float | None = None  # the same for a MoE block of an all-CPU plan
    cpu_matrix_fixed_s: float | None = None
    # sampling a token on the CPU: seconds + seconds per logit of the vocabulary (probe_step.sample_costs)
    cpu_sample_s: float | None = None
    cpu_sample_logit_s: float | None = None
    # --- GPU (None without CUDA)
    cuda: bool = False
    gpu_name: str | None = None
    gpu_total_bytes: int | None = None
    gpu_free_bytes: int | None = None
    gpu_copy_Bps: float | None = None  # device-to-device copy, bytes read + written per s
    gpu_gemv_Bps: float | None = None  # bf16 matrix-vector product, weight bytes read per s
    h2d_pinned_Bps: float | None = None
    d2h_pinned_Bps: float | None = None
    h2d_pageable_Bps: float | None = None
    d2h_pageable_Bps: float | None = None
    roundtrip_s: float | None = None  # 8 KiB host->device, one op, device->host, synchronise
    launch_sync_s: float | None = None  # one tiny kernel + synchronise
    launch_s: float | None = None  # per kernel when queued back to back (asynchronous launch cost)
    gpu_context_bytes: int | None = None  # GPU memory a torch process holds outside its allocator (CUDA
    # context, cuBLAS workspace, kernel images); None: not measured (the planner assumes Constants')

    # --- accessors used by the cost model (fall back sensibly when a kind was not measured)
    def _by_kind(self, table: dict[str, float], kind: str) -> float:
        if kind in table:
            return table[kind]
        for k in ("bf16", "f16", "f32"):
            if k in table:
                return table[k]
        raise HotcoldError(f"hardware profile {self.hostname}: no CPU measurement; run `hotcold probe --force`")

    def cpu_ffn(self, kind: str) -> float:
        """Bytes/s of weights the CPU FFN kernel reads (sparse rows)."""
        return self._by_kind(self.cpu_ffn_Bps or self.cpu_gather_Bps, kind)

    def cpu_expert(self, kind: str) -> float:
        """Bytes/s of weights the CPU reads computing whole MoE experts (a token's, one call); the
        FFN rate where the kind was not measured (float experts run the FFN kernel)."""
        return self.cpu_expert_Bps.get(kind) or self.cpu_ffn(kind)

    def cpu_dense(self, kind: str) -> float:
        """Bytes/s of weights a dense CPU matrix-vector product reads."""
        return self._by_kind(self.cpu_dense_Bps or self.cpu_gather_Bps, kind)

    def pcie_Bps(self) -> float:
        """Pinned host<->device copy bandwidth, the mean of both directions."""
        return ((self.h2d_pinned_Bps or 0) + (self.d2h_pinned_Bps or 0)) / 2 or 1e9

    def busy_warning(self) -> str | None:
        """A warning when the machine was busy as it was measured: rates measured beside other work
        (a compile, say) come out low, and the plan's placement and prediction with them (an H200
        host probed beside a 10-job build measured every kernel at one call per scheduler quantum,
        and its plan predicted 5.3 tok/s where the idle probe's predicted 422)."""
        cpus = self.cpu_threads or os.cpu_count() or 1  # the measured machine's, not the planning one's
        if self.source != "measured" or self.load_before is None or self.load_before < 0.5 * cpus:
            return None
        return (f"this machine was busy when it was measured (load average {self.load_before:.1f} on {cpus} CPUs): "
                "its rates, and plans made with them, are likely too low; measure again when it is idle: "
                "`hotcold probe --force`")

    def best_of(self, older: "HardwareProfile") -> "HardwareProfile":
        """This profile with each rate the higher, and each per-call time the lower, of this
        measurement and an older one of the same machine: other work on the machine only ever slows a
        measurement down, so the best of several probes approaches what the idle machine does. The
        rest (memory, load, dates) is this one's. An older profile of another configuration (threads,
        GPU, kernels, row length, format) is ignored."""
        same = ("hostname", "format", "cpu_threads", "cpu_kernel", "cpu_row_len", "cuda", "gpu_name")
        if older.source != "measured" or any(getattr(self, k) != getattr(older, k) for k in same):
            return self
        best = {}
        for f in dataclasses.fields(self):
            new, old = getattr(self, f.name), getattr(older, f.name)
            if f.name.endswith(("_Bps", "_per_s")) and isinstance(new, dict):
                best[f.name] = {k: max(v, old.get(k, v)) for k, v in new.items()}
            elif f.name.endswith(("_Bps", "_per_s")) and new is not None and old is not None:
                best[f.name] = max(new, old)
            elif f.name.endswith("_s") and f.name != "probe_s" and new is not None and old is not None:
                best[f.name] = min(new, old)
        return dataclasses.replace(self, **best)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def summary_rows(self) -> list[tuple[str, str]]:
        """(what, value) pairs for a table."""
        from hotcold.planner.sizes import format_size

        def bw(v):
            return "-" if v is None else f"{v / 1e9:.1f} GB/s"

        def us(v):
            return "-" if v is None else f"{v * 1e6:.1f} µs"

        rows = [("host", f"{self.hostname} ({self.source})"),
                ("CPU threads", str(self.cpu_threads)),
                ("RAM total / available", f"{format_size(self.ram_total_bytes)} / {format_size(self.ram_available_bytes)}"),
                ("CPU kernel", self.cpu_kernel)]
        for k in KINDS + QKINDS:
            if k in self.cpu_gather_Bps:
                rows.append((f"CPU {k}: gather / ffn / dense",
                             f"{bw(self.cpu_gather_Bps[k])} ({self.cpu_gather_rows_per_s.get(k, 0) / 1e6:.2f} M rows/s)"
                             f" / {bw(self.cpu_ffn_Bps.get(k))} / {bw(self.cpu_dense_Bps.get(k))}"
                             + (f"; experts {bw(self.cpu_expert_Bps[k])}" if k in self.cpu_expert_Bps else "")))
        rows += [("CPU call / thread hand-off", f"{us(self.cpu_call_s)} / {us(self.thread_handoff_s)}"),
                 ("CPU layer step (dense / MoE) / small product, beyond bytes",
                  f"{us(self.cpu_layer_s)} / {us(self.cpu_moe_layer_s)} / {us(self.cpu_matrix_fixed_s)}"),
                 ("CPU sampling a token (default settings)", f"{us(self.cpu_sample_s)} + "
                  f"{'-' if self.cpu_sample_logit_s is None else f'{self.cpu_sample_logit_s * 1e9:.2f} ns'} a logit")]
        if not self.cuda:
            rows.append(("GPU", "none (CUDA not available): plans are all-CPU"))
            return rows
        rows += [("GPU", f"{self.gpu_name}"),
                 ("GPU memory free / total", f"{format_size(self.gpu_free_bytes or 0)} / {format_size(self.gpu_total_bytes or 0)}"),
                 ("GPU copy / GEMV", f"{bw(self.gpu_copy_Bps)} / {bw(self.gpu_gemv_Bps)}"),
                 ("H2D / D2H pinned", f"{bw(self.h2d_pinned_Bps)} / {bw(self.d2h_pinned_Bps)}"),
                 ("H2D / D2H pageable", f"{bw(self.h2d_pageable_Bps)} / {bw(self.d2h_pageable_Bps)}"),
                 ("round trip / launch+sync / launch", f"{us(self.roundtrip_s)} / {us(self.launch_sync_s)} / {us(self.launch_s)}"),
                 ("CUDA context", format_size(self.gpu_context_bytes) if self.gpu_context_bytes is not None
                  else "not measured")]
        return rows


# ------------------------------------------------------------------------------------------- presets
# An H200 host (16 cores; measured) and a gaming PC (an RTX 4090 on PCIe 4 with dual-channel DDR5,
# from its specifications: GPU about 1 TB/s, PCIe 25 GB/s, DRAM 60-80 GB/s). Values marked ~ are
# estimates, not measurements: i8 and ffn rates, call and hand-off costs.
_GiB = 1 << 30
PRESETS: dict[str, dict] = {
    "h200": dict(
        hostname="h200-host", cpu_threads=16, ram_total_bytes=128 * _GiB, ram_available_bytes=120 * _GiB,
        cpu_row_len=4096,
        cpu_gather_Bps={"f32": 82e9, "f16": 110e9, "bf16": 110e9, "i8": 90e9},  # i8 ~
        cpu_ffn_Bps={"f32": 80e9, "f16": 100e9, "bf16": 100e9, "i8": 85e9},  # ~
        cpu_dense_Bps={"f32": 73e9, "f16": 73e9, "bf16": 73e9, "i8": 70e9},
        cpu_call_s=5e-6, thread_handoff_s=30e-6,  # ~
        cuda=True, gpu_name="NVIDIA H200 (preset)", gpu_total_bytes=139 * _GiB, gpu_free_bytes=138 * _GiB,
        gpu_copy_Bps=4.2e12, gpu_gemv_Bps=3.6e12, h2d_pinned_Bps=52e9, d2h_pinned_Bps=55e9,
        h2d_pageable_Bps=15e9, d2h_pageable_Bps=15e9, roundtrip_s=38e-6, launch_sync_s=20e-6, launch_s=5e-6),
    "rtx4090": dict(
        hostname="gaming-pc", cpu_threads=16, ram_total_bytes=64 * _GiB, ram_available_bytes=60 * _GiB,
        cpu_row_len=4096,
        cpu_gather_Bps={"f32": 55e9, "f16": 60e9, "bf16": 60e9, "i8": 55e9},  # ~
        cpu_ffn_Bps={"f32": 55e9, "f16": 60e9, "bf16": 60e9, "i8": 55e9},  # ~
        cpu_dense_Bps={"f32": 65e9, "f16": 65e9, "bf16": 65e9, "i8": 60e9},
        cpu_call_s=5e-6, thread_handoff_s=30e-6,  # ~
        cuda=True, gpu_name="NVIDIA RTX 4090 (preset)", gpu_total_bytes=24 * _GiB, gpu_free_bytes=23 * _GiB,
        gpu_copy_Bps=1.0e12, gpu_gemv_Bps=0.9e12, h2d_pinned_Bps=25e9, d2h_pinned_Bps=25e9,
        h2d_pageable_Bps=10e9, d2h_pageable_Bps=10e9, roundtrip_s=30e-6, launch_sync_s=15e-6, launch_s=5e-6),
}


def preset(name: str) -> HardwareProfile:
    d = dict(PRESETS[name])
    d["cpu_gather_rows_per_s"] = {k: v / (d["cpu_row_len"] * _KIND_BYTES[k]) for k, v in d["cpu_gather_Bps"].items()}
    d["cpu_ffn_neurons_per_s"] = {k: v / (3 * d["cpu_row_len"] * _KIND_BYTES[k]) for k, v in d["cpu_ffn_Bps"].items()}
    return HardwareProfile(source=f"preset:{name}", created="", **d)


_KIND_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i8": 1}


# ------------------------------------------------------------------------------------------- cache
def hardware_path(hostname: str | None = None) -> Path:
    home = Path(os.environ.get("HOTCOLD_HOME", Path.home() / ".cache" / "hotcold")).expanduser()
    return home / f"hardware-{hostname or socket.gethostname()}.json"


def read_hardware(path: Path) -> HardwareProfile:
    if not path.is_file():
        raise HotcoldError(f"{path}: no hardware profile here; run `hotcold probe` or pass --hardware "
                           f"({', '.join(PRESETS)} or a JSON file)")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HotcoldError(f"{path}: unreadable hardware profile ({e}); run `hotcold probe --force`") from None
    if d.get("format") != FORMAT:
        raise HotcoldError(f"{path}: hardware profile format {d.get('format')} is not {FORMAT}; run `hotcold probe --force`")
    return HardwareProfile.from_dict(d)


def write_hardware(hw: HardwareProfile, path: Path) -> None:
    from hotcold.artifacts import atomic_path

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(hw.to_json())


# ------------------------------------------------------------------------------------------- measuring
