"""`generate` (the plan, the generator and the writers, end to end) and `--check` (the planted statistics
measured on held-out text with hotcold's reference forward)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from makemodel.generator import WeightGenerator, _top_share
from makemodel.spec import BOS_ID, EOS_ID, MakeModelError, Spec, expert_shares, firing_probs, mass_fraction
from makemodel.tensors import QUANT, STORAGE, count_params, tensor_plan
from makemodel.tokens import load_tokenizer, text_windows, write_hf_tokenizer
from makemodel.writers import GGUFStreamWriter, IOThread, SafetensorsWriter, _raw, gguf_types, hf_config

# ----------------------------------------------------------------------------- driver


@dataclass
class Result:
    out: Path
    hf: Path | None
    gguf: Path | None
    model_bytes: int  # the HF form's bytes (the storage dtype's)
    seconds: float
    notes: list[dict]
    gguf_bytes: int = 0  # the GGUF form's tensor bytes (smaller than model_bytes when quantised)

    @property
    def written_bytes(self) -> int:
        return (self.model_bytes if self.hf else 0) + (self.gguf_bytes if self.gguf else 0)


def generate(spec: Spec, out: Path, *, dtype: str = "f16", seed: int = 0, formats: tuple[str, ...] = ("hf", "gguf"),
             sparsity: float = 0.89, mass80: float = 0.2, expert_skew: float = 0.5, calib_tokens: int = 256,
             calib_len: int = 128, shard_bytes: int = 4 << 30, progress: bool = True, force: bool = False,
             preset: str = "", gate_rank: int | None = None, gate_noise: float = 0.03) -> Result:
    """Write the model (see the module help). gate_rank None: hidden // 16 for dense models.
    dtype q8_0/q4_0/q4_k: the HF form (and the generation) in f16, the GGUF's matrices quantised."""
    if dtype not in STORAGE and dtype not in QUANT:
        raise MakeModelError(f"--dtype {dtype}: use one of {', '.join([*STORAGE, *QUANT])}")
    quant = QUANT.get(dtype)
    torch_dtype = STORAGE.get(dtype, torch.float16)
    if gate_rank is None:
        gate_rank = 0 if spec.moe or spec.act != "relu" else max(1, spec.hidden // 16)
    if not 0 <= gate_rank <= spec.hidden or not 0.0 <= gate_noise <= 1.0:
        raise MakeModelError(f"--gate-rank must be in [0, hidden] and --gate-noise in [0, 1], got "
                             f"{gate_rank} and {gate_noise}")
    if spec.moe:  # check the targets before writing anything
        expert_shares(spec.experts, spec.top_k, expert_skew)
    elif spec.act == "relu":
        firing_probs(spec.ffn, sparsity, mass80)
    plan = tensor_plan(spec)
    esize = torch.finfo(torch_dtype).bits // 8
    model_bytes = count_params(plan) * esize
    types = gguf_types(plan, torch_dtype, quant)
    gguf_bytes = sum(n for _, n in types.values())
    hf_dir = out / "hf" if "hf" in formats else None
    gguf_path = out / "model.gguf" if "gguf" in formats else None
    _prepare(out, hf_dir, gguf_path, (model_bytes if hf_dir else 0) + (gguf_bytes if gguf_path else 0), force)

    tokenizer = load_tokenizer()
    calib_len = min(calib_len, calib_tokens)
    calib = text_windows(tokenizer, max(1, calib_tokens // calib_len), calib_len, "calib")
    gen = WeightGenerator(spec, torch_dtype, seed, sparsity, mass80, expert_skew, calib, gate_rank, gate_noise)

    t0 = time.perf_counter()
    io = IOThread()
    st = SafetensorsWriter(hf_dir, [p for e in plan for p in e.parts], torch_dtype, shard_bytes, io) \
        if hf_dir else None
    relu = spec.family == "llama" and spec.act == "relu"
    gw = GGUFStreamWriter(gguf_path, spec, plan, torch_dtype, "relu" if relu else None, io, quant) \
        if gguf_path else None
    from tqdm import tqdm

    bar = tqdm(total=model_bytes, unit="B", unit_scale=True, desc="generating", disable=not progress or None,
               file=sys.stderr)
    chunks = gen.chunks()
    for entry in plan:
        for part in entry.parts:
            done = 0
            rows = part.shape[0]
            while done < rows:
                name, r0, chunk = next(chunks)
                if name != part.hf or r0 != done:
                    raise AssertionError(f"generator order: got {name}[{r0}], expected {part.hf}[{done}]")
                if st:
                    st.write(part, _raw(chunk))
                if gw:
                    gw.write(entry, part, r0, chunk)
                done += chunk.shape[0]
                bar.update(chunk.numel() * esize)
        if gw:
            gw.end_entry()
    if next(chunks, None) is not None:
        raise AssertionError("generator produced more tensors than the plan")
    bar.close()
    if st:
        st.close()
    if gw:
        gw.close()
    io.join()
    seconds = time.perf_counter() - t0
    if hf_dir:
        (hf_dir / "config.json").write_text(json.dumps(hf_config(spec, torch_dtype), indent=2) + "\n")
        (hf_dir / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}, indent=2) + "\n")
        write_hf_tokenizer(hf_dir, spec.context)
    summary = {
        "preset": preset, "spec": dataclasses.asdict(spec), "dtype": dtype, "seed": seed,
        "targets": {"expert_skew_top25_share": expert_skew} if spec.moe else
                   {"sparsity": sparsity, "mass80": mass80} if spec.act == "relu" else {},
        "gate_rank": gate_rank, "gate_noise": gate_noise if gate_rank else None,
        "constant_channel": gen.c, "constant_value": gen.A if gen.c >= 0 else None,
        "calibration_tokens": int(calib.numel()), "model_bytes": model_bytes,
        "gguf_bytes": gguf_bytes if gguf_path else None,
        "gguf_types": _type_summary(types) if gguf_path else None,
        "files": {"hf": str(hf_dir) if hf_dir else None, "gguf": str(gguf_path) if gguf_path else None},
        "seconds": round(seconds, 2), "layers": gen.layer_notes,
    }
    (out / "make_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return Result(out, hf_dir, gguf_path, model_bytes, seconds, gen.layer_notes, gguf_bytes)


def _type_summary(types: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    """GGML type -> the GGUF tensors of that type, layer numbers folded (blk.N.attn_q.weight)."""
    import re

    out: dict[str, list[str]] = {}
    for name, (t, _) in types.items():
        key = re.sub(r"^blk\.\d+\.", "blk.N.", name)
        if key not in out.setdefault(t, []):
            out[t].append(key)
    return out


def _prepare(out: Path, hf_dir: Path | None, gguf_path: Path | None, need: int, force: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    existing = [p for p in (hf_dir, gguf_path) if p is not None and p.exists()]
    if existing and not force:
        raise MakeModelError(f"{existing[0]} already exists; pass --force to overwrite it")
    for p in existing:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    free = shutil.disk_usage(out).free
    if free < need * 1.01 + (64 << 20):
        raise MakeModelError(f"{out}: {need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free; free space, "
                             "choose --format hf or gguf, or fewer --layers")
    if hf_dir:
        hf_dir.mkdir()


# ----------------------------------------------------------------------------- --check


CHECK_WINDOW = 256  # tokens per held-out window of the check (shorter windows weigh early positions more)


def check(hf_dir: Path, layers: int = 4, windows: int = 4, length: int = CHECK_WINDOW, targets: dict | None = None,
          quiet: bool = False) -> list[dict]:
    """Load the first `layers` layers of the HF folder with hotcold's reference forward (float32,
    CPU), run held-out calibration text through them and measure per layer: sparsity and the
    80%-mass fraction of FFN neurons (dense), or the expert routing shares (MoE)."""
    from safetensors import safe_open

    from hotcold.models import hf_loader
    from hotcold.models.config import config_from_hf
    from hotcold.models.layers import Rotary, route
    from hotcold.models.tokenizer import Tokenizer
    from hotcold.models.transformer import Transformer

    raw = hf_loader.read_config(hf_dir)
    n = min(layers, int(raw["num_hidden_layers"]))
    config = config_from_hf(dict(raw, num_hidden_layers=n), source=str(hf_dir / "config.json"))
    with torch.device("meta"):
        model = Transformer(config)
    if hasattr(model, "lm_head"):
        del model.lm_head  # not needed: only the layers run
    model = model.to_empty(device="cpu").float()
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset("cpu")
    params = dict(model.named_parameters())
    for path in hf_loader.shard_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                mapped = hf_loader.canonical_name(key, config.sandwich_norms)
                if mapped is None or mapped[0] not in params:
                    continue
                name, expert = mapped
                dest = params[name].data if expert is None else params[name].data[expert]
                dest.copy_(f.get_tensor(key))
    model.eval()
    tokens = text_windows(Tokenizer.from_hf_folder(hf_dir), windows, length, "check")

    counts: dict[int, torch.Tensor] = {}
    seen: dict[int, int] = {}

    def hook(layer: int):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if module.kind == "moe":
                _, ids = route(module.router(x), module.top_k, module.renormalise)
                c = torch.bincount(ids.reshape(-1), minlength=module.router.out_features).double()
            else:
                c = (module.activations(x) != 0).sum(0).double()
            counts[layer] = counts.get(layer, 0) + c
            seen[layer] = seen.get(layer, 0) + x.shape[0]
        return fn

    handles = [b.ffn.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.layers)]
    inputs: dict[tuple[int, str], list[torch.Tensor]] = {}  # SwiGLU: what each projection reads
    if config.activation == "silu" and not any(config.ffn_kind(i) == "moe" for i in range(n)):
        def keep(layer: int, group: str):
            def fn(module, args):
                x = args[0]
                inputs.setdefault((layer, group), []).append(x.reshape(-1, x.shape[-1]).float()[::4])
            return fn
        for i, b in enumerate(model.layers):
            for group, lin in (("qkv", b.attn.q), ("o", b.attn.o), ("gate/up", b.ffn.gate), ("down", b.ffn.down)):
                handles.append(lin.register_forward_pre_hook(keep(i, group)))
    with torch.inference_mode():
        for w in range(tokens.shape[0]):
            t = tokens[w : w + 1]
            pos = torch.arange(t.shape[1])
            x = model.embed_tokens(t, pos)
            for block in model.layers:
                x = block(x, pos, None)
    for h in handles:
        h.remove()

    targets = targets or {}
    rows = []
    for layer in range(n):
        c = counts[layer]
        if config.ffn_kind(layer) == "moe":
            share = (c / c.sum()).numpy()
            row = {"layer": layer, "kind": "moe", "top25_share": _top_share(share), "max_share": float(share.max()),
                   "experts_mass80": mass_fraction(share)}
            if "expert_skew" in targets:
                q = expert_shares(len(share), config.top_k, targets["expert_skew"])
                row.update(target_top25_share=_top_share(q), target_max_share=float(q.max()),
                           target_experts_mass80=mass_fraction(q))
        else:
            freq = (c / seen[layer]).numpy()
            row = {"layer": layer, "kind": "dense", "sparsity": 1 - float(freq.mean()), "mass80": mass_fraction(freq),
                   "tokens": seen[layer]}
            if "sparsity" in targets:
                p = firing_probs(len(freq), targets["sparsity"], targets["mass80"])
                row.update(target_sparsity=targets["sparsity"], target_mass80=mass_fraction(p))
            if inputs:
                row["inputs"] = {g: input_shape(torch.cat(inputs[(layer, g)]))
                                 for g in ("qkv", "o", "gate/up", "down")}
        rows.append(row)
    if not quiet:
        print_check(rows, int(tokens.numel()))
    return rows


def input_shape(x: torch.Tensor) -> dict:
    """A projection input's distribution: excess kurtosis (Gaussian 0, Laplacian 3) and the share of
    its energy in the smaller half of its entries by magnitude (Gaussian 0.071, Laplacian 0.033): what
    a threshold at 50% sparsity drops. x: [tokens, channels]; the constant channel (a mean magnitude
    over 10x the median channel's) is left out: no threshold drops it."""
    mag = x.abs().mean(0)
    x = x[:, mag <= 10 * mag.median()].reshape(-1).double()
    x = x - x.mean()
    kurt = float((x**4).mean() / (x**2).mean() ** 2 - 3)
    e = (x * x).sort().values
    return {"kurtosis": round(kurt, 2), "low_half_energy": round(float(e[: len(e) // 2].sum() / e.sum()), 4)}


def print_check(rows: list[dict], n_tokens: int) -> None:
    print(f"check: {n_tokens} held-out tokens of Python's documentation, hotcold reference forward (float32)")
    if rows and "inputs" in rows[0]:
        groups = list(rows[0]["inputs"])
        print("projection inputs: excess kurtosis / energy share of the smaller half (Gaussian 0 / 0.071, "
              "Laplacian 3 / 0.033)")
        print(f"{'layer':>5}  " + "  ".join(f"{g:>14}" for g in groups))
        for r in rows:
            print(f"{r['layer']:>5}  " + "  ".join(
                f"{r['inputs'][g]['kurtosis']:>6.2f} / {r['inputs'][g]['low_half_energy']:.3f}" for g in groups))
        return
    if rows and rows[0]["kind"] == "moe":
        print(f"{'layer':>5}  {'top-25% share':>20}  {'max share':>20}  {'experts 80% mass':>20}")
        print(f"{'':>5}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}")
        for r in rows:
            print(f"{r['layer']:>5}  {r.get('target_top25_share', float('nan')):>9.3f} {r['top25_share']:>10.3f}  "
                  f"{r.get('target_max_share', float('nan')):>9.3f} {r['max_share']:>10.3f}  "
                  f"{r.get('target_experts_mass80', float('nan')):>9.3f} {r['experts_mass80']:>10.3f}")
        return
    print(f"{'layer':>5}  {'sparsity':>20}  {'80%-mass fraction':>20}")
    print(f"{'':>5}  {'target':>9} {'achieved':>10}  {'target':>9} {'achieved':>10}")
    for r in rows:
        print(f"{r['layer']:>5}  {r.get('target_sparsity', float('nan')):>9.3f} {r['sparsity']:>10.3f}  "
              f"{r.get('target_mass80', float('nan')):>9.3f} {r['mass80']:>10.3f}")
