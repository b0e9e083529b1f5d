"""executors/split_cache.py: a plan's CPU split of a quantised GGUF model (cold W_down transposed to
Q8_0, cold up/gate rows of a partial plan, CPU predictors in Q8_0 blocks) mapped from its cache gives
the same bytes, and the same prefill and decode logits bit for bit, as the split computed at load
(the reference: the engine built with the cache turned off); an all-cold plan's up/gate are the
file's own rows; a truncated, edited or stale cache (another plan, other predictors, another model
version) is refused with one line and rebuilt; new code rebuilds it quietly.
Model: tools/make_model.py's tiny-llama (ReLU, gated) as a Q4_0 GGUF, predictors made here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hotcold.executors import engine as engine_mod
from hotcold.executors import make_hybrid, random_hot
from hotcold.executors import split_cache
from hotcold.models.loader import load_model
from hotcold.models.transformer import KVCache
from hotcold.predictors.artifact import PredictorSet, load_predictors, save_predictors
from hotcold.predictors.neurons import NeuronPredictor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import make_model as mm  # noqa: E402

PROMPT = [5, 17, 99, 42, 7, 130, 64, 12]
DECODE = [3, 77, 150, 21]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split_cache") / "tiny"
    spec = mm.build_spec("tiny-llama")
    mm.generate(spec, out, dtype="q4_0", progress=False, force=True, preset="tiny-llama", calib_tokens=256,
                formats=("gguf",))
    return out / "model.gguf"


@pytest.fixture(scope="module")
def predictors_file(model) -> Path:
    lm = load_model(model, "cpu", "float32")
    cfg = lm.config
    torch.manual_seed(1)
    preds = PredictorSet(lm.fingerprint)
    for l in range(cfg.num_layers):
        p = NeuronPredictor(cfg.hidden_size, cfg.intermediate_size, 24)
        p.threshold.fill_(-0.05)
        preds.neurons[l] = p
    return save_predictors(model.parent / "predictors.safetensors", preds)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


PLANS = {"cpu": lambda lm: {}, "partial": lambda lm: random_hot(lm, 0.3, seed=2)}


def build(model: Path, predictors_file: Path, plan: str = "cpu", cached: bool = True, monkeypatch=None):
    """The model loaded and split by `plan` on the CPU tier, with its predictors (cached=False: with
    the split cache turned off, the reference)."""
    lm = load_model(model, "cpu", "float32")
    preds = load_predictors(predictors_file, lm.fingerprint)
    if not cached:
        monkeypatch.setattr(engine_mod, "open_split_memo", lambda *a: None)
    try:
        engine = make_hybrid(lm, PLANS[plan](lm), preds, device="cpu", threads=1, stats=False)
    finally:
        if not cached:
            monkeypatch.undo()
    return engine


def run(engine) -> list[torch.Tensor]:
    """The prompt's prefill logits, then each decode step's."""
    lm = engine.lm
    cache = KVCache(lm.config, len(PROMPT) + len(DECODE) + 1)
    out = []
    with torch.inference_mode():
        out.append(lm.model(torch.tensor([PROMPT]), 0, cache))
        for i, t in enumerate(DECODE):
            out.append(lm.model(torch.tensor([[t]]), len(PROMPT) + i, cache))
    return out


def parts(engine) -> dict[str, np.ndarray]:
    """Every host matrix the split built: cold up/gate/down_t and the CPU predictors' blocks."""
    out = {}
    for l, h in engine.layers.items():
        for k in ("up", "gate", "down_t"):
            out[f"{l}.{k}"] = getattr(h.cold, k).data
        mask = h.gpu.mask_fn
        for k in ("l1", "l2"):
            out[f"{l}.{k}"] = getattr(mask, k).host.data
    return out


def mapped(a: np.ndarray) -> bool:
    import mmap

    while isinstance(a, np.ndarray):  # a view of a view ... of a mapping (or of a memoryview of one)
        a = a.base
    return isinstance(a, mmap.mmap) or isinstance(a, memoryview) and isinstance(a.obj, mmap.mmap)


@pytest.fixture(scope="module")
def references(model, predictors_file):
    mp = pytest.MonkeyPatch()
    refs = {}
    for plan in PLANS:
        e = build(model, predictors_file, plan, cached=False, monkeypatch=mp)
        refs[plan] = ({k: bytes(v) for k, v in parts(e).items()}, run(e))
        e.close()
    return refs


def check_same(engine, reference, from_cache: bool) -> None:
    want_parts, want_logits = reference
    got = parts(engine)
    assert set(got) == set(want_parts)
    for k, a in got.items():
        assert bytes(a) == want_parts[k], k
        if not k.endswith(("up", "gate")):  # built: a view of the cache file's mapping, or a fresh array
            assert mapped(a) == from_cache, k
        assert not a.flags.writeable, k
    for g, w in zip(run(engine), want_logits):
        assert torch.equal(g, w)
    engine.close()


@pytest.mark.parametrize("plan", list(PLANS))
def test_mapped_split_equals_the_computed_one(model, predictors_file, home, references, capsys, plan):
    check_same(build(model, predictors_file, plan), references[plan], from_cache=False)  # built, and written
    files = list((home / "cache" / "split").iterdir())
    assert len(files) == 1
    e = build(model, predictors_file, plan)
    if plan == "cpu":  # every neuron cold: up/gate are the file's own matrices, neither copied nor cached
        for h in e.layers.values():
            assert mapped(h.cold.up.data) and mapped(h.cold.gate.data)
            assert h.cold.up.rows == h.cold.n
    check_same(e, references[plan], from_cache=True)  # mapped from the cache
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", ["truncate", "edit a byte"])
def test_damaged_cache_is_rebuilt_with_one_line(model, predictors_file, home, references, capsys, damage):
    build(model, predictors_file).close()
    (path,) = (home / "cache" / "split").iterdir()
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(path) - 100)
        else:
            f.seek(os.path.getsize(path) - 1000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    check_same(build(model, predictors_file), references["cpu"], from_cache=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "split cache" in err and "rebuilding" in err, err
    assert ("truncated" in err) if damage == "truncate" else ("corrupt" in err), err
    check_same(build(model, predictors_file), references["cpu"], from_cache=True)  # rewritten whole
    assert capsys.readouterr().err == ""


def test_another_plan_or_predictors_rebuild_with_one_line(model, predictors_file, home, references, capsys):
    build(model, predictors_file, "cpu").close()
    check_same(build(model, predictors_file, "partial"), references["partial"], from_cache=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another plan of model.gguf" in err, err
    check_same(build(model, predictors_file, "partial"), references["partial"], from_cache=True)
    st = os.stat(predictors_file)
    os.utime(predictors_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the predictors re-made
    check_same(build(model, predictors_file, "partial"), references["partial"], from_cache=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other predictors of model.gguf" in err, err
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version of the model file
    try:
        check_same(build(model, predictors_file, "partial"), references["partial"], from_cache=False)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "another version of model.gguf" in err, err
    finally:
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(list((home / "cache" / "split").iterdir())) == 1  # one file per model file


def test_new_code_rebuilds_quietly(model, predictors_file, home, references, capsys, monkeypatch):
    build(model, predictors_file).close()
    code = split_cache._code
    monkeypatch.setattr(split_cache, "_code", lambda: [b"another version", *code()])
    check_same(build(model, predictors_file), references["cpu"], from_cache=False)
    assert capsys.readouterr().err == ""
    check_same(build(model, predictors_file), references["cpu"], from_cache=True)


def test_predictors_built_in_memory_are_not_cached(model, home, references, capsys):
    """A PredictorSet made in memory has no file to key by: its blocks are built every load, the
    FFN's cold parts still come from the cache."""
    for n in range(2):
        lm = load_model(model, "cpu", "float32")
        torch.manual_seed(3)
        preds = PredictorSet(lm.fingerprint, {l: NeuronPredictor(lm.config.hidden_size, lm.config.intermediate_size, 24)
                                              for l in range(lm.config.num_layers)})
        e = make_hybrid(lm, {}, preds, device="cpu", threads=1, stats=False)
        for h in e.layers.values():
            assert mapped(h.cold.down_t.data) == (n == 1)
            assert not mapped(h.gpu.mask_fn.l2.host.data)
        e.close()
    assert capsys.readouterr().err == ""
