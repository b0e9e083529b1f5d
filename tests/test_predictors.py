"""Neuron predictors, MoE look-ahead, the predictor file, and the predictor-sparse forward."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import run_cli
from hotcold.artifacts import ArtifactError
from hotcold.models.loader import load_model
from hotcold.models.perplexity import perplexity
from hotcold.profiler.data import default_source
from hotcold.predictors.artifact import PredictorSet, load_predictors, save_predictors
from hotcold.predictors.lookahead import fit_lookahead, topk_recall
from hotcold.predictors.neurons import (NeuronPredictor, choose_ranks, magnitude_loss_weight, neuron_thresholds,
                                        set_neuron_thresholds, threshold_for_recall, train_layer)
from hotcold.predictors.sparse import predicted_sparse
from tiny_models import add_tiny_tokenizer, make_tiny


def planted(n=3000, dim=48, neurons=96, rank=4, seed=0, margin=False):
    """Inputs and masks where neuron i fires iff a rank-4 linear function of x exceeds its bias
    (margin: also return that function minus the bias, [n, neurons], a stand-in for |h|)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    u, v = torch.randn(dim, rank, generator=g), torch.randn(rank, neurons, generator=g)
    bias = torch.linspace(-2.5, 1.0, neurons) * (rank**0.5) * (dim**0.5)  # from rare to common neurons
    score = x @ u @ v + bias
    return (x, score > 0, score) if margin else (x, score > 0)


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


def test_weighted_threshold_for_recall_exact():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 0.8, 0.4]])
    truth = torch.tensor([[True, True, False, True], [True, False, True, False]])
    weight = torch.tensor([[1.0, 1.0, 50.0, 1.0], [1.0, 9.0, 6.0, 9.0]])
    # positives by logit: 0.1 (w 1), 0.3 (1), 0.7 (1), 0.8 (6), 0.9 (1); total 10
    assert threshold_for_recall(logits, truth, 0.8, weight) == pytest.approx(0.3)  # may miss 2: 0.1 and 0.3
    assert threshold_for_recall(logits, truth, 0.85, weight) == pytest.approx(0.1)  # may miss 1.5: 0.1 only
    assert threshold_for_recall(logits, truth, 0.3, weight) == pytest.approx(0.7)  # may miss 7, not the 6 at 0.8
    # unit weights give the count rule
    for r in (0.5, 0.8, 1.0):
        assert threshold_for_recall(logits, truth, r, torch.ones_like(logits)) == pytest.approx(
            threshold_for_recall(logits, truth, r), abs=1e-5)


def test_neuron_thresholds_reach_recall_per_neuron():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 6, generator=g) + torch.arange(6.0)  # neurons on different logit scales
    truth = torch.rand(2000, 6, generator=g) < torch.sigmoid(logits - 2)
    truth[:, 5] = False
    truth[:3, 5] = True  # too few positives: the fallback
    weight = torch.rand(2000, 6, generator=g) ** 4 * 100
    for w in (None, weight):
        t = neuron_thresholds(logits, truth, 0.9, w, min_positives=40, fallback=123.0)
        pred = logits > t
        ww = torch.ones_like(logits) if w is None else w
        caught = (ww * truth * pred).sum(0) / (ww * truth).sum(0)  # [I]
        assert bool((caught[:5] >= 0.9).all())
        assert bool((caught[:5] < 0.93).all())  # largest thresholds: not trivially all caught
        assert float(t[5]) == 123.0
    # a neuron never active is never selected when no fallback is given
    t = neuron_thresholds(logits, torch.zeros_like(truth), 0.9)
    assert not bool((logits > t).any())


def test_per_neuron_thresholds_fold_into_bias_and_hold_out():
    x, active = planted(n=4000)
    p, m = train_layer(x, active, rank=16, recall=0.9, epochs=20, per_neuron=True)
    assert float(p.threshold) == 0.0  # the rule is forward(x) > 0: a runtime needs no threshold vector
    assert m.recall >= 0.87  # held-out
    # every neuron with enough held-out positives is caught about 90% of the time
    test = x[-1000:]
    pred, truth = p.predict(test), active[-1000:]
    n_pos = truth.sum(0)
    per_neuron = (pred & truth).sum(0)[n_pos >= 100] / n_pos[n_pos >= 100]
    assert len(per_neuron) > 20 and float(per_neuron.min()) >= 0.8
    # folding is exact: bias - t with threshold 0 decides as threshold t would
    q = NeuronPredictor(48, 96, 4)
    t = torch.randn(96)
    with torch.no_grad():
        before = q(x[:50]) > t
    set_neuron_thresholds(q, t)
    assert torch.equal(q.predict(x[:50]), before)


def test_weighted_recall_holds_out():
    """An |h|-weighted threshold catches its share of the positives' total |h| on held-out samples."""
    x, active, score = planted(n=4000, margin=True)
    magnitude = score.clamp(min=0) ** 2  # large far from the boundary, as |h| is: easy positives weigh most
    p, m = train_layer(x, active, rank=16, recall=0.95, epochs=20, magnitude=magnitude, weighted_recall=True)
    assert 0.93 <= m.weighted_recall <= 0.975
    assert m.recall < 0.9  # the weighted rule may miss many light positives (the count rule would catch 95%)
    p, m = train_layer(x, active, rank=16, recall=0.95, epochs=20, magnitude=magnitude, weighted_recall=True,
                       weighted_loss=True, per_neuron=True)
    assert m.weighted_recall >= 0.92
    with pytest.raises(ValueError, match="magnitude"):
        train_layer(x, active, rank=16, weighted_loss=True)


def test_magnitude_loss_weight():
    active = torch.tensor([[True, False], [True, True], [False, True]])
    magnitude = torch.tensor([[1.0, 9.0], [3.0, 2.0], [5.0, 1000.0]])
    w = magnitude_loss_weight(magnitude, active, power=1.0, cap=1.9)
    # per neuron: |h| over the mean active |h| (2 and 501), capped; 0 where inactive
    assert torch.allclose(w.float(), torch.tensor([[0.5, 0.0], [1.5, 2 / 501], [0.0, 1.9]]), rtol=1e-3)
    w = magnitude_loss_weight(magnitude, active)  # default: |h|^2 over its mean (5 and 500002), cap 100
    assert torch.allclose(w.float(), torch.tensor([[0.2, 0.0], [1.8, 4 / 500002], [0.0, 2.0]]), rtol=1e-3)
    assert torch.allclose(magnitude_loss_weight(magnitude * 1e30, active).float(), w.float())  # no overflow


def test_weighted_loss_catches_heavy_positives():
    """With too little rank for every neuron's pattern, the |h|-weighted loss favours the positives that
    carry |h|: at the same count recall it catches more of their total |h| (held-out)."""
    x, active = planted(n=4000)
    magnitude = active * (1 + 30 * (x[:, :1] > 1.0).float())  # heavy where x0 > 1, a quarter of the samples
    _, plain = train_layer(x, active, rank=4, recall=0.8, epochs=20, magnitude=magnitude)
    _, weighted = train_layer(x, active, rank=4, recall=0.8, epochs=20, magnitude=magnitude, weighted_loss=True)
    assert abs(weighted.recall - plain.recall) < 0.03
    assert weighted.weighted_recall > plain.weighted_recall + 0.04


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
    assert not any(m["weighted_loss"] for m in pm["layers"])  # ReLU: active = fired, plain BCE
    assert (art / "predictors.safetensors").is_file()
    r = run_cli("run", str(model), "--prompt", "The value of", "-n", "5", "--temperature", "0", "--sparse",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "of FFN neurons computed" in r.stderr
    r = run_cli("perplexity", str(model), "--sparse", "--ctx", "64", "--chunks", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["sparse"] is True


def test_cli_profile_gated_trains_with_magnitude_weights(tiny, tmp_path):
    out = tmp_path / "art"
    r = run_cli("profile", str(tiny("llama")), "--tokens", "512", "--seq-len", "64", "--sparsity", "0.5",
                "--heldout-tokens", "128", "--samples", "256", "--out", str(out))
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "profile.json").read_text())
    pm = meta["predictors"]
    assert all(m["weighted_loss"] for m in pm["layers"])  # gated, |h| > threshold: |h|^2-weighted BCE
    assert all(0 < m["weighted_recall"] <= 1 for m in pm["layers"]) and 0 < pm["mean_weighted_recall"] <= 1
    # the predictor-sparse held-out perplexity, recorded: what the saved predictors give on the held-out tail
    assert pm["heldout_ppl_rise"] == pytest.approx(pm["heldout_ppl"] / meta["dense_ppl"] - 1)
    assert "predictor-sparse held-out perplexity" in r.stderr
    lm = load_model(tiny("llama"), "cpu", "float32")
    ids = lm.tokenizer.encode(default_source().text, add_special_tokens=False)[-128:]
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    assert perplexity(lm.model, ids, 64, bos).ppl == pytest.approx(meta["dense_ppl"], rel=1e-4)
    with predicted_sparse(lm.model, load_predictors(out / "predictors.safetensors", lm.fingerprint)):
        assert perplexity(lm.model, ids, 64, bos).ppl == pytest.approx(pm["heldout_ppl"], rel=1e-4)


def test_run_sparse_without_predictors_is_a_clear_error(tiny):
    r = run_cli("run", str(tiny("qwen2")), "--prompt", "hi", "-n", "2", "--sparse")
    assert r.returncode == 2 and "no predictors for this model" in r.stderr and r.stderr.count("\n") == 1


def test_sample_magnitude_of_a_quantised_ffn(tiny):
    """A GGUF loads on the CPU in its blocks (QuantLinear: no float weight parameters); the |h| the
    gated predictors weigh their loss by is still computed (it crashed `hotcold profile` on quantised
    gated models), close to the float model's."""
    from hotcold.predictors.train import sample_magnitude

    path = tiny("llama")
    ref = load_model(path, "cpu", "float32")
    q = load_model(path, "cpu", "float32", quantize="q8_0")
    x = torch.randn(16, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = sample_magnitude(ref.model.layers[0].ffn, x).float()
    got = sample_magnitude(q.model.layers[0].ffn, x).float()
    assert got.shape == want.shape and (got - want).abs().max() <= 0.05 * want.abs().max()


def test_batched_perplexity_equals_window_by_window(tmp_path):
    """perplexity(batch=k) (several windows per forward, as the profile's searches run it) against one
    window at a time, with a last batch shorter than the others; progress counts every window."""
    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    ids = torch.randint(3, 160, (5 * 32 + 7,), generator=torch.Generator().manual_seed(2)).tolist()
    one = perplexity(lm.model, ids, 32, 1)
    for batch in (2, 8):
        seen = []
        got = perplexity(lm.model, ids, 32, 1, batch=batch, progress=lambda done, total: seen.append((done, total)))
        assert got.ppl == pytest.approx(one.ppl, rel=1e-5) and got.tokens_scored == one.tokens_scored == 5 * 15
        assert seen == [(w, 5) for w in range(1, 6)]
