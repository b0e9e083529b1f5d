"""Train every predictor of a model from its profile: neuron predictors per dense/gated layer and
the expert look-ahead per MoE layer, with the metrics that go into profile.json."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hotcold.models.loader import LoadedModel
from hotcold.predictors.artifact import PredictorSet
from hotcold.predictors.lookahead import fit_lookahead
from hotcold.predictors.neurons import choose_ranks, cpu_time_per_token, train_layer
from hotcold.profiler.artifact import Profile
from hotcold.profiler.layer_pool import in_parallel


def ffn_params(config, layer: int) -> int:
    """Weights of layer's FFN (biases ignored)."""
    c = config
    kind = c.ffn_kind(layer)
    if kind == "moe":
        return 3 * c.hidden_size * (c.num_experts * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    return (2 if kind == "dense" else 3) * c.hidden_size * c.intermediate_size


def sample_magnitude(ffn, x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """|h|, the down projection's input, of a dense/gated FFN on samples x [S, D] -> float16 [S, I].
    A quantised FFN (QuantLinear: blocks, no float weight parameters) takes float32 inputs."""
    p = next(ffn.parameters(), None)
    dtype = p.dtype if p is not None else torch.float32
    with torch.no_grad():
        return torch.cat([ffn.activations(c.to(dtype)).abs().to(torch.float16) for c in x.split(chunk)])


def train_predictors(lm: LoadedModel, profile: Profile, recall: float = 0.95, budget: float = 0.04,
                     epochs: int = 20, device: str | torch.device = "cpu",
                     progress: Callable[[str, int, int], None] | None = None, weighted_loss: bool | None = None,
                     weighted_recall: bool = False, per_neuron: bool = False) -> tuple[PredictorSet, dict]:
    """Predictors for every layer with samples in the profile. `budget`: total neuron-predictor
    parameters as a fraction of the dense/gated FFNs' parameters. weighted_loss (None: on the layers
    whose activity is a magnitude threshold, i.e. non-ReLU gated FFNs), weighted_recall, per_neuron: see
    train_layer (|h| is recomputed from the sampled FFN inputs with the model's own weights, so the
    profile need not store it). Returns (predictors, metrics)."""
    options = dict(weighted_loss=weighted_loss, weighted_recall=weighted_recall, per_neuron=per_neuron)
    progress = progress or (lambda *a: None)
    c = lm.config
    dense_layers = [l for l in range(c.num_layers) if c.ffn_kind(l) != "moe" and l in profile.neuron_freq]
    rows = {r["layer"]: r for r in profile.meta["layers"]}
    dense_ffn_params = sum(ffn_params(c, l) for l in dense_layers)
    budget_params = int(budget * dense_ffn_params)
    ranks = choose_ranks(c.hidden_size, [c.intermediate_size] * len(dense_layers),
                         [1 - rows[l]["sparsity"] for l in dense_layers],
                         [rows[l]["mass80"] or 1.0 for l in dense_layers], budget_params)
    preds = PredictorSet(lm.fingerprint)
    jobs = []
    for l, r in zip(dense_layers, ranks):
        samples = profile.samples(l)
        if samples is not None and len(samples[0]) >= 10:
            jobs.append((l, r, samples))
    layer_metrics = [None] * len(jobs)
    progress("predictors", 0, len(jobs), "layer")

    def prepare(job):
        l, r, (x, active) = job
        x, active = x.to(device), active.to(device)
        wl = profile.threshold.get(l, 0.0) > 0 if weighted_loss is None else weighted_loss
        # |h| costs a full FFN pass over the samples (a minute per 13B-shaped layer on 2 CPU cores):
        # only where training needs it, or on a GPU (then the |h| recall is reported for every layer)
        need = wl or weighted_recall or torch.device(device).type == "cuda"
        mag = sample_magnitude(lm.model.layers[l].ffn, x.to(lm.device)).to(device) if need else None  # [S, I]
        return l, r, x, active, mag, wl

    def train(i, l, r, x, active, mag, wl):
        p, m = train_layer(x, active, r, layer=l, recall=recall, epochs=epochs, magnitude=mag, weighted_loss=wl,
                           weighted_recall=weighted_recall, per_neuron=per_neuron)
        preds.neurons[l] = p.cpu()
        layer_metrics[i] = dict(m.__dict__, weighted_loss=wl)

    # layers side by side on single-threaded workers (profiler/layer_pool.py); |h| in this thread
    in_parallel(jobs, prepare, train, lambda n: progress("predictors", n, len(jobs), "layer"), device)
    preds.neurons = dict(sorted(preds.neurons.items()))

    lookahead = []
    moe_layers = [l for l in range(c.num_layers - 1) if c.ffn_kind(l + 1) == "moe"]
    if moe_layers:
        progress("look-ahead", 0, len(moe_layers), "layer")
    for i, l in enumerate(moe_layers):
        samples = profile.lookahead_samples(l)
        if samples is None:
            continue
        nxt = lm.model.layers[l + 1]
        w, m = fit_lookahead(samples[0].to(lm.device), samples[1].to(lm.device), nxt.ffn_norm, nxt.ffn.router,
                             layer=l)
        if w is not None:
            preds.lookahead[l] = w.cpu()
        lookahead.append(m.__dict__)
        progress("look-ahead", i + 1, len(moe_layers), "layer")

    total = sum(p.n_params() for p in preds.neurons.values())
    metrics = {
        "recall_target": recall,
        "options": options,
        "budget_fraction": budget,
        "total_params": total,
        "ffn_params_fraction": round(total / max(1, dense_ffn_params), 4),
        "cpu_ms_per_token": round(1000 * cpu_time_per_token(preds.neurons, c.hidden_size), 3) if preds.neurons else 0,
        "layers": layer_metrics,
        "lookahead": lookahead,
    }
    if layer_metrics:
        for key in ("recall", "weighted_recall", "precision", "predicted_active_fraction", "true_active_fraction"):
            metrics[f"mean_{key}"] = round(sum(m[key] for m in layer_metrics) / len(layer_metrics), 4)
    if lookahead:
        metrics["mean_lookahead_recall"] = round(sum(m["recall"] for m in lookahead) / len(lookahead), 4)
    return preds, metrics
