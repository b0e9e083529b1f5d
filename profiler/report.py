"""Summary statistics of a profile, its terminal table and its figure."""

from __future__ import annotations

from pathlib import Path

import torch


def mass_fraction(freq: torch.Tensor, mass: float = 0.8) -> float | None:
    """Smallest fraction of units (neurons or experts), hottest first, that carry `mass` of all
    activations; None when nothing fired."""
    f = freq.double().flatten().sort(descending=True).values
    total = float(f.sum())
    if total <= 0:
        return None
    k = int(torch.searchsorted(f.cumsum(0) / total, torch.tensor(mass, dtype=torch.float64))) + 1
    return min(k, len(f)) / len(f)


def layer_summary(layer: int, kind: str, threshold: float, neuron_freq: torch.Tensor | None,
                  expert_freq: torch.Tensor | None, expert_neuron_freq: torch.Tensor | None) -> dict:
    """One row of profile.json's `layers`: mean sparsity and the 80%-mass fractions."""
    row: dict = {"layer": layer, "kind": kind, "threshold": threshold}
    if kind == "moe":
        share = expert_freq / expert_freq.sum().clamp_min(1e-12)  # routing share per expert
        active = (expert_neuron_freq.mean(1) * share).sum()  # per routed token, weighted by use
        row.update(sparsity=round(1 - float(active), 4), mass80=_r(mass_fraction(expert_neuron_freq * expert_freq[:, None])),
                   experts_mass80=_r(mass_fraction(expert_freq)),
                   top_expert_share=round(float(share.max()), 4))
    else:
        row.update(sparsity=round(1 - float(neuron_freq.mean()), 4), mass80=_r(mass_fraction(neuron_freq)))
    return row


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def print_table(meta: dict, console=None) -> None:
    """The per-layer summary and the perplexity curve, as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    moe = any(r["kind"] == "moe" for r in meta["layers"])
    neurons = not all(r["kind"] == "moe" for r in meta["layers"])  # MoE experts run whole: no neuron columns
    t = Table(title=f"profile of {meta['model']} ({meta['tokens']} tokens, seq {meta['seq_len']})")
    for col in ("layer", "kind", *(("threshold", "sparsity", "neurons 80%") if neurons else ())):
        t.add_column(col, justify="right")
    if moe:
        t.add_column("experts 80%", justify="right")
        t.add_column("top expert", justify="right")
    for r in meta["layers"]:
        cells = [str(r["layer"]), r["kind"]]
        if neurons:
            cells += [f"{r['threshold']:.4g}", f"{r['sparsity']:.1%}", _pct(r["mass80"])]
        if moe:
            cells += [_pct(r.get("experts_mass80")), _pct(r.get("top_expert_share"))]
        t.add_row(*cells)
    console.print(t)
    if meta.get("curve"):
        budget = f" (budget {meta['ppl_budget']:.1%})" if meta.get("ppl_budget") else ""
        c = Table(title=f"perplexity on {meta['heldout_tokens']} held-out tokens{budget}")
        c.add_column("sparsity", justify="right")
        c.add_column("ppl", justify="right")
        c.add_column("vs dense", justify="right")
        base = meta["curve"][0]["ppl"]
        for p in meta["curve"]:
            mark = " ←" if abs(p["sparsity"] - meta["sparsity_target"]) < 1e-9 else ""
            c.add_row(f"{p['sparsity']:.1%}", f"{p['ppl']:.4f}", f"{p['ppl'] / base - 1:+.2%}{mark}")
        console.print(c)
    if meta.get("input_sparsity"):
        _input_table(meta["input_sparsity"], console)
    if meta.get("predictors", {}).get("layers"):
        _predictor_table(meta["predictors"], console)
    if meta.get("predictors", {}).get("lookahead"):
        _lookahead_table(meta["predictors"], console)
    s = meta["summary"]
    shares = ([f"mean sparsity {s['sparsity']:.1%}", f"neurons carrying 80% of activations {_pct(s['mass80'])}"]
              if neurons else []) + ([f"experts carrying 80% of routings {_pct(s['experts_mass80'])}"] if moe else [])
    console.print(", ".join(shares) + f"; {meta['throughput_tok_s']:.0f} tok/s")


def _input_table(im: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"input sparsity of every projection (TEAL; budget {im['ppl_budget']:.1%}): "
                    "share of weights skipped against held-out perplexity")
    for col in ("sparsity", "ppl", "vs dense"):
        t.add_column(col, justify="right")
    for p in im["curve"]:
        mark = " ←" if abs(p["sparsity"] - im["chosen"]) < 1e-9 else ""
        t.add_row(f"{p['sparsity']:.0%}", f"{p['ppl']:.4f}", f"{p['rise']:+.2%}{mark}")
    console.print(t)
    if im["chosen"] <= 0:
        console.print("input sparsity: no level within the budget; runs stay dense")


def _predictor_table(pm: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"neuron predictors (target recall {pm['recall_target']:.0%}, "
                    f"{pm['ffn_params_fraction']:.1%} of FFN parameters, {pm['cpu_ms_per_token']:.2f} ms/token on CPU)")
    for col in ("layer", "rank", "recall", "precision", "predicted active", "true active"):
        t.add_column(col, justify="right")
    for m in pm["layers"]:
        t.add_row(str(m["layer"]), str(m["rank"]), f"{m['recall']:.3f}", f"{m['precision']:.3f}",
                  f"{m['predicted_active_fraction']:.1%}", f"{m['true_active_fraction']:.1%}")
    t.add_row("mean", "", f"{pm['mean_recall']:.3f}", f"{pm['mean_precision']:.3f}",
              f"{pm['mean_predicted_active_fraction']:.1%}", f"{pm['mean_true_active_fraction']:.1%}")
    console.print(t)


def _lookahead_table(pm: dict, console) -> None:
    from rich.table import Table

    t = Table(title="MoE look-ahead: experts of layer l+1 guessed at layer l (held-out top-k recall)")
    for col in ("layer", "router guess", "kept", "recall", "recall @2k"):
        t.add_column(col, justify="right")
    for m in pm["lookahead"]:
        t.add_row(str(m["layer"]), f"{m['router_recall']:.3f}", m["mode"], f"{m['recall']:.3f}", f"{m['recall_at_2k']:.3f}")
    console.print(t)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def plot(freqs: dict[int, torch.Tensor], meta: dict, path: Path, what: str = "neuron") -> None:
    """profile.png: sorted firing frequency per layer (log-log) and the 80%-mass fraction per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    cmap = plt.get_cmap("viridis")
    n = max(1, len(freqs) - 1)
    for i, (layer, f) in enumerate(sorted(freqs.items())):
        y = f.double().flatten().sort(descending=True).values.clamp_min(1e-6).numpy()
        a.loglog(range(1, len(y) + 1), y, color=cmap(i / n), lw=0.8, label=f"layer {layer}" if i in (0, n) else None)
    a.set_xlabel(f"{what} rank (hottest first)")
    a.set_ylabel("firing frequency")
    a.set_title(f"sorted {what} frequency per layer")
    a.legend(fontsize=8)
    rows = meta["layers"]
    b.bar([r["layer"] for r in rows], [r["mass80"] or 0 for r in rows], color="tab:blue", label="neurons")
    if any(r.get("experts_mass80") is not None for r in rows):
        b.plot([r["layer"] for r in rows], [r.get("experts_mass80") or 0 for r in rows], "o-", color="tab:red",
               label="experts")
    b.set_xlabel("layer")
    b.set_ylabel("fraction carrying 80% of activations")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    fig.suptitle(f"{meta['model']}: mean sparsity {meta['summary']['sparsity']:.1%}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
