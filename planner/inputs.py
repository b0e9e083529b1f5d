"""What the planner reads about a model: per-layer access frequencies from `hotcold profile`'s
`profile.safetensors` (+ predictor stats from `profile.json`), or assumed uniform ones (`--uniform`).

profile.safetensors (metadata {"fingerprint", "format": "1"}), per layer l:
  dense/gated layers  layers.{l}.neuron_freq  float32 [intermediate_size]
  MoE layers          layers.{l}.expert_freq  float32 [num_experts]  (sums to top_k)
profile.json: {"fingerprint", "predictors": {"layers": [{"layer", "params", "predicted_active_fraction", ...}]}}
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from hotcold.artifacts import ArtifactError
from hotcold.planner.costs import LayerStats
from hotcold.planner.weight_format import WeightFormat, gpu_int4_format, quantize_format, quantized_format
from hotcold.profiler.artifact import load_profile


def uniform_stats(cfg, sparsity: float) -> list[LayerStats]:
    """Every neuron fires with probability 1 - sparsity; every expert is routed top_k / E of the time."""
    out = []
    for l in range(cfg.num_layers):
        kind = cfg.ffn_kind(l)
        if kind == "moe":
            out.append(LayerStats(kind, np.full(cfg.num_experts, cfg.top_k / cfg.num_experts)))
        else:
            out.append(LayerStats(kind, np.full(cfg.intermediate_size, 1.0 - sparsity)))
    return out


def read_profile(path: Path, cfg, fingerprint: str) -> tuple[list[LayerStats], dict]:
    """Per-layer stats from a profile (read by the profiler's own reader, which refuses one made
    for another model). Returns (stats, profile.json)."""
    prof = load_profile(Path(path), fingerprint)
    stats = []
    for l in range(cfg.num_layers):
        kind = cfg.ffn_kind(l)
        table, name, n = ((prof.expert_freq, "expert_freq", cfg.num_experts) if kind == "moe"
                          else (prof.neuron_freq, "neuron_freq", cfg.intermediate_size))
        if l not in table:
            raise ArtifactError(f"{path}: tensor layers.{l}.{name} is missing; re-run `hotcold profile`")
        freq = table[l].double().numpy().reshape(-1)
        if freq.shape[0] != n:
            raise ArtifactError(f"{path}: layers.{l}.{name} has {freq.shape[0]} entries, the model has {n}; "
                                "re-run `hotcold profile`")
        stats.append(LayerStats(kind, np.nan_to_num(freq, nan=1.0)))
    allowed = predictors_within_budget(prof.meta)
    for st in stats:
        st.predictor_allowed = allowed
    for entry in (prof.meta.get("predictors") or {}).get("layers", []) or []:
        l = int(entry.get("layer", -1))
        if 0 <= l < len(stats) and stats[l].kind != "moe":
            if entry.get("params") is not None:
                stats[l].predictor_params = int(entry["params"])
            if entry.get("predicted_active_fraction") is not None:
                stats[l].predicted_active_fraction = float(entry["predicted_active_fraction"])
    return stats, prof.meta


def predictors_within_budget(meta: dict) -> bool:
    """Whether a profile's predictors keep held-out perplexity within the profile's budget (a gated
    model's profile measures the predictor-sparse perplexity; a ReLU model's predictors only skip
    neurons that would be zero or nearly so, and the profile does not measure them)."""
    rise = (meta.get("predictors") or {}).get("heldout_ppl_rise")
    budget = meta.get("ppl_budget")
    return rise is None or budget is None or rise <= budget


def _is_ffn_matrix(name: str) -> bool:
    """An FFN row matrix of the hybrid split: a dense/gated FFN's up/gate/down or a MoE layer's
    experts (not the router, the shared expert or its gate, which stay with the fast tier)."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[2] == "ffn" and parts[3] in ("up", "gate", "down", "experts")


def _is_hot_row_matrix(name: str) -> bool:
    """A dense/gated FFN's up or gate matrix: the rows the hot neurons keep int4 under --gpu-int4."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[2] == "ffn" and parts[3] in ("up", "gate")


@functools.lru_cache(maxsize=4)
def _tensor_storage(path: str, mtime_ns: int, size: int) -> tuple:
    """GGUFFile(path).tensor_storage(), once per file version (`plan` weighs a model both ways)."""
    from hotcold.models.gguf_loader import open_gguf

    return tuple(open_gguf(path).tensor_storage())


def gguf_format(path: Path, base: WeightFormat, gpu_int4: bool = False) -> WeightFormat:
    """The weight format a GGUF runs with: `base` when its FFN matrices are float (expanded at load),
    else quantised (models/quantized.py): host bytes per weight from the file's own tensor sizes
    (a dense FFN's W_down host copy is Q8_0, as executors/weights.py builds it, MoE experts keep the
    file's W_down; the token embedding, a row
    lookup, apart from the attention and LM head that are read whole), the CPU kernel kind of its
    largest share of gate/up bytes; gpu_int4: the shares of its attention matrices, and of its
    dense/gated FFNs' up/gate matrices (the hot rows), that the GPU keeps int4 (Q4_0 / Q4_1 / Q4_K),
    the layers whose whole FFN it keeps int4 when every neuron is hot (all three matrices 4-bit),
    whether the LM head is 4-bit, and the MoE layers whose experts' gate/up and down are 4-bit."""
    from hotcold.sparse_ops.gpu_quant import INT4_QTYPES
    from hotcold.sparse_ops.quant import QTYPES

    _, bs8, ts8 = QTYPES["Q8_0"]
    ffn_b = ffn_n = other_b = other_n = embed_b = embed_n = attn_n = int4_n = rows_n = rows4_n = 0.0
    kinds: dict[str, float] = {}
    ffn4: dict[int, bool] = {}  # dense/gated layer -> all its FFN matrices of a 4-bit type (kept int4 whole)
    head4 = False  # an (untied) LM head of a 4-bit type
    exps4: dict[str, dict[int, bool]] = {"gate_up": {}, "down": {}}  # MoE layer -> its experts 4-bit
    st = Path(path).stat()
    for name, qtype, n, nbytes, kept in _tensor_storage(str(Path(path).resolve()), st.st_mtime_ns, st.st_size):
        host = nbytes if kept else n * base.bytes_per_weight
        head4 = head4 or (name == "lm_head.weight" and bool(kept) and qtype in INT4_QTYPES)
        if name == "embed.weight":
            embed_b, embed_n = embed_b + host, embed_n + n
        elif _is_ffn_matrix(name):
            if kept and ".down" in name and ".experts." not in name:
                host = n * ts8 / bs8  # a dense FFN's W_down: transposed and requantised as Q8_0 (experts keep theirs)
            elif kept:
                kinds[qtype] = kinds.get(qtype, 0.0) + nbytes
            ffn_b, ffn_n = ffn_b + host, ffn_n + n
            if name.endswith(".weight") and name.split(".")[3] in ("up", "gate", "down"):
                l = int(name.split(".")[1])
                ffn4[l] = ffn4.get(l, True) and bool(kept) and qtype in INT4_QTYPES
            if ".experts." in name:
                which = exps4["down" if name.endswith(".down") else "gate_up"]
                l = int(name.split(".")[1])
                which[l] = which.get(l, True) and bool(kept) and qtype in INT4_QTYPES
            if _is_hot_row_matrix(name):
                rows_n += n
                rows4_n += n if kept and qtype in INT4_QTYPES else 0
        elif name.endswith(".weight") and "norm" not in name or name.endswith("experts"):
            other_b, other_n = other_b + host, other_n + n
            if ".attn." in name:
                attn_n += n
                int4_n += n if kept and qtype in INT4_QTYPES else 0
    if not kinds:
        return base
    kind = max(kinds, key=kinds.get).lower()
    fmt = quantized_format(base, kind, other_b / max(other_n, 1.0), ffn_b / max(ffn_n, 1.0),
                           embed_b / embed_n if embed_n else None)
    if not gpu_int4:
        return fmt
    whole, experts, experts_down = (frozenset(l for l, ok in d.items() if ok)
                                    for d in (ffn4, exps4["gate_up"], exps4["down"]))
    return gpu_int4_format(fmt, int4_n / max(attn_n, 1.0), rows4_n / max(rows_n, 1.0), whole, head4,
                           experts, experts_down)


def model_format(path: Path, base: WeightFormat, quantize: str | None = None, gpu_int4: bool = False,
                 moe: bool = False) -> WeightFormat:
    """The weight format `hotcold run` will use for the model at path: a GGUF's own quantisation
    (see gguf_format), `--quantize` for an HF folder, else base; gpu_int4: `--gpu-int4`; moe: the
    model's FFNs are routed experts (quantize_format)."""
    if quantize:
        return quantize_format(base, quantize, gpu_int4, moe=moe)
    if Path(path).is_file():
        return gguf_format(Path(path), base, gpu_int4)
    return base
