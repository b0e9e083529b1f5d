"""Python entry points of the block kernels: argument checks, then one kernel call."""

from __future__ import annotations

import numpy as np

from hotcold.sparse_ops.selection import ACTS, as_rows, batch_input, get_threads

from . import formats
from .formats import _XQ_TYPES, QTYPES, X8
from .interleaved import _interleave, _x8_dequant_kernel, qgemv_x8_kernel
from .experts_one import qexperts_one_kernel, qexperts_routed_kernel
from .kernels import (_qaxpy_rows_kernel, _qdequant_bf16_kernel, _qexperts_pairs_kernel, qdequant_kernel,
                      qffn_one_kernel, qgemv_rows_kernel)
from .matrix import QuantMatrix, _check_m
from .tiles import qexperts_tiles


def _as_f32(a: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return np.ascontiguousarray(a)


def _check_out(out: np.ndarray, shape: tuple) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {shape}")
    return out



def pack_rows(m: QuantMatrix, xq: bool | None = None, out: np.ndarray | None = None) -> QuantMatrix:
    """m in the interleaved layout (see interleaved.py) when its type is in
    formats.PACK_DEFAULT, its rows are a multiple of 8 and Q8 activations suit it (xq None: its type is in
    formats.XQ_DEFAULT; True: the caller accepts them, e.g. for Q8_0 predictors); else m. For matrices only
    read whole: one-token qgemv over all rows runs 1.5-1.9x faster (1 thread, from DRAM); qdequantize
    (prefill) reads it too; row selections do not. m's data is left as it is (the caller may drop
    its file pages). out: uint8 [rows / 8, 8 * row bytes] to write the interleaved rows into (a slice
    of a stack), used only where m is interleaved."""
    _check_m(m, whole=True)
    if xq is None:
        xq = m.qtype in formats.XQ_DEFAULT
    if m.interleaved or m.qtype not in formats.PACK_DEFAULT or not xq or m.rows % X8:
        return m
    nb, ts = m.cols // QTYPES[m.qtype][1], QTYPES[m.qtype][2]
    src = np.ascontiguousarray(m.data).reshape(-1)  # [G * 8 * nb * ts]: G groups of 8 rows
    shape = (m.rows // X8, X8 * nb * ts)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be contiguous uint8 {shape}, got {out.dtype} {out.shape}")
    _interleave(m._id, src, nb, ts, out)
    return QuantMatrix(out, m.qtype, m.shape, interleaved=True)


def qgemv_rows(m: QuantMatrix, rows: np.ndarray, x: np.ndarray, out: np.ndarray | None = None,
               xq: bool | None = None) -> np.ndarray:
    """out[i] = m[rows[i]] · x. rows int [K]; x float32 [cols]; returns out float32 [K] (overwritten).

    xq: quantise x to Q8 per 32-block and dot in integers (None: when m's type is in `formats.XQ_DEFAULT`)."""
    _check_m(m)
    rows = as_rows(rows, m.rows)
    x = _as_f32(x, (m.cols,), "x")
    out = np.empty(rows.shape[0], np.float32) if out is None else _check_out(out, rows.shape)
    if xq is None:
        xq = m.qtype in formats.XQ_DEFAULT
    if xq and m.qtype not in _XQ_TYPES:
        raise ValueError(f"xq=True supports {', '.join(_XQ_TYPES)}, not {m.qtype}")
    if rows.shape[0]:
        qgemv_rows_kernel(m._id, m.data, rows, x, bool(xq), out)
    return out


def qgemv(m: QuantMatrix, x: np.ndarray, out: np.ndarray | None = None, xq: bool | None = None) -> np.ndarray:
    """Dense out = m @ x over all rows. x float32 [cols] -> out float32 [rows]. An interleaved m
    (`pack_rows`) always takes Q8 activations."""
    _check_m(m, whole=True)
    if m.interleaved:
        if xq is False:
            raise ValueError("an interleaved matrix takes Q8 activations only (xq=False is not available)")
        x = _as_f32(x, (m.cols,), "x")
        out = np.empty(m.rows, np.float32) if out is None else _check_out(out, (m.rows,))
        qgemv_x8_kernel(m._id, m.data, x, out)
        return out
    return qgemv_rows(m, m.all_rows(), x, out, xq)


def qaxpy_rows(m: QuantMatrix, rows: np.ndarray, coeff: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[cols] += sum_i coeff[i] * m[rows[i]] (down projection with m = W_down transposed)."""
    _check_m(m)
    rows = as_rows(rows, m.rows)
    coeff = _as_f32(coeff, rows.shape, "coeff")
    _check_out(out, (m.cols,))
    k = rows.shape[0]
    if k:
        _qaxpy_rows_kernel(m._id, m.data, rows, coeff, min(get_threads(), k), out)
    return out


def qffn_rows(x: np.ndarray, rows: np.ndarray, up: QuantMatrix, down_t: QuantMatrix, act: str,
              gate: QuantMatrix | None = None, out: np.ndarray | None = None,
              xq: bool | None = None, up_bias: np.ndarray | None = None,
              row_scale: np.ndarray | None = None) -> np.ndarray:
    """Fused sparse FFN of one token over the selected neurons; returns out float32 [D] (+=).

    x float32 [D]; up, gate [I, D] (same type); down_t [I, D], W_down transposed (any type, see
    `transpose_quantized`). h_j = act(gate_j·x) * (up_j·x) when gate is given, else
    act(up_j·x + up_bias_j); out += sum_j h_j * row_scale_j * down_t[j] over j in rows (row_scale
    float32 [I] or None: e.g. the routing weight of the expert a row belongs to). act: relu | silu |
    gelu_tanh. xq: as in `qgemv_rows`, for gate / up (None: when up's type is in `formats.XQ_DEFAULT`).
    """
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    _check_m(up, "up")
    _check_m(down_t, "down_t")
    n, d = up.shape
    if down_t.shape != (n, d):
        raise ValueError(f"down_t has shape {down_t.shape}, expected {(n, d)} like up (W_down transposed)")
    if gate is not None:
        _check_m(gate, "gate")
        if gate.shape != (n, d) or gate.qtype != up.qtype:
            raise ValueError(f"gate must be {up.qtype} {(n, d)} like up, got {gate.qtype} {gate.shape}")
    x = _as_f32(x, (d,), "x")
    rows = as_rows(rows, n)
    out = np.zeros(d, np.float32) if out is None else _check_out(out, (d,))
    k = rows.shape[0]
    if k:
        g = gate if gate is not None else up
        use_xq = up.qtype in formats.XQ_DEFAULT if xq is None else bool(xq)
        bias = _NONE if (up_bias is None or gate is not None) else _as_f32(up_bias, (n,), "up_bias")
        scale = _NONE if row_scale is None else _as_f32(row_scale, (n,), "row_scale")
        qffn_one_kernel(x, rows, up._id, up.data, g.data, down_t._id, down_t.data, ACTS[act],
                         gate is not None, use_xq, bias, bias is not _NONE, scale, scale is not _NONE,
                         min(get_threads(), k), out)
    return out


_NONE = np.zeros(1, np.float32)
BATCH_CHUNK_BYTES = 16 << 20  # float32 rows decoded at once by qffn_rows_batch


def gemm_operands(m: QuantMatrix, rows: np.ndarray, buf: np.ndarray | None = None):
    """Rows of m decoded for a torch GEMM: bfloat16 where `GEMM_BF16`, else float32. buf: a
    scratch array of at least len(rows) rows of that dtype (None: a new one). -> [K, cols] tensor."""
    import torch

    if buf is not None:
        buf = buf[: len(rows)]
    if GEMM_BF16:
        return torch.from_numpy(qdequantize(m, rows, buf, bf16=True)).view(torch.bfloat16)
    return torch.from_numpy(qdequantize(m, rows, buf))


def gemm_scratch(rows: int, cols: int) -> np.ndarray:
    """A scratch buffer for `gemm_operands` of rows x cols."""
    return np.empty((rows, cols), np.uint16 if GEMM_BF16 else np.float32)


def _gemm_bf16_supported() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Several tokens' products (prefill) over decoded blocks in bfloat16 where oneDNN has bfloat16
# kernels (AVX512-BF16 / AMX): 2-core Zen 4, [64, 4096] x [4096, 11008]: 365 GFLOP/s against 110 in
# float32. x, the decoded weights and the products are rounded to bfloat16 (2^-9 relative), far
# below a 4-bit block's own error (~8%) and of the order of the Q8 activations that llama.cpp's
# prefill and our one-token kernels use. Tests that compare the block path exactly turn it off.
GEMM_BF16 = _gemm_bf16_supported()


def _torch_act(act: str):
    """The torch function of an activation name (one of ACTS), for the GEMM paths."""
    import torch

    return {"relu": torch.relu, "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}[act]


def qffn_rows_batch(X: np.ndarray, rows: np.ndarray, up: QuantMatrix, down_t: QuantMatrix, act: str,
                    gate: QuantMatrix | None = None, up_bias: np.ndarray | None = None,
                    out: np.ndarray | None = None, row_scale: np.ndarray | None = None) -> np.ndarray:
    """`qffn_rows` for T tokens sharing one selection: X float32 [T, D] -> out float32 [T, D] (+=).

    The selected rows are decoded `BATCH_CHUNK_BYTES` of float32 at a time (each block once per
    call, whatever T) and multiplied with torch's GEMM (see `GEMM_BF16`), so prefill reads the
    blocks once."""
    import torch

    n, d = up.shape
    X = batch_input(X, d, act)
    rows = as_rows(rows, n)
    out = np.zeros((X.shape[0], d), np.float32) if out is None else _check_out(out, (X.shape[0], d))
    if rows.shape[0] == 0 or X.shape[0] == 0:
        return out
    fn = _torch_act(act)
    y = torch.from_numpy(out)
    x = torch.from_numpy(X).to(torch.bfloat16 if GEMM_BF16 else torch.float32)  # [T, D]
    step = max(1, BATCH_CHUNK_BYTES // (4 * d))
    buf = gemm_scratch(min(step, rows.shape[0]), d)
    for a in range(0, rows.shape[0], step):
        r = rows[a:a + step]
        z = (x @ gemm_operands(gate if gate is not None else up, r, buf).T).float()  # [T, k]
        if gate is not None:
            h = fn(z) * (x @ gemm_operands(up, r, buf).T).float()
        else:
            h = fn(z + torch.from_numpy(up_bias[r]).float()) if up_bias is not None else fn(z)
        if row_scale is not None:
            h = h * torch.from_numpy(np.asarray(row_scale, np.float32)[r])
        y += (h.to(x.dtype) @ gemm_operands(down_t, r, buf)).float()  # [T, D]
    return out


def _expert_shapes(gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix) -> tuple[int, int, int]:
    # (experts E, hidden I, dim D) of stacked experts: gate, up [E*I, D] of one type, down [E*D, I]
    for name, m in (("gate", gate), ("up", up), ("down", down)):
        _check_m(m, name, whole=True)  # (an expert is read whole: interleaved groups are fine)
    if gate.shape != up.shape or gate.qtype != up.qtype or gate.interleaved != up.interleaved:
        raise ValueError(f"gate and up must match: {gate.qtype} {gate.shape} vs {up.qtype} {up.shape}")
    d, i = gate.cols, down.cols
    e = down.rows // d if d else 0
    if e <= 0 or down.rows != e * d or gate.rows != e * i:
        raise ValueError(f"down {down.shape} is not {gate.rows // max(i, 1)} experts' [D={d}, I={i}] W_down "
                         f"beside gate {gate.shape}")
    if i % 32 or (down.interleaved and d % X8):
        raise ValueError(f"expert hidden size {i} must be a multiple of 32 (and dim {d} of 8 when interleaved)")
    return e, i, d


def qexperts(x: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
             down: QuantMatrix, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """One token through whole experts in the file's own blocks (MoE decode): out += sum_k coef[k] *
    down_e (act(gate_e x) * (up_e x)) for e = experts[k]. Returns out float32 [D] (+=).

    x float32 [D]; experts int [n] (positions in the stacks, distinct); coef float32 [n] (routing
    weights); gate, up [E*I, D] of one type (expert e's rows [e*I, (e+1)*I)); down [E*D, I], each
    expert's W_down as GGUF stores it (blocks along I; rows [e*D, (e+1)*D)): read in place, no
    transposed copy. Q8 activations where the type is in `formats.XQ_DEFAULT` (x for gate/up, each expert's h
    for down). One call, two parallel phases: the experts' gate/up rows with the activation, then
    the down GEMVs, summed per span of output rows in the experts' order (over interleaved stacks
    with silu, bit for bit what `qexperts_tokens` gives the token for its experts in that order)."""
    e, i, d = check_expert_stacks(gate, up, down, act)
    x = _as_f32(x, (d,), "x")
    experts = as_rows(experts, e)
    if len(np.unique(experts)) != len(experts):
        raise ValueError("experts must be distinct")
    coef = _as_f32(coef, experts.shape, "coef")
    out = np.zeros(d, np.float32) if out is None else _check_out(out, (d,))
    return qexperts_trusted(x, experts, coef, gate, up, down, act, out)


def check_expert_stacks(gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, act: str) -> tuple[int, int, int]:
    """Check stacked experts as `qexperts` takes them (ValueError if not) -> (experts E, hidden I, dim D)."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    return _expert_shapes(gate, up, down)


def qexperts_trusted(x: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
                     down: QuantMatrix, act: str, out: np.ndarray) -> np.ndarray:
    """`qexperts` without its argument checks, for a caller that checked its stacks once
    (`check_expert_stacks`) and passes its own well-formed buffers: x float32 [D] and out float32
    [D] C-contiguous, experts int64 [n] distinct and in range, coef float32 [n]. The MoE executor's
    decode step calls it once a layer, where the checks cost about as much as the call."""
    if experts.shape[0]:
        qexperts_one_kernel(x, experts, coef, up._id, gate.data, up.data, up.interleaved, down._id, down.data,
                             down.interleaved, down.cols, ACTS[act], up.interleaved or up.qtype in formats.XQ_DEFAULT,
                             down.interleaved or down.qtype in formats.XQ_DEFAULT, out)
    return out


def qexperts_routed(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, pos: np.ndarray, gate: QuantMatrix,
                    up: QuantMatrix, down: QuantMatrix, act: str, out: np.ndarray) -> int:
    """One decode token's routed experts held here, selected and computed in one kernel call, without
    argument checks (as `qexperts_trusted`): out = sum_j weights[j] * expert pos[ids[j]] (x) over the j
    with pos[ids[j]] >= 0, in routing order (out overwritten). ids int64 [k] in range of pos, weights
    float32 [k], pos int64 [E] (positions in the stacks, -1 elsewhere). Returns the experts computed.
    The MoE executor's decode step: the selection in numpy cost ~5 µs a layer."""
    return qexperts_routed_kernel(x, ids, weights, pos, up._id, gate.data, up.data, up.interleaved, down._id, down.data,
                                  down.interleaved, down.cols, ACTS[act], up.interleaved or up.qtype in formats.XQ_DEFAULT,
                                  down.interleaved or down.qtype in formats.XQ_DEFAULT, out)


def qexperts_tokens(X: np.ndarray, experts: np.ndarray, coef: np.ndarray, gate: QuantMatrix, up: QuantMatrix,
                    down: QuantMatrix, act: str, out: np.ndarray | None = None) -> np.ndarray:
    """`qexperts` for T tokens in one call (MoE prefill): out[t] += sum_k coef[t, k] * expert
    experts[t, k] (x[t]) over the k with experts[t, k] >= 0 (positions in the stacks; -1: skipped, an
    expert computed elsewhere). X float32 [T, D]; experts int [T, k] (distinct per token); coef float32
    [T, k]; returns out float32 [T, D] (+=). Each token's Q8 activations are made once; each routed
    expert's gate/up rows are read once for all of its tokens and its down rows once per span of
    output rows; each token gets the products the one-token kernel computes, summed in ascending
    expert order (equal to `qexperts` given the experts in that order: bit for bit with silu over
    interleaved stacks, else up to the float rounding of that sum, ~1e-7). Interleaved gate/up
    (`pack_rows`): tiles.py's kernels, a decoded block dotted with up to 8 tokens at once; else one
    pair at a time. 2-core AMX Xeon, 128 Q4_0 Qwen3-30B-A3B experts, 8 routed per token, 2 threads
    (tools/bench_kt_kernel.py, the machine shared): 128 tokens 84 ms, 512 tokens 208 ms; 1 thread
    (CPU time) against the pair-at-a-time kernel: 2.0x (128 tokens), 2.4x (512)."""
    e, i, d = check_expert_stacks(gate, up, down, act)
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    experts = np.asarray(experts)
    if experts.ndim != 2 or experts.shape[0] != X.shape[0] or experts.dtype.kind not in "iu":
        raise ValueError(f"experts must be an int array [{X.shape[0]}, k], got {experts.dtype} {experts.shape}")
    coef = _as_f32(coef, experts.shape, "coef")
    if ((experts < -1) | (experts >= e)).any():
        raise IndexError(f"expert position out of range [0, {e}) (or -1)")
    chosen = np.sort(np.where(experts >= 0, experts, e + np.arange(experts.shape[1])), axis=1)  # (skips distinct)
    if (np.diff(chosen, axis=1) == 0).any():
        raise ValueError("experts must be distinct per token")
    out = np.zeros(X.shape, np.float32) if out is None else _check_out(out, X.shape)
    t_idx, k_idx = np.nonzero(experts >= 0)
    if t_idx.shape[0] == 0:
        return out
    first = experts[t_idx, k_idx].astype(np.int64)
    order = np.lexsort((t_idx, first))  # by expert, then token
    tok, first, c = t_idx[order].astype(np.int64), first[order], np.ascontiguousarray(coef[t_idx, k_idx][order])
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1], True]).astype(np.int64)
    xq_down = down.interleaved or down.qtype in formats.XQ_DEFAULT
    if up.interleaved:
        qexperts_tiles(X, tok, first, c, starts, up._id, gate.data, up.data, down._id, down.data,
                       down.interleaved, down.cols, ACTS[act], xq_down, out)
    else:
        _qexperts_pairs_kernel(X, tok, first, c, starts, up._id, gate.data, up.data, False, down._id, down.data,
                               down.interleaved, down.cols, ACTS[act], up.qtype in formats.XQ_DEFAULT, xq_down, out)
    return out


def qexpert_batch(X: np.ndarray, expert: int, gate: QuantMatrix, up: QuantMatrix, down: QuantMatrix, act: str,
                  coef: np.ndarray | None = None) -> np.ndarray:
    """T tokens through one whole expert (prefill), as `qexperts` lays them out: X float32 [T, D] ->
    float32 [T, D] = coef[:, None] * down_e (act(gate_e X) * (up_e X)) (coef float32 [T] or None).
    The expert's blocks are decoded once (bfloat16 where `GEMM_BF16`) for torch GEMMs."""
    import torch

    e, i, d = check_expert_stacks(gate, up, down, act)
    if not 0 <= expert < e:
        raise IndexError(f"expert {expert} out of range [0, {e})")
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != d:
        raise ValueError(f"X must be [T, {d}], got {X.shape}")
    fn = _torch_act(act)
    x = torch.from_numpy(X).to(torch.bfloat16 if GEMM_BF16 else torch.float32)  # [T, D]
    rows = np.arange(expert * i, (expert + 1) * i, dtype=np.int64)
    h = fn((x @ gemm_operands(gate, rows).T).float()) * (x @ gemm_operands(up, rows).T).float()  # [T, I]
    if coef is not None:
        h = h * torch.from_numpy(_as_f32(coef, (X.shape[0],), "coef"))[:, None]
    w_down = gemm_operands(down, np.arange(expert * d, (expert + 1) * d, dtype=np.int64))  # [D, I]
    return (h.to(x.dtype) @ w_down.T).float().numpy()


def qdequantize(m: QuantMatrix, rows: np.ndarray | None = None, out: np.ndarray | None = None,
                bf16: bool = False) -> np.ndarray:
    """float32 [K, cols] of m's rows (all when None), decoded in parallel by the kernels' block code
    (gguf.quants' numpy decoder, `QuantMatrix.dequantize`, is the independent reference); bf16:
    uint16 [K, cols] holding bfloat16 bits instead (rounded to nearest even; half the bytes, for a
    bfloat16 GEMM: `torch.from_numpy(a).view(torch.bfloat16)`). out, when given, must be a
    C-contiguous array of that dtype and shape; it is overwritten."""
    _check_m(m, whole=True)
    if rows is None:
        rows = m.all_rows()
    rows = as_rows(rows, m.rows)
    k = rows.shape[0]
    shape, dt = (k, m.cols), (np.uint16 if bf16 else np.float32)
    if out is None:
        out = np.empty(shape, dt)
    elif out.dtype != dt or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {np.dtype(dt)} array of shape {shape}")
    data = m.data
    if m.interleaved and k and k % X8 == 0 and rows[0] % X8 == 0 and rows[-1] - rows[0] == k - 1 \
            and bool(np.all(np.diff(rows) == 1)):  # whole groups: decoded in place
        _x8_dequant_kernel(m._id, m.data, rows[0] // X8, out, bf16)
        return out
    if m.interleaved:  # other rows in the GGUF layout first (a copy)
        data, rows = m.row_data(rows), np.arange(k, dtype=np.int64)
    if rows.shape[0] and bf16:
        _qdequant_bf16_kernel(m._id, data, rows, out)
    elif rows.shape[0]:
        out[:] = 0.0
        qdequant_kernel(m._id, data, rows, out)
    return out
