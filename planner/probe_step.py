"""What a CPU decode step costs beyond reading its weights: per layer, per matrix product, per
sampled token, and per hand-off to the CPU worker thread.

The cost model charges a layer's weight bytes at the probe's kernel rates; a decode step also pays
for what does not scale with bytes: the Python around the block's fused call and its dispatch, the
start of every kernel's thread team, the norms, the rotary and a short attention. On small models
these are a large share of the token (SmolLM2-135M: 30 layers of 2.2 MB each, ~75 µs of bytes a
layer at 2 threads), and a count of kernel calls times a one-row call's time missed most of them.

`layer_step_s` times one-token steps of two tiny synthetic Q4_0 llama models (2 and 10 layers,
hidden 64: each layer's bytes read in well under a microsecond) through `Transformer.forward`, as
`hotcold run` decodes a dense CPU model, and returns the slope: seconds per layer. With moe=True the
models are Qwen3-MoE ones split as an all-CPU plan runs them (a MoE block's attention is one fused
call, its experts another, with the routing in torch between them).

`matrix_fixed_s` is what a matrix product of a small model's size costs over its bytes at the
dense rate of large matrices: with several threads each product starts its thread team and every
thread's stream from memory anew (on 2 cores, Q4_1 matrices of 200-550 KB read from memory at 14-19
GB/s where 10-80 MB ones read at 26: about 7 µs a product, where one thread loses ~1-3 µs).
"""

from __future__ import annotations

import queue
import threading

from hotcold.planner.timing import _call_time, _rate

LAYERS = (2, 10)  # the two depths whose step times give the per-layer slope


def _random_q4_0(cfg):
    """A Transformer of cfg with small random weights (seeded), its matrices quantised to Q4_0."""
    import torch

    from hotcold.models.quantized import quantize_model
    from hotcold.models.transformer import Transformer

    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    quantize_model(model, "q4_0")
    return model.eval()


def _tiny_model(layers: int):
    """A Q4_0 llama of `layers` layers, hidden 64 (2 heads of 32, one KV head), FFN 128, 256 tokens,
    its matrices interleaved as a dense CPU load packs them."""
    from hotcold.models.config import LlamaConfig
    from hotcold.models.quantized import pack_for_decode

    cfg = LlamaConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=layers,
                      num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = _random_q4_0(cfg)
    pack_for_decode(model)
    return cfg, model


def _tiny_moe(layers: int, threads: int | None):
    """A Q4_0 Qwen3-MoE of `layers` layers (hidden 64, 8 experts of 64, top 2) split as an all-CPU plan
    runs it: every expert a host expert of a `HybridMoE` on a CPU tier (`make_hybrid`), so a step
    pays what such a layer pays beyond its bytes (the router's module call and routing in torch,
    `FFN.host_decode`, the expert kernel's call). -> (config, model, engine)."""
    from pathlib import Path

    import torch

    from hotcold.executors import make_hybrid
    from hotcold.models.config import Qwen3MoeConfig
    from hotcold.models.loader import LoadedModel

    cfg = Qwen3MoeConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=64,
                         num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, num_experts=8, top_k=2, moe_intermediate_size=64)
    lm = LoadedModel(_random_q4_0(cfg), None, cfg, Path("probe"), "probe", torch.device("cpu"), torch.float32)
    engine = make_hybrid(lm, {}, None, device="cpu", threads=threads, gpu_experts={}, stats=False)
    return cfg, lm.model, engine


def layer_step_s(min_time: float = 0.25, position: int = 64, rounds: int = 3, moe: bool = False,
                 threads: int | None = None) -> float | None:
    """Seconds per layer of a one-token CPU step beyond its weights' bytes (see the module
    docstring); the step decodes at `position` (a short context: the KV read is charged apart). The
    two depths are timed in turns, `rounds` times, each keeping its fastest: a busy moment slows one
    timing, and a difference of two disturbed timings can come out anywhere. None when the deeper
    model did not come out slower (a machine too busy to tell)."""
    import torch

    from hotcold.models.transformer import KVCache

    steps, engines = [], []
    with torch.inference_mode():
        for n in LAYERS:
            if moe:
                cfg, model, engine = _tiny_moe(n, threads)
                engines.append(engine)
            else:
                cfg, model = _tiny_model(n)
            cache = KVCache(cfg, position + 8)
            model(torch.arange(position).reshape(1, -1) % cfg.vocab_size, 0, cache, last_only=True)
            token = torch.tensor([[5]])
            steps.append(lambda model=model, cache=cache, token=token: model(token, position, cache, last_only=True))
        best = [float("inf")] * len(LAYERS)
        for _ in range(rounds):
            for i, step in enumerate(steps):
                best[i] = min(best[i], _rate(step, min_time / rounds))
    for engine in engines:
        engine.close()
    slope = (best[1] - best[0]) / (LAYERS[1] - LAYERS[0])
    return slope if slope > 0 else None


MATRIX_ROWS, MATRIX_COLS = 512, 1024  # the small product matrix_fixed_s times (Q4_0: 288 KB)


def matrix_fixed_s(raw, dense_Bps: float, call_s: float, min_time: float = 0.25) -> float:
    """Seconds a dense product of a small Q4_0 matrix takes beyond its bytes at `dense_Bps` (the
    large matrices' rate) and one Python call (`call_s`): each call reads another matrix of a pool
    over the byte buffer `raw` (larger than the last-level cache), as decoding reads each layer's."""
    import itertools

    import numpy as np

    from hotcold.planner.probe import _quant_pool
    from hotcold.sparse_ops import quant

    mats = _quant_pool(quant, raw, "Q4_0", MATRIX_ROWS, MATRIX_COLS, dense=True)
    pool = itertools.cycle(mats)
    x = (np.random.default_rng(0).standard_normal(MATRIX_COLS) / MATRIX_COLS).astype(np.float32)
    out = np.empty(MATRIX_ROWS, np.float32)
    t = _rate(lambda: quant.qgemv(next(pool), x, out), min_time)
    return max(0.0, t - mats[0].nbytes / dense_Bps - call_s)


def handoff_s(quick: bool = False) -> float:
    """Seconds of a round trip main thread -> worker -> main through two queues (the executors'
    hand-off to their CPU worker)."""
    to_w, to_m = queue.SimpleQueue(), queue.SimpleQueue()

    def worker():
        while True:
            item = to_w.get()
            if item is None:
                return
            to_m.put(item)

    th = threading.Thread(target=worker, daemon=True)
    th.start()

    def trip():
        to_w.put(1)
        to_m.get()

    try:
        return _call_time(trip, 50 if quick else 400)
    finally:
        to_w.put(None)
        th.join()


SAMPLE_VOCABS = (16384, 262144)  # the two vocabulary sizes sample_costs times


def sample_costs(min_time: float = 0.25) -> tuple[float, float]:
    """(seconds, seconds per logit) of sampling one token on the CPU with the default sampling
    (temperature, top-k, top-p, min-p: models/sampling.py), fitted to two vocabulary sizes: a token
    of a V-logit model costs seconds + V x seconds per logit (SmolLM2's 49k: ~0.2 ms on 2 cores,
    Gemma 3's 262k: ~0.55 ms). Timed in turns, keeping each size's fastest."""
    import torch

    from hotcold.models.sampling import SamplingParams, sample_id

    params, gen = SamplingParams(), torch.Generator().manual_seed(0)
    logits = [torch.randn(v, generator=gen) for v in SAMPLE_VOCABS]
    best = [float("inf")] * len(SAMPLE_VOCABS)
    for _ in range(3):
        for i, x in enumerate(logits):
            best[i] = min(best[i], _rate(lambda x=x: sample_id(x, params, gen), min_time / 3))
    per_logit = max(0.0, (best[1] - best[0]) / (SAMPLE_VOCABS[1] - SAMPLE_VOCABS[0]))
    return max(0.0, best[0] - per_logit * SAMPLE_VOCABS[0]), per_logit
