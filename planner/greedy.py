"""The baseline the ILP must beat: fill the GPU with the globally hottest units first.

Every unit has an access frequency: attention (with its KV cache) and the lm_head are used by every
token (1.0), a neuron block by the mean activation frequency of its neurons, an expert by its
routing frequency. Units are placed in decreasing frequency (ties: attention, lm_head, then block
k of every layer before block k+1 of any) while they fit in the GPU budget; within a layer a block is taken only after the
hotter blocks of that layer (prefix). Placing a layer's attention also reserves its predictor; the
predictor is released when the layer's FFN becomes entirely GPU-resident.
"""

from __future__ import annotations

import numpy as np

from hotcold.planner.costs import ModelCosts
from hotcold.planner.evaluate import Placement


def greedy(costs: ModelCosts, vram: float) -> Placement:
    from hotcold.planner.ilp import MARGIN

    free = vram - MARGIN - costs.gpu_fixed_bytes  # the ILP's margin: greedy's placement is a valid start
    n = len(costs.layers)
    p = Placement("hybrid", [False] * n, [np.zeros(lc.n_units, bool) for lc in costs.layers], False)
    if free < 0:
        return p
    items = []  # (-freq, priority, unit, layer): equally hot blocks are spread over the layers
    for l, lc in enumerate(costs.layers):
        items.append((-1.0, 0, -1, l))
        for k in range(lc.n_units):
            items.append((-float(lc.unit_freq[k]), 2, k, l))
    items.append((-1.0, 1, -1, -1))
    items.sort()
    blocked = set()
    for _, prio, k, l in items:
        if prio == 1:
            if costs.head_bytes <= free:
                p.head_gpu = True
                free -= costs.head_bytes
            continue
        lc = costs.layers[l]
        if prio == 0:
            need = lc.attn_bytes + lc.kv_bytes + (lc.pred_bytes if lc.kind != "moe" else 0.0)
            if need <= free:
                p.attn_gpu[l] = True
                free -= need
            continue
        if lc.kind != "moe" and l in blocked:
            continue
        need = float(lc.unit_bytes[k])
        completes = lc.kind != "moe" and k == lc.n_units - 1
        if completes and p.attn_gpu[l]:
            need -= lc.pred_bytes  # the layer no longer needs its predictor
        if completes and lc.whole_bytes is not None:
            need += lc.whole_bytes - float(lc.unit_bytes.sum())  # now kept int4 whole (fewer bytes)
        if need <= free:
            p.on_gpu[l][k] = True
            free -= need
        elif lc.kind != "moe":
            blocked.add(l)
    return p
