"""hotcold.executors on quantised models: the hybrid engine keeps the CPU side in GGUF blocks.

Tiny random models (tests/tiny_models.py) are quantised in place (`quantize_model`, what
`load_model(..., quantize=)` does): q8_0 and q4_0 on the usual tiny shapes (D = 64, I = 96), q4_k on
wider ones (D = 256, I = 512: K-quants need rows of 256). The hybrid engine must compute the
*quantised* dense model: its logits are compared with that reference's, prefill and every decode
step. They are not bit-equal: the cold W_down is requantised to Q8_0 when transposed (~0.5% relative
error on the cold share) and Q4_0's one-token kernels round x to Q8 where the reference rounds it in
other places; so the tolerances are relative to the largest |logit|, and a test checks that they
are well below the gap between the float and the quantised model (a hybrid computing float weights
would fail). The SmolLM2 Q4_1 GGUF runs hybrid too (slow).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from hotcold.executors import HybridFFN, make_hybrid, random_hot
from hotcold.executors.expert_cache import ExpertCache
from hotcold.executors.graphs import split_step
from hotcold.executors.host_attention import HostAttention
from hotcold.executors.moe import HybridMoE, random_experts
from hotcold.executors.weights import ColdFFN, HotFFN, quant_cols_t, split_ffn
from hotcold.models.generate import Generator
from hotcold.models.loader import LoadedModel, load_model
from hotcold.models.quantized import QUANTIZE_TYPES, QuantLinear, quantize_model
from hotcold.models.sampling import SamplingParams
from hotcold.models.transformer import KVCache
from hotcold.sparse_ops.gpu import hot_ffn
from hotcold.sparse_ops.gpu_quant import INT4_DOWN_DEFAULT, Int4Matrix, int4_padded
from hotcold.sparse_ops.quant import QTYPES, QuantMatrix, qdequantize, random_matrix
from test_executors import T, decode_logits, tokens
from tiny_models import COMMON, make_tiny

FAMILIES = ["llama", "opt", "qwen3_moe", "qwen2_moe"]  # gated; ungated with biases; MoE; MoE + shared + a gated layer
KINDS = ["q8_0", "q4_0", "q4_k"]
TOL = {"q8_0": 1.5e-2, "q4_0": 4e-2, "q4_k": 4e-2}  # relative to the largest |logit|, per step (Q4_0 and Q4_K
# round x to Q8 per block, as llama.cpp does)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_quant")


def make_wide(family: str, folder: Path, seed: int = 0) -> Path:
    """The family's tiny model with D = 256, I = 512 (MoE experts: 256), so Q4_K can hold its rows."""
    import transformers as Tr

    out = folder / f"{family}_wide"
    if not (out / "config.json").exists():
        common = {**COMMON, "hidden_size": 256, "intermediate_size": 512}
        cfg = {
            "llama": lambda: Tr.LlamaConfig(**common),
            "opt": lambda: Tr.OPTConfig(vocab_size=160, hidden_size=256, ffn_dim=512, num_hidden_layers=3,
                                        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=256,
                                        init_std=0.1),
            "qwen3_moe": lambda: Tr.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=256, head_dim=64, norm_topk_prob=True),
            "qwen2_moe": lambda: Tr.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                                   mlp_only_layers=[1]),
        }[family]()
        torch.manual_seed(seed)
        Tr.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def model_path(folder: Path, family: str, kind: str) -> Path:
    return make_wide(family, folder) if kind == "q4_k" else make_tiny(family, folder)


_REFS: dict = {}


def reference(folder: Path, family: str, kind: str, quantized: bool = True) -> LoadedModel:
    """The dense model quantised as kind (quantized=False: the float32 model of the same shape),
    loaded once; never converted."""
    key = (family, kind, quantized)
    if key not in _REFS:
        lm = load_model(model_path(folder, family, kind), "cpu", "float32")
        if quantized:
            left = quantize_model(lm.model, kind)  # every matrix but the tiny qwen2_moe's shared W_down (I = 48)
            assert all(n.endswith("shared.down") for n in left), left
        _REFS[key] = lm
    return _REFS[key]


def fresh(folder: Path, family: str, kind: str) -> LoadedModel:
    return copy.deepcopy(reference(folder, family, kind))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


ROUTING_TIE = 2e-3  # router probabilities of a layer's k-th and (k+1)-th expert closer than this: a near tie


def near_ties(lm: LoadedModel, toks: torch.Tensor) -> set[int]:
    """The decode steps at which some MoE layer of lm routes with a near tie between its k-th and
    (k+1)-th expert: there the quantised kernels' rounding (Q8 activations, another summation order)
    may pick the other expert, a different but not a wrong result (seen: qwen2_moe q4_0, step 8,
    layer 2: probabilities 0.00024 apart)."""
    from hotcold.models.layers import MoEFFN

    ties, step, hooks = set(), [0], []
    for b in lm.model.layers:
        if isinstance(b.ffn, MoEFFN):
            def hook(mod, inp, out, k=b.ffn.top_k):
                p = torch.softmax(out.float(), -1)[-1].sort(descending=True).values
                if p[k - 1] - p[k] < ROUTING_TIE:
                    ties.add(step[0])
            hooks.append(b.ffn.router.register_forward_hook(hook))
    try:
        cache = KVCache(lm.config, toks.shape[1] + 1, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
        with torch.inference_mode():
            for i in range(toks.shape[1]):
                step[0] = i
                lm.model(toks[:, i:i + 1], i, cache)
    finally:
        for h in hooks:
            h.remove()
    return ties


def row_bytes(qtype: str, cols: int) -> int:
    _, bs, ts = QTYPES[qtype]
    return cols // bs * ts


def colds(eng) -> list[ColdFFN]:
    return [f.cold for f in eng.layers.values() if f.cold.n] + [m.cold for m in eng.moe.values() if m.cold is not None]


def check_cold_quantized(eng, kind: str, dim: int) -> None:
    """Every cold part is GGUF blocks (up/gate in kind's type; a dense FFN's W_down transposed Q8_0,
    CPU experts' W_down in kind's own blocks, untransposed) and the host holds exactly their bytes:
    about a quarter (Q8_0) or less of float32."""
    qtype = QUANTIZE_TYPES[kind]
    want = 0
    for c in colds(eng):
        assert c.quantized and all(isinstance(m, QuantMatrix) for m in c.mats)
        assert c.up.qtype == qtype and (c.gate is None or c.gate.qtype == qtype)
        assert c.up.shape == (c.n, dim)
        if c.down is not None:  # whole experts: [E_cpu * D, I] as the file stores W_down
            assert c.down_t is None and c.down.qtype == qtype
            n_exp = c.down.rows // dim
            assert c.down.shape == (n_exp * dim, c.n // n_exp)
            want += c.n * (row_bytes(qtype, dim) * 2 + row_bytes(qtype, dim))  # down: D rows of I = I rows of D
        else:
            assert c.down_t.qtype == "Q8_0" and c.down_t.shape == (c.n, dim)
            want += c.n * (row_bytes(qtype, dim) * (2 if c.gate is not None else 1) + row_bytes("Q8_0", dim))
        want += 0 if c.up_bias is None else c.up_bias.nbytes
        float_bytes = 4 * c.n * dim * len(c.mats)
        assert sum(m.nbytes for m in c.mats) < 0.3 * float_bytes
    mem = eng.memory()
    assert mem["host_ffn_bytes"] == want > 0
    assert mem["stream_workspace_bytes"] == 0  # quantised cold parts are never streamed


# ---------------------------------------------------------------------------------------------
# Oracle predictors: the hybrid engine computes the quantised reference model


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_matches_quantized_reference(folder, family, kind):
    ref = reference(folder, family, kind)
    toks = tokens(seed=7)
    with torch.inference_mode():
        want = ref.model(toks)
        float_logits = reference(folder, family, kind, quantized=False).model(toks)
    want_dec = decode_logits(ref, toks)
    lm = fresh(folder, family, kind)
    with make_hybrid(lm, random_hot(lm, 0.4, seed=1), "oracle", threads=2,
                     gpu_experts=random_experts(lm, 0.5, seed=1)) as eng:
        assert all(isinstance(b.ffn, (HybridFFN, HybridMoE)) for b in lm.model.layers)
        check_cold_quantized(eng, kind, lm.config.hidden_size)
        with torch.inference_mode():
            got = lm.model(toks)
        got_dec = decode_logits(lm, toks)
        st = eng.stats()
    tol = TOL[kind]
    assert rel_err(got, want) < tol
    ties = near_ties(ref, toks)
    assert len(ties) <= 2, ties  # (a test that skipped most steps would test nothing)
    for i in range(T):  # every decode step on its own, but for a top-k near tie that rounding may flip
        if i not in ties:
            assert rel_err(got_dec[:, i], want_dec[:, i]) < tol, f"decode step {i}"
    assert st["prefill"]["regimes"].get("stream", 0) == 0
    d = st["decode"]
    assert d["rows_cpu"] + d["experts_cpu"] > 0 and d["rows_gpu"] + d["experts_gpu"] > 0
    # the tolerance is far below what the quantisation itself changes: float weights would fail it
    if kind != "q8_0":
        assert rel_err(float_logits, want) > 3 * max(rel_err(got, want), rel_err(got_dec, want_dec))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_mapped_cpu_experts_match_quantized_reference(folder, family, kind):
    """map_experts: the CPU experts are the file's own blocks, read in place (every expert at its
    position, the fast tier's never read); prefill, streamed prefill and decode equal the quantised
    reference as the interleaved copies do."""
    ref = reference(folder, family, kind)
    toks = tokens(seed=11)
    with torch.inference_mode():
        want = ref.model(toks)
    want_dec = decode_logits(ref, toks)
    ties = near_ties(ref, toks)
    for prefill in ("auto", "stream"):
        lm = fresh(folder, family, kind)
        gpu = random_experts(lm, 0.25, seed=4)
        blocks = {l: b.ffn.experts.qup.data for l, b in enumerate(lm.model.layers) if hasattr(b.ffn, "experts")}
        with make_hybrid(lm, {}, None, threads=2, gpu_experts=gpu, map_experts=True, prefill=prefill,
                         expert_stream_bytes=1) as eng:
            for l, h in eng.moe.items():
                cold, n = h.cold, lm.config.num_experts
                assert cold.up.rows == n * lm.config.moe_intermediate_size and not cold.up.interleaved
                assert cold.up.data is blocks[l]  # the model's own blocks (a GGUF's: its mapping), not a copy
                on_gpu = set(torch.as_tensor(gpu[l]).tolist())
                assert h.pos.tolist() == [-1 if e in on_gpu else e for e in range(n)]
            with torch.inference_mode():
                got = lm.model(toks)
            if prefill == "auto":
                got_dec = decode_logits(lm, toks)
            st = eng.stats()
        assert rel_err(got, want) < TOL[kind], prefill
        assert st["prefill"]["experts_cpu" if prefill == "auto" else "rows_streamed"] > 0
    for i in range(T):
        if i not in ties:
            assert rel_err(got_dec[:, i], want_dec[:, i]) < TOL[kind], f"decode step {i}"


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_all_cpu_moe_layers_decode_inside_the_fused_step(folder, kind, monkeypatch):
    """Every expert on the host, a CPU tier and an inline executor (an all-CPU plan): each MoE layer's
    one token is computed by HybridMoE.host_decode inside the block's fused step, bit for bit the
    module path's logits (the same routing and expert kernel), and the quantised reference's within
    the tolerance. A layer with a shared expert (qwen2_moe) keeps the module path."""
    ref = reference(folder, "qwen3_moe", kind)
    toks = tokens(seed=12)
    want = decode_logits(ref, toks)
    ties = near_ties(ref, toks)
    lm = fresh(folder, "qwen3_moe", kind)
    took, real = [], HybridMoE.host_decode
    monkeypatch.setattr(HybridMoE, "host_decode", lambda self, x, out: took.append(real(self, x, out)) or took[-1])
    with make_hybrid(lm, {}, None, threads=2, gpu_experts=random_experts(lm, 0.0)) as eng:
        assert eng.moe and all(h.n_cold == lm.config.num_experts for h in eng.moe.values())
        got = decode_logits(lm, toks)
        assert len(took) == T * len(eng.moe) and all(took)
        monkeypatch.setattr(HybridMoE, "host_decode", lambda self, x, out: False)
        module = decode_logits(lm, toks)
    assert torch.equal(got, module)
    for i in range(T):
        if i not in ties:
            assert rel_err(got[:, i], want[:, i]) < TOL[kind], f"decode step {i}"
    lm = fresh(folder, "qwen2_moe", kind)
    monkeypatch.setattr(HybridMoE, "host_decode", real)
    with make_hybrid(lm, {}, None, threads=2, gpu_experts=random_experts(lm, 0.0)) as eng:
        h = next(iter(eng.moe.values()))
        assert h.shared is not None and not h.host_decode(np.zeros(h.dim, np.float32), np.zeros(h.dim, np.float32))


@pytest.mark.parametrize("family", ["llama", "opt", "qwen2_moe"])
def test_all_hot_and_all_cold(folder, family):
    """The two ends of a plan: every neuron on the fast tier (dequantised), or none."""
    ref = reference(folder, family, "q8_0")
    toks = tokens(seed=8)
    want = decode_logits(ref, toks)
    for frac in (0.0, 1.0):
        lm = fresh(folder, family, "q8_0")
        with make_hybrid(lm, random_hot(lm, frac, seed=2), None, threads=2,
                         gpu_experts=random_experts(lm, frac, seed=2)) as eng:
            assert rel_err(decode_logits(lm, toks), want) < TOL["q8_0"]
            if frac == 1.0:
                assert eng.memory()["host_ffn_bytes"] == 0


def test_forced_stream_prefill_runs_on_the_cpu(folder):
    """prefill="stream" cannot stream blocks: quantised cold parts take the CPU regime."""
    ref = reference(folder, "llama", "q4_0")
    toks = tokens(seed=9)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, "llama", "q4_0")
    with make_hybrid(lm, random_hot(lm, 0.3), None, threads=2, prefill="stream") as eng:
        assert eng.streamer is None
        with torch.inference_mode():
            got = lm.model(toks)
        assert eng.stats()["prefill"]["regimes"] == {"cpu": 3}
    assert rel_err(got, want) < TOL["q4_0"]


def test_cpu_attention_uses_the_blocks(folder):
    """Attention placed on the CPU multiplies from the QuantLinear's blocks (numba gemv dispatches)."""
    ref = reference(folder, "llama", "q4_0")
    toks = tokens(seed=10)
    want = decode_logits(ref, toks)
    lm = fresh(folder, "llama", "q4_0")
    with make_hybrid(lm, random_hot(lm, 0.5), None, threads=2, attention_cpu={0, 2}) as eng:
        for l in (0, 2):
            a = lm.model.layers[l].attn
            assert isinstance(a, HostAttention) and isinstance(a.attn.q.host, QuantMatrix)
            assert isinstance(a.attn.q.quant, QuantLinear)
        assert isinstance(lm.model.layers[1].attn.q, QuantLinear)  # the CPU tier keeps the rest quantised too
        got = decode_logits(lm, toks)
        # no predictor: those layers decode as HostBlocks (executors/host_block.py), from the blocks too
        assert [lm.model.layers[l].steps for l in (0, 2)] == [T, T]
        assert [lm.model.layers[l].node_steps for l in (0, 2)] == [T, T]  # each step one compiled call
        with torch.inference_mode():
            prefill = lm.model(toks)
        assert eng.stats()["decode"]["host_s"] > 0
    assert rel_err(got, want) < TOL["q4_0"]
    with torch.inference_mode():
        assert rel_err(prefill, ref.model(toks)) < TOL["q4_0"]


def test_prefill_decodes_busy_cpu_experts_once(folder, monkeypatch):
    """In a prompt chunk, a CPU expert routed by many tokens is decoded once for all of them
    (qexpert_batch), the others run over their blocks for all their tokens in one call
    (qexperts_tokens); the logits equal the quantised reference either way."""
    import hotcold.executors.moe_host as M

    calls = {"batch": 0, "one": 0}
    for name, key in (("qexpert_batch", "batch"), ("qexperts_tokens", "one")):
        def counted(*a, _f=getattr(M, name), _k=key, **kw):
            calls[_k] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(M, name, counted)
    monkeypatch.setattr(M, "EXPERT_BATCH_TOKENS", 6)
    ref = reference(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=9)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, "qwen3_moe", "q4_0")
    with make_hybrid(lm, {}, None, threads=2, gpu_experts=random_experts(lm, 0.25, seed=2)) as eng:
        with torch.inference_mode():
            got = lm.model(toks)
        assert eng.stats()["prefill"]["experts_cpu"] > 0
    assert rel_err(got, want) < TOL["q4_0"]
    assert calls["batch"] > 0 and calls["one"] > 0, calls


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_cache_with_quantized_experts(folder, family):
    """Cached host experts are decoded into the slots (tier dtype); decode still equals the reference."""
    ref = reference(folder, family, "q8_0")
    toks = tokens(seed=21)
    want = decode_logits(ref, toks)
    lm = fresh(folder, family, "q8_0")
    c = lm.config
    nbytes = 3 * ExpertCache.slot_bytes(c.moe_intermediate_size, c.hidden_size, "f32")
    with make_hybrid(lm, {}, None, cpu_dtype="i8", threads=2, gpu_experts=random_experts(lm, 0.25, seed=3),
                     expert_cache_bytes=nbytes, prefetch_experts=c.top_k) as eng:
        cache = next(iter(eng.moe.values())).cache
        assert cache.kind == "f32" and cache.n_slots == 3  # the tier's dtype, whatever cpu_dtype says
        got = decode_logits(lm, toks)
        st = eng.stats()["decode"]
    for i in range(T):
        assert rel_err(got[:, i], want[:, i]) < TOL["q8_0"], f"decode step {i}"
    assert st["experts_prefetched"] > 0 and st["experts_cached"] > 0


# ---------------------------------------------------------------------------------------------
# The split itself


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_split_ffn_parts(folder, kind, monkeypatch):
    """Hot part: exactly the dequantised rows / columns (W_down decoded a few rows at a time); cold
    part: the cold rows' own blocks, and W_down's cold columns transposed to Q8_0."""
    import hotcold.executors.weights as W
    import hotcold.models.quantized as Q

    monkeypatch.setattr(W, "_COL_CHUNK_BYTES", 4 * 96 * 5)  # 5 rows of W_down per chunk
    monkeypatch.setattr(W, "BLOCK_ROWS", 7)
    monkeypatch.setattr(Q, "CHUNK_BYTES", 1)  # hot rows decoded one at a time
    lm = fresh(folder, "opt", kind)
    ffn = lm.model.layers[1].ffn
    I = ffn.up.out_features
    hot = torch.randperm(I, generator=torch.Generator().manual_seed(0))[:37]
    hot_part, cold, down_bias = split_ffn(ffn, hot, "relu", "cpu", torch.float32)
    up, down = ffn.up.weight, ffn.down.weight  # dequantised [I, D], [D, I]
    assert torch.equal(hot_part.up, up[hot]) and torch.equal(hot_part.down_t, down[:, hot].T)
    assert torch.equal(hot_part.up_bias, ffn.up.bias[hot]) and torch.equal(down_bias, ffn.down.bias)
    c = np.setdiff1d(np.arange(I), hot.numpy())
    assert np.array_equal(cold.idx, c) and np.array_equal(cold.up.data, ffn.up.qweight.data[c])
    assert np.array_equal(cold.up_bias, ffn.up.bias[c].numpy())
    want = down[:, c].T.numpy()
    assert np.abs(qdequantize(cold.down_t) - want).max() < 0.01 * np.abs(want).max()  # Q8_0 rounding


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_quant_cols_t_selects_and_transposes(qtype):
    m = random_matrix(qtype, (64, 2048), seed=1)
    cols = np.sort(np.random.default_rng(0).choice(2048, 300, replace=False))
    t = quant_cols_t(m, cols)
    assert t.qtype == "Q8_0" and t.shape == (300, 64)
    want = qdequantize(m)[:, cols].T
    assert np.abs(qdequantize(t) - want).max() <= 0.01 * np.abs(want).max()
    assert quant_cols_t(m, np.zeros(0, np.int64)).shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# int4 hot rows (`--gpu-int4`), on the CPU through torch's CPU twin kernels (int4_hot=True)


def int4_weights(hot: HotFFN) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The float32 weights hot's kernels multiply by, [H, D] each (padding neurons dropped), and up_bias [H]."""
    h = hot.n
    deq = lambda m: m.dequantize(torch.float32)  # noqa: E731 ([N, K], through the kernel itself)
    down = deq(hot.down_t).T if isinstance(hot.down_t, Int4Matrix) else hot.down_t.float()  # [H', D] or [H, D]
    return (deq(hot.up)[:h], None if hot.gate is None else deq(hot.gate)[:h], down[:h],
            None if hot.up_bias is None else hot.up_bias[:h].float())


def check_int4_hot(eng, device, int4_down: bool, ref: LoadedModel | None = None) -> None:
    """Every split layer's hot rows are int4 (the test fails if they were silently expanded): up/gate
    Int4Matrix padded to the kernels' multiple, W_down's columns a tensor [H, D] or an Int4Matrix
    [D, H']; each layer's hot FFN equals hot_ffn over the weights its kernels hold, and those are
    ref's hot rows (up to the bf16 rounding of scales and zeros)."""
    gen = torch.Generator().manual_seed(0)
    for f in eng.layers.values():
        hot, gpu = f.gpu.hot, f.gpu
        if not hot.n:
            continue
        n = int4_padded(hot.n, device, as_k=int4_down)
        assert hot.int4 and hot.int4_skipped is None and isinstance(hot.up, Int4Matrix)
        assert hot.up.shape == (n, f.dim) and hot.up.qtype in ("Q4_0", "Q4_K")
        assert hot.gate is None or (isinstance(hot.gate, Int4Matrix) and hot.gate.shape == (n, f.dim))
        if int4_down:
            assert isinstance(hot.down_t, Int4Matrix) and hot.down_t.shape == (f.dim, n)
        else:
            assert isinstance(hot.down_t, torch.Tensor) and hot.down_t.shape == (hot.n, f.dim)
        x = torch.randn(5, f.dim, generator=gen).to(device)
        mask = torch.rand(5, hot.n, generator=gen).to(device) < 0.6
        up, gate, down_t, bias = int4_weights(hot)
        if ref is not None:
            rf = ref.model.layers[f.layer].ffn
            for w, lin in ((up, rf.up), (gate, getattr(rf, "gate", None))):
                if lin is not None:
                    want = lin.weight[hot.idx.cpu()].to(device)  # [H, D]
                    assert (w - want).abs().max() <= 2.0 ** -7 * want.abs().max()
        with torch.inference_mode():
            got = gpu.compute(x, mask) - (0 if gpu.down_bias is None else gpu.down_bias)
            want = hot_ffn(x.bfloat16().float(), up, down_t, f.cold.act, gate, bias, mask)  # the kernels take bf16 x
        assert (got.float() - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("family, kind", [("llama", "q4_0"), ("opt", "q4_0"), ("llama", "q4_k"), ("qwen2_moe", "q4_0")])
def test_int4_hot_rows_match_their_weights_and_the_expanded_engine(folder, family, kind):
    """int4_hot on the CPU tier (torch's CPU int4 kernels): the hot up/gate rows stay int4 from their own
    blocks, W_down's hot columns stay in the tier dtype (INT4_DOWN_DEFAULT); the hot FFN equals the
    int4 weights' product, the logits the quantised reference's within its tolerance and the expanded
    engine's as closely (the kernels round x to bf16); the split one-token step (what a CUDA graph
    replays) equals the forward; up/gate hold about 0.31x their bf16 bytes."""
    ref = reference(folder, family, kind)
    toks = tokens(seed=13)
    want = decode_logits(ref, toks)
    hot, moe = random_hot(ref, 0.4, seed=3), getattr(ref.config, "num_experts", 0)
    got = {}
    for int4 in (False, True):
        lm = fresh(folder, family, kind)
        with make_hybrid(lm, hot, "oracle", threads=2, int4_hot=int4,
                         gpu_experts=random_experts(lm, 0.5, seed=3) if moe else None) as eng:
            got[int4] = decode_logits(lm, toks)
            if not int4:
                assert not any(f.gpu.hot.int4 or f.gpu.hot.int4_skipped for f in eng.layers.values())
                continue
            assert INT4_DOWN_DEFAULT is False and eng.int4_skipped() == {}
            check_int4_hot(eng, "cpu", int4_down=False, ref=ref)
            with torch.inference_mode():
                prefill = lm.model(toks)
            f = next(iter(eng.layers.values()))
            x = torch.randn(1, 1, lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
            with torch.inference_mode():
                assert torch.allclose(split_step(f, x), f(x), rtol=1e-5, atol=1e-6)
            for f in eng.layers.values():
                h, n_mats, d = f.gpu.hot.n, 2 if f.gpu.hot.gate is not None else 1, f.dim
                ug = f.gpu.hot.up.nbytes * n_mats
                assert ug == n_mats * f.gpu.hot.up.rows * d * (0.5 + 4 / 32)
                assert ug < 0.4 * n_mats * h * d * 2  # bf16's: 0.31 x H' / H (38 neurons padded to 48 here)
    for i in range(T):
        assert rel_err(got[True][:, i], want[:, i]) < TOL[kind], f"decode step {i}"
    # bf16 x in the kernels moves the logits 1-2% of the largest, 10-50x less than the quantisation does
    with torch.inference_mode():
        want_prefill, float_logits = ref.model(toks), reference(folder, family, kind, quantized=False).model(toks)
    assert rel_err(prefill, want_prefill) < TOL[kind]
    assert 10 * rel_err(got[True], got[False]) < rel_err(float_logits, want_prefill)
    assert rel_err(got[True], got[False]) < TOL[kind]


@pytest.mark.parametrize("family, kind", [("qwen3_moe", "q4_0"), ("qwen3_moe", "q4_k"), ("qwen2_moe", "q4_0"),
                                          ("qwen3_moe", "q8_0")])
def test_int4_gpu_experts_keep_their_4_bit_blocks(folder, family, kind):
    """int4_hot: a MoE layer's fast-tier experts keep the file's 4-bit gate, up and down as Q4Stack
    (0.625 bytes a weight), each slot dequantising to its expert's own blocks; decode and prefill
    equal the quantised reference within its tolerance and the expanded engine's as closely (the
    CPU tier runs routed_experts' torch version; the Triton kernels are the CUDA tests'). Q8_0
    experts are expanded as before."""
    from hotcold.sparse_ops.moe_gpu import Q4Stack

    ref = reference(folder, family, kind)
    toks = tokens(seed=1)  # (seeds 13 and 17 route a step of the tiny qwen3_moe q4_0 through a near-tie: 10-17%, both ways)
    want = decode_logits(ref, toks)
    got = {}
    for int4 in (False, True):
        lm = fresh(folder, family, kind)
        gpu = random_experts(lm, 0.5, seed=4)
        with make_hybrid(lm, random_hot(lm, 0.5, seed=4), "oracle", threads=2, int4_hot=int4, gpu_experts=gpu) as eng:
            got[int4] = decode_logits(lm, toks)
            with torch.inference_mode():
                prefill = lm.model(toks)
            assert eng.moe
            for l, m in eng.moe.items():
                f, ex = m.fast, ref.model.layers[l].ffn.experts
                if not int4 or kind == "q8_0":
                    assert f.int4 == () and not isinstance(f.gate, Q4Stack)
                    continue
                assert f.int4 == ("gate", "up", "down")
                for which in f.int4:
                    st = getattr(f, which)
                    assert st.nbytes == len(f.ids) * ex.hidden * ex.dim * (0.5 + 4 / 32)
                    for g, e in enumerate(f.ids):
                        w = torch.from_numpy(qdequantize(ex.matrix(which, e)))
                        assert (st.dequantize(g) - w).abs().max() <= 2e-3 * w.abs().max()
    with torch.inference_mode():
        want_prefill = ref.model(toks)
    for i in range(T):
        assert rel_err(got[True][:, i], want[:, i]) < TOL[kind], f"decode step {i}"
    assert rel_err(prefill, want_prefill) < TOL[kind]
    assert rel_err(got[True], got[False]) < TOL[kind]


@pytest.mark.parametrize("kind", ["q4_0", "q4_k"])
def test_int4_down_requantised(folder, kind):
    """int4_down: W_down's hot columns requantised to int4 (zero-padded to a multiple of 32 neurons):
    the hot FFN equals the requantised weights' product; the whole hot part holds about 0.31x its bf16
    bytes; the logits leave the tolerance of the expanded W_down (the measured reason for
    INT4_DOWN_DEFAULT = False), though by less than the file's own quantisation moves them."""
    ref = reference(folder, "llama", kind)
    toks = tokens(seed=14)
    want = decode_logits(ref, toks)
    lm = fresh(folder, "llama", kind)
    with make_hybrid(lm, random_hot(lm, 2 / 3, seed=4), "oracle", threads=2, int4_hot=True, int4_down=True) as eng:
        check_int4_hot(eng, "cpu", int4_down=True)
        got = decode_logits(lm, toks)
        for f in eng.layers.values():
            hot = f.gpu.hot  # 64 of 96 neurons (no padding); q4_k: 341 of 512, padded to 352
            assert hot.nbytes == 3 * hot.up.nbytes < 0.33 * 3 * hot.n * f.dim * 2
            cols = ref.model.layers[f.layer].ffn.down.weight[:, hot.idx]  # [D, H] dequantised
            err = (hot.down_t.dequantize(torch.float32)[:, :hot.n] - cols).norm() / cols.norm()
            assert 0.01 < err < 0.15  # a second 4-bit rounding, of the size of the file's own
    with torch.inference_mode():
        quantized, floats = ref.model(toks), reference(folder, "llama", kind, quantized=False).model(toks)
    assert TOL[kind] < rel_err(got, want) < 0.5 * rel_err(floats, quantized)  # 0.07 / 0.17 against 0.52 / 0.88


def test_int4_hot_rows_fall_back_where_they_cannot_be_int4(folder):
    """Where the hot rows cannot stay int4 (Q8_0 blocks; no hot neuron) they are expanded as before,
    and HotFFN.int4_skipped / engine.int4_skipped() say why; a CPU tier without int4_hot keeps the
    expanded rows even with gpu_int4 (which keeps CUDA tiers' matrices 4-bit)."""
    lm = fresh(folder, "llama", "q8_0")
    hot = random_hot(lm, 0.4, seed=5)
    hot[1] = hot[1][:0]
    with make_hybrid(lm, hot, None, threads=2, int4_hot=True) as eng:
        skipped = eng.int4_skipped()
        assert list(skipped.values()) == [[0, 2]] and "Q8_0 is not a 4-bit type" in next(iter(skipped))
        assert all(isinstance(f.gpu.hot.up, torch.Tensor) for f in eng.layers.values())
    lm = fresh(folder, "llama", "q4_0")
    with make_hybrid(lm, random_hot(lm, 0.4, seed=5), None, threads=2, gpu_int4=True) as eng:
        assert not any(f.gpu.hot.int4 for f in eng.layers.values()) and eng.int4_skipped() == {}


def whole_hot(lm, layers: list[int], frac: float, seed: int) -> dict[int, torch.Tensor]:
    """random_hot(frac), with every neuron of `layers` hot (in a random order)."""
    hot = random_hot(lm, frac, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for l in layers:
        hot[l] = torch.randperm(lm.config.intermediate_size, generator=gen)
    return hot


def check_whole(eng, lm, ref: LoadedModel, layers: list[int]) -> None:
    """layers' FFNs are kept int4 whole (not split): up/gate/down Int4Linear whose weights are ref's
    own, W_down included (its blocks are whole: no second rounding), up to the bf16 rounding of the
    scales; they are counted as fast-tier FFN bytes (0.625 bytes a weight)."""
    from hotcold.sparse_ops.gpu_quant import Int4Linear

    assert sorted(eng.whole) == layers and not set(eng.layers) & set(layers)
    whole_bytes = 0
    for l in layers:
        ffn, rf = lm.model.layers[l].ffn, ref.model.layers[l].ffn
        assert ffn is eng.whole[l]
        for name in ("up", "gate", "down"):
            want = getattr(rf, name, None)
            if want is None:
                continue
            lin = getattr(ffn, name)
            assert isinstance(lin, Int4Linear), f"layer {l} {name} is {type(lin).__name__}"
            w, want_w = lin.qweight.dequantize(torch.float32).cpu(), want.weight.float()
            assert w.shape == want_w.shape and (w - want_w).abs().max() <= 2.0 ** -7 * want_w.abs().max()
            whole_bytes += lin.qweight.nbytes
            assert lin.qweight.nbytes == want_w.numel() * (0.5 + 4 / 32)
    split = sum(f.gpu.nbytes for f in eng.layers.values())
    assert eng.memory()["fast_ffn_bytes"] == split + whole_bytes


@pytest.mark.parametrize("family, kind", [("llama", "q4_0"), ("opt", "q4_0"), ("llama", "q4_k")])
def test_all_hot_layers_stay_int4_whole(folder, family, kind):
    """int4_hot and every neuron of a layer hot (a plan that places the whole FFN on the GPU): the FFN
    is not split but kept whole, its three matrices int4 from their own blocks (check_whole); the
    other layers are split as before; the logits stay the quantised reference's within its tolerance."""
    ref = reference(folder, family, kind)
    toks = tokens(seed=16)
    want = decode_logits(ref, toks)
    lm = fresh(folder, family, kind)
    with make_hybrid(lm, whole_hot(lm, [0, 2], 0.4, seed=6), "oracle", threads=2, int4_hot=True) as eng:
        check_whole(eng, lm, ref, [0, 2])
        assert sorted(eng.layers) == [1] and eng.layers[1].gpu.hot.int4
        got = decode_logits(lm, toks)
        with torch.inference_mode():
            prefill = lm.model(toks)
    for i in range(T):
        assert rel_err(got[:, i], want[:, i]) < TOL[kind], f"decode step {i}"
    with torch.inference_mode():
        assert rel_err(prefill, ref.model(toks)) < TOL[kind]


def test_all_hot_layers_split_where_they_cannot_be_int4_whole(folder):
    """Q8_0 blocks (not a 4-bit type) or int4_hot off: an all-hot layer is split as any other."""
    for kind, int4 in (("q8_0", True), ("q4_0", False)):
        lm = fresh(folder, "llama", kind)
        with make_hybrid(lm, whole_hot(lm, [1], 0.4, seed=7), None, threads=2, int4_hot=int4) as eng:
            assert eng.whole == {} and sorted(eng.layers) == [0, 1, 2]
            assert eng.layers[1].gpu.hot.n == lm.config.intermediate_size


# ---------------------------------------------------------------------------------------------
# A real GGUF file


@pytest.mark.slow
def test_smollm2_gguf_hybrid_greedy_tokens(monkeypatch):
    """SmolLM2-135M Q4_1 GGUF, 30% of each layer's neurons hot: the same greedy tokens as the dense
    quantised model, with the cold rows in Q4_1 blocks (W_down Q8_0). Float x in the block kernels:
    with Q4_1's default Q8 activations the dense model's and the cold rows' rounding differ from the
    hot rows' float products, and the third token is a near-tie (logits 28.106 / 28.100) that flips."""
    from conftest import smollm2_gguf
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.formats, "XQ_DEFAULT", frozenset())
    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)  # the prompt's products in float32 too

    path = smollm2_gguf()
    prompt = list(range(20, 40))
    greedy = SamplingParams(temperature=0.0)

    def generate(lm):
        return [e.token_id for e in Generator(lm).generate(prompt, max_tokens=8, sampling=greedy, ignore_eos=True)]

    ref = load_model(path, "cpu", "float32")
    want = generate(ref)
    del ref
    lm = load_model(path, "cpu", "float32")
    with make_hybrid(lm, random_hot(lm, 0.3, seed=0), None, threads=2) as eng:
        for c in colds(eng):
            assert c.up.qtype == c.gate.qtype == "Q4_1" and c.down_t.qtype == "Q8_0"
        got = generate(eng.lm)
        mem = eng.memory()
    assert got == want
    D, I = lm.config.hidden_size, lm.config.intermediate_size
    cold_rows = lm.config.num_layers * (I - round(0.3 * I))
    assert mem["host_ffn_bytes"] == cold_rows * (2 * row_bytes("Q4_1", D) + row_bytes("Q8_0", D))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family, kind", [("llama", "q4_0"), ("opt", "q8_0"), ("qwen2_moe", "q8_0")])
def test_cuda_dequantizes_the_fast_tier(folder, family, kind):
    """On a GPU the hot rows, GPU experts and the rest of the model are dequantised there (nothing
    quantised is left outside the cold parts); the cold parts stay blocks on the host; the expert
    cache decodes host experts into its slots."""
    from hotcold.models.quantized import QUANT_MODULES

    ref = reference(folder, family, kind)
    toks = tokens(seed=11)
    want = decode_logits(ref, toks)
    lm = fresh(folder, family, kind)
    c = lm.config
    moe = getattr(c, "num_experts", 0)
    cache = 3 * ExpertCache.slot_bytes(c.moe_intermediate_size, c.hidden_size, "f32") if moe else 0
    with make_hybrid(lm, random_hot(lm, 0.4, seed=1), "oracle", device="cuda", threads=2,
                     gpu_experts=random_experts(lm, 0.25, seed=1) if moe else None, expert_cache_bytes=cache) as eng:
        assert not any(isinstance(m, QUANT_MODULES) for m in lm.model.modules())
        assert all(c.quantized for c in colds(eng))
        got = decode_logits(lm, toks.cuda()).cpu()
    for i in range(T):
        assert rel_err(got[:, i], want[:, i]) < TOL[kind], f"decode step {i}"


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family, kind", [("llama", "q4_0"), ("llama", "q4_k"), ("qwen2_moe", "q4_0")])
def test_cuda_gpu_int4_keeps_4bit_matrices_4bit(folder, family, kind):
    """gpu_int4: the attention (and other non-FFN 4-bit) matrices go to the GPU as Int4Linear, the
    split FFNs' hot up/gate rows as Int4Matrix (padded to a multiple of 8 neurons) and the MoE layers'
    GPU experts as Q4Stack, not expanded; the
    hot FFNs equal their int4 weights' product; logits stay within the quantised tolerance (the int4
    kernel multiplies in bf16), with the one-token steps replayed as CUDA graphs (the hot FFN inside
    them) or eager, and close to the engine whose hot rows alone are expanded (int4_hot=False)."""
    from hotcold.executors.graphs import GraphedBlock
    from hotcold.sparse_ops.gpu_quant import Int4Linear

    ref = reference(folder, family, kind)
    toks = tokens(seed=12)
    want = decode_logits(ref, toks)
    got = {}
    for int4, graphs in ((True, True), (True, False), (False, True)):
        lm = fresh(folder, family, kind)
        moe = getattr(lm.config, "num_experts", 0)
        with make_hybrid(lm, random_hot(lm, 0.4, seed=2), "oracle", device="cuda", threads=2, gpu_int4=True,
                         int4_hot=None if int4 else False, cuda_graphs=graphs,
                         gpu_experts=random_experts(lm, 0.25, seed=2) if moe else None) as eng:
            attn = lm.model.layers[0].attn
            assert all(isinstance(getattr(attn, p), Int4Linear) for p in ("q", "k", "v", "o"))
            if int4:
                check_int4_hot(eng, "cuda", int4_down=False, ref=ref)
            else:
                assert not any(f.gpu.hot.int4 for f in eng.layers.values())
            # the MoE layers' GPU experts: 4-bit stacks read by the Triton kernels (in the graphs too)
            assert all(m.fast.int4 == (("gate", "up", "down") if int4 else ()) for m in eng.moe.values())
            got[int4, graphs] = decode_logits(lm, toks.cuda()).cpu()
            blocks = [b for b in lm.model.layers if isinstance(b, GraphedBlock)]
            assert len(blocks) == (lm.config.num_layers if graphs else 0)
            assert all(b.replays == T and b.captured.pre is not None for b in blocks)  # the FFN in the graph
    for i in range(T):
        assert rel_err(got[True, True][:, i], want[:, i]) < 2 * TOL[kind], f"decode step {i}"
    assert rel_err(got[True, True], got[True, False]) < 1e-3
    assert rel_err(got[True, True], got[False, True]) < TOL[kind]


@pytest.mark.cuda
@CUDA
def test_cuda_prefill_int4_experts_chunk_kernels(folder, monkeypatch):
    """A prompt's 4-bit GPU experts through the chunk kernels (codes dequantised in registers), and a
    group of experts at a time (each group decoded, then batched products: chunk kernels turned off):
    the same prefill logits, both within the quantised tolerance."""
    from hotcold.executors.moe import HybridMoE

    ref = reference(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=1)
    with torch.inference_mode():
        want = ref.model(toks)
    got = {}
    for chunk in (False, True):
        if not chunk:
            monkeypatch.setattr(HybridMoE, "chunk_kernels", lambda self: False)
        else:
            monkeypatch.undo()
        lm = fresh(folder, "qwen3_moe", "q4_0")
        with make_hybrid(lm, {}, None, device="cuda", threads=2, gpu_int4=True,
                         gpu_experts=random_experts(lm, 0.5, seed=4)) as eng:
            assert all(m.fast.int4 == ("gate", "up", "down") and m.chunk_kernels() == chunk for m in eng.moe.values())
            with torch.inference_mode():
                got[chunk] = lm.model(toks.cuda()).float().cpu()
    assert rel_err(got[True], got[False]) < 1e-2
    assert rel_err(got[True], want) < 2 * TOL["q4_0"]


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family, int4", [("qwen3_moe", True), ("qwen2_moe", False)])
def test_cuda_host_node_steps_match_split_graphs(folder, family, int4):
    """host_nodes: a MoE layer's graphed decode step is one graph whose CPU experts run as a host
    node (CUDA's callback thread, numba cfunc); its logits equal the split graphs' (same kernels, same
    order of sums) and the quantised reference; every node ran once a step; a layer with no host
    experts keeps the split graphs."""
    from hotcold.executors.graphs import GraphedBlock

    ref = reference(folder, family, "q4_0")
    toks = tokens(seed=16)
    want = decode_logits(ref, toks)
    got, ran = {}, {}
    for host in (False, True):
        lm = fresh(folder, family, "q4_0")
        gpu_experts = random_experts(lm, 0.25, seed=5)
        last = max(gpu_experts)
        gpu_experts[last] = list(range(lm.config.num_experts))  # every expert of the last MoE layer on the GPU
        with make_hybrid(lm, {}, None, device="cuda", threads=2, gpu_int4=int4, stats=False, host_nodes=host,
                         gpu_experts=gpu_experts, cpu_inline=not host) as eng:
            got[host] = decode_logits(lm, toks.cuda()).cpu()
            blocks = {l: b for l, b in enumerate(lm.model.layers) if isinstance(b, GraphedBlock)}
            assert all(b.replays == T for b in blocks.values())
            # host nodes in every MoE layer but the last, whose step is split: no whole-step graph
            assert lm.model.one_token_step.replays == 0
            ran[host] = {l: (b.captured.out is not None, m._node.calls if m._node is not None else 0)
                         for l, m in eng.moe.items() for b in [blocks[l]]}
            assert eng.cpu.inline == (not host)  # host nodes with a worker (prompts' CPU experts)
    assert ran[False] == {l: (False, 0) for l in ran[False]}
    assert ran[True] == {l: (l != last, T if l != last else 0) for l in ran[True]}, ran[True]
    assert rel_err(got[True], got[False]) < 1e-5
    # cuda_graphs="step", host experts in every MoE layer: from the second step the whole step is one
    # graph (StepGraph); qwen2_moe's dense layer 1 (no hot rows) is in it too, its cold rows a host node
    lm = fresh(folder, family, "q4_0")
    with make_hybrid(lm, {}, None, device="cuda", threads=2, gpu_int4=int4, stats=False, cuda_graphs="step",
                     gpu_experts=random_experts(lm, 0.25, seed=5)) as eng:
        whole = decode_logits(lm, toks.cuda()).cpu()
        assert lm.model.one_token_step.replays == T - 1
        assert all(m._node.calls == T for m in eng.moe.values())
        assert all(f._node.calls == T for f in eng.layers.values()) and len(eng.layers) == (family == "qwen2_moe")
    ties = near_ties(ref, toks)
    assert len(ties) <= 2, ties
    errs = [round(rel_err(got[True][:, i], want[:, i]), 4) for i in range(T)]
    assert all(e < 2 * TOL["q4_0"] for i, e in enumerate(errs) if i not in ties), (errs, ties)
    errs = [round(rel_err(whole[:, i], want[:, i]), 4) for i in range(T)]
    assert all(e < 2 * TOL["q4_0"] for i, e in enumerate(errs) if i not in ties), (errs, ties)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("pred", ["oracle", None])
def test_cuda_dense_host_node_of_quantised_rows(folder, pred):
    """dense_host_nodes on a Q4_0 model: each layer's cold rows (GGUF blocks, W_down^T Q8_0) run as a
    host node in one graph per layer; logits equal the split graphs' and every node ran once a step."""
    toks = tokens(seed=19)
    got, calls = {}, {}
    for host in (False, True):
        lm = fresh(folder, "llama", "q4_0")
        with make_hybrid(lm, random_hot(lm, 0.5, seed=7), pred, device="cuda", threads=2, stats=False,
                         dense_host_nodes=host) as eng:
            got[host] = decode_logits(lm, toks.cuda()).cpu()
            calls[host] = [f._node.calls if f._node is not None else 0 for f in eng.layers.values()]
            assert all(f._node is None or f._node.kind == "quant" for f in eng.layers.values())
    assert calls[False] == [0] * len(calls[False]) and calls[True] == [T] * len(calls[True])
    assert rel_err(got[True], got[False]) < 1e-5


@pytest.mark.cuda
@CUDA
def test_cuda_int4_down_requantised(folder):
    """int4_down on the GPU: W_down's hot columns as an Int4Matrix [D, H'] (H' a multiple of 32), in
    the CUDA graph too; the hot FFNs equal their int4 weights' product."""
    ref = reference(folder, "llama", "q4_0")
    toks = tokens(seed=15)
    want = decode_logits(ref, toks)
    lm = fresh(folder, "llama", "q4_0")
    with make_hybrid(lm, random_hot(lm, 2 / 3, seed=4), "oracle", device="cuda", threads=2, gpu_int4=True,
                     int4_down=True) as eng:
        check_int4_hot(eng, "cuda", int4_down=True)
        got = decode_logits(lm, toks.cuda()).cpu()
    with torch.inference_mode():
        quantized, floats = ref.model(toks), reference(folder, "llama", "q4_0", quantized=False).model(toks)
    assert rel_err(got, want) < 0.5 * rel_err(floats, quantized)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("kind", ["q4_0", "q4_k"])
def test_cuda_all_hot_layers_int4_whole_in_the_graphs(folder, kind):
    """On a GPU: an all-hot layer's FFN kept int4 whole is captured with its attention in one CUDA graph
    (no eager FFN after the replay); logits as the eager engine's and the quantised reference's."""
    from hotcold.executors.graphs import GraphedBlock

    ref = reference(folder, "llama", kind)
    toks = tokens(seed=17)
    want = decode_logits(ref, toks)
    got = {}
    for graphs in (True, False):
        lm = fresh(folder, "llama", kind)
        with make_hybrid(lm, whole_hot(lm, [0, 2], 0.4, seed=8), "oracle", device="cuda", threads=2, gpu_int4=True,
                         cuda_graphs=graphs) as eng:
            check_whole(eng, lm, ref, [0, 2])
            got[graphs] = decode_logits(lm, toks.cuda()).cpu()
            if graphs:
                blocks = lm.model.layers
                assert all(isinstance(b, GraphedBlock) and b.replays == T for b in blocks)
                assert [b.captured.h is not None for b in blocks] == [True, False, True]
                assert blocks[1].captured.pre is not None
    for i in range(T):
        assert rel_err(got[True][:, i], want[:, i]) < 2 * TOL[kind], f"decode step {i}"
    assert rel_err(got[True], got[False]) < 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_streamed_quantised_experts_match_reference(folder, family, kind, device):
    """prefill="stream" on quantised experts: each MoE layer's host experts cross to the fast tier as
    their blocks, one expert a group (the smallest workspace), are decoded there and computed for
    their tokens; the prompt's logits stay within the quantised tolerance, every routed host pair
    runs streamed and none on the CPU worker."""
    ref = reference(folder, family, kind)
    toks = tokens(seed=13)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, family, kind)
    with make_hybrid(lm, random_hot(lm, 0.3, seed=1), None, device=device, threads=2, prefill="stream",
                     gpu_experts=random_experts(lm, 0.25, seed=3), expert_stream_bytes=1) as eng:
        s = eng.experts_streamer
        assert s is not None and s.group == 1 and set(eng.moe) == set(s._groups)
        assert eng.memory()["stream_workspace_bytes"] >= s.workspace_bytes > 0
        with torch.inference_mode():
            got = lm.model(toks.to(device)).cpu()
        st = eng.stats()["prefill"]
        raw = [t for slot in s.slots for t in slot.values()]  # the raw slots hold a group's bytes, no more
        assert sum(t.numel() for t in raw) == 2 * s.group * s.raw_bytes
    assert rel_err(got, want) < TOL[kind]
    assert st["regimes"]["stream"] == len(eng.moe) and st["experts_cpu"] == 0
    assert st["experts_gpu"] == toks.shape[1] * lm.config.top_k * len(eng.moe)
    assert st["rows_streamed"] > 0


def test_grouped_int4_fast_experts_in_prefill(folder, monkeypatch):
    """A prompt chunk's 4-bit fast-tier experts decoded a group at a time for batched products (on
    the CPU tier the Q4Stack is decoded by torch too): the prompt's logits within the quantised
    tolerance, each group decoded once, every routed pair counted."""
    from hotcold.sparse_ops.moe_gpu import Q4Stack

    ref = reference(folder, "qwen3_moe", "q4_0")
    toks = tokens(seed=14)
    with torch.inference_mode():
        want = ref.model(toks)
    lm = fresh(folder, "qwen3_moe", "q4_0")
    decoded = []
    real = Q4Stack.dequantize
    monkeypatch.setattr(Q4Stack, "dequantize", lambda self, s, dtype=torch.float32: decoded.append(s) or real(self, s, dtype))
    with make_hybrid(lm, {}, None, threads=2, gpu_int4=True, int4_hot=True,
                     gpu_experts=random_experts(lm, 0.75, seed=5)) as eng:
        assert all(m.fast.int4 == ("gate", "up", "down") for m in eng.moe.values())
        with torch.inference_mode():
            got = lm.model(toks)
        st = eng.stats()["prefill"]
    assert rel_err(got, want) < TOL["q4_0"]
    assert decoded and all(isinstance(s, slice) for s in decoded)  # whole groups, no expert on its own
    assert st["experts_gpu"] + st["experts_cpu"] == toks.shape[1] * lm.config.top_k * len(eng.moe)


@pytest.mark.cuda
@CUDA
def test_cuda_pinning_leaves_read_only_mappings_pageable(tmp_path, monkeypatch):
    """A model file's read-only mapping (--map-experts, the split cache) is not page-locked: a refused
    cudaHostRegister leaves an error that the next kernel launch raised as its own; writable cold
    matrices are pinned and unpinned as before."""
    from types import SimpleNamespace

    from hotcold.executors import prefill

    monkeypatch.setattr(prefill, "PIN_MIN_BYTES", 0)
    path = tmp_path / "blocks.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, np.uint8, mode="r")  # PROT_READ pages, as a GGUF's mapping
    writable = np.zeros(1 << 16, np.uint8)
    ptrs = prefill.pin_host(SimpleNamespace(mats=[SimpleNamespace(data=mapped), SimpleNamespace(data=writable)],
                                            pinned=False))
    assert ptrs == [writable.ctypes.data]
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum()) == 56.0  # a kernel launch after the registrations raises nothing
    prefill.unpin_host(ptrs)
    assert ptrs == []
