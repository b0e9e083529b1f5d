"""tools/agreement.py: hotcold's next-token distributions against llama.cpp's on the same GGUF file.

The comparison itself is checked on arrays whose answer is known; the whole tool on SmolLM2-135M
Q4_1 (a trained model: both engines must agree closely, in prefill and in one-token steps) and on
a small generated MoE file in float32, where there is no rounding to amplify and the two engines
must compute the same function."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hotcold_agreement", REPO / "tools" / "agreement.py")
agreement = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agreement)

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None


def test_compare_counts_agreement_and_divergence():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(20, 50)).astype(np.float32)
    same = agreement.compare(ref, ref.copy())
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] < 1e-12 and same["max_rel_logit_diff"] == 0.0
    swapped = ref.copy()
    top = ref.argmax(axis=1)
    swapped[np.arange(10), top[:10]] = ref.min()  # the first 10 positions lose their top token
    c = agreement.compare(ref, swapped)
    assert c["top1_agreement"] == 0.5 and c["kl_max"] > 0.01
    padded = np.concatenate([ref, np.full((20, 6), 50.0, np.float32)], axis=1)  # the reference pads its vocabulary
    assert agreement.compare(padded, ref)["top1_agreement"] == 1.0


def test_bad_input_is_one_line_exit_2(tmp_path):
    for args in ([str(tmp_path / "missing.gguf")], [str(REPO / "README.md")]):
        r = subprocess.run([sys.executable, str(REPO / "tools" / "agreement.py"), *args], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr


def _run(model: Path, tmp_path, *args) -> dict:
    out = tmp_path / "agreement.json"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "agreement.py"), str(model), "--threads", "2",
                        "--json", str(out), *args], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA, reason="needs llama-cpp-python")
def test_smollm2_agrees_with_llama_cpp(smollm2_path, tmp_path):
    # 32 one-token steps: a 135M model's top two logits are often near-tied, so over 8 steps one
    # flip of rounding (12.5%) would decide the check; over 32 the bound measures agreement
    rep = _run(smollm2_path, tmp_path, "--tokens", "64", "--decode", "32", "--no-plan")
    for path in ("prefill", "decode"):
        c = rep["runs"]["run"][path]
        assert c["top1_agreement"] >= 0.9 and c["kl_mean"] < 0.02, (path, c)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA, reason="needs llama-cpp-python")
def test_a_float32_moe_file_is_the_same_function_in_both_engines(tmp_path):
    model = tmp_path / "moe"
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_model.py"), "tiny-qwen3-moe", "--out", str(model),
                           "--format", "gguf", "--dtype", "f32", "--quiet"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    rep = _run(model / "model.gguf", tmp_path, "--tokens", "48", "--decode", "8", "--no-plan")
    for path in ("prefill", "decode"):
        c = rep["runs"]["run"][path]
        assert c["top1_agreement"] == 1.0 and c["kl_max"] < 1e-4, (path, c)
