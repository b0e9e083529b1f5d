"""When a plan asks no predictor: the cost model's choice per layer, the profile's quality budget, the
artifact, and the run that follows."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hotcold.executors.options import Placement as EnginePlacement
from hotcold.planner.costs import LayerStats, build_costs
from hotcold.planner.evaluate import Placement, evaluate, without_needless_predictors
from hotcold.planner.inputs import predictors_within_budget, read_profile
from hotcold.planner.make import make_plan, plan_json, plan_tensors
from hotcold.planner.plan import load_plan, write_plan
from hotcold.planner.weight_format import weight_format
from test_planner import TOY_CONSTANTS, _req, model_bytes, tiny_cfg, toy_hw, write_profile


def _stats(cfg, predicted: float, params: int) -> list[LayerStats]:
    f = np.linspace(0.9, 0.1, cfg.intermediate_size)  # mean 0.5
    return [LayerStats("gated", f.copy(), predictor_params=params, predicted_active_fraction=predicted)
            for _ in range(cfg.num_layers)]


def test_a_predictor_that_selects_nearly_everything_is_turned_off():
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    hw = toy_hw(cuda=False)
    for predicted, params, want in ((0.99, 4000, "off"), (0.2, 10, "cpu")):
        costs = build_costs(cfg, _stats(cfg, predicted, params), hw, weight_format("bf16"), ctx=64, block_size=8,
                            constants=TOY_CONSTANTS)
        p = without_needless_predictors(costs, Placement.all_cpu(costs))
        ev, asked = evaluate(costs, p), evaluate(costs, Placement.all_cpu(costs))
        assert [le.predictor for le in ev.layers] == [want, want]
        if want == "off":
            lc = costs.layers[0]
            assert ev.layers[0].pred_s == 0 and ev.layers[0].ffn_cpu_s == pytest.approx(
                lc.unit_all_cpu_s.sum() + lc.ffn_cpu_fixed_s)
            assert ev.time_s < asked.time_s and ev.cpu_bytes["predictors"] == 0
        else:
            assert p.pred_off is None and ev.time_s == asked.time_s


def test_predictors_over_the_profiles_perplexity_budget_are_not_asked(tmp_path):
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    stats = _stats(cfg, 0.2, 10)  # cheap and selective: the cost model alone would keep them
    path = write_profile(tmp_path, cfg, "fp", stats, predictors=True)
    meta = json.loads((tmp_path / "profile.json").read_text())
    assert predictors_within_budget(meta)  # a ReLU model's profile measures no predictor perplexity
    meta.update(ppl_budget=0.01)
    meta["predictors"]["heldout_ppl_rise"] = 0.0496
    (tmp_path / "profile.json").write_text(json.dumps(meta))
    got, _ = read_profile(path, cfg, "fp")
    assert not predictors_within_budget(meta) and not any(st.predictor_allowed for st in got)
    hw = toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6)
    costs = build_costs(cfg, got, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    assert all(lc.pred_bytes == 0 and np.array_equal(lc.unit_cpu_s, lc.unit_all_cpu_s) for lc in costs.layers)
    req = _req(costs.gpu_fixed_bytes + 0.1 * (model_bytes(costs) - costs.gpu_fixed_bytes))
    r = make_plan(cfg, got, hw, req)
    assert r.mode == "hybrid"
    preds = [le.predictor for le in r.evaluation.layers]
    assert "off" in preds and set(preds) <= {"off", "none"} and r.evaluation.gpu_bytes["predictors"] == 0
    # written and read back: the engine's placement asks no predictor in those layers
    meta = plan_json(r, req, fingerprint="fp", model=tmp_path / "m", model_type=cfg.model_type, hw=hw, hw_file=None,
                     profile_source="test", sparsity=None)
    (tmp_path / "plan").mkdir()
    write_plan(tmp_path / "plan", plan_tensors(r), meta)
    plan = load_plan(tmp_path / "plan", "fp")
    off = {l for l, x in enumerate(preds) if x == "off"}
    assert set(np.flatnonzero(plan.predictor_off)) == off and not plan.splits_nothing
    assert EnginePlacement.of_plan(plan, cuda=True, gpu_int4=False).predictor_off == off


def test_an_all_cpu_plan_without_predictors_splits_nothing(tmp_path):
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    hw = toy_hw(cuda=False)
    stats = _stats(cfg, 0.99, 4000)
    req = _req(0)
    r = make_plan(cfg, stats, hw, req)
    meta = plan_json(r, req, fingerprint="fp", model=tmp_path / "m", model_type=cfg.model_type, hw=hw, hw_file=None,
                     profile_source="test", sparsity=None)
    write_plan(tmp_path, plan_tensors(r), meta)
    plan = load_plan(tmp_path, "fp")
    assert plan.mode == "cpu" and plan.predictor_off.all() and plan.splits_nothing
    # a plan written before the field existed reads as asking every predictor
    from safetensors.numpy import load_file, save_file

    t = load_file(str(tmp_path / "plan.safetensors"))
    del t["predictor_off"]
    save_file(t, str(tmp_path / "plan.safetensors"), metadata={"fingerprint": "fp", "format": "1", "mode": "cpu"})
    old = load_plan(tmp_path, "fp")
    assert not old.predictor_off.any() and not old.splits_nothing


def test_the_prediction_follows_the_runs_context_length(tmp_path):
    """The plan assumes a step reads half its --ctx of cached positions; `run --stats` compares the
    measured step with the prediction at the positions its steps read (Plan.predicted_s_at)."""
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    hw = toy_hw(cuda=False)
    stats = _stats(cfg, 0.5, 100)
    preds = {}
    for ctx in (64, 128):
        req = dataclasses.replace(_req(0), ctx=ctx)
        r = make_plan(cfg, stats, hw, req)
        meta = plan_json(r, req, fingerprint="fp", model=tmp_path / "m", model_type=cfg.model_type, hw=hw,
                         hw_file=None, profile_source="test", sparsity=None)
        (tmp_path / str(ctx)).mkdir()
        write_plan(tmp_path / str(ctx), plan_tensors(r), meta)
        preds[ctx] = load_plan(tmp_path / str(ctx), "fp")
    p64, p128 = preds[64], preds[128]
    assert p64.predicted_s_at(None) == pytest.approx(p64.meta["predicted"]["time_per_token_s"])
    assert p64.predicted_s_at(32) == pytest.approx(p64.predicted_s_at(None))  # half of --ctx 64
    assert p128.predicted_s_at(32) == pytest.approx(p64.predicted_s_at(32))  # the weights cost the same
    per_pos = sum(e["kv_s_per_position"] for e in p64.meta["layers"])
    assert per_pos > 0 and p64.predicted_s_at(10) == pytest.approx(p64.predicted_s_at(32) - 22 * per_pos)
    assert p64.predicted_s_at(1000) == pytest.approx(p64.predicted_s_at(64))  # the cache holds --ctx positions
