"""Runs of consecutive blocks' one-token CPU steps in one numba call (models/cpu_run.py): the same
bits as block by block, for every family the fused step takes, and rebuilt when a block changes."""

from __future__ import annotations

import copy

import pytest
import torch

import hotcold.models.cpu_run as cpu_run
from hotcold.models.transformer import KVCache
from hotcold.models.loader import load_model
from tiny_models import make_tiny, quantised_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_run")


def _quantised(tiny_dir, family: str, kind: str, fused: bool = False):
    return quantised_tiny(tiny_dir, family, kind, fused)


def _decode(lm, toks, runs: bool, prefix: int = 4) -> torch.Tensor:
    real = cpu_run.applies
    if not runs:
        cpu_run.applies = lambda *a: False
    try:
        cache = KVCache(lm.config, toks.shape[1] + 1)
        with torch.inference_mode():
            out = [lm.model(toks[:, :prefix], 0, cache, last_only=True)]
            out += [lm.model(toks[:, p:p + 1], p, cache) for p in range(prefix, toks.shape[1])]
        return torch.cat(out, 1)
    finally:
        cpu_run.applies = real


@pytest.mark.parametrize("family, kind, fused", [("llama", "q8_0", False), ("llama", "q4_0", True),
                                                 ("qwen2", "q8_0", False), ("qwen3", "q4_0", False),
                                                 ("mistral", "q4_0", False), ("gemma3", "q8_0", False),
                                                 ("opt", "q8_0", False), ("opt", "q4_0", False),
                                                 ("opt_post", "q4_0", False)])
def test_runs_give_the_block_by_block_bits(tiny_dir, family, kind, fused):
    """Every block of these models joins one run, and a decode through it gives bit for bit the
    logits of the blocks' fused steps one by one (biases: qwen2, opt; QK-norm: qwen3, gemma3; sliding
    windows: mistral, gemma3; gemma3's two rotary kinds and sandwich norms; OPT's LayerNorm, DenseFFN
    and no rotary, pre-norm and post-norm)."""
    lm = _quantised(tiny_dir, family, kind, fused)
    toks = torch.randint(3, 160, (1, 16), generator=torch.Generator().manual_seed(4))
    want = _decode(lm, toks, runs=False)
    got = _decode(lm, toks, runs=True)
    runs = cpu_run.runs_of(lm.model)
    assert [(r.i0, r.i1) for r in runs] == [(0, lm.config.num_layers)]
    if family == "gemma3":
        assert len(runs[0].rotaries) == 2
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["opt", "opt_post"])
def test_opt_runs_match_transformers(tiny_dir, family):
    """A float32 OPT model (pre-norm; post-norm with its embeddings projected in and out) decodes
    through one run of all its blocks, and its prompt and decode logits are transformers' own."""
    transformers = pytest.importorskip("transformers")
    path = make_tiny(family, tiny_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    lm = load_model(path, "cpu", "float32")
    toks = torch.randint(3, 160, (1, 18), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = ref(toks).logits
    cache = KVCache(lm.config, 20)
    with torch.inference_mode():
        got = torch.cat([lm.model(toks[:, :6], 0, cache)] + [lm.model(toks[:, p:p + 1], p, cache) for p in range(6, 18)], 1)
    assert [(r.i0, r.i1) for r in cpu_run.runs_of(lm.model)] == [(0, lm.config.num_layers)]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_a_changed_block_leaves_the_run_and_comes_back(tiny_dir):
    """A hook on one block's attention (the profiler's kind of change) splits the run around it, the
    hooked block runs as modules (its hook sees it) and the logits stay the block-by-block ones; a
    replaced matrix is seen; removing the hook makes one run again."""
    lm = _quantised(tiny_dir, "llama", "q8_0")
    m = lm.model
    toks = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(5))
    base = _decode(lm, toks, runs=True)
    assert [(r.i0, r.i1) for r in cpu_run.runs_of(m)] == [(0, lm.config.num_layers)]
    seen = []
    h = m.layers[1].attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    got = _decode(lm, toks, runs=True)
    assert all((r.i0 > 1 or r.i1 <= 1) for r in cpu_run.runs_of(m))
    assert len(seen) == toks.shape[1] - 4 + 1 and torch.equal(got, _decode(lm, toks, runs=False))
    h.remove()
    assert torch.equal(_decode(lm, toks, runs=True), base)
    assert [(r.i0, r.i1) for r in cpu_run.runs_of(m)] == [(0, lm.config.num_layers)]
    other = _quantised(tiny_dir, "llama", "q4_0")  # another matrix in layer 0: the run takes it
    m.layers[0].ffn.down = other.model.layers[0].ffn.down
    assert torch.equal(_decode(lm, toks, runs=True), _decode(lm, toks, runs=False))


def test_moe_blocks_run_one_by_one(tiny_dir):
    """A MoE block's FFN runs as its module: no run takes it, and decoding is unchanged."""
    lm = _quantised(tiny_dir, "mixtral", "q8_0")
    toks = torch.randint(3, 160, (1, 10), generator=torch.Generator().manual_seed(6))
    assert torch.equal(_decode(lm, toks, runs=True), _decode(lm, toks, runs=False))
    assert lm.model in cpu_run._RUNS and cpu_run.runs_of(lm.model) == []


def test_a_model_that_ran_can_be_deep_copied(tiny_dir):
    """A model's runs live beside it (numba's typed Lists do not deep-copy): a copy of a model that
    decoded makes its own runs and decodes to the same bits."""
    lm = _quantised(tiny_dir, "llama", "q8_0")
    toks = torch.randint(3, 160, (1, 8), generator=torch.Generator().manual_seed(7))
    want = _decode(lm, toks, runs=True)
    twin = copy.deepcopy(lm)
    assert cpu_run.runs_of(twin.model) == []
    assert torch.equal(_decode(twin, toks, runs=True), want)
    assert [(r.i0, r.i1) for r in cpu_run.runs_of(twin.model)] == [(0, lm.config.num_layers)]
