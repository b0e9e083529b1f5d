"""Input sparsity (TEAL): the input-major kernel against dense products, the greedy allocation against
brute force, the thresholded model against HF transformers with the same inputs zeroed by hooks, the
fused quantised step against the module path, and the profile -> run round trip."""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import hotcold.models.cpu_run as cpu_run
import hotcold.models.transformer as transformer
from hotcold.executors.input_sparse import apply_input_sparsity
from hotcold.models.loader import load_model
from hotcold.models.quantized import dequantize_model, quantize_model
from hotcold.models.transformer import KVCache
from hotcold.profiler.input_sparsity import (GROUPS, LayerAllocations, Magnitudes, greedy_allocation, group_params,
                                             thresholded)
from hotcold.sparse_ops.input_sparse import im_gemv, input_major, sparse_linear_torch
from hotcold.sparse_ops.quant import QuantMatrix, pack_rows
from conftest import run_cli
from tiny_models import add_tiny_tokenizer, make_tiny

RNG = np.random.default_rng(0)


def _x(cols: int) -> np.ndarray:
    x = RNG.standard_normal(cols).astype(np.float32)
    x[RNG.integers(0, cols, 3)] *= 20  # a few outlier channels, as hidden states have
    x[:5] = 0.0  # exact zeros are skipped at threshold 0 too
    return x


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows, cols", [(64, 96), (600, 256), (1030, 64)])
@pytest.mark.parametrize("packed", [False, True])
def test_quantised_kernel_equals_the_dense_product(qtype, rows, cols, packed):
    """The float32 kinds: exact weights (the file's codes, scales and offsets, read back whole) and the
    product of the thresholded input within float32 summation noise, for any threshold; the counter
    counts the kept inputs. (The integer kinds: tests/test_input_sparse_int.py.)"""
    m = QuantMatrix.quantize(RNG.standard_normal((rows, cols)).astype(np.float32), qtype)
    if packed:
        m = pack_rows(m, xq=True)
    w = m.dequantize().astype(np.float64)
    x = _x(cols)
    for thr in (0.0, 0.3, float(np.quantile(np.abs(x), 0.7)), 1e9):
        im = input_major(m, thr, integer=False)
        assert np.array_equal(im.dense(), m.dequantize())
        xs = np.where(np.abs(x) > thr, x, 0.0)
        want = w @ xs
        got = im_gemv(im, x)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), (qtype, thr)
        assert im.counter.tolist() == [int((np.abs(x) > thr).sum()), cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_kernel_equals_the_dense_product(dtype):
    w = torch.randn(300, 160).to(dtype)
    x = _x(160)
    for thr in (0.0, 0.8):
        im = input_major(w, thr)
        got = im_gemv(im, x)
        want = w.double().numpy() @ np.where(np.abs(x) > thr, x, 0.0)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        # the torch form (the GPU's reference path) computes the same product
        ref = sparse_linear_torch(torch.from_numpy(x), w.float(), thr)
        assert torch.allclose(ref.double(), torch.from_numpy(want), rtol=1e-4, atol=1e-4)


def test_formats_without_an_input_major_form():
    m = QuantMatrix.quantize(RNG.standard_normal((64, 64)).astype(np.float32), "Q5_0")
    assert input_major(m, 0.1) is None
    assert input_major(torch.randn(8, 32, dtype=torch.bfloat16), 0.1) is None
    odd = QuantMatrix.quantize(RNG.standard_normal((63, 64)).astype(np.float32), "Q4_0")
    assert input_major(odd, 0.1, integer=False) is None  # 4-bit float32-kind codes pair rows
    assert input_major(QuantMatrix.quantize(RNG.standard_normal((63, 64)).astype(np.float32), "Q8_0"), 0.1) is not None


@pytest.mark.parametrize("levels", [(0.25, 0.5, 0.75)])
def test_greedy_allocation_equals_brute_force_on_a_separable_convex_error(levels):
    """With equal weights and an error that is a sum of convex per-group terms, taking the cheapest
    raise each step is optimal: at each level the greedy allocation has the least error of every
    allocation on the step grid with as many steps."""
    cost = {"a": 1.0, "b": 3.0, "c": 0.5, "d": 2.0}
    power = {"a": 2.0, "b": 1.5, "c": 3.0, "d": 2.0}

    def error(alloc):
        return sum(cost[g] * alloc[g] ** power[g] for g in alloc)

    step = 0.125
    got = greedy_allocation(error, {g: 1.0 for g in cost}, levels, step, cap=1.0)
    grid = [i * step for i in range(9)]
    for level in levels:
        n = round(level * 4 / step)  # steps to reach the level with equal weights
        best = min(error(dict(zip(cost, a))) for a in itertools.product(grid, repeat=4)
                   if round(sum(a) / step) == n)
        assert sum(got[level].values()) == pytest.approx(level * 4)
        assert error(got[level]) == pytest.approx(best)


def test_greedy_allocation_weights_the_level_by_parameters():
    got = greedy_allocation(lambda a: a["big"] * 10 + a["small"], {"big": 3.0, "small": 1.0}, (0.1, 0.3), 0.1, cap=0.9)
    assert got[0.1]["small"] > 0 and (3 * got[0.3]["big"] + got[0.3]["small"]) / 4 >= 0.3 - 1e-9
    assert 0.5 not in greedy_allocation(lambda a: 0.0, {"x": 1.0}, (0.5,), 0.1, cap=0.4)


def test_greedy_allocation_resumes_where_a_lower_level_stopped():
    """Advancing level by level from the allocation returned for the previous one gives what one
    search over all levels gives, with an error whose groups interact."""
    def error(a):
        return (a["a"] + 2 * a["b"]) ** 2 + a["c"] * a["a"] * 3 + a["d"] ** 1.5 + 0.5 * a["c"] ** 2

    weights = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0}
    levels = (0.1, 0.2, 0.3, 0.45)
    whole = greedy_allocation(error, weights, levels, 0.05, cap=0.9)
    start = None
    for level in levels:
        start = greedy_allocation(error, weights, (level,), 0.05, cap=0.9, start=start)[level]
        assert start == whole[level]


def test_layer_allocations_equal_each_blocks_own_greedy_search(tmp_path):
    """LayerAllocations (blocks side by side on worker threads, each level resumed from the last)
    against each block's greedy search over both levels at once, run here in order."""
    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    model = lm.model
    seqs = torch.randint(3, 160, (2, 16), generator=torch.Generator().manual_seed(5))
    mags = Magnitudes(model)
    with mags.recording(), torch.inference_mode():
        model(seqs)
    allocations = LayerAllocations(model, seqs, mags)
    got = {s: allocations.advance(s) for s in (0.1, 0.3)}
    positions = torch.arange(seqs.shape[1])
    with torch.inference_mode():
        x = model.embed_tokens(seqs, positions)
        for l, block in enumerate(model.layers):
            dense = block(x, positions, None)

            def error(alloc):
                with thresholded(model, {l: {g: mags.threshold(l, g, s) for g, s in alloc.items()}}):
                    y = block(x, positions, None)
                return float(((y - dense) ** 2).sum())

            want = greedy_allocation(error, group_params(block), (0.1, 0.3))
            assert [got[0.1][l], got[0.3][l]] == [want[0.1], want[0.3]], l
            x = dense
    assert allocations.advance(0.99) is None  # beyond every group's cap


def _thresholds(model, rng_seed: int = 0) -> dict[int, dict[str, float]]:
    g = torch.Generator().manual_seed(rng_seed)
    return {l: {grp: float(0.02 + 0.3 * torch.rand(1, generator=g)) for grp in GROUPS}
            for l in range(len(model.layers))}


def _hf_hooks(hf, thresholds):
    """Forward pre-hooks on HF's projections zeroing their inputs at or below the thresholds."""
    def zero(t):
        return lambda mod, args: (args[0] * (args[0].abs() > t),)
    handles = []
    for l, layer in enumerate(hf.model.layers):
        a, f = layer.self_attn, layer.mlp
        for grp, mods in {"qkv": [a.q_proj, a.k_proj, a.v_proj], "o": [a.o_proj],
                          "gate_up": [f.gate_proj, f.up_proj], "down": [f.down_proj]}.items():
            handles += [m.register_forward_pre_hook(zero(thresholds[l][grp])) for m in mods]
    return handles


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_thresholded_model_equals_hf_with_inputs_zeroed(tmp_path, family):
    """Prefill and one-token decode steps (the input-major kernels) of our thresholded model against
    HF transformers' model with the same projection inputs zeroed by hooks."""
    import transformers as T

    path = make_tiny(family, tmp_path)
    lm = load_model(path, "cpu", "float32")
    th = _thresholds(lm.model)
    applied = apply_input_sparsity(lm.model, th)
    assert applied.input_major == 7 * len(lm.model.layers) and not applied.dense
    hf = T.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    _hf_hooks(hf, th)
    toks = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = hf(toks).logits
        cache = KVCache(lm.config, 16)
        pre = lm.model(toks[:, :6], 0, cache)
        steps = [lm.model(toks[:, i:i + 1], i, cache) for i in range(6, 12)]
    got = torch.cat([pre, *steps], 1)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    achieved = applied.achieved()
    assert achieved is not None and 0.05 < achieved < 0.95
    # and dense differs: the thresholds matter
    dense = load_model(path, "cpu", "float32")
    with torch.inference_mode():
        assert (dense.model(toks) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind, im", [("q4_0", True), ("q8_0", True), ("q8_0", False)])
def test_fused_quantised_step_equals_the_thresholded_module_path(tmp_path, kind, im):
    """The fused one-token block step (models/cpu_step.py) of a quantised, thresholded model against
    the profiler's thresholded forward (hooks) on the same weights dequantised: the float32 input-major
    kernels (Q4_0, Q8_0), and the threshold-then-dense path that types without that form take (im=False;
    with Q8_0, whose dense kernel takes float x: a Q4 one's Q8 activations would add their own noise).
    The integer kernels: test_integer_input_major_step_equals_threshold_then_dense."""
    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(lm.model, kind)
    th = _thresholds(lm.model, 1)
    toks = torch.randint(3, 160, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = dequantize_model(copy.deepcopy(lm.model), "cpu", torch.float32)  # the same weights, float32 products
    # compared before the LM head, whose dense Q4 kernel takes Q8 activations (their noise, not float32's)
    seen = {"got": [], "want": []}
    ref.norm.register_forward_pre_hook(lambda mod, args: seen["want"].append(args[0]))
    lm.model.norm.register_forward_pre_hook(lambda mod, args: seen["got"].append(args[0]))
    with torch.inference_mode(), thresholded(ref, th):
        ref(toks)
    want = seen["want"][0]
    applied = apply_input_sparsity(lm.model, th, input_major=im, integer=False)
    assert applied.input_major == (7 * len(lm.model.layers) if im else 0)
    calls = []
    orig = transformer.block_step
    transformer.block_step = lambda *a: (lambda y: calls.append(y is not None) or y)(orig(*a))
    try:
        with torch.inference_mode():
            cache = KVCache(lm.config, 16)
            for i in range(10):
                lm.model(toks[:, i:i + 1], i, cache)
    finally:
        transformer.block_step = orig
    got = torch.cat(seen["got"], 1)
    in_runs = sum(r.i1 - r.i0 for r in cpu_run.runs_of(lm.model))  # (runs call each block's fused step too)
    assert all(calls) and len(calls) == 10 * (len(lm.model.layers) - in_runs)  # every block took the fused step
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert 0.05 < applied.achieved() < 0.95


@pytest.mark.parametrize("kind", ["q4_0"])  # (Q4_1 and Q8_0 kernels: tests/test_input_sparse_int.py)
def test_integer_input_major_step_equals_the_thresholded_quantised_input(tmp_path, kind):
    """Decode through the fused step with the integer input-major kernels against the same weights
    dequantised, each projection's input zeroed at or below its threshold and then rounded to int8 per
    32-block by the dense kernels' quantiser (hooks): what the kernels compute, up to float32
    summation order (compared before the LM head, as above)."""
    from hotcold.profiler.input_sparsity import group_modules
    from hotcold.sparse_ops.input_sparse_int import available
    from hotcold.sparse_ops.quant.activations import _quantize_x

    if not available():
        pytest.skip("the integer kernel needs AVX-512 VNNI")
    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(lm.model, kind)
    th = _thresholds(lm.model, 1)
    toks = torch.randint(3, 160, (1, 10), generator=torch.Generator().manual_seed(4))
    ref = dequantize_model(copy.deepcopy(lm.model), "cpu", torch.float32)

    def zero_and_round(t):  # the dense kernels' own int8 rounding of each token's thresholded input
        def hook(mod, args):
            x = (args[0] * (args[0].abs() > t)).reshape(-1, args[0].shape[-1]).numpy()
            rows = []
            for r in x:
                xq, xd = _quantize_x(np.ascontiguousarray(r, np.float32))
                rows.append(xq.reshape(-1, 32).astype(np.float32) * xd[0::2, None])
            return (torch.from_numpy(np.stack(rows).reshape(args[0].shape)),)
        return hook

    for l, per in th.items():
        for g, mods in group_modules(ref.layers[l]).items():
            for m in mods:
                m.register_forward_pre_hook(zero_and_round(per[g]))
    seen = {"got": [], "want": []}
    ref.norm.register_forward_pre_hook(lambda mod, args: seen["want"].append(args[0]))
    lm.model.norm.register_forward_pre_hook(lambda mod, args: seen["got"].append(args[0]))
    applied = apply_input_sparsity(lm.model, th, integer=True)
    assert applied.input_major == 7 * len(lm.model.layers)
    with torch.inference_mode():
        ref(toks)
        cache = KVCache(lm.config, 16)
        for i in range(10):
            lm.model(toks[:, i:i + 1], i, cache)
    got, want = torch.cat(seen["got"], 1), seen["want"][0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert 0.05 < applied.achieved() < 0.95


def test_profile_then_run_with_and_without_input_sparsity(tmp_path):
    """`hotcold profile` records magnitudes, allocation, curve and thresholds; `run --stats` applies
    them by default where the sparse products pay and says the sparsity achieved; --no-sparse runs dense."""
    model = add_tiny_tokenizer(make_tiny("llama", tmp_path))
    r = run_cli("profile", str(model), "--tokens", "256", "--seq-len", "64", "--heldout-tokens", "256",
                "--no-predictors", "--ppl-budget", "1.0")
    assert r.returncode == 0, r.stderr
    out = next(Path(p).parent for p in r.stdout.split() if p.endswith("profile.json"))
    meta = json.loads((out / "profile.json").read_text())["input_sparsity"]
    assert meta["groups"] == list(GROUPS) and meta["chosen"] > 0
    assert [p["sparsity"] for p in meta["curve"]][0] == 0.0 and len(meta["curve"]) >= 2
    assert (out / "input_sparsity.png").read_bytes()[:4] == b"\x89PNG"
    args = ("run", str(model), "-p", "The", "-n", "8", "-t", "0", "--stats", "--ignore-eos")
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    # applied where its products time faster here (then --stats says what was skipped), else dense, said so
    assert ("applied to the" in r.stderr and "inputs skipped" in r.stderr) or \
        ("not applied: no projection's sparse product is faster" in r.stderr and "inputs skipped" not in r.stderr)
    r2 = run_cli(*args, "--no-sparse")
    assert r2.returncode == 0 and "input sparsity off (--no-sparse)" in r2.stderr and "inputs skipped" not in r2.stderr
    # a profile without predictors plans no predictor (a split would compute every cold row), says
    # why, and its plan runs the model whole
    r3 = run_cli("plan", str(model), "--vram", "0")
    assert r3.returncode == 0, r3.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert all(le["predictor"] == "off" for le in plan["layers"])
    assert "--no-predictors" in plan["predictors_off_reason"]
    r4 = run_cli(*args)
    assert r4.returncode == 0 and "the model runs whole on the CPU" in r4.stderr, r4.stderr


def test_timed_choice_thresholds_only_where_the_sparse_product_pays(tmp_path):
    """Given the allocation's sparsities, a projection is thresholded only where its input-major
    product timed faster than its dense kernel; the others stay dense, and the model equals the one
    with exactly the chosen projections' inputs zeroed."""
    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(lm.model, "q8_0")
    ref = copy.deepcopy(lm.model)
    th = _thresholds(lm.model, 2)
    toks = torch.randint(3, 160, (1, 6), generator=torch.Generator().manual_seed(5))
    applied = apply_input_sparsity(lm.model, th, sparsities={l: {g: 0.5 for g in GROUPS} for l in th})
    n = 7 * len(lm.model.layers)
    assert applied.input_major == len(applied.counters) and applied.input_major + len(applied.dense) == n
    assert all("dense kernel is faster" in d for d in applied.dense)
    refs = dict(ref.named_modules())
    for name, m in lm.model.named_modules():
        if "input_threshold" in m.__dict__:
            t = m.__dict__["input_threshold"]
            refs[name].register_forward_pre_hook(lambda mod, args, t=t: (args[0] * (args[0].abs() > t),))
    with torch.inference_mode():
        got, want = lm.model(toks), ref(toks)
    assert torch.allclose(got, want, atol=1e-5)


def test_timed_choices_are_kept_per_machine_model_and_code(tmp_path, monkeypatch, capsys):
    """input_major_pays's answers are timed on a model's first load and read back on the next (no
    timing: the same projections thresholded); another machine, a changed model file or answers timed
    on a busy machine now idle are timed again, quietly; a damaged file with one line."""
    from types import SimpleNamespace

    from hotcold.executors import input_sparse as isp

    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(isp, "machine_busy", lambda: False)
    base = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(base.model, "q8_0")
    th = _thresholds(base.model, 2)
    sparsities = {l: {g: 0.5 for g in GROUPS} for l in th}
    file = tmp_path / "model.gguf"  # the model file the answers are kept for
    file.write_bytes(b"a model")
    lm = SimpleNamespace(path=file, fingerprint="f")
    capsys.readouterr()  # (make_tiny's progress bar)
    calls = []
    real = isp.input_major_pays
    monkeypatch.setattr(isp, "input_major_pays", lambda *a: calls.append(1) or real(*a))

    def load() -> tuple[list[str], int]:
        calls.clear()
        model = copy.deepcopy(base.model)
        cache = isp.PaysCache.open(lm)
        apply_input_sparsity(model, th, sparsities=sparsities, timed=cache.timed)
        cache.save()
        chosen = sorted(n for n, m in model.named_modules() if "input_major" in m.__dict__)
        return chosen, len(calls)

    first, timed = load()
    assert timed > 0
    assert load() == (first, 0)  # read back: nothing timed
    monkeypatch.setattr(isp, "_machine", lambda: "another machine")
    assert load()[1] == timed
    assert load()[1] == 0
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version of the model file
    assert load()[1] == timed
    assert load()[1] == 0  # answers timed on an idle machine serve a busy one
    monkeypatch.setattr(isp, "_machine", lambda: "a third machine, busy")
    monkeypatch.setattr(isp, "machine_busy", lambda: True)
    assert load()[1] == timed
    assert load()[1] == 0  # still busy: kept
    monkeypatch.setattr(isp, "machine_busy", lambda: False)
    monkeypatch.setattr(isp, "input_major_pays", lambda *a: calls.append(1) or real(*a))
    assert load()[1] == timed  # idle now: timed again
    assert capsys.readouterr().err == ""
    (path,) = (tmp_path / "home" / "cache" / "input_major").iterdir()
    path.write_bytes(path.read_bytes()[:-3])
    assert load()[1] == timed
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input-sparsity cache" in err and "timing again" in err, err
    assert load()[1] == 0


def test_input_major_copies_are_built_once_and_mapped_after(tmp_path, monkeypatch, capsys):
    """The input-major copies are written to a verified cache on a model's first load and mapped on
    the next (read-only views, nothing built, the same products); a kind of matrix whose product does
    not pay is built once to be timed, not for every layer; a damaged file is rebuilt with one line."""
    from types import SimpleNamespace

    from hotcold.executors import input_sparse as isp
    from hotcold.executors.input_major_cache import open_major_memo
    from hotcold.sparse_ops import input_sparse as sp_mod

    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    base = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(base.model, "q8_0")
    th = _thresholds(base.model, 2)
    sparsities = {l: {g: 0.5 for g in GROUPS} for l in th}
    file = tmp_path / "model.gguf"
    file.write_bytes(b"a model")
    lm = SimpleNamespace(path=file, fingerprint="f")
    capsys.readouterr()
    builds = []
    real = sp_mod.input_major
    monkeypatch.setattr(sp_mod, "input_major", lambda *a: builds.append(1) or real(*a))
    toks = torch.randint(3, 160, (1, 1), generator=torch.Generator().manual_seed(3))

    model_of = [None]

    def load(timed: dict) -> tuple[torch.Tensor, int, object]:
        builds.clear()
        model = model_of[0] = copy.deepcopy(base.model)
        memo = open_major_memo(lm)
        applied = apply_input_sparsity(model, th, sparsities=sparsities, timed=timed, memo=memo)
        memo.save()
        with torch.inference_mode():
            out = model(toks, 0, KVCache(base.config, 8))
        return out, len(builds), applied

    every = {}  # every kind pays: all 14 projections built, then mapped
    monkeypatch.setattr(isp, "input_major_pays", lambda *a: True)
    first, built_first, applied = load(every)
    assert built_first == applied.input_major == 7 * len(base.model.layers)
    again, built, applied = load(every)
    assert built == 0 and torch.equal(first, again)
    ims = [m.__dict__["input_major"] for m in model_of[0].modules() if "input_major" in m.__dict__]
    assert len(ims) == built_first and all(not im.codes.flags.writeable and not im.codes.flags.owndata for im in ims)
    (path,) = (tmp_path / "home" / "cache" / "input_major_layout").iterdir()
    path.write_bytes(path.read_bytes()[:-5])
    capsys.readouterr()
    third, built, _ = load(every)
    err = capsys.readouterr().err
    assert built == 7 * len(base.model.layers) and torch.equal(first, third)
    assert err.count("\n") == 1 and "input-major cache" in err and "rebuilding" in err, err

    none = {}  # no kind pays: each kind (type, shape, sparsity) built once, to be timed
    monkeypatch.setattr(isp, "input_major_pays", lambda *a: False)
    out, built, applied = load(none)
    kinds = {isp._pays_key(lin, 0.5, False) for l in th for g in GROUPS for lin in isp.group_modules(base.model.layers[l])[g]}
    assert applied.input_major == 0 and len(none) == len(kinds) and built <= len(kinds) < 7 * len(base.model.layers)


def test_models_outgrowing_the_cache_are_timed_from_memory(tmp_path, monkeypatch):
    """Projections whose weights together exceed the last-level cache are timed one call at a time
    after an eviction (decode reads them from memory); smaller ones cache-hot."""
    from hotcold.executors import input_sparse as isp

    lm = load_model(make_tiny("llama", tmp_path), "cpu", "float32")
    quantize_model(lm.model, "q8_0")
    th = _thresholds(lm.model, 2)
    sparsities = {l: {g: 0.5 for g in GROUPS} for l in th}
    total = isp._weight_bytes(lm.model, th)
    assert total == sum(lin.qweight.data.nbytes for b in lm.model.layers for g in GROUPS
                        for lin in isp.group_modules(b)[g])
    seen = []
    monkeypatch.setattr(isp, "input_major_pays", lambda lin, im, sp, cold: seen.append(cold) or True)
    for llc, cold in ((total + 1, False), (total - 1, True)):
        seen.clear()
        monkeypatch.setattr(isp, "llc_bytes", lambda llc=llc: llc)
        apply_input_sparsity(copy.deepcopy(lm.model), th, sparsities=sparsities, timed={})
        assert seen and set(seen) == {cold}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_thresholded_model_on_cuda_equals_hf_with_inputs_zeroed(tmp_path):
    """On CUDA the thresholds apply too (inputs zeroed, then the dense product): the thresholded model
    against HF's with the same inputs zeroed by hooks, and the torch form of the sparse product
    against the dense product of the thresholded input."""
    import transformers as T

    path = make_tiny("llama", tmp_path)
    lm = load_model(path, "cuda", "float32")
    th = _thresholds(lm.model)
    applied = apply_input_sparsity(lm.model, th, input_major=False)
    assert applied.input_major == 0
    hf = T.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    _hf_hooks(hf, th)
    toks = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.inference_mode():
        want = hf(toks).logits
        cache = KVCache(lm.config, 16, device="cuda")
        pre = lm.model(toks[:, :6], 0, cache)
        got = torch.cat([pre, *[lm.model(toks[:, i:i + 1], i, cache) for i in range(6, 12)]], 1)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    w = torch.randn(512, 256, device="cuda")
    x = torch.randn(256, device="cuda")
    ref = w.double() @ (x * (x.abs() > 0.7)).double()
    assert torch.allclose(sparse_linear_torch(x, w, 0.7).double(), ref, rtol=1e-4, atol=1e-4)
