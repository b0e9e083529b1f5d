"""hotcold.executors.moe: the hybrid MoE layer against our dense forward and transformers' logits.

Every model is a tiny random MoE model of a supported family (tests/tiny_models.py): qwen2_moe (a
shared expert, and one gated layer), mixtral and qwen3_moe. Experts are placed all on the CPU, split,
or all on the fast tier. On the CPU the fast tier is the CPU device and cold experts are float32
unless a test says otherwise, so results agree to float32 rounding; the `cuda` tests repeat the core
checks on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import re
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from hotcold.executors import CPUExecutor, HybridFFN, make_hybrid
from hotcold.executors.moe import HybridMoE, random_experts
from hotcold.executors.moe_host import MoEJob
from hotcold.models.generate import Generator
from hotcold.models.loader import LoadedModel, load_model
from hotcold.models.sampling import SamplingParams
from test_executors import T, assert_close, decode_logits, tokens  # the same decode path and tolerance
from tiny_models import add_tiny_tokenizer, make_tiny

MOE = ["qwen2_moe", "mixtral", "qwen3_moe"]
PLACEMENTS = {"cold": 0.0, "mixed": 0.5, "fast": 1.0}  # fraction of each layer's experts on the fast tier
HF_TOL = 1e-4  # absolute, as tests/test_models.py compares our dense forward with transformers

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_moe")


_REFS: dict = {}


def reference(folder: Path, family: str, device: str = "cpu") -> LoadedModel:
    """The dense float32 model (loaded once per family/device; never converted)."""
    if (family, device) not in _REFS:
        _REFS[family, device] = load_model(make_tiny(family, folder), device=device, dtype="float32")
    return _REFS[family, device]


def fresh(folder: Path, family: str, device: str = "cpu") -> LoadedModel:
    return copy.deepcopy(reference(folder, family, device))


def hf_logits(folder: Path, family: str, toks: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(make_tiny(family, folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(toks.cpu()).logits


def moe_layers(lm: LoadedModel) -> list[int]:
    return [l for l in range(lm.config.num_layers) if lm.config.ffn_kind(l) == "moe"]


# ---------------------------------------------------------------------------------------------
# The hybrid MoE computes the reference model


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("family", MOE)
def test_prefill_and_decode_match_references(folder, family, placement):
    ref = reference(folder, family)
    toks = tokens()
    with torch.inference_mode():
        want = ref.model(toks)
    hf = hf_logits(folder, family, toks)
    lm = fresh(folder, family)
    experts = random_experts(lm, PLACEMENTS[placement], seed=1)
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=experts) as eng:
        E, k, L = lm.config.num_experts, lm.config.top_k, len(moe_layers(lm))
        assert sorted(eng.moe) == moe_layers(lm)
        for l, b in enumerate(lm.model.layers):
            assert isinstance(b.ffn, HybridMoE if l in eng.moe else HybridFFN)
            if l in eng.moe:
                assert b.ffn.fast.ids == experts[l] and b.ffn.n_cold == E - len(experts[l])
        with torch.inference_mode():
            prefill = lm.model(toks)
        decode = decode_logits(lm, toks)
        st = eng.stats()
    for got in (prefill, decode):
        assert_close(got, want)
        assert (got - hf).abs().max().item() < HF_TOL
    for phase, n in (("prefill", T), ("decode", T)):
        s = st[phase]
        assert s["experts_gpu"] + s["experts_cpu"] == n * k * L  # every routed (token, expert) pair once
        assert (s["experts_gpu"] == 0) == (placement == "cold") and (s["experts_cpu"] == 0) == (placement == "fast")
    assert st["decode"]["tokens"] == T and st["prefill"]["tokens"] == T
    if placement != "fast":
        assert st["decode"]["cpu_s"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("family", MOE)
def test_prefill_gpu_experts_chunk_kernels(folder, family, device, monkeypatch):
    """A chunk's GPU experts: on CUDA through chunk_experts (every MoE layer once a chunk, no wait for
    the routing), elsewhere a group of experts at a time from the routing on the host; the same
    logits as the reference, every routed pair counted."""
    import hotcold.executors.moe as moe

    calls = []

    def counted(x, *a, **kw):
        calls.append(tuple(x.shape))
        return chunk_experts(x, *a, **kw)

    chunk_experts = moe.chunk_experts
    monkeypatch.setattr(moe, "chunk_experts", counted)
    ref = reference(folder, family, device)
    toks = tokens(seed=29, device=device)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, family, device)
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.5, seed=2),
                     stats=True) as eng:
        assert all(m.chunk_kernels() == (device == "cuda") for m in eng.moe.values())  # Triton's, on CUDA only
        with torch.inference_mode():
            got = lm.model(toks)
        st = eng.stats()["prefill"]
    assert_close(got, want, *([1e-4] if device == "cuda" else []))
    L = len(moe_layers(lm))
    assert calls == ([(toks.shape[1], lm.config.hidden_size)] * L if device == "cuda" else [])
    assert st["experts_gpu"] + st["experts_cpu"] == toks.shape[1] * lm.config.top_k * L and st["experts_gpu"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("slots", [None, 1])  # default slots; one expert's rows split over two chunks
@pytest.mark.parametrize("family", MOE)
def test_streamed_prefill_matches_reference(folder, family, slots, device):
    """prefill="stream": a chunk's host experts computed on the fast tier from their rows streamed
    through the two slots (on the CPU tier the copies are host to host); the same logits, every
    routed pair counted once, the layer's host rows streamed."""
    ref = reference(folder, family, device)
    toks = tokens(seed=23, device=device)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, family, device)
    c = lm.config
    kw = {}
    if slots:  # slots of 1.5 experts' rows: chunks cut through experts
        kw["stream_slots_bytes"] = int(2 * 1.5 * c.moe_intermediate_size * (3 * c.hidden_size * 4 + 16))
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.25, seed=3),
                     prefill="stream", **kw) as eng:
        if slots:
            assert 0 < eng.streamer.chunk_rows % c.moe_intermediate_size
        with torch.inference_mode():
            got = lm.model(toks)
        st = eng.stats()["prefill"]
    assert_close(got, want)
    L = len(moe_layers(lm))
    assert st["experts_gpu"] == T * c.top_k * L and st["experts_cpu"] == 0
    assert st["rows_streamed"] > 0


def test_moe_prefill_regime_weighs_rereads_against_one_copy():
    """Few tokens per expert: the CPU reads each routed expert once, cheaper than copying them all;
    many: the CPU re-reads them per token tile and streaming wins; never without CUDA."""
    from hotcold.executors.prefill import moe_prefill_regime

    eb, params = 9.4e6, 4.7e6  # a Qwen3-30B-A3B expert in bf16
    args = dict(cpu_bw=60e9, pcie_bw=50e9, gpu_flops=400e12, tokens_per_pass=4)
    assert moe_prefill_regime([1] * 8, eb, 120, params, **args) == "cpu"
    assert moe_prefill_regime([32] * 120, eb, 120, params, **args) == "stream"
    assert moe_prefill_regime([32] * 120, eb, 120, params, **args, cuda=False) == "cpu"
    assert moe_prefill_regime([], eb, 120, params, **args) == "cpu"
    # quantised experts (Q4_0: 2.65 MB each), 8 tokens each, one pass over each: the bytes alone
    # favour the CPU, but its block kernels are compute-bound over a chunk and the copy wins
    q4 = dict(args, tokens_per_pass=128)
    assert moe_prefill_regime([8] * 120, 2.65e6, 120, params, **q4) == "cpu"
    assert moe_prefill_regime([8] * 120, 2.65e6, 120, params, **q4, cpu_flops=3e11) == "stream"
    assert moe_prefill_regime([1] * 8, 2.65e6, 120, params, **q4, cpu_flops=3e11) == "cpu"


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_generate_same_greedy_tokens(folder, family):
    """Prefill a prompt, then decode: the same greedy tokens as the dense model."""
    ref = reference(folder, family)
    prompt = tokens(6, seed=5)[0].tolist()
    greedy = SamplingParams(temperature=0.0)
    want = [e.token_id for e in Generator(ref).generate(prompt, max_tokens=12, sampling=greedy, ignore_eos=True)]
    lm = fresh(folder, family)
    with make_hybrid(lm, {}, None, cpu_dtype="f32", threads=2, gpu_experts=random_experts(lm, 0.5, seed=4)) as eng:
        got = [e.token_id for e in Generator(eng.lm).generate(prompt, max_tokens=12, sampling=greedy, ignore_eos=True)]
        per = eng.stats()["decode"]["per_token"]
    assert got == want
    L, k = len(moe_layers(lm)), lm.config.top_k
    assert per["experts_gpu"] + per["experts_cpu"] == L * k and per["cpu_ms"] > 0 and per["gpu_ms"] > 0


@pytest.mark.parametrize("kind", ["bf16", "i8"])
def test_cpu_storage_kinds(folder, kind):
    """Cold experts stored in bf16 or i8: close to dense."""
    ref = reference(folder, "qwen3_moe")
    toks = tokens(seed=12)
    with torch.inference_mode():
        dense = ref.model(toks)
    lm = fresh(folder, "qwen3_moe")
    with make_hybrid(lm, {}, None, cpu_dtype=kind, threads=2, gpu_experts=random_experts(lm, 0.25)):
        assert_close(decode_logits(lm, toks), dense, {"bf16": 3e-2, "i8": 5e-2}[kind])


# ---------------------------------------------------------------------------------------------
# Memory, the worker, bad plans


def test_original_expert_weights_released(folder):
    """The stacked expert parameters are freed; every weight is held once (the engine's own tensors)."""
    lm = fresh(folder, "qwen3_moe")
    total = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    moes = [b.ffn for b in lm.model.layers]
    refs = [weakref.ref(p) for m in moes for p in m.experts.parameters()]
    moe_bytes = sum(p.numel() * p.element_size() for m in moes for p in m.parameters())
    del moes
    eng = make_hybrid(lm, {}, None, cpu_dtype="f32", threads=1, gpu_experts=random_experts(lm, 0.5))
    gc.collect()
    assert all(r() is None for r in refs), "an original expert parameter is still referenced"
    hybrid = list(eng.moe.values())
    fast = sum(m.fast.nbytes for m in hybrid)  # plain tensors, not parameters
    host = [mat for m in hybrid if m.cold is not None for mat in m.cold.mats]
    host_bytes = sum(mat.nbytes for mat in host)
    params = sum(p.numel() * p.element_size() for p in lm.model.parameters())  # router and the rest
    assert params + fast + host_bytes == total  # every weight once, nothing more
    for i, a in enumerate(host):  # no two host matrices share memory
        assert not any(np.shares_memory(a.data, b.data) for b in host[i + 1:])
    mem = eng.memory()
    assert mem["fast_moe_bytes"] + mem["host_moe_bytes"] == moe_bytes
    assert mem["host_moe_bytes"] == host_bytes and 0 < host_bytes < moe_bytes
    eng.close()


def test_job_error_fails_the_job_not_the_worker():
    cpu = CPUExecutor(threads=1)
    bad = MoEJob(object(), np.array([-1, 0]), [np.arange(4)], np.zeros(4, np.float32), np.zeros((1, 8), np.float32),
                 np.array([[1, 0]]), np.ones((1, 2), np.float32), np.zeros((1, 8), np.float32))
    with pytest.raises(RuntimeError, match="CPU executor failed"):
        cpu.submit(bad).wait()
    assert cpu.alive
    cpu.close()


def test_bad_expert_placements(folder):
    threads = threading.active_count()
    with pytest.raises(ValueError, match="no MoE FFN"):
        make_hybrid(fresh(folder, "qwen2_moe"), {}, None, gpu_experts={1: [0]})  # layer 1 is gated
    with pytest.raises(ValueError, match="out of range"):
        make_hybrid(fresh(folder, "mixtral"), {}, None, gpu_experts={0: [4]})
    with pytest.raises(ValueError, match="repeat"):
        make_hybrid(fresh(folder, "mixtral"), {}, None, gpu_experts={0: [1, 1]})
    assert threading.active_count() == threads  # refused before a worker thread started


# ---------------------------------------------------------------------------------------------
# The CLI: profile, plan with experts split, run = run --no-plan


def _slow_cpu_hardware(path: Path) -> Path:
    """The H200 preset with a CPU 1000x slower: on a tiny model, splitting experts then pays."""
    from hotcold.planner.hardware import preset

    hw = preset("h200")
    slow = {f: {k: v / 1000 for k, v in getattr(hw, f).items()}
            for f in ("cpu_ffn_Bps", "cpu_gather_Bps", "cpu_dense_Bps")}
    path.write_text(dataclasses.replace(hw, **slow, gpu_context_bytes=0).to_json())  # a tiny GPU: no context to reserve
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
def test_cli_profile_plan_run(tmp_path, monkeypatch, device):
    """float32 compute on either device (cold experts are stored in bf16, as `run` chooses for float32)."""
    from hotcold.planner.plan import load_plan

    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    model = add_tiny_tokenizer(make_tiny("qwen3_moe", tmp_path))
    r = run_cli("profile", model, "--tokens", "1024", "--seq-len", "64", "--samples", "256", "--device", device)
    assert r.returncode == 0, r.stderr
    r = run_cli("plan", model, "--vram", "314KiB", "--workspace", "16KiB", "--ctx", "128", "--expert-cache", "32KiB",
                "--hardware", _slow_cpu_hardware(tmp_path / "hw.json"))
    assert r.returncode == 0, r.stderr
    plan = load_plan(model.parent / f"{model.name}.hotcold")
    assert plan.mode == "hybrid" and any(0 < len(plan.gpu_experts[l]) < len(plan.expert_order[l]) for l in range(3))
    args = ("run", model, "--prompt", "The value of", "-n", "12", "--temperature", "0", "--ignore-eos", "--json",
            "--device", device, "--dtype", "float32")
    hybrid = run_cli(*args, "--stats")
    dense = run_cli(*args, "--no-plan")
    assert hybrid.returncode == 0 and dense.returncode == 0, hybrid.stderr + dense.stderr
    assert "hybrid" in hybrid.stderr and "experts per token" in hybrid.stderr
    stats = next(l for l in hybrid.stderr.splitlines() if l.startswith("[stats] decode"))
    if device == "cuda":
        assert "idle GPU" in stats, stats
    else:  # no GPU in use: the fast tier is not called one
        assert "idle fast tier (CPU)" in stats and "GPU" not in stats, stats
    # the engine's counts cover the decode steps after the first token, as the measured rate does
    # (on CUDA the first of them is queued before the first token is read: one fewer)
    assert f"({11 if device == 'cpu' else 10} steps timed)" in hybrid.stderr, hybrid.stderr
    if sys.platform.startswith("linux"):  # the host memory's huge-page share, from /proc/self/smaps_rollup
        assert re.search(r"host memory \d+\.\d GiB resident, \d+\.\d GiB anonymous, \d+% of that in huge pages", hybrid.stderr), hybrid.stderr
    assert plan.meta["budget"]["expert_cache_bytes"] == 32 * 1024
    if device == "cuda":  # the cache is a GPU feature: 2 experts of 12.7 KB
        assert "expert cache: 2 experts" in hybrid.stderr and "expert cache hit rate" in hybrid.stderr
    assert json.loads(hybrid.stdout)["token_ids"] == json.loads(dense.stdout)["token_ids"]


# ---------------------------------------------------------------------------------------------
# CUDA: the same checks with the GPU as the fast tier


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", MOE)
def test_cuda_matches_dense(folder, family):
    ref = reference(folder, family, "cuda")
    toks = tokens(seed=13, device="cuda")
    with torch.inference_mode():
        want = ref.model(toks)
    for frac in PLACEMENTS.values():
        lm = fresh(folder, family, "cuda")
        with make_hybrid(lm, {}, None, cpu_dtype="f32", gpu_experts=random_experts(lm, frac, seed=2)) as eng:
            with torch.inference_mode():
                assert_close(lm.model(toks), want, 1e-4)
            assert_close(decode_logits(lm, toks), want, 1e-4)
            st = eng.stats()["decode"]
            assert st["tokens"] == T and st["transfer_s"] > 0  # the routing crosses even with no CPU expert
            assert (st["experts_cpu"] == 0) == (frac == 1.0)


@pytest.mark.cuda
@CUDA
def test_cuda_bf16_generate(folder):
    ref = reference(folder, "qwen2_moe")
    lm = fresh(folder, "qwen2_moe")  # loaded on the CPU, converted onto the GPU in bf16
    toks = tokens(seed=15)
    with torch.inference_mode():
        dense = ref.model(toks)
    with make_hybrid(lm, {}, None, device="cuda", dtype=torch.bfloat16, gpu_experts=random_experts(lm, 0.5)) as eng:
        assert lm.device.type == "cuda" and eng.moe[0].fast.gate.device.type == "cuda"
        assert_close(decode_logits(lm, toks.cuda()).cpu(), dense, 5e-2)
        out = list(Generator(eng.lm).generate(tokens(4)[0].tolist(), max_tokens=8,
                                             sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        assert len(out) == 8


def test_routes_padded_against_brute_force():
    """expert_stream.Routes: each range's positions hold exactly their routed tokens, in token order,
    with those pairs' routing weights, padded with weight 0 to the range's busiest position; ranges
    with no pair are None, and positions outside every range are left out."""
    from hotcold.executors.expert_stream import Routes
    rng = np.random.default_rng(4)
    where = np.where(rng.random((40, 4)) < 0.7, rng.integers(0, 11, (40, 4)), -1)  # 11 positions, -1: elsewhere
    where[where == 6] = 7  # position 6 gets no pair
    weights = torch.rand(40, 4) + 0.5
    bounds = [(0, 3), (3, 5), (6, 7), (7, 10)]  # position 10 in no range
    routes = Routes.of(where, 11)
    assert routes.pairs == int((where >= 0).sum())
    got = routes.padded(bounds, weights)
    for (a, b), picked in zip(bounds, got):
        want = [[(t, s) for t in range(40) for s in range(4) if where[t, s] == p] for p in range(a, b)]
        if not any(want):
            assert picked is None
            continue
        tok, coef = picked
        width = max(len(w) for w in want)
        assert tok.shape == coef.shape == (b - a, width) and coef.dtype == torch.float32
        for j, pairs in enumerate(want):
            n = len(pairs)
            assert tok[j, :n].tolist() == [t for t, _ in pairs] and tok[j, n:].eq(0).all()
            assert coef[j, :n].tolist() == [weights[t, s].item() for t, s in pairs] and coef[j, n:].eq(0).all()


@pytest.mark.cuda
@CUDA
def test_a_moe_file_runs_whole_on_cuda_with_4bit_experts(tmp_path):
    """`run` without a plan on CUDA: a Q4_0 MoE file goes through the split engine with every expert
    on the GPU as its 4-bit codes (Q4Stack, the routed experts' Triton kernels), not expanded to
    bf16; prompt logits within the 4-bit tolerance of the float32 model of the file, and one token at a
    time (the Triton kernels, every layer captured whole, the step replayed as one CUDA graph) within
    twice it of the prompt's (the grouped products), as test_executors_quant bounds its decode steps."""
    import subprocess

    from hotcold.executors.from_plan import open_for_run
    from hotcold.sparse_ops.moe_gpu import Q4Stack

    out = tmp_path / "moe"
    made = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "tools" / "make_model.py"), "tiny-qwen3-moe",
                           "--out", str(out), "--format", "gguf", "--dtype", "q4_0", "--quiet"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    path = out / "model.gguf"
    ref = load_model(path, "cpu", "float32")
    setup = open_for_run(path, use_plan=False, device="cuda")
    try:
        assert setup.engine is not None and any("MoE model whole on the GPU" in n for n in setup.notes)
        from hotcold.executors.host_attention import HostEmbedding

        # the embedding on the GPU: a step's token is looked up there, not read on the host first
        assert not isinstance(setup.lm.model.embed, HostEmbedding)
        assert all(t.is_cuda for t in [*setup.lm.model.embed.parameters(), *setup.lm.model.embed.buffers()])
        moes = list(setup.engine.moe.values())
        assert len(moes) == ref.config.num_layers
        for m in moes:
            assert len(m.fast.ids) == ref.config.num_experts and m.n_cold == 0
            assert all(isinstance(getattr(m.fast, w), Q4Stack) for w in ("gate", "up", "down"))
        toks = tokens(seed=21)
        with torch.inference_mode():
            want = ref.model(toks)
            got = setup.lm.model(toks.cuda()).cpu()
        assert_close(got, want, 4e-2)
        assert_close(decode_logits(setup.lm, toks.cuda()).cpu(), got, 8e-2)
        step = setup.lm.model.one_token_step  # no host share in any layer: the whole step is one CUDA graph
        assert step.replays >= toks.shape[1] - 2 and step.captured.head
    finally:
        setup.close()
