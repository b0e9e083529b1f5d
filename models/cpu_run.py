"""Consecutive blocks' one-token steps on the CPU in one numba call.

A block's fused step (models/cpu_step.py) is one numba call, but each call costs ~40 µs of Python
around it (checks that the block has not changed, its arguments, numba's dispatch of 38 of them, the
tensor conversions): 1.2 ms of SmolLM2-135M's ~7 ms token on 2 cores. Here a run of consecutive
whole blocks whose kernel arguments have one numba type (a model's layers mostly do: the GGUF
types are run-time values) goes in one call of `_run_blocks`, which loops over the blocks and calls
each one's `_block_step`, the same compiled step with the same arguments: the output is bit for bit
the block-by-block one (tests/test_cpu_run.py). The Python left per block is the check that its
arguments are still those the run was made of (`cpu_step.prepared`).

The run's static arguments (norms, matrices, shapes, each layer's rotary kind and window) are made
once and kept per model (beside it, not in it: numba's typed Lists neither pickle nor deep-copy, and
a copy of a model makes its own runs); per step it passes the token's activation, the rotary tables of this
position (one row per rotary kind: Gemma 3 has two; a row of zeros for OPT's blocks, which have no
rotary), the layers' KV arrays (kept per cache) and shared scratch. OPT's blocks (LayerNorm, biases,
DenseFFN, pre- or post-norm) join runs as the others do: the step's flags are run-time values.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import torch
from numba import njit, typeof
from numba.core.errors import NumbaPendingDeprecationWarning
from numba.typed import List

from hotcold.models import cpu_step
from hotcold.models.cpu_step import _FLOATS, _block_step, _norm_weights, _rotary_tables, attn_scratch, ffn_args, \
    kv_arrays, prepared


@njit(nogil=True, cache=True)
def _run_blocks(x, statics, kcs, vcs, cos_t, sin_t, pos, abuf, fbuf):
    # statics: a typed List (its numba type does not depend on the run's length: one build for every
    # model whose blocks have these types); statics[i]: block i's (norm_w, eps, plus_one, sandwich,
    # qkv, q, k, v, fused, biases, has_bias, qk_norm, H, Hkv, Dh, rotary, scale, o, gate, up, down,
    # act, window, layer_norm, pre_norm, gated, FFN biases, rotary kind); kcs/vcs[i] its KV arrays
    # (typed Lists too); cos_t/sin_t [kinds, Dh] (a row of zeros for blocks without rotary).
    # Returns the last block's output [D].
    cur = x.copy()
    nxt = np.empty_like(x)
    r = np.empty_like(x)
    f_in = np.empty_like(x)
    for i in range(len(statics)):
        s = statics[i]
        lo = max(0, pos - s[22] + 1) if s[22] > 0 else 0
        _block_step(cur, s[0], s[1], s[2], s[23], s[24], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11],
                    s[12], s[13], s[14], cos_t[s[27]], sin_t[s[27]], s[15], kcs[i], vcs[i], pos, lo, s[16], s[17],
                    abuf, s[18], s[19], s[20], s[25], s[26], s[21], fbuf, r, f_in, nxt)
        cur, nxt = nxt, cur
    return cur


@njit(nogil=True, cache=True)
def _typed(items):
    # a Python list as a typed List, made in compiled (disk-cached) code: a List made from Python
    # compiles the list's methods for its item type in every process (~2 s); a tuple would compile
    # once per length, its runtime indexing a switch over every element
    out = List()
    for item in items:
        out.append(item)
    return out


def _as_list(items: list):
    with warnings.catch_warnings():  # (numba's note that reflected lists will go: only this one call's)
        warnings.simplefilter("ignore", NumbaPendingDeprecationWarning)
        return _typed(items)


class BlockRun:
    """Blocks layers[i0:i1] as one call: their static arguments."""

    def __init__(self, i0: int, i1: int, statics: List, rotaries: list, need_f: int, heads: tuple):
        self.i0, self.i1 = i0, i1
        self.statics, self.rotaries = statics, rotaries
        self.need_f, self.heads = need_f, heads
        self.kv: tuple | None = None  # (the cache's layer list, kcs, vcs)


def _key(block) -> tuple | None:
    """What a block's run arguments were made of (its kernel arguments and norm weights, as objects
    that `cpu_step.prepared` replaces when the block changes), or None where no run takes it."""
    if "attn" not in getattr(block, "_modules", {}):  # an executor's wrapper
        return None
    got = prepared(block)
    if got is None or not got[1]:
        return None
    return got[2], block.ffn.__dict__.get("_cpu_args"), block.__dict__.get("_cpu_norms")


def _same(a: tuple | None, b: tuple | None) -> bool:
    return a is b or (a is not None and b is not None and all(x is y for x, y in zip(a, b)))


def _statics(block, blocks_only: bool = False) -> tuple | None:
    """(static arguments, rotary or None) of a block the run can take, else None. blocks_only: only
    blocks the batched step takes (cpu_step._Plan.blocks)."""
    got = prepared(block)
    if got is None or not got[1] or (blocks_only and not got[0].blocks):
        return None
    plan, _, aa = got
    a = block.attn
    fa = ffn_args(block.ffn)
    norm_w = _norm_weights(block, plan, aa)
    if block.__dict__.get("_cpu_norms", (None, None, None))[2] is not norm_w:
        return None  # half norms converted at each step: the block-by-block path tracks their versions
    H, Hkv, Dh = plan.heads
    st = (norm_w, plan.eps, plan.plus_one, plan.sandwich, aa[0], aa[1], aa[2], aa[3], plan.fused, aa[5],
          plan.has_bias, plan.qk_norm, H, Hkv, Dh, a.rotary is not None, plan.scale, aa[4], fa[0], fa[1], fa[2],
          plan.act, int(plan.window or 0), plan.layer_norm, plan.pre_norm, plan.gated, fa[3])
    return st, a.rotary


def _rot_key(rotary) -> str | None:
    return None if rotary is None else rotary._key


def make_runs(layers, blocks_only: bool = False) -> list[BlockRun]:
    """The runs of two or more consecutive blocks the one call can take (one numba type for all;
    blocks_only: see _statics)."""
    runs, cur = [], []

    def close():
        if len(cur) >= 2:
            rot_keys = []  # the rotaries' kinds (None: a block without rotary, OPT's)
            for _, rot, _ in cur:
                if _rot_key(rot) not in rot_keys:
                    rot_keys.append(_rot_key(rot))
            statics = _as_list([(*st, rot_keys.index(_rot_key(rot))) for st, rot, _ in cur])
            rotaries = [next(rot for _, rot, _ in cur if _rot_key(rot) == k) for k in rot_keys]
            need_f = max(2 * st[18][4].shape[0] for st, _, _ in cur)
            runs.append(BlockRun(cur[0][2], cur[-1][2] + 1, statics, rotaries, need_f, cur[0][0][12:15]))
        cur.clear()

    last_type = None
    for i, block in enumerate(layers):
        got = _statics(block, blocks_only) if "attn" in getattr(block, "_modules", {}) else None  # (a wrapper: not)
        if got is None:
            close()
            last_type = None
            continue
        t = typeof(got[0])
        if cur and (t != last_type or got[0][12:15] != cur[0][0][12:15]):
            close()
        cur.append((got[0], got[1], i))
        last_type = t
    close()
    return runs


_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (the blocks' keys, its runs)


def runs_of(model) -> list[BlockRun]:
    """The runs a model's last one-token CPU step took (empty before its first)."""
    return _RUNS.get(model, (None, []))[1]


def current_runs(model, store: weakref.WeakKeyDictionary = _RUNS, blocks_only: bool = False) -> list[BlockRun]:
    """The model's runs as its blocks are now: kept in store by model, made again where a block's
    arguments changed (checked at every step, every block: one may join or leave a run)."""
    layers = model.layers
    keys = [_key(b) for b in layers]
    kept, runs = store.get(model, (None, None))
    if runs is None or len(kept) != len(keys) or not all(map(_same, kept, keys)):
        runs = make_runs(layers, blocks_only)
        store[model] = ([_key(b) for b in layers], runs)  # (making runs may have made the blocks' arguments)
    return runs


def run_step(model, x: torch.Tensor, positions: torch.Tensor, cache, start: int | None) -> torch.Tensor:
    """The blocks of a one-token CPU step, runs of them in one call each (the others block by block).
    x: [1, 1, D] -> [1, 1, D]."""
    layers = model.layers
    by_start = {r.i0: r for r in current_runs(model)}
    i, n = 0, len(layers)
    while i < n:
        run = by_start.get(i)
        if run is None:
            x = layers[i](x, positions, cache.layers[i], start)
            i += 1
            continue
        x = _run(run, layers, x, positions, cache, start)
        i = run.i1
    return x


def _run(run: BlockRun, layers, x: torch.Tensor, positions: torch.Tensor, cache, start: int | None) -> torch.Tensor:
    if run.kv is None or run.kv[0] is not cache.layers:
        kv = [kv_arrays(cache.layers[i]) for i in range(run.i0, run.i1)]
        run.kv = (cache.layers, _as_list([k for k, _ in kv]), _as_list([v for _, v in kv]))
    pos = int(positions[0]) if start is None else start
    H, Hkv, Dh = run.heads
    zero = np.zeros(Dh, np.float32)  # the row of a kind without rotary (read by no block)
    tables = [(zero, zero) if rot is None else _rotary_tables(rot, positions, start, pos) for rot in run.rotaries]
    cos_t, sin_t = np.stack([c for c, _ in tables]), np.stack([s for _, s in tables])
    xv = np.ascontiguousarray(x.detach().reshape(-1).float().numpy())
    d = xv.shape[0]
    owner = layers[run.i0]
    abuf = cpu_step._scratch(owner, "_cpu_attn_buf", attn_scratch(d, H, Hkv, Dh, pos))
    fbuf = cpu_step._scratch(owner, "_cpu_ffn_buf", run.need_f + d)
    y = _run_blocks(xv, run.statics, run.kv[1], run.kv[2], cos_t, sin_t, pos, abuf, fbuf)
    out = torch.from_numpy(y.reshape(1, 1, d))
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def applies(x: torch.Tensor, cache) -> bool:
    """Whether a step of x ([B, T, D]) with `cache` may take runs: one token on the CPU, a float32 or
    float16 cache, no autograd."""
    return (x.shape[0] == 1 and x.shape[1] == 1 and x.device.type == "cpu" and x.dtype in _FLOATS
            and cache is not None and len(cache.layers) > 0 and cache.layers[0][0].dtype in (torch.float32, torch.float16)
            and not torch.is_grad_enabled())
