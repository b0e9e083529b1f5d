"""Input sparsity for gated models (TEAL, Liu et al. 2024): thresholds on the input of every projection.

Each block's projections read four inputs, one threshold each ("groups"):

  qkv      the attention norm's output, read by q, k and v
  o        the attention's output, read by o
  gate_up  the FFN norm's output, read by gate and up
  down     act(gate x) * up x, read by down

An input entry with |x| <= threshold is zeroed, and the runtime skips the weights it would multiply
(sparse_ops/input_sparse.py). The profile chooses the thresholds in three steps:

1. magnitudes: a bounded random sample of |x| per layer and group on a dense forward over calibration
   text; the threshold for sparsity s is the s-quantile of that sample;
2. allocation, per block (TEAL's block-wise greedy): starting from no sparsity, raise one group's
   sparsity by `step` at a time, the group whose raise adds least to the block's output error
   (squared error against the dense block, on the calibration tokens' dense block inputs), until the
   block's sparsity (its groups' weighted by the parameters they read) passes each level of
   `LEVELS`; the allocation at each level is kept. Every block gets the same level, so the level is
   the model's sparsity in parameters read;
3. the level: held-out perplexity measured by running the thresholded model at each level until the
   budget breaks; the highest level within it is chosen (0 when none is). Steps 2 and 3 alternate:
   the allocation is advanced to a level only when the search reaches it.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import torch

GROUPS = ("qkv", "o", "gate_up", "down")
LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)  # model-level sparsities the allocation and the curve cover
STEP = 0.1  # the greedy allocation's raise of one group's sparsity (0.05 doubles the search: ~200 block
# forwards a layer, 45 s a SmolLM2 layer on the busy 2-core machine)
MAX_GROUP = 0.95  # no group is made sparser than this
QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # of |x|, reported per layer and group


def group_modules(block) -> dict[str, list[torch.nn.Module]]:
    """The projections reading each group's input in one block (a gated FFN and q/k/v/o attention)."""
    a, f = block.attn, block.ffn
    return {"qkv": [a.q, a.k, a.v], "o": [a.o], "gate_up": [f.gate, f.up], "down": [f.down]}


def _shape(lin) -> tuple[int, int]:
    if hasattr(lin, "out_features"):
        return lin.out_features, lin.in_features
    return tuple(lin.weight.shape)


def group_params(block) -> dict[str, int]:
    """Weights each group's input multiplies (what its sparsity can skip)."""
    return {g: sum(math.prod(_shape(lin)) for lin in mods) for g, mods in group_modules(block).items()}


def applies(model) -> bool:
    """Whether every block is gated-FFN attention of the form the groups name (no MoE, no ungated FFN)."""
    return all(getattr(b.ffn, "kind", None) == "gated" and hasattr(b.attn, "q") for b in model.layers)


def _zero_below(t: float):
    def hook(mod, args):  # hardshrink: x where |x| > t, else 0, in one op (a profile calls it ~20,000 times)
        return (torch.nn.functional.hardshrink(args[0], t),) + tuple(args[1:])
    return hook


@contextlib.contextmanager
def thresholded(model, thresholds: dict[int, dict[str, float]], blocks=None) -> Iterator[None]:
    """Within the block, the given layers' projections see their input zeroed where |x| <= threshold
    (forward pre-hooks, so every forward path of the module runs thresholded). blocks: the layers'
    blocks when not model.layers (a float copy of one block)."""
    handles = []
    try:
        for l, per in thresholds.items():
            mods = group_modules((blocks or model.layers)[l])
            for g, t in per.items():
                if t > 0:
                    handles += [m.register_forward_pre_hook(_zero_below(float(t))) for m in mods[g]]
        yield
    finally:
        for h in handles:
            h.remove()


class Magnitudes:
    """A bounded uniform subsample of |x| per layer and group, read as quantiles."""

    def __init__(self, model, per_group: int = 1 << 18, seed: int = 0):
        self.model, self.per_group = model, per_group
        self.values: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._sorted: dict[tuple[int, str], torch.Tensor] = {}
        self._gen = torch.Generator().manual_seed(seed)

    def _add(self, key, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1).abs().float()
        k = min(flat.numel(), self.per_group)
        idx = torch.randint(flat.numel(), (k,), generator=self._gen).to(flat.device)
        self.values.setdefault(key, []).append(flat[idx].cpu())
        self._sorted.pop(key, None)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        handles = []
        try:
            for l, block in enumerate(self.model.layers):
                for g, mods in group_modules(block).items():
                    handles.append(mods[0].register_forward_pre_hook(
                        lambda mod, args, key=(l, g): self._add(key, args[0])))
            yield
        finally:
            for h in handles:
                h.remove()

    def sorted(self, l: int, g: str) -> torch.Tensor:
        key = (l, g)
        if key not in self._sorted:
            self._sorted[key] = torch.cat(self.values[key]).sort().values
        return self._sorted[key]

    def threshold(self, l: int, g: str, sparsity: float) -> float:
        """|x| below which a `sparsity` fraction of the sample falls (0 for sparsity 0)."""
        if sparsity <= 0:
            return 0.0
        v = self.sorted(l, g)
        return float(v[min(len(v) - 1, int(sparsity * len(v)))])

    def thresholds(self, allocation: list[dict[str, float]]) -> dict[int, dict[str, float]]:
        """Per layer and group, the thresholds of an allocation (per layer, each group's sparsity)."""
        return {l: {g: self.threshold(l, g, s) for g, s in per.items()} for l, per in enumerate(allocation)}


def greedy_allocation(error: Callable[[dict[str, float]], float], weights: dict[str, float],
                      levels=LEVELS, step: float = STEP, cap: float = MAX_GROUP,
                      start: dict[str, float] | None = None) -> dict[float, dict[str, float]]:
    """Block-wise greedy allocation: from all groups at 0 (or at `start`, an allocation this search
    returned for a lower level: it resumes there), raise by `step` the group whose raise gives the
    smallest `error(allocation)`, until the weighted sparsity sum(w_g s_g) / sum(w_g) reaches each
    level; returns {level: the allocation when it first reached it}. A level no allocation reaches
    (every group at `cap`) is left out."""
    total = sum(weights.values())
    alloc = dict(start) if start is not None else {g: 0.0 for g in weights}
    out: dict[float, dict[str, float]] = {}
    pending = sorted(levels)

    def weighted(a):
        return sum(weights[g] * a[g] for g in a) / total

    while pending:
        best, best_err = None, math.inf
        for g in weights:
            if alloc[g] + step > cap + 1e-9:
                continue
            trial = dict(alloc, **{g: round(alloc[g] + step, 6)})
            e = error(trial)
            if e < best_err:
                best, best_err = trial, e
        if best is None:
            break
        alloc = best
        while pending and weighted(alloc) >= pending[0] - 1e-9:
            out[pending.pop(0)] = dict(alloc)
    return out


@torch.inference_mode()
def block_inputs(model, seqs: torch.Tensor) -> list[torch.Tensor]:
    """Each block's dense input on tokens seqs [B, T]: a list of [B, T, D] (on the model's device)."""
    positions = torch.arange(seqs.shape[1], device=seqs.device)
    x = model.embed_tokens(seqs, positions)
    out = []
    for block in model.layers:
        out.append(x)
        x = block(x, positions, None)
    return out


class LayerAllocations:
    """The greedy allocation of every block on calibration tokens seqs [B, T], advanced level by level
    as the perplexity search asks for the next one: a level beyond the budget's is never allocated
    (each step of the greedy search costs a block forward per group). Blocks are allocated side by
    side on single-threaded workers (profiler/layer_pool.py), each on its own float copy."""

    def __init__(self, model, seqs: torch.Tensor, mags: Magnitudes, step: float = STEP):
        self.model, self.mags, self.step = model, mags, step
        self.positions = torch.arange(seqs.shape[1], device=seqs.device)
        self.xs = block_inputs(model, seqs)
        self.current: list[dict[str, float] | None] = [None] * len(self.xs)  # each block's latest allocation
        self.levels: dict[float, list[dict[str, float]]] = {}
        for l in range(len(self.xs)):  # sorted here, not in the workers
            for g in GROUPS:
                mags.sorted(l, g)

    def _workers(self) -> int:
        """As many as a third of the available RAM holds float copies of a block (a large model's)."""
        import psutil

        per = 4 * sum(group_params(self.model.layers[0]).values()) + 1
        return max(1, int(psutil.virtual_memory().available // 3 // per) - 1)

    @torch.inference_mode()
    def advance(self, level: float, progress: Callable | None = None) -> list[dict[str, float]] | None:
        """Every block's allocation at `level` (per layer {group: sparsity}), or None when some block
        cannot reach it (every group at MAX_GROUP). progress(stage, done, total, "layer") per block."""
        from hotcold.models.quantized import dequantize_model, is_quantized
        from hotcold.profiler.layer_pool import in_parallel

        if level in self.levels:
            return self.levels[level]
        L = len(self.xs)
        stage = f"allocation {level:.0%}"
        progress = progress or (lambda *a: None)
        progress(stage, 0, L, "layer")
        reached: list[dict[str, float] | None] = [None] * L
        mags, positions = self.mags, self.positions

        def prepare(l):
            block, x = self.model.layers[l], self.xs[l]
            if is_quantized(block):  # a float copy: a quantised block's several-token products decode its
                # blocks on every call, and the greedy search calls it ~100 times
                block = dequantize_model(copy.deepcopy(block), x.device, x.dtype)
            return l, block, x

        def work(i, l, block, x):
            dense = block(x, positions, None).float()
            scale = float(((dense - x.float()) ** 2).sum()) or 1.0  # the block's own contribution

            def error(alloc):
                with thresholded(self.model, {l: {g: mags.threshold(l, g, s) for g, s in alloc.items()}}, {l: block}):
                    y = block(x, positions, None).float()
                return float(((y - dense) ** 2).sum()) / scale

            got = greedy_allocation(error, group_params(block), (level,), self.step, start=self.current[l])
            reached[l] = got.get(level)

        in_parallel(list(range(L)), prepare, work, lambda n: progress(stage, n, L, "layer"), self.xs[0].device,
                    self._workers())
        if any(a is None for a in reached):
            return None
        self.current = reached
        self.levels[level] = reached
        return reached


def profile_input_sparsity(lm, calib: torch.Tensor, heldout: list[int], seq_len: int, budget: float,
                           progress: Callable | None = None, seed: int = 0, greedy_tokens: int = 128,
                           dense_ppl: float | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Magnitudes, allocation and perplexity curve of `lm` (see the module docstring). calib: [B, T]
    calibration sequences (the greedy allocation reads the first `greedy_tokens` of them, at least one
    sequence); heldout: ids for perplexity, whose dense perplexity is `dense_ppl` when the caller has
    measured it. The levels are walked upwards until the budget breaks (or a level cannot be
    allocated); the highest within it is chosen. Returns (profile tensors, profile.json's
    "input_sparsity" section, with the allocations of the levels walked)."""
    from hotcold.models.perplexity import perplexity
    from hotcold.profiler.calibrate import HELDOUT_BATCH, CurvePoint

    progress = progress or (lambda *a: None)
    model, dev = lm.model, lm.device
    bos = lm.tokenizer.bos_id if lm.tokenizer.add_bos else None
    mags = Magnitudes(model, seed=seed)
    progress("magnitudes", 0, calib.numel())
    with mags.recording(), torch.inference_mode():
        positions = torch.arange(calib.shape[1], device=dev)
        for i in range(len(calib)):
            x = model.embed_tokens(calib[i:i + 1].to(dev), positions)
            for block in model.layers:
                x = block(x, positions, None)
            progress("magnitudes", (i + 1) * calib.shape[1], calib.numel())
    greedy = calib[: max(1, greedy_tokens // calib.shape[1]), :greedy_tokens]  # whole sequences, or one's start
    allocations = LayerAllocations(model, greedy.to(dev), mags)
    most = len(LEVELS) + (dense_ppl is None)  # evaluations, if no level breaks the budget
    evals = [0]

    def ppl_at(thresholds) -> float:
        with thresholded(model, thresholds):
            p = perplexity(model, heldout, seq_len, bos, batch=HELDOUT_BATCH).ppl
        evals[0] += 1
        progress("input ppl", evals[0], most, "evaluation")
        return p

    if dense_ppl is None:
        progress("input ppl", 0, most, "evaluation")
        dense_ppl = ppl_at({})
    points, chosen = [CurvePoint(0.0, dense_ppl)], 0.0
    for s in LEVELS:
        alloc = allocations.advance(s, progress)
        if alloc is None:
            break
        if evals[0] == 0:
            progress("input ppl", 0, most, "evaluation")
        points.append(CurvePoint(s, ppl_at(mags.thresholds(alloc))))
        if points[-1].ppl > dense_ppl * (1 + budget):
            break
        chosen = s
    levels = sorted(allocations.levels)
    L = len(model.layers)
    chosen_t = mags.thresholds(allocations.levels[chosen]) if chosen > 0 else {l: {g: 0.0 for g in GROUPS}
                                                                                for l in range(L)}
    tensors = {f"layers.{l}.input_threshold": torch.tensor([chosen_t[l][g] for g in GROUPS], dtype=torch.float32)
               for l in range(L)}
    meta = {
        "groups": list(GROUPS),
        "chosen": chosen,
        "ppl_budget": budget,
        "dense_ppl": dense_ppl,
        "curve": [{"sparsity": p.sparsity, "ppl": p.ppl, "rise": p.ppl / dense_ppl - 1} for p in points],
        "calibration_tokens": int(calib.numel()),  # of the magnitudes
        "allocation_tokens": int(greedy.numel()),
        "step": STEP,
        "allocation": {str(s): [[round(a[g], 4) for g in GROUPS] for a in allocations.levels[s]] for s in levels},
        "thresholds": {str(s): [[round(t[g], 6) for g in GROUPS] for t in mags.thresholds(allocations.levels[s]).values()]
                       for s in levels},
        "quantiles": {"q": list(QUANTILES),  # of |x|: [layer][group][q]
                      "layers": [[[round(mags.threshold(l, g, q), 6) for q in QUANTILES] for g in GROUPS]
                                 for l in range(L)]},
    }
    return tensors, meta


def plot_curve(meta: dict, model_name: str, path) -> None:
    """input_sparsity.png: held-out perplexity against model-level input sparsity, and the chosen
    level's per-layer allocation by group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    pts = meta["curve"]
    a.plot([p["sparsity"] for p in pts], [100 * p["rise"] for p in pts], "o-")
    a.axhline(100 * meta["ppl_budget"], color="tab:red", ls="--", lw=0.8, label="budget")
    a.axvline(meta["chosen"], color="tab:green", ls=":", lw=0.8, label=f"chosen {meta['chosen']:.0%}")
    a.set_xlabel("model-level input sparsity (share of weights skipped)")
    a.set_ylabel("held-out perplexity rise (%)")
    a.legend(fontsize=8)
    key = str(meta["chosen"]) if meta["chosen"] > 0 else next(iter(meta["allocation"]), None)
    if key is not None:
        rows = meta["allocation"][key]
        for i, g in enumerate(meta["groups"]):
            b.plot(range(len(rows)), [r[i] for r in rows], "o-", ms=3, label=g)
        b.set_title(f"allocation at {float(key):.0%}")
    b.set_xlabel("layer")
    b.set_ylabel("group sparsity")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    fig.suptitle(f"{model_name}: input sparsity")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
