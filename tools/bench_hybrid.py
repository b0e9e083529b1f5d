#!/usr/bin/env python3
"""Decode speed of the hybrid engine on a generated llama-shaped layer stack, against its bound.

A few llama-7b-shaped layers (hidden 4096, FFN 11008; random weights tiled from a random pool, a
small vocabulary) are split per --hot-fraction (random hot neurons) and decoded token by token
through the KV cache. Each layer's mask is a rank-r predictor's top `--active` fraction per token
(a fixed fraction active, fresh neurons every token). Per token it reports GPU, CPU, transfer and
wait time (from the engine's statistics), tok/s with statistics off and on, and the bound

    max(fast-tier bytes / fast-tier bw, active cold bytes / CPU bw) + layers × sync

with bandwidths and the per-layer sync (worker hand-off + a small D2H/H2D round trip) measured here.
Also reports RSS before and after the split: the FFN weights are held once.

    python tools/bench_hybrid.py --hot-fraction 0.3                       # CUDA if present
    python tools/bench_hybrid.py --device cpu --layers 2 --hot-fraction 0,0.3 --tokens 16
    python tools/bench_hybrid.py --hot-fraction 0.3 --host-nodes no,yes   # cold rows as host nodes (CUDA)
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numba
import numpy as np
import psutil
import torch

from hotcold.executors import make_hybrid, random_hot
from hotcold.executors.cpu_executor import ColdJob
from hotcold.models.config import config_from_hf
from hotcold.models.layers import Rotary
from hotcold.models.loader import LoadedModel
from hotcold.models.transformer import KVCache, Transformer
from hotcold.predictors.neurons import NeuronPredictor


def rss() -> int:
    return psutil.Process().memory_info().rss


def build_model(layers: int, dim: int, ffn: int, heads: int, vocab: int, dtype: torch.dtype) -> LoadedModel:
    """Random llama-shaped model on the CPU; weights N(0, 0.02) tiled from a 16M-value pool (fast)."""
    config = config_from_hf(dict(model_type="llama", vocab_size=vocab, hidden_size=dim, intermediate_size=ffn,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                 max_position_embeddings=4096), source="bench")
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 24, generator=gen) * 0.02).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.data.view(-1)
            if name.endswith("norm.weight"):
                flat.fill_(1.0)
                continue
            off = int(torch.randint(0, 1 << 20, (1,), generator=gen))
            for a in range(0, flat.numel(), len(pool) - off):
                b = min(flat.numel(), a + len(pool) - off)
                flat[a:b].copy_(pool[off:off + b - a])
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset("cpu")  # rotary tables in float32, as the loader keeps them
    return LoadedModel(model.eval(), None, config, Path("bench"), "bench", torch.device("cpu"), dtype)


class TopKMask:
    """A rank-r predictor whose top `k` neurons per token are the active ones (a fixed fraction)."""

    def __init__(self, dim: int, n: int, rank: int, k: int, device):
        p = NeuronPredictor(dim, n, rank).to(device)
        self.w1, self.b1 = p.w1.weight.detach(), p.w1.bias.detach()
        self.w2, self.b2 = p.w2.weight.detach(), p.w2.bias.detach()
        self.k, self.n = k, n
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.w1, self.b1, self.w2, self.b2))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> bool [N, I] with k True per row
        logits = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x.float(), self.w1, self.b1)),
                                            self.w2, self.b2)
        idx = torch.topk(logits, self.k, dim=-1).indices
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gpu_bw(device: torch.device, dtype: torch.dtype) -> float:
    """Weight bytes/s of a GEMV over a 1 GiB (CUDA) / 256 MiB (CPU) matrix."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // (4096 * torch.finfo(dtype).bits // 8)
    w = torch.randn(n, 4096, device=device).to(dtype)
    x = torch.randn(4096, device=device).to(dtype)
    for _ in range(3):
        w @ x
    sync(device)
    reps = 20 if device.type == "cuda" else 3
    t = time.perf_counter()
    for _ in range(reps):
        w @ x
    sync(device)
    return reps * w.numel() * w.element_size() / (time.perf_counter() - t)


def measure_cpu_bw(eng) -> float:
    """Weight bytes/s of the worker's fused FFN kernel over *all* cold rows of one layer (its best
    case: one long pass), on the worker thread with its numba threads."""
    ffn = next(f for f in eng.layers.values() if f.cold.n)
    cold, io = ffn.cold, ffn.decode_io
    io.x_np[:] = np.random.default_rng(0).standard_normal(io.x_np.shape).astype(np.float32)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        eng.cpu.submit(ColdJob(cold, io.x_np, None, io.out_np)).wait()
        times.append(time.perf_counter() - t)
    return cold.n * cold.neuron_bytes / float(np.median(times[1:]))


def measure_sync(eng, device: torch.device, dim: int) -> tuple[float, float]:
    """Per-layer fixed costs (medians): (worker hand-off with no rows, D2H + H2D round trip of x)."""
    ffn = next(f for f in eng.layers.values() if f.cold.n)
    cold, io = ffn.cold, ffn.decode_io
    none = np.zeros(cold.n, bool)
    x = torch.randn(1, dim, device=device)
    hand, trip = [], []
    for _ in range(50):
        t = time.perf_counter()
        eng.cpu.submit(ColdJob(cold, io.x_np, none, io.out_np)).wait()
        hand.append(time.perf_counter() - t)
        t = time.perf_counter()
        io.x.copy_(x)  # D2H (synchronous)
        y = io.out.to(device, non_blocking=True)
        sync(device)
        trip.append(time.perf_counter() - t)
    del y
    return float(np.median(hand)), float(np.median(trip))


def decode(lm: LoadedModel, steps: int, warmup: int, on_start=None) -> float:
    """Decode `steps` tokens greedily after `warmup`; returns seconds per token."""
    cache = KVCache(lm.config, warmup + steps + 2, device=lm.device, dtype=lm.dtype, layer_devices=lm.layer_devices)
    tok = torch.tensor([[1]], device=lm.device)
    with torch.inference_mode():
        for i in range(warmup + steps):
            if i == warmup:
                sync(lm.device)
                if on_start:
                    on_start()
                t0 = time.perf_counter()
            logits = lm.model(tok, i, cache)
            tok = logits[:, -1].argmax(-1, keepdim=True) % 7 + 1  # forces a sync, like sampling
        sync(lm.device)
    return (time.perf_counter() - t0) / steps


def dense_baseline(args, dtype: torch.dtype) -> dict:
    """The unconverted model entirely on the device (the reference forward)."""
    lm = build_model(args.layers, args.dim, args.ffn, args.heads, args.vocab, dtype)
    device = torch.device(args.device)
    lm.model.to(device)
    for m in lm.model.modules():
        if isinstance(m, Rotary):
            m.reset(device)
    lm.device = device
    s = decode(lm, args.tokens, args.warmup)
    del lm
    gc.collect()
    return dict(hot_fraction=float("nan"), tok_s=1 / s, ms_per_token=1e3 * s)


def run(args, frac: float, host_nodes: bool = False) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    gc.collect()
    r0 = rss()
    lm = build_model(args.layers, args.dim, args.ffn, args.heads, args.vocab, dtype)
    ffn_bytes = sum(p.numel() * p.element_size() for b in lm.model.layers for p in b.ffn.parameters())
    gc.collect()
    r1 = rss()
    attn_cpu = set(range(int(round(args.attention_cpu * args.layers))))
    attn_cpu_bytes = sum(p.numel() * p.element_size() for l in attn_cpu for p in lm.model.layers[l].attn.parameters())
    eng = make_hybrid(lm, random_hot(lm, frac, seed=1), None, device=device, dtype=dtype, cpu_dtype=args.cpu_dtype,
                      threads=args.threads, stats=True, prefill="cpu", attention_cpu=attn_cpu,
                      cpu_inline=args.host_thread == "inline", dense_host_nodes=host_nodes)
    gc.collect()
    r2 = rss()
    k = int(round(args.active * args.ffn))
    for f in eng.layers.values():
        f.gpu.mask_fn = TopKMask(args.dim, args.ffn, args.rank, k, device)
        # the mask must come out in hot-first order: TopKMask's neurons are already anonymous (random)
    threads = eng.cpu.threads
    cold_any = next((f.cold for f in eng.layers.values() if f.cold.n), None)
    cpu_bw = args.cpu_bw or (measure_cpu_bw(eng) if cold_any else float("nan"))
    gpu_bw = args.gpu_bw or measure_gpu_bw(device, dtype)
    hand_s, trip_s = measure_sync(eng, device, args.dim) if cold_any else (0.0, 0.0)
    sync_s = hand_s + trip_s

    eng.set_stats(False)
    s_plain = decode(eng.lm, args.tokens, args.warmup)
    eng.set_stats(True)
    s_timed = decode(eng.lm, args.tokens, args.warmup, on_start=eng.reset_stats)
    st = eng.stats()["decode"]
    per = st["per_token"]

    attn = sum(p.numel() * p.element_size() for b in lm.model.layers for p in b.attn.parameters()) - attn_cpu_bytes
    norms = sum(p.numel() * p.element_size() for b in lm.model.layers
                for m in (b.attn_norm, b.ffn_norm) for p in m.parameters())
    fast_bytes = sum(f.gpu.hot.nbytes + f.gpu.mask_fn.nbytes for f in eng.layers.values()) + attn + norms
    fast_bytes += lm.model.embed.weight.numel() * lm.model.embed.weight.element_size()  # lm_head, roughly
    neuron_bytes = cold_any.neuron_bytes if cold_any else 0
    cpu_bytes = per["rows_cpu"] * neuron_bytes + attn_cpu_bytes
    n_sync = sum(1 for f in eng.layers.values() if f.cold.n) + len(attn_cpu)
    bound = max(fast_bytes / gpu_bw, cpu_bytes / cpu_bw if cold_any else 0.0) + n_sync * sync_s
    eng.close()
    out = dict(
        hot_fraction=frac, host_nodes=host_nodes, active_fraction=args.active, layers=args.layers, device=str(device), dtype=args.dtype,
        cpu_dtype=args.cpu_dtype, threads=threads, tok_s=1 / s_plain, tok_s_timed=1 / s_timed,
        ms_per_token=1e3 * s_plain, gpu_ms=per["gpu_ms"], cpu_ms=per["cpu_ms"], transfer_ms=per["transfer_ms"],
        wait_ms=per["wait_ms"], cpu_wait_ms=per["cpu_wait_ms"], host_ms=per["host_ms"], attention_cpu=len(attn_cpu),
        host_thread=args.host_thread, rows_gpu=per["rows_gpu"], rows_cpu=per["rows_cpu"],
        fast_MB=fast_bytes / 1e6, cpu_active_MB=cpu_bytes / 1e6, gpu_bw_GBs=gpu_bw / 1e9, cpu_bw_GBs=cpu_bw / 1e9,
        sync_us=1e6 * sync_s, handoff_us=1e6 * hand_s, roundtrip_us=1e6 * trip_s,
        numba_layer=_threading_layer(), bound_ms=1e3 * bound, bound_tok_s=1 / bound,
        rss_model_MB=(r1 - r0) / 1e6, rss_split_delta_MB=(r2 - r1) / 1e6, ffn_MB=ffn_bytes / 1e6,
    )
    del eng, lm
    gc.collect()
    return out


def _threading_layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:
        return "none yet"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hot-fraction", default="0.3", help="comma-separated fractions of FFN neurons on the fast tier")
    ap.add_argument("--active", type=float, default=0.2, help="fraction of neurons active per token")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--rank", type=int, default=128, help="predictor rank")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fast tier: bf16 | f16 | f32 (default bf16 on CUDA, f32 on CPU)")
    ap.add_argument("--cpu-dtype", default="bf16", help="cold rows: f32 | bf16 | f16 | i8")
    ap.add_argument("--threads", type=int, default=None, help="CPU worker's numba threads")
    ap.add_argument("--attention-cpu", type=float, default=0.0,
                    help="fraction of layers (the first ones) whose attention and KV cache stay on the CPU")
    ap.add_argument("--host-thread", choices=("inline", "worker"), default="inline",
                    help="where the CPU parts (cold FFN, CPU attention) run: the calling thread (the engine's default "
                    "on CUDA with graphs and on the CPU) or a worker thread")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (CPU attention's rotary, cache and SDPA ops); default: torch's")
    ap.add_argument("--host-nodes", default="no", help="CUDA: each layer's cold rows as a host node of one graph per "
                    "layer (FFNHostNode) for the statistics-off run: no / yes / no,yes (the timed run keeps split graphs)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--gpu-bw", type=float, default=None, help="bytes/s instead of measuring")
    ap.add_argument("--cpu-bw", type=float, default=None, help="bytes/s instead of measuring")
    ap.add_argument("--dense", action="store_true", help="also time the unconverted model on the device")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "f32")
    if args.device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    dense = dense_baseline(args, dtype) if args.dense else None
    rows = [run(args, float(f), h == "yes") for f in args.hot_fraction.split(",")
            for h in (h.strip() for h in args.host_nodes.split(","))]
    if args.json:
        args.json.write_text(json.dumps({"dense": dense, "rows": rows}, indent=1))
    cols = [("hot", "hot_fraction", "{:.2f}"), ("host node", "host_nodes", "{}"), ("tok/s", "tok_s", "{:.1f}"), ("tok/s(st)", "tok_s_timed", "{:.1f}"),
            ("ms/tok", "ms_per_token", "{:.2f}"), ("gpu", "gpu_ms", "{:.2f}"), ("cpu", "cpu_ms", "{:.2f}"),
            ("xfer", "transfer_ms", "{:.3f}"), ("wait", "wait_ms", "{:.2f}"), ("cpuwait", "cpu_wait_ms", "{:.2f}"),
            ("host", "host_ms", "{:.2f}"),
            ("rows_gpu", "rows_gpu", "{:.0f}"), ("rows_cpu", "rows_cpu", "{:.0f}"), ("bound", "bound_ms", "{:.2f}"),
            ("bound tok/s", "bound_tok_s", "{:.0f}")]
    r = rows[0]
    print(f"\n{r['layers']} llama-shaped layers ({args.dim}x{args.ffn}), fast tier {r['device']} {r['dtype']}, "
          f"cold rows {r['cpu_dtype']}, {r['threads']} CPU threads, {args.active:.0%} active per token; "
          f"times are ms per token; attention of {r['attention_cpu']} layers on the CPU ({r['host_thread']} thread)")
    print(f"measured: fast-tier bw {r['gpu_bw_GBs']:.0f} GB/s, CPU bw {r['cpu_bw_GBs']:.1f} GB/s (fused kernel, all "
          f"cold rows, worker thread; numba layer {r['numba_layer']}), sync {r['sync_us']:.0f} us per layer "
          f"(hand-off {r['handoff_us']:.0f} + D2H/H2D round trip {r['roundtrip_us']:.0f})")
    if dense:
        print(f"dense reference forward, all on {args.device}: {dense['tok_s']:.1f} tok/s ({dense['ms_per_token']:.2f} ms/token)")
    print(" | ".join(f"{h:>9s}" for h, _, _ in cols))
    for r in rows:
        print(" | ".join(f"{f.format(r[k]):>9s}" for _, k, f in cols))
    for r in rows:
        print(f"hot {r['hot_fraction']:.2f}: RSS +{r['rss_model_MB']:.0f} MB for the model "
              f"(FFN {r['ffn_MB']:.0f} MB), {r['rss_split_delta_MB']:+.0f} MB by the split; fast-tier bytes/token "
              f"{r['fast_MB']:.0f} MB, active cold bytes/token {r['cpu_active_MB']:.1f} MB")


if __name__ == "__main__":
    main()
