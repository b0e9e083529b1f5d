"""The CLI end to end: bad input gives one line and exit code 2; run and perplexity print what they promise."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_cli
from tiny_models import make_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("tiny"))


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_path():
    assert_one_line_error(run_cli("run", "/no/such/model", "--prompt", "hi"), "/no/such/model", "no such file")


def test_truncated_safetensors(tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_one_line_error(run_cli("perplexity", bad), "model.safetensors", "truncated")


def test_truncated_gguf(smollm2_path, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        bad.write_bytes(src.read(2_000_000))
    assert_one_line_error(run_cli("run", bad, "--prompt", "hi"), "cut.gguf", "truncated")


def _with_config(src, dest, **changes):
    """A copy of the model folder src whose config.json has `changes` applied."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_unknown_architecture(tiny_llama, tmp_path):
    bad = _with_config(tiny_llama, tmp_path / "bert", model_type="bert")
    assert_one_line_error(run_cli("perplexity", bad), "config.json", "model_type='bert'")


def test_config_weights_mismatch(tiny_llama, tmp_path):
    bad = _with_config(tiny_llama, tmp_path / "mismatch", intermediate_size=128)
    assert_one_line_error(run_cli("perplexity", bad), "ffn", "does not match")


def test_missing_layer_in_weights(tiny_llama, tmp_path):
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    bad = _with_config(tiny_llama, tmp_path / "deeper", num_hidden_layers=layers + 1)
    assert_one_line_error(run_cli("perplexity", bad), "layers.3", "missing")


@pytest.mark.slow
def test_prompt_longer_than_context(smollm2_path):
    proc = run_cli("run", smollm2_path, "--prompt", "word " * 100, "--ctx", "32")
    assert_one_line_error(proc, "prompt has", "context holds 32")


def test_bad_device_and_dtype(tiny_llama):
    assert_one_line_error(run_cli("perplexity", tiny_llama, "--dtype", "int3"), "--dtype")
    assert_one_line_error(run_cli("perplexity", tiny_llama, "--device", "tpu"), "--device")


@pytest.mark.slow
def test_run_json_greedy_is_reproducible(smollm2_path):
    args = ("run", smollm2_path, "--prompt", "The capital of France is", "--temperature", "0", "-n", "12", "--json")
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_tokens", "completion_tokens", "ttft_s", "decode_tok_per_s"}
    assert out["completion_tokens"] == len(out["token_ids"]) <= 12
    assert out["prompt_tokens"] > 3 and out["decode_tok_per_s"] > 0
    assert "Paris" in out["text"]
    assert json.loads(run_cli(*args).stdout)["token_ids"] == out["token_ids"]


@pytest.mark.slow
def test_run_seeded_sampling_and_stop(smollm2_path):
    args = ("run", smollm2_path, "--prompt", "List three fruits:", "-n", "20", "--seed", "7", "--json")
    a, b = json.loads(run_cli(*args).stdout), json.loads(run_cli(*args).stdout)
    assert a["token_ids"] == b["token_ids"]
    stopped = json.loads(run_cli(*args, "--stop", a["text"][3:6]).stdout)
    assert stopped["finish_reason"] == "stop" and a["text"][3:6] not in stopped["text"]


@pytest.mark.slow
def test_perplexity_json(smollm2_path):
    proc = run_cli("perplexity", smollm2_path, "--ctx", "128", "--chunks", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ctx"] == 128 and out["tokens_scored"] == 4 * 63
    assert 1.5 < out["ppl"] < 60  # a real model on English prose, far below the vocabulary size


def test_load_refuses_weights_larger_than_free_ram(tiny_llama, monkeypatch):
    """A load whose weights exceed the RAM (and swap) free now stops before reading them, in one line
    that names the need, what is free and the way out, instead of being killed part-way."""
    import psutil

    from hotcold.errors import HotcoldError
    from hotcold.models.loader import load_model

    mem = lambda avail: type("M", (), {"available": avail, "free": 0})()  # noqa: E731
    monkeypatch.setattr(psutil, "swap_memory", lambda: mem(0))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(100_000))
    with pytest.raises(HotcoldError) as e:
        load_model(tiny_llama, device="cpu", dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and "of RAM in float32" in msg and "float16" in msg and "GiB is available" in msg
    with pytest.raises(HotcoldError, match="of RAM in bfloat16"):
        load_model(tiny_llama, device="cpu", dtype="bfloat16")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: mem(1 << 40))
    assert load_model(tiny_llama, device="cpu", dtype="float32").model is not None
