"""models/batch_step.decode_rows: B sequences in one step equal each sequence's own step, bit for bit.

The reference is the model's own forward over a one-sequence KVCache (the path Generator runs, checked
against HF transformers by tests/test_models.py); the rows differ in prompt length and so in position
and attention span. Quantised tiny models take the fused batched block (checked: the test fails if
none does); float ones, OPT and the MoE families run their blocks row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hotcold.models import batch_step
from hotcold.models.batch_step import SlotCache, decode_rows
from hotcold.models.loader import load_model
from hotcold.models.transformer import KVCache
from tiny_models import make_tiny

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [11, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], [99]]
STEPS = 6


def _compare(lm, prompts=PROMPTS, slots=(2, 0, 3, 1)):
    """Greedy-decode every prompt alone and all together; assert the logits equal at every step."""
    m = lm.model
    pool = SlotCache(lm.config, 4, 64, dtype=lm.dtype)
    alone = [KVCache(lm.config, 64, dtype=lm.dtype) for _ in prompts]
    with torch.inference_mode():
        ref = torch.stack([m(torch.tensor([p]), 0, c, last_only=True)[0, -1] for p, c in zip(prompts, alone)])
        got = torch.stack([m(torch.tensor([p]), 0, pool.view(s), last_only=True)[0, -1]
                           for p, s in zip(prompts, slots)])
        assert torch.equal(ref, got)
        for i in range(STEPS):
            toks = [int(r.argmax()) for r in ref]
            pos = [len(p) + i for p in prompts]
            ref = torch.stack([m(torch.tensor([[t]]), q, c, last_only=True)[0, -1] for t, q, c in zip(toks, pos, alone)])
            got = decode_rows(m, toks, pos, pool, list(slots))
            assert torch.equal(ref, got), f"step {i}: max diff {(ref - got).abs().max()}"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "opt", "mixtral", "qwen2_moe"])
def test_float_models_batch_row_by_row_exactly(family, tiny_dir):
    _compare(load_model(make_tiny(family, tiny_dir), "cpu", "float32"))


@pytest.mark.parametrize("family, packed", [("llama", False), ("qwen3", False), ("gemma3", False), ("mistral", False),
                                            ("llama", True), ("gemma3", True)])
def test_quantised_blocks_batch_in_one_call_exactly(family, packed, tiny_dir):
    """packed: the matrices interleaved as a dense load leaves them (pack_for_decode), which the
    batched GEMV dots in tiles of rows."""
    from hotcold.models.quantized import pack_for_decode

    lm = load_model(make_tiny(family, tiny_dir), "cpu", "float32", quantize="q4_0")
    if packed:
        assert pack_for_decode(lm.model) > 0
    with torch.inference_mode():  # the fused batched block runs, all blocks in one call
        assert all(batch_step._fused_args(b) is not None for b in lm.model.layers)
        assert [(r.i0, r.i1) for r in batch_step.row_runs(lm.model)] == [(0, lm.config.num_layers)]
    _compare(lm)


def test_runs_of_blocks_batch_as_blocks_one_by_one(tiny_dir, monkeypatch):
    """The batched step's runs of blocks (one call for consecutive blocks) give the bits of its
    block-by-block calls; a hooked block leaves the run and runs as modules, row by row."""
    lm = load_model(make_tiny("qwen3", tiny_dir), "cpu", "float32", quantize="q8_0")
    m, L = lm.model, lm.config.num_layers
    pool = SlotCache(lm.config, 3, 32)
    with torch.inference_mode():
        for s, p in enumerate(([5, 17, 33], [11, 3, 8, 9, 2], [60])):
            m(torch.tensor([p]), 0, pool.view(s))

        def step(runs: bool) -> torch.Tensor:
            if not runs:
                monkeypatch.setattr(batch_step, "row_runs", lambda model: [])
            out = decode_rows(m, [7, 8, 9], [3, 5, 1], pool, [0, 1, 2])
            monkeypatch.undo()
            return out

        assert torch.equal(step(True), step(False))
        assert [(r.i0, r.i1) for r in batch_step.row_runs(m)] == [(0, L)]
        seen = []
        h = m.layers[1].attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
        assert torch.equal(step(True), step(False))
        assert all(r.i0 > 1 or r.i1 <= 1 for r in batch_step.row_runs(m)) and len(seen) == 2 * 3
        h.remove()


@pytest.mark.parametrize("kind, im, integer", [("q4_0", True, False), ("q4_0", True, True), ("q8_0", False, None)])
def test_input_sparse_blocks_batch_exactly(kind, im, integer, tiny_dir):
    """Thresholded projections (executors/input_sparse.py) batch as they run alone: the input-major
    kernels row by row (float32 and integer), or each row thresholded before the dense product; the
    rows' kept inputs are counted as one sequence's are."""
    from hotcold.executors.input_sparse import apply_input_sparsity
    from hotcold.profiler.input_sparsity import GROUPS
    from hotcold.sparse_ops.input_sparse_int import available

    if integer and not available():
        pytest.skip("the integer input-major kernels need AVX-512 VNNI")
    lm = load_model(make_tiny("llama", tiny_dir), "cpu", "float32", quantize=kind)
    th = {l: {g: 0.05 + 0.04 * i for i, g in enumerate(GROUPS)} for l in range(len(lm.model.layers))}
    applied = apply_input_sparsity(lm.model, th, input_major=im, integer=integer)
    assert applied.input_major == (7 * len(lm.model.layers) if im else 0)
    with torch.inference_mode():
        assert all(batch_step._fused_args(b) is not None for b in lm.model.layers)
    _compare(lm)
    assert 0.05 < applied.achieved() < 0.95


@pytest.mark.parametrize("packed", [False, True])
def test_smollm2_batches_exactly(smollm2_path, packed):
    from hotcold.models.quantized import pack_for_decode

    lm = load_model(smollm2_path, "cpu")
    if packed:  # as `hotcold serve` loads it: interleaved matrices, the tied Q8_0 head too
        pack_for_decode(lm.model)
        assert lm.model.embed.qweight.interleaved
    assert batch_step._head_matrix(lm.model) is not None  # the quantised head in one batched GEMV too
    prompts = [lm.tokenizer.encode(t) for t in ("Once upon a time", "The capital of France is",
                                                "def fibonacci(n):", "1, 2, 3, 4,")]
    _compare(lm, prompts)


def test_copy_prefix_and_views(tiny_dir):
    lm = load_model(make_tiny("llama", tiny_dir), "cpu", "float32")
    pool = SlotCache(lm.config, 3, 32)
    with torch.inference_mode():
        lm.model(torch.tensor([PROMPTS[0]]), 0, pool.view(1))
    pool.copy_prefix(1, 2, 5)
    for k, v in pool.layers:
        assert torch.equal(k[2, :, :5], k[1, :, :5]) and torch.equal(v[2, :, :5], v[1, :, :5])
    assert pool.view(2).layers[0][0].data_ptr() == pool.layers[0][0][2].data_ptr()
    assert pool.slot_nbytes() * 3 == pool.nbytes()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 17])
def test_batched_gemv_rows_equal_one_token_gemv(qtype, packed, rows):
    """Each row of qgemv_batch is qgemv's for that row, bit for bit (an interleaved matrix with more
    than 8 rows: in tiles of near-equal sizes; 104 weight rows: 13 groups, the last one alone)."""
    from hotcold.models.batch_gemv import qgemv_batch
    from hotcold.sparse_ops.quant import pack_rows, qgemv, random_matrix
    from hotcold.sparse_ops.quant.formats import PACK_DEFAULT

    m = random_matrix(qtype, (104, 256), seed=2)
    if packed:
        if qtype not in PACK_DEFAULT:
            pytest.skip(f"{qtype} is not interleaved")
        m = pack_rows(m)
    X = torch.randn(rows, 256).numpy()
    ref = np.stack([qgemv(m, x) for x in X])
    assert np.array_equal(qgemv_batch(m, X), ref)
