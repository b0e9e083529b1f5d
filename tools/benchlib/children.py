"""Children: each run is `python bench.py --_child SPEC.json`; it loads one engine, times it and writes
its result JSON."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from benchlib.common import BUILD_HINT, WARMUP_PROMPT, WARMUP_TOKENS
from benchlib.inputs import hotcold_options
from benchlib.offload import llama_cpu_moe_patterns

def _peak_rss() -> int:
    """This process's peak resident set (VmHWM: its own, not its parent's as ru_maxrss can be after exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest()[:16]


def _timings(t0: float, stamps: list[float], n_prompt: int) -> dict:
    ttft = stamps[0] - t0
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return {"ttft_s": ttft, "prefill_tok_per_s": n_prompt / ttft if ttft > 0 else None, "decode_tok_per_s": decode}


def _torch_setup(spec: dict):
    import torch

    torch.set_num_threads(spec["threads"])
    return torch


def _torch_vram(torch, device) -> int | None:
    if getattr(device, "type", str(device)).startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_reserved())
    return None


def plan_ctx_note(plan_ctx: int | None, ctx: int) -> str | None:
    """A note when hotcold's plan kept GPU memory for a much longer KV cache than the bench uses (llama.cpp
    gets n_ctx = ctx): the two then do not compare at equal budgets (a 13B shape's 4096 positions are 1.3
    GiB of a 4 GiB budget)."""
    if plan_ctx and plan_ctx > 2 * ctx:
        return (f"hotcold's plan keeps GPU memory for a {plan_ctx}-token KV cache, this bench uses {ctx} "
                f"(llama.cpp's n_ctx): plan with --ctx {ctx} to compare at equal budgets")
    return None


def run_hotcold(spec: dict) -> dict:
    torch = _torch_setup(spec)
    from hotcold.executors.from_plan import open_for_run
    from hotcold.models.generate import Generator
    from hotcold.models.sampling import SamplingParams

    opts = hotcold_options(spec["args"], spec["device"], spec["dtype"])
    ids, n = spec["prompt_ids"], spec["tokens"]
    notes = []
    t = time.perf_counter()
    # As `hotcold run` does: by the model's plan (hybrid engine) when there is one, else dense.
    setup = open_for_run(Path(spec["model"]["hotcold"]), opts.plan, not opts.no_plan, opts.device, opts.dtype,
                         threads=spec["threads"], input_sparse=not opts.no_sparse, map_experts=opts.map_experts,
                         defer_experts=opts.defer_experts)
    lm = setup.lm
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    notes += setup.notes
    if setup.plan is None and spec.get("vram_bytes"):
        notes.append(f"no plan: hotcold ran dense on {lm.device}, not within --vram")
    greedy = SamplingParams(temperature=0)
    ctx = len(ids) + n + 8
    ctx_note = plan_ctx_note(setup.plan.meta["budget"].get("ctx"), ctx) if setup.plan is not None else None
    if ctx_note and spec.get("vram_bytes"):
        notes.append(ctx_note)
    t = time.perf_counter()
    if spec["warmup"]:
        warm = Generator(lm, max_context=ctx)
        for _ in warm.generate(ids[:WARMUP_PROMPT], WARMUP_TOKENS, greedy, ignore_eos=True):
            pass
        del warm
    warmup_s = time.perf_counter() - t
    gen = Generator(lm, max_context=ctx)
    events = list(gen.generate(ids, n, greedy, ignore_eos=True))
    s = gen.stats
    assert s.cached_prompt_tokens == 0, "prefill reused a cache"
    ttft = s.ttft_s
    setup.close()
    return {
        "load_s": load_s, "load_stages": setup.load_times.as_dict(), "warmup_s": warmup_s, "ttft_s": ttft,
        "prefill_tok_per_s": s.prompt_tokens / ttft if ttft > 0 else None,
        "decode_tok_per_s": s.decode_tok_per_s or None,
        "prompt_tokens": s.prompt_tokens, "prompt_ids_sha": _ids_digest(ids),
        "completion_tokens": s.completion_tokens, "token_ids": [e.token_id for e in events],
        "torch_vram_bytes": _torch_vram(torch, lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
        "device": str(lm.device), "notes": notes,
    }


OVERRIDE_LOG = b"buffer type overridden to"  # llama-model-loader.cpp logs this (debug level) per overridden tensor


def _llama_cpu_buffer_type(lc) -> int:
    """ggml_backend_cpu_buffer_type() of the ggml that libllama itself uses, looked up through libllama's handle
    (dlsym searches its dependencies). Loading llama_cpp/lib/libggml-base.so by path would not do: the wheel
    ships copies, not links, so that is a second ggml whose CPU buffer type llama.cpp does not recognise."""
    import ctypes

    try:
        fn = lc._lib.ggml_backend_cpu_buffer_type
    except AttributeError as e:
        raise RuntimeError("llama.cpp expert overrides: ggml_backend_cpu_buffer_type not found through libllama "
                           f"({e}); this llama-cpp-python cannot run --n-cpu-moe") from e
    fn.restype, fn.argtypes = ctypes.c_void_p, []
    buft = fn()
    if not buft:
        raise RuntimeError("llama.cpp expert overrides: ggml_backend_cpu_buffer_type() returned NULL")
    return buft


@contextmanager
def llama_tensor_overrides(patterns: list[str]):
    """While a `Llama` is constructed inside: llama.cpp puts tensors whose names match `patterns` (regexes) in its
    CPU buffer type, like `-ot PATTERN=CPU` / `--n-cpu-moe`. llama-cpp-python's `Llama` does not expose
    `tensor_buft_overrides`, so `llama_model_default_params` (which `Llama.__init__` calls) is wrapped to fill
    it with a NULL-terminated `llama_model_tensor_buft_override` array, and llama.cpp's log is tapped for the
    lines that report each overridden tensor (forwarded to llama-cpp-python's logger as before).

    Yields a dict: "address" (of the array, to check against the Llama's model_params), "overridden" (the log
    lines) and the ctypes objects, which the caller keeps as long as the model. Raises RuntimeError when the
    overrides cannot be installed."""
    import ctypes

    import llama_cpp

    if not patterns:
        yield None
        return
    lc = llama_cpp.llama_cpp
    if "tensor_buft_overrides" not in [f[0] for f in lc.llama_model_params._fields_]:
        raise RuntimeError(f"llama.cpp expert overrides: llama-cpp-python {llama_cpp.__version__}'s "
                           "llama_model_params has no tensor_buft_overrides field")
    limit = lc.llama_max_tensor_buft_overrides()
    if len(patterns) + 1 > limit:
        raise RuntimeError(f"llama.cpp expert overrides: {len(patterns)} patterns, llama.cpp takes {limit - 1}")
    buft = _llama_cpu_buffer_type(lc)

    class Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
        _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

    encoded = [p.encode() for p in patterns]
    array = (Override * (len(encoded) + 1))(*[Override(p, buft) for p in encoded])  # last zeroed: the end
    address = ctypes.addressof(array)
    overridden: list[str] = []
    forward = llama_cpp._logger.llama_log_callback

    @lc.llama_log_callback
    def tap(level, text, user_data):
        if text and OVERRIDE_LOG in text:
            overridden.append(text.decode("utf-8", "replace").strip())
        forward(level, text, user_data)

    lc.llama_log_set(tap, ctypes.c_void_p(0))
    try:
        with llama_model_params(tensor_buft_overrides=address):
            yield {"address": address, "overridden": overridden, "keep": (array, encoded, tap)}
    finally:
        lc.llama_log_set(forward, ctypes.c_void_p(0))


# llama.cpp's extra CPU buffer types (weights repacked at load for AMX or other CPU kernels) off: on a
# 2-core AMX Xeon, llama-cpp-python 0.3.36 built there segfaulted in llama_decode with them on SmolLM2
# Q4_1 and Gemma 3 Q4_K_M
NO_REPACK = {"use_extra_bufts": False}


@contextmanager
def llama_model_params(**fields):
    """While a `Llama` is constructed inside: `llama_model_default_params` (which `Llama.__init__` calls;
    llama-cpp-python's `Llama` does not expose every model param) returns the defaults with `fields` set."""
    import llama_cpp

    lc = llama_cpp.llama_cpp
    default_params = lc.llama_model_default_params

    def params():
        p = default_params()
        for name, value in fields.items():
            setattr(p, name, value)
        return p

    lc.llama_model_default_params = params
    try:
        yield
    finally:
        lc.llama_model_default_params = default_params


def run_llama_cpp(spec: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    ids, n = spec["prompt_ids"], spec["tokens"]
    ngl = spec.get("n_gpu_layers", 0)
    n_cpu_moe = spec.get("n_cpu_moe") or 0
    if ngl and not llama_cpp.llama_supports_gpu_offload():
        raise RuntimeError(BUILD_HINT.replace("VERSION", llama_cpp.__version__))
    t = time.perf_counter()
    with llama_tensor_overrides(llama_cpu_moe_patterns(n_cpu_moe)) as overrides, \
            llama_model_params(**({} if spec.get("llama_extra_bufts", True) else NO_REPACK)):
        # no mmap with CPU overrides: llama.cpp warns that mmap costs speed there ("--load-mode none")
        llm = Llama(spec["model"]["gguf"], n_ctx=spec["n_ctx"], n_batch=512, n_threads=spec["threads"],
                    n_threads_batch=spec["threads"], n_gpu_layers=ngl, use_mmap=not n_cpu_moe,
                    verbose=bool(spec.get("verbose")))
    load_s = time.perf_counter() - t
    extra: dict = {}
    if n_cpu_moe:
        llm._hotcold_overrides = overrides  # read while loading, but llama_model keeps the params: keep it too
        if llm.model_params.tensor_buft_overrides != overrides["address"]:
            raise RuntimeError("llama.cpp expert overrides: Llama() did not build its model params through "
                               "llama_model_default_params, so the overrides were not passed")
        if not overrides["overridden"]:
            raise RuntimeError(f"llama.cpp expert overrides: llama.cpp put no tensor on the CPU for --n-cpu-moe "
                               f"{n_cpu_moe} (no '{OVERRIDE_LOG.decode()}' in its log): no routed experts?")
        extra = {"n_cpu_moe": n_cpu_moe, "overridden_tensors": len(overrides["overridden"])}
    greedy = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    t = time.perf_counter()
    if spec["warmup"]:
        for i, _ in enumerate(llm.generate(ids[:WARMUP_PROMPT], **greedy)):
            if i + 1 >= WARMUP_TOKENS:
                break
    warmup_s = time.perf_counter() - t
    llm.reset()  # n_tokens = 0: the measured prompt reuses nothing from the warm-up
    out, stamps = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, reset=True, **greedy):  # yields EOS like any token: EOS is ignored
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) >= n:
            break
    return {
        "load_s": load_s, "warmup_s": warmup_s, **_timings(t0, stamps, len(ids)),
        "prompt_tokens": len(ids), "prompt_ids_sha": _ids_digest(ids), "completion_tokens": len(out),
        "token_ids": out, "n_gpu_layers": ngl, **extra, "notes": [],
    }


def run_transformers(spec: dict) -> dict:
    torch = _torch_setup(spec)
    import transformers
    from transformers.generation.streamers import BaseStreamer

    ids, n = spec["prompt_ids"], spec["tokens"]
    device = spec["device"]
    dtype_name = spec["dtype"] or ("bfloat16" if device == "cuda" else "float32")
    kw: dict = {"dtype": getattr(torch, dtype_name), "local_files_only": True}
    if device == "cuda":
        if spec.get("vram_bytes"):
            import psutil

            kw["device_map"] = "auto"
            kw["max_memory"] = {0: spec["vram_bytes"], "cpu": psutil.virtual_memory().total}
        else:
            kw["device_map"] = {"": 0}
    m = spec["model"]
    t = time.perf_counter()
    if m["hf"]:
        model = transformers.AutoModelForCausalLM.from_pretrained(m["hf"], **kw)
    else:
        g = Path(m["gguf"])
        model = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, **kw)
    model.eval()
    if device == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    first = next(model.parameters()).device if device != "cuda" else torch.device("cuda:0")
    gc = model.generation_config
    gc.eos_token_id = None  # ignore EOS: generate exactly n tokens, greedy
    gc.pad_token_id = 0
    for k in ("temperature", "top_p", "top_k"):
        setattr(gc, k, None)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(prompt: list[int], tokens: int, streamer=None):
        x = torch.tensor([prompt], device=first)
        with torch.inference_mode():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                  do_sample=False, streamer=streamer,
                                  generation_config=gc)

    t = time.perf_counter()
    if spec["warmup"]:
        generate(ids[:WARMUP_PROMPT], WARMUP_TOKENS)
    warmup_s = time.perf_counter() - t
    st = Stamps()
    t0 = time.perf_counter()
    seq = generate(ids, n, st)
    out = seq[0, len(ids):].tolist()
    stamps = st.times[1:]  # the first put() is the prompt
    return {
        "load_s": load_s, "warmup_s": warmup_s, **_timings(t0, stamps, len(ids)),
        "prompt_tokens": len(ids), "prompt_ids_sha": _ids_digest(ids), "completion_tokens": len(out),
        "token_ids": out, "torch_vram_bytes": _torch_vram(torch, torch.device(device)), "dtype": dtype_name,
        "notes": [],
    }


def run_probe(spec: dict) -> dict:
    """Prompt ids (hotcold's tokenizer), torch/CUDA facts and llama.cpp's GPU support, in one child."""
    info: dict = {}
    from hotcold.models.perplexity import calibration_text

    m = spec["model"]
    hf = Path(m["hf"]) if m["hf"] else None
    if hf is not None and (hf / "tokenizer.json").is_file():
        from hotcold.models.tokenizer import Tokenizer

        tok, info["tokenizer"] = Tokenizer.from_hf_folder(hf), str(hf / "tokenizer.json")
    elif m["gguf"]:
        from hotcold.models.gguf_loader import GGUFFile
        from hotcold.models.tokenizer import Tokenizer

        tok, info["tokenizer"] = Tokenizer.from_gguf_metadata(GGUFFile(m["gguf"]).metadata), m["gguf"]
    else:
        raise RuntimeError(f"{hf}: no tokenizer.json and no GGUF to read a tokenizer from; the prompt needs one")
    text, chars, want = calibration_text(), 1024, spec["prompt_tokens"]
    while True:
        ids = tok.encode(text[:chars])
        if len(ids) >= want or chars >= len(text):
            break
        chars *= 2
    if len(ids) < want:
        raise RuntimeError(f"the calibration text has only {len(ids)} tokens; lower --prompt-tokens")
    info["prompt_ids"] = ids[:want]
    info["vocab_size"] = tok.vocab_size
    import torch

    info["cuda"] = torch.cuda.is_available()
    info["gpu_name"] = torch.cuda.get_device_name(0) if info["cuda"] else None
    if spec.get("check_llama_gpu"):
        import llama_cpp

        info["llama_gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
        info["llama_cpp_version"] = llama_cpp.__version__
    return info


RUNNERS = {"hotcold": run_hotcold, "llama.cpp": run_llama_cpp, "transformers": run_transformers, "probe": run_probe}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        t = time.perf_counter()
        result = RUNNERS[spec["kind"]](spec)
        result["child_s"] = time.perf_counter() - t
        result["peak_ram_bytes"] = _peak_rss()
        rc = 0
    except Exception as e:  # reported to the parent as one line
        msg = str(e).strip().splitlines()
        result, rc = {"error": f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]}, 1
    Path(spec["result"]).write_text(json.dumps(result))
    return rc
