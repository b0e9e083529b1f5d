"""predictors.safetensors: every layer's neuron predictor and the MoE look-ahead corrections.

Tensors (metadata {"fingerprint", "format"}):
  layers.{l}.w1.weight [r, D], layers.{l}.w1.bias [r], layers.{l}.w2.weight [I, r], layers.{l}.w2.bias [I],
  layers.{l}.threshold [1]          dense/gated layer l: active = w2(relu(w1 x)) > threshold
  lookahead.{l}.weight [E, D]       MoE: corrected router predicting layer l+1's experts from layer l's
                                    residual (after layer l+1's norm); absent: use layer l+1's router
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from hotcold.artifacts import ArtifactError, atomic_path, find_artifact_dir, read_artifact
from hotcold.predictors.neurons import NeuronPredictor

FORMAT = "1"


@dataclass
class PredictorSet:
    fingerprint: str
    neurons: dict[int, NeuronPredictor] = field(default_factory=dict)
    lookahead: dict[int, torch.Tensor] = field(default_factory=dict)
    # the file read (models/layout_cache.py model_version: path, size, mtime, inode, fingerprint), for
    # caches of what is built from these predictors (executors/split_cache.py); None: built in memory
    source: str | None = None

    def to(self, device) -> "PredictorSet":
        for p in self.neurons.values():
            p.to(device)
        self.lookahead = {l: w.to(device) for l, w in self.lookahead.items()}
        return self


def save_predictors(path: Path, preds: PredictorSet) -> Path:
    tensors = {}
    for l, p in preds.neurons.items():
        for name, t in p.state_dict().items():
            tensors[f"layers.{l}.{name}"] = t.detach().cpu().contiguous()
    for l, w in preds.lookahead.items():
        tensors[f"lookahead.{l}.weight"] = w.detach().cpu().contiguous()
    with atomic_path(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"fingerprint": preds.fingerprint, "format": FORMAT})
    return Path(path)


def load_predictors(path: Path, fingerprint: str | None = None) -> PredictorSet:
    """Read predictors; refuse a file made for another model when `fingerprint` is given."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no predictors here; run `hotcold profile MODEL` (without --no-predictors)")
    header, tensors, _ = read_artifact(path, "predictors", FORMAT, fingerprint, "re-run `hotcold profile`")
    from hotcold.models.layout_cache import model_version

    preds = PredictorSet(header["fingerprint"], source=model_version(path, header["fingerprint"]))
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    for l in layers:
        w1, w2 = tensors[f"layers.{l}.w1.weight"], tensors[f"layers.{l}.w2.weight"]
        with torch.device("meta"):  # no random initialisation of weights about to be replaced
            p = NeuronPredictor(w1.shape[1], w2.shape[0], w1.shape[0])
        p.load_state_dict({k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{l}.")},
                          assign=True)
        preds.neurons[l] = p.eval()
    for n, t in tensors.items():
        if n.startswith("lookahead."):
            preds.lookahead[int(n.split(".")[1])] = t
    return preds


def find_predictors(model_path: Path, fingerprint: str) -> Path | None:
    folder = find_artifact_dir(model_path, fingerprint)
    if folder is not None and (folder / "predictors.safetensors").is_file():
        return folder / "predictors.safetensors"
    return None
