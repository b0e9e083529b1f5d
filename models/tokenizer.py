"""Text <-> token ids: tokenizers built from GGUF metadata or a Hugging Face folder,
chat-template rendering and streaming (incremental) detokenization.

The heavy lifting is done by the `tokenizers` library; this module only turns
llama.cpp's GGUF vocabulary description into an equivalent `tokenizers` pipeline:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with the file's merges and the
  pre-tokenizer regexes llama.cpp uses for ``tokenizer.ggml.pre``.
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE. llama.cpp merges the adjacent
  pair whose concatenation has the best score; a BPE whose merges are every
  (left, right) split of each vocabulary token, ranked by that token's score, does the
  same. Characters missing from the vocabulary fall back to ``<0xNN>`` byte tokens.

Control (type 3) and user-defined (type 4) tokens are matched whole in the text before
the model runs, as llama.cpp does.
"""

from __future__ import annotations

import functools
import json
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from hotcold.errors import HotcoldError, ModelFileError, UnsupportedModelError

TEMPLATES_DIR = Path(__file__).parent / "templates"

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Texts of tokens that end a generation (llama.cpp's end-of-generation list).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

SPM_SPACE = "\u2581"  # '▁', SentencePiece's visible space

# ---------------------------------------------------------------------------
# Pre-tokenizer regexes of llama.cpp (llm_tokenizer_bpe), by tokenizer.ggml.pre.
# Each list is applied in order; every regex splits the pieces of the previous one,
# keeping both the matches and the text between them.
# ---------------------------------------------------------------------------
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SPLITS = [r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"]
STARCODER_SPLITS = [r"\p{N}", GPT2_SPLIT]

PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "default": DEFAULT_SPLITS,
    "gpt-2": [GPT2_SPLIT], "mpt": [GPT2_SPLIT], "olmo": [GPT2_SPLIT], "jais": [GPT2_SPLIT],
    "smollm": STARCODER_SPLITS, "starcoder": STARCODER_SPLITS, "refact": STARCODER_SPLITS,
    "command-r": STARCODER_SPLITS, "codeshell": STARCODER_SPLITS, "exaone": STARCODER_SPLITS,
    "llama-bpe": [LLAMA3_SPLIT], "llama3": [LLAMA3_SPLIT], "llama-v3": [LLAMA3_SPLIT],
    "falcon3": [LLAMA3_SPLIT], "dbrx": [LLAMA3_SPLIT], "smaug-bpe": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT], "stablelm2": [QWEN2_SPLIT], "deepseek-r1-qwen": [QWEN2_SPLIT],
}
# Vocabularies where a pre-token that is itself a token skips the merges (llama.cpp: ignore_merges).
IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3"})


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template, streaming detokenizer."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str,
        template_source: str,
        eos_id: int | None = None,
        verbatim_tokens: dict[int, str] | None = None,
    ):
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids)
        self.eos_id = eos_id if eos_id is not None else min(self.eos_ids, default=None)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.template_source = template_source
        # Added tokens whose text the backend's decoder would mangle (non-ASCII specials of a
        # byte-level vocabulary): decode() inserts their text as is.
        self._verbatim_tokens = verbatim_tokens or {}
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata (every key -> plain Python value, arrays as lists)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.tokens; the file carries no vocabulary")
        token_types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if kind == "gpt2":
            backend, verbatim = _byte_level_backend(meta, tokens, token_types)
        elif kind == "llama":
            backend, verbatim = _sentencepiece_backend(meta, tokens, token_types), {}
        else:
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        template, source = _gguf_chat_template(meta)
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_id=bos_id,
            eos_ids=_gguf_end_of_generation_ids(meta, tokens, token_types),
            eos_id=eos_id,
            add_bos=_gguf_adds_bos(meta, kind) and bos_id is not None,
            chat_template=template,
            template_source=source,
            verbatim_tokens=verbatim,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "Tokenizer":
        """Build from a Hugging Face folder (tokenizer.json, tokenizer_config.json, ...)."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(f"{tokenizer_file} not found: hotcold needs the fast-tokenizer file tokenizer.json")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def special_id(name: str) -> int | None:
            text = _token_content(config.get(name) or special_map.get(name))
            return backend.token_to_id(text) if text else None

        bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
        eos_ids = {i for i in _as_list(generation.get("eos_token_id")) if isinstance(i, int)}
        eos_ids |= {eos_id} if eos_id is not None else set()
        eos_ids |= {i for i, t in backend.get_added_tokens_decoder().items()
                    if t.special and t.content in END_OF_GENERATION_TEXTS}
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        template, source = _hf_chat_template(folder, config)
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_id=bos_id,
            eos_ids=eos_ids,
            eos_id=eos_id,
            add_bos=bool(add_bos) and bos_id is not None,
            chat_template=template,
            template_source=source,
        )

    # -- encode / decode ---------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. With
        add_special_tokens, prepends BOS when the model wants one (not twice)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD)."""
        ids = list(ids)
        if not any(i in self._verbatim_tokens for i in ids):
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for token_id in ids:
            if token_id not in self._verbatim_tokens:
                run.append(token_id)
                continue
            pieces.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
            if not (skip_special_tokens and token_id in self._special_ids):
                pieces.append(self._verbatim_tokens[token_id])
        pieces.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(pieces)

    def token_to_id(self, text: str) -> int | None:
        """Id of the token spelled `text` in the vocabulary, or None."""
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of `token_id` (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str:
        return self._token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_id)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._verbatim_tokens.get(token_id) or self.backend.id_to_token(token_id) or ""

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer for one generated sequence."""
        return IncrementalDetokenizer(lambda ids: self.decode(ids, skip_special_tokens))

    # -- chat --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to the prompt text the model
        was trained on. Extra keyword arguments (tools=..., ...) reach the template."""
        context = {"tools": None, "documents": None, **template_vars}
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **context,
        )


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time, never emitting half a character.

    It keeps a window of ids: a context part whose text was already emitted, then the
    pending ids. The new text is decode(window) minus decode(context); while it ends in
    U+FFFD (an incomplete UTF-8 sequence) it waits for more ids. After each emission the
    window restarts at the ids just emitted, so decoding stays short and starts on a
    character boundary.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._window: list[int] = []
        self._context_len = 0     # ids at the window's start whose text was emitted
        self._context_text = ""   # decode(self._window[:self._context_len])

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ('' while a character is incomplete)."""
        self._window.append(token_id)
        new_text = self._pending_text()
        if new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes become U+FFFD)."""
        return self._emit(self._pending_text())

    def _pending_text(self) -> str:
        return self._decode(self._window)[len(self._context_text):]

    def _emit(self, text: str) -> str:
        if self._context_len < len(self._window):
            self._window = self._window[self._context_len:]
            self._context_len = len(self._window)
            self._context_text = self._decode(self._window)
        return text


# ---------------------------------------------------------------------------
# GGUF: byte-level BPE ("gpt2")
# ---------------------------------------------------------------------------

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (bytes that print as
    themselves keep their character, the rest get U+0100 onwards)."""
    keeps_own_char = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keeps_own_char}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
BYTE_ALPHABET = frozenset(BYTE_TO_UNICODE.values())


def _byte_level_spelling(text: str) -> str:
    """A token as a byte-level vocabulary spells it (already-spelled tokens unchanged)."""
    if set(text) <= BYTE_ALPHABET:
        return text
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode("utf-8"))


def _byte_level_backend(meta: dict, tokens: list[str], token_types: list[int]
                        ) -> tuple[BackendTokenizer, dict[int, str]]:
    """Byte-level BPE with llama.cpp's pre-tokenizer regexes for tokenizer.ggml.pre."""
    vocab: dict[str, int] = {}
    for token_id, (text, token_type) in enumerate(zip(tokens, token_types)):
        # Control/user-defined tokens are matched in the raw text, so they keep their raw spelling.
        key = text if token_type in (CONTROL, USER_DEFINED) else _byte_level_spelling(text)
        vocab.setdefault(key, token_id)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre") or "default"
    model = models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES_PRE)
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = _bpe_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, token_types)
    # The ByteLevel decoder maps characters back to bytes, so only printable ASCII
    # survives it unchanged; other added tokens are decoded verbatim.
    verbatim = {i: tokens[i] for i in _added_token_ids(token_types)
                if not all("!" <= ch <= "~" for ch in tokens[i])}
    return backend, verbatim


def _bpe_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        warnings.warn(f"unknown tokenizer.ggml.pre {pre!r}: splitting text like GPT-2; "
                      "tokenization may differ from the model's", stacklevel=4)
        splits = [GPT2_SPLIT]
    steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# ---------------------------------------------------------------------------
# GGUF: SentencePiece ("llama")
# ---------------------------------------------------------------------------

def _sentencepiece_backend(meta: dict, tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """SentencePiece BPE: score-ranked merges, byte fallback, '▁' for spaces."""
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for token_id, text in enumerate(tokens):
        vocab.setdefault(text, token_id)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab,
        _cached_merges(tokens, scores, token_types, vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(model)
    spaces_to_spm = normalizers.Replace(" ", SPM_SPACE)
    decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp puts a space before every stretch of text that starts the input or follows a
        # special token; tokenizers normalizes exactly those stretches. Decoding drops the first one.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), spaces_to_spm])
        decode_steps.append(decoders.Strip(" ", 1, 0))
    else:  # Gemma
        backend.normalizer = spaces_to_spm
    backend.decoder = decoders.Sequence(decode_steps)
    _add_special_tokens(backend, tokens, token_types)
    return backend


def _cached_merges(tokens: list[str], scores: list[float], token_types: list[int],
                   vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`_merges_ranked_by_score`, kept as token-id pairs in a verified cache (models/build_cache.py)
    keyed by the vocabulary, its scores and types and that function's source: finding them takes
    ~1.5 s of a 262k-token vocabulary's load (Gemma 3), reading them back ~0.01 s."""
    import inspect
    from array import array

    from hotcold.models.build_cache import cached, digest

    key = digest("spm-merges", inspect.getsource(_merges_ranked_by_score), str(len(tokens)), "\0".join(tokens),
                 array("d", scores).tobytes(), array("q", token_types).tobytes())

    def build() -> dict[str, np.ndarray]:
        merges = _merges_ranked_by_score(tokens, scores, token_types, vocab)
        pairs = [(vocab[left], vocab[right]) for left, right in merges]
        return {"merges": np.array(pairs, dtype=np.int32).reshape(-1, 2)}  # [N, 2] left, right token ids

    ids = cached("tokenizer", key, build, "tokenizer")["merges"]
    if len(ids) and (ids.min() < 0 or ids.max() >= len(tokens)):
        raise ModelFileError("the cached SentencePiece merges name tokens outside the vocabulary")
    # the pairs as references to the vocabulary's own strings: no string is copied
    by_id = np.empty(len(tokens), dtype=object)
    by_id[:] = tokens
    return list(zip(by_id[ids[:, 0]].tolist(), by_id[ids[:, 1]].tolist()))


def _merges_ranked_by_score(tokens: list[str], scores: list[float], token_types: list[int],
                            vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of each normal token into two vocabulary tokens, best
    token score first. BPE with these merges repeats llama.cpp's SPM loop: merge the
    adjacent pair whose concatenation scores best."""
    candidates = []
    for token_id, text in enumerate(tokens):
        if token_types[token_id] != NORMAL or len(text) < 2 or vocab.get(text) != token_id:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[token_id], left, right))
    candidates.sort(key=lambda c: c[0])  # stable: ties keep vocabulary order
    return [(left, right) for _, left, right in candidates]


# ---------------------------------------------------------------------------
# GGUF: shared helpers
# ---------------------------------------------------------------------------

def _added_token_ids(token_types: list[int]) -> list[int]:
    return [i for i, t in enumerate(token_types) if t in (CONTROL, USER_DEFINED)]


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Match control tokens (special) and user-defined tokens (not special) whole in the text."""
    control = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(token_types) if t == CONTROL and tokens[i]]
    user_defined = [AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(token_types) if t == USER_DEFINED and tokens[i]]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)


def _gguf_end_of_generation_ids(meta: dict, tokens: list[str], token_types: list[int]) -> set[int]:
    """EOS plus end-of-turn tokens: the declared ids and control tokens llama.cpp knows end a turn."""
    declared = (meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))
    ids = {i for i in declared if i is not None}
    ids |= {i for i, (text, t) in enumerate(zip(tokens, token_types))
            if t == CONTROL and text in END_OF_GENERATION_TEXTS}
    return ids


def _gguf_adds_bos(meta: dict, kind: str) -> bool:
    flag = meta.get("tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    return kind == "llama" or meta.get("tokenizer.ggml.pre") in IGNORE_MERGES_PRE  # llama.cpp's defaults


def _gguf_chat_template(meta: dict) -> tuple[str, str]:
    template = meta.get("tokenizer.chat_template")
    if template:
        return template, "model"
    return _builtin_template(meta.get("general.architecture") or "")


# ---------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path} is not valid JSON ({e})") from e


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _post_processor_adds_bos(backend: BackendTokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front (newer HF folders say it only there)."""
    if bos_id is None:
        return False
    with_specials = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return with_specials[:1] == [bos_id] and without[:1] != [bos_id]


def _hf_chat_template(folder: Path, config: dict) -> tuple[str, str]:
    """chat_template.jinja, then chat_template.json, then tokenizer_config.json; else built-in."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), "model"
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template, "model"
    model_type = _read_json(folder / "config.json").get("model_type") or config.get("tokenizer_class") or ""
    return _builtin_template(model_type)


# ---------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------

def _builtin_template(family: str) -> tuple[str, str]:
    """The fallback template for a model family: gemma's for gemma*, ChatML otherwise."""
    name = "gemma" if family.lower().startswith("gemma") else "chatml"
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8"), f"built-in:{name}"


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (marks assistant text); renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_template_error(message: str):
    raise HotcoldError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without jinja's HTML escaping (what HF templates expect)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers' apply_chat_template."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
