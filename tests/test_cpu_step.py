"""A block's one-token CPU step as one numba call (models/cpu_step.py) against the module path: GGUF
blocks and float weights."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import hotcold.models.transformer as transformer
from hotcold.models.cpu_step import block_step, prepared
from hotcold.models.layers import FFN
from hotcold.models.loader import load_model
from hotcold.models.quantized import QuantLinear, fuse_qkv
from hotcold.models.transformer import KVCache
from tiny_models import make_tiny, quantised_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_step")


def _quantised(tiny_dir, family: str, kind: str, fused: bool = False):
    return quantised_tiny(tiny_dir, family, kind, fused)


def _module_path():
    """A context where Block.forward never takes the fused step."""
    class Off:
        def __enter__(self):
            self.orig, transformer.block_step = transformer.block_step, lambda *a: None

        def __exit__(self, *exc):
            transformer.block_step = self.orig
    return Off()


def _each_block(lm, toks, prefix: int, ca: KVCache, cb: KVCache):
    """Prefill toks[:, :prefix] into both caches by the module path; then at each later position feed
    every block the module path's input, once fused (cache ca), once by the module path (cb). Yields
    (position, layer, block, the fused step's output or None, the module path's output)."""
    m = lm.model
    with torch.inference_mode():
        with _module_path():
            m(toks[:, :prefix], 0, ca)
            m(toks[:, :prefix], 0, cb)
        for p in range(prefix, toks.shape[1]):
            pos = torch.tensor([p])
            x = m.embed_tokens(toks[:, p:p + 1], pos)
            for i, blk in enumerate(m.layers):
                got = block_step(blk, x, pos, ca.layers[i], p)
                with _module_path():
                    want = blk(x, pos, cb.layers[i], p)
                yield p, i, blk, got, want
                x = want


@pytest.mark.parametrize("family, kind, fused", [("llama", "q8_0", False), ("llama", "q4_0", True),
                                                 ("qwen2", "q8_0", False), ("qwen3", "q4_0", False),
                                                 ("mistral", "q4_0", False), ("gemma3", "q8_0", False),
                                                 ("opt", "q8_0", False), ("opt", "q4_0", False),
                                                 ("opt_post", "q4_0", False)])
def test_block_step_equals_the_module_path(tiny_dir, family, kind, fused):
    """Each block's fused step, fed the module path's input at every position of a decode, gives the
    module path's output and writes the same keys and values (biases: qwen2, opt; QK-norm: qwen3, gemma3;
    sliding windows: mistral, gemma3; sandwich norms and GeGLU: gemma3; LayerNorm, no rotary and a
    DenseFFN with biases: opt, pre-norm and post-norm)."""
    lm = _quantised(tiny_dir, family, kind, fused)
    m, cfg = lm.model, lm.config
    assert all(getattr(b.attn, "qkv", None) is not None for b in m.layers) == fused
    if family.startswith("opt"):  # the whole OPT block in the one call, not its attention half
        plans = [prepared(b)[0] for b in m.layers]
        assert all(p.layer_norm and p.ffn and not p.gated and p.pre_norm == (family == "opt") for p in plans)
    ca, cb = KVCache(cfg, 32), KVCache(cfg, 32)
    toks = torch.randint(3, 160, (1, 20), generator=torch.Generator().manual_seed(1))
    for p, i, _, got, want in _each_block(lm, toks, 6, ca, cb):
        assert got is not None
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (family, p, i)
    for (ka, va), (kb, vb) in zip(ca.layers, cb.layers):
        assert torch.allclose(ka[:, :, :20], kb[:, :, :20], atol=1e-5) and torch.allclose(va[:, :, :20], vb[:, :, :20], atol=1e-5)


@pytest.mark.parametrize("family, kind", [("llama", "q8_0"), ("opt", "q4_0"), ("opt_post", "q8_0")])
def test_decode_takes_the_fused_step_and_stays_close(tiny_dir, family, kind):
    """Decoding through the model uses the fused step in every block (float32, quantised) and its
    logits stay within Q8-activation noise of the module path's."""
    lm = _quantised(tiny_dir, family, kind)
    toks = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(2))

    def decode(cache):
        with torch.inference_mode():
            return torch.cat([lm.model(toks[:, i:i + 1], i, cache) for i in range(12)], 1)

    calls = []
    orig, runs = transformer.block_step, transformer.cpu_run.applies
    transformer.block_step = lambda *a: calls.append(orig(*a)) or calls[-1]
    transformer.cpu_run.applies = lambda *a: False  # block by block (runs of blocks: tests/test_cpu_run.py)
    try:
        got = decode(KVCache(lm.config, 16))
    finally:
        transformer.block_step, transformer.cpu_run.applies = orig, runs
    assert len(calls) == 12 * lm.config.num_layers and all(c is not None for c in calls)
    assert all(b.__dict__["_cpu_step"][1] is not None for b in lm.model.layers)
    with _module_path():
        want = decode(KVCache(lm.config, 16))
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("qwen2", "float16"), ("gemma3", "bfloat16"),
                                           ("qwen3", "float16"), ("opt", "float32"), ("opt_post", "float32"),
                                           ("opt", "bfloat16"), ("opt_post", "float16")])
def test_float_block_step_equals_the_float32_module_path(tiny_dir, family, dtype):
    """Blocks of float weights (nn.Linear float32 / float16 / bfloat16, read in place by the row kernel;
    a half model's q/k/v fused into one matrix by fuse_qkv) take the fused step, and each block's output
    is the float32 module path's over the same weight values, within the rounding of the output and of a
    half model's float16 cache, at every position of a decode (biases: qwen2; QK-norm: qwen3, gemma3;
    sandwich norms and GeGLU: gemma3; LayerNorm, no rotary and biases on every projection: opt,
    pre-norm and post-norm)."""
    lm = load_model(make_tiny(family, tiny_dir), "cpu", dtype)
    half = dtype != "float32"
    if half:
        fuse_qkv(lm.model)
        assert all(isinstance(getattr(b.attn, "qkv", None), torch.Tensor) for b in lm.model.layers)
    ref = load_model(make_tiny(family, tiny_dir), "cpu", "float32")
    params = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            params[name].copy_(p.float())
    ca = KVCache(lm.config, 32, dtype=torch.float16 if half else torch.float32)
    cb = KVCache(ref.config, 32)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    toks = torch.randint(3, 160, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        with _module_path():
            lm.model(toks[:, :4], 0, ca)
            ref.model(toks[:, :4], 0, cb)
        for p in range(4, 14):
            pos = torch.tensor([p])
            x = ref.model.embed_tokens(toks[:, p:p + 1], pos)
            for i, (blk, rblk) in enumerate(zip(lm.model.layers, ref.model.layers)):
                got = block_step(blk, x.to(getattr(torch, dtype)), pos, ca.layers[i], p)
                assert got is not None and got.dtype == getattr(torch, dtype)
                with _module_path():
                    want = rblk(x, pos, cb.layers[i], p)
                assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol, (family, dtype, p, i)
                x = want


def test_block_step_gives_way_to_hooks_and_replaced_modules(tiny_dir):
    """A hook on an attention-side module (the look-ahead's on ffn_norm, a probe on q) sends the step
    down the module path; one on the FFN's modules (the profiler's) leaves the attention half fused
    and runs the FFN as a module, so the hook sees it; a module replaced after the first step (a hybrid
    split, a new QuantLinear) is seen, and what the block remembers does not keep it alive."""
    lm = _quantised(tiny_dir, "llama", "q8_0")
    blk = lm.model.layers[0]
    cache = KVCache(lm.config, 8).layers[0]
    x, pos = torch.randn(1, 1, lm.config.hidden_size), torch.tensor([0])
    with torch.inference_mode():
        want = block_step(blk, x, pos, cache, 0)
        assert want is not None
        seen = []
        h = blk.ffn.up.register_forward_hook(lambda *a: seen.append(1))
        got = block_step(blk, x, pos, cache, 0)
        assert seen == [1] and ((got - want).abs().max() / want.abs().max()).item() < 1e-5
        h.remove()
        for module in (blk.ffn_norm, blk.attn.q):
            h = module.register_forward_pre_hook(lambda *a: seen.append(2))
            assert block_step(blk, x, pos, cache, 0) is None
            blk(x, pos, cache, 0)
            h.remove()
        assert seen == [1, 2, 2]
        assert block_step(blk, x, pos, cache, 0) is not None
        old = blk.__dict__["_cpu_step"]
        blk.ffn.down = copy.deepcopy(blk.ffn.down)
        assert isinstance(blk.ffn.down, QuantLinear)
        assert block_step(blk, x, pos, cache, 0) is not None and blk.__dict__["_cpu_step"] is not old
        q = blk.attn.q
        blk.attn.q = torch.nn.Linear(q.in_features, q.out_features, bias=True)
        assert block_step(blk, x, pos, cache, 0) is None  # a bias on q but not on k, v: the module path
        blk.attn.q = q
        for bias in (False, True):  # a float o projection, with and without bias: seen, and read in place
            blk.attn.o = torch.nn.Linear(blk.attn.o.in_features, blk.attn.o.out_features, bias=bias)
            got = block_step(blk, x, pos, cache, 0)
            with _module_path():
                want = blk(x, pos, cache, 0)
            assert got is not None and ((got - want).abs().max() / want.abs().max()).item() < 1e-5
        # what the block remembers holds no reference to its modules: a replaced FFN is freed
        gone = weakref.ref(blk.ffn)
        blk.ffn = torch.nn.Identity()
        gc.collect()
        assert gone() is None


def test_block_step_sees_new_and_updated_norm_weights(tiny_dir):
    """The norm weights a block keeps between steps: a new weight tensor is taken, an in-place update
    of a float32 one is read where it lies; each step equals the module path's."""
    lm = _quantised(tiny_dir, "llama", "q8_0")
    blk = lm.model.layers[0]
    cache = KVCache(lm.config, 8).layers[0]
    x, pos = torch.randn(1, 1, lm.config.hidden_size), torch.tensor([0])

    def step_and_check():
        with torch.inference_mode():
            got = block_step(blk, x, pos, cache, 0)
            with _module_path():
                want = blk(x, pos, cache, 0)
        assert got is not None and ((got - want).abs().max() / want.abs().max()).item() < 1e-5
        return got

    first = step_and_check()
    blk.ffn_norm.weight = torch.nn.Parameter(blk.ffn_norm.weight.detach() * 3)
    second = step_and_check()
    with torch.no_grad():
        blk.attn_norm.weight.mul_(0.25)
    third = step_and_check()
    assert not torch.allclose(first, second) and not torch.allclose(second, third)


class _OtherFFN(FFN):
    """An FFN module of a type the fused step does not take (as a hybrid split's HybridFFN): the inner one's
    forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("family, kind", [("qwen3_moe", "q4_0"), ("qwen2_moe", "q8_0"), ("llama", "q8_0"),
                                          ("opt", "q8_0"), ("opt_post", "q4_0")])
def test_attention_half_before_an_ffn_module(tiny_dir, family, kind):
    """A block whose FFN is not a GatedFFN of host matrices without biases nor a DenseFFN (MoE layers
    here; the llama FFN's down given a bias; OPT's FFN inside another FFN module, as a hybrid split's)
    runs its attention half as one call and its FFN as a module: the block's output equals the module
    path's at every position of a decode (OPT pre-norm and post-norm: the FFN's residual add and
    ffn_norm after the module)."""
    lm = _quantised(tiny_dir, family, kind)
    m = lm.model
    if family == "llama":
        for blk in m.layers:
            blk.ffn.down = torch.nn.Linear(blk.ffn.down.in_features, blk.ffn.down.out_features, bias=True)
    if family.startswith("opt"):
        for blk in m.layers:
            blk.ffn = _OtherFFN(blk.ffn)
    ca, cb = KVCache(lm.config, 24), KVCache(lm.config, 24)
    toks = torch.randint(3, 160, (1, 14), generator=torch.Generator().manual_seed(3))
    for p, i, blk, got, want in _each_block(lm, toks, 4, ca, cb):
        # (qwen2_moe's layer 1 is a dense GatedFFN: that one runs whole)
        assert got is not None
        assert blk.__dict__["_cpu_step"][1].ffn == (type(blk.ffn).__name__ == "GatedFFN" and family != "llama")
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, (family, p, i)
