"""The profile artifact: `profile.safetensors` + `profile.json` (+ `profile.png`), read and written.

profile.safetensors (metadata {"fingerprint", "format"}), per layer l:
  dense/gated FFN layers
    layers.{l}.neuron_freq          float32 [I]      fraction of profiled tokens on which neuron i was active
    layers.{l}.sample_x             float16 [S, D]   reservoir sample of the FFN input (after its norm)
    layers.{l}.sample_active        uint8 [S, I/8]   the matching active masks, bits packed little-endian
  MoE layers
    layers.{l}.expert_freq          float32 [E]      fraction of tokens routed to expert e (sums to top_k)
    layers.{l}.expert_neuron_freq   float32 [E, Ie]  among tokens routed to e, fraction on which neuron i was active
    layers.{l}.lookahead_hidden     float16 [S, D]   residual stream entering layer l's FFN norm ...
    layers.{l}.lookahead_experts    int32 [S, k]     ... and the experts layer l+1 chose for that token
  every layer
    layers.{l}.threshold            float32 [1]      |h| above which a neuron counts as active (0: ReLU)
  gated models with input sparsity (profiler/input_sparsity.py; absent otherwise)
    layers.{l}.input_threshold      float32 [4]      |x| at or below which each projection input is zeroed,
                                                     for the groups qkv, o, gate_up, down (0: dense)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hotcold.artifacts import ArtifactError, atomic_path, find_artifact_dir, read_artifact

FORMAT = "1"


@dataclass
class Profile:
    """A profile read back: frequencies and thresholds in memory, samples read on demand."""

    path: Path  # profile.safetensors
    meta: dict  # profile.json
    neuron_freq: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_freq: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_neuron_freq: dict[int, torch.Tensor] = field(default_factory=dict)
    threshold: dict[int, float] = field(default_factory=dict)
    input_threshold: dict[int, torch.Tensor] = field(default_factory=dict)  # [4] per layer (see GROUPS)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def samples(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x [S, D] float16, active [S, I] bool) for a dense/gated layer, or None."""
        from hotcold.profiler.instrument import unpack_bits

        with safe_open(self.path, "pt") as f:
            if f"layers.{layer}.sample_x" not in f.keys():
                return None
            x = f.get_tensor(f"layers.{layer}.sample_x")
            packed = f.get_tensor(f"layers.{layer}.sample_active")
        return x, unpack_bits(packed, len(self.neuron_freq[layer]))

    def lookahead_samples(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(residual [S, D] float16, experts chosen by layer+1 [S, k] int32), or None."""
        with safe_open(self.path, "pt") as f:
            if f"layers.{layer}.lookahead_hidden" not in f.keys():
                return None
            return f.get_tensor(f"layers.{layer}.lookahead_hidden"), f.get_tensor(f"layers.{layer}.lookahead_experts")


def write_profile(folder: Path, tensors: dict[str, torch.Tensor], meta: dict, plot_fn=None) -> list[Path]:
    """Write profile.safetensors, profile.json and (via plot_fn(path)) profile.png, each atomically."""
    folder = Path(folder)
    paths = [folder / "profile.safetensors", folder / "profile.json"]
    with atomic_path(paths[0]) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"fingerprint": meta["fingerprint"], "format": FORMAT})
    with atomic_path(paths[1]) as tmp:
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
    if plot_fn is not None:
        paths.append(folder / "profile.png")
        with atomic_path(paths[2]) as tmp:
            plot_fn(tmp)
    return paths


def find_profile(model_path: Path, fingerprint: str, given: Path | None = None) -> Path | None:
    """profile.safetensors: the one given (a file or an artifact folder), or the model's own."""
    if given is not None:
        given = Path(given).expanduser()
        return given / "profile.safetensors" if given.is_dir() else given
    folder = find_artifact_dir(model_path, fingerprint)
    if folder is not None and (folder / "profile.safetensors").is_file():
        return folder / "profile.safetensors"
    return None


def load_profile(path: Path, fingerprint: str | None = None) -> Profile:
    """Read a profile; refuse one made for another model when `fingerprint` is given."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no profile here; run `hotcold profile MODEL` first")
    header, tensors, meta = read_artifact(path, "profile", FORMAT, fingerprint, "re-run `hotcold profile`",
                                          meta_path=path.with_suffix(".json"),
                                          keep=lambda n: "sample" not in n and "lookahead" not in n)
    prof = Profile(path, meta)
    for name, t in tensors.items():
        _, layer, what = name.split(".", 2)
        layer = int(layer)
        if what == "threshold":
            prof.threshold[layer] = float(t[0])
        else:
            getattr(prof, what)[layer] = t
    return prof
