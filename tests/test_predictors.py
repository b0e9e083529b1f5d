"""Neuron predictors, MoE look-ahead, the predictor file, and the predictor-sparse forward."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import run_cli
from hotcold.artifacts import ArtifactError
from hotcold.models.loader import load_model
from hotcold.predictors.artifact import PredictorSet, load_predictors, save_predictors
from hotcold.predictors.lookahead import fit_lookahead, topk_recall
from hotcold.predictors.neurons import NeuronPredictor, choose_ranks, threshold_for_recall, train_layer
from hotcold.predictors.sparse import predicted_sparse
from tiny_models import add_tiny_tokenizer, make_tiny


def planted(n=3000, dim=48, neurons=96, rank=4, seed=0):
    """Inputs and masks where neuron i fires iff a rank-4 linear function of x exceeds its bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    u, v = torch.randn(dim, rank, generator=g), torch.randn(rank, neurons, generator=g)
    bias = torch.linspace(-2.5, 1.0, neurons) * (rank**0.5) * (dim**0.5)  # from rare to common neurons
    active = (x @ u @ v + bias) > 0
    return x, active


def test_planted_pattern_is_learned():
    x, active = planted()
    p, m = train_layer(x, active, rank=16, recall=0.95, epochs=30)
    assert m.recall >= 0.93  # measured on samples neither trained on nor used for the threshold
    assert m.predicted_active_fraction <= 1.3 * m.true_active_fraction
    assert m.precision >= 0.7
    # an untrained predictor at the same recall selects far more (the test can fail)
    blank = NeuronPredictor(48, 96, 16)
    with torch.no_grad():
        logits = blank(x[:500])
    thr = threshold_for_recall(logits, active[:500], 0.95)
    assert float((logits > thr).float().mean()) > 1.5 * float(active.float().mean())


def test_threshold_for_recall_exact():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 0.8, 0.4]])
    truth = torch.tensor([[True, True, False, True], [True, False, True, False]])
    # positives: 0.1 0.9 0.3 0.7 0.8; recall 0.8 may miss one -> threshold at the smallest, 0.1
    t = threshold_for_recall(logits, truth, 0.8)
    assert float(((logits > t) & truth).sum()) / 5 >= 0.8
    assert t == pytest.approx(0.1, abs=1e-5)
    t = threshold_for_recall(logits, truth, 1.0)
    assert bool((logits > t)[truth].all())


def test_choose_ranks_within_budget_and_by_difficulty():
    ranks = choose_ranks(256, [1024] * 3, active=[0.1, 0.5, 0.5], mass80=[0.2, 0.2, 0.7], budget_params=200_000)
    assert sum(r * (256 + 1024 + 1) for r in ranks) <= 200_000 + 3 * 16 * 1300  # floor of 16 may add a little
    assert ranks[0] <= ranks[1] <= ranks[2]


def test_save_load_round_trip_and_fingerprint(tmp_path):
    x, active = planted(n=400)
    p, _ = train_layer(x, active, rank=8, epochs=2)
    preds = PredictorSet("abcdabcdabcdabcd", {3: p}, {1: torch.randn(4, 48)})
    path = save_predictors(tmp_path / "predictors.safetensors", preds)
    back = load_predictors(path, "abcdabcdabcdabcd")
    assert torch.equal(back.neurons[3].predict(x), p.predict(x))
    assert float(back.neurons[3].threshold) == float(p.threshold)
    assert torch.equal(back.lookahead[1], preds.lookahead[1])
    with pytest.raises(ArtifactError, match="another model"):
        load_predictors(path, "ffffffffffffffff")


def test_lookahead_router_guess_and_correction():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2000, 32, generator=g)
    router = nn.Linear(32, 8, bias=False)
    # the next layer's router sees exactly this hidden state: the guess is perfect
    experts = router(hidden).topk(2, dim=-1).indices
    w, m = fit_lookahead(hidden, experts, nn.Identity(), router)
    assert w is None and m.mode == "router" and m.recall == pytest.approx(1.0)
    # experts chosen by another linear map: the plain guess is poor, the trained correction better
    other = torch.randn(8, 32, generator=g)
    experts = (hidden @ other.T).topk(2, dim=-1).indices
    w, m = fit_lookahead(hidden, experts, nn.Identity(), router, epochs=80, lr=1e-2)
    assert m.mode == "trained" and w is not None
    assert m.recall > m.router_recall + 0.2
    assert topk_recall(hidden @ w.T, experts, 2) == pytest.approx(m.recall, abs=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyp")
    return lambda family: add_tiny_tokenizer(make_tiny(family, root))


def test_predicted_sparse_extremes_equal_dense_and_zero(tiny):
    lm = load_model(tiny("llama"), "cpu", "float32")
    c = lm.config
    tokens = torch.randint(0, c.vocab_size, (1, 12))
    dense = lm.model(tokens)
    everything = {l: NeuronPredictor(c.hidden_size, c.intermediate_size, 4) for l in range(c.num_layers)}
    for p in everything.values():
        p.threshold.fill_(-float("inf"))
    with predicted_sparse(lm.model, PredictorSet(lm.fingerprint, everything)) as wrapped:
        assert torch.allclose(lm.model(tokens), dense, atol=1e-5)
        assert all(w.selected == w.tokens * c.intermediate_size for w in wrapped.values())
    nothing = {0: NeuronPredictor(c.hidden_size, c.intermediate_size, 4)}
    nothing[0].threshold.fill_(float("inf"))
    ffn_in = torch.randn(1, 3, c.hidden_size)
    with predicted_sparse(lm.model, PredictorSet(lm.fingerprint, nothing)):
        assert torch.count_nonzero(lm.model.layers[0].ffn(ffn_in)) == 0
    assert torch.allclose(lm.model(tokens), dense)  # restored


def test_cli_profile_trains_predictors_and_run_sparse(tiny, tmp_path):
    model = tiny("llama_relu")
    r = run_cli("profile", str(model), "--tokens", "1024", "--seq-len", "64", "--samples", "256")
    assert r.returncode == 0, r.stderr
    art = model.parent / f"{model.name}.hotcold"
    meta = json.loads((art / "profile.json").read_text())
    pm = meta["predictors"]
    assert len(pm["layers"]) == 3 and pm["total_params"] > 0 and pm["cpu_ms_per_token"] > 0
    assert all(0 <= m["recall"] <= 1 and m["rank"] >= 16 for m in pm["layers"])
    assert (art / "predictors.safetensors").is_file()
    r = run_cli("run", str(model), "--prompt", "The value of", "-n", "5", "--temperature", "0", "--sparse",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "of FFN neurons computed" in r.stderr
    r = run_cli("perplexity", str(model), "--sparse", "--ctx", "64", "--chunks", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["sparse"] is True


def test_run_sparse_without_predictors_is_a_clear_error(tiny):
    r = run_cli("run", str(tiny("qwen2")), "--prompt", "hi", "-n", "2", "--sparse")
    assert r.returncode == 2 and "no predictors for this model" in r.stderr and r.stderr.count("\n") == 1
