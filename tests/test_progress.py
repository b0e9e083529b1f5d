"""profile's progress bars: every stage says its total before it starts, and its rate in its own unit."""

from __future__ import annotations

import pytest

from hotcold.models.loader import load_model
from hotcold.predictors.train import train_predictors
from hotcold.profiler.artifact import load_profile, write_profile
from hotcold.profiler.command import StageClock, rate_text
from hotcold.profiler.data import Source, tokenise
from hotcold.profiler.profile import ProfileOptions, run_profile
from tiny_models import add_tiny_tokenizer, make_tiny

TEXT = "\n".join(f"The value of item {i} is computed by the function f({i % 7}) and stored." for i in range(300))


def test_rate_text_in_the_stages_unit():
    assert rate_text(4096, 2.0, "tok") == "2,048 tok/s"
    assert rate_text(10, 120.0, "layer") == "12.0 s/layer"
    assert rate_text(3, 0.5, "evaluation") == "6.0 evaluations/s"
    assert rate_text(0, 5.0, "layer") == ""


def test_stage_clock_gives_each_report_the_time_since_the_last():
    """Time between reports goes to the stage reporting work done; a start report (done=0) closes
    time outside any stage (counted as 'other'); per-level allocation stages are added up."""
    ticks = iter([0.0, 10.0, 14.0, 20.0, 30.0, 31.0, 51.0, 60.0, 80.0, 100.0])
    clock = StageClock(lambda: next(ticks))
    for stage, done in [("thresholds", 0), ("thresholds", 4096), ("allocation 10%", 0), ("allocation 10%", 30),
                        ("input ppl", 0), ("allocation 20%", 30), ("input ppl", 1), ("predictors", 0),
                        ("predictors", 30)]:
        clock.update(stage, done)
    assert clock.spent == {"thresholds": 4.0, "allocation": 10.0 + 20.0, "input ppl": 9.0, "predictors": 20.0}
    assert clock.summary(151.0) == ("profiled in 2 min 31 s: thresholds 4 s, allocation 30 s, input ppl 9 s, "
                                    "predictors 20 s, other 88 s")
    assert StageClock(lambda: 0.0).summary(12.4) == "profiled in 12 s: other 12 s"


def test_every_stage_starts_at_zero_with_its_total(tmp_path):
    lm = load_model(add_tiny_tokenizer(make_tiny("llama", tmp_path)), "cpu", "float32")
    opts = ProfileOptions(tokens=512, seq_len=64, samples=64, heldout_tokens=256)
    cal = tokenise(lm.tokenizer, [Source("t", TEXT)], opts.tokens, opts.seq_len, opts.heldout_tokens)
    calls = []
    tensors, meta = run_profile(lm, cal, opts, lambda *a: calls.append(a))
    (tmp_path / "out").mkdir()
    paths = write_profile(tmp_path / "out", tensors, meta, None)
    train_predictors(lm, load_profile(paths[0], lm.fingerprint), progress=lambda *a: calls.append(a))
    stages = {}
    for stage, done, total, *unit in calls:
        stages.setdefault(stage, []).append((done, total, unit[0] if unit else "tok"))
    # the input sparsity's stages too: a gated model's profile measures it by default, allocating
    # each level it reaches in a stage of its own ("allocation 10%", ...)
    allocated = sorted(s for s in stages if s.startswith("allocation "))
    assert allocated and allocated[0] == "allocation 10%", stages
    units = {"thresholds": "tok", "counting": "tok", "perplexity": "evaluation", "predictors": "layer",
             "magnitudes": "tok", "input ppl": "evaluation", **{s: "layer" for s in allocated}}
    assert set(units) == set(stages), stages
    for s in allocated:  # every block, once per level
        assert stages[s][-1][:2] == (lm.config.num_layers, lm.config.num_layers), (s, stages[s])
    for stage, seq in stages.items():
        assert seq[0][0] == 0, (stage, seq)  # said before its work starts: the clock starts there
        assert all(total > 0 and 0 <= done <= total for done, total, _ in seq), (stage, seq)
        assert {u for *_, u in seq} == {units[stage]}, (stage, seq)
    assert stages["predictors"][-1][:2] == (lm.config.num_layers, lm.config.num_layers)
    assert stages["counting"][-1][0] == stages["counting"][-1][1]
