"""hotcold.server.engine.ServingEngine keeps what `serve` loads for as long as it serves.

`hotcold serve` loads through `open_for_run`, whose RunSetup holds the hybrid engine: the CPU worker
and the page-locked host weights, released when that engine is collected. The server's ServingEngine must
hold the whole setup while it serves and close it when it stops."""

from __future__ import annotations

import gc
import time
import weakref

from hotcold.executors.from_plan import RunSetup
from hotcold.models.loader import load_model
from hotcold.server.engine import ServingEngine
from tiny_models import add_tiny_tokenizer, make_tiny


class _Hybrid:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def _started(engine: ServingEngine) -> ServingEngine:
    engine.start()
    deadline = time.monotonic() + 60
    while not engine.ready:
        assert engine.state != "failed", engine.load_error
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return engine


def test_engine_holds_the_run_setup_while_serving_and_closes_it(tmp_path):
    lm = load_model(add_tiny_tokenizer(make_tiny("llama", tmp_path)), "cpu", "float32")
    hybrid = _Hybrid()
    alive = weakref.ref(hybrid)
    engine = _started(ServingEngine(lambda: RunSetup(lm, engine=hybrid)))
    del hybrid
    gc.collect()
    assert alive() is not None and alive().closed == 0  # kept, not collected, while serving
    assert engine.lm is lm
    engine.close()
    engine._thread.join(30)
    assert not engine._thread.is_alive() and alive().closed == 1


def test_engine_takes_a_bare_model_too(tmp_path):
    lm = load_model(add_tiny_tokenizer(make_tiny("llama", tmp_path)), "cpu", "float32")
    engine = _started(ServingEngine(lambda: lm))
    assert engine.lm is lm and engine._setup is None
    engine.close()
    engine._thread.join(30)


def test_serve_opens_the_whole_setup(tmp_path):
    from hotcold.server.command import _open

    setup = _open(add_tiny_tokenizer(make_tiny("llama", tmp_path)), None, True, "cpu", "float32")
    assert isinstance(setup, RunSetup) and setup.lm.tokenizer is not None


def test_serve_no_sparse_turns_the_profiles_input_sparsity_off(tmp_path):
    """A model whose profile chose input sparsity: served with it by default, exactly with --no-sparse."""
    from hotcold.server.command import _open
    from conftest import run_cli

    model = add_tiny_tokenizer(make_tiny("llama", tmp_path))
    r = run_cli("profile", str(model), "--tokens", "256", "--seq-len", "64", "--heldout-tokens", "256",
                "--no-predictors", "--ppl-budget", "1.0")
    assert r.returncode == 0, r.stderr
    on = _open(model, None, True, "cpu", "float32")
    off = _open(model, None, True, "cpu", "float32", input_sparse=False)
    assert any("input sparsity: the profile chose" in n for n in on.notes)
    assert any("input sparsity off (--no-sparse)" in n for n in off.notes) and off.input_sparsity is None
