"""Quantised weights kept in their GGUF blocks (models/quantized.py, issue 10), against independent
references: gguf's own numpy dequantiser, the float model, llama.cpp on the real GGUF files."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import gemma3_gguf, llama_reference, smollm2_gguf
from hotcold.errors import HotcoldError
from hotcold.models.loader import load_model
from hotcold.models.gguf_loader import drop_file_pages
from hotcold.models.quantized import (GEMV_TOKENS, QuantEmbedding, QuantExperts, QuantLinear, dequantize_model,
                                      is_quantized, pack_for_decode)
from hotcold.sparse_ops.quant import QuantMatrix, qdequantize, random_matrix
from tiny_models import make_tiny


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_qdequantize_matches_gguf(qtype):
    m = random_matrix(qtype, (37, 512), seed=3)
    rows = np.array([36, 0, 5, 5])
    assert np.array_equal(qdequantize(m), m.dequantize())  # m.dequantize: gguf.quants' numpy decoder
    assert np.array_equal(qdequantize(m, rows), m.dequantize(rows))
    assert qdequantize(m, np.array([], np.int64)).shape == (0, 512)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_qdequantize_to_bfloat16_bits(qtype):
    """bf16=True: the float32 rows rounded to bfloat16 (nearest even, as torch rounds), as uint16."""
    m = random_matrix(qtype, (37, 512), seed=4)
    rows = np.array([36, 0, 5, 5, 17, 2, 9, 30, 11])  # more than one parallel block of rows
    want = torch.from_numpy(m.dequantize(rows) + 0.0).bfloat16().view(torch.int16).numpy().view(np.uint16)  # -0 -> +0
    got = qdequantize(m, rows, bf16=True)
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    out = np.full((len(rows), 512), 7, np.uint16)
    assert qdequantize(m, rows, out, bf16=True) is out and np.array_equal(out, want)
    with pytest.raises(ValueError, match="uint16"):
        qdequantize(m, rows, np.empty((len(rows), 512), np.float32), bf16=True)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])  # float-x types (Q4_0 / Q4_K round x to Q8: test_quant_ops)
@pytest.mark.parametrize("tokens,bf16", [(1, False), (GEMV_TOKENS + 3, False), (GEMV_TOKENS + 3, True)])
def test_quant_linear_matches_dequantised(qtype, tokens, bf16, monkeypatch):
    """One token through the block kernels, several through a GEMM over decoded rows: float32, or
    bfloat16 (GEMM_BF16, where the CPU has it) within bfloat16's rounding."""
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.ops, "GEMM_BF16", bf16)
    m = random_matrix(qtype, (96, 256), seed=1)
    bias = torch.randn(96)
    layer = QuantLinear(m, bias)
    x = torch.randn(2, tokens, 256)
    ref = F.linear(x, torch.from_numpy(m.dequantize()), bias)
    got = layer(x)
    assert got.shape == (2, tokens, 96) and got.dtype == torch.float32
    tol = 2e-2 if bf16 else 1e-4
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_qffn_rows_batch_matches_one_token_kernels(bf16, gated, monkeypatch):
    """Several tokens sharing a selection (prefill's cold rows): the GEMM over decoded rows equals
    the one-token fused kernel (float x) per token; in bfloat16 within its rounding."""
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.ops, "GEMM_BF16", bf16)
    I, D, T = 300, 256, 9
    up, gate = random_matrix("Q4_K", (I, D), seed=5), random_matrix("Q4_K", (I, D), seed=6) if gated else None
    down_t = random_matrix("Q8_0", (I, D), seed=7)
    rows = np.sort(np.random.default_rng(0).choice(I, 170, replace=False))
    X = np.random.default_rng(1).standard_normal((T, D)).astype(np.float32)
    act = "silu" if gated else "relu"
    bias = None if gated else np.random.default_rng(2).standard_normal(I).astype(np.float32) * 0.1
    want = np.stack([quant.qffn_rows(X[t], rows, up, down_t, act, gate=gate, up_bias=bias, xq=False) for t in range(T)])
    monkeypatch.setattr(quant.ops, "BATCH_CHUNK_BYTES", 64 * 4 * D)  # several chunks of rows
    got = quant.qffn_rows_batch(X, rows, up, down_t, act, gate=gate, up_bias=bias)
    tol = 2e-2 if bf16 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_quant_embedding_rows_and_tied_head():
    m = random_matrix("Q6_K", (50, 256), seed=2)
    emb = QuantEmbedding(m, torch.float32)
    dense = torch.from_numpy(m.dequantize())
    ids = torch.tensor([[3, 49, 0]])
    assert torch.equal(emb(ids), dense[ids])
    x = torch.randn(1, 2, 256)
    torch.testing.assert_close(emb.logits(x), x @ dense.T, rtol=1e-4, atol=1e-3)
    with pytest.raises(IndexError):
        emb(torch.tensor([[50]]))


@pytest.mark.parametrize("family", ["llama", "opt", "gemma3", "qwen2_moe", "mixtral"])
def test_quantize_model_matches_its_dequantised_copy(tmp_path, family, monkeypatch):
    """q8_0 at load: every matrix becomes blocks; logits equal the same model with those blocks
    dequantised by gguf (independent decoder) and stay close to the float model's (several tokens
    in float32: bfloat16 GEMMs are checked in test_quant_linear_matches_dequantised)."""
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    path = make_tiny(family, tmp_path)
    ref = load_model(path, "cpu", "float32").model
    lm = load_model(path, "cpu", "float32", quantize="q8_0")
    q = lm.model
    kinds = {type(m) for m in q.modules()}
    assert QuantLinear in kinds and not any(isinstance(m, torch.nn.Linear) and m.weight.shape[1] % 32 == 0
                                            and not n.endswith(("router", "shared_gate")) for n, m in q.named_modules())
    if family in ("qwen2_moe", "mixtral"):
        assert QuantExperts in kinds
    deq = load_model(path, "cpu", "float32", quantize="q8_0").model
    for name, m in list(deq.named_modules()):  # reference weights through gguf's numpy decoder
        if isinstance(m, QuantLinear):
            m.qweight = QuantMatrix.quantize(m.qweight.dequantize(), "Q8_0")  # exact: Q8_0 requantises to itself
    dequantize_model(deq, "cpu", torch.float32)
    assert not is_quantized(deq)
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 2, 64]])
    with torch.inference_mode():
        got, want, flt = q(ids), deq(ids), ref(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert ((got - flt).norm() / flt.norm()).item() < 0.05  # Q8_0 is close to float
        one = q(ids[:, :1])  # one token: the block-decoding GEMV path
        torch.testing.assert_close(one, want[:, :1], rtol=1e-3, atol=1e-3)


def test_quantize_refusals(tmp_path):
    path = make_tiny("llama", tmp_path)
    with pytest.raises(HotcoldError, match="--quantize"):
        load_model(path, "cpu", "float32", quantize="q3_k")
    with pytest.raises(HotcoldError, match="GGUF"):
        load_model(smollm2_gguf(), "cpu", "float32", quantize="q8_0")


def test_gguf_quantised_matches_dequantised_load(monkeypatch):
    """SmolLM2 Q4_1: kept in blocks (the default on the CPU) = expanded at load (the old path), with
    float x in the one-token kernels (Q8 activations, Q4_1's default, are checked against gguf's
    decoder in test_quant_ops; here they would move a decode step's logits by ~1%)."""
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.formats, "XQ_DEFAULT", frozenset())
    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    q = load_model(smollm2_gguf(), "cpu", "float32")
    d = load_model(smollm2_gguf(), "cpu", "float32", quantized=False)
    assert isinstance(q.model.layers[0].ffn.up, QuantLinear) and isinstance(q.model.embed, QuantEmbedding)
    assert not is_quantized(d.model)
    assert q.fingerprint == d.fingerprint
    ids = torch.tensor([q.tokenizer.encode("The Python language reference describes the syntax")])
    with torch.inference_mode():
        torch.testing.assert_close(q.model(ids), d.model(ids), rtol=1e-4, atol=1e-3)
        a, b = q.model(ids[:, :1]), d.model(ids[:, :1])
        assert ((a - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_pack_for_decode_interleaves_and_keeps_the_logits(tmp_path, family, monkeypatch):
    """A Q4_0 model's matrices interleaved for one-token GEMVs (and a tied head, gemma3's) give the
    same logits one token at a time (the same integer products) and for a prompt (prefill decodes
    the interleaved rows), and the same embedding lookups."""
    from hotcold.sparse_ops import quant

    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    path = make_tiny(family, tmp_path)
    lm = load_model(path, "cpu", "float32", quantize="q4_0")
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 2, 64]])
    with torch.inference_mode():
        one, many = lm.model(ids[:, :1]), lm.model(ids)
    packed = pack_for_decode(lm.model)
    lins = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert packed > 0 and lins and all(m.qweight.interleaved for m in lins if m.qweight.rows % 8 == 0)
    assert isinstance(lm.model.embed, QuantEmbedding)
    assert lm.model.embed.qweight.interleaved == bool(lm.config.tie_word_embeddings)
    with torch.inference_mode():
        torch.testing.assert_close(lm.model(ids[:, :1]), one, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lm.model(ids), many, rtol=1e-5, atol=1e-5)
    assert pack_for_decode(lm.model) == 0  # already done


def test_pack_for_decode_on_the_real_gemma3_file():
    """Gemma 3 270M Q4_K_M: its Q4_K matrices (attention output, half the FFN down projections)
    and its Q8_0 tied head interleaved, the rest left in their blocks; a prompt's logits unchanged,
    one token's within the head's Q8 activations (HEAD_XQ: same top-1, 0.33% of the logits' norm)."""
    lm = load_model(gemma3_gguf(), "cpu", "float32")
    ids = torch.tensor([lm.tokenizer.encode("The Python language reference describes the syntax")])
    with torch.inference_mode():
        want, many = lm.model(ids[:, -1:]), lm.model(ids)  # one token: the GEMV path
    pack_for_decode(lm.model)
    kinds = {(m.qweight.qtype, m.qweight.interleaved) for m in lm.model.modules() if isinstance(m, QuantLinear)}
    assert ("Q4_K", True) in kinds and ("Q4_K", False) not in kinds and ("Q5_0", False) in kinds
    assert lm.model.embed.qweight.qtype == "Q8_0" and lm.model.embed.qweight.interleaved  # the tied head
    with torch.inference_mode():
        got = lm.model(ids[:, -1:])
        torch.testing.assert_close(lm.model(ids), many, rtol=1e-4, atol=1e-4)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1)), rel


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_embedding_lookups_and_tied_head(dtype):
    """HalfEmbedding keeps its table as stored (a model's .to(dtype) leaves it), looks rows up in the
    compute dtype, and as a tied head gives x @ W.T: one token by numba's half GEMV, several by torch."""
    from hotcold.models.quantized import HalfEmbedding

    torch.manual_seed(0)
    w = torch.randn(300, 64).to(dtype)
    emb = HalfEmbedding(w, torch.float32)
    ids = torch.tensor([[0, 7, 299]])
    assert torch.equal(emb(ids), w[ids].float())
    holder = torch.nn.Sequential(emb).to(torch.float32)
    assert holder[0].weight.dtype == dtype and not list(holder.parameters())
    x = torch.randn(1, 5, 64)
    want = x @ w.float().T  # [1, 5, 300]
    torch.testing.assert_close(emb.logits(x), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(emb.logits(x[:, :1]), want[:, :1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="float16"):
        HalfEmbedding(w.float())


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_drop_file_pages_releases_a_mapped_tensor(tmp_path):
    """After a copy, the source's pages leave the resident set (one copy of the weights in RAM); the
    view still reads the file's bytes. Arrays that are not file mappings are left alone."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    f = tmp_path / "blob.bin"
    np.arange(24 << 20, dtype=np.int32).tofile(f)  # 96 MiB
    mm = np.memmap(f, dtype=np.uint8, mode="r")
    view = mm[1000:(88 << 20) + 1000].reshape(-1, 4096)  # not page-aligned, inside the file
    total = int(view.sum(dtype=np.int64))
    before = rss()
    drop_file_pages(view)
    assert before - rss() > (80 << 20)
    assert int(view.sum(dtype=np.int64)) == total  # read back from the file
    a = np.ones(1 << 20, np.uint8)
    drop_file_pages(a)
    assert a.sum() == 1 << 20


_RSS_SCRIPT = r"""
import ctypes, os, sys, torch
from hotcold.models.loader import load_model
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages glibc keeps cached: not the model's
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def load_and_run():
    lm = load_model(sys.argv[1], "cpu", "float32", quantized=sys.argv[2] == "1")
    with torch.inference_mode():
        lm.model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
        lm.model(torch.tensor([[9]]), 8)
    return lm
first = load_and_run()  # one-time costs (numba kernels, torch's meta machinery) before the baseline
before = rss()
second = load_and_run()  # a second, independent mapping and model
print(rss() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_ram_of_a_quantised_gguf_is_about_its_file_size():
    """Issue 10: RAM within 10% of the file (+ buffers); expanding to float32 takes ~5x. Measured as
    what a second load of the model (its own mapping of the file) adds to a process that loaded it
    once: weights, metadata, tokenizer, forward buffers. Freed memory that glibc's heap keeps cached
    is handed back first (malloc_trim): glibc may otherwise keep tens of MiB of the forward passes'
    buffers cached, which would count as growth."""
    path = smollm2_gguf()
    size = os.path.getsize(path)
    grown = {}
    for q in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path), q], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr[-2000:]
        grown[q] = int(out.stdout.split()[-1])
    assert grown["1"] <= 1.10 * size + (64 << 20), f"kept in blocks: +{grown['1'] >> 20} MiB for a {size >> 20} MiB file"
    assert grown["0"] > 3 * size  # the check can tell expanded weights apart


def _llama_cpp_ppl(path, windows: list[list[int]]) -> float:
    pytest.importorskip("llama_cpp")
    ctx = len(windows[0])
    llm = llama_reference(path, n_ctx=ctx, logits_all=True, n_threads=2, n_batch=ctx, verbose=False)
    nll, n = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = torch.from_numpy(llm.scores[:ctx].copy()).double()
        first = ctx // 2
        logp = torch.log_softmax(logits[first:ctx - 1], -1)
        nll -= float(logp.gather(1, torch.tensor(w[first + 1:])[:, None]).sum())
        n += ctx - 1 - first
    return math.exp(nll / n)


def _transformers_ppl(path, windows: list[list[int]]) -> float:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = ref(torch.tensor([w])).logits[0].double()
            first = len(w) // 2
            logp = torch.log_softmax(logits[first:len(w) - 1], -1)
            nll -= float(logp.gather(1, torch.tensor(w[first + 1:])[:, None]).sum())
            n += len(w) - 1 - first
    return math.exp(nll / n)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_perplexity_against_transformers_and_llama_cpp(model, monkeypatch):
    """Issue 10: `hotcold perplexity` on the quantised files, same windows: with float32 GEMMs it is
    the quantised model's exact perplexity (transformers' float dequantisation of the GGUF, within
    0.1%); with the machine's default GEMMs (bfloat16 where the CPU has them) within 1.5% of llama.cpp,
    which rounds activations to Q8 (its own deviation from the exact value: SmolLM2 Q4_1 -0.85%,
    Gemma 3 Q4_K_M +1.08% on a 2-core AMX Xeon without its repacked buffers; -0.55% / -0.74% for ours
    against it on a Zen 4)."""
    from hotcold.models.perplexity import calibration_text, perplexity
    from hotcold.sparse_ops import quant

    path = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[model]()
    lm = load_model(path, "cpu", "float32")
    assert is_quantized(lm.model)
    ctx, n_windows = 256, 3
    ids = lm.tokenizer.encode(calibration_text()[30_000:60_000])
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    ours = perplexity(lm.model, ids, ctx, bos, n_windows).ppl
    windows = [ids[w * ctx:(w + 1) * ctx] for w in range(n_windows)]
    if bos is not None:
        windows = [[bos] + w[1:] for w in windows]
    ref = _llama_cpp_ppl(path, windows)
    print(f"perplexity {model}: hotcold {ours:.4f} vs llama.cpp {ref:.4f} ({ours / ref - 1:+.2%})")
    assert abs(ours / ref - 1) < 0.015, f"hotcold {ours:.4f} vs llama.cpp {ref:.4f}"
    monkeypatch.setattr(quant.ops, "GEMM_BF16", False)
    exact = perplexity(lm.model, ids, ctx, bos, n_windows).ppl
    want = _transformers_ppl(path, windows)
    assert abs(exact / want - 1) < 0.001, f"hotcold float32 {exact:.5f} vs transformers {want:.5f}"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_qkv_is_one_copy_and_gives_the_same_decode_steps(tmp_path, family):
    """pack_for_decode gives each attention one matrix of its interleaved q, k and v rows (attn.qkv)
    that q, k and v then view (one copy in RAM); one-token steps over a KV cache (the path that
    multiplies it in one GEMV) give the same logits, bit for bit, as three separate GEMVs."""
    from hotcold.models.generate import Generator

    lm = load_model(make_tiny(family, tmp_path), "cpu", "float32", quantize="q4_0")
    pack_for_decode(lm.model)
    attns = [b.attn for b in lm.model.layers]
    for a in attns:
        lins = (a.q, a.k, a.v)
        assert a.qkv.rows == sum(lin.qweight.rows for lin in lins) and a.qkv.interleaved
        assert all(np.shares_memory(lin.qweight.data, a.qkv.data) for lin in lins)
    ids = [1, 5, 9, 33, 7, 100, 2, 64]

    def steps() -> torch.Tensor:
        gen = Generator(lm)
        gen._ensure_cache(len(ids))
        return torch.stack([gen.forward([t], i) for i, t in enumerate(ids)])  # [T, 1, V]

    fused = steps()
    for a in attns:
        a.qkv = None  # the three QuantLinears, over the same rows
    assert torch.equal(fused, steps())
