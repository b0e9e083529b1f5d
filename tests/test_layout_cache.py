"""models/layout_cache.py: a GGUF model's CPU layout (interleaved matrices, fused q/k/v) mapped from
its cache gives the same bytes and the same logits as packing it at load; a stale, truncated or
edited cache is refused with one line and rebuilt. Real model: SmolLM2-135M Q4_1."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from hotcold.models.layout_cache import packed_for_decode
from hotcold.models.loader import load_model
from hotcold.models.quantized import pack_for_decode
from hotcold.sparse_ops.quant import QuantMatrix

PROMPT = list(range(20, 36))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def matrices(model) -> dict[str, np.ndarray]:
    """Every block matrix the model holds, by module and attribute."""
    out = {}
    for name, m in model.named_modules():
        for attr in ("qweight", "qkv"):
            w = getattr(m, attr, None)
            if isinstance(w, QuantMatrix):
                out[f"{name}.{attr}"] = w
    return out


def logits(lm) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's logits (the prefill path) and the next decode step's (the one-token kernels)."""
    from hotcold.models.transformer import KVCache

    with torch.no_grad():
        cache = KVCache(lm.config, len(PROMPT) + 1)
        full = lm.model(torch.tensor([PROMPT]), cache=cache)
        step = lm.model(torch.tensor([[PROMPT[-1]]]), start_pos=len(PROMPT), cache=cache)
    return full, step


@pytest.fixture(scope="module")
def reference(smollm2_path):
    lm = load_model(smollm2_path, "cpu")
    pack_for_decode(lm.model)
    return {k: bytes(w.data) for k, w in matrices(lm.model).items()}, logits(lm)


def check_same(lm, reference, mapped: bool) -> None:
    want_bytes, want_logits = reference
    got = matrices(lm.model)
    assert set(got) == set(want_bytes)
    interleaved = 0
    for k, w in got.items():
        assert bytes(w.data) == want_bytes[k], k
        if w.interleaved:
            interleaved += 1
            assert (not w.data.flags.writeable) == mapped, k  # a view of the cache file's mapping, or a copy
    assert interleaved > 0
    for g, w in zip(logits(lm), want_logits):
        assert torch.equal(g, w)


def load_packed(path):
    lm = load_model(path, "cpu")
    packed_for_decode(lm)
    return lm


def test_mapped_layout_equals_packing(smollm2_path, home, reference, capsys):
    check_same(load_packed(smollm2_path), reference, mapped=False)  # packed, and written
    files = list((home / "cache" / "layout").iterdir())
    assert len(files) == 1
    check_same(load_packed(smollm2_path), reference, mapped=True)  # mapped from the cache
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", ["truncate", "edit a byte"])
def test_damaged_cache_is_rebuilt_with_one_line(smollm2_path, home, reference, capsys, damage):
    load_packed(smollm2_path)
    (path,) = (home / "cache" / "layout").iterdir()
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    check_same(load_packed(smollm2_path), reference, mapped=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rebuilding" in err and ("truncated" in err or "corrupt" in err), err
    check_same(load_packed(smollm2_path), reference, mapped=True)  # rewritten whole
    assert capsys.readouterr().err == ""


def test_a_changed_model_file_is_not_served_its_old_layout(smollm2_path, home, tmp_path, reference, capsys):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_path, copy)
    load_packed(copy)
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version of the file, as far as anyone knows
    check_same(load_packed(copy), reference, mapped=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another version of model.gguf" in err, err
    check_same(load_packed(copy), reference, mapped=True)
    # the copy goes: the next layout written (another model's) removes its file, and only its
    copy.unlink()
    load_packed(smollm2_path)
    assert len(list((home / "cache" / "layout").iterdir())) == 1
    check_same(load_packed(smollm2_path), reference, mapped=True)


def test_new_packing_code_rebuilds_quietly(smollm2_path, home, reference, capsys, monkeypatch):
    from hotcold.models import quantized

    load_packed(smollm2_path)
    with monkeypatch.context() as m:
        m.setattr(quantized, "HEAD_XQ", not quantized.HEAD_XQ)  # part of the key: another layout
        load_packed(smollm2_path)
    assert capsys.readouterr().err == ""
    check_same(load_packed(smollm2_path), reference, mapped=False)  # rebuilt again for this code, no line
    assert capsys.readouterr().err == ""
