"""The planner: hardware probe, cost model, ILP (against brute force and greedy), plan artifacts, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from hotcold.artifacts import ArtifactError
from hotcold.errors import HotcoldError
from hotcold.models.config import config_from_hf
from hotcold.planner.costs import Constants, LayerStats, build_costs, expert_stream_budget
from hotcold.planner.evaluate import Placement, evaluate
from hotcold.planner.weight_format import quantize_format, quantized_format, weight_format
from hotcold.planner.greedy import greedy
from hotcold.planner.ilp import solve
from hotcold.planner.make import BudgetError, PlanRequest, make_plan, plan_json, plan_tensors
from hotcold.planner.plan import load_plan, write_plan
from hotcold.planner.hardware import QKINDS, HardwareProfile, preset, read_hardware
from hotcold.planner.probe import load_hardware, probe
from hotcold.planner.sizes import GiB, KiB, MiB, parse_size

# ------------------------------------------------------------------------------------------- helpers
TINY = {
    "llama_relu": dict(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, hidden_act="relu"),
    "opt": dict(model_type="opt", vocab_size=160, hidden_size=64, ffn_dim=32, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64),
    "mixtral": dict(model_type="mixtral", vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=160, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      mlp_only_layers=[1]),
}
TOY_CONSTANTS = Constants(workspace_bytes=4 * KiB, workspace_per_token_bytes_factor=0, host_reserve_bytes=0,
                          step_overhead_s=0.0, layer_overhead_s=0.0, stream_slots_bytes=0)


def tiny_cfg(name: str, **over):
    return config_from_hf(dict(TINY[name], **over))


def toy_hw(gpu_bw=20e9, cpu_bw=2e9, rt=4e-6, launch=0.2e-6, call=0.5e-6, handoff=1e-6, cuda=True) -> HardwareProfile:
    """A machine scaled to tiny models: transfer and sync costs comparable to the compute of a block."""
    kinds = ("f32", "bf16", "f16", "i8")
    return HardwareProfile(
        hostname="toy", source="preset:toy", cpu_threads=2, ram_total_bytes=8 * GiB, ram_available_bytes=8 * GiB,
        cpu_gather_Bps={k: cpu_bw for k in kinds}, cpu_ffn_Bps={k: cpu_bw for k in kinds},
        cpu_dense_Bps={k: cpu_bw * 1.5 for k in kinds}, cpu_call_s=call, thread_handoff_s=handoff, cuda=cuda,
        gpu_name="toy" if cuda else None, gpu_total_bytes=GiB if cuda else None, gpu_free_bytes=GiB if cuda else None,
        gpu_copy_Bps=gpu_bw * 1.2 if cuda else None, gpu_gemv_Bps=gpu_bw if cuda else None,
        h2d_pinned_Bps=1e9 if cuda else None, d2h_pinned_Bps=1e9 if cuda else None,
        h2d_pageable_Bps=0.5e9 if cuda else None, d2h_pageable_Bps=0.5e9 if cuda else None,
        roundtrip_s=rt if cuda else None, launch_sync_s=2 * launch if cuda else None, launch_s=launch if cuda else None,
        gpu_context_bytes=0 if cuda else None)


def power_law_stats(cfg, rng, alphas=None, scale=0.9) -> list[LayerStats]:
    """Per-layer power-law frequencies (neurons shuffled), expert frequencies summing to top_k."""
    out = []
    for l in range(cfg.num_layers):
        a = alphas[l] if alphas is not None else rng.uniform(0.5, 2.0)
        if cfg.ffn_kind(l) == "moe":
            w = np.arange(1, cfg.num_experts + 1, dtype=float) ** (-a)
            f = np.minimum(1.0, cfg.top_k * w / w.sum())
        else:
            f = np.minimum(1.0, scale * np.arange(1, cfg.intermediate_size + 1, dtype=float) ** (-a))
        out.append(LayerStats(cfg.ffn_kind(l), rng.permutation(f)))
    return out


def write_profile(folder: Path, cfg, fingerprint: str, stats: list[LayerStats], predictors: bool = False) -> Path:
    """What `hotcold profile` writes, as far as the planner reads it."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t = {}
    for l, st in enumerate(stats):
        if st.kind == "moe":
            t[f"layers.{l}.expert_freq"] = st.freq.astype(np.float32)
            t[f"layers.{l}.expert_neuron_freq"] = np.full((cfg.num_experts, cfg.moe_intermediate_size), 0.3, np.float32)
        else:
            t[f"layers.{l}.neuron_freq"] = st.freq.astype(np.float32)
        t[f"layers.{l}.threshold"] = np.zeros(1, np.float32)
    save_file(t, str(folder / "profile.safetensors"), metadata={"fingerprint": fingerprint, "format": "1"})
    meta = {"fingerprint": fingerprint, "tokens": 1000}
    if predictors:
        meta["predictors"] = {"layers": [{"layer": l, "params": 1000, "predicted_active_fraction": 0.5, "recall": 0.99}
                                         for l, st in enumerate(stats) if st.kind != "moe"]}
    (folder / "profile.json").write_text(json.dumps(meta))
    return folder / "profile.safetensors"


def make_model_folder(root: Path, name: str, cfg_dict: dict) -> Path:
    """An HF folder with config.json and a small safetensors file: enough for describe_model."""
    from safetensors.numpy import save_file

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg_dict))
    h = cfg_dict["hidden_size"]
    save_file({"model.embed_tokens.weight": np.zeros((cfg_dict["vocab_size"], h), np.float32),
               "model.norm.weight": np.ones(h, np.float32)}, str(d / "model.safetensors"))
    return d


def model_bytes(costs) -> float:
    return evaluate(costs, Placement.all_gpu(costs)).gpu_total


# ------------------------------------------------------------------------------------------- sizes
def test_parse_size():
    assert parse_size("8GiB") == 8 * GiB
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("8G") == 8 * GiB
    assert parse_size("1.5gb") == 1_500_000_000
    assert parse_size("0") == 0
    assert parse_size("4096") == 4096
    with pytest.raises(HotcoldError, match="--vram: cannot read size"):
        parse_size("eight", "--vram")
    with pytest.raises(HotcoldError):
        parse_size("8 parsecs")


# ------------------------------------------------------------------------------------------- brute force
def _brute_force(costs, vram, ram):
    """The best hybrid placement by enumeration: prefixes of dense layers, all subsets of experts,
    attention on/off, a CPU attention's predictor on either side (dense layers), lm_head on/off."""
    per_layer = []
    for lc in costs.layers:
        K = lc.n_units
        if lc.kind == "moe":
            subsets = [np.array(bits, bool) for bits in itertools.product([False, True], repeat=K)]
        else:
            subsets = [np.arange(K) < n for n in range(K + 1)]
        sides = [(False, False), (True, True)] + ([(False, True)] if lc.kind != "moe" else [])  # (attention, predictor)
        per_layer.append([(a, pg, s) for a, pg in sides for s in subsets])
    best = None
    for combo in itertools.product(*per_layer):
        for head in (False, True):
            p = Placement("hybrid", [c[0] for c in combo], [c[2] for c in combo], head, [c[1] for c in combo])
            ev = evaluate(costs, p)
            if ev.gpu_total <= vram - 1024 and ev.cpu_total <= ram - 1024 and (best is None or ev.time_s < best):
                best = ev.time_s
    return best


def test_cpu_attention_predictor_on_either_side():
    """A CPU attention's predictor costs its round trip on the CPU (the FFN's input is back on the GPU
    after the attention: down, a hand-off, the mask up) and its bytes on the GPU: evaluate charges
    each, and with a budget that holds the predictors but no attention the ILP puts them on the GPU."""
    rng = np.random.default_rng(3)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2, intermediate_size=64)
    costs = build_costs(cfg, power_law_stats(cfg, rng), toy_hw(rt=50e-6, handoff=20e-6), weight_format("bf16"),
                        ctx=64, block_size=8, constants=TOY_CONSTANTS)
    on = [np.zeros(lc.n_units, bool) for lc in costs.layers]
    beside = evaluate(costs, Placement("hybrid", [False, False], on, False))  # predictors beside the attention
    apart = evaluate(costs, Placement("hybrid", [False, False], on, False, [True, True]))
    for lc, a, b in zip(costs.layers, beside.layers, apart.layers):
        assert lc.pred_sync_s > 70e-6 and lc.pred_bytes > 0
        assert a.predictor == "cpu" and a.pred_s == pytest.approx(lc.pred_cpu_s + lc.pred_sync_s)
        assert b.predictor == "gpu" and b.pred_s == pytest.approx(lc.pred_gpu_s)
        assert a.sync_s == pytest.approx(b.sync_s + lc.pred_sync_s)
    assert apart.gpu_bytes["predictors"] == pytest.approx(sum(lc.pred_bytes for lc in costs.layers))
    assert beside.gpu_bytes["predictors"] == 0 and apart.time_s < beside.time_s
    vram = costs.gpu_fixed_bytes + sum(lc.pred_bytes for lc in costs.layers) + 2048  # (the ILP keeps 1 KiB)
    assert vram < costs.gpu_fixed_bytes + min(lc.attn_bytes + lc.kv_bytes for lc in costs.layers)
    res = solve(costs, vram, 1e12, solver="cbc", gap=0.0, time_limit=20)
    assert not any(res.placement.attn_gpu) and res.placement.pred_gpu == [True, True]
    assert evaluate(costs, res.placement).time_s == pytest.approx(res.objective, rel=1e-6)


@pytest.mark.parametrize("name,block,layers,twins", [("llama_relu", 8, 2, False), ("opt", 8, 3, False),
                                                     ("llama_relu", 8, 3, True), ("mixtral", 0, 2, False),
                                                     ("qwen2_moe", 8, 3, False)])
def test_ilp_matches_brute_force(name, block, layers, twins):
    """twins: every layer has the same profile (the ILP then counts choices per group of identical layers)."""
    rng = np.random.default_rng(len(name) + layers)
    cfg = tiny_cfg(name, num_hidden_layers=layers, **({"intermediate_size": 16} if name == "qwen2_moe" else {}))
    n_checked = 0
    for trial in range(3):
        hw = toy_hw(gpu_bw=rng.uniform(5e9, 40e9), cpu_bw=rng.uniform(1e9, 4e9), rt=rng.uniform(1e-6, 10e-6))
        stats = power_law_stats(cfg, rng)
        if twins:
            stats = [stats[0]] * layers
        costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=block, constants=TOY_CONSTANTS)
        full = model_bytes(costs)
        for frac in (0.25, 0.6):
            vram = costs.gpu_fixed_bytes + frac * (full - costs.gpu_fixed_bytes)
            ram = 8 * GiB if trial else full * 0.8  # also a binding RAM budget
            best = _brute_force(costs, vram, ram)
            res = solve(costs, vram, ram, solver="cbc", gap=0.0, time_limit=20)
            if best is None:
                assert res.status == "infeasible"
                continue
            ev = evaluate(costs, res.placement)
            assert res.status == "optimal"
            assert ev.time_s == pytest.approx(best, rel=1e-6)
            assert res.objective == pytest.approx(ev.time_s, rel=1e-6)  # the ILP's model is the evaluator's
            assert ev.gpu_total <= vram and ev.cpu_total <= ram
            n_checked += 1
    assert n_checked >= 4


def test_highs_agrees_with_cbc():
    rng = np.random.default_rng(7)
    cfg = tiny_cfg("qwen2_moe")
    costs = build_costs(cfg, power_law_stats(cfg, rng), toy_hw(), weight_format("bf16"), ctx=64, block_size=8,
                        constants=TOY_CONSTANTS)
    vram = costs.gpu_fixed_bytes + 0.4 * (model_bytes(costs) - costs.gpu_fixed_bytes)
    a = solve(costs, vram, 8 * GiB, solver="cbc", gap=0.0)
    b = solve(costs, vram, 8 * GiB, solver="highs", gap=0.0)
    assert a.status == b.status == "optimal"
    assert evaluate(costs, a.placement).time_s == pytest.approx(evaluate(costs, b.placement).time_s, rel=1e-6)
    assert b.gap is not None and b.gap <= 1e-6


# ------------------------------------------------------------------------------------------- plans
def _req(vram, ram=8 * GiB, **kw):
    return PlanRequest(vram=int(vram), ram=int(ram), ctx=64, fmt=weight_format("bf16"), block_size=kw.pop("block", 8),
                       gap=0.0, constants=kw.pop("constants", TOY_CONSTANTS), **kw)


@pytest.mark.parametrize("name", ["llama_relu", "qwen2_moe"])
def test_budget_respected_and_monotonic(name):
    rng = np.random.default_rng(3)
    cfg = tiny_cfg(name, num_hidden_layers=4)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    full = model_bytes(costs)
    prev = None
    modes = set()
    for vram in [0] + list(np.linspace(costs.gpu_fixed_bytes, full * 1.05, 14)):
        r = make_plan(cfg, stats, hw, _req(vram))
        modes.add(r.mode)
        assert r.evaluation.gpu_total <= max(vram, 0) or r.mode == "cpu"
        assert r.evaluation.cpu_total <= 8 * GiB
        if r.mode == "cpu":
            assert r.evaluation.gpu_total == 0
        if prev is not None:
            assert r.evaluation.time_s <= prev * (1 + 1e-9), f"slower with more VRAM ({vram:.0f} B)"
        prev = r.evaluation.time_s
    assert modes == {"cpu", "hybrid", "gpu"}


def test_extremes_all_gpu_and_all_cpu():
    rng = np.random.default_rng(4)
    cfg = tiny_cfg("llama_relu")
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    r = make_plan(cfg, stats, hw, _req(model_bytes(costs)))
    assert r.mode == "gpu" and all(r.placement.attn_gpu) and r.placement.head_gpu
    assert all(on.all() for on in r.placement.on_gpu)
    assert all(le.predictor == "none" for le in r.evaluation.layers)
    r0 = make_plan(cfg, stats, hw, _req(0))
    assert r0.mode == "cpu" and not any(r0.placement.attn_gpu) and not r0.placement.head_gpu
    assert r0.evaluation.gpu_total == 0 and all(le.sync_s == 0 for le in r0.evaluation.layers)
    # no CUDA in the hardware profile: all-CPU whatever --vram says, with a note
    r1 = make_plan(cfg, stats, toy_hw(cuda=False), _req(GiB))
    assert r1.mode == "cpu" and any("no CUDA" in n for n in r1.notes)


def test_gpu_reserve_counts_cuda_context_and_stream_slots():
    """The budget holds the process's CUDA context (measured, else the constant), the prefill
    streamer's slots (at most two FFN layers) and, under GQA, a prompt chunk's keys and values
    repeated to the query's heads over the context; no GPU, no reserve."""
    cfg = tiny_cfg("llama_relu", num_hidden_layers=3)
    assert cfg.num_kv_heads < cfg.num_heads
    stats = power_law_stats(cfg, np.random.default_rng(2))
    fmt = weight_format("bf16")
    consts = dataclasses.replace(TOY_CONSTANTS, stream_slots_bytes=128 * MiB)
    ffn_layer = (3 if cfg.ffn_kind(0) == "gated" else 2) * cfg.hidden_size * cfg.intermediate_size * 2  # bf16
    gqa = 2 * cfg.num_heads * 64 * cfg.head_dim * 2  # bf16 keys and values, 64 positions

    def ws(hw, c=consts):
        return build_costs(cfg, stats, hw, fmt, ctx=64, block_size=8, constants=c).workspace_bytes

    base = ws(toy_hw(cuda=False))
    assert ws(toy_hw()) == base + 2 * ffn_layer + gqa  # measured context 0; slots capped at two layers
    assert ws(dataclasses.replace(toy_hw(), gpu_context_bytes=300 * MiB)) == base + 300 * MiB + 2 * ffn_layer + gqa
    unmeasured = dataclasses.replace(toy_hw(), gpu_context_bytes=None)
    assert ws(unmeasured) == base + consts.cuda_context_bytes + 2 * ffn_layer + gqa
    big = dataclasses.replace(consts, stream_slots_bytes=1000)
    assert ws(toy_hw(), big) == base + 1000 + gqa
    # a plan at a budget just above the reserve keeps its weights under budget - reserve
    hw = dataclasses.replace(toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6), gpu_context_bytes=64 * KiB)
    costs = build_costs(cfg, stats, hw, fmt, ctx=64, block_size=8, constants=consts)
    vram = costs.workspace_bytes + 0.4 * (model_bytes(costs) - costs.workspace_bytes)
    r = make_plan(cfg, stats, hw, _req(vram, constants=consts))
    assert r.mode == "hybrid" and r.evaluation.gpu_total <= vram and r.evaluation.gpu_bytes["workspace"] == ws(hw)


def test_moe_router_and_shared_expert_stay_on_the_gpu():
    """As the runtime keeps them (executors/moe.py): GPU bytes in any hybrid plan, whatever the
    attention's placement; host bytes in an all-CPU plan; counted once either way."""
    cfg = tiny_cfg("qwen2_moe", num_hidden_layers=3, intermediate_size=16)
    stats = power_law_stats(cfg, np.random.default_rng(4))
    fmt = weight_format("bf16")
    moe_layers = [l for l in range(3) if cfg.ffn_kind(l) == "moe"]
    h, s = cfg.hidden_size, cfg.shared_expert_intermediate_size
    want = len(moe_layers) * (h * cfg.num_experts + 3 * h * s + h) * 2  # router + shared expert + its gate, bf16
    costs = build_costs(cfg, stats, toy_hw(), fmt, ctx=64, block_size=8, constants=TOY_CONSTANTS)
    assert costs.moe_gpu_bytes == want and costs.gpu_fixed_bytes == costs.workspace_bytes + want
    cpu_costs = build_costs(cfg, stats, toy_hw(cuda=False), fmt, ctx=64, block_size=8, constants=TOY_CONSTANTS)
    hybrid = Placement.all_gpu(costs)
    hybrid.mode = "hybrid"
    hybrid.attn_gpu = [False] * 3
    ev = evaluate(costs, hybrid)
    assert ev.gpu_bytes["router_shared"] == want and ev.cpu_bytes.get("router_shared", 0) == 0
    cpu_ev = evaluate(costs, Placement.all_cpu(costs))
    assert cpu_ev.cpu_bytes["router_shared"] == want and cpu_ev.gpu_total == 0
    # an all-CPU plan costs the same bytes and time as on a machine without a GPU
    ref = evaluate(cpu_costs, Placement.all_cpu(cpu_costs))
    assert cpu_ev.cpu_total == pytest.approx(ref.cpu_total) and cpu_ev.time_s == pytest.approx(ref.time_s, rel=1e-9)


def test_streamed_experts_workspace_follows_the_budget_into_the_plan(tmp_path):
    """A quantised MoE model's hybrid plan reserves prefill's streamed-expert workspace, a 16th of the
    budget within 128-512 MiB (at most all of a layer's experts), and the plan carries it to the engine."""
    assert [expert_stream_budget(v) // MiB for v in (0, 2 * GiB, 4 * GiB, 8 * GiB, 24 * GiB)] == [128, 128, 256, 512, 512]
    cfg = tiny_cfg("qwen2_moe", num_hidden_layers=3, intermediate_size=16)
    stats = power_law_stats(cfg, np.random.default_rng(2))
    q4 = quantized_format(weight_format("bf16"), "q4_0", 0.5625, 0.5625)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (2 * 0.5625 + 2)  # two raw slots and its bf16 decode

    def ws(fmt, stream):
        c = dataclasses.replace(TOY_CONSTANTS, expert_stream_bytes=stream)
        return build_costs(cfg, stats, toy_hw(), fmt, ctx=64, block_size=8, constants=c).workspace_bytes

    assert ws(q4, 1000) - ws(q4, 0) == 1000
    assert ws(q4, 512 * MiB) - ws(q4, 0) == pytest.approx(cfg.num_experts * expert)
    assert ws(weight_format("bf16"), 1000) == ws(weight_format("bf16"), 0)  # float experts do not stream
    # a prompt chunk's GPU experts run in the chunk kernels: their buffers are reserved as the kernels allocate them
    from hotcold.models.generate import PREFILL_CHUNK
    from hotcold.sparse_ops.moe_chunk_gpu import BLOCK_M, workspace_bytes

    assert (TOY_CONSTANTS.chunk_tokens, TOY_CONSTANTS.chunk_block) == (PREFILL_CHUNK, BLOCK_M)

    def chunk_ws(tokens):
        c = dataclasses.replace(TOY_CONSTANTS, chunk_tokens=tokens)
        return build_costs(cfg, stats, toy_hw(), q4, ctx=64, block_size=8, constants=c).workspace_bytes

    for tokens in (PREFILL_CHUNK, 3):  # a chunk of at most the context's 64 tokens
        want = workspace_bytes(min(tokens, 64), cfg.top_k, cfg.num_experts, cfg.hidden_size,
                               cfg.moe_intermediate_size, 2)
        assert chunk_ws(tokens) - chunk_ws(0) == want
    c = dataclasses.replace(TOY_CONSTANTS, expert_stream_bytes=192 * MiB)
    costs = build_costs(cfg, stats, toy_hw(), q4, ctx=64, block_size=8, constants=c)
    req = dataclasses.replace(_req(costs.gpu_fixed_bytes + 0.5 * (model_bytes(costs) - costs.gpu_fixed_bytes),
                                   constants=c), fmt=q4)
    r = make_plan(cfg, stats, toy_hw(), req)
    meta = plan_json(r, req, fingerprint="f", model=tmp_path / "m", model_type=cfg.model_type, hw=toy_hw(),
                     hw_file=None, profile_source="test", sparsity=None)
    write_plan(tmp_path, plan_tensors(r), meta)
    assert load_plan(tmp_path, "f").expert_stream_bytes == 192 * MiB
    del meta["cost_constants"]["expert_stream_bytes"]  # a plan written before the field: the old constant
    write_plan(tmp_path, plan_tensors(r), meta)
    assert load_plan(tmp_path, "f").expert_stream_bytes == Constants().expert_stream_bytes == 128 * MiB


def test_expert_cache_is_reserved_for_moe_models_only():
    fmt = weight_format("bf16")
    consts = dataclasses.replace(TOY_CONSTANTS, expert_cache_bytes=40 * KiB)
    for name, want in (("mixtral", 40 * KiB), ("llama_relu", 0)):
        cfg = tiny_cfg(name, num_hidden_layers=2)
        stats = power_law_stats(cfg, np.random.default_rng(6))
        base = build_costs(cfg, stats, toy_hw(), fmt, ctx=64, block_size=8, constants=TOY_CONSTANTS)
        costs = build_costs(cfg, stats, toy_hw(), fmt, ctx=64, block_size=8, constants=consts)
        assert costs.gpu_fixed_bytes - base.gpu_fixed_bytes == want
        assert build_costs(cfg, stats, toy_hw(cuda=False), fmt, ctx=64, block_size=8,
                           constants=consts).expert_cache_bytes == 0  # no GPU, no cache
        if want:
            vram = costs.gpu_fixed_bytes + 0.3 * (model_bytes(costs) - costs.gpu_fixed_bytes)
            r = make_plan(cfg, stats, toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6), _req(vram, constants=consts))
            assert r.mode == "hybrid" and r.evaluation.gpu_bytes["expert_cache"] == want
            assert r.evaluation.gpu_total <= vram


def test_infeasible_budgets_say_the_minimum():
    rng = np.random.default_rng(5)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=3)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    consts = dataclasses.replace(TOY_CONSTANTS, workspace_bytes=64 * KiB)
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=consts)
    full = model_bytes(costs)
    minimum = f"{costs.workspace_bytes / KiB:.0f}KiB"  # 64 KiB and a chunk's repeated keys and values
    with pytest.raises(BudgetError, match=rf"cannot hold the GPU workspace.*--vram {minimum} or more.*--vram 0") as e:
        make_plan(cfg, stats, hw, _req(8 * KiB, constants=consts))
    assert "\n" not in str(e.value)
    # RAM too small for an all-CPU plan
    with pytest.raises(BudgetError, match=r"all-CPU plan: it needs --ram \d+KiB"):
        make_plan(cfg, stats, hw, _req(0, ram=64 * KiB, constants=consts))
    # RAM too small for what stays on the CPU at this VRAM; the message's minimums work
    vram = costs.gpu_fixed_bytes + 0.3 * (full - costs.gpu_fixed_bytes)
    ram = 0.3 * evaluate(costs, Placement.all_cpu(costs)).cpu_total
    with pytest.raises(BudgetError, match=r"cannot hold what stays on the CPU: with --vram \S+ it needs --ram (\S+); "
                                          r"with --ram \S+ it needs --vram (\S+)") as e:
        make_plan(cfg, stats, hw, _req(vram, ram=ram, constants=consts))
    import re

    need_ram, need_vram = re.search(r"needs --ram (\S+);.*needs --vram (\S+)$", str(e.value)).groups()
    make_plan(cfg, stats, hw, _req(vram, ram=parse_size(need_ram), constants=consts))  # no error
    assert make_plan(cfg, stats, hw, _req(parse_size(need_vram), ram=ram, constants=consts)).mode in ("hybrid", "gpu")


def test_beats_greedy_where_layers_differ():
    """Two busy layers (neurons fire half the time) and two sparse ones (2%): greedy fills the GPU with the
    sparse layers' blocks too, making every layer GPU-bound; the ILP balances each layer's GPU and CPU halves."""
    cfg = tiny_cfg("llama_relu", num_hidden_layers=4, intermediate_size=256)
    rng = np.random.default_rng(6)
    stats = [LayerStats("gated", np.full(256, f) * rng.uniform(0.9, 1.0, 256)) for f in (0.5, 0.02, 0.5, 0.02)]
    hw = toy_hw(gpu_bw=8e9, cpu_bw=2e9, rt=1e-6, handoff=0.5e-6)
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=32, constants=TOY_CONSTANTS)
    vram = 0.95 * model_bytes(costs)
    g = greedy(costs, vram)
    g_ev = evaluate(costs, g)
    r = make_plan(cfg, stats, hw, _req(vram, explain=True, block=32))
    assert r.mode == "hybrid"
    assert r.evaluation.time_s < 0.85 * g_ev.time_s
    assert r.greedy[1].time_s == pytest.approx(g_ev.time_s)
    assert g_ev.gpu_total <= vram and r.evaluation.gpu_total <= vram
    # the sparse layers keep most of their neurons on the CPU in the plan, not in greedy's
    assert r.placement.on_gpu[1].sum() < g.on_gpu[1].sum()


def test_matches_greedy_where_costs_are_uniform():
    """Identical layers whose neurons all fire equally often, on a machine without per-call latencies and
    without predictors: every byte of a kind is worth the same, so hottest-first is already optimal."""
    cfg = tiny_cfg("llama_relu", num_hidden_layers=3)
    stats = [LayerStats("gated", np.full(32, 0.3)) for _ in range(3)]
    hw = toy_hw(rt=0.0, launch=0.0, call=0.0, handoff=0.0)
    consts = dataclasses.replace(TOY_CONSTANTS, predictor_fraction=0.0, mask_bytes_per_neuron=0.0,
                                 transfer_bytes_per_value=0)
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=consts)
    full = model_bytes(costs)
    for frac in (0.3, 0.5, 0.8):
        vram = costs.gpu_fixed_bytes + frac * (full - costs.gpu_fixed_bytes)
        g_ev = evaluate(costs, greedy(costs, vram))
        res = solve(costs, vram, 8 * GiB, gap=0.0)
        assert evaluate(costs, res.placement).time_s == pytest.approx(g_ev.time_s, rel=1e-9)


def test_cost_model_details():
    cfg = tiny_cfg("llama_relu", num_hidden_layers=1)
    stats = [LayerStats("gated", np.linspace(1.0, 0.0, 32))]
    hw = toy_hw()
    c1 = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    lc = c1.layers[0]
    assert list(lc.order[:3]) == [0, 1, 2] and lc.n_units == 4
    assert np.all(np.diff(lc.unit_cpu_s) <= 0)  # hot blocks cost the CPU more
    assert np.allclose(lc.unit_gpu_s, lc.unit_gpu_s[0])  # the GPU computes its rows densely
    assert lc.unit_bytes[0] == 8 * 3 * 64 * 2  # 8 neurons x (gate, up, down) x hidden x bf16
    c4 = build_costs(cfg, stats, hw, weight_format("f32"), ctx=64, batch=4, block_size=8, constants=TOY_CONSTANTS)
    assert c4.layers[0].unit_bytes[0] == 2 * lc.unit_bytes[0]
    assert c4.layers[0].kv_bytes == 4 * 2 * lc.kv_bytes  # batch 4, 4-byte KV
    # predictor stats: params set the size, the predicted-active fraction inflates the CPU rows
    st = [LayerStats("gated", np.full(32, 0.1), predictor_params=500, predicted_active_fraction=0.2)]
    cp = build_costs(cfg, st, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    c0 = build_costs(cfg, [LayerStats("gated", np.full(32, 0.1))], hw, weight_format("bf16"), ctx=64, block_size=8,
                     constants=TOY_CONSTANTS)
    assert cp.layers[0].pred_bytes == 1000  # fp16 where a GPU runs it
    assert cp.layers[0].pred_host_bytes == pytest.approx(500 * 34 / 32)  # Q8_0 blocks on the CPU
    assert cp.layers[0].pred_cpu_s == pytest.approx(cp.layers[0].pred_host_bytes / hw.cpu_dense("q8_0")
                                                    + TOY_CONSTANTS.predictor_cpu_calls * hw.cpu_call_s)
    assert cp.layers[0].unit_cpu_s[0] == pytest.approx(2 * c0.layers[0].unit_cpu_s[0])
    # sliding-window layers keep only the window in their KV cache
    g = config_from_hf(dict(model_type="mistral", vocab_size=160, hidden_size=64, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, sliding_window=16))
    cs = build_costs(g, [LayerStats("gated", np.full(32, 0.1))], hw, weight_format("bf16"), ctx=64, block_size=8,
                     constants=TOY_CONSTANTS)
    assert cs.layers[0].kv_bytes == lc.kv_bytes * 16 / 64


def test_all_cpu_plans_charge_the_measured_fixed_costs():
    """An all-CPU plan charges a layer the probe's measured step cost and each matrix product read
    whole its fixed cost, in place of counted calls and the layer overhead, and each token its sampling
    over the vocabulary; a GPU plan keeps the counts and samples on the GPU."""
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    stats = [LayerStats("gated", np.full(32, 0.1)) for _ in range(2)]
    consts = dataclasses.replace(TOY_CONSTANTS, layer_overhead_s=15e-6, step_overhead_s=100e-6)
    fmt = weight_format("bf16")
    plain = toy_hw(cuda=False)
    measured = dataclasses.replace(plain, cpu_layer_s=40e-6, cpu_matrix_fixed_s=3e-6, cpu_sample_s=50e-6,
                                   cpu_sample_logit_s=2e-9)
    c0 = build_costs(cfg, stats, plain, fmt, ctx=64, block_size=8, constants=consts)
    c1 = build_costs(cfg, stats, measured, fmt, ctx=64, block_size=8, constants=consts)
    a0, a1 = c0.layers[0], c1.layers[0]
    calls = consts.attn_cpu_calls * plain.cpu_call_s
    assert a1.attn_cpu_s == pytest.approx(a0.attn_cpu_s - calls + 40e-6 + 2 * 3e-6)  # q/k/v and o
    assert a0.all_cpu_fixed_s == 0 and a1.all_cpu_fixed_s == pytest.approx(3 * 3e-6)  # gate, up, down
    assert c0.fixed_s == pytest.approx(100e-6 + 2 * 15e-6)
    assert c1.fixed_s == pytest.approx(100e-6 + 50e-6 + cfg.vocab_size * 2e-9)
    assert c1.head_cpu_s == pytest.approx(c0.head_cpu_s + 3e-6)
    p = Placement.all_cpu(c1)
    off = evaluate(c1, dataclasses.replace(p, pred_off=[True, True]))
    on = evaluate(c1, p)
    assert off.layers[0].ffn_cpu_s == pytest.approx(float(a1.unit_all_cpu_s.sum()) + a1.ffn_cpu_fixed_s + 9e-6)
    assert on.layers[0].ffn_cpu_s == pytest.approx(float(a1.unit_cpu_s.sum()) + a1.ffn_cpu_fixed_s)
    gpu = build_costs(cfg, stats, dataclasses.replace(toy_hw(), cpu_layer_s=40e-6, cpu_matrix_fixed_s=3e-6,
                                                      cpu_sample_s=50e-6, cpu_sample_logit_s=2e-9), fmt,
                      ctx=64, block_size=8, constants=consts)
    assert gpu.layers[0].all_cpu_fixed_s == 0 and gpu.fixed_s == pytest.approx(100e-6 + 2 * 15e-6)


def test_all_cpu_moe_layers_charge_their_measured_step_beyond_a_dense_one():
    """A MoE layer of an all-CPU plan pays the probe's MoE layer step less the dense one the attention
    already pays (as FFN fixed seconds, whenever it has CPU experts); unmeasured, or on a GPU plan, 0."""
    cfg = tiny_cfg("qwen2_moe")
    stats = power_law_stats(cfg, np.random.default_rng(3))
    fmt = weight_format("bf16")
    measured = dataclasses.replace(toy_hw(cuda=False), cpu_layer_s=40e-6, cpu_matrix_fixed_s=3e-6)
    c0 = build_costs(cfg, stats, measured, fmt, ctx=64, block_size=8, constants=TOY_CONSTANTS)
    c1 = build_costs(cfg, stats, dataclasses.replace(measured, cpu_moe_layer_s=150e-6), fmt, ctx=64, block_size=8,
                     constants=TOY_CONSTANTS)
    moe = [l for l, lc in enumerate(c1.layers) if lc.kind == "moe"]
    assert moe and all(c0.layers[l].ffn_cpu_fixed_s == 0 for l in moe)
    assert all(c1.layers[l].ffn_cpu_fixed_s == pytest.approx(110e-6) for l in moe)
    e0, e1 = (evaluate(c, Placement.all_cpu(c)) for c in (c0, c1))
    assert e1.time_s == pytest.approx(e0.time_s + len(moe) * 110e-6)
    gpu = build_costs(cfg, stats, dataclasses.replace(toy_hw(), cpu_layer_s=40e-6, cpu_moe_layer_s=150e-6), fmt,
                      ctx=64, block_size=8, constants=TOY_CONSTANTS)
    assert all(gpu.layers[l].ffn_cpu_fixed_s == 0 for l in moe)


# ------------------------------------------------------------------------------------------- artifacts
def test_plan_artifact_roundtrip(tmp_path):
    rng = np.random.default_rng(8)
    cfg = tiny_cfg("qwen2_moe")
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    costs = build_costs(cfg, stats, hw, weight_format("bf16"), ctx=64, block_size=8, constants=TOY_CONSTANTS)
    req = _req(costs.gpu_fixed_bytes + 0.5 * (model_bytes(costs) - costs.gpu_fixed_bytes), explain=True)
    r = make_plan(cfg, stats, hw, req)
    meta = plan_json(r, req, fingerprint="abc123", model=tmp_path / "m", model_type=cfg.model_type, hw=hw, hw_file=None,
                     profile_source="test", sparsity=None)
    write_plan(tmp_path, plan_tensors(r), meta)
    p = load_plan(tmp_path, "abc123")
    assert p.mode == r.mode and p.num_layers == 3
    assert json.loads((tmp_path / "plan.json").read_text())["fingerprint"] == "abc123"
    for l, lc in enumerate(r.costs.layers):
        ids = r.placement.gpu_items(r.costs, l)
        if lc.kind == "moe":
            assert np.array_equal(p.gpu_experts[l], ids) and len(p.expert_order[l]) == 4
            f = stats[l].freq[p.gpu_experts[l]]
            assert np.all(np.diff(f) <= 0)  # hottest first
        else:
            assert np.array_equal(p.gpu_neurons[l], p.neuron_order[l][:len(ids)])
            assert np.all(np.diff(stats[l].freq[p.neuron_order[l]]) <= 0)
        assert p.gpu_count[l] == len(ids)
        assert p.attention_gpu[l] == r.placement.attn_gpu[l]
    assert meta["bytes"]["gpu"]["total"] <= req.vram
    assert meta["predicted"]["tokens_per_s"] == pytest.approx(1 / r.evaluation.time_s)
    assert meta["solver"]["status"] == "optimal" and meta["solver"]["gap"] is not None
    assert "greedy" in meta["alternatives"]
    with pytest.raises(ArtifactError, match="made for another model"):
        load_plan(tmp_path, "someoneelse")


def test_profile_reading_and_fingerprint(tmp_path):
    from hotcold.planner.inputs import read_profile, uniform_stats

    rng = np.random.default_rng(9)
    cfg = tiny_cfg("qwen2_moe")
    stats = power_law_stats(cfg, rng)
    path = write_profile(tmp_path / "p", cfg, "fp-this", stats, predictors=True)
    got, meta = read_profile(path, cfg, "fp-this")
    assert [s.kind for s in got] == ["moe", "gated", "moe"]
    assert np.allclose(got[0].freq, stats[0].freq, atol=1e-6)
    assert got[1].predictor_params == 1000 and got[1].predicted_active_fraction == 0.5
    with pytest.raises(ArtifactError, match="made for another model"):
        read_profile(path, cfg, "fp-other")
    u = uniform_stats(cfg, 0.9)
    assert np.allclose(u[1].freq, 0.1) and np.allclose(u[0].freq.sum(), cfg.top_k)


# ------------------------------------------------------------------------------------------- probe
def test_probe_quick_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path))
    hw = probe(quick=True)
    assert hw.cpu_threads >= 1 and hw.ram_total_bytes > 0 and hw.thread_handoff_s > 0 and hw.cpu_call_s > 0
    assert hw.load_before is not None and hw.load_before >= 0  # the busy warning's evidence
    for kind in ("f32", "bf16", "f16", "i8"):
        assert hw.cpu_gather_Bps[kind] > 0 and hw.cpu_ffn_Bps[kind] > 0 and hw.cpu_dense_Bps[kind] > 0
        assert hw.cpu_gather_rows_per_s[kind] > 0
    assert set(hw.cpu_expert_Bps) == set(QKINDS) and min(hw.cpu_expert_Bps.values()) > 0
    # fixed costs: a layer's step over its bytes, a small product's over its bytes at the dense rate
    # (None: a machine too busy to tell the two depths apart; the cost model then counts calls)
    assert (hw.cpu_layer_s is None or 0 < hw.cpu_layer_s < 0.05) and 0 <= hw.cpu_matrix_fixed_s < 0.05
    assert hw.cpu_moe_layer_s is None or 0 < hw.cpu_moe_layer_s < 0.05
    assert 0 <= hw.cpu_sample_s < 0.05 and 0 <= hw.cpu_sample_logit_s < 1e-6
    import torch

    assert hw.cuda == torch.cuda.is_available()
    if not hw.cuda:
        assert hw.gpu_gemv_Bps is None and hw.roundtrip_s is None
    calls = []
    quiet = dataclasses.replace(hw, load_before=0.0)  # (this test's own probe may have met a busy moment)
    monkeypatch.setattr("hotcold.planner.probe.probe",
                        lambda quick=False, log=None, threads=None: calls.append(1) or quiet)
    a, path, measured = load_hardware(None)
    assert measured and path.is_file() and path.parent == tmp_path and path.name.startswith("hardware-")
    b, _, measured2 = load_hardware(None)
    assert not measured2 and b == a and len(calls) == 1
    load_hardware(None, force=True)
    assert len(calls) == 2
    assert read_hardware(path) == a
    # a profile measured with another CPU thread count than the run's is measured again
    _, _, measured_t = load_hardware(None, threads=a.cpu_threads + 1)
    assert measured_t and len(calls) == 3
    calls.pop()
    # a cached profile measured on a busy machine is kept while the machine is still busy, and measured
    # again (and replaced) once it is idle: its rates were too low for every plan made with them
    busy = dataclasses.replace(a, source="measured", cpu_threads=2, load_before=3.0)
    path.write_text(busy.to_json())
    monkeypatch.setattr("os.getloadavg", lambda: (2.5, 2.0, 2.0))
    c, _, measured3 = load_hardware(None, threads=2)
    assert not measured3 and c == busy and len(calls) == 2
    monkeypatch.setattr("os.getloadavg", lambda: (0.2, 1.0, 2.0))
    d, _, measured4 = load_hardware(None, threads=2)
    assert measured4 and d == a and len(calls) == 3 and read_hardware(path) == a


def test_probe_measures_with_the_runs_threads():
    """The probe's CPU kernels run with the thread count asked (default: what a run takes here), which
    the profile records; the caller's numba thread count is left as it was."""
    from hotcold.machine import default_threads
    from hotcold.planner.probe import run_threads
    from hotcold.sparse_ops.cpu import get_threads

    import torch

    assert run_threads() == default_threads(cuda=torch.cuda.is_available())
    before = get_threads()
    assert probe(quick=True, threads=1).cpu_threads == 1
    assert get_threads() == before


def test_best_of_two_probes():
    """A re-probe keeps the best rate and the shortest per-call time of each measurement (other work
    only slows a probe down), and ignores an older profile of another configuration."""
    old = toy_hw(cuda=False)
    old = dataclasses.replace(old, source="measured", load_before=3.0, cpu_threads=2, cpu_call_s=2e-6,
                              cpu_expert_Bps={"q4_0": 20e9, "q8_0": 1e9}, cpu_dense_Bps={"f32": 1e9})
    new = dataclasses.replace(old, load_before=0.1, cpu_call_s=9e-6, thread_handoff_s=1e-6,
                              cpu_expert_Bps={"q4_0": 1e9, "q8_0": 25e9}, cpu_dense_Bps={"f32": 30e9},
                              ram_available_bytes=123)
    best = new.best_of(old)
    assert best.cpu_expert_Bps == {"q4_0": 20e9, "q8_0": 25e9} and best.cpu_dense_Bps == {"f32": 30e9}
    assert best.cpu_call_s == 2e-6 and best.thread_handoff_s == min(old.thread_handoff_s, 1e-6)
    assert best.load_before == 0.1 and best.ram_available_bytes == 123  # the rest: the new probe's
    assert best.busy_warning() is None and old.busy_warning() is not None
    assert new.best_of(dataclasses.replace(old, cpu_threads=4)) == new  # another configuration
    assert new.best_of(dataclasses.replace(old, source="preset:h200")) == new
    assert preset("h200").gpu_gemv_Bps == 3.6e12


@pytest.mark.cuda
def test_probe_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    hw = probe(quick=True)
    assert hw.cuda and hw.gpu_gemv_Bps > 0 and hw.h2d_pinned_Bps > 0 and hw.roundtrip_s > 0 and hw.launch_s > 0
    assert hw.gpu_free_bytes > 0


# ------------------------------------------------------------------------------------------- CLI
def _cli(*args):
    from typer.testing import CliRunner

    from hotcold.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=True)


def test_cli_plan_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "160")
    from hotcold.models.loader import describe_model

    cfg_dict = dict(TINY["llama_relu"], num_hidden_layers=3, intermediate_size=96)
    model = make_model_folder(tmp_path, "tiny", cfg_dict)
    info = describe_model(model)
    # no profile yet: one clear line
    r = _cli("plan", model, "--vram", "300MiB", "--hardware", "h200")
    assert isinstance(r.exception, HotcoldError) and "run `hotcold profile" in str(r.exception)
    write_profile(tmp_path / "tiny.hotcold", info.config, info.fingerprint,
                  power_law_stats(info.config, np.random.default_rng(1)))
    hw_file = tmp_path / "toy.json"
    hw_file.write_text(toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6).to_json())
    r = _cli("plan", model, "--vram", "150KiB", "--workspace", "16KiB", "--hardware", hw_file, "--ctx", "128",
             "--explain")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "greedy" in r.output
    p = load_plan(tmp_path / "tiny.hotcold", info.fingerprint)
    meta = p.meta
    assert meta["mode"] == "hybrid" and meta["budget"]["ctx"] == 128 and p.mode == "hybrid"
    assert 0 < meta["bytes"]["gpu"]["total"] <= parse_size("150KiB")
    assert len(meta["layers"]) == 3 and meta["solver"]["name"] == "cbc" and meta["solver"]["status"] == "optimal"
    assert meta["hardware"]["file"] == str(hw_file)
    # the small budget holds hot neurons or CPU attentions' predictors (the planner weighs both)
    assert sum(p.gpu_count) < 3 * 96 and (sum(p.gpu_count) > 0 or p.predictor_gpu.any())
    assert [e["predictor"] == "gpu" for e in meta["layers"]] == p.predictor_gpu.tolist()
    assert "busy" not in r.output
    # a profile measured on a busy machine (a compile beside the probe) is said to be so, at every plan
    busy = tmp_path / "busy.json"
    busy.write_text(dataclasses.replace(toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6),
                                        source="measured", load_before=1.5).to_json())  # toy: 2 CPUs
    r = _cli("plan", model, "--vram", "150KiB", "--workspace", "16KiB", "--hardware", busy, "--ctx", "128",
             "--out", tmp_path / "busy-plan")
    flat = " ".join(r.output.split())  # the console wraps the line
    assert r.exit_code == 0 and "was busy when it was measured" in flat and "hotcold probe --force" in flat
    # ... against the CPUs of the machine it measured, not of the one planning: 1.5 is idle for 16
    idle16 = tmp_path / "idle16.json"
    idle16.write_text(dataclasses.replace(toy_hw(cpu_bw=0.5e9, rt=0.5e-6, handoff=0.2e-6), source="measured",
                                          cpu_threads=16, load_before=1.5).to_json())
    r = _cli("plan", model, "--vram", "150KiB", "--workspace", "16KiB", "--hardware", idle16, "--ctx", "128",
             "--out", tmp_path / "idle16-plan")
    assert r.exit_code == 0 and "busy" not in r.output
    # a budget for the whole model: all on the GPU; --vram 0: all on the CPU
    r = _cli("plan", model, "--vram", "1GiB", "--hardware", "h200", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["mode"] == "gpu"
    r = _cli("plan", model, "--vram", "0", "--hardware", "h200", "--solver", "highs")
    assert r.exit_code == 0 and load_plan(tmp_path / "tiny.hotcold").mode == "cpu"
    assert "GPU" not in r.output and "µs/layer" in r.output, r.output  # an all-CPU plan's tables: no GPU column
    # --uniform needs no profile; --out chooses the folder
    r = _cli("plan", model, "--vram", "1GiB", "--hardware", "rtx4090", "--uniform", "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["profile"]["source"] == "uniform"
    # a profile of another model is refused
    other = make_model_folder(tmp_path, "other", dict(cfg_dict, vocab_size=170))
    r = _cli("plan", other, "--vram", "1GiB", "--hardware", "h200", "--profile", tmp_path / "tiny.hotcold")
    assert isinstance(r.exception, ArtifactError) and "made for another model" in str(r.exception)
    # infeasible: one line with the minimum
    r = _cli("plan", model, "--vram", "10MiB", "--hardware", "h200")
    # (256 MiB workspace + the 512 MiB CUDA context the presets assume + two FFN layers' stream slots)
    assert isinstance(r.exception, BudgetError) and "--vram 769MiB or more" in str(r.exception)
    # no hardware profile yet for this machine: plan probes once and caches it
    monkeypatch.setattr("hotcold.planner.probe.probe", lambda quick=False, log=None, threads=None: toy_hw(cuda=False))
    r = _cli("plan", model, "--vram", "1GiB", "--ram", "4GiB")
    assert r.exit_code == 0, r.output
    assert list((tmp_path / "home").glob("hardware-*.json"))
    assert load_plan(tmp_path / "tiny.hotcold").mode == "cpu"  # this machine has no CUDA (toy profile)
    assert "no GPU" in r.output and "VRAM" not in r.output  # --vram 1GiB named no memory this machine has


def test_cli_probe_and_error_line(tmp_path, monkeypatch):
    from conftest import run_cli

    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path))
    monkeypatch.setattr("hotcold.planner.probe.probe", lambda quick=False, log=None, threads=None: toy_hw(cuda=False))
    r = _cli("probe")
    assert r.exit_code == 0, r.output
    assert "hardware profile" in r.output and list(tmp_path.glob("hardware-*.json"))
    r = _cli("probe", "--json")
    assert json.loads(r.output)["hostname"] == "toy"
    model = make_model_folder(tmp_path, "tiny", TINY["llama_relu"])
    p = run_cli("plan", model, "--vram", "1MiB", "--hardware", "h200", "--uniform", timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "GPU workspace" in p.stderr and "--vram 0" in p.stderr


# ------------------------------------------------------------------------------------------- scale
@pytest.mark.slow
def test_llama70b_shape_solves_quickly():
    """80 layers x 28672 neurons, the default block size and time limit: a plan in well under 10 s
    on a quiet machine (the bound here is loose: CI machines are shared)."""
    cfg = config_from_hf(dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_act="relu",
                              max_position_embeddings=8192))
    rng = np.random.default_rng(0)
    stats = power_law_stats(cfg, rng, alphas=rng.uniform(0.6, 1.1, 80), scale=100.0)
    req = PlanRequest(vram=40 * GiB, ram=400 * GiB, ctx=4096, fmt=weight_format("bf16"))
    t0 = time.perf_counter()
    r = make_plan(cfg, stats, preset("h200"), req)
    elapsed = time.perf_counter() - t0
    assert r.mode == "hybrid" and r.solve.status in ("optimal", "feasible")
    assert r.evaluation.gpu_total <= 40 * GiB
    assert elapsed < 30


# ------------------------------------------------------------------------------------------- quantised
def test_quantised_format_counts_host_blocks_and_their_kernel_rate():
    """A quantised model: GPU bytes as the dtype (dequantised there), host bytes as blocks (gate/up of
    the type, W_down Q8_0), CPU time at the probe's rate for that block type."""
    from hotcold.planner.weight_format import quantize_format

    rng = np.random.default_rng(3)
    cfg = tiny_cfg("llama_relu", intermediate_size=64)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    hw.cpu_ffn_Bps["q4_0"] = 0.5e9
    hw.cpu_dense_Bps["q4_0"] = 0.7e9
    bf, q = weight_format("bf16"), quantize_format(weight_format("bf16"), "q4_0")
    assert q.host_ffn_w == pytest.approx((2 * 18 / 32 + 34 / 32) / 3) and q.host_w == pytest.approx(18 / 32)
    cb = build_costs(cfg, stats, hw, bf, ctx=64, block_size=8, constants=TOY_CONSTANTS)
    cq = build_costs(cfg, stats, hw, q, ctx=64, block_size=8, constants=TOY_CONSTANTS)
    for lb, lq in zip(cb.layers, cq.layers):
        np.testing.assert_allclose(lq.unit_bytes, lb.unit_bytes)  # the GPU side is the dtype
        np.testing.assert_allclose(lq.unit_host_bytes, lb.unit_bytes * q.host_ffn_w / 2)
        np.testing.assert_allclose(lq.unit_cpu_s, lb.unit_cpu_s * (q.host_ffn_w / 2) * (hw.cpu_ffn("bf16") / 0.5e9))
        assert lq.attn_host_bytes == pytest.approx(lb.attn_bytes * q.host_w / 2)
    cpu_b, cpu_q = (evaluate(c, Placement.all_cpu(c)).cpu_bytes for c in (cb, cq))
    assert cpu_q["ffn"] == pytest.approx(cpu_b["ffn"] * q.host_ffn_w / 2)
    assert cpu_q["embedding"] == pytest.approx(cpu_b["embedding"] * q.host_w / 2)


def test_quantised_ilp_matches_brute_force_with_a_binding_ram_budget():
    """Host and GPU bytes now differ per unit: the ILP's host constraint must use the host ones."""
    from hotcold.planner.weight_format import quantize_format

    rng = np.random.default_rng(11)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=2)
    hw = toy_hw()
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 1e9
    checked = 0
    for trial in range(3):
        stats = power_law_stats(cfg, rng)
        costs = build_costs(cfg, stats, hw, quantize_format(weight_format("bf16"), "q4_0"), ctx=64, block_size=8,
                            constants=TOY_CONSTANTS)
        full_host = evaluate(costs, Placement.all_cpu(costs)).cpu_total
        vram = costs.gpu_fixed_bytes + 0.4 * (model_bytes(costs) - costs.gpu_fixed_bytes)
        ram = 0.7 * full_host
        best = _brute_force(costs, vram, ram)
        res = solve(costs, vram, ram, solver="cbc", gap=0.0, time_limit=20)
        if best is None:
            assert res.status == "infeasible"
            continue
        ev = evaluate(costs, res.placement)
        assert ev.time_s == pytest.approx(best, rel=1e-6) and ev.cpu_total <= ram and ev.gpu_total <= vram
        checked += 1
    assert checked >= 2


def test_gpu_int4_counts_int4_bytes_for_gpu_attention_and_places_more_of_it():
    """--gpu-int4: the GPU's attention bytes are int4's (codes + bf16 scale/zero per 32), their time
    at the int4 kernel's share of the GEMV bandwidth; the hot FFN rows' up/gate too (W_down's
    columns stay the dtype: INT4_DOWN_DEFAULT), the LM head stays the dtype. With a budget that
    holds the int4 attention of every layer but not the bf16 one, the plan puts more attention on
    the GPU."""
    from hotcold.planner.weight_format import INT4_GPU_BYTES_PER_WEIGHT, INT4_GPU_SPEED, quantize_format

    rng = np.random.default_rng(5)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=4)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 1e9
    plain, int4 = (quantize_format(weight_format("bf16"), "q4_0", gpu_int4=g) for g in (False, True))
    assert int4.gpu_attn_w == pytest.approx(INT4_GPU_BYTES_PER_WEIGHT) and int4.gpu_attn_speed == INT4_GPU_SPEED
    assert quantize_format(weight_format("bf16"), "q8_0", gpu_int4=True).gpu_attn_w == 2.0  # not a 4-bit type
    cp, ci = (build_costs(cfg, stats, hw, f, ctx=64, block_size=8, constants=TOY_CONSTANTS) for f in (plain, int4))
    for lp, li in zip(cp.layers, ci.layers):
        assert li.attn_bytes == pytest.approx(lp.attn_bytes * INT4_GPU_BYTES_PER_WEIGHT / 2)
        np.testing.assert_allclose(li.unit_bytes, lp.unit_bytes * (2 * INT4_GPU_BYTES_PER_WEIGHT + 2) / 6)
        np.testing.assert_allclose(li.unit_host_bytes, lp.unit_host_bytes)
        assert li.attn_host_bytes == pytest.approx(lp.attn_host_bytes)
    # --quantize q4_0 quantises the (untied) LM head too: int4 on the GPU, at int4's speed; a file's
    # head of another type (often Q6_K) or a tied one (the embedding's table) stays the dtype
    assert not cfg.tie_word_embeddings and int4.gpu_head_int4 and not plain.gpu_head_int4
    assert ci.head_bytes == pytest.approx(cp.head_bytes * INT4_GPU_BYTES_PER_WEIGHT / 2)
    assert ci.head_gpu_s - cp.head_gpu_s == pytest.approx((ci.head_bytes / INT4_GPU_SPEED - cp.head_bytes)
                                                          / hw.gpu_gemv_Bps)
    tied = build_costs(tiny_cfg("llama_relu", num_hidden_layers=4, tie_word_embeddings=True), stats, hw, int4,
                       ctx=64, block_size=8, constants=TOY_CONSTANTS)
    assert tied.head_bytes == pytest.approx(cp.head_bytes)
    # room for the fixed parts, the int4 attention of every layer and little else
    vram = ci.gpu_fixed_bytes + ci.head_bytes + sum(l.attn_bytes + l.kv_bytes for l in ci.layers) * 1.05
    on_gpu = []
    for costs in (cp, ci):
        res = solve(costs, vram, 1e12, solver="cbc", gap=0.0, time_limit=20)
        on_gpu.append(sum(res.placement.attn_gpu))
    assert on_gpu[1] > on_gpu[0]


def test_gpu_int4_counts_hot_ffn_rows_int4_and_places_more_hot_neurons():
    """--gpu-int4 and the hot FFN rows: up/gate at int4's bytes and speed, W_down's columns at the
    dtype's (not requantised: INT4_DOWN_DEFAULT). A budget that holds N int4 hot neurons per layer
    beside the attention holds fewer bf16 ones: the int4 plan places more hot neurons, about the
    byte ratio more."""
    from hotcold.planner.weight_format import (INT4_GPU_BYTES_PER_WEIGHT, INT4_GPU_SPEED, gpu_int4_format,
                                               quantize_format)
    from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT

    assert not INT4_DOWN_DEFAULT  # the counts below assume W_down's hot columns in the dtype
    rng = np.random.default_rng(6)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=4, intermediate_size=64)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw(cpu_bw=0.05e9)  # a slow CPU: every byte the budget allows goes to the GPU
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 0.05e9
    plain = quantize_format(weight_format("bf16"), "q4_0")
    full = quantize_format(weight_format("bf16"), "q4_0", gpu_int4=True)
    int4 = gpu_int4_format(plain, 0.0, 1.0)  # the hot rows alone: attention in the dtype in both plans
    for f in (full, int4):
        assert f.gpu_int4 and f.gpu_ffn_w == pytest.approx(INT4_GPU_BYTES_PER_WEIGHT)
        assert f.gpu_ffn_speed == pytest.approx(INT4_GPU_SPEED) and f.gpu_down_w == 2.0 and f.gpu_down_speed == 1.0
    assert int4.gpu_attn_w == 2.0 and not plain.gpu_int4
    cp, ci = (build_costs(cfg, stats, hw, f, ctx=64, block_size=8, constants=TOY_CONSTANTS) for f in (plain, int4))
    h, ratio = cfg.hidden_size, (2 * INT4_GPU_BYTES_PER_WEIGHT + 2) / 6
    for lp, li in zip(cp.layers, ci.layers):
        rows = np.diff(lp.starts)
        np.testing.assert_allclose(lp.unit_bytes, rows * 3 * h * 2)
        np.testing.assert_allclose(li.unit_bytes, lp.unit_bytes * ratio)
        t = rows * (2 * h * INT4_GPU_BYTES_PER_WEIGHT / INT4_GPU_SPEED + h * 2) / hw.gpu_gemv_Bps
        np.testing.assert_allclose(li.unit_gpu_s, t)
        assert li.attn_bytes == lp.attn_bytes and li.pred_bytes == lp.pred_bytes
        np.testing.assert_allclose(li.unit_host_bytes, lp.unit_host_bytes)
    n = 32  # int4 hot neurons per layer the budget holds beside everything else on the GPU
    vram = (ci.gpu_fixed_bytes + ci.head_bytes + sum(l.attn_bytes + l.kv_bytes + l.pred_bytes for l in ci.layers)
            + cfg.num_layers * n * 3 * h * 2 * ratio * 1.01)
    hot = []
    for costs in (cp, ci):
        res = solve(costs, vram, 1e12, solver="cbc", gap=0.0, time_limit=20)
        ev = evaluate(costs, res.placement)
        assert ev.gpu_total <= vram and all(res.placement.attn_gpu) and res.placement.head_gpu
        hot.append([len(res.placement.gpu_items(costs, l)) for l in range(cfg.num_layers)])
    assert sum(hot[1]) == cfg.num_layers * n  # every block the budget holds
    assert sum(hot[0]) <= sum(hot[1]) * ratio + 8 * cfg.num_layers  # bf16: about ratio as many
    assert sum(hot[1]) > 1.5 * sum(hot[0])


def test_gpu_int4_whole_layers_cost_their_int4_bytes_when_every_neuron_is_hot():
    """--gpu-int4 on a model whose FFN matrices are all 4-bit: with every block of a layer on the GPU,
    its FFN counts as kept int4 whole (W_down too: 0.625 bytes a weight at int4's speed) instead of
    the hot rows' sums (W_down's columns in bf16); the ILP's options and evaluate agree; a budget
    that holds every layer whole but not split gets every neuron on the GPU, where the format
    without whole layers leaves some on the CPU."""
    import dataclasses

    from hotcold.planner.weight_format import INT4_GPU_BYTES_PER_WEIGHT, INT4_GPU_SPEED, quantize_format
    from hotcold.planner.ilp import prefix_options

    rng = np.random.default_rng(7)
    cfg = tiny_cfg("llama_relu", num_hidden_layers=4, intermediate_size=64)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw(cpu_bw=0.05e9)
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 0.05e9
    whole = quantize_format(weight_format("bf16"), "q4_0", gpu_int4=True)
    split = dataclasses.replace(whole, gpu_whole_int4=False)
    assert whole.whole_int4(3) and not split.whole_int4(3)
    assert dataclasses.replace(whole, gpu_whole_int4=frozenset({1})).whole_int4(1)
    cw, cs = (build_costs(cfg, stats, hw, f, ctx=64, block_size=8, constants=TOY_CONSTANTS) for f in (whole, split))
    h, i = cfg.hidden_size, cfg.intermediate_size
    for lw, ls in zip(cw.layers, cs.layers):
        assert ls.whole_bytes is None and lw.whole_bytes == pytest.approx(i * 3 * h * INT4_GPU_BYTES_PER_WEIGHT)
        assert lw.whole_gpu_s == pytest.approx(lw.whole_bytes / INT4_GPU_SPEED / hw.gpu_gemv_Bps)
        assert lw.whole_bytes < 0.6 * lw.unit_bytes.sum()  # W_down at 0.625 bytes instead of 2
        np.testing.assert_allclose(lw.unit_bytes, ls.unit_bytes)  # partial layers: unchanged
        for a, t, gb, hb in prefix_options(lw):
            for n in (lw.n_units - 1, lw.n_units):
                on = np.arange(lw.n_units) < n
                p = Placement("hybrid", [a == 1] * 4, [on] * 4, True, [a >= 1] * 4)
                le = evaluate(cw, p).layers[lw.layer]
                assert le.t_s == pytest.approx(t[n]) and sum(le.gpu_bytes.values()) == pytest.approx(gb[n])
        assert prefix_options(lw)[1][2][-1] < prefix_options(lw)[1][2][-2]  # all blocks: fewer bytes than all but one
    vram = (cw.gpu_fixed_bytes + cw.head_bytes + sum(l.attn_bytes + l.kv_bytes + l.whole_bytes for l in cw.layers)
            + 2048)  # (the ILP keeps 1 KiB below the budget)
    hot = []
    for costs in (cw, cs):
        res = solve(costs, vram, 1e12, solver="cbc", gap=0.0, time_limit=20)
        ev = evaluate(costs, res.placement)
        assert ev.gpu_total <= vram
        hot.append(sum(len(res.placement.gpu_items(costs, l)) for l in range(cfg.num_layers)))
    assert hot[0] == cfg.num_layers * i and hot[1] < hot[0]
    # greedy agrees: completing a layer releases the difference
    g = evaluate(cw, greedy(cw, vram))
    assert g.gpu_total <= vram and sum(g.gpu_bytes.values()) == g.gpu_total


def test_gpu_int4_experts_cost_their_int4_bytes():
    """--gpu-int4 on a model whose experts are 4-bit: a GPU expert counts 0.625 bytes a weight (gate, up
    and down; or gate and up alone where down is not 4-bit) at the expert kernels' int4 speed; the host
    side is unchanged; a budget holds about 3.2x the experts it holds in bf16."""
    import dataclasses

    from hotcold.planner.weight_format import INT4_EXPERT_SPEED, INT4_GPU_BYTES_PER_WEIGHT, quantize_format

    rng = np.random.default_rng(11)
    cfg = tiny_cfg("qwen2_moe", num_hidden_layers=3, intermediate_size=16, num_experts=16)
    stats = power_law_stats(cfg, rng)
    hw = toy_hw()
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 2e9
    q4 = quantize_format(weight_format("bf16"), "q4_0", gpu_int4=True)
    plain = quantize_format(weight_format("bf16"), "q4_0")
    gate_up = dataclasses.replace(q4, gpu_experts_down_int4=frozenset())
    assert q4.experts_int4(0) == (True, True) and plain.experts_int4(0) == (False, False)
    assert gate_up.experts_int4(2) == (True, False) and gate_up.gpu_int4
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    costs = {k: build_costs(cfg, stats, hw, f, ctx=64, block_size=8, constants=TOY_CONSTANTS)
             for k, f in (("q4", q4), ("plain", plain), ("gate_up", gate_up))}
    b4 = INT4_GPU_BYTES_PER_WEIGHT
    for l in range(cfg.num_layers):
        lq, lp, lg = (costs[k].layers[l] for k in ("q4", "plain", "gate_up"))
        if lq.kind != "moe":
            continue
        np.testing.assert_allclose(lp.unit_bytes, 3 * h * inter * 2.0)
        np.testing.assert_allclose(lq.unit_bytes, 3 * h * inter * b4)
        np.testing.assert_allclose(lg.unit_bytes, h * inter * (2 * b4 + 2.0))
        np.testing.assert_allclose(lq.unit_host_bytes, lp.unit_host_bytes)
        # time: the int4 bytes at the kernels' share of the GEMV rate (the launches are per layer, the same in both)
        extra = lq.unit_gpu_s - lp.unit_gpu_s
        q = lp.unit_gpu_s / (3 * h * inter * 2.0 / hw.gpu_gemv_Bps)
        assert lq.ffn_gpu_fixed_s == lp.ffn_gpu_fixed_s == TOY_CONSTANTS.moe_gpu_kernels * hw.launch_s
        np.testing.assert_allclose(extra, q * 3 * h * inter * (b4 / INT4_EXPERT_SPEED - 2.0) / hw.gpu_gemv_Bps,
                                   rtol=1e-9, atol=1e-15)
    n_moe = sum(l.kind == "moe" for l in costs["q4"].layers)
    held = {}
    for k in ("plain", "q4"):  # each format's own fixed bytes (4-bit experts add their decode group's workspace)
        fixed = costs[k].gpu_fixed_bytes + costs[k].head_bytes + sum(l.attn_bytes + l.kv_bytes + l.pred_bytes
                                                                     for l in costs[k].layers)
        vram = fixed + n_moe * 2 * 3 * h * inter * 2.0 + 8192  # two bf16 experts a MoE layer, or 6 int4 ones
        p = solve(costs[k], vram, 1e12, solver="cbc", gap=0.0, time_limit=20).placement
        held[k] = sum(len(p.gpu_items(costs[k], l)) for l in range(cfg.num_layers) if costs[k].layers[l].kind == "moe")
    assert held["plain"] <= 2 * n_moe and held["q4"] >= 3 * held["plain"]


def test_cpu_experts_cost_the_probes_expert_rate():
    """Quantised CPU experts are read at the probe's whole-expert rate (qexperts) where it has one,
    at its FFN rate where not; float experts (the FFN kernel) always at the FFN rate."""
    from hotcold.planner.weight_format import quantize_format

    rng = np.random.default_rng(12)
    cfg = tiny_cfg("qwen2_moe", num_hidden_layers=2, intermediate_size=16, num_experts=8)
    stats = power_law_stats(cfg, rng)
    q4 = quantize_format(weight_format("bf16"), "q4_0", moe=True)
    hw = toy_hw(call=0.0)
    hw.cpu_ffn_Bps["q4_0"] = hw.cpu_dense_Bps["q4_0"] = 2e9

    def cpu_s(hw, fmt):
        c = build_costs(cfg, stats, hw, fmt, ctx=64, block_size=8, constants=TOY_CONSTANTS)
        return np.concatenate([l.unit_cpu_s for l in c.layers if l.kind == "moe"])

    by_ffn = cpu_s(hw, q4)
    hw.cpu_expert_Bps["q4_0"] = 8e9
    assert hw.cpu_expert("q4_0") == 8e9 and hw.cpu_expert("bf16") == hw.cpu_ffn("bf16")
    np.testing.assert_allclose(cpu_s(hw, q4), by_ffn / 4, rtol=1e-12)
    bf = weight_format("bf16")  # float experts: the FFN rate, whatever the q4_0 experts measured
    np.testing.assert_allclose(cpu_s(hw, bf), cpu_s(toy_hw(call=0.0), bf), rtol=1e-12)


def test_gguf_format_counts_4_bit_experts(tmp_path):
    """A MoE GGUF whose expert stacks are Q4_0: `--gpu-int4` keeps every layer's GPU experts int4 (gate/up
    and down), and plan.json says so per layer; without it they are expanded."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import argparse

    import make_model as mm

    from hotcold.planner.inputs import model_format

    spec = mm.build_spec("tiny-qwen3-moe", argparse.Namespace(**{k: None for k in mm.OVERRIDES}))
    mm.generate(spec, tmp_path / "m", dtype="q4_0", progress=False, force=True, preset="tiny-qwen3-moe",
                calib_tokens=64, formats=("gguf",))
    path = tmp_path / "m" / "model.gguf"
    f4, f = (model_format(path, weight_format("bf16"), gpu_int4=g) for g in (True, False))
    assert f4.gpu_experts_int4 == f4.gpu_experts_down_int4 == frozenset(range(spec.layers))
    assert f.experts_int4(0) == (False, False)
    # CPU experts keep the file's W_down (no Q8_0 transposed copy): host bytes are the file's Q4_0
    assert f.host_ffn_w == pytest.approx(18 / 32)
    assert quantize_format(weight_format("bf16"), "q4_0", moe=True).host_ffn_w == pytest.approx(18 / 32)
    r = _cli("plan", path, "--uniform", "--vram", "1GiB", "--hardware", "h200", "--gpu-int4", "--out", tmp_path / "p",
             "--json")
    assert r.exit_code == 0, r.output
    layers = json.loads(r.output)["layers"]
    assert [x["experts_int4"] for x in layers] == [["gate", "up", "down"]] * spec.layers


def test_gguf_format_from_the_file(tmp_path, monkeypatch):
    """SmolLM2 Q4_1: FFN host bytes = two Q4_1 matrices + W_down as Q8_0 per three weights; `plan`
    says so in plan.json and counts them; --quantize is refused for a GGUF and for an unknown type."""
    from conftest import smollm2_gguf
    from hotcold.models.gguf_loader import GGUFFile
    from hotcold.planner.inputs import model_format

    path = smollm2_gguf()
    types = {t for n, t, *_ in GGUFFile(path).tensor_storage() if ".ffn." in n}
    assert types == {"Q4_1"}
    fmt = model_format(path, weight_format("bf16"))
    assert fmt.cpu_kind == "q4_1" and fmt.bytes_per_weight == 2.0
    assert fmt.host_ffn_w == pytest.approx((2 * 20 / 32 + 34 / 32) / 3)
    # the attention's Q4_1 apart from the (tied) Q8_0 embedding, which is also the LM head's bytes
    assert fmt.host_w == pytest.approx(20 / 32) and fmt.host_embed_w == pytest.approx(34 / 32)
    # --gpu-int4: every attention matrix is Q4_1, kept int4 on the GPU
    from hotcold.planner.weight_format import INT4_GPU_BYTES_PER_WEIGHT

    f4 = model_format(path, weight_format("bf16"), gpu_int4=True)
    assert f4.gpu_attn_w == pytest.approx(INT4_GPU_BYTES_PER_WEIGHT, rel=0.01) and fmt.gpu_attn_w == 2.0
    # ... and so are the FFNs' up/gate: the hot rows stay int4, W_down's columns are expanded
    assert f4.gpu_ffn_w == pytest.approx(INT4_GPU_BYTES_PER_WEIGHT) and f4.gpu_down_w == fmt.gpu_ffn_w == 2.0
    # ... and an all-hot layer's whole FFN (up, gate and down all Q4_1) stays int4
    n_layers = len({n.split(".")[1] for n, *_ in GGUFFile(path).tensor_storage() if n.startswith("layers.")})
    assert f4.gpu_whole_int4 == frozenset(range(n_layers)) and fmt.gpu_whole_int4 is False
    assert not f4.gpu_head_int4  # tied: the LM head is the Q8_0 embedding's table
    # Gemma 3 Q4_K_M: up/gate are Q5_0 (no int4 kernel), W_down Q4_K or Q6_K: no layer whole
    from conftest import gemma3_gguf

    assert model_format(gemma3_gguf(), weight_format("bf16"), gpu_int4=True).gpu_whole_int4 == frozenset()
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    r = _cli("plan", path, "--uniform", "--vram", "0", "--hardware", "h200", "--out", tmp_path / "p", "--json")
    assert r.exit_code == 0, r.output
    meta = json.loads(r.output)
    assert meta["weights"]["format"] == "q4_1/bf16" and meta["weights"]["cpu_kind"] == "q4_1"
    from hotcold.models.loader import describe_model

    cfg = describe_model(path).config
    ffn_weights = cfg.num_layers * 3 * cfg.hidden_size * cfg.intermediate_size
    assert meta["bytes"]["cpu"]["ffn"] == pytest.approx(ffn_weights * fmt.host_ffn_w, rel=1e-6)
    assert meta["bytes"]["cpu"]["embedding"] == pytest.approx(cfg.vocab_size * cfg.hidden_size * 34 / 32, rel=1e-6)
    assert not meta["weights"]["gpu_int4"] and meta["weights"]["gpu_ffn_bytes_per_weight"] == 2.0
    # plan.json says what --gpu-int4 counted (`run` follows it: executors/from_plan.py)
    r = _cli("plan", path, "--uniform", "--vram", "0", "--hardware", "h200", "--gpu-int4", "--out", tmp_path / "p4",
             "--json")
    assert r.exit_code == 0, r.output
    w4 = json.loads(r.output)["weights"]
    assert w4["gpu_int4"] and not w4["gpu_int4_down"] and w4["format"] == "q4_1/bf16+int4"
    assert w4["gpu_ffn_bytes_per_weight"] == pytest.approx(INT4_GPU_BYTES_PER_WEIGHT)
    assert w4["gpu_down_bytes_per_weight"] == 2.0
    r = _cli("plan", path, "--uniform", "--vram", "0", "--hardware", "h200", "--quantize", "q8_0")
    assert isinstance(r.exception, HotcoldError) and "GGUF" in str(r.exception)
    r = _cli("plan", path, "--uniform", "--vram", "0", "--hardware", "h200", "--quantize", "q3")
    assert isinstance(r.exception, HotcoldError) and "--quantize" in str(r.exception)


def test_run_dtype_on_the_cpu_follows_a_half_precision_checkpoint(tmp_path):
    """`run` on the CPU computes a float16 / bfloat16 checkpoint in its own dtype (float32 would read
    twice the bytes per token and take twice the RAM), a float32 one in float32; --dtype wins; a
    dense open of the float16 folder really loads float16 weights."""
    import torch
    import transformers as T

    from hotcold.executors.from_plan import open_for_run, run_dtype
    from tiny_models import tiny_configs

    cpu = torch.device("cpu")
    folders = {}
    for name, dt in (("f16", torch.float16), ("bf16", torch.bfloat16), ("f32", torch.float32)):
        torch.manual_seed(0)
        m = T.AutoModelForCausalLM.from_config(tiny_configs()["llama"]).to(dt)
        m.save_pretrained(tmp_path / name)
        folders[name] = tmp_path / name
    assert run_dtype(folders["f16"], None, cpu) == torch.float16
    assert run_dtype(folders["bf16"], "auto", cpu) == torch.bfloat16
    assert run_dtype(folders["f32"], None, cpu) == torch.float32
    assert run_dtype(folders["f16"], "float32", cpu) == torch.float32
    assert run_dtype(folders["f16"], None, torch.device("cuda")) == torch.bfloat16  # the GPU default is unchanged
    setup = open_for_run(folders["f16"], device="cpu")
    assert setup.lm.dtype == torch.float16 and setup.lm.model.layers[0].ffn.up.weight.dtype == torch.float16


def test_open_for_run_notes_host_functions_that_had_to_be_compiled(tmp_path, monkeypatch):
    """A run whose host functions take long to build (numba's cache cold: a first run) says so once
    in its notes; one that builds them quickly (loaded from the cache) does not. The build is timed
    around make_hybrid: the CPU plan's layers step as compiled calls (LayerHostNode). A run with
    another CPU thread count than the plan's hardware profile measured with is told so too."""
    import torch
    import transformers as T

    from hotcold.executors import from_plan
    from hotcold.executors import host_node as hn
    from tiny_models import tiny_configs

    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    torch.manual_seed(0)
    model = tmp_path / "tiny"
    T.AutoModelForCausalLM.from_config(tiny_configs()["llama"]).save_pretrained(model)
    # a machine without per-call costs: the tiny model's predictors pay, so the plan splits its layers
    hw_file = tmp_path / "nocalls.json"
    hw_file.write_text(toy_hw(cpu_bw=0.5e9, call=0.0, handoff=0.0).to_json())
    r = _cli("plan", model, "--uniform", "--vram", "0", "--hardware", hw_file, "--out", tmp_path / "p")
    assert r.exit_code == 0, r.output
    assert not load_plan(tmp_path / "p").splits_nothing
    notes = {}
    for limit in (0.0, 1e9):
        monkeypatch.setattr(hn, "_CFUNCS", {})  # built again in this process (from numba's disk cache)
        monkeypatch.setattr(from_plan, "COMPILE_NOTE_S", limit)
        setup = from_plan.open_for_run(model, tmp_path / "p", device="cpu")
        notes[limit] = [n for n in setup.notes if "compiled the CPU kernels" in n]
        assert any(getattr(b, "use_node", False) for b in setup.lm.model.layers)
        setup.close()
    assert len(notes[0.0]) == 1 and re.search(r"in \d+ s; later runs load them", notes[0.0][0])
    assert notes[1e9] == []
    # a run with another thread count than the profile measured (toy: 2) is told its prediction is off
    for threads, said in ((2, False), (1, True)):
        setup = from_plan.open_for_run(model, tmp_path / "p", device="cpu", threads=threads)
        assert any("measured with 2 threads and this run takes 1" in n for n in setup.notes) == said
        setup.close()
