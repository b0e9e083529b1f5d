"""tools/defer_quality.py: the perplexity cost of expert deferral, measured on a dense model.

Its whole-sequence deferred forward must be the model itself where nothing is deferred, and must
equal a token-by-token deferred decode through the KV cache (what the engine's deferral computes),
which is the claim its measurement rests on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotcold.models.layers import project
from hotcold.models.loader import load_model
from hotcold.models.transformer import KVCache
from tiny_models import make_tiny

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hotcold_defer_quality", REPO / "tools" / "defer_quality.py")
dq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dq)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny("llama", tmp_path_factory.mktemp("defer_quality")), "cpu", "float32")


def tokens(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 160, (1, n), generator=torch.Generator().manual_seed(seed))


def stepped(model, toks: torch.Tensor, late: dict[int, torch.Tensor]) -> torch.Tensor:
    """Token by token through a KV cache: block l's late neurons' share joins after block l + 1."""
    cache = KVCache(model.config, toks.shape[1] + 1)
    out, last = [], len(model.layers) - 1
    with torch.inference_mode():
        for t in range(toks.shape[1]):
            pos = torch.tensor([t])
            x, carry = model.embed_tokens(toks[:, t:t + 1], pos), None
            for l, b in enumerate(model.layers):
                res = x + b.attn(b.attn_norm(x), pos, cache.layers[l], t)
                f = b.ffn_norm(res)
                a = b.ffn.activations(f)
                m = late.get(l) if l < last else None
                if m is None:
                    now, nxt = project(b.ffn.down, a), None
                else:
                    now, nxt = project(b.ffn.down, a * ~m), project(b.ffn.down, a * m)
                x = res + now + (0 if carry is None else carry)
                carry = nxt
            out.append(model.head(x))
    return torch.cat(out, dim=1)


def test_nothing_deferred_is_the_model(tiny):
    toks = tokens()
    with torch.inference_mode():
        want = tiny.model(toks)
    assert torch.allclose(dq.deferred_logits(tiny.model, toks, {}), want, atol=1e-5)
    assert torch.allclose(dq.deferred_logits(tiny.model, toks, dq.late_masks(tiny.model, 0.0, "random", None)),
                          want, atol=1e-5)
    assert torch.allclose(dq.deferred_logits(tiny.model, toks, dq.late_masks(tiny.model, 0.0, "token", None)),
                          want, atol=1e-5)


def test_the_whole_sequence_equals_a_deferred_decode(tiny):
    """Keys and values of each position come from the residual without the previous block's late share,
    in the one forward as in the decode: the two give the same logits, and they are not the model's."""
    toks = tokens(seed=1)
    late = dq.late_masks(tiny.model, 0.5, "random", None, seed=3)
    got = dq.deferred_logits(tiny.model, toks, late)
    assert torch.allclose(got, stepped(tiny.model, toks, late), atol=1e-4)
    with torch.inference_mode():
        exact = tiny.model(toks)
    assert (got - exact).abs().max() > 1e-2
    # every neuron deferred per token is every neuron deferred
    every = {l: torch.ones_like(m) for l, m in late.items()}
    assert torch.allclose(dq.deferred_logits(tiny.model, toks, dq.late_masks(tiny.model, 1.0, "token", None)),
                          dq.deferred_logits(tiny.model, toks, every), atol=1e-5)


def test_cold_order_defers_the_least_active(tiny):
    windows = tokens(16, seed=2).reshape(2, 8)
    activity = dq.mean_activation(tiny.model, windows)
    assert not any("activations" in b.ffn.__dict__ for b in tiny.model.layers)  # the recording is removed
    masks = dq.late_masks(tiny.model, 0.25, "cold", activity)
    for l, m in masks.items():
        assert m.sum() == round(0.25 * m.numel())
        assert activity[l][m].max() <= activity[l][~m].min()


def test_bad_fractions_exit_2():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "defer_quality.py"), "--fractions", "0,2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ")


def test_a_model_the_engine_would_not_defer_exits_2(tmp_path):
    """Gemma 3's sandwich norms: the engine never defers across them, and the tool says so (exit 2)."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "defer_quality.py"), str(make_tiny("gemma3", tmp_path)),
                        "--windows", "1", "--ctx", "16"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: block 0 ") and r.stderr.count("\n") == 1, r.stderr
