"""The profiler against brute force on tiny models of each FFN kind, its artifacts, and its CLI errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import run_cli
from hotcold.artifacts import ArtifactError
from hotcold.models.layers import route
from hotcold.models.loader import load_model
from hotcold.profiler.artifact import load_profile, write_profile
from hotcold.profiler.calibrate import search_sparsity
from hotcold.profiler.data import DataError, Source, read_source, tokenise
from hotcold.profiler.instrument import Reservoir, pack_bits, unpack_bits
from hotcold.profiler.profile import ProfileOptions, run_profile
from hotcold.profiler.report import mass_fraction
from tiny_models import add_tiny_tokenizer, make_tiny

TEXT = "\n".join(f"The value of item {i} is computed by the function f({i % 7}) and stored." for i in range(300))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return lambda family: add_tiny_tokenizer(make_tiny(family, root))


def _profile(path, **kw):
    lm = load_model(path, "cpu", "float32")
    opts = ProfileOptions(**{"tokens": 512, "seq_len": 64, "samples": 64, "heldout_tokens": 256, **kw})
    cal = tokenise(lm.tokenizer, [Source("t", TEXT)], opts.tokens, opts.seq_len, opts.heldout_tokens)
    tensors, meta = run_profile(lm, cal, opts)
    return lm, cal, tensors, meta


def _ffn_inputs(lm, seqs, thresholds):
    """Brute force: FFN inputs per layer, from forward hooks that recompute each FFN with its threshold."""
    inputs = {}

    def hook(layer):
        def fn(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1])
            inputs.setdefault(layer, []).append(x)
            if module.kind == "moe":
                return _moe_token_by_token(module, x, thresholds[layer]).reshape(output.shape)
            h = module.activations(x)
            return module.down(h * (h.abs() > thresholds[layer])).reshape(output.shape)
        return fn

    handles = [b.ffn.register_forward_hook(hook(i)) for i, b in enumerate(lm.model.layers)]
    try:
        with torch.inference_mode():
            for s in seqs:
                lm.model(s[None])
    finally:
        for h in handles:
            h.remove()
    return {l: torch.cat(v) for l, v in inputs.items()}


def _moe_token_by_token(moe, x, tau):
    """The thresholded MoE output, one token and one expert at a time."""
    out = torch.zeros_like(x)
    for t in range(len(x)):
        weights, ids = route(moe.router(x[t : t + 1]), moe.top_k, moe.renormalise)
        for w, e in zip(weights[0].tolist(), ids[0].tolist()):
            h = moe.experts.activations(e, x[t : t + 1])
            out[t] += w * (h * (h.abs() > tau) @ moe.experts.down[e].T)[0]
    return moe.add_shared(x, out)


@pytest.mark.parametrize("family", ["opt", "llama_relu"])
def test_relu_counts_equal_brute_force(tiny, family):
    lm, cal, tensors, meta = _profile(tiny(family))
    assert meta["mode"] == "relu" and meta["curve"] == []
    inputs = _ffn_inputs(lm, cal.sequences, {l: 0.0 for l in range(lm.config.num_layers)})
    for l, x in inputs.items():
        ffn = lm.model.layers[l].ffn
        fired = ffn.activations(x) != 0  # [N, I]: a ReLU neuron is active when it fired
        expected = fired.double().mean(0).float()
        assert torch.equal(tensors[f"layers.{l}.neuron_freq"], expected)
        # each sample is one of the tokens, with that token's mask
        sx, packed = tensors[f"layers.{l}.sample_x"], tensors[f"layers.{l}.sample_active"]
        assert sx.shape == (64, lm.config.hidden_size)
        dist = torch.cdist(sx.float(), x)
        row = dist.argmin(1)
        assert float(dist.min(1).values.max()) < 1e-2
        assert torch.equal(unpack_bits(packed, fired.shape[1]), fired[row])
    assert meta["tokens"] == cal.sequences.numel()


def test_gated_thresholds_counts_and_sparsity(tiny):
    lm, cal, tensors, meta = _profile(tiny("llama"), sparsity=0.6)
    taus = {l: float(tensors[f"layers.{l}.threshold"][0]) for l in range(lm.config.num_layers)}
    assert all(t > 0 for t in taus.values())
    inputs = _ffn_inputs(lm, cal.sequences, taus)
    for l, x in inputs.items():
        h = lm.model.layers[l].ffn.activations(x)
        expected = (h.abs() > taus[l]).double().sum(0)
        flips = (tensors[f"layers.{l}.neuron_freq"].double() * len(x) - expected).abs().round()
        assert float(flips.sum()) <= 2  # the threshold is one of the |h| values: rounding may flip a tie
    assert abs(meta["summary"]["sparsity"] - 0.6) <= 0.01
    assert [p["sparsity"] for p in meta["curve"]] == [0.0, 0.6]


def test_ppl_budget_picks_largest_sparsity_within_budget(tiny):
    lm, cal, tensors, meta = _profile(tiny("gemma3"), ppl_budget=0.02)
    base = meta["curve"][0]["ppl"]
    chosen = meta["sparsity_target"]
    within = [p["sparsity"] for p in meta["curve"] if p["ppl"] <= base * 1.02]
    assert chosen == max(within)
    assert abs(meta["summary"]["sparsity"] - chosen) <= 0.01


def test_search_sparsity_bisects():
    s, curve = search_sparsity(lambda s: 10 * (1 + s**4), 0.01)
    # s^4 <= 0.01 <=> s <= 0.316: grid passes 0.3, fails 0.4, bisection tries 0.35 and 0.325 (both fail)
    assert s == 0.3
    assert [p.sparsity for p in curve] == [0.0, 0.2, 0.3, 0.325, 0.35, 0.4]
    s, _ = search_sparsity(lambda s: 10.0, 0.01)
    assert s == 0.9


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_moe_counts_equal_brute_force(tiny, family):
    lm, cal, tensors, meta = _profile(tiny(family), sparsity=0.5)
    c = lm.config
    taus = {l: float(tensors[f"layers.{l}.threshold"][0]) for l in range(c.num_layers)}
    inputs = _ffn_inputs(lm, cal.sequences, taus)
    n_tokens = cal.sequences.numel()
    for l in range(c.num_layers):
        if c.ffn_kind(l) != "moe":
            assert f"layers.{l}.neuron_freq" in tensors
            continue
        moe, x = lm.model.layers[l].ffn, inputs[l]
        expert_count = torch.zeros(c.num_experts)
        neuron_count = torch.zeros(c.num_experts, c.moe_intermediate_size)
        for t in range(len(x)):  # token by token
            _, ids = route(moe.router(x[t : t + 1]), c.top_k, c.norm_topk_prob)
            for e in ids[0].tolist():
                expert_count[e] += 1
                neuron_count[e] += (moe.experts.activations(e, x[t : t + 1])[0].abs() > taus[l]).float()
        assert torch.allclose(tensors[f"layers.{l}.expert_freq"], expert_count / n_tokens, atol=1e-6)
        assert float(tensors[f"layers.{l}.expert_freq"].sum()) == pytest.approx(c.top_k)
        expected = neuron_count / expert_count.clamp_min(1)[:, None]
        # the threshold is itself one of the |h| values, so batched vs per-token rounding may flip a tie
        # and a flip upstream moves later layers' inputs a little: allow 0.1% of the decisions to differ
        flips = ((tensors[f"layers.{l}.expert_neuron_freq"] - expected).abs() * expert_count[:, None]).round()
        assert float(flips.sum()) <= 1e-3 * float(expert_count.sum()) * c.moe_intermediate_size
        if l > 0 and c.ffn_kind(l) == "moe" and f"layers.{l-1}.lookahead_experts" in tensors:
            nxt = tensors[f"layers.{l-1}.lookahead_experts"]
            assert nxt.shape == (64, c.top_k) and int(nxt.min()) >= 0 and int(nxt.max()) < c.num_experts
    assert any(r.get("experts_mass80") for r in meta["layers"])


def test_a_model_of_moe_layers_only_skips_the_threshold_search(tiny, monkeypatch):
    """Experts run whole in every engine, so a model whose FFNs are all MoE layers (mixtral here)
    needs no neuron thresholds: no held-out perplexity is evaluated, every threshold is 0, and the
    routing is still counted. A model with a dense or gated layer beside its MoE layers still searches."""
    import hotcold.profiler.profile as P

    calls = []
    real = P.perplexity
    monkeypatch.setattr(P, "perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm, _, tensors, meta = _profile(tiny("mixtral"))
    assert all(lm.config.ffn_kind(l) == "moe" for l in range(lm.config.num_layers))
    assert calls == [] and not meta.get("curve")
    assert all(float(tensors[f"layers.{l}.threshold"][0]) == 0.0 for l in range(lm.config.num_layers))
    assert all(float(tensors[f"layers.{l}.expert_freq"].sum()) == pytest.approx(lm.config.top_k)
               for l in range(lm.config.num_layers))
    lm, _, _, meta = _profile(tiny("llama"))  # gated: the search runs
    assert calls and len(meta["curve"]) >= 2


def test_reservoir_is_bounded_and_uniform():
    r = Reservoir(100)
    g = torch.Generator().manual_seed(0)
    for start in range(0, 10_000, 500):
        keys = torch.rand(500, generator=g)
        ids = torch.arange(start, start + 500)
        sel = r.accepts(keys)
        r.add(keys[sel], id=ids[sel])
    assert r.fields["id"].shape == (100,)
    assert len(set(r.fields["id"].tolist())) == 100
    assert 3000 < float(r.fields["id"].float().mean()) < 7000  # not just the first or last batch


def test_sample_cap_fits_a_third_of_free_ram(tiny, monkeypatch):
    """--samples is lowered, with a note, so that every layer's reservoir plus one layer's update copy
    fit in a third of the available RAM; it is kept when they fit."""
    import psutil
    from rich.console import Console

    from hotcold.profiler.command import _sample_cap, sample_row_bytes

    lm = load_model(tiny("llama"), device="cpu", dtype="float32")
    c = lm.config
    total, largest = sample_row_bytes(c)
    assert total == c.num_layers * (2 * c.hidden_size + -(-c.intermediate_size // 8)) and largest == total // c.num_layers
    avail = 3 * 1000 * (total + largest)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": avail})())
    console = Console(record=True, width=200)
    assert _sample_cap(lm, 16384, console) == 1000
    assert "keeping 1000 predictor-training samples" in console.export_text()
    assert _sample_cap(lm, 999, console) == 999


def test_pack_bits_round_trip():
    active = torch.rand(5, 21) > 0.5
    assert torch.equal(unpack_bits(pack_bits(active), 21), active)


def test_mass_fraction_brute_force():
    freq = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    # 0.5+0.3 = 0.8 of 1.0: two of five units
    assert mass_fraction(freq) == pytest.approx(2 / 5)
    assert mass_fraction(torch.ones(10)) == pytest.approx(8 / 10)
    assert mass_fraction(torch.zeros(4)) is None


def test_tokenise_reuses_short_text_with_shifted_windows(tiny):
    lm = load_model(tiny("llama"), "cpu", "float32")
    cal = tokenise(lm.tokenizer, [Source("t", TEXT[:3000])], 5000, 64, 0)
    assert cal.reused and cal.sequences.shape[1] == 64
    assert cal.sequences.numel() >= 5000
    assert len({tuple(s.tolist()) for s in cal.sequences}) > len(cal.sequences) // 2
    assert (cal.sequences[:, 0] == lm.tokenizer.bos_id).all()


def test_profile_round_trip_and_fingerprint(tiny, tmp_path):
    lm, cal, tensors, meta = _profile(tiny("llama_relu"))
    write_profile(tmp_path, tensors, meta)
    prof = load_profile(tmp_path / "profile.safetensors", lm.fingerprint)
    assert torch.equal(prof.neuron_freq[1], tensors["layers.1.neuron_freq"])
    x, active = prof.samples(1)
    assert x.shape[0] == active.shape[0] == 64 and active.dtype == torch.bool
    with pytest.raises(ArtifactError, match="another model"):
        load_profile(tmp_path / "profile.safetensors", "0123456789abcdef")


def test_cli_profile_writes_artifacts(tiny, tmp_path):
    model = tiny("llama")
    out = tmp_path / "art"
    r = run_cli("profile", str(model), "--tokens", "256", "--seq-len", "64", "--sparsity", "0.5",
                "--heldout-tokens", "128", "--samples", "16", "--out", str(out))
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "profile.json").read_text())
    assert meta["sparsity_target"] == 0.5 and meta["data"][0]["source"] == "pydoc_data.topics"
    assert (out / "profile.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob(".*tmp"))
    # a profile of another model is refused by a stage that reads it
    other = tiny("qwen2")
    from hotcold.models.loader import describe_model

    with pytest.raises(ArtifactError):
        load_profile(out / "profile.safetensors", describe_model(other).fingerprint)


@pytest.mark.parametrize("content,suffix,message", [
    (None, ".txt", "no such file"),
    ('{"text": "ok"}\nnot json\n', ".jsonl", ":2: not valid JSON"),
    ('{"body": "x"}\n', ".jsonl", "no string field 'text'"),
    ("   \n", ".txt", "contains no text"),
    (b"\xff\xfe\x00bad", ".txt", "not UTF-8"),
])
def test_bad_data_files(tmp_path, tiny, content, suffix, message):
    path = tmp_path / f"data{suffix}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_source(path)
    r = run_cli("profile", str(tiny("llama")), "--data", str(path), "--tokens", "64")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message.split(":")[-1].strip()[:10] in r.stderr


def test_cli_rejects_both_sparsity_and_budget(tiny):
    r = run_cli("profile", str(tiny("llama")), "--sparsity", "0.5", "--ppl-budget", "0.01")
    assert r.returncode == 2 and "either --sparsity or --ppl-budget" in r.stderr


def test_jsonl_data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "alpha"}\n\n{"text": "beta", "id": 2}\n')
    assert read_source(path).text == "alpha\n\nbeta"


def test_truncated_profile_is_a_clear_error(tiny, tmp_path):
    lm, cal, tensors, meta = _profile(tiny("llama_relu"))
    write_profile(tmp_path, tensors, meta)
    path = tmp_path / "profile.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match="unreadable profile"):
        load_profile(path, lm.fingerprint)


def test_profile_device_falls_back_to_the_cpu_where_the_gpu_cannot_hold_the_model():
    from hotcold.errors import HotcoldError
    from hotcold.profiler.command import profile_device

    G = 2**30
    assert profile_device(None, None, 10**9, None) == ("cpu", None)  # no CUDA
    assert profile_device("cpu", None, 10**12, 4 * G) == ("cpu", None)
    assert profile_device(None, None, 10**9, 4 * G) == ("cuda", None)  # 1.9 GiB in bfloat16 of 4 free
    device, note = profile_device(None, None, 10**9, 2 * G)  # 1.9 GiB does not fit 90% of 2 GiB
    assert device == "cpu" and "1.9 GiB of GPU memory in bfloat16" in note and "2.0 GiB free" in note
    assert profile_device(None, "float32", 10**9, 4 * G)[0] == "cpu"  # 3.7 GiB in float32
    with pytest.raises(HotcoldError, match=r"--device cuda: the weights need 1\.9 GiB .* leave --device out"):
        profile_device("cuda", None, 10**9, 2 * G)


def test_describe_model_counts_the_weights(tiny):
    from safetensors import safe_open

    from hotcold.models.loader import describe_model

    folder = tiny("qwen3_moe")
    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    assert describe_model(folder).params == n > 0
