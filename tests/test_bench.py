"""tools/bench.py: its pure parts (sizes, statistics, table, llama.cpp layer and expert offload, argument checks),
llama.cpp with an MoE model's experts on the CPU, and one real run of hotcold against llama.cpp on SmolLM2."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hotcold_bench", REPO / "tools" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["hotcold_bench"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


# -- sizes, numbers, statistics --------------------------------------------------------------


@pytest.mark.parametrize("text,value", [
    ("8GiB", 8 << 30), ("8G", 8 << 30), ("8gib", 8 << 30), ("8GB", 8 * 10**9), ("512MiB", 512 << 20),
    ("1.5GiB", 3 << 29), ("4096", 4096), ("64KiB", 64 << 10), (" 2 TiB ", 2 << 40),
])
def test_vram_size(text, value):
    assert bench.vram_size(text) == value


@pytest.mark.parametrize("text", ["", "8 gigs", "GiB", "-1GiB", "0", "8iB", "8XB", "1e9"])
def test_vram_size_rejects_with_one_line(text):
    with pytest.raises(bench.BenchError) as e:
        bench.vram_size(text)
    assert "--vram" in str(e.value) and "\n" not in str(e.value)


def test_summarise_median_and_spread():
    s = bench.summarise([3.0, 1.0, 2.0, None])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 1.0, "n": 3}
    assert bench.summarise([4.0, 2.0])["median"] == 3.0
    assert bench.summarise([None]) is None
    assert bench.ratio(5.0, 10.0) == 0.5
    assert bench.ratio(5.0, None) is None and bench.ratio(None, 3.0) is None and bench.ratio(1.0, 0.0) is None


def test_number_formats():
    assert [bench.fmt_num(v) for v in (1234.4, 127.04, 17.84, 1.234, 0.3114, None)] == \
        ["1234", "127", "17.8", "1.23", "0.311", "-"]
    assert bench.fmt_bytes(206 << 20) == "206 MiB"
    assert bench.fmt_bytes(int(1.5 * (1 << 30))) == "1.5 GiB"
    assert bench.fmt_bytes(None) == "-"
    assert bench.fmt_ratio(0.141) == "0.14×" and bench.fmt_ratio(12.34) == "12.3×" and bench.fmt_ratio(166.2) == "166×"


# -- the report and its table ---------------------------------------------------------------


def _run(prefill, decode, ttft, ram, tokens=4, ids=(5, 6, 7, 8), sha=None):
    return {"load_s": 1.0, "prefill_tok_per_s": prefill, "decode_tok_per_s": decode, "ttft_s": ttft,
            "peak_ram_bytes": ram, "completion_tokens": tokens, "token_ids": list(ids),
            "prompt_ids_sha": sha or bench._ids_digest([1, 2, 3])}


def _args(**kw):
    base = dict(prompt_tokens=3, tokens=4, threads=2, repeats=3, device="cpu", dtype=None, vram_bytes=None,
                no_warmup=False)
    return argparse.Namespace(**{**base, **kw})


def _report(runs, engines=None, **kw):
    engines = engines or [bench.BenchEngine("hotcold", "hotcold"), bench.BenchEngine("llama.cpp", "llama.cpp")]
    paths = bench.ModelPaths(None, Path("m.gguf"), Path("m.gguf"), "m.gguf")
    return bench.build_report(_args(**kw), paths, engines, runs, [1, 2, 3], {}, [], {})


def test_report_medians_ratios_and_table():
    runs = {
        "hotcold": [_run(100, 10, 0.03, 600 << 20), _run(120, 12, 0.025, 600 << 20), _run(110, 14, 0.027, 600 << 20)],
        "llama.cpp": [_run(200, 40, 0.015, 200 << 20), _run(220, 40, 0.014, 200 << 20),
                      _run(210, 40, 0.016, 200 << 20, ids=(5, 6, 9, 9))],
    }
    rep = _report(runs)
    assert rep["reference"] == "llama.cpp"
    hc = rep["engines"]["hotcold"]
    assert hc["summary"]["decode_tok_per_s"]["median"] == 12 and hc["summary"]["decode_tok_per_s"]["spread"] == 2
    assert hc["ratio"]["decode_tok_per_s"] == pytest.approx(0.3)
    assert hc["ratio"]["prefill_tok_per_s"] == pytest.approx(110 / 210)
    assert hc["ratio"]["peak_ram_bytes"] == pytest.approx(3.0)
    assert hc["agreement_with_reference"] == 4  # against the reference's first run
    table = rep["table"]
    lines = table.splitlines()
    hc_line = next(ln for ln in lines if ln.startswith("hotcold"))
    ref_line = next(ln for ln in lines if ln.startswith("llama.cpp"))
    assert "12.0±2.0 (0.30×)" in hc_line and "110±10 (0.52×)" in hc_line and "600 MiB (3.00×)" in hc_line
    assert "40.0±0.0" in ref_line and "×" not in ref_line
    assert "median of 3" in lines[0] and "threads 2" in lines[0]
    assert not [n for n in rep["notes"] if "different prompt" in n or "generated" in n]
    assert any(n.startswith("noisy: hotcold decode ±17%") for n in rep["notes"])  # 2 / 12
    md = rep["table_markdown"].splitlines()
    assert "| engine | load s | prefill tok/s |" in md[0] and md[2].startswith("| hotcold | 1.00 | 110±10 (0.52×) |")


def test_report_flags_wrong_token_counts_prompt_ids_and_failures():
    runs = {
        "hotcold": [_run(100, 10, 0.03, 1, tokens=3, ids=(5, 6, 7))],
        "llama.cpp": [_run(200, 40, 0.015, 1, sha="deadbeef")],
        "transformers": [{"error": "OSError: cannot load", "status": "skipped"}],
    }
    engines = [bench.BenchEngine(n, n) for n in ("hotcold", "llama.cpp", "transformers")]
    rep = _report(runs, engines, repeats=1)
    notes = "\n".join(rep["notes"])
    assert "hotcold: generated [3] tokens, not 4" in notes
    assert "llama.cpp: was fed different prompt ids" in notes
    assert rep["engines"]["transformers"]["status"] == "skipped"
    assert "transformers: skipped: OSError: cannot load" in rep["table"]


def test_report_without_a_peer_has_no_ratios():
    rep = _report({"hotcold": [_run(100, 10, 0.03, 1)]}, [bench.BenchEngine("hotcold", "hotcold")], repeats=1)
    assert rep["reference"] is None and "ratio" not in rep["engines"]["hotcold"] and "×" not in rep["table"]


def test_reference_is_llama_cpp_else_first_peer():
    E = bench.BenchEngine
    assert bench.reference_engine([E("hotcold", "hotcold"), E("transformers", "transformers"),
                                   E("llama.cpp", "llama.cpp")]) == "llama.cpp"
    assert bench.reference_engine([E("hotcold", "hotcold"), E("transformers", "transformers")]) == "transformers"


def test_report_flags_over_budget_vram():
    r = _run(100, 10, 0.03, 1)
    r["peak_vram_bytes"] = 9 << 30
    rep = _report({"hotcold": [r], "llama.cpp": [_run(200, 40, 0.015, 1)]}, repeats=1, device="cuda",
                  vram_bytes=8 << 30)
    assert any("over the 8.0 GiB budget" in n for n in rep["notes"])


# -- llama.cpp layer offload ----------------------------------------------------------------


def test_llama_gpu_layers_fits_last_layers_then_output():
    layout = bench.GgufLayout(n_layer=4, layer_bytes=[10, 10, 10, 20], output_bytes=5, kv_bytes_per_token=[1] * 4)
    n_ctx = 2  # each layer: weights + 2 bytes of KV; llama.cpp offloads the LAST layers first
    assert bench.llama_gpu_layers(layout, n_ctx, 0) == 0
    assert bench.llama_gpu_layers(layout, n_ctx, 21) == 0  # the last layer needs 22
    assert bench.llama_gpu_layers(layout, n_ctx, 22) == 1
    assert bench.llama_gpu_layers(layout, n_ctx, 33) == 1
    assert bench.llama_gpu_layers(layout, n_ctx, 34) == 2
    assert bench.llama_gpu_layers(layout, n_ctx, 58) == 4
    assert bench.llama_gpu_layers(layout, n_ctx, 62) == 4  # + output needs 63
    assert bench.llama_gpu_layers(layout, n_ctx, 63) == 5
    assert bench.llama_gpu_layers(layout, n_ctx, 10**9) == 5
    assert bench.llama_gpu_layers(layout, 100, 58) == 0  # a long context's KV pushes layers out


def test_read_gguf_layout_of_smollm2(smollm2_path):
    import gguf

    layout = bench.read_gguf_layout(smollm2_path)
    reader = gguf.GGUFReader(str(smollm2_path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert layout.n_layer == 30 and len(layout.layer_bytes) == 30
    assert sum(layout.layer_bytes) == sum(v for k, v in sizes.items() if k.startswith("blk."))
    assert layout.layer_bytes[0] == sum(v for k, v in sizes.items() if k.startswith("blk.0."))
    # tied embeddings: no output.weight, llama.cpp puts a copy of token_embd on the output device
    assert layout.output_bytes == sizes["token_embd.weight"] + sizes["output_norm.weight"]
    assert layout.kv_bytes_per_token == [3 * (64 + 64) * 2] * 30  # 3 KV heads of 64, K + V in f16
    budget = sum(layout.layer_bytes[-10:]) + 10 * layout.kv_bytes_per_token[0] * 256
    assert bench.llama_gpu_layers(layout, 256, budget) == 10
    assert layout.expert_bytes == [0] * 30 and not layout.moe


# -- llama.cpp with an MoE model's experts on the CPU (--n-cpu-moe) ---------------------------


def _moe_layout(experts=(20, 20, 20)):
    """3 layers of 30 bytes, `experts` of them routed experts; output 5; 1 byte of KV per token and layer."""
    return bench.GgufLayout(n_layer=3, layer_bytes=[30] * 3, output_bytes=5, kv_bytes_per_token=[1] * 3,
                            expert_bytes=list(experts))


def test_llama_cpu_moe_layers_keeps_the_first_layers_experts_on_the_cpu():
    layout, n_ctx = _moe_layout(), 2  # the rest: 3 * 10 + 5 + 3 * 2 = 41 bytes, experts 20 a layer
    assert layout.moe
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 10**9) == 0
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 101) == 0  # everything, exactly
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 100) == 1
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 81) == 1
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 80) == 2
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 61) == 2
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 60) == 3
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 41) == 3  # every layer's experts on the CPU
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 40) is None  # the rest alone does not fit
    assert bench.llama_cpu_moe_layers(layout, n_ctx, 0) is None
    assert bench.llama_cpu_moe_layers(layout, 21, 100) == 3  # a long context's KV: 30 + 5 + 3 * 21 = 98
    assert bench.llama_cpu_moe_layers(layout, 22, 100) is None  # 30 + 5 + 3 * 22 = 101
    # llama.cpp counts from layer 0 (--n-cpu-moe N = layers 0..N-1), not the biggest experts first
    uneven = _moe_layout((10, 30, 20))
    assert bench.llama_cpu_moe_layers(uneven, n_ctx, 91) == 1
    assert bench.llama_cpu_moe_layers(uneven, n_ctx, 90) == 2  # dropping layer 1 alone would fit, N=1 does not
    dense = bench.GgufLayout(n_layer=3, layer_bytes=[30] * 3, output_bytes=5, kv_bytes_per_token=[1] * 3)
    assert not dense.moe and bench.llama_cpu_moe_layers(dense, n_ctx, 101) == 0
    assert bench.llama_cpu_moe_layers(dense, n_ctx, 100) is None


def test_plan_ctx_note_when_the_plan_kept_a_longer_kv_cache():
    """A plan made for 4096 positions, benched with 200 (llama.cpp's n_ctx), is not at an equal budget:
    the note says so and names the --ctx to plan with; a plan near the bench's context gets none."""
    note = bench.plan_ctx_note(4096, 200)
    assert note is not None and "4096-token KV cache" in note and "--ctx 200" in note
    assert bench.plan_ctx_note(256, 200) is None and bench.plan_ctx_note(None, 200) is None


def test_llama_offload_rules_and_notes():
    layout, n_ctx, reserve = _moe_layout(), 2, 1000
    o = bench.llama_offload(layout, n_ctx, 1080, reserve)  # 80 bytes left: experts of layers 0 and 1 on the CPU
    assert (o.n_gpu_layers, o.n_cpu_moe) == (4, 2)
    assert o.note.startswith("llama.cpp n_gpu_layers=4 of 3 (+1 = output layer) with the routed experts of the "
                             "first 2 layers on the CPU (--n-cpu-moe 2)") and "less 1000 B" in o.note
    o = bench.llama_offload(layout, n_ctx, 1040, reserve)  # not even N = 3: the whole-layer rule, said so
    assert (o.n_gpu_layers, o.n_cpu_moe) == (bench.llama_gpu_layers(layout, n_ctx, 40), None) == (1, None)
    assert o.note.startswith("llama.cpp (MoE, but even with every layer's routed experts on the CPU the rest does "
                             "not fit: whole layers) n_gpu_layers=1 of 3 (+1 = output layer), the most whose")
    o = bench.llama_offload(layout, n_ctx, 1080, reserve, "layers")
    assert (o.n_gpu_layers, o.n_cpu_moe) == (2, None)
    assert "(MoE, --llama-moe-offload layers: whole layers) n_gpu_layers=2" in o.note
    o = bench.llama_offload(layout, n_ctx, 1080, reserve, "all")  # --cpu-moe: every layer's experts on the CPU
    assert (o.n_gpu_layers, o.n_cpu_moe) == (4, 3) and "(--cpu-moe; --llama-moe-offload all)" in o.note
    o = bench.llama_offload(layout, n_ctx, None, 0)  # no budget: everything on the GPU, experts included
    assert (o.n_gpu_layers, o.n_cpu_moe) == (4, 0) and o.note == "llama.cpp n_gpu_layers=4 of 3 (+1 = output layer)"
    dense = bench.GgufLayout(n_layer=3, layer_bytes=[30] * 3, output_bytes=5, kv_bytes_per_token=[1] * 3)
    o = bench.llama_offload(dense, n_ctx, 1080, reserve)  # dense models: as before
    assert (o.n_gpu_layers, o.n_cpu_moe) == (2, None)
    assert o.note == ("llama.cpp n_gpu_layers=2 of 3 (+1 = output layer), the most whose weights + KV fit in "
                      "1.1 KiB less 1000 B for its CUDA context and compute buffers (hotcold's planner keeps the "
                      "same out of the budget)")
    assert bench.llama_offload(dense, n_ctx, None, 0).n_cpu_moe is None


def test_llama_cpu_moe_patterns_match_the_first_layers_routed_experts_only():
    import re

    names = ["blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight",
             "blk.0.ffn_up_exps.bias", "blk.1.ffn_gate_up_exps.weight", "blk.1.ffn_down_chexps.weight",
             "blk.1.ffn_up_shexp.weight", "blk.1.ffn_gate_inp.weight", "blk.1.ffn_up.weight", "blk.1.attn_q.weight",
             "blk.2.ffn_up_exps.weight", "blk.10.ffn_up_exps.weight", "blk.12.ffn_down_exps.weight"]
    pats = bench.llama_cpu_moe_patterns(2)
    assert pats == [r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps", r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"]
    hit = [n for n in names if any(re.search(p, n) for p in pats)]  # llama.cpp: std::regex_search, same syntax
    assert hit == names[:6]
    assert bench.llama_cpu_moe_patterns(0) == []


@pytest.mark.parametrize("device,vram,mode,want", [
    ("cuda", 1080, "experts", (4, 2)),  # every layer on the GPU, experts of layers 0 and 1 on the CPU
    ("cuda", 1080, "layers", (2, None)),  # the whole-layer rule on request
    ("cuda", 1040, "experts", (1, None)),  # not even N = 3 fits: whole layers
    ("cuda", None, "experts", (4, 0)),  # no budget: everything on the GPU
    ("cpu", None, "experts", (0, None)),  # no GPU: as before
])
def test_bench_passes_the_split_to_llama_cpp_and_records_it(tmp_path, monkeypatch, capsys, device, vram, mode, want):
    """bench() on a (fake) GPU machine: the split reaches llama.cpp's spec, settings and notes; children faked."""
    specs = []

    def fake_spawn(spec, workdir, tag, threads, poll_vram, timeout):
        specs.append(spec)
        if spec["kind"] == "probe":
            return {"prompt_ids": [1, 2, 3], "cuda": True, "llama_gpu_offload": True, "gpu_name": "fake"}
        return _run(100, 10, 0.03, 1)

    monkeypatch.setattr(bench, "spawn", fake_spawn)
    monkeypatch.setattr(bench, "read_gguf_layout", lambda path: _moe_layout())
    monkeypatch.setattr(bench, "gpu_reserve_bytes", lambda: 1000)
    args = _args(device=device, vram_bytes=vram, llama_moe_offload=mode, repeats=1, prompt_tokens=1, tokens=1,
                 json=str(tmp_path / "b.json"), markdown=False, timeout=60)  # n_ctx = 1 + 1 + 8 = 10 > 2: KV 30
    paths = bench.ModelPaths(None, Path("m.gguf"), Path("m.gguf"), "m.gguf")
    if device == "cuda" and vram:
        args.vram_bytes += 3 * (10 - 2)  # the hand-made budgets assume n_ctx 2: add the 8 extra tokens' KV
    bench.bench(args, paths, [bench.BenchEngine("llama.cpp", "llama.cpp")])
    (spec,) = [s for s in specs if s["kind"] == "llama.cpp"]
    assert (spec["n_gpu_layers"], spec["n_cpu_moe"]) == want
    rep = json.loads((tmp_path / "b.json").read_text())
    assert rep["settings"]["llama_n_gpu_layers"] == want[0]
    if device == "cuda":
        assert rep["settings"]["llama_n_cpu_moe"] == want[1] and rep["settings"]["llama_moe_offload"] == mode
        assert sum(n.startswith("llama.cpp ") for n in rep["notes"]) == 1
        assert (f"--n-cpu-moe {want[1]}" in " ".join(rep["notes"])) == bool(vram and want[1])
    else:
        assert "llama_n_cpu_moe" not in rep["settings"] and not any(n.startswith("llama.cpp ") for n in rep["notes"])


def _make_gguf(out: Path, preset: str, *args: str) -> Path:
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_model.py"), preset, "--out", str(out),
                           "--format", "gguf", "--quiet", *args], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    return out / "model.gguf"


@pytest.fixture(scope="module")
def tiny_moe_gguf(tmp_path_factory) -> Path:
    """A 3-layer qwen3moe GGUF (8 experts of 64 a layer, f16): blk.N.ffn_{gate,up,down}_exps.weight."""
    return _make_gguf(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", "tiny-qwen3-moe", "--layers", "3")


@pytest.mark.slow
def test_read_gguf_layout_of_a_moe_gguf(tiny_moe_gguf):
    import gguf

    layout = bench.read_gguf_layout(tiny_moe_gguf)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(tiny_moe_gguf)).tensors}
    assert layout.n_layer == 3 and layout.moe
    for i in range(3):
        exps = [sizes[f"blk.{i}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")]
        assert layout.expert_bytes[i] == sum(exps) == 3 * 8 * 64 * 64 * 2
        assert layout.layer_bytes[i] == sum(v for k, v in sizes.items() if k.startswith(f"blk.{i}."))
    assert bench.llama_cpu_moe_layers(layout, 64, sum(layout.layer_bytes) + layout.output_bytes
                                      + 64 * sum(layout.kv_bytes_per_token) - 1) == 1


def _llama_spec(gguf: Path, **kw) -> dict:
    return {"model": {"gguf": str(gguf)}, "prompt_ids": list(range(1, 17)), "tokens": 8, "threads": 1, "n_ctx": 64,
            "warmup": False, **kw}


@pytest.mark.slow
def test_llama_cpp_with_experts_on_the_cpu_generates_the_same_tokens(tiny_moe_gguf, capsys):
    """On a CPU build the CPU buffer type is the only one, so --n-cpu-moe must not change a greedy token; llama.cpp's
    own log names each overridden tensor, and only the first N layers' experts."""
    import llama_cpp

    default_params = llama_cpp.llama_cpp.llama_model_default_params
    plain = bench.run_llama_cpp(_llama_spec(tiny_moe_gguf))
    assert "overridden_tensors" not in plain and len(plain["token_ids"]) == 8
    capsys.readouterr()
    two = bench.run_llama_cpp(_llama_spec(tiny_moe_gguf, n_cpu_moe=2, verbose=True))
    log = capsys.readouterr().err
    assert two["token_ids"] == plain["token_ids"]
    assert (two["n_cpu_moe"], two["overridden_tensors"]) == (2, 6)
    overridden = re.findall(r"tensor (\S+) \(.*\) buffer type overridden to CPU", log)
    assert sorted(overridden) == sorted(f"blk.{i}.ffn_{k}_exps.weight" for i in (0, 1) for k in ("gate", "up", "down"))
    every = bench.run_llama_cpp(_llama_spec(tiny_moe_gguf, n_cpu_moe=3))
    assert every["token_ids"] == plain["token_ids"] and every["overridden_tensors"] == 9
    assert llama_cpp.llama_cpp.llama_model_default_params is default_params  # put back after loading


@pytest.mark.slow
def test_llama_cpp_expert_overrides_fail_loudly(tiny_moe_gguf, smollm2_path, monkeypatch):
    import types

    import llama_cpp

    with pytest.raises(RuntimeError, match="put no tensor on the CPU for --n-cpu-moe 2"):  # a dense model
        bench.run_llama_cpp(_llama_spec(smollm2_path, n_cpu_moe=2, tokens=2))
    real, default_params = llama_cpp.llama_cpp, llama_cpp.llama_cpp.llama_model_default_params

    class Bypass:  # a llama-cpp-python whose Llama would not build its params through the module attribute
        def __getattr__(self, name):
            return default_params if name == "llama_model_default_params" else getattr(real, name)

    with monkeypatch.context() as m:
        m.setattr(llama_cpp.llama, "llama_cpp", Bypass())
        with pytest.raises(RuntimeError, match="did not build its model params"):
            bench.run_llama_cpp(_llama_spec(tiny_moe_gguf, n_cpu_moe=1, tokens=2))
    with monkeypatch.context() as m:
        m.setattr(real, "_lib", types.SimpleNamespace())  # a build without the symbol
        with pytest.raises(RuntimeError, match="ggml_backend_cpu_buffer_type not found"):
            bench.run_llama_cpp(_llama_spec(tiny_moe_gguf, n_cpu_moe=1, tokens=2))
    assert real.llama_model_default_params is default_params


# -- inputs and argument checks -------------------------------------------------------------


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + b"\0" * 12)
    return path


def test_resolve_model_layouts(tmp_path):
    d = tmp_path / "m"
    (d / "hf").mkdir(parents=True)
    (d / "hf" / "config.json").write_text("{}")
    g = _fake_gguf(d / "model.gguf")
    for arg in (d, d / "hf"):  # the make_model folder, or its hf/ folder
        p = bench.resolve_model(str(arg), None)
        assert (p.hf, p.gguf, p.hotcold) == (d / "hf", g, d / "hf")
    other = _fake_gguf(tmp_path / "other.gguf")
    assert bench.resolve_model(str(d), str(other)).gguf == other
    p = bench.resolve_model(str(g), None)
    assert (p.hf, p.gguf, p.hotcold) == (None, g, g)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert bench.resolve_model(str(bare), None).gguf is None


@pytest.mark.parametrize("case", ["missing", "empty_dir", "not_gguf", "gguf_missing", "gguf_not_gguf"])
def test_resolve_model_errors_are_one_line(tmp_path, case):
    model, gguf = str(tmp_path / "nope"), None
    if case == "empty_dir":
        model = str(tmp_path)
    elif case == "not_gguf":
        (tmp_path / "x.gguf").write_text("hello")
        model = str(tmp_path / "x.gguf")
    elif case.startswith("gguf"):
        model = str(_fake_gguf(tmp_path / "m.gguf"))
        gguf = str(tmp_path / "none.gguf")
        if case == "gguf_not_gguf":
            (tmp_path / "none.gguf").write_text("text")
    with pytest.raises(bench.BenchError) as e:
        bench.resolve_model(model, gguf)
    assert "\n" not in str(e.value) and ("MODEL" in str(e.value) or "--gguf" in str(e.value))


def test_engines_and_variants():
    eng = bench.parse_engines("hotcold,llama.cpp", ["hotcold-bf16=--dtype bfloat16"], "", "cpu", None)
    assert [(e.name, e.kind, e.args) for e in eng] == [
        ("hotcold", "hotcold", []), ("hotcold-bf16", "hotcold", ["--dtype", "bfloat16"]),
        ("llama.cpp", "llama.cpp", [])]
    eng = bench.parse_engines("llama.cpp,v,hotcold", ["v=--dtype float16"], "--device cpu", "cpu", None)
    assert [e.name for e in eng] == ["llama.cpp", "v", "hotcold"]
    assert eng[1].args == ["--device", "cpu", "--dtype", "float16"]
    ns = bench.hotcold_options(eng[1].args, "cuda", "float32")
    assert (ns.device, ns.dtype) == ("cpu", "float16")
    ns = bench.hotcold_options(["--env", "HOTCOLD_LAYER_GRAPHS=0", "--env", "X_Y=a=b"], "cpu", None)
    assert ns.env == {"HOTCOLD_LAYER_GRAPHS": "0", "X_Y": "a=b"}


def test_a_variants_env_reaches_its_process_only(tmp_path, monkeypatch):
    """--variant "NAME=--env K=V": spawn gives the row's child process K=V, and no other engine's."""
    real = subprocess.Popen

    def child(cmd, **kw):  # the child writes what it sees instead of running an engine
        spec = json.loads(Path(cmd[-1]).read_text())
        code = f"import json, os; json.dump({{'foo': os.environ.get('FOO')}}, open({spec['result']!r}, 'w'))"
        return real([sys.executable, "-c", code], **kw)

    monkeypatch.setattr(bench.subprocess, "Popen", child)
    monkeypatch.delenv("FOO", raising=False)
    spec = {"kind": "hotcold", "args": ["--env", "FOO=bar"], "device": "cpu", "dtype": None}
    assert bench.spawn(spec, tmp_path, "v", 1, False, 60)["foo"] == "bar"
    assert bench.spawn(dict(spec, kind="llama.cpp"), tmp_path, "l", 1, False, 60)["foo"] is None


@pytest.mark.parametrize("engines,variants,message", [
    ("hotcold,vllm", [], "unknown engine 'vllm'"),
    ("", [], "--engines: empty"),
    ("hotcold,hotcold", [], "twice"),
    ("hotcold", ["nameonly"], "NAME=ARGS"),
    ("hotcold", ["llama.cpp=--dtype float16"], "taken"),
    ("hotcold", ["x=--frobnicate 3"], "unknown '--frobnicate 3'"),
    ("hotcold", ["x=--env NOEQUALS"], "is not NAME=VALUE"),
])
def test_engine_errors(engines, variants, message):
    with pytest.raises(bench.BenchError, match=message):
        bench.parse_engines(engines, variants, "", "cpu", None)


@pytest.mark.parametrize("argv,message", [
    (["/no/such/model"], "error: MODEL: /no/such/model: no such file or folder"),
    (["{gguf}", "--vram", "8 gigs", "--device", "cuda"], "error: --vram: cannot read size '8 gigs'"),
    (["{gguf}", "--vram", "8GiB", "--device", "cpu"], "error: --vram is a GPU budget"),
    (["{gguf}", "--tokens", "1"], "error: --tokens: must be at least 2"),
    (["{gguf}", "--threads", "0"], "error: --threads: must be at least 1"),
    (["{gguf}", "--engines", "hotcold,foo"], "error: --engines: unknown engine 'foo'"),
    (["{gguf}", "--e2e", "tiny"], "error: give MODEL or --e2e PRESET, not both"),
    (["{gguf}", "--json", "/no/such/dir/out.json"], "error: --json: folder /no/such/dir does not exist"),
])
def test_main_rejects_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    g = str(_fake_gguf(tmp_path / "m.gguf"))
    assert bench.main([a.replace("{gguf}", g) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


def test_default_model_is_smollm2(smollm2_path, monkeypatch):
    assert bench.default_model() == smollm2_path
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(bench.BenchError, match="give MODEL or --e2e PRESET"):
        bench.default_model()


def test_llama_cpp_without_a_gguf_is_an_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert bench.main([str(tmp_path), "--engines", "hotcold,llama.cpp"]) == 2
    assert "llama.cpp reads a GGUF: pass --gguf" in capsys.readouterr().err


def test_child_env_pins_threads_and_forbids_downloads():
    env = bench.child_env(3)
    assert env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_vram_poller_is_inert_without_a_gpu():
    if bench.VramPoller.sample() is not None:
        pytest.skip("a GPU tool is present")
    p = bench.VramPoller(12345, None)
    p.start()
    assert p.stop() == (None, None)


def test_vram_poller_peaks_by_pid_else_device_delta(monkeypatch):
    samples = iter([({7: 100, 9: 5}, 1100), ({7: 300}, 1300), ({7: 200}, 1200)] + [({}, 1000)] * 10**4)
    monkeypatch.setattr(bench.VramPoller, "sample", staticmethod(lambda: next(samples)))
    p = bench.VramPoller(7, baseline=1000)
    p.interval = 0.001
    p.start()
    deadline = time.monotonic() + 10
    while (p.peak_pid or 0) < 300 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.stop() == (300, "process (NVML/nvidia-smi)")
    samples = iter([({1: 100}, 1500), ({1: 100}, 1900)] + [({}, 1000)] * 10**4)  # our pid hidden (container)
    p = bench.VramPoller(7, baseline=1000)
    p.interval = 0.001
    p.start()
    deadline = time.monotonic() + 10
    while (p.peak_device or 0) < 900 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.stop() == (900, "device in use minus baseline")


def fake_make_model(tmp_path: Path, monkeypatch, hf: bool = True) -> None:
    """bench.REPO pointed at a repo whose tools/make_model.py writes an empty model pair and records
    its arguments in hf/config.json (hf=False: model.gguf alone, as --format gguf)."""
    fake = tmp_path / "repo"
    (fake / "tools").mkdir(parents=True)
    (fake / "tools" / "make_model.py").write_text(
        "import json, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        + ("(out / 'hf').mkdir(parents=True)\n"
           "(out / 'hf' / 'config.json').write_text(json.dumps(sys.argv[1:]))\n" if hf else "out.mkdir(parents=True)\n")
        + "(out / 'model.gguf').write_bytes(b'GGUF' + bytes(12))\n")
    monkeypatch.setattr(bench, "REPO", fake)


def test_e2e_makes_the_model_with_pass_through_args_and_skips_missing_commands(tmp_path, monkeypatch):
    fake_make_model(tmp_path, monkeypatch)
    monkeypatch.setattr(bench, "hotcold_has", lambda command: False)
    out = tmp_path / "model"
    args = argparse.Namespace(e2e="tiny-llama", out=str(out), make_args="--layers 2 --seed 7", regenerate=False,
                              threads=1, vram="8GiB", profile_args="", plan_args="")
    paths, notes, settings = bench.e2e(args)
    assert json.loads((out / "hf" / "config.json").read_text()) == [
        "tiny-llama", "--out", str(out.resolve()), "--layers", "2", "--seed", "7"]
    assert (paths.hf, paths.gguf) == (out.resolve() / "hf", out.resolve() / "model.gguf")
    assert any("no 'profile' command" in n for n in notes) and any("no 'plan' command" in n for n in notes)
    assert settings["e2e"] == "tiny-llama" and "make_model_s" in settings
    (out / "hf" / "config.json").write_text("{}")  # a second run reuses the model
    _, notes, settings = bench.e2e(args)
    assert any("reused the model" in n for n in notes) and "make_model_s" not in settings


def test_e2e_builds_llama_cpp_in_the_background_and_puts_it_on_the_path(tmp_path, monkeypatch):
    """--llama-cpp-src: the source package is built with pip while the model is made, installed into
    DIR/llama-cpp/site before `plan` (which probes the machine), and importable by this process and
    its children. A stand-in package replaces llama.cpp's (the mechanism, not CUDA, is tested here)."""
    src = tmp_path / "llama_cpp_python-0.0.1"
    (src / "llama_cpp_standin").mkdir(parents=True)
    (src / "llama_cpp_standin" / "__init__.py").write_text("BUILT = True\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "llama_cpp_python"\nversion = "0.0.1"\n'
        '[tool.setuptools]\npackages = ["llama_cpp_standin"]\n')
    fake_make_model(tmp_path, monkeypatch)
    order = []
    monkeypatch.setattr(bench, "hotcold_has", lambda command: order.append(
        (command, (tmp_path / "model" / "llama-cpp" / "site" / "llama_cpp_standin").is_dir())) and False)
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = argparse.Namespace(e2e="tiny-llama", out=str(tmp_path / "model"), make_args="", regenerate=False, threads=1,
                              vram="8GiB", profile_args="", plan_args="", llama_cpp_src=str(src))
    _, _, settings = bench.e2e(args)
    assert order == [("profile", False), ("plan", True)]  # built and installed before plan, not before profile
    assert settings["llama_cpp_build_s"] > 0
    child = subprocess.run([sys.executable, "-c", "import llama_cpp_standin; print(llama_cpp_standin.BUILT)"],
                           capture_output=True, text=True, env=dict(os.environ))
    assert child.stdout.strip() == "True", child.stderr
    with pytest.raises(bench.BenchError, match="no such file"):
        bench.e2e(argparse.Namespace(**{**vars(args), "llama_cpp_src": str(tmp_path / "missing.tar.gz")}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pyproject.toml").write_text("this is not toml [")
    with pytest.raises(bench.BenchError, match="building llama-cpp-python failed"):
        bench.e2e(argparse.Namespace(**{**vars(args), "llama_cpp_src": str(broken), "out": str(tmp_path / "m2")}))


# -- real engines ----------------------------------------------------------------------------


def _bench_cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "bench.py"), *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_hotcold_against_llama_cpp_on_smollm2(smollm2_path, tmp_path):
    out = tmp_path / "bench.json"
    r = _bench_cli(smollm2_path, "--engines", "hotcold,llama.cpp", "--prompt-tokens", "16", "--tokens", "8",
                   "--repeats", "1", "--threads", "2", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["reference"] == "llama.cpp" and len(rep["prompt_ids"]) == 16
    assert rep["machine"]["threads"] == 2 and rep["machine"]["versions"]["llama-cpp-python"]
    assert rep["machine"]["cpu"] and rep["date"] and "tools/bench.py" in rep["command"]
    for name in ("hotcold", "llama.cpp"):
        e = rep["engines"][name]
        assert e["status"] == "ok", e
        (run,) = e["runs"]
        assert run["completion_tokens"] == 8 and len(run["token_ids"]) == 8
        assert run["prompt_tokens"] == 16 and run["prompt_ids_sha"] == rep["prompt_ids_sha"]
        for m in ("load_s", "prefill_tok_per_s", "decode_tok_per_s", "ttft_s"):
            assert 0 < run[m] < 1e6, (name, m, run[m])
        assert 50 << 20 < run["peak_ram_bytes"] < 8 << 30
        assert run.get("peak_vram_bytes") is None  # CPU run
    assert 0 < rep["engines"]["hotcold"]["ratio"]["decode_tok_per_s"] < 100
    assert rep["engines"]["hotcold"]["agreement_with_reference"] >= 1  # same prompt -> same first greedy token
    assert rep["notes"] == [n for n in rep["notes"] if "not 8" not in n and "different prompt" not in n]
    assert "hotcold" in r.stdout and "llama.cpp" in r.stdout and "decode tok/s" in r.stdout


@pytest.mark.slow
def test_a_failing_engine_is_reported_not_fatal(smollm2_path, tmp_path):
    """A hotcold variant that cannot run (a device that is not there) fails its row; the others still run."""
    out = tmp_path / "bench.json"
    r = _bench_cli(smollm2_path, "--engines", "llama.cpp", "--variant", "broken=--device cuda:99",
                   "--prompt-tokens", "4", "--tokens", "2", "--repeats", "2", "--threads", "1", "--json", out,
                   "--no-warmup")
    assert r.returncode == 1, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["engines"]["llama.cpp"]["status"] == "ok" and len(rep["engines"]["llama.cpp"]["runs"]) == 2
    broken = rep["engines"]["broken"]
    assert broken["status"] == "failed" and len(broken["runs"]) == 1  # not repeated after a first failure
    assert "cuda" in broken["note"].lower()
    assert "broken" in r.stdout


@pytest.mark.slow
def test_three_engines_on_a_make_model_pair(tmp_path):
    """hotcold and transformers read DIR/hf, llama.cpp DIR/model.gguf; runs alternate."""
    d = tmp_path / "tiny"
    made = subprocess.run([sys.executable, str(REPO / "tools" / "make_model.py"), "tiny-llama", "--out", str(d),
                           "--quiet"], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "bench.json"
    r = _bench_cli(d, "--prompt-tokens", "8", "--tokens", "4", "--repeats", "2", "--threads", "1",
                   "--no-warmup", "--json", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["settings"]["hf"] == str(d / "hf") and rep["settings"]["gguf"] == str(d / "model.gguf")
    assert list(rep["engines"]) == ["hotcold", "llama.cpp", "transformers"]
    for i, e in enumerate(rep["engines"].values()):
        assert e["status"] == "ok" and [run["seq"] for run in e["runs"]] == [i + 1, i + 4]
        assert all(run["completion_tokens"] == 4 and run["prompt_ids_sha"] == rep["prompt_ids_sha"]
                   for run in e["runs"])
        assert e["summary"]["decode_tok_per_s"]["n"] == 2
    # hotcold and transformers compute the same ReLU model from the same safetensors
    hc, tf = (rep["engines"][n]["runs"][0]["token_ids"] for n in ("hotcold", "transformers"))
    assert hc == tf


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(_has_cuda(), reason="checks the message of a machine without CUDA")
def test_device_cuda_without_a_gpu_stops_in_one_line(smollm2_path):
    r = _bench_cli(smollm2_path, "--device", "cuda", "--engines", "hotcold", "--prompt-tokens", "4", "--tokens", "2",
                   "--repeats", "1", "--threads", "1", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: --device cuda: torch sees no CUDA GPU here; use --device cpu"


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_cuda_budget_run(smollm2_path, tmp_path):
    """On a GPU: every engine under a VRAM budget; llama.cpp's layers computed from the GGUF."""
    out = tmp_path / "bench.json"
    # 800 MiB: llama.cpp keeps 768 MiB (the planner's workspace + CUDA context) out, so part of the 85 MB fits
    r = _bench_cli(smollm2_path, "--engines", "hotcold,llama.cpp,transformers", "--device", "cuda", "--vram",
                   "800MiB", "--prompt-tokens", "16", "--tokens", "8", "--repeats", "1", "--json", out)
    if "no GPU offload" in r.stderr:
        pytest.skip("llama-cpp-python here is a CPU build")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert 0 < rep["settings"]["llama_n_gpu_layers"] < 30
    for e in rep["engines"].values():
        assert e["status"] == "ok" and e["runs"][0]["completion_tokens"] == 8
        assert e["runs"][0]["peak_vram_bytes"] > 0


@pytest.mark.slow
def test_decode_timeline_reports_the_host_calls_of_a_moe_decode(tmp_path):
    """tools/decode_timeline.py on a Q4_0 MoE GGUF (CPU tier): per-call rows for the MoE layers,
    their CPU jobs and the expert kernel, and one token's timeline, whose calls lie inside it."""
    gguf = _make_gguf(tmp_path / "q4moe", "tiny-qwen3-moe", "--layers", "2", "--dtype", "q4_0")
    run = subprocess.run([sys.executable, str(REPO / "tools" / "decode_timeline.py"), str(gguf), "--device", "cpu",
                          "--threads", "2", "--tokens", "4", "--fraction", "0.25"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()[2:] if line and not line.startswith(" ")
            and not line.startswith("timeline")}
    assert float(rows["moe.forward"][0]) == 2.0  # two MoE layers a token
    assert float(rows["job.run"][0]) == 2.0 and 0 < float(rows["qexperts"][0]) <= 2.0
    timeline = run.stdout.split("timeline of token 2 (")[1]
    span = float(timeline.split(" µs)")[0])
    marks = [line.split() for line in timeline.splitlines()[1:] if line.strip()]
    assert [m[3] for m in marks].count("moe.forward") == 2
    assert all(0 <= float(m[0]) <= float(m[2]) for m in marks) and all(float(m[0]) < span for m in marks)
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "decode_timeline.py"), str(tmp_path / "none.gguf"),
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "no such file" in bad.stderr


@pytest.mark.slow
def test_decode_timeline_reports_host_blocks_of_a_dense_decode(tmp_path):
    """tools/decode_timeline.py on a dense llama GGUF with both layers' attention on the CPU (CPU tier,
    no predictors): each layer's one-token step is a HostBlock, its host share one compiled call
    inside it (LayerHostNode), one step a token."""
    gguf = _make_gguf(tmp_path / "llama", "tiny-llama", "--layers", "2")
    run = subprocess.run([sys.executable, str(REPO / "tools" / "decode_timeline.py"), str(gguf), "--device", "cpu",
                          "--threads", "2", "--tokens", "4", "--fraction", "0.25", "--attention-cpu", "0,1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()[2:] if line and not line.startswith(" ")
            and not line.startswith("timeline")}
    assert float(rows["step"][0]) == 1.0 and float(rows["host.block"][0]) == 2.0 and float(rows["host.node"][0]) == 2.0
    assert "host.half" not in rows  # (the module path's)
    assert float(rows["host.node"][2]) <= float(rows["host.block"][2]) <= float(rows["step"][2])  # µs per token, nested
    assert "timeline of token 2 (" in run.stdout
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "decode_timeline.py"), str(gguf), "--device", "cpu",
                          "--attention-cpu", "0,7"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "outside 0..1" in bad.stderr


def test_moe_cpu_bench_times_calls_after_idle_gaps():
    """tools/bench_moe_cpu.py --gap-us: one row per gap, each a positive time and rate over the k experts'
    bytes (4 experts of [256 x 64] Q4_0: tiny, so the test is quick)."""
    run = subprocess.run([sys.executable, str(REPO / "tools" / "bench_moe_cpu.py"), "--experts", "4", "--k", "2",
                          "--hidden", "256", "--inter", "64", "--iters", "3", "--threads", "2", "--gap-us", "0,50"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("|") and "--" not in line][1:]
    assert [float(r[0]) for r in rows] == [0.0, 50.0]
    assert all(float(r[1]) > 0 and float(r[3]) > 0 for r in rows)
    assert "2 of 4 experts per call (0.06 MB)" in run.stdout  # 2 x 3 x 64 x 256 weights at 18 bytes per 32


def test_e2e_gguf_only_profiles_and_plans_the_gguf(tmp_path, monkeypatch):
    """--make-args="--format gguf": the model folder holds model.gguf alone (a full-depth MoE's two
    forms do not fit one disk); profile and plan read it, every engine is given it, and a second
    run reuses it."""
    fake_make_model(tmp_path, monkeypatch, hf=False)
    monkeypatch.setattr(bench, "hotcold_has", lambda command: True)
    steps, make = [], bench.run_step
    monkeypatch.setattr(bench, "run_step",
                        lambda cmd, threads: make(cmd, threads) if cmd[1].endswith("make_model.py") else steps.append(cmd))
    out = tmp_path / "model"
    args = argparse.Namespace(e2e="qwen3-30b-a3b", out=str(out), make_args="--format gguf --dtype q4_0",
                              regenerate=False, threads=1, vram="8GiB", profile_args="", plan_args="")
    paths, notes, settings = bench.e2e(args)
    gguf = out.resolve() / "model.gguf"
    assert (paths.hf, paths.gguf, paths.hotcold) == (None, gguf, gguf)
    assert [c[3:5] for c in steps] == [["profile", str(gguf)], ["plan", str(gguf)]]
    steps.clear()
    _, notes, settings = bench.e2e(args)
    assert any("reused the model" in n for n in notes) and "make_model_s" not in settings
    assert bench._make_format("--layers 8 --format=gguf") == "gguf" and bench._make_format("--layers 8") is None


def test_trim_llama_sdist_keeps_what_the_build_reads(tmp_path):
    import importlib.util
    import io
    import tarfile

    spec = importlib.util.spec_from_file_location("trim_llama_sdist", Path(bench.REPO) / "tools" / "trim_llama_sdist.py")
    trim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trim)
    src = tmp_path / "llama_cpp_python-9.tar.gz"
    names = ["p/CMakeLists.txt", "p/llama_cpp/llama.py", "p/vendor/llama.cpp/src/llama.cpp",
             "p/vendor/llama.cpp/ggml/src/ggml-cuda/x.cu", "p/vendor/llama.cpp/ggml/src/ggml-cpu/y.c",
             "p/vendor/llama.cpp/models/vocab.gguf", "p/vendor/llama.cpp/ggml/src/ggml-vulkan/z.cpp",
             "p/vendor/llama.cpp/tools/ui/app.js", "p/vendor/llama.cpp/tools/mtmd/m.cpp", "p/.git/HEAD",
             "p/vendor/llama.cpp/testsuite.txt"]
    with tarfile.open(src, "w:gz") as t:
        for n in names:
            info = tarfile.TarInfo(n)
            info.size = len(n)
            t.addfile(info, io.BytesIO(n.encode()))
    out = tmp_path / "trimmed.tar.gz"
    assert trim.main([str(src), str(out)]) == 0
    with tarfile.open(out) as t:
        kept = sorted(t.getnames())
        assert t.extractfile("p/llama_cpp/llama.py").read() == b"p/llama_cpp/llama.py"
    assert kept == sorted(["p/CMakeLists.txt", "p/llama_cpp/llama.py", "p/vendor/llama.cpp/src/llama.cpp",
                           "p/vendor/llama.cpp/ggml/src/ggml-cuda/x.cu", "p/vendor/llama.cpp/ggml/src/ggml-cpu/y.c",
                           "p/vendor/llama.cpp/tools/mtmd/m.cpp", "p/vendor/llama.cpp/testsuite.txt"])
    assert trim.main([str(tmp_path / "missing.tar.gz"), str(out)]) == 2
