"""The dense reference forward of every family against transformers on tiny random models."""

from __future__ import annotations

import pytest
import torch

from hotcold.models.generate import Generator
from hotcold.models.loader import load_model
from hotcold.models.sampling import SamplingParams
from hotcold.models.transformer import KVCache
from memory import HAVE_SMAPS, hugepage_advised, mapped_rss
from tiny_models import FAMILIES, make_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def _pair(family, tiny_dir, dtype=torch.float32):
    path = make_tiny(family, tiny_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    return ref, load_model(path, "cpu", name)


def _prompt(n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 160, (1, n), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family, tiny_dir):
    ref, lm = _pair(family, tiny_dir)
    ids = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits
    got = lm.model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_full_forward(family, tiny_dir):
    """Prefill 10 tokens, then feed the rest one at a time through the KV cache."""
    ref, lm = _pair(family, tiny_dir)
    ids = _prompt(20, seed=2)
    with torch.no_grad():
        expected = ref(ids).logits[0]
    cache = KVCache(lm.config, 32)
    with torch.inference_mode():
        steps = [lm.model(ids[:, :10], 0, cache)[0]]
        for t in range(10, 20):
            steps.append(lm.model(ids[:, t : t + 1], t, cache)[0])
    got = torch.cat(steps)
    assert (got - expected).abs().max().item() < 1e-4


def _reference_greedy(ref, ids, n):
    seq = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = ref(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical(family, tiny_dir):
    ref, lm = _pair(family, tiny_dir)
    ids = _prompt(12, seed=3)
    expected = _reference_greedy(ref, ids, 16)
    gen = Generator(lm)
    events = list(gen.generate(ids[0].tolist(), 16, SamplingParams(temperature=0), ignore_eos=True))
    assert [e.token_id for e in events] == expected
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_transformers(family, dtype, tiny_dir):
    ref, lm = _pair(family, tiny_dir, dtype)
    ids = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits.float()
    got = lm.model(ids)
    assert lm.model.embed.weight.dtype == dtype
    rel = (got - expected).norm() / expected.norm()
    assert rel < 2e-2
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_through_float16_cpu_cache(family, dtype, tiny_dir):
    """A half-precision model's CPU KV cache is float16 (kv_dtype): one-token steps (the numba
    attention over it) give the transformers logits as closely as the prompt's forward does."""
    ref, lm = _pair(family, tiny_dir, dtype)
    ids = _prompt()
    with torch.no_grad():
        expected = ref(ids).logits.float()
    cache = KVCache(lm.config, ids.shape[1], dtype=lm.dtype)
    assert cache.layers[0][0].dtype == torch.float16 and KVCache(lm.config, 4).layers[0][0].dtype == torch.float32
    with torch.inference_mode():
        got = torch.cat([lm.model(ids[:, i:i + 1], i, cache) for i in range(ids.shape[1])], dim=1).float()
    rel = (got - expected).norm() / expected.norm()
    assert rel < 2e-2
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_repeated_prompt_starts_from_its_stored_logits(tiny_dir):
    """The same prompt again (e.g. a chat request and its streamed twin) reuses the whole cached
    prompt and its next-token logits: no prompt token is recomputed, the tokens are the same."""
    lm = load_model(make_tiny("llama", tiny_dir), "cpu")
    ids = _prompt(16, seed=5)[0].tolist()
    gen = Generator(lm)
    first = [e.token_id for e in gen.generate(ids, 6, SamplingParams(temperature=0), ignore_eos=True)]
    calls = []
    forward = gen.forward
    gen.forward = lambda toks, start, *a, **k: calls.append(len(toks)) or forward(toks, start, *a, **k)
    again = [e.token_id for e in gen.generate(ids, 6, SamplingParams(temperature=0), ignore_eos=True)]
    assert again == first and gen.stats.cached_prompt_tokens == len(ids)
    assert calls == [1] * 5  # the generated tokens' steps only
    other = [e.token_id for e in gen.generate(ids[:-1] + [ids[-1] + 1], 6, SamplingParams(temperature=0),
                                              ignore_eos=True)]
    assert gen.stats.cached_prompt_tokens == len(ids) - 1 and calls[5] == 1 and len(other) == 6


def test_prefix_reuse_gives_same_tokens(tiny_dir):
    """A second call sharing the prompt prefix reuses the cache and still generates the same tokens."""
    lm = load_model(make_tiny("llama", tiny_dir), "cpu")
    ids = _prompt(16, seed=4)[0].tolist()
    fresh = [e.token_id for e in Generator(lm).generate(ids, 8, SamplingParams(temperature=0), ignore_eos=True)]
    gen = Generator(lm)
    list(gen.generate(ids[:10], 4, SamplingParams(temperature=0), ignore_eos=True))
    again = [e.token_id for e in gen.generate(ids, 8, SamplingParams(temperature=0), ignore_eos=True)]
    assert gen.stats.cached_prompt_tokens == 10
    assert again == fresh


def _events(gen, ids, n, sampling, **kw):
    return [(e.token_id, e.text, e.finish_reason) for e in gen.generate(ids, n, sampling, **kw)]


def test_pipelined_decode_gives_the_plain_loops_events(tiny_dir, tmp_path):
    """The pipelined loop (the next step queued before the host reads the token; on by default on
    CUDA, forced here on the CPU) yields the plain loop's events: greedy and seeded sampling with a
    repetition penalty, ending by length, by EOS and by a stop string; it queues no step after the
    budget's last token, one (wasted) after an EOS, and the cache it leaves serves the next prompt."""
    import shutil

    from tiny_models import add_tiny_tokenizer

    shutil.copytree(make_tiny("llama", tiny_dir), tmp_path / "m")
    lm = load_model(add_tiny_tokenizer(tmp_path / "m"), "cpu")
    ids = _prompt(12, seed=6)[0].tolist()
    plain, piped = Generator(lm), Generator(lm)
    plain.pipeline, piped.pipeline = False, True
    calls = []
    forward = piped.forward
    piped.forward = lambda toks, start, *a, **k: calls.append((len(toks), start)) or forward(toks, start, *a, **k)
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3)
    runs = {}
    for sampling in (greedy, sampled):
        want = runs[sampling] = _events(plain, ids, 10, sampling, seed=3, ignore_eos=True)
        assert _events(piped, ids, 10, sampling, seed=3, ignore_eos=True) == want
        assert want[-1][2] == "length" and piped.stats.token_ids == plain.stats.token_ids
        assert piped.cached_ids == plain.cached_ids == ids + [t for t, _, _ in want[:-1]]
    # 10 tokens: the prompt's forward (the second run reuses its logits) and 9 one-token steps each
    steps = [(1, len(ids) + i) for i in range(9)]
    assert calls == [(len(ids), 0)] + steps + steps

    tokens = [t for t, _, _ in runs[greedy]]
    eos = tokens[4]
    lm.tokenizer.eos_ids = {eos}
    try:
        want = _events(plain, ids, 10, greedy)
        n = len(calls)
        assert _events(piped, ids, 10, greedy) == want and want[-1][2] == "stop"
        assert len(want) == tokens.index(eos) + 1
        assert len(calls) - n == len(want)  # the prompt is cached: one step per token, the last wasted
    finally:
        lm.tokenizer.eos_ids = set()
    text = "".join(t for _, t, _ in _events(plain, ids, 10, sampled, seed=3, ignore_eos=True))
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    want = _events(plain, ids, 10, sampled, seed=3, stop=[stop], ignore_eos=True)
    assert _events(piped, ids, 10, sampled, seed=3, stop=[stop], ignore_eos=True) == want
    assert want[-1][2] == "stop" and stop not in "".join(t for _, t, _ in want)
    # the wasted step's cache entry beyond cached_ids does not leak into a longer prompt
    longer = ids + piped.stats.token_ids[:2]
    assert _events(piped, longer, 6, greedy, ignore_eos=True) == _events(Generator(lm), longer, 6, greedy,
                                                                          ignore_eos=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_cuda_pipelined_decode_matches_plain(family, tiny_dir):
    """On CUDA the default loop samples on the GPU and queues the next step first: greedy tokens equal
    the plain loop's; seeded sampling repeats itself."""
    lm = load_model(make_tiny(family, tiny_dir), "cuda", "float32")
    ids = _prompt(12, seed=7)[0].tolist()
    plain, piped = Generator(lm), Generator(lm)
    plain.pipeline = False
    assert piped.pipeline == "auto"
    greedy = SamplingParams(temperature=0)
    assert _events(piped, ids, 12, greedy, ignore_eos=True) == _events(plain, ids, 12, greedy, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3)
    a = _events(piped, ids, 12, sampled, seed=4, ignore_eos=True)
    assert a == _events(Generator(lm), ids, 12, sampled, seed=4, ignore_eos=True) and len(a) == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_matches_cpu(family, tiny_dir):
    path = make_tiny(family, tiny_dir)
    cpu = load_model(path, "cpu", "float32")
    gpu = load_model(path, "cuda", "float32")
    ids = _prompt()
    expected = cpu.model(ids)
    got = gpu.model(ids.cuda()).cpu()
    assert (got - expected).abs().max().item() < 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,dtype", [(f, "float32") for f in FAMILIES]
                         + [(f, "bfloat16") for f in FAMILIES if f != "mixtral"])
def test_cuda_chunked_prefill_matches_cpu(family, dtype, tiny_dir):
    """A prompt prefilled in chunks through the KV cache on CUDA (each chunk's causal mask aligned to
    the keys' end: flash or memory-efficient attention) gives the CPU's whole-prompt logits. Not the
    tiny mixtral in bfloat16: its random router has near-tied experts, which bfloat16's rounding
    turns into others (0.12 relative error on the H100; float32 checks its attention)."""
    path = make_tiny(family, tiny_dir)
    cpu, gpu = load_model(path, "cpu", "float32"), load_model(path, "cuda", dtype)
    ids = _prompt(24, seed=5)
    expected = cpu.model(ids)[0]
    cache = KVCache(gpu.config, 32, device="cuda", dtype=getattr(torch, dtype))
    with torch.inference_mode():
        got = torch.cat([gpu.model(ids[:, a:b].cuda(), a, cache)[0].float().cpu() for a, b in ((0, 9), (9, 20), (20, 24))])
    err = (got - expected).norm() / expected.norm()
    assert err < (1e-4 if dtype == "float32" else 3e-2), err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_close_to_transformers(family, tiny_dir):
    path = make_tiny(family, tiny_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    lm = load_model(path, "cuda", "bfloat16")
    ids = _prompt().cuda()
    with torch.no_grad():
        expected = ref(ids).logits.float()
    got = lm.model(ids)
    assert (got.norm() > 0) and ((got - expected).norm() / expected.norm() < 2e-2)
    gen = Generator(lm)
    tokens = [e.token_id for e in gen.generate(ids[0].tolist(), 8, SamplingParams(temperature=0), ignore_eos=True)]
    assert len(tokens) == 8


def test_sharded_checkpoint_loads_like_single(tiny_dir, tmp_path):
    """save_pretrained with a small shard size writes model.safetensors.index.json + shards."""
    path = make_tiny("qwen2_moe", tiny_dir)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    single, sharded = load_model(path, "cpu"), load_model(tmp_path / "sharded", "cpu")
    ids = _prompt()
    assert torch.equal(single.model(ids), sharded.model(ids))
    assert single.fingerprint != load_model(make_tiny("qwen2", tiny_dir), "cpu").fingerprint



@pytest.mark.skipif(not HAVE_SMAPS, reason="needs Linux /proc")
def test_safetensors_pages_do_not_stay_resident(tmp_path):
    """Loading must not keep a shard's pages mapped beside the model's own copy (that doubled peak RAM):
    while the last of 8 tensors is read, at most about one tensor of the file is resident in our maps."""
    from safetensors.torch import save_file

    from hotcold.models.hf_loader import iter_tensors

    mib4 = 1 << 20  # float32 elements in 4 MiB
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.ones(mib4) for i in range(8)},
              str(tmp_path / "model.safetensors"))
    seen = 0
    for _, _, t in iter_tensors(tmp_path, sandwich_norms=False):
        assert float(t.sum()) == mib4  # touches every page of the tensor
        seen += 1
        resident = mapped_rss(tmp_path / "model.safetensors")
    assert seen == 8 and resident <= 2 * 4 * mib4, f"{resident / 2**20:.1f} MiB of the file resident"


@pytest.mark.skipif(not HAVE_SMAPS, reason="needs Linux /proc/self/smaps")
def test_cpu_weights_are_advised_huge_pages(tmp_path):
    """The matrices a CPU decode step streams are asked for transparent huge pages before they are
    filled (numpy does so for its own arrays, torch does not; 4 KiB pages cost a [15360, 5120] float16
    GEMV 27% of its rate on the 2-core Xeon), the fused half q/k/v matrix included."""
    import transformers as T

    from hotcold.models.quantized import fuse_qkv

    cfg = T.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    lm = load_model(tmp_path / "m", device="cpu", dtype="float16")
    attn = lm.model.layers[0].attn
    # every matrix of at least 4 MiB: the head and embedding [4096, 1024], the FFN's [2048, 1024]
    big = [(n, p) for n, p in lm.model.named_parameters() if p.numel() * p.element_size() >= 4 << 20]
    assert len(big) >= 5 and all(hugepage_advised(p) for _, p in big), [n for n, p in big if not hugepage_advised(p)]
    fuse_qkv(attn)  # q, k, v [1024, 1024] float16 each: one [3072, 1024] matrix, 6 MiB
    assert attn.qkv.data_ptr() == attn.q.weight.data_ptr() and hugepage_advised(attn.qkv)
    from hotcold.sparse_ops.cpu import advise_hugepages

    assert advise_hugepages(attn.qkv) and not advise_hugepages(torch.empty(1 << 20, device="meta"))  # host memory only
