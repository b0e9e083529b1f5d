"""What the planner reads about a model: per-layer access frequencies from `hotcold profile`'s
`profile.safetensors` (+ predictor stats from `profile.json`), or assumed uniform ones (`--uniform`).

profile.safetensors (metadata {"fingerprint", "format": "1"}), per layer l:
  dense/gated layers  layers.{l}.neuron_freq  float32 [intermediate_size]
  MoE layers          layers.{l}.expert_freq  float32 [num_experts]  (sums to top_k)
profile.json: {"fingerprint", "predictors": {"layers": [{"layer", "params", "predicted_active_fraction", ...}]}}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hotcold.artifacts import ArtifactError, check_fingerprint, find_artifact_dir
from hotcold.planner.costs import LayerStats

PROFILE_FORMAT = "1"


def find_profile(model_path: Path, fingerprint: str, given: Path | None = None) -> Path | None:
    """profile.safetensors: the one given (a file or a folder), else the model's artifact folder's."""
    if given is not None:
        given = Path(given).expanduser()
        return given / "profile.safetensors" if given.is_dir() else given
    folder = find_artifact_dir(model_path, fingerprint)
    if folder is not None and (folder / "profile.safetensors").is_file():
        return folder / "profile.safetensors"
    return None


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
    """Per-layer stats from a profile; refuses one made for another model. Returns (stats, profile.json)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no profile here; run `hotcold profile MODEL` first")
    try:
        with safe_open(str(path), "np") as f:
            header = f.metadata() or {}
            check_fingerprint(header.get("fingerprint"), fingerprint, path)
            if header.get("format") != PROFILE_FORMAT:
                raise ArtifactError(f"{path}: profile format {header.get('format')} is not {PROFILE_FORMAT}; "
                                    "re-run `hotcold profile`")
            names = set(f.keys())
            stats = []
            for l in range(cfg.num_layers):
                kind = cfg.ffn_kind(l)
                name, n = ((f"layers.{l}.expert_freq", cfg.num_experts) if kind == "moe"
                           else (f"layers.{l}.neuron_freq", cfg.intermediate_size))
                if name not in names:
                    raise ArtifactError(f"{path}: tensor {name} is missing; re-run `hotcold profile`")
                freq = np.asarray(f.get_tensor(name), dtype=np.float64).reshape(-1)
                if freq.shape[0] != n:
                    raise ArtifactError(f"{path}: {name} has {freq.shape[0]} entries, the model has {n}; "
                                        "re-run `hotcold profile`")
                stats.append(LayerStats(kind, np.nan_to_num(freq, nan=1.0)))
    except ArtifactError:
        raise
    except Exception as e:  # safetensors raises its own types for truncated files
        raise ArtifactError(f"{path}: unreadable profile ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "re-run `hotcold profile`") from None
    meta: dict = {}
    meta_path = path.with_suffix(".json")
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{meta_path}: unreadable ({e}); re-run `hotcold profile`") from None
        check_fingerprint(meta.get("fingerprint"), fingerprint, meta_path)
        for entry in (meta.get("predictors") or {}).get("layers", []) or []:
            l = int(entry.get("layer", -1))
            if 0 <= l < len(stats) and stats[l].kind != "moe":
                if entry.get("params") is not None:
                    stats[l].predictor_params = int(entry["params"])
                if entry.get("predicted_active_fraction") is not None:
                    stats[l].predicted_active_fraction = float(entry["predicted_active_fraction"])
    return stats, meta
