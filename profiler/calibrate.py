"""Choosing the sparsity of gated FFNs: the largest one whose perplexity stays within a budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
HELDOUT_BATCH = 8  # held-out windows per forward in the profile's perplexity evaluations (models/perplexity.py)


@dataclass
class CurvePoint:
    sparsity: float
    ppl: float


def search_sparsity(ppl_at: Callable[[float], float], budget: float, grid=GRID, refine: int = 2
                    ) -> tuple[float, list[CurvePoint]]:
    """Largest sparsity s with ppl_at(s) <= ppl_at(0) * (1 + budget), assuming perplexity grows
    with sparsity: walk the grid until the budget breaks, then bisect `refine` times between the
    last sparsity within budget and the first beyond it. Returns (s, every point measured)."""
    curve = [CurvePoint(0.0, ppl_at(0.0))]
    limit = curve[0].ppl * (1 + budget)
    good, bad = 0.0, None
    for s in grid:
        curve.append(CurvePoint(s, ppl_at(s)))
        if curve[-1].ppl > limit:
            bad = s
            break
        good = s
    if bad is not None:
        for _ in range(refine):
            mid = round((good + bad) / 2, 4)
            curve.append(CurvePoint(mid, ppl_at(mid)))
            if curve[-1].ppl > limit:
                bad = mid
            else:
                good = mid
    return good, sorted(curve, key=lambda p: p.sparsity)
