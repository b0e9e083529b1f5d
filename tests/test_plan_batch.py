"""`hotcold plan --batch N`: the KV caches of N sequences in the plan's memory budget, recorded in
plan.json; `hotcold serve` without --parallel decodes that many together."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hotcold.planner.plan import load_plan, planned_batch, read_plan_json
from hotcold.planner.sizes import parse_size
from hotcold.server.command import resolve_parallel
from hotcold.server.engine import DEFAULT_PARALLEL
from test_planner import TINY, _cli, make_model_folder

CTX = 128
CFG = dict(TINY["llama_relu"], num_hidden_layers=3, intermediate_size=96)


def kv_bytes_by_hand(batch: int, bytes_per_value: int = 2) -> int:
    """K and V of every layer: layers x 2 x kv_heads x head_dim x ctx x batch values (bf16: 2 bytes)."""
    head_dim = CFG["hidden_size"] // CFG["num_attention_heads"]
    return CFG["num_hidden_layers"] * 2 * CFG["num_key_value_heads"] * head_dim * CTX * batch * bytes_per_value


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    return make_model_folder(tmp_path, "tiny", CFG)


def plan_meta(model, out, *args) -> dict:
    r = _cli("plan", model, "--uniform", "--hardware", "h200", "--ctx", CTX, "--out", out, *args)
    assert r.exit_code == 0, r.output
    return json.loads((out / "plan.json").read_text())


def test_kv_of_the_batch_in_the_budget(model, tmp_path):
    """The KV bytes of an all-CPU plan (host RAM) and of an all-GPU plan (VRAM) are those of N
    sequences of --ctx, as computed by hand; the rest of the budget does not change with N."""
    cpu1 = plan_meta(model, tmp_path / "cpu1", "--vram", "0")
    cpu3 = plan_meta(model, tmp_path / "cpu3", "--vram", "0", "--batch", "3")
    assert cpu1["mode"] == cpu3["mode"] == "cpu"
    assert cpu1["bytes"]["cpu"]["kv_cache"] == kv_bytes_by_hand(1)
    assert cpu3["bytes"]["cpu"]["kv_cache"] == kv_bytes_by_hand(3)
    assert cpu3["bytes"]["cpu"]["total"] - cpu1["bytes"]["cpu"]["total"] == kv_bytes_by_hand(2)
    assert cpu1["budget"]["batch"] == 1 and cpu1["budget"]["batch_set"] is False
    assert cpu3["budget"]["batch"] == 3 and cpu3["budget"]["batch_set"] is True
    gpu4 = plan_meta(model, tmp_path / "gpu4", "--vram", "1GiB", "--batch", "4")
    assert gpu4["mode"] == "gpu" and gpu4["bytes"]["gpu"]["kv_cache"] == kv_bytes_by_hand(4)
    assert "kv_cache" not in gpu4["bytes"]["cpu"]
    # plan.json and the Plan read back say the batch; a plan made without --batch names none
    assert load_plan(tmp_path / "gpu4").batch == 4 and load_plan(tmp_path / "cpu1").batch is None
    assert planned_batch(read_plan_json(tmp_path / "cpu3" / "plan.safetensors")) == 3
    assert read_plan_json(tmp_path / "nowhere") is None


def test_a_batch_over_the_ram_budget_is_refused(model, tmp_path):
    """A RAM budget that holds the model with one sequence's KV but not with eight: refused at
    --batch 8, with the RAM it would need."""
    one = plan_meta(model, tmp_path / "one", "--vram", "0")
    ram = one["bytes"]["cpu"]["total"] + kv_bytes_by_hand(1)  # room for a second sequence, not for eight
    r = _cli("plan", model, "--uniform", "--hardware", "h200", "--ctx", CTX, "--vram", "0", "--ram", ram,
             "--batch", "8", "--out", tmp_path / "eight")
    assert r.exit_code != 0 and "cannot hold the model" in str(r.exception)
    needed = parse_size(str(r.exception).split("it needs --ram ")[1].split()[0])
    assert needed >= one["bytes"]["cpu"]["total"] + kv_bytes_by_hand(7)
    r = _cli("plan", model, "--uniform", "--hardware", "h200", "--ctx", CTX, "--vram", "0", "--ram", ram,
             "--batch", "2", "--out", tmp_path / "two")
    assert r.exit_code == 0, r.output


def test_resolve_parallel():
    cpu = lambda batch, given: {"mode": "cpu", "budget": {"batch": batch, "batch_set": given}}  # noqa: E731
    gpu = {"mode": "hybrid", "budget": {"batch": 2, "batch_set": True}}
    assert resolve_parallel(None, None) == (DEFAULT_PARALLEL, None)
    assert resolve_parallel(7, None) == (7, None)
    assert resolve_parallel(None, cpu(6, True)) == (6, None)
    assert resolve_parallel(None, cpu(1, False)) == (DEFAULT_PARALLEL, None)  # planned without --batch
    assert resolve_parallel(None, {"mode": "cpu", "budget": {"batch": 1}}) == (DEFAULT_PARALLEL, None)  # older plans
    assert resolve_parallel(6, cpu(6, True)) == (6, None)
    n, warning = resolve_parallel(8, cpu(6, True))
    assert n == 8 and "KV caches of 6 sequences" in warning and "RAM" in warning and "--batch 8" in warning
    n, warning = resolve_parallel(3, cpu(1, False))
    assert n == 3 and "KV cache of 1 sequence" in warning
    assert resolve_parallel(2, gpu) == (2, None)
    n, warning = resolve_parallel(4, gpu)
    assert n == 4 and "VRAM" in warning and "--batch 4" in warning and "one sequence at a time" in warning
    assert len(warning.splitlines()) == 1


class _Started(Exception):
    pass


def test_serve_takes_the_plans_batch(model, tmp_path, monkeypatch):
    """serve without --parallel: the batch of the model's plan (`plan --batch 3`), before anything
    loads; --parallel overrides it; --no-plan: the default."""
    import hotcold.server.engine as engine

    seen = []

    def fake_engine(load, max_concurrency, ctx, parallel, cache_slots):
        seen.append(parallel)
        raise _Started

    monkeypatch.setattr(engine, "ServingEngine", fake_engine)
    plan_meta(model, tmp_path / "tiny.hotcold", "--vram", "0", "--batch", "3")  # the model's own plan folder
    for args, want in (((), 3), (("--parallel", "5"), 5), (("--no-plan",), DEFAULT_PARALLEL),
                       (("--plan", tmp_path / "tiny.hotcold"), 3)):
        r = _cli("serve", model, "--port", "0", *args)
        assert isinstance(r.exception, _Started), r.output
        assert seen[-1] == want, args


@pytest.mark.parametrize("args", [("plan", "--batch", "0"), ("plan", "--batch", "-2"), ("serve", "--parallel", "0"),
                                  ("serve", "--parallel", "-1")])
def test_bad_batch_is_one_line(capsys, args):
    from hotcold.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and args[1] in err[0], err


def test_batch_changes_nothing_else(model, tmp_path):
    """A larger batch at the same budgets keeps the weights' bytes (only the KV grows)."""
    a = plan_meta(model, tmp_path / "a", "--vram", "0")
    b = plan_meta(model, tmp_path / "b", "--vram", "0", "--batch", "5")
    for k in set(a["bytes"]["cpu"]) - {"kv_cache", "total"}:
        assert np.isclose(a["bytes"]["cpu"][k], b["bytes"]["cpu"][k]), k
