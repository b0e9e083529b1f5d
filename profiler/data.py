"""Calibration data: text sources (.txt, .jsonl with a `text` field, or Python's documentation),
tokenised into fixed-length sequences, with a held-out tail for perplexity."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hotcold.errors import HotcoldError


class DataError(HotcoldError):
    """A calibration data file is missing, unreadable or has no text."""


@dataclass
class Source:
    """One calibration text source and, once tokenised, how many tokens it gave."""

    name: str
    text: str
    tokens: int = 0


def default_source() -> Source:
    """Python's own documentation (pydoc_data.topics): ~110k tokens of prose, no download."""
    from hotcold.models.perplexity import calibration_text

    return Source("pydoc_data.topics", calibration_text())


def read_source(path: Path) -> Source:
    """A .txt file (used whole) or a .jsonl file (one JSON object per line with a string `text`)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path}: no such file; --data takes .txt files or .jsonl files with a 'text' field")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix.lower() == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be an object with a 'text' field") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{path}:{n}: no string field 'text' in this JSON line")
            texts.append(record["text"])
        raw = "\n\n".join(texts)
    elif path.suffix.lower() not in (".txt", ".text", ".md", ""):
        raise DataError(f"{path}: unsupported data file type '{path.suffix}'; use .txt or .jsonl")
    if not raw.strip():
        raise DataError(f"{path}: contains no text")
    return Source(str(path), raw)


@dataclass
class Calibration:
    """Token ids split into profiling sequences and a held-out stream for perplexity."""

    sequences: torch.Tensor  # [N, L] int64, each starting with BOS when the model uses one
    heldout: list[int]  # ids for perplexity windows (disjoint from the sequences' text)
    sources: list[Source]
    reused: bool  # the text was shorter than asked and was reused with shifted windows


def tokenise(tokenizer, sources: list[Source], tokens: int, seq_len: int, heldout_tokens: int) -> Calibration:
    """Tokenise sources; keep the last `heldout_tokens` ids for perplexity, cut the rest into
    sequences of `seq_len` (BOS first when the model adds one) until `tokens` are covered."""
    ids: list[int] = []
    for src in sources:
        part = tokenizer.encode(src.text, add_special_tokens=False)
        src.tokens = len(part)
        ids.extend(part)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    body = seq_len - (bos is not None)
    if body < 1:
        raise DataError(f"--seq-len {seq_len} is too short")
    heldout = ids[len(ids) - heldout_tokens :] if heldout_tokens else []
    ids = ids[: len(ids) - len(heldout)]
    if len(ids) < body:
        raise DataError(f"calibration text has {len(ids)} tokens after holding out {len(heldout)} for perplexity; "
                        f"need at least one sequence of {seq_len}: give more text (--data) or a smaller --seq-len")
    want = -(-tokens // seq_len)  # sequences
    starts: list[int] = []
    offset, reused = 0, False
    while len(starts) < want:
        pass_starts = list(range(offset, len(ids) - body + 1, body)) or [0]
        starts.extend(pass_starts[: want - len(starts)])
        if len(starts) < want:  # text exhausted: reuse it, windows shifted so sequences differ
            reused = True
            offset = (offset + body // 2 + 1) % body
    seqs = torch.tensor([ids[s : s + body] for s in starts], dtype=torch.long)
    if bos is not None:
        seqs = torch.cat([torch.full((len(starts), 1), bos, dtype=torch.long), seqs], dim=1)
    return Calibration(seqs, heldout, sources, reused)
