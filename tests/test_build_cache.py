"""models/build_cache.py: verified cache files (truncated, edited, extended or foreign ones are
refused and rebuilt with one line), and the SentencePiece merges a tokenizer reads from it."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hotcold.models import build_cache
from hotcold.models import tokenizer as tokenizer_module
from hotcold.models.build_cache import CacheInvalid, cached, read_cache, write_cache
from hotcold.models.tokenizer import Tokenizer


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path))
    return tmp_path


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"pairs": rng.integers(0, 1000, (37, 2), dtype=np.int32),
            "blocks": rng.integers(0, 256, (5, 18), dtype=np.uint8)}


def test_round_trip_gives_read_only_views_of_the_file(tmp_path):
    path = tmp_path / "c.safetensors"
    write_cache(path, "k1", sample())
    got = read_cache(path, "k1")
    assert set(got) == {"pairs", "blocks"}
    for name, want in sample().items():
        np.testing.assert_array_equal(got[name], want)
        assert got[name].dtype == want.dtype and not got[name].flags.writeable
    assert read_cache(tmp_path / "absent.safetensors", "k1") is None
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left behind


def test_a_file_made_from_other_inputs_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    write_cache(path, "k1", sample())
    with pytest.raises(CacheInvalid, match="key differs"):
        read_cache(path, "k2")


@pytest.mark.parametrize("cut", [0, 5, 20, -1, -100])
def test_a_truncated_file_is_refused(tmp_path, cut):
    path = tmp_path / "c.safetensors"
    write_cache(path, "k1", sample())
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])
    with pytest.raises(CacheInvalid, match="truncated|unreadable"):
        read_cache(path, "k1")


def test_an_extended_file_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    write_cache(path, "k1", sample())
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(CacheInvalid, match="longer"):
        read_cache(path, "k1")


@pytest.mark.parametrize("where", ["first data byte", "last byte", "header"])
def test_an_edited_byte_is_refused(tmp_path, where):
    path = tmp_path / "c.safetensors"
    write_cache(path, "k1", sample())
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    i = {"first data byte": 8 + header_len, "last byte": len(data) - 1,
         "header": data.index(b'"k1"') + 2}[where]
    data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheInvalid, match="corrupt|key differs|unreadable"):
        read_cache(path, "k1")


def test_cached_builds_once_then_reads(home):
    calls = []

    def build():
        calls.append(1)
        return sample()

    first = cached("test", "k1", build, "test")
    second = cached("test", "k1", build, "test")
    assert len(calls) == 1
    np.testing.assert_array_equal(first["pairs"], second["pairs"])
    assert (home / "cache" / "test" / "k1.safetensors").is_file()


def test_cached_rebuilds_a_corrupt_file_with_one_line(home, capsys):
    cached("test", "k1", sample, "test")
    path = home / "cache" / "test" / "k1.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    got = cached("test", "k1", sample, "test")
    np.testing.assert_array_equal(got["blocks"], sample()["blocks"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: the test cache") and "corrupt" in err and "rebuilding" in err
    assert read_cache(path, "k1") is not None  # rewritten whole
    path.write_bytes(path.read_bytes()[:-10])
    cached("test", "k1", sample, "test")
    assert "truncated" in capsys.readouterr().err
    assert read_cache(path, "k1") is not None


def test_digest_separates_its_parts():
    assert build_cache.digest("ab", "c") != build_cache.digest("a", "bc")
    assert build_cache.digest(b"x") == build_cache.digest("x")


# -- the SentencePiece merges of a GGUF vocabulary ----------------------------------------------

def spm_meta(scores_shift: float = 0.0) -> dict:
    from test_tokenizer import tiny_sentencepiece_meta

    meta = tiny_sentencepiece_meta()
    meta["tokenizer.ggml.scores"] = [s + scores_shift for s in meta["tokenizer.ggml.scores"]]
    return meta


TEXTS = ["abc a\né", "bcab cab  a", "<start_of_turn>abc<end_of_turn>", ""]


def test_sentencepiece_merges_come_from_the_cache(home, monkeypatch, capsys):
    built = Tokenizer.from_gguf_metadata(spm_meta())
    files = list((home / "cache" / "tokenizer").iterdir())
    assert len(files) == 1

    @functools.wraps(tokenizer_module._merges_ranked_by_score)  # (its source is part of the key)
    def no_search(*args):
        raise AssertionError("the merges were searched again")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_module, "_merges_ranked_by_score", no_search)
        from_cache = Tokenizer.from_gguf_metadata(spm_meta())
    for text in TEXTS:
        assert from_cache.encode(text) == built.encode(text), text
    # another vocabulary (here: other scores) has another key: a new file, never the old one's merges
    Tokenizer.from_gguf_metadata(spm_meta(scores_shift=-1.0))
    assert len(list((home / "cache" / "tokenizer").iterdir())) == 2
    # a corrupt file: one line, then the same tokenizer as built from scratch
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    rebuilt = Tokenizer.from_gguf_metadata(spm_meta())
    assert "corrupt" in capsys.readouterr().err
    for text in TEXTS:
        assert rebuilt.encode(text) == built.encode(text), text


def test_sentencepiece_merges_cached_equal_searched(home):
    meta = spm_meta()
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    want = tokenizer_module._merges_ranked_by_score(tokens, scores, types, vocab)
    assert want  # the tiny vocabulary has merges to rank
    assert tokenizer_module._cached_merges(tokens, scores, types, vocab) == want  # built and written
    assert tokenizer_module._cached_merges(tokens, scores, types, vocab) == want  # read back
