"""`QuantMatrix`: rows of GGUF blocks of one type, and the functions that build one."""

from __future__ import annotations

import numpy as np

from hotcold.sparse_ops.selection import as_rows

from .formats import DOWN_T_DEFAULT, QTYPES, X8, X8_TYPES, qtype_name
from .interleaved import _x8_rows_kernel, _x8_table
from .quantise import _f16_bytes, dequantize_rows, quantize_rows


class QuantMatrix:
    """R rows of `cols` logical columns stored as GGUF blocks of one type, uint8 [R, bytes_per_row].

    data: uint8 [R, cols / block_size * block_bytes], C-contiguous rows (a memmap view is kept as is);
      interleaved: uint8 [R / 8, 8 * bytes_per_row], groups of 8 rows with their blocks interleaved
      (see `pack_rows`: read only whole, by qgemv and qdequantize)
    qtype: "Q8_0" | "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" | "Q4_K" | "Q5_K" | "Q6_K", a ggml type id or GGMLQuantizationType
    shape: logical (R, cols)
    """

    def __init__(self, data: np.ndarray, qtype, shape: tuple[int, int], interleaved: bool = False):
        name = qtype_name(qtype)
        _, bs, ts = QTYPES[name]
        if len(shape) != 2:
            raise ValueError(f"shape must be (rows, cols), got {shape}")
        r, c = int(shape[0]), int(shape[1])
        if c <= 0 or c % bs:
            raise ValueError(f"{name} needs cols to be a positive multiple of {bs}, got {c}")
        want = (r, c // bs * ts)
        if interleaved:
            if QTYPES[name][0] not in X8_TYPES or r % X8:
                raise ValueError(f"no interleaved layout for {name} with {r} rows")
            want = (r // X8, X8 * want[1])
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != want:
            raise ValueError(f"{name} data for shape {(r, c)} must be a uint8 array of shape {want}, got "
                             f"{getattr(data, 'dtype', type(data))} {getattr(data, 'shape', '')}")
        if not data.flags.c_contiguous:
            raise ValueError("data must be C-contiguous")
        self.data, self.qtype, self.shape, self.interleaved = data, name, (r, c), interleaved
        self._id = QTYPES[name][0]
        self._all_rows: np.ndarray | None = None

    @classmethod
    def from_gguf(cls, tensor) -> "QuantMatrix":
        """From a `gguf.GGUFReader` tensor (its `data` is uint8 [rows, bytes_per_row]; `shape` is ggml's
        [cols, rows]). No copy."""
        ne = [int(v) for v in tensor.shape]
        if len(ne) != 2:
            raise ValueError(f"{tensor.name}: expected a 2-D tensor, got ggml shape {ne}")
        return cls(tensor.data, tensor.tensor_type, (ne[1], ne[0]))

    @classmethod
    def quantize(cls, w: np.ndarray, qtype) -> "QuantMatrix":
        """Quantise a float [R, C] array (see `quantize_rows`)."""
        name = qtype_name(qtype)
        w = np.asarray(w, np.float32)
        return cls(quantize_rows(w, name), name, w.shape)

    @property
    def type_id(self) -> int:
        """The ggml type id the block kernels dispatch on."""
        return self._id

    def all_rows(self) -> np.ndarray:
        """int64 [R]: every row's index, made once (for kernels that take a row list, reading all rows)."""
        if self._all_rows is None:
            self._all_rows = np.arange(self.rows, dtype=np.int64)
        return self._all_rows

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def block_size(self) -> int:
        return QTYPES[self.qtype][1]

    def row_bytes(self) -> int:
        """Bytes a kernel reads per selected row."""
        return self.data.shape[1] // X8 if self.interleaved else self.data.shape[1]

    def row_data(self, rows: np.ndarray | None = None) -> np.ndarray:
        """uint8 [K, row_bytes] of rows (all when None) in the GGUF layout (a copy if interleaved)."""
        if not self.interleaved:
            return self.data if rows is None else self.data[np.asarray(rows, np.int64)]
        rows = np.arange(self.rows, dtype=np.int64) if rows is None else as_rows(rows, self.rows)
        out = np.empty((rows.shape[0], self.row_bytes()), np.uint8)
        if rows.shape[0]:
            _x8_rows_kernel(self.data, _x8_table(self._id), rows, out)
        return out

    def dequantize(self, rows: np.ndarray | None = None) -> np.ndarray:
        """float32 [K, cols] of rows (all when None), through gguf.quants (for tests / references)."""
        return dequantize_rows(self.row_data(rows), self.qtype, self.cols)

    def __repr__(self) -> str:
        lay = ", interleaved" if self.interleaved else ""
        return f"QuantMatrix({self.qtype}, shape={self.shape}{lay}, {self.nbytes / 2**20:.1f} MiB)"


def _check_m(m, name: str = "m", whole: bool = False) -> None:
    # whole: the caller reads all rows (interleaved matrices allowed)
    if not isinstance(m, QuantMatrix):
        raise ValueError(f"{name} must be a QuantMatrix, got {type(m).__name__}")
    if m.interleaved and not whole:
        raise ValueError(f"{name} is interleaved (pack_rows): only qgemv and qdequantize read it")


def transpose_quantized(m: QuantMatrix, kind=None, strip: int = 256) -> QuantMatrix:
    """m [R, C] -> its transpose [C, R] quantised as `kind` (None: `DOWN_T_DEFAULT`; "same": m's type).

    Built strip by strip of `strip` columns (a multiple of m's block size): dequantise the strip
    [R, strip], transpose, requantise its rows. Memory is O(R * strip). R must be a multiple of kind's
    block size. Used at load time for W_down, which GGUF stores as [D, I] while the sparse down
    projection needs neuron j's D weights contiguous.

    Requantising adds error; relative RMS error of the transposed copy against the dequantised
    original (`tools/bench_quant.py --requant`; Gaussian [4096, 2048], then real ffn_down tensors):
      kind   Q8_0    Q4_0   Q4_1   Q4_K   Q5_K   Q6_K   (as "same")
      extra  0.0053  0.078  0.078  0.078  0.038  0.019  (Q8_0 kind: 0.005 for every source type)
      SmolLM2-135M Q4_1 [576, 1536]: same 0.080-0.088, Q8_0 0.0056-0.0064
      gemma-3-270m Q4_K / Q6_K [640, 2048]: same impossible (640 % 256 != 0), Q8_0 0.0058-0.0064
    A same-type requantisation is a second, independent rounding (total error x1.4 for 4-bit types);
    Q8_0 adds ~0.005, i.e. Q4_K's total error goes from 0.0784 to 0.0786. Hence DOWN_T_DEFAULT = Q8_0:
    W_down's CPU copy is 1.9x the bytes of a 4.5-bit type, but these kernels are compute-bound on a
    small CPU and Q8_0 rows decode fastest (qaxpy_rows per row about as fast as Q4_K, faster than
    Q5_K / Q6_K), and it works for any D that is a multiple of 32."""
    _check_m(m)
    kind = m.qtype if kind == "same" else qtype_name(DOWN_T_DEFAULT if kind is None else kind)
    _, bs_in, ts_in = QTYPES[m.qtype]
    _, bs_out, ts_out = QTYPES[kind]
    r, c = m.shape
    if r % bs_out:
        raise ValueError(f"cannot store the transpose as {kind}: its rows have {r} elements, "
                         f"not a multiple of {bs_out}")
    if strip <= 0 or strip % bs_in:
        raise ValueError(f"strip must be a positive multiple of {bs_in}, got {strip}")
    out = np.empty((c, r // bs_out * ts_out), np.uint8)
    for c0 in range(0, c, strip):
        c1 = min(c, c0 + strip)
        part = m.data[:, c0 // bs_in * ts_in: c1 // bs_in * ts_in]
        dense = dequantize_rows(part, m.qtype, c1 - c0)  # [R, c1 - c0]
        out[c0:c1] = quantize_rows(np.ascontiguousarray(dense.T), kind)
    return QuantMatrix(out, kind, (c, r))


def random_matrix(qtype, shape: tuple[int, int], seed: int = 0, scale: float = 0.01) -> QuantMatrix:
    """Random valid blocks (random quant bytes, fp16 scale fields near `scale`) for tests / benchmarks."""
    name = qtype_name(qtype)
    _, bs, ts = QTYPES[name]
    r, c = shape
    if c % bs:
        raise ValueError(f"{name} needs cols to be a multiple of {bs}, got {c}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (r * (c // bs), ts), dtype=np.uint8)
    fields = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(name, (0,))
    for i, o in enumerate(fields):  # Q4_1's / Q5_1's second field (m) is signed; the K mins are subtracted
        v = scale * rng.uniform(0.5, 1.5, (blocks.shape[0], 1))
        if name in ("Q4_1", "Q5_1") and i == 1:
            v *= rng.choice([-8.0, 8.0], (blocks.shape[0], 1))
        blocks[:, o:o + 2] = _f16_bytes(v)
    return QuantMatrix(blocks.reshape(r, c // bs * ts), name, (r, c))
