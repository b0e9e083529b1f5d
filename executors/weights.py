"""One FFN's weights split by the plan: hot neurons compacted on the fast tier, cold ones in host memory.

A neuron is one row of W_up (and W_gate) and one column of W_down; both halves keep W_down
transposed so each neuron's weights are rows ([n, D]). Cold rows are `HostMatrix`es in the CPU
storage kind (f32 | bf16 | f16 | i8), contiguous per neuron, for the numba kernels. Conversion goes
in blocks of rows, so building never holds more than one extra block beside the original. A MoE
expert on the CPU is a ColdFFN of all its neurons (`host_expert`).

Quantised models (models/quantized.py: QuantLinear, QuantExperts) stay quantised on the CPU: the
cold up/gate rows are a copy of their GGUF blocks (`QuantMatrix`, whatever `cpu_kind` says) and
W_down transposed is requantised to `DOWN_T_DEFAULT` (Q8_0, see `transpose_quantized`), so host
memory is about the file's size; CPU experts, always computed whole, keep W_down in its own blocks
(`host_quant_experts`), so theirs is the file's size. The hot part on the fast tier is dequantised into the tier dtype,
BLOCK_ROWS rows (or, for W_down's columns, `_COL_CHUNK_BYTES` of float32) at a time; or, asked for
int4 (`--gpu-int4`), its 4-bit up/gate rows stay 4-bit (see `_hot_int4`); an FFN whose neurons are
all hot and whose matrices are all 4-bit is not split but kept int4 whole (`whole_int4`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hotcold.models.layers import DenseFFN, GatedFFN
from hotcold.models.quantized import QuantExperts, QuantLinear, dequantize_module, dequantized_rows, drop_module_pages
from hotcold.sparse_ops.cpu import HostMatrix, gather_columns, host_empty, quantize_i8
from hotcold.sparse_ops.gpu_quant import (INT4_DOWN_DEFAULT, Int4Matrix, int4_layout_reason, int4_padded,
                                          int4_unsupported_reason)
from hotcold.sparse_ops.quant import DOWN_T_DEFAULT, QTYPES, QuantMatrix, pack_rows, qdequantize, quantize_rows

CPU_KINDS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i8": None}
BLOCK_ROWS = 2048
STACK_THREADS = min(8, os.cpu_count() or 1)  # threads placing a layer's host experts into their stacks
_COL_CHUNK_BYTES = 32 << 20  # float32 rows of a quantised W_down decoded at once to take its hot columns
_STRIP = 1024  # columns of a quantised W_down decoded at once to transpose its cold columns


@dataclass
class HotFFN:
    """Hot neurons on the fast tier. up/gate/down_t: [H, D]; up_bias: [H] (ungated FFNs).

    int4 (`_hot_int4`): up/gate are Int4Matrix [H', D] of the hot rows' own blocks, down_t a [H, D]
    tensor or, requantised, an Int4Matrix [D, H'] (W_down's hot columns as the kernel takes a weight,
    [N, K]); up_bias [H']. H' >= H: zero neurons pad the count to the kernels' multiple (their h is 0)."""

    idx: torch.Tensor  # int64 [H] neuron indices, plan order (hottest first)
    up: torch.Tensor | Int4Matrix
    gate: torch.Tensor | Int4Matrix | None
    down_t: torch.Tensor | Int4Matrix
    up_bias: torch.Tensor | None
    int4_skipped: str | None = None  # why int4 was asked for and not used (None: used, or not asked)

    @property
    def n(self) -> int:
        return int(self.idx.numel())

    @property
    def int4(self) -> bool:
        return isinstance(self.up, Int4Matrix)

    @property
    def nbytes(self) -> int:
        ts = [self.up, self.gate, self.down_t, self.up_bias]
        return sum(t.nbytes if isinstance(t, Int4Matrix) else t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class ColdFFN:
    """Cold neurons in host memory. up/gate/down_t: [C, D], all HostMatrix or all QuantMatrix (a
    quantised model: up/gate in the file's block type, down_t Q8_0); up_bias: float32 [C].
    Quantised MoE experts (`host_quant_experts`) hold `down` instead of down_t: each expert's W_down
    [D, I] in the file's blocks, stacked [E_cpu * D, I] (expert p's rows [p*D, (p+1)*D))."""

    idx: np.ndarray  # int64 [C] neuron indices, ascending
    up: HostMatrix | QuantMatrix
    gate: HostMatrix | QuantMatrix | None
    down_t: HostMatrix | QuantMatrix | None
    up_bias: np.ndarray | None
    act: str
    pinned: bool = False  # page-locked for streaming / prefetch copies (prefill.pin_host)
    down: QuantMatrix | None = None  # whole quantised experts: W_down per expert, not transposed

    @property
    def quantized(self) -> bool:
        """Whether the rows are GGUF blocks (the sparse_ops entry points dispatch on it)."""
        return isinstance(self.up, QuantMatrix)

    @property
    def n(self) -> int:
        return len(self.idx)

    @property
    def gemm_ready(self) -> bool:
        """Whether torch GEMMs can read the rows as they are (f32, f16, bf16: prefill's "dense" regime)."""
        return not self.quantized and self.down_t is not None and all(m.kind != "i8" for m in self.mats)

    @property
    def mats(self) -> list[HostMatrix | QuantMatrix]:
        return [m for m in (self.up, self.gate, self.down_t, self.down) if m is not None]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats) + (self.up_bias.nbytes if self.up_bias is not None else 0)

    @property
    def neuron_bytes(self) -> int:
        """Weight bytes read per computed neuron."""
        rows = sum(m.row_bytes() for m in (self.up, self.gate, self.down_t) if m is not None)
        return rows + (self.down.nbytes // max(self.n, 1) if self.down is not None else 0)


def _host_rows(w: torch.Tensor, rows: torch.Tensor, kind: str) -> HostMatrix:
    """w[rows] as a host matrix of `kind`, converted BLOCK_ROWS rows at a time. w: [N, D] (any device).
    Consecutive rows (every neuron cold: a CPU plan) are sliced, not gathered into a second copy;
    all of a contiguous CPU matrix already of `kind` is shared, not copied (a 32-layer 7B shape's CPU
    plan spent 10 s of its load copying W_up and W_gate); W_down's columns (w a transposed view)
    are gathered in tiles (`gather_columns`: 7 s of the same load went to torch's transposed copy)."""
    r0 = int(rows[0]) if len(rows) else 0
    consecutive = len(rows) and bool(torch.equal(rows.cpu(), torch.arange(r0, r0 + len(rows))))
    if consecutive and r0 == 0 and len(rows) == w.shape[0] and w.device.type == "cpu" and w.is_contiguous() \
            and w.dtype == CPU_KINDS.get(kind):
        return HostMatrix.from_torch(w.detach(), kind)  # shares w's memory (and keeps it alive)
    if w.device.type == "cpu" and w.t().is_contiguous() and w.dtype == CPU_KINDS.get(kind) and len(rows):
        return HostMatrix.from_torch(gather_columns(w.t(), rows), kind)  # W_down's columns, in numba tiles
    if consecutive:
        blocks = (w[r0 + a:r0 + min(a + BLOCK_ROWS, len(rows))] for a in range(0, len(rows), BLOCK_ROWS))
    else:
        blocks = (w.index_select(0, rows[a:a + BLOCK_ROWS]) for a in range(0, len(rows), BLOCK_ROWS))
    return _host_matrix(blocks, len(rows), w.shape[1], kind)


def _host_matrix(parts, n: int, d: int, kind: str) -> HostMatrix:
    """A host matrix [n, D] of `kind` filled from `parts` (tensors [k, D] on any device, n rows in
    all), converting one part at a time so that no second copy of the whole matrix is held."""
    if kind == "i8":
        q, scale = np.empty((n, d), np.int8), np.empty(n, np.float32)
        a = 0
        for w in parts:
            q[a:a + len(w)], scale[a:a + len(w)] = quantize_i8(w)
            a += len(w)
        return HostMatrix(q, "i8", scale)
    out = host_empty((n, d), CPU_KINDS[kind])
    a = 0
    for w in parts:
        out[a:a + len(w)] = w.to("cpu", out.dtype)
        a += len(w)
    return HostMatrix.from_torch(out, kind)  # shares out's memory


def _device_rows(w: torch.Tensor, rows: torch.Tensor, device, dtype) -> torch.Tensor:
    """w[rows] on device in dtype, [K, D]."""
    with torch.inference_mode(False):
        out = torch.empty((len(rows), w.shape[1]), dtype=dtype, device=device)
    for a in range(0, len(rows), BLOCK_ROWS):
        out[a:a + BLOCK_ROWS] = w.index_select(0, rows[a:a + BLOCK_ROWS]).to(device, dtype)
    return out


def check_hot(hot_idx, n: int) -> torch.Tensor:
    """Validate a plan's neuron index list: int64 [H], unique, in [0, n)."""
    idx = torch.as_tensor(hot_idx, dtype=torch.int64).flatten().cpu()
    if idx.numel() and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"hot neuron index out of range [0, {n})")
    if idx.unique().numel() != idx.numel():
        raise ValueError("hot neuron indices repeat")
    return idx


@torch.no_grad()
def split_ffn(ffn: DenseFFN | GatedFFN, hot_idx, act: str, device, dtype, cpu_kind: str = "bf16",
              int4: bool = False, int4_down: bool = INT4_DOWN_DEFAULT,
              memo=None, name: str = "") -> tuple[HotFFN, ColdFFN, torch.Tensor | None]:
    """Split an FFN into (hot part on device, cold part in host memory, down bias on device or None).

    A quantised FFN (`ffn.up` a QuantLinear) keeps its cold part quantised (see `_split_quantized`;
    cpu_kind does not apply). int4: keep 4-bit hot up/gate rows 4-bit on device, int4_down: W_down's
    hot columns requantised to int4 too (see `_hot_int4`; where it cannot, the hot part is expanded
    and HotFFN.int4_skipped says why). The caller drops `ffn` afterwards; the returned parts share no
    memory with it (except a cold f32 part of an f32 CPU model, which is a fresh compacted copy too,
    and a quantised FFN's cold up/gate when they are all its rows: its own matrices, see
    `_split_quantized`). memo: an executors.split_cache.SplitMemo that serves and keeps the cold
    part's built matrices, named after `name` (a quantised FFN's only)."""
    if cpu_kind not in CPU_KINDS:
        raise ValueError(f"cpu_dtype must be one of {tuple(CPU_KINDS)}, got {cpu_kind!r}")
    n = ffn.up.out_features  # I
    hot = check_hot(hot_idx, n)
    is_hot = torch.zeros(n, dtype=torch.bool)
    is_hot[hot] = True
    cold = torch.nonzero(~is_hot).flatten()
    gated = isinstance(ffn, GatedFFN)
    if isinstance(ffn.up, QuantLinear):
        hot_part, cold_part = _split_quantized(ffn, hot, cold, gated, act, device, dtype, int4, int4_down, memo, name)
    else:
        hot_part, cold_part = _split_float(ffn, hot, cold, gated, act, device, dtype, cpu_kind)
        hot_part.int4_skipped = "its weights are not quantised" if int4 and hot.numel() else None
    down_bias = None if ffn.down.bias is None else ffn.down.bias.to(device, dtype).clone()
    return hot_part, cold_part, down_bias


def _split_float(ffn, hot: torch.Tensor, cold: torch.Tensor, gated: bool, act: str, device, dtype,
                 cpu_kind: str) -> tuple[HotFFN, ColdFFN]:
    """Float weights: hot rows to device in dtype, cold rows to HostMatrix of cpu_kind."""
    up = ffn.up.weight  # [I, D]
    mats = {"up": up, "gate": ffn.gate.weight if gated else None, "down_t": ffn.down.weight.t()}  # each [I, D]
    src_dev = up.device
    hot_d, cold_d = hot.to(src_dev), cold.to(src_dev)
    hot_part = HotFFN(
        idx=hot.to(device),
        **{k: None if w is None else _device_rows(w, hot_d, device, dtype) for k, w in mats.items()},
        up_bias=None if gated else ffn.up.bias[hot_d].to(device, dtype),
    )
    cold_part = ColdFFN(
        idx=cold.numpy().astype(np.int64),
        **{k: None if w is None else _host_rows(w, cold_d, cpu_kind) for k, w in mats.items()},
        up_bias=None if gated else ffn.up.bias[cold_d].float().cpu().numpy().copy(),
        act=act,
    )
    return hot_part, cold_part


def _split_quantized(ffn, hot: torch.Tensor, cold: torch.Tensor, gated: bool, act: str, device, dtype,
                     int4: bool = False, int4_down: bool = INT4_DOWN_DEFAULT, memo=None,
                     name: str = "") -> tuple[HotFFN, ColdFFN]:
    """A QuantLinear FFN: the hot part per `_hot_quantized`; cold rows of up/gate in their blocks
    (gate requantised to up's type if it differs, as the fused kernel needs one type): every row cold
    (a CPU plan), the matrix itself, whose rows are the cold rows in their order; else a copy of the
    cold rows. Cold columns of W_down transposed to DOWN_T_DEFAULT. memo (see split_ffn) serves
    the copies and W_down's columns."""
    lins = {"up": ffn.up, "gate": ffn.gate if gated else None}
    qtype = ffn.up.qweight.qtype
    c = cold.numpy().astype(np.int64)

    def built(part: str, build):
        return build() if memo is None else memo.matrix(f"{name}.{part}", build)

    def rows(part: str, m):
        w = getattr(m, "qweight", None)
        if isinstance(w, QuantMatrix) and not w.interleaved and w.qtype == qtype and len(c) == w.rows \
                and (not len(c) or c[-1] == len(c) - 1):  # ascending and unique: 0 .. n-1
            return w
        return built(part, lambda: _cold_quant_rows(m, c, qtype))

    cold_part = ColdFFN(
        idx=c,
        **{k: None if m is None else rows(k, m) for k, m in lins.items()},
        down_t=built("down_t", lambda: _cold_quant_down_t(ffn.down, c)),
        up_bias=None if gated else ffn.up.bias[cold].float().numpy().copy(),
        act=act,
    )
    return _hot_quantized(ffn, hot, gated, device, dtype, int4, int4_down), cold_part


def _hot_quantized(ffn, hot: torch.Tensor, gated: bool, device, dtype, int4: bool, int4_down: bool) -> HotFFN:
    """Hot rows of up/gate and hot columns of W_down dequantised to device in dtype, or with int4
    kept 4-bit (`_hot_int4`) where the kernels take them (else int4_skipped says why)."""
    int4 = int4 and len(hot) > 0
    why = _int4_reason(ffn, gated, device, len(hot), int4_down) if int4 else None
    if int4 and why is None:
        return _hot_int4(ffn, hot, gated, device, dtype, int4_down)
    lins = {"up": ffn.up, "gate": ffn.gate if gated else None}
    return HotFFN(
        idx=hot.to(device),
        **{k: None if m is None else fast_rows(m, hot, device, dtype) for k, m in lins.items()},
        down_t=_fast_cols(ffn.down, hot, device, dtype),
        up_bias=None if gated else ffn.up.bias[hot].to(device, dtype),
        int4_skipped=why,
    )


def _int4_reason(ffn, gated: bool, device, h: int, int4_down: bool) -> str | None:
    """Why h hot neurons of a quantised FFN cannot be kept int4 on device (see `_hot_int4`); None if they can."""
    n = int4_padded(h, device, as_k=int4_down)
    for name, lin in (("up", ffn.up), ("gate", ffn.gate if gated else None)):
        if lin is None:
            continue
        if not isinstance(lin, QuantLinear):
            return f"its {name} weights are not quantised"
        why = int4_unsupported_reason(lin.qweight.qtype, device, (n, lin.in_features))
        if why is not None:
            return f"{name}: {why}"
    return int4_layout_reason(device, (ffn.down.out_features, n)) if int4_down else None


def whole_int4_reason(ffn, device) -> str | None:
    """Why a dense/gated FFN cannot be kept int4 whole on device (`whole_int4`); None if it can."""
    for name in ("up", "gate", "down"):
        lin = getattr(ffn, name, None)
        if lin is None:
            continue
        if not isinstance(lin, QuantLinear):
            return f"its {name} weights are not quantised"
        why = int4_unsupported_reason(lin.qweight.qtype, device, lin.qweight.shape)
        if why is not None:
            return f"{name}: {why}"
    return None


def whole_int4(ffn, device, dtype) -> None:
    """Every neuron hot and every matrix 4-bit: the FFN's QuantLinears become Int4Linears on device
    from their own blocks (W_down's blocks run along the neuron axis, whole here, so nothing is
    requantised: exact up to the bf16 rounding of scale and zero, as the hot up/gate rows), in place;
    their file pages are dropped. Check `whole_int4_reason` first."""
    for name in ("up", "gate", "down"):
        lin = getattr(ffn, name, None)
        if lin is not None:
            setattr(ffn, name, dequantize_module(lin, device, dtype, int4=True))
            drop_module_pages(lin)


def _hot_int4(ffn, hot: torch.Tensor, gated: bool, device, dtype, int4_down: bool) -> HotFFN:
    """The hot part kept 4-bit (see HotFFN): up/gate from the hot rows' own blocks (exact up to the
    bf16 rounding of scale and zero), W_down's hot columns dequantised to dtype or, int4_down,
    requantised to int4 from float32; the count padded with zero neurons to `int4_padded`."""
    h = len(hot)
    n = int4_padded(h, device, as_k=int4_down)
    up, gate = (None if lin is None else Int4Matrix.from_quant(lin.qweight, device, rows=hot.numpy(), n=n)
                for lin in (ffn.up, ffn.gate if gated else None))
    if int4_down:
        cols = _fast_cols(ffn.down, hot, "cpu", torch.float32)  # [H, D]
        down = Int4Matrix.from_float(F.pad(cols, (0, 0, 0, n - h)).T, device)  # [D, H']
    else:
        down = _fast_cols(ffn.down, hot, device, dtype)  # [H, D]
    bias = None if gated else F.pad(ffn.up.bias[hot].float(), (0, n - h)).to(device, dtype)
    return HotFFN(idx=hot.to(device), up=up, gate=gate, down_t=down, up_bias=bias)


def fast_rows(lin, rows: torch.Tensor, device, dtype) -> torch.Tensor:
    """Rows of lin's weight (nn.Linear or QuantLinear: only those rows decoded) on device in dtype,
    [K, D], a fresh tensor (not an inference tensor)."""
    if not isinstance(lin, QuantLinear):
        return _device_rows(lin.weight, rows.to(lin.weight.device), device, dtype)
    return dequantized_rows(lin.qweight, device, dtype, rows)


def _fast_cols(down, cols: torch.Tensor, device, dtype) -> torch.Tensor:
    """Columns `cols` of W_down [D, I] transposed, [K, D] on device in dtype. A QuantLinear is decoded
    `_COL_CHUNK_BYTES` of float32 rows at a time, never whole."""
    if not isinstance(down, QuantLinear):
        return _device_rows(down.weight.t(), cols.to(down.weight.device), device, dtype)
    d, i = down.out_features, down.in_features
    with torch.inference_mode(False):
        out = torch.empty((len(cols), d), dtype=dtype, device=device)
    if len(cols):
        step = max(1, _COL_CHUNK_BYTES // (4 * i))
        for a in range(0, d, step):
            b = min(d, a + step)
            w = down.dequantize(torch.arange(a, b))  # [b - a, I] float32
            out[:, a:b] = w[:, cols].T.to(device, dtype)
    return out


def _quant_empty(n: int, cols: int, qtype: str) -> np.ndarray:
    """uint8 [n, bytes per row of qtype] for a host QuantMatrix, huge pages advised before first touch."""
    _, bs, ts = QTYPES[qtype]
    t = host_empty((n, cols // bs * ts), torch.uint8)
    return t.numpy()  # keeps t alive


def _quant_rows(q: QuantMatrix, rows: np.ndarray, qtype: str | None = None) -> QuantMatrix:
    """A fresh QuantMatrix of q's rows [K, cols]: their blocks copied, or requantised when qtype
    differs from q's (decoded BLOCK_ROWS rows at a time)."""
    qtype = qtype or q.qtype
    out = _quant_empty(len(rows), q.cols, qtype)
    for a in range(0, len(rows), BLOCK_ROWS):
        r = rows[a:a + BLOCK_ROWS]
        if qtype == q.qtype:
            np.take(q.data, r, axis=0, out=out[a:a + len(r)])
        else:
            out[a:a + len(r)] = quantize_rows(qdequantize(q, r), qtype)
    return QuantMatrix(out, qtype, (len(rows), q.cols))


def _cold_quant_rows(lin, rows: np.ndarray, qtype: str) -> QuantMatrix:
    """Rows of lin's weight (QuantLinear, or an nn.Linear quantised here) as a QuantMatrix of qtype."""
    if isinstance(lin, QuantLinear):
        return _quant_rows(lin.qweight, rows, qtype)
    return _quantize_tensor_rows(lin.weight.detach(), rows, qtype)


def _quantize_tensor_rows(w: torch.Tensor, rows: np.ndarray, qtype: str) -> QuantMatrix:
    """w[rows] quantised as qtype, BLOCK_ROWS rows at a time. w: [N, D] float (any device)."""
    out = _quant_empty(len(rows), w.shape[1], qtype)
    for a in range(0, len(rows), BLOCK_ROWS):
        r = torch.from_numpy(rows[a:a + BLOCK_ROWS]).to(w.device)
        out[a:a + len(r)] = quantize_rows(w.index_select(0, r).float().cpu().numpy(), qtype)
    return QuantMatrix(out, qtype, (len(rows), w.shape[1]))


def _cold_quant_down_t(down, cols: np.ndarray, kind: str = DOWN_T_DEFAULT) -> QuantMatrix:
    """Columns `cols` (ascending) of W_down [D, I] transposed, [C, D], quantised as kind (a float
    W_down, one the quantiser left, is quantised here)."""
    if isinstance(down, QuantLinear):
        return quant_cols_t(down.qweight, cols, kind)
    return _quantize_tensor_rows(down.weight.detach().t(), cols, kind)


def quant_cols_t(q: QuantMatrix, cols: np.ndarray | None = None, kind: str = DOWN_T_DEFAULT) -> QuantMatrix:
    """q[:, cols] transposed, [C, R], quantised as kind (cols ascending; None: all). Decodes `_STRIP`
    columns of q at a time (memory O(R * _STRIP)). Like sparse_ops.quant.transpose_quantized, with a
    column selection and the numba decoder. R must be a multiple of kind's block size."""
    _, bs_in, ts_in = QTYPES[q.qtype]
    r = q.rows
    if r % QTYPES[kind][1]:
        raise ValueError(f"cannot store W_down transposed as {kind}: {r} is not a multiple of {QTYPES[kind][1]}")
    cols = np.arange(q.cols, dtype=np.int64) if cols is None else np.asarray(cols, np.int64)
    out = _quant_empty(len(cols), r, kind)
    strip = max(bs_in, _STRIP // bs_in * bs_in)
    for c0 in range(0, q.cols, strip):
        c1 = min(q.cols, c0 + strip)
        j0, j1 = np.searchsorted(cols, [c0, c1])
        if j0 == j1:
            continue
        part = QuantMatrix(np.ascontiguousarray(q.data[:, c0 // bs_in * ts_in:c1 // bs_in * ts_in]), q.qtype,
                           (r, c1 - c0))
        dense = qdequantize(part)  # [R, c1 - c0]
        out[j0:j1] = quantize_rows(np.ascontiguousarray(dense[:, cols[j0:j1] - c0].T), kind)
    return QuantMatrix(out, kind, (len(cols), r))


@torch.no_grad()
def host_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ids: list[int], act: str,
                 cpu_kind: str) -> ColdFFN:
    """MoE experts `ids` stacked in host memory, expert p's neurons at rows [p*I, (p+1)*I) of each
    matrix, so one kernel call computes several experts. gate, up: [E, I, D]; down: [E, D, I]."""
    if cpu_kind not in CPU_KINDS:
        raise ValueError(f"cpu_dtype must be one of {tuple(CPU_KINDS)}, got {cpu_kind!r}")
    n, d = len(ids) * up.shape[1], up.shape[2]
    mats = {k: _host_matrix((w(e) for e in ids), n, d, cpu_kind)
            for k, w in (("gate", lambda e: gate[e]), ("up", lambda e: up[e]), ("down_t", lambda e: down[e].t()))}
    return ColdFFN(idx=np.arange(n, dtype=np.int64), up_bias=None, act=act, **mats)


@torch.no_grad()
def host_quant_experts(ex: QuantExperts, ids: list[int], act: str) -> ColdFFN:
    """`host_experts` for quantised experts, kept in the file's blocks: gate/up rows copied (gate
    requantised to up's type if it differs) and W_down as GGUF stores it (`ColdFFN.down`, no
    transposed copy: a CPU expert is computed whole, see sparse_ops.quant.qexperts), each matrix
    row-interleaved where `pack_rows` applies. Host bytes: the experts' share of the file."""
    qtype, every = ex.qup.qtype, np.arange(ex.hidden, dtype=np.int64)

    def gate(e: int) -> QuantMatrix:
        m = ex.matrix("gate", e)
        return m if m.qtype == qtype else _quant_rows(m, every, qtype)

    return ColdFFN(idx=np.arange(len(ids) * ex.hidden, dtype=np.int64), up=_stacked(lambda e: ex.matrix("up", e), ids),
                   gate=_stacked(gate, ids), down_t=None, up_bias=None, act=act,
                   down=_stacked(lambda e: ex.matrix("down", e), ids))


def mapped_quant_experts(ex: QuantExperts, act: str) -> ColdFFN | None:
    """All of ex's experts as they lie in the model file, read in place (no copy): expert e at
    position e of each stack. Host memory is the file's page cache, shared with other processes and
    never copied; the kernels read the GGUF row layout, about 1.2x slower than `host_quant_experts`'
    interleaved rows where the CPU's arithmetic rather than its memory bounds them (few cores). None
    where the file's blocks do not serve as they are (gate and up of different types)."""
    if ex.qgate.qtype != ex.qup.qtype:
        return None
    return ColdFFN(idx=np.arange(ex.n * ex.hidden, dtype=np.int64), up=ex.qup, gate=ex.qgate, down_t=None,
                   up_bias=None, act=act, down=ex.qdown)


def _stacked(get, ids: list[int]) -> QuantMatrix:
    """get(e) (QuantMatrices of one type and shape, e.g. file views) for e in ids, stacked by rows,
    each interleaved by `pack_rows` where it applies straight into its slice of the stack (no copy
    beside it), the experts in threads (numpy's strided copies release the GIL; a 48-layer
    Qwen3-30B-A3B-shaped file has ~16 GB of host experts to place at load)."""
    first = get(ids[0])
    packed = pack_rows(first)
    g, width = packed.data.shape
    data = np.empty((len(ids) * g, width), np.uint8)

    def place(p: int, e: int) -> None:
        m, part = (first if p == 0 else get(e)), data[p * g:(p + 1) * g]
        if packed.interleaved:
            pack_rows(m, out=part)
        else:
            part[...] = m.data.reshape(part.shape)

    with ThreadPoolExecutor(min(STACK_THREADS, len(ids))) as pool:
        list(pool.map(place, range(len(ids)), ids))
    return QuantMatrix(data, packed.qtype, (len(ids) * packed.rows, packed.cols), interleaved=packed.interleaved)
