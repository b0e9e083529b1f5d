"""Read GGUF model files into hotcold's canonical tensors and an HF-style config.

`GGUFFile(path)` memory-maps a llama.cpp GGUF file with `gguf.GGUFReader`, checks
it is complete, exposes its metadata as plain Python values, translates that
metadata into a Hugging Face `config.json`-style dict (`hf_config()`), and yields
its tensors one at a time under the canonical names of models/NAMES.md,
dequantised and with llama.cpp's storage conventions undone (`tensors()`):

- GGUF lists dims fastest-first (ne0 = the input dim); the reader's numpy view is
  already reversed, so a matrix comes out as PyTorch's [out, in].
- llama.cpp permutes the q/k rows of `llama` models for its rotary layout;
  `unpermute_rotary` restores HF's layout.
- llama.cpp stores gemma3 norm weights as w + 1; we subtract the 1 again.
- Llama-3 rope scaling is stored as a `rope_freqs` tensor of per-frequency
  divisors, not as metadata; `llama3_rope_scaling` recovers HF's parameters.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import sys
import warnings
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from hotcold.errors import ModelFileError, UnsupportedModelError
from hotcold.models.gguf_config import MODEL_TYPES, Meta, hf_config_from_metadata, llama3_rope_scaling, one_line
from hotcold.sparse_ops.blocks_torch import DECODABLE
from hotcold.sparse_ops.blocks_torch import dequantize as dequantize_blocks
from hotcold.sparse_ops.quant import QTYPES, QuantMatrix

__all__ = [
    "GGUFFile",
    "drop_file_pages",
    "SUPPORTED_TENSOR_TYPES",
    "canonical_name",
    "kept_quantized",
    "hf_config_from_metadata",
    "llama3_rope_scaling",
    "permute_rotary",
    "unpermute_rotary",
]

SUPPORTED_TENSOR_TYPES = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K}
)

# Whole-model tensors: GGUF name -> canonical name.
_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",  # [V, D]
    "output_norm.weight": "norm.weight",  # [D]
    "output.weight": "lm_head.weight",  # [V, D]
}
# Per-layer tensors: GGUF `blk.{i}.<key>` -> canonical `layers.{i}.<value>`.
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
    "attn_q.weight": "attn.q.weight",  # [H*Dh, D]
    "attn_k.weight": "attn.k.weight",  # [Hkv*Dh, D]
    "attn_v.weight": "attn.v.weight",  # [Hkv*Dh, D]
    "attn_output.weight": "attn.o.weight",  # [D, H*Dh]
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "attn_output.bias": "attn.o.bias",
    "attn_q_norm.weight": "attn.q_norm.weight",  # [Dh]
    "attn_k_norm.weight": "attn.k_norm.weight",  # [Dh]
    "ffn_gate.weight": "ffn.gate.weight",  # [I, D]
    "ffn_up.weight": "ffn.up.weight",  # [I, D]
    "ffn_down.weight": "ffn.down.weight",  # [D, I]
    "ffn_gate_inp.weight": "ffn.router.weight",  # [E, D]
    "ffn_gate_exps.weight": "ffn.experts.gate",  # [E, I, D]
    "ffn_up_exps.weight": "ffn.experts.up",  # [E, I, D]
    "ffn_down_exps.weight": "ffn.experts.down",  # [E, D, I]
    "ffn_gate_shexp.weight": "ffn.shared.gate.weight",  # [Is, D]
    "ffn_up_shexp.weight": "ffn.shared.up.weight",  # [Is, D]
    "ffn_down_shexp.weight": "ffn.shared.down.weight",  # [D, Is]
    "ffn_gate_inp_shexp.weight": "ffn.shared_gate.weight",  # GGUF [D] -> [1, D]
}
# Tensors with no canonical counterpart whose content comes through hf_config().
_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_GGUF_MAGIC = b"GGUF"


# Canonical names never kept in blocks: small matrices the fast tier reads as plain tensors.
_ALWAYS_DENSE = ("router.weight", "shared_gate.weight", "embed_positions.weight")


def kept_quantized(name: str, ggml_type: str, ndim: int) -> bool:
    """Whether the loader keeps canonical tensor `name` of `ggml_type` as stored when asked to: the
    matrices (2-D, or 3-D expert stacks) of a type the CPU kernels compute on, and a float16 /
    bfloat16 token embedding (`HalfEmbedding`: expanding it to float32 doubled a generated Q4_0
    file's RAM)."""
    if name == "embed.weight" and ggml_type in _HALF_TYPES:
        return True
    return ggml_type in QTYPES and ndim >= 2 and not name.endswith(_ALWAYS_DENSE)


DECODE_SLICE = 1 << 24  # elements a torch decode takes at a time (its float32 temporaries: a few times 64 MB)
_HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def canonical_name(gguf_name: str) -> str | None:
    """Canonical hotcold name of a GGUF tensor; None for tensors to skip.

    Raises UnsupportedModelError for a name hotcold does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModelError(
        f"tensor {gguf_name!r} is not one hotcold knows how to load; "
        "this model variant is not supported"
    )


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF rotate-half layout -> interleaved pairs).

    w: [n_head*Dh, ...] -> same shape; within each head, rows (j, Dh/2 + j) become
    adjacent rows (2j, 2j + 1).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rotary`: llama.cpp's interleaved q/k rows back to HF's layout.

    w: [n_head*Dh, ...] (a weight [n_head*Dh, D] or a bias [n_head*Dh]).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



# ----------------------------------------------------------------------------------
# The file
# ----------------------------------------------------------------------------------


def drop_file_pages(a: np.ndarray) -> None:
    """Drop the pages of a (a view of a memory-mapped file, e.g. a GGUF tensor) from this process's
    resident set once it has been copied: pages read through a mapping stay resident until it is
    closed. Anything else is left alone."""
    root = a  # the array whose base is the mapping itself (np.memmap's own view of it)
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base
    if not isinstance(root, np.memmap) or not hasattr(mmap, "MADV_DONTNEED") or a.nbytes == 0:
        return
    mm = root.base
    start_addr = root.ctypes.data - root.offset % mmap.ALLOCATIONGRANULARITY  # where mm begins
    page = mmap.PAGESIZE
    lo = (a.ctypes.data - start_addr + page - 1) // page * page  # whole pages inside a only
    hi = (a.ctypes.data - start_addr + a.nbytes) // page * page
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def open_gguf(path: str | os.PathLike[str]) -> "GGUFFile":
    """GGUFFile(path), parsed once per version of the file (its real path, mtime and size): a 49k-token
    vocabulary's metadata takes about 3 s to parse, and `run` reads the header before it loads."""
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    return _open_cached(real, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> "GGUFFile":
    return GGUFFile(path)


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that checks tensor types and sizes before mapping the tensor data."""

    def __init__(self, path: str):
        self._source = path
        super().__init__(path, mode="r")
        for name, field in self.fields.items():
            if field.parts and isinstance(field.parts[-1], _Strings):
                self.fields[name] = _StringArrayField(*field)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """As GGUFReader._get, but slicing a plain ndarray view of the map: slicing the memmap
        itself costs ~20x more, which made opening a 262k-token vocabulary take 10 s."""
        plain = self.__dict__.get("_plain")
        if plain is None or plain.base is not self.data:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """Numeric arrays (token scores and types: 262k entries for Gemma) as one view, not one per element."""
        if raw_type == gguf.GGUFValueType.ARRAY:
            itype = self._get(orig_offs, np.uint32)
            sub = gguf.GGUFValueType(int(itype[0]))
            nptype = self.gguf_scalar_to_np.get(sub)
            alen = self._get(orig_offs + 4, np.uint64)
            if nptype is not None and int(alen[0]) > 0:
                values = self._get(orig_offs + 12, nptype, int(alen[0]))
                return 12 + int(values.nbytes), [itype, alen, values], [2], [gguf.GGUFValueType.ARRAY, sub]
            if sub == gguf.GGUFValueType.STRING and int(alen[0]) > 0 and self.byte_order == "I" \
                    and sys.byteorder == "little":
                return self._string_array(orig_offs, itype, alen)
        return super()._get_field_parts(orig_offs, raw_type)

    def _string_array(self, orig_offs: int, itype, alen):
        """An array of strings (a vocabulary: 262k tokens for Gemma 3) decoded in one loop over the
        file's bytes into one part, a _Strings list (GGUFReader makes two numpy views per string, and
        its contents() decodes each: ~2 s of a 270M model's start-up); __init__ gives its field the
        contents() that reads that list."""
        with open(self._source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            end = len(mm)
            offs = orig_offs + 12
            out = _Strings()
            from_bytes = int.from_bytes
            for _ in range(int(alen[0])):
                n = from_bytes(mm[offs:offs + 8], "little")
                if offs + 8 + n > end:
                    raise ValueError("a string array runs past the end of the file")
                out.append(mm[offs + 8:offs + 8 + n].decode("utf-8"))
                offs += 8 + n
        return offs - orig_offs, [itype, alen, out], [2], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        data_end = 0  # bytes of tensor data the header promises, from start_offs
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                qtype = QT(int(raw_type[0]))
            except ValueError:
                raise UnsupportedModelError(
                    f"{self._source}: tensor {name!r} has ggml type {int(raw_type[0])}, unknown to "
                    "the installed gguf package; upgrade gguf or use another quantisation"
                ) from None
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims.astype(np.int64))) * block_bytes // block
            data_end = max(data_end, int(offset[0]) + n_bytes)
        found = len(self.data) - start_offs
        if found < data_end:
            raise ModelFileError(
                f"{self._source}: file is truncated (expected {data_end} bytes of tensor data, "
                f"found {max(found, 0)}); re-download it"
            )
        super()._build_tensors(start_offs, fields)


class _Strings(list):
    """The decoded strings of a GGUF string array, kept as one part of its field."""


class _StringArrayField(gguf.ReaderField):
    """A string array's field whose last part is its _Strings."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        return self.parts[-1][index_or_slice]


def _open_reader(path: str) -> gguf.GGUFReader:
    """Open `path` with GGUFReader, turning every failure into a one-line HotcoldError."""
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: file not found; check the path")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, not a .gguf file; pass the .gguf file itself")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({one_line(e.strerror or e)}); check its permissions") from None
    if magic != _GGUF_MAGIC:
        raise ModelFileError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'); pass a llama.cpp .gguf model file"
        )
    try:
        return _CheckedReader(path)
    except (ModelFileError, UnsupportedModelError):
        raise
    except Exception as e:  # GGUFReader raises ValueError/IndexError/... on a cut-off header (--debug shows it)
        raise ModelFileError(
            f"{path}: file is truncated or corrupt: its GGUF header (the model's settings and list of tensors) "
            f"cannot be read from its {os.path.getsize(path):,} bytes; re-download it"
        ) from e


def _torch_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF's dims are ne0, the input, first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


class GGUFFile:
    """A memory-mapped GGUF model file.

    Attributes: path, metadata (every key -> plain Python value), architecture
    (general.architecture). Opening checks the magic, the header, that all tensor
    data lies inside the file, and that the architecture is supported.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {key: field.contents() for key, field in self._reader.fields.items()}
        self._check_tensor_extents()
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(
                f"{self.path}: metadata key general.architecture is missing; the file is not a complete GGUF model"
            )
        if arch not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: general.architecture {arch!r} is not supported; "
                f"hotcold reads GGUF models of: {', '.join(sorted(MODEL_TYPES))}"
            )
        self.architecture: str = arch

    def _check_tensor_extents(self) -> None:
        """Every tensor's bytes must lie inside the file (the reader maps, it does not read)."""
        size = len(self._reader.data)
        end = max((t.data_offset + int(t.n_bytes) for t in self._reader.tensors), default=0)
        if end > size:
            raise ModelFileError(
                f"{self.path}: file is truncated (expected {end - self._reader.data_offset} bytes of tensor data, "
                f"found {size - self._reader.data_offset}); re-download it"
            )

    def tensor_inventory(self) -> list[tuple[str, list[int], str]]:
        """(GGUF name, shape, ggml type) of every tensor, sorted: what the model fingerprint hashes."""
        return sorted((t.name, list(shape), t.tensor_type.name)
                      for t, shape in zip(self._reader.tensors, self.tensor_shapes().values()))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape in PyTorch order (GGUF's dims reversed)."""
        return {t.name: _torch_shape(t) for t in self._reader.tensors}

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face config.json-style dict (with "model_type") for this model."""
        rope_freqs = next((t for t in self._reader.tensors if t.name == "rope_freqs.weight"), None)
        freqs = None if rope_freqs is None else self._dequantize(rope_freqs)  # [Dh/2]
        return hf_config_from_metadata(self.metadata, self.tensor_shapes(), freqs, source=self.path)

    def tensors(self, dtype: torch.dtype = torch.float32, keep_quantized: bool = False, copy: bool = True,
                device: torch.device | str = "cpu") -> Iterator[tuple[str, "torch.Tensor | QuantMatrix"]]:
        """Yield (canonical name, tensor) one at a time, dequantised into `dtype`. A matrix in a type
        `blocks_torch` decodes comes decoded by torch on `device` (its blocks cross to a GPU as they are,
        a quarter to a half of the float bytes; the same float32 values as gguf's numpy decoders,
        which took most of a 48-layer MoE file's 4.5-minute GPU profile); other tensors come on the CPU.

        copy False: an F16 matrix yielded as float16 that needs no rearranging comes as a read-only
        view of the mapped file, valid until the next tensor is asked for (its pages are then dropped):
        for a consumer that copies it at once (load_model: one copy instead of two).

        keep_quantized: matrices stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K (`kept_quantized`)
        come as `QuantMatrix` views of the mapped file instead (no copy; llama q/k rows are
        un-permuted into a copy), 3-D expert stacks as [E * rows, cols]; a float16 / bfloat16 token
        embedding as a tensor of its own dtype (a read-only view of the file; a copy whose file pages
        are dropped where it is also the LM head). All names and types are checked before the first
        tensor is yielded.
        """
        plan = [(t, self._canonical(t)) for t in self._reader.tensors]
        for t, name in plan:
            if name is not None:
                self._check_type(t)
        heads = self._head_counts()
        tied = not any(t.name == "output.weight" for t in self._reader.tensors)
        for t, name in plan:
            if name is None:
                continue
            if keep_quantized and kept_quantized(name, t.tensor_type.name, len(t.shape)):
                if t.tensor_type.name in _HALF_TYPES:  # the embedding, as stored
                    # tied, the LM head streams it every token: a copy (huge pages, where advised);
                    # untied, a view of the mapped file: a lookup reads a prompt's rows only (a copy
                    # took 0.9 s and 0.6 GiB of RAM for a 152k x 2048 table)
                    bits = (np.array if tied else np.asarray)(t.data).view(np.uint8).reshape(-1).view(np.uint16)
                    with warnings.catch_warnings():  # the view of the read-only mapping is never written
                        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                        w = torch.from_numpy(bits.reshape(-1, int(t.shape[0])))  # [V, D]
                    yield name, w.view(_HALF_TYPES[t.tensor_type.name])
                    if tied:
                        self._release(t)
                else:
                    yield name, self._quant_matrix(t, heads)
                continue
            if t.tensor_type.name in DECODABLE and len(t.shape) >= 2:
                w = self._conventions(t, self._decode_torch(t, dtype, device), heads).contiguous()
            else:
                w = self._convert(t, heads, copy)
                with warnings.catch_warnings():  # a view of the read-only mapping (copy False): not written to
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    w = torch.from_numpy(w).to(dtype)
            yield name, w
            del w
            self._release(t)

    def tensor_storage(self) -> list[tuple[str, str, int, int, bool]]:
        """(canonical name, ggml type, elements, bytes in the file, kept in blocks by
        `tensors(keep_quantized=True)`) of every tensor the model loads."""
        out = []
        for t in self._reader.tensors:
            name = self._canonical(t)
            if name is not None:
                kept = kept_quantized(name, t.tensor_type.name, len(t.shape))
                out.append((name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), kept))
        return out

    def kept_names(self) -> list[str]:
        """Canonical names of the tensors `tensors(keep_quantized=True)` yields as QuantMatrix."""
        return [n for t in self._reader.tensors if (n := self._canonical(t)) is not None
                and kept_quantized(n, t.tensor_type.name, len(t.shape))]

    def _quant_matrix(self, t: Any, heads: tuple[int, int]) -> QuantMatrix:
        """Tensor t's blocks as a QuantMatrix [rows, cols] (experts stacked: [E * rows, cols])."""
        ne = [int(v) for v in t.shape]  # ggml order: ne0 = cols
        data = t.data.reshape(-1, t.data.shape[-1])  # uint8 [rows, bytes per row], a view
        key = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        if self.architecture == "llama" and key in ("attn_q.weight", "attn_k.weight"):
            rows = np.arange(data.shape[0]).reshape(-1, 1)
            perm = unpermute_rotary(rows, heads[0] if key == "attn_q.weight" else heads[1])[:, 0]
            data = np.ascontiguousarray(data[perm])
        return QuantMatrix(data, t.tensor_type.name, (int(np.prod(ne[1:])), ne[0]))

    def _release(self, t: Any) -> None:
        """Drop tensor t's file pages from this process's resident set once it has been converted: the
        whole file is mapped, and pages read through a mapping stay resident until it is closed (a
        3.8 GiB f16 file loaded to a peak RSS of 8.6 GiB, the file beside the model's copy)."""
        drop_file_pages(t.data)

    # -- helpers --------------------------------------------------------------------

    def _canonical(self, t: Any) -> str | None:
        try:
            return canonical_name(t.name)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{self.path}: {e}") from None

    def _check_type(self, t: Any) -> None:
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_TENSOR_TYPES)
            raise UnsupportedModelError(
                f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which hotcold cannot "
                f"dequantise (supported: {supported}); use a file quantised with a supported type"
            )

    def _head_counts(self) -> tuple[int, int]:
        meta = Meta(self.metadata, self.architecture, self.path)
        n_heads = int(meta.need("attention.head_count"))
        return n_heads, int(meta.get("attention.head_count_kv", n_heads))

    def _dequantize(self, t: Any) -> np.ndarray:
        """Tensor data as a fresh float32 array in PyTorch order ([out, in]; experts [E, out, in])."""
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.tensor_type == QT.F32:
            w = w.copy()  # F32 "dequantises" to a view of the mmap: never hand that out
        return w.astype(np.float32, copy=False).reshape(_torch_shape(t))

    def _decode_torch(self, t: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A `DECODABLE` tensor decoded by torch on `device` into `dtype` [torch shape], in float32
        and then rounded (as the numpy path), a slice of rows at a time (bounded temporaries)."""
        shape = _torch_shape(t)
        cols = shape[-1]
        rows = int(t.n_elements) // cols
        row_bytes = cols // QTYPES[t.tensor_type.name][1] * QTYPES[t.tensor_type.name][2]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        out = torch.empty(rows, cols, dtype=dtype, device=device)
        step = max(1, DECODE_SLICE // cols)
        with warnings.catch_warnings():  # reads of the read-only mapping
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for a in range(0, rows, step):
                b = min(rows, a + step)
                blocks = torch.from_numpy(raw[a * row_bytes : b * row_bytes]).to(device)
                out[a:b] = dequantize_blocks(blocks, t.tensor_type.name, (b - a, cols), dtype=torch.float32)
        return out.reshape(shape)

    def _convert(self, t: Any, heads: tuple[int, int], copy: bool = True) -> np.ndarray:
        """Dequantise one tensor (an F16 one stays float16: torch widens or narrows it 4x faster than
        gguf's float32 conversion, which took 0.32 s per 4096 x 11008 matrix) and undo llama.cpp's
        storage conventions. copy False: an F16 matrix may be a view of the mapped file."""
        if t.tensor_type == QT.F16 and len(t.shape) >= 2:  # (vectors, e.g. Gemma's norms, take float32)
            w = (np.array if copy else np.asarray)(t.data, dtype=np.float16).reshape(_torch_shape(t))
        else:
            w = self._dequantize(t)
        return np.ascontiguousarray(self._conventions(t, w, heads))

    def _conventions(self, t: Any, w, heads: tuple[int, int]):
        """Undo llama.cpp's storage conventions on tensor t's values `w` (a numpy array or a torch
        tensor: the same operations on either); may return a view."""
        key = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        if self.architecture == "llama" and key in ("attn_q.weight", "attn_q.bias"):
            w = unpermute_rotary(w, heads[0])  # w: [H*Dh, D]
        elif self.architecture == "llama" and key in ("attn_k.weight", "attn_k.bias"):
            w = unpermute_rotary(w, heads[1])  # w: [Hkv*Dh, D]
        elif self.architecture == "gemma3" and key.endswith("norm.weight"):
            w = w - 1.0  # stored as 1 + w; HF's Gemma3RMSNorm adds the 1 itself
        elif key == "ffn_gate_inp_shexp.weight":
            w = w.reshape(1, -1)  # [D] -> [1, D]
        return w

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, architecture={self.architecture!r}, tensors={len(self._reader.tensors)})"
