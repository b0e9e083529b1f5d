"""Constrained decoding: JSON (any, or following a JSON schema) compiled by llguidance into a
per-sequence matcher whose token mask is applied to the logits before sampling.

llguidance was chosen over xgrammar by measurement on SmolLM2's and Gemma 3's tokenizers
(tools/bench_grammar.py --engines; docs/server.md has the figures): both compute a mask in tens
of microseconds, but xgrammar compiles each schema against the whole vocabulary up front while
llguidance builds its lexer lazily, so a new schema per request costs far less.

One `Grammar` is compiled per request (`compile_json`); `Grammar.matcher()` gives the sequence's
`Constraint`, which the generator drives: `apply(logits)` masks the logits of the next token,
`accept(token)` advances the matcher and starts computing the next mask on a worker thread, so it
is ready when the model's step returns; `done` says the grammar is complete.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch

from hotcold.errors import HotcoldError

# compact JSON, like json.dumps(..., separators=(", ", ": ")) without newlines: a model cannot
# spend its tokens on whitespace, and the reply is what a client prints
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotcold-grammar")
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class GrammarError(HotcoldError):
    """A schema or grammar the engine cannot compile; the message says which part and why."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of hotcold; missing only in a broken install
        raise HotcoldError(f"structured outputs need the llguidance package ({e}); pip install 'llguidance>=1.0'") \
            from None
    return llguidance


def ll_tokenizer(tokenizer, n_vocab: int):
    """llguidance's view of a hotcold Tokenizer (built from its `tokenizers` pipeline, once per tokenizer:
    about a second for a large vocabulary)."""
    llg = _llguidance()
    with _LOCK:
        cached = _TOKENIZERS.setdefault(tokenizer, {})
        if n_vocab not in cached:
            cached[n_vocab] = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab,
                                              eos_token=sorted(tokenizer.eos_ids))
        return cached[n_vocab]


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with every object that lists its `properties` and says nothing of others closed to
    them (`additionalProperties: false`), as OpenAI's strict mode and xgrammar do: a model is not
    invited to invent keys (a small one echoes the schema's own words as keys until max_tokens).
    Objects combined with allOf/anyOf/oneOf/$ref, and allOf's branches, stay open: closing one part
    would exclude the keys another part adds."""
    if isinstance(schema, list):
        return [closed(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMAS:
            out[key] = closed(value, key == "allOf")
        else:
            out[key] = value
    combined = any(k in out for k in ("allOf", "anyOf", "oneOf", "$ref", "additionalProperties",
                                       "patternProperties", "unevaluatedProperties"))
    if isinstance(out.get("properties"), dict) and not in_all_of and not combined:
        out["additionalProperties"] = False
    return out


def json_grammar(schema: Optional[dict] = None, where: str = "schema") -> str:
    """The llguidance grammar of JSON following `schema` (None: any JSON object), its objects closed."""
    llg = _llguidance()
    if schema is None:
        schema = ANY_JSON_OBJECT
    if not isinstance(schema, dict):
        raise GrammarError(f"{where}: a JSON schema must be an object, not {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema)), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{where}: {_one_line(str(e))}") from None


def lark_grammar(lark: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def check_grammar(grammar: str, tokenizer=None, n_vocab: Optional[int] = None, where: str = "schema") -> None:
    """Raise GrammarError naming what llguidance cannot compile (an unsupported keyword, a bad pattern)."""
    llg = _llguidance()
    lltok = ll_tokenizer(tokenizer, n_vocab) if tokenizer is not None else None
    message = llg.LLMatcher.validate_grammar(grammar, lltok)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"{where} cannot be enforced: {_one_line(message)}; simplify or remove that part")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:400]


class Grammar:
    """A compiled grammar for one tokenizer; `matcher()` starts a sequence's Constraint."""

    def __init__(self, grammar: str, tokenizer, n_vocab: int, where: str = "schema"):
        check_grammar(grammar, tokenizer, n_vocab, where)
        self.grammar, self.tokenizer, self.n_vocab, self.where = grammar, tokenizer, n_vocab, where

    def matcher(self, overlap: Optional[bool] = None) -> "Constraint":
        llg = _llguidance()
        m = llg.LLMatcher(ll_tokenizer(self.tokenizer, self.n_vocab), self.grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"{self.where} cannot be enforced: {_one_line(m.get_error())}")
        return Constraint(m, self.n_vocab, overlap)


def compile_json(tokenizer, n_vocab: int, schema: Optional[dict] = None, where: str = "schema") -> Grammar:
    """JSON following `schema` (None: any JSON object), checked against the tokenizer; raises GrammarError
    naming the innermost part of the schema that fails (a JSON pointer)."""
    try:
        return Grammar(json_grammar(schema, where), tokenizer, n_vocab, where)
    except GrammarError as e:
        raise _located(e, schema, where) from None


def check_schema(schema: Any, where: str = "schema") -> None:
    """Raise GrammarError if the engine cannot enforce `schema` (no tokenizer needed: before a model loads)."""
    try:
        check_grammar(json_grammar(schema, where), where=where)
    except GrammarError as e:
        raise _located(e, schema, where) from None


def _located(e: GrammarError, schema: Any, where: str) -> GrammarError:
    part = _failing_part(schema) if isinstance(schema, dict) else ""
    return GrammarError(str(e).replace(where, f"{where} at {part}", 1)) if part else e


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "propertyNames")


def _failing_part(root: dict) -> str:
    """The JSON pointer of the innermost subschema that does not compile on its own ("" when none does)."""
    llg = _llguidance()
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}

    def fails(sub) -> bool:
        if not isinstance(sub, dict):
            return False
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({**defs, **sub}), defaults=JSON_OPTIONS)
        except (ValueError, TypeError):
            return True
        message = llg.LLMatcher.validate_grammar(grammar)
        return bool(message) and not message.startswith("WARNING")

    def children(node: dict):
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for name, sub in node[key].items():
                    yield f"/{key}/{name}", sub
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, sub in enumerate(node[key]):
                    yield f"/{key}/{i}", sub
        for key in _SUBSCHEMAS:
            yield f"/{key}", node.get(key)

    path, node = "", root
    for _ in range(32):  # deep enough for real schemas, bounded for recursive ones
        for step, sub in children(node):
            if fails(sub):
                path, node = path + step, sub
                break
        else:
            return path
    return path


class Constraint:
    """One sequence's grammar state, driven by the generator token by token.

    The mask for the next token depends only on the tokens accepted so far, so `accept` can hand its
    computation to a worker thread (llguidance releases the GIL) and `apply` waits for it: the mask
    is computed while the model's next step runs. `overlap` None decides per step: on when the step
    ran on a GPU or torch leaves a core free; off when torch's threads fill every core, where the
    worker would take a core from the step (measured on 2 cores: tools/bench_grammar.py).
    """

    def __init__(self, matcher, n_vocab: int, overlap: Optional[bool] = None):
        self._m = matcher
        self.n_vocab = n_vocab
        self.overlap = overlap if overlap is not None else torch.get_num_threads() < (os.cpu_count() or 1)
        self._auto = overlap is None
        self._words = (n_vocab + 31) // 32
        self._bits = np.empty(self._words, dtype=np.int32)
        self._pending: Optional[Future] = None
        self.tokens = 0
        self.done = False  # the grammar admits no more text (only end-of-sequence): generation ends here
        self.accepting = matcher.is_accepting()  # what was generated so far is a complete match
        if self.overlap:
            self._pending = _POOL.submit(self._compute)

    def _compute(self) -> tuple[bool, torch.Tensor]:
        """The next mask as the shorter list: (True, the allowed ids) or (False, the forbidden ids).
        A step usually allows a handful of tokens (JSON's structure) or nearly all (inside a string):
        either way the main thread touches few entries (a bool masked_fill over a 49k vocabulary
        costs about 0.1 ms on two cores, the index list's update about 0.01 ms)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(np.bool_)
        n_allowed = int(np.count_nonzero(allowed))
        keep = n_allowed <= self.n_vocab // 2
        return keep, torch.from_numpy(np.flatnonzero(allowed if keep else ~allowed))

    def _next_mask(self) -> tuple[bool, torch.Tensor]:
        if self._pending is not None:
            mask, self._pending = self._pending.result(), None
            return mask
        return self._compute()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [n_vocab] with the tokens the grammar forbids at -inf (a new tensor)."""
        keep, ids = self._next_mask()
        if self._auto and logits.is_cuda:
            self.overlap = True
        if self._m.is_error():
            raise HotcoldError(f"constrained decoding failed: {_one_line(self._m.get_error())}")
        if not logits.is_cuda:  # numpy: no OpenMP region to wake torch's threads for (they may be asleep)
            src = logits.numpy()
            idx = ids.numpy()
            if keep:
                out = np.full_like(src, -np.inf)
                out[idx] = src[idx]
            else:
                out = src.copy()
                out[idx] = -np.inf
            return torch.from_numpy(out)
        ids = ids.to(logits.device, non_blocking=True)
        if keep:
            out = torch.full_like(logits, float("-inf"))
            out[ids] = logits[ids]
            return out
        return logits.clone().index_fill_(0, ids, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance the matcher by the sampled token and start on the next mask."""
        self.close()
        if not self._m.consume_token(token):
            raise HotcoldError(f"constrained decoding failed: token {token} was not allowed "
                               f"({_one_line(self._m.get_error())})")
        self.tokens += 1
        # read the state before the worker borrows the matcher: it may not be touched while a mask is computed
        self.done, self.accepting = self._m.is_stopped(), self._m.is_accepting()
        if self.overlap and not self.done:
            self._pending = _POOL.submit(self._compute)

    def close(self) -> None:
        """Wait for a mask still being computed (the matcher must not be freed under it)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
