"""hotcold.executors: the hybrid engine against the dense, thresholded and predictor-sparse references.

Every model is a tiny random one of a supported family (tests/tiny_models.py). On the CPU the fast
tier is the CPU device and cold rows are float32 unless a test says otherwise, so results agree to
float32 rounding; the `cuda` tests repeat the core checks on a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from hotcold.executors import ColdJob, CPUExecutor, HybridFFN, PrefillCosts, make_hybrid, prefill_regime, random_hot
from hotcold.executors.moe import HybridMoE
from hotcold.executors.gpu_executor import LearnedMask
from hotcold.executors.layer_node import L_S
from hotcold.executors.host_attention import HostEmbedding, HostHead, HostLinear
from hotcold.executors.weights import split_ffn
from hotcold.executors.prefill import STREAM_SLOTS_BYTES
from hotcold.models.cpu_step import prepared
from hotcold.models.generate import Generator
from hotcold.models.loader import LoadedModel, load_model
from hotcold.models.sampling import SamplingParams
from hotcold.models.transformer import KVCache
from hotcold.predictors.artifact import PredictorSet
from hotcold.predictors.neurons import NeuronPredictor, train_layer
from hotcold.predictors.sparse import predicted_sparse
from hotcold.profiler.instrument import instrumented

from tiny_models import make_tiny

DENSE = ["llama", "llama_relu", "mistral", "qwen2", "qwen3", "opt", "opt_post", "gemma3"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
RELU = {"llama_relu", "opt", "opt_post"}
T = 10
TOL = 2e-5  # float32 everywhere: relative to the largest |logit|

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


_REFS: dict = {}


def reference(folder: Path, family: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """The dense model (loaded once per family/device/dtype; never converted)."""
    key = (family, device, dtype)
    if key not in _REFS:
        _REFS[key] = load_model(make_tiny(family, folder), device=device, dtype=dtype)
    return _REFS[key]


def fresh(folder: Path, family: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """A private copy of the reference to convert."""
    return copy.deepcopy(reference(folder, family, device, dtype))


def tokens(n: int = T, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randint(3, 160, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def decode_logits(lm: LoadedModel, toks: torch.Tensor) -> torch.Tensor:
    """Logits [1, T, V] computed one token at a time through the KV cache (the decode path)."""
    cache = KVCache(lm.config, toks.shape[1] + 1, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
    with torch.inference_mode():
        return torch.cat([lm.model(toks[:, i:i + 1], i, cache) for i in range(toks.shape[1])], dim=1)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} > {tol:g} * {scale:.3g}"


def ffn_input_samples(lm: LoadedModel, n_seq: int = 24, seq: int = 24) -> dict[int, torch.Tensor]:
    """Per layer, FFN inputs [S, D] on random token sequences (forward pre-hooks)."""
    xs: dict[int, list] = {}
    hooks = [b.ffn.register_forward_pre_hook(lambda m, a, i=i: xs.setdefault(i, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for i, b in enumerate(lm.model.layers)]
    try:
        with torch.inference_mode():
            for s in range(n_seq):
                lm.model(tokens(seq, 100 + s, lm.device))
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(v) for i, v in xs.items()}


def gap_thresholds(lm: LoadedModel, toks: torch.Tensor) -> dict[int, float]:
    """Per gated layer, a threshold with about half the neurons active on toks, placed in the middle
    of the widest gap between the |h| values seen there, so that float rounding flips no neuron
    (layer by layer, under the thresholds of the layers before); {} for ReLU models (threshold 0)."""
    if lm.config.activation == "relu":
        return {}
    thr: dict[int, float] = {}
    for l in range(lm.config.num_layers):
        if lm.config.ffn_kind(l) == "moe":
            continue
        seen = []
        with instrumented(lm.model, thr), torch.inference_mode():
            block = lm.model.layers[l]
            hook = block.ffn.register_forward_pre_hook(lambda m, a: seen.append(m.inner.activations(a[0]).abs()))
            lm.model(toks)
            hook.remove()
        v = seen[0].flatten().double().sort().values
        lo, hi = int(0.4 * len(v)), int(0.6 * len(v))
        j = lo + int(torch.argmax(v[lo + 1:hi + 1] - v[lo:hi]))
        thr[l] = float((v[j] + v[j + 1]) / 2)
    return thr


def random_predictors(lm: LoadedModel, rank: int = 8, seed: int = 0) -> PredictorSet:
    """Hand-built predictors: random low-rank MLPs with threshold 0 (about half predicted active)."""
    torch.manual_seed(seed)
    c = lm.config
    preds = PredictorSet("test")
    for i in range(c.num_layers):
        if c.ffn_kind(i) != "moe":
            preds.neurons[i] = NeuronPredictor(c.hidden_size, c.intermediate_size, rank).eval()
    return preds


# ---------------------------------------------------------------------------------------------
# Oracle predictors: the hybrid engine computes the reference model


@pytest.mark.parametrize("frac", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("family", DENSE)
def test_oracle_prefill_matches_dense(folder, family, frac):
    ref = reference(folder, family)
    lm = fresh(folder, family)
    with make_hybrid(lm, random_hot(lm, frac, seed=1), "oracle", cpu_dtype="f32", threads=2) as eng:
        assert all(isinstance(b.ffn, HybridFFN) for b in lm.model.layers)
        toks = tokens()
        with torch.inference_mode():
            assert_close(lm.model(toks), ref.model(toks))
        st = eng.stats()["prefill"]
        assert st["forwards"] == 1 and st["tokens"] == T
        assert st["regimes"] == ({} if frac == 1.0 else {"cpu": 3})
        I = lm.config.intermediate_size
        assert st["hot_rows"] == 3 * round(frac * I) and st["cold_rows"] == 3 * (I - round(frac * I))


@pytest.mark.parametrize("family", DENSE)
def test_oracle_decode_matches_thresholded_reference(folder, family):
    """Token by token with thresholds: equals the profiler's thresholded forward; the stats count
    exactly the active neurons, split between the two sides."""
    ref = reference(folder, family)
    toks = tokens(seed=3)
    thr = gap_thresholds(ref, toks)
    from hotcold.profiler.instrument import Recorder

    rec = Recorder(ref.model, samples=0)
    rec.start_batch(T)
    with instrumented(ref.model, thr, rec), torch.inference_mode():
        want = ref.model(toks)
    active = sum(int(c.sum()) for c in rec.neuron_count.values())
    lm = fresh(folder, family)
    with make_hybrid(lm, random_hot(lm, 0.5, seed=2), "oracle", cpu_dtype="f32", thresholds=thr, threads=2) as eng:
        got = decode_logits(lm, toks)
        st = eng.stats()["decode"]
        # each block's attention half ran as one compiled call before its HybridFFN (models/cpu_step.py)
        assert all(prepared(b) is not None and not prepared(b)[1] for b in lm.model.layers)
    assert_close(got, want, 1e-4)
    assert st["tokens"] == T and st["layer_calls"] == 3 * T
    assert st["rows_gpu"] + st["rows_cpu"] == active
    assert st["rows_gpu"] > 0 and st["rows_cpu"] > 0
    if family not in RELU:
        assert 0.3 < active / (3 * T * lm.config.intermediate_size) < 0.7  # the thresholds bite


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3"])
def test_generate_same_greedy_tokens(folder, family):
    ref = reference(folder, family)
    prompt = tokens(6, seed=5)[0].tolist()
    greedy = SamplingParams(temperature=0.0)
    want = [e.token_id for e in Generator(ref).generate(prompt, max_tokens=12, sampling=greedy, ignore_eos=True)]
    lm = fresh(folder, family)
    with make_hybrid(lm, random_hot(lm, 0.3, seed=4), "oracle", cpu_dtype="f32", threads=2) as eng:
        gen = Generator(eng.lm)
        got = [e.token_id for e in gen.generate(prompt, max_tokens=12, sampling=greedy, ignore_eos=True)]
        st = eng.stats()
    assert got == want
    assert st["decode"]["tokens"] == 11 and st["prefill"]["tokens"] == 6
    per = st["decode"]["per_token"]
    assert set(per) >= {"gpu_ms", "cpu_ms", "transfer_ms", "wait_ms", "rows_gpu", "rows_cpu"}
    assert per["cpu_ms"] > 0 and per["gpu_ms"] > 0


@pytest.mark.parametrize("family", MOE)
def test_moe_models_run_with_experts_on_the_cpu_by_default(folder, family):
    """Without GPU experts given, MoE layers run hybrid with every expert on the CPU (the MoE layer
    itself: tests/test_moe_executor.py)."""
    ref = reference(folder, family)
    lm = fresh(folder, family)
    with make_hybrid(lm, random_hot(lm, 0.5), "oracle", cpu_dtype="f32", threads=2):
        kinds = [lm.config.ffn_kind(i) for i in range(lm.config.num_layers)]
        for k, b in zip(kinds, lm.model.layers):
            assert isinstance(b.ffn, HybridMoE if k == "moe" else HybridFFN)
            assert k != "moe" or not b.ffn.fast.ids
        toks = tokens(seed=6)
        with torch.inference_mode():
            want = ref.model(toks)
            assert_close(lm.model(toks), want)
        assert_close(decode_logits(lm, toks), want)


# ---------------------------------------------------------------------------------------------
# Learned predictors: hybrid = the reference predictor-sparse forward


@pytest.mark.parametrize("family", DENSE)
def test_hand_built_predictors_match_predicted_sparse(folder, family):
    ref = reference(folder, family)
    preds = random_predictors(ref)
    toks = tokens(seed=7)
    with predicted_sparse(ref.model, preds), torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, family)
    with make_hybrid(lm, random_hot(lm, 0.6, seed=8), preds, cpu_dtype="f32", threads=2):
        assert_close(decode_logits(lm, toks), want, 1e-4)


class UnionFFN(nn.Module):
    """Reference for prefill: every token of the chunk computes the union of the predicted masks."""

    def __init__(self, inner, predictor):
        super().__init__()
        self.inner, self.predictor = inner, predictor

    def forward(self, x):
        mask = self.predictor.predict(x.float())  # [B, T, I]
        union = mask.reshape(-1, mask.shape[-1]).any(0)  # [I]
        return self.inner.down(self.inner.activations(x) * union.to(x.dtype))


@contextlib.contextmanager
def union_sparse(model, preds: PredictorSet):
    originals = {l: model.layers[l].ffn for l in preds.neurons}
    try:
        for l, p in preds.neurons.items():
            model.layers[l].ffn = UnionFFN(originals[l], p)
        yield
    finally:
        for l, f in originals.items():
            model.layers[l].ffn = f


@pytest.fixture(scope="module")
def trained(folder):
    """llama_relu with quickly trained predictors (FFN inputs and true active masks as samples)."""
    ref = reference(folder, "llama_relu")
    xs = ffn_input_samples(ref)
    preds = PredictorSet("test")
    recalls = []
    with torch.inference_mode():
        actives = {l: ref.model.layers[l].ffn.activations(x) > 0 for l, x in xs.items()}
    for l, x in xs.items():
        with torch.inference_mode(False):
            p, m = train_layer(x.clone(), actives[l].clone(), rank=16, layer=l, epochs=6, recall=0.9)
        preds.neurons[l] = p
        recalls.append(m.recall)
    return ref, preds, recalls


@pytest.mark.parametrize("regime", ["cpu", "stream", "stream-chunks"])
def test_trained_predictors_match_references(folder, trained, regime):
    """stream-chunks: each layer's cold rows stream through slots of a few rows (several chunks per
    layer, each with its slice of the predicted mask)."""
    ref, preds, recalls = trained
    assert min(recalls) > 0.6  # they learned something
    toks = tokens(seed=9)
    with predicted_sparse(ref.model, preds), torch.inference_mode():
        want_decode = ref.model(toks)
    with union_sparse(ref.model, preds), torch.inference_mode():
        want_prefill = ref.model(toks)
    assert (want_prefill - want_decode).abs().max() > 1e-3  # the two references differ
    lm = fresh(folder, "llama_relu")
    slots = 4096 if regime == "stream-chunks" else STREAM_SLOTS_BYTES
    with make_hybrid(lm, random_hot(lm, 0.3, seed=10), preds, cpu_dtype="f32", threads=2,
                     prefill=regime.removesuffix("-chunks"), stream_slots_bytes=slots) as eng:
        if regime == "stream-chunks":
            s = eng.streamer
            assert all(len(s.chunks(l)) > 2 for l in eng.layers) and eng.memory()["stream_workspace_bytes"] <= slots
        assert_close(decode_logits(lm, toks), want_decode, 1e-4)
        with torch.inference_mode():
            assert_close(lm.model(toks), want_prefill, 1e-4)
        st = eng.stats()
    assert st["prefill"]["regimes"] == {regime.removesuffix("-chunks"): 3}
    d = st["decode"]
    assert 0 < d["rows_gpu"] + d["rows_cpu"] < 3 * T * lm.config.intermediate_size


def _predicted_sparse_case(folder, family: str, device: str, dtype: str, seed: int):
    """Random predictors for the family's reference, tokens, the predictor-sparse reference's logits
    for them, and a fresh model to convert: (preds, toks, want, lm)."""
    ref = reference(folder, family, device, dtype)
    preds = random_predictors(ref)
    toks = tokens(seed=seed, device=device)
    with predicted_sparse(ref.model, preds), torch.inference_mode():
        want = ref.model(toks)
    return preds, toks, want, fresh(folder, family, device, dtype)


def _placed_on_cpu(folder, family: str, device: str, dtype: str, tol: float) -> None:
    """Attention of layer 0 and the predictor of the last layer placed on the CPU (as a plan may put
    them), and the embedding and LM head in host memory (as a plan counts them), give the logits of
    the predictor-sparse reference; that layer's KV cache is in host memory."""
    preds, toks, want, lm = _predicted_sparse_case(folder, family, device, dtype, seed=16)
    last = lm.config.num_layers - 1
    with make_hybrid(lm, random_hot(lm, 0.4, seed=17), preds, cpu_dtype="f32", threads=2,
                     attention_cpu={0}, predictor_cpu={last}, embed_cpu=True, head_cpu=True) as eng:
        assert [d.type for d in lm.layer_devices] == ["cpu"] + [device] * last
        assert isinstance(lm.model.embed, HostEmbedding) and lm.model.embed.embed.weight.device.type == "cpu"
        if not lm.config.tie_word_embeddings:
            assert isinstance(lm.model.lm_head, HostHead) and lm.model.lm_head.linear.weight.device.type == "cpu"
        assert next(lm.model.layers[0].attn.parameters()).device.type == "cpu"
        mask_fn = eng.layers[last].gpu.mask_fn
        assert mask_fn.device.type == "cpu" and isinstance(mask_fn.l1, HostLinear)
        cache = KVCache(lm.config, 4, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
        assert cache.layers[0][0].device.type == "cpu" and cache.layers[0][0].dtype == torch.float32
        assert_close(decode_logits(lm, toks), want, tol)


def _host_blocks(folder, family: str, device: str, dtype: str, tol: float) -> None:
    """Layers whose attention and predictor are both on the CPU decode as HostBlocks (the residual
    stream on the host for the step) and give the predictor-sparse reference's logits; a prompt runs
    block by block. (OPT's tiny model is pre-norm, with LayerNorms.)"""
    from hotcold.executors.host_block import HostBlock

    preds, toks, want, lm = _predicted_sparse_case(folder, family, device, dtype, seed=18)
    both = {0, lm.config.num_layers - 1}
    with make_hybrid(lm, random_hot(lm, 0.4, seed=19), preds, cpu_dtype="f32", threads=2,
                     attention_cpu=both, predictor_cpu=both) as eng:
        wrapped = [l for l, b in enumerate(lm.model.layers) if isinstance(b, HostBlock) and b.host]
        assert wrapped == sorted(both)
        # on a CPU tier the other llama layers step as one compiled call too (cpu_block_ready)
        rest = [l for l, b in enumerate(lm.model.layers) if isinstance(b, HostBlock) and not b.host]
        assert rest == ([l for l in range(lm.config.num_layers) if l not in both]
                        if device == "cpu" and family != "opt" else [])
        assert_close(decode_logits(lm, toks), want, tol)
        assert sum(lm.model.layers[l].steps for l in wrapped) == len(wrapped) * T  # every decode step went that way
        # llama's and Gemma 3's steps run as one compiled call each (LayerHostNode); OPT's LayerNorms
        # take the module path
        assert [lm.model.layers[l].node_steps for l in wrapped] == [T * (family != "opt")] * len(wrapped)
        assert eng.stats()["decode"]["regimes"]["cpu"] > 0
        with torch.inference_mode():
            lm.model(toks)  # a prompt (the union of its tokens' masks: not the per-token reference)
        assert sum(lm.model.layers[l].steps for l in wrapped) == len(wrapped) * T


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3"])
def test_attention_and_predictor_of_a_layer_on_the_cpu_decode_on_the_host(folder, family):
    _host_blocks(folder, family, "cpu", "float32", 1e-4)


def _layer_nodes(folder, device: str, dtype: str, cpu_dtype: str, tol: float, family: str = "llama") -> None:
    """A CPU-attention layer's one-token step as one compiled call (LayerHostNode: float32 norms and
    residual) gives the logits of the HostBlock's module path (norms and residual in the model's
    dtype), whatever the storage of its matrices and cold rows; on CUDA without statistics the call
    is a host node of the layer's graph."""
    preds = random_predictors(reference(folder, family, device, dtype))
    toks = tokens(seed=21, device=device)
    got = {}
    ways = {"module": dict(layer_nodes=False), "node": dict(layer_nodes=True)}
    if device == "cuda":
        ways["graph"] = dict(layer_nodes=True, stats=False)
    for way, kw in ways.items():
        lm = fresh(folder, family, device, dtype)
        both = [0, lm.config.num_layers - 1]
        with make_hybrid(lm, random_hot(lm, 0.4, seed=22), preds, cpu_dtype=cpu_dtype, threads=2,
                         attention_cpu=set(both), predictor_cpu=set(both), **kw):
            got[way] = decode_logits(lm, toks)
            blocks = [lm.model.layers[l] for l in both]
            assert [b.node_steps for b in blocks] == [T * (way != "module")] * 2
            assert all((b._graph is not None) == (way == "graph") for b in blocks)
            if way == "node":  # a position outside the cache: nothing written, the call reports it
                node = blocks[0]._node
                node.pos[0] = node.ctl[L_S]
                with pytest.raises(RuntimeError, match=r"position out of range \[0, 11\)"):
                    node()
    for way in ways:
        assert_close(got[way], got["module"], tol)


@pytest.mark.parametrize("dtype,cpu_dtype,tol", [("float32", "f16", 1e-5), ("float32", "i8", 1e-5),
                                                 ("bfloat16", "bf16", 5e-2)])
def test_a_layer_step_as_one_compiled_call_equals_the_module_path(folder, dtype, cpu_dtype, tol):
    _layer_nodes(folder, "cpu", dtype, cpu_dtype, tol)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma3"])
def test_a_layer_step_as_one_compiled_call_in_each_rms_family(folder, family):
    """Sliding windows (Mistral), q/k/v biases (Qwen2), QK-norm (Qwen3), and Gemma 3's sandwich and
    QK norms (x (1 + w)), GELU and query scale in the compiled call."""
    _layer_nodes(folder, "cpu", "float32", "f32", 1e-5, family)


@pytest.mark.parametrize("rank", [40, 64])
def test_cpu_predictor_in_q8_0_blocks(rank):
    """A CPU predictor in Q8_0 blocks (its rank padded to the block size) decides as the float32 one
    but for logits within the blocks' rounding of the threshold, one token and several alike, and
    holds only its blocks."""
    torch.manual_seed(rank)
    D, I = 256, 512
    pred = NeuronPredictor(D, I, rank)
    with torch.no_grad():
        pred.w2.bias.add_(-0.1)  # about a third of the neurons predicted active
    perm = torch.randperm(I)
    x = torch.randn(16, D)
    exact = LearnedMask(pred, perm, "cpu", host_threads=2, host_qtype=None)
    q8 = LearnedMask(pred, perm, "cpu", host_threads=2)
    assert isinstance(q8.l1.quant, nn.Module) and exact.l1.quant is None
    want = exact(x)  # [16, I] (several tokens: torch over the dequantised blocks)
    assert torch.equal(want, pred.predict(x)[:, perm])
    with torch.no_grad():
        margin = (pred(x)[:, perm] - pred.threshold).abs()  # distance of each logit from the decision
    for got in (q8(x), torch.cat([q8(x[i:i + 1]) for i in range(16)])):  # several tokens; one at a time (numba)
        assert 0.15 < got.float().mean() < 0.85
        flips = got != want
        assert flips.float().mean() < 0.01 and (margin[flips] < 0.02).all()
    rp = -(-rank // 32) * 32  # the padded rank
    assert q8.nbytes == (rp * D + I * rp) * 34 // 32 + 4 * (rp + I)  # Q8_0 blocks and float32 biases, nothing more


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3"])
def test_attention_and_predictor_placed_on_the_cpu(folder, family):
    _placed_on_cpu(folder, family, "cpu", "float32", 1e-4)
    with pytest.raises(ValueError, match="attention_cpu"):
        make_hybrid(fresh(folder, family), {}, None, attention_cpu={99})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("host", [False, True])
def test_half_precision_predictor_agrees_with_float32(dtype, host, monkeypatch):
    """A predictor in the model's half precision (torch), or on the CPU in Q8_0 blocks (numba for one
    token, a float32 GEMM over the decoded blocks for several) takes the float32 predictor's
    decisions, bar a few at the threshold."""
    from hotcold.executors.gpu_executor import LearnedMask, predictor_dtype
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    torch.manual_seed(0)
    pred = NeuronPredictor(256, 1024, 32).eval()
    perm = torch.randperm(1024)
    x = torch.randn(64, 256)
    want = LearnedMask(pred, perm, "cpu")(x)
    mask = LearnedMask(pred, perm, "cpu", predictor_dtype(dtype), host_threads=2 if host else None)
    got = mask(x.to(dtype))  # several tokens: torch
    one = torch.cat([mask(x[i:i + 1].to(dtype)) for i in range(8)])  # one token: numba gemv when host
    assert got.dtype == torch.bool and got.shape == want.shape
    # one token on the host: Q8_0 rows interleaved, with Q8 activations (0.1-0.15% flips on real inputs)
    assert (got != want).float().mean() < 2e-3 and (one != want[:8]).float().mean() < 4e-3
    assert predictor_dtype(torch.float32) == torch.float32 and predictor_dtype(dtype) == dtype


@pytest.mark.parametrize("hot", [0.25, 0.0])  # 0: every row cold (a CPU plan), sliced rather than gathered
def test_no_predictors_is_dense(folder, hot):
    ref = reference(folder, "qwen2")
    lm = fresh(folder, "qwen2")
    toks = tokens(seed=11)
    with make_hybrid(lm, random_hot(lm, hot) if hot else {}, None, cpu_dtype="f32", threads=2) as eng, \
            torch.inference_mode():
        assert_close(lm.model(toks), ref.model(toks))
        if not hot:
            assert all(f.cold.n == lm.config.intermediate_size for f in eng.layers.values())


def test_a_layer_without_its_predictor_computes_every_neuron(folder):
    """Placement.predictor_off: the layer computes all its neurons (dense) although a predictor exists;
    the other layers still follow theirs."""
    ref = reference(folder, "llama")
    preds = random_predictors(ref)
    off = {0}
    toks = tokens(seed=12)
    with predicted_sparse(ref.model, PredictorSet("test", {l: p for l, p in preds.neurons.items() if l not in off})), \
            torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, "llama")
    with make_hybrid(lm, random_hot(lm, 0.5, seed=13), preds, cpu_dtype="f32", threads=2, predictor_off=off) as eng:
        assert eng.layers[0].gpu.mask_fn is None and eng.layers[1].gpu.mask_fn is not None
        assert_close(decode_logits(lm, toks), want, 1e-4)


# ---------------------------------------------------------------------------------------------
# Storage kinds, prefill regimes


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("kind", ["bf16", "f16", "i8"])
def test_cpu_storage_kinds_and_streaming(folder, family, kind):
    """Cold rows stored in bf16/f16/i8: close to dense; streaming them computes the same as the CPU."""
    ref = reference(folder, family)
    toks = tokens(seed=12)
    with torch.inference_mode():
        dense = ref.model(toks)
    outs = {}
    for regime in ("cpu", "stream", "dense"):
        lm = fresh(folder, family)
        with make_hybrid(lm, random_hot(lm, 0.3), "oracle", cpu_dtype=kind, threads=2, prefill=regime) as eng:
            with torch.inference_mode():
                outs[regime] = lm.model(toks)
            if regime == "cpu":
                assert_close(decode_logits(lm, toks), dense, {"bf16": 3e-2, "f16": 5e-3, "i8": 5e-2}[kind])
            # int8 rows have no GEMM: "dense" falls back to the rows kernel
            want = "cpu" if regime == "dense" and kind == "i8" else regime
            assert set(eng.stats()["prefill"]["regimes"]) == {want}
    assert_close(outs["cpu"], dense, {"bf16": 3e-2, "f16": 5e-3, "i8": 5e-2}[kind])
    assert_close(outs["stream"], outs["cpu"], 1e-4)
    # GEMMs in the rows' dtype round the activations too
    assert_close(outs["dense"], outs["cpu"], {"bf16": 3e-2, "f16": 5e-3, "i8": 1e-6}[kind])


def test_prefill_regime_rule():
    gb = 1 << 30
    kw = dict(cpu_bw=73e9, pcie_bw=52e9, gpu_flops=400e12)
    assert prefill_regime(512, gb, **kw, cuda=False) == "cpu"  # no GPU: never stream
    assert prefill_regime(512, gb, **kw) == "stream"  # long prompt: copy once beats 128 CPU passes
    assert prefill_regime(2, gb, **kw) == "cpu"  # one CPU pass beats the slower PCIe copy
    assert prefill_regime(512, 0, **kw) == "cpu"
    assert prefill_regime(8, gb, **kw, tokens_per_pass=8) == "cpu"
    assert prefill_regime(8, gb, **dict(kw, pcie_bw=200e9), tokens_per_pass=8) == "stream"
    # the CPU's GEMMs: one read of all the rows, or their FLOPs at cpu_flops if slower
    cpu = dict(kw, cpu_bw=25e9, cuda=False)
    assert prefill_regime(64, gb, **cpu, cpu_flops=200e9) == "dense"  # 16 passes of the rows kernel cost more
    assert prefill_regime(64, gb, **cpu, cpu_flops=1e9) == "cpu"  # a slow GEMM
    assert prefill_regime(64, gb, **cpu) == "cpu"  # no GEMM rate: not considered
    assert prefill_regime(4, gb, **cpu, cpu_flops=200e9, selected=0.2) == "cpu"  # one pass over a fifth of the rows
    assert prefill_regime(64, gb, **cpu, cpu_flops=200e9, selected=0.05) == "cpu"  # 16 passes over 5% < one read
    assert prefill_regime(512, gb, **dict(kw, cpu_flops=1e15)) == "dense"  # a CPU faster than PCIe
    from types import SimpleNamespace

    costs = PrefillCosts.from_hardware(SimpleNamespace(cpu_ffn_Bps={"bf16": 30e9}, h2d_pinned_Bps=None))
    assert costs.cpu_bw == 30e9 and costs.pcie_bw == PrefillCosts().pcie_bw


@pytest.mark.parametrize("cpu_flops, want", [(1e3, "cpu"), (1e15, "dense"), (None, None)])
def test_auto_regime_without_cuda_never_streams(folder, monkeypatch, cpu_flops, want):
    """On a CPU tier "auto" picks the rows kernel or GEMMs by their costs, never streaming; without a
    GEMM rate the engine times one (the regime is then this machine's choice, one per layer). The
    rows kernel's token tile is cut to 4 tokens, as at D = 4096 (at D = 64 it would be 256)."""
    from hotcold.sparse_ops import cpu as cpu_ops

    monkeypatch.setattr(cpu_ops, "_TILE_BYTES", 4 * 4 * 64)
    lm = fresh(folder, "llama")
    costs = PrefillCosts(cpu_bw=25e9, cpu_flops=cpu_flops)
    with make_hybrid(lm, random_hot(lm, 0.5), None, cpu_dtype="f32", threads=2, costs=costs) as eng:
        with torch.inference_mode():
            lm.model(tokens(40))
        regimes = eng.stats()["prefill"]["regimes"]
        assert sum(regimes.values()) == 3 and "stream" not in regimes
        if want:
            assert regimes == {want: 3}
        else:
            assert eng.layers[0].costs.cpu_flops > 1e8  # measured (a 2-core machine: ~1e11)


# ---------------------------------------------------------------------------------------------
# The worker thread and memory


def test_worker_thread_lifecycle(folder):
    lm = fresh(folder, "llama")
    eng = make_hybrid(lm, random_hot(lm, 0.5), None, cpu_dtype="f32", threads=1, cpu_inline=False)  # as on CUDA
    cpu = eng.cpu
    assert cpu.alive and cpu.thread_count == 1  # numba's threads were set inside the worker
    cold = eng.layers[0].cold
    bad = ColdJob(cold, np.zeros((1, 5), np.float32), None, np.zeros((1, 64), np.float32))
    with pytest.raises(RuntimeError, match="CPU executor failed"):
        cpu.submit(bad).wait()
    assert cpu.alive  # an error fails the job, not the worker
    with torch.inference_mode():
        lm.model(tokens(3))
    n_threads = threading.active_count()
    eng.close()
    assert not cpu.alive and threading.active_count() == n_threads - 1
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        cpu.submit(bad)


def test_cpu_tier_runs_cold_parts_inline(folder):
    """On a CPU fast tier the cold parts run in the calling thread (no worker thread, no second
    OpenMP team); an error still fails the job with the same message; results are the worker's."""
    ref = reference(folder, "llama")
    toks = tokens(seed=31)
    want = {}
    for inline in (False, True):
        lm = fresh(folder, "llama")
        n_threads = threading.active_count()
        with make_hybrid(lm, random_hot(lm, 0.5), "oracle", cpu_dtype="f32", threads=1, cpu_inline=inline) as eng:
            assert eng.cpu.inline == inline and threading.active_count() == n_threads + (not inline)
            want[inline] = decode_logits(lm, toks)
            if inline:
                bad = ColdJob(eng.layers[0].cold, np.zeros((1, 5), np.float32), None, np.zeros((1, 64), np.float32))
                with pytest.raises(RuntimeError, match="CPU executor failed"):
                    eng.cpu.submit(bad).wait()
        assert not eng.cpu.alive
    assert torch.equal(want[True], want[False])
    assert_close(want[True], decode_logits(ref, toks))


def test_huge_page_share_reads_smaps_rollup():
    from hotcold.executors.stats import huge_page_share, parse_smaps_rollup

    text = ("55d0c0a00000-7ffd1b1fe000 ---p 00000000 00:00 0      [rollup]\nRss:             2097152 kB\n"
            "Pss:             2000000 kB\nAnonymous:       1048576 kB\nAnonHugePages:    786432 kB\n")
    assert parse_smaps_rollup(text) == (2097152 * 1024, 1048576 * 1024, 786432 * 1024)
    assert parse_smaps_rollup(text.replace("AnonHugePages", "ShmemHugePages")) is None
    live = huge_page_share()
    if os.path.exists("/proc/self/smaps_rollup"):
        assert live is not None and 0 < live[1] <= live[0] and 0 <= live[2] <= live[1]
    else:
        assert live is None


def test_worker_finishes_queued_jobs_before_stopping():
    cpu = CPUExecutor(threads=1)
    lm_ffn = nn.Linear(8, 8)  # any object: the jobs below fail, but each is answered
    jobs = [cpu.submit(ColdJob(lm_ffn, np.zeros((1, 8), np.float32), None, np.zeros((1, 8), np.float32)))
            for _ in range(5)]
    cpu.close()
    assert all(j.done.is_set() for j in jobs) and not cpu.alive


def test_original_ffn_weights_released(folder):
    lm = fresh(folder, "opt")
    ffns = [b.ffn for b in lm.model.layers]
    refs = [weakref.ref(p) for f in ffns for p in f.parameters()]
    nbytes = sum(p.numel() * p.element_size() for f in ffns for p in f.parameters())
    del ffns
    eng = make_hybrid(lm, random_hot(lm, 0.4), None, cpu_dtype="f32", threads=1)
    gc.collect()
    assert all(r() is None for r in refs), "an original FFN parameter is still referenced"
    mem = eng.memory()
    assert mem["fast_ffn_bytes"] + mem["host_ffn_bytes"] == nbytes  # every weight once, nothing more
    eng.close()


_RSS_SCRIPT = r"""
import gc, psutil, torch
from hotcold.executors.engine import make_hybrid, random_hot
from hotcold.models.config import config_from_hf
from hotcold.models.loader import LoadedModel
from hotcold.models.transformer import Transformer

def random_llama(intermediate):
    config = config_from_hf(dict(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=intermediate,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=64), source="test")
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return LoadedModel(model.eval(), None, config, ".", "test", torch.device("cpu"), torch.float32)

rss = lambda: psutil.Process().memory_info().rss
small = random_llama(256)  # one-time costs (worker thread, numba threads, lazy imports) first
make_hybrid(small, random_hot(small, 0.3), None, cpu_dtype="f32", threads=1).close()
lm = random_llama(5504)
gc.collect()
before = rss()
eng = make_hybrid(lm, random_hot(lm, 0.3), None, cpu_dtype="f32", threads=1)
gc.collect()
print(rss() - before)
eng.close()
"""


def test_rss_not_duplicated():
    """A 4-layer model with 64 MiB of FFN weights: converting it (f32 cold rows) adds < 1/4 of them.
    Measured in a fresh process whose malloc returns every large block to the system when freed
    (MALLOC_MMAP_THRESHOLD_ fixed): glibc's adaptive threshold otherwise keeps freed original
    weights in its heap, and the reading depended on what ran before (8-24 MiB)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    ffn_bytes = 4 * 3 * 256 * 5504 * 4
    assert grown < ffn_bytes / 4, f"RSS grew by {grown / 2**20:.1f} MiB for {ffn_bytes / 2**20:.0f} MiB of FFN weights"


def test_split_rejects_bad_plans(folder):
    lm = fresh(folder, "llama")
    ffn = lm.model.layers[0].ffn
    with pytest.raises(ValueError, match="out of range"):
        split_ffn(ffn, [0, 96], "silu", "cpu", torch.float32)
    with pytest.raises(ValueError, match="repeat"):
        split_ffn(ffn, [1, 1], "silu", "cpu", torch.float32)
    with pytest.raises(ValueError, match="cpu_dtype"):
        split_ffn(ffn, [1], "silu", "cpu", torch.float32, cpu_kind="q4")
    with pytest.raises(ValueError, match="no dense or gated FFN"):
        make_hybrid(fresh(folder, "mixtral"), {0: torch.arange(3)}, None)


# ---------------------------------------------------------------------------------------------
# CUDA: the same checks with the GPU as the fast tier


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["llama", "opt", "gemma3", "qwen2_moe"])
def test_cuda_oracle_matches_dense(folder, family):
    ref = reference(folder, family, "cuda", "float32")
    toks = tokens(seed=13, device="cuda")
    thr = gap_thresholds(ref, toks)
    with instrumented(ref.model, thr), torch.inference_mode():
        want = ref.model(toks)
    with torch.inference_mode():
        dense = ref.model(toks)
    for frac in (0.0, 0.5, 1.0):
        lm = fresh(folder, family, "cuda", "float32")
        with make_hybrid(lm, random_hot(lm, frac), "oracle", cpu_dtype="f32", thresholds=thr) as eng:
            assert_close(decode_logits(lm, toks), want, 1e-4)
            st = eng.stats()["decode"]
            assert st["tokens"] == T and (frac == 1.0 or st["transfer_s"] > 0)
        lm = fresh(folder, family, "cuda", "float32")
        with make_hybrid(lm, random_hot(lm, frac), "oracle", cpu_dtype="f32") as eng, torch.inference_mode():
            assert_close(lm.model(toks), dense, 1e-4)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family, cpu_dtype, pred", [("llama_relu", "f32", "oracle"), ("llama", "bf16", None),
                                                     ("opt", "i8", "oracle")])
def test_cuda_dense_host_node_steps_match_split_graphs(folder, family, cpu_dtype, pred):
    """dense_host_nodes: a dense or gated layer's graphed decode step is one graph whose cold rows run
    as a host node (FFNHostNode: CUDA's callback thread, numba cfunc); its logits equal the split
    graphs' (same kernels, same order of sums), every node ran once a step, and with every block one
    graph the whole step becomes one (cuda_graphs="step")."""
    from hotcold.executors.graphs import GraphedBlock

    ref = reference(folder, family, "cuda", "float32")
    toks = tokens(seed=18, device="cuda")
    thr = gap_thresholds(ref, toks) if pred else None
    got, ran = {}, {}
    for host in (False, True, "step"):
        lm = fresh(folder, family, "cuda", "float32")
        with make_hybrid(lm, random_hot(lm, 0.5, seed=3), pred, cpu_dtype=cpu_dtype, thresholds=thr, stats=False,
                         threads=2, dense_host_nodes=bool(host), cuda_graphs="step" if host == "step" else True) as eng:
            got[host] = decode_logits(lm, toks).cpu()
            blocks = [b for b in lm.model.layers if isinstance(b, GraphedBlock)]
            assert len(blocks) == lm.config.num_layers and all(b.replays >= 1 for b in blocks)
            ran[host] = [(b.captured.out is not None, f._node.calls if f._node is not None else 0)
                         for b, f in zip(blocks, (b.block.ffn for b in blocks))]
            if host == "step":
                assert lm.model.one_token_step.replays == T - 1
    assert ran[False] == [(False, 0)] * len(ran[False])
    assert ran[True] == ran["step"] == [(True, T)] * len(ran[True])
    for host in (True, "step"):
        assert ((got[host] - got[False]).abs().max() / got[False].abs().max()).item() < 1e-5


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("regime", ["cpu", "stream", "dense"])
def test_cuda_predictors_and_regimes(folder, regime):
    ref = reference(folder, "llama_relu", "cuda", "float32")
    preds = random_predictors(ref)
    toks = tokens(seed=14, device="cuda")
    with predicted_sparse(ref.model, preds), torch.inference_mode():
        want_decode = ref.model(toks)
    with union_sparse(ref.model, preds), torch.inference_mode():
        want_prefill = ref.model(toks)
    lm = fresh(folder, "llama_relu", "cuda", "float32")
    with make_hybrid(lm, random_hot(lm, 0.3), preds, cpu_dtype="f32", prefill=regime) as eng:
        assert_close(decode_logits(lm, toks), want_decode, 1e-4)
        with torch.inference_mode():
            assert_close(lm.model(toks), want_prefill, 1e-4)
        assert eng.stats()["prefill"]["regimes"] == {regime: 3}


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["llama", "opt", "gemma3"])
def test_cuda_attention_and_predictor_placed_on_the_cpu(folder, family):
    _placed_on_cpu(folder, family, "cuda", "float32", 1e-4)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_attention_and_predictor_of_a_layer_on_the_cpu_decode_on_the_host(folder, family):
    _host_blocks(folder, family, "cuda", "float32", 1e-4)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype,cpu_dtype,tol,family", [("float32", "f16", 1e-5, "llama"), ("bfloat16", "bf16", 5e-2, "llama"),
                                                        ("float32", "f32", 1e-5, "qwen3"), ("float32", "f32", 1e-5, "gemma3")])
def test_cuda_a_layer_step_as_one_compiled_call_equals_the_module_path(folder, dtype, cpu_dtype, tol, family):
    _layer_nodes(folder, "cuda", dtype, cpu_dtype, tol, family)


@pytest.mark.cuda
@CUDA
def test_cuda_bf16_generate(folder):
    ref = reference(folder, "llama", "cpu", "float32")
    lm = fresh(folder, "llama")  # loaded on the CPU, converted onto the GPU in bf16
    toks = tokens(seed=15)
    with torch.inference_mode():
        dense = ref.model(toks)
    with make_hybrid(lm, random_hot(lm, 0.5), "oracle", device="cuda", dtype=torch.bfloat16) as eng:
        assert lm.device.type == "cuda" and lm.dtype == torch.bfloat16
        assert_close(decode_logits(lm, toks.cuda()).cpu(), dense, 5e-2)
        out = list(Generator(eng.lm).generate(tokens(4)[0].tolist(), max_tokens=8,
                                             sampling=SamplingParams(temperature=0.0), ignore_eos=True))
        assert len(out) == 8


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 15, 16, 17])
@pytest.mark.parametrize("smt", [1, 2])
def test_default_threads_leave_two_cpus_beside_a_gpu(cores, smt, monkeypatch):
    """A CPU tier takes every physical core; beside a GPU the CPU experts' team leaves two CPUs to the
    thread driving the GPU and CUDA's threads (on 2 cores or fewer, every core), and only such a team
    may spin once the main thread's team is ended."""
    import numba
    import psutil

    from hotcold import machine

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: cores * smt if logical else cores)
    monkeypatch.setattr(machine, "available_cpus", lambda: cores * smt)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 64)
    assert machine.default_threads(cuda=False) == cores
    t = machine.default_threads(cuda=True)
    if cores <= 2:
        assert t == cores
    else:
        assert t == min(cores, cores * smt - 2) and t >= 1
        assert machine.spare_cpus_for_spinning(t) and not machine.spare_cpus_for_spinning(cores * smt - 1)
