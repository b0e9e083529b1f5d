"""tools/bench_kt_kernel.py: its ours-only path on tiny shapes (table, JSON, the numerical check), the
one-line exit when kt-kernel is missing, the child process per thread count, and the stand-in that
hands kt-kernel's LLAMAFILE loader our blocks (kt-kernel itself is not importable here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hotcold_bench_kt_kernel", REPO / "tools" / "bench_kt_kernel.py")
bk = importlib.util.module_from_spec(_spec)
sys.modules["hotcold_bench_kt_kernel"] = bk  # dataclasses look their module up
_spec.loader.exec_module(bk)

TINY = ["--experts", "16", "--hidden", "256", "--inter", "64", "--layers", "3", "--repeats", "2", "--burst", "2",
        "--gap-ms", "0"]
EXPERT_BYTES = 3 * 64 * 256 * 18 // 32  # gate + up + down of one [256 x 64] expert in Q4_0


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("|") and "---" not in line and "engine" not in line]


def test_ours_only_prints_a_checked_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bk.main(["--engines", "ours", "--threads", "2", "--tokens", "1,16", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = table_rows(text)
    assert [(r[0], r[1], r[2]) for r in rows] == [("2", "1", "ours"), ("2", "16", "ours")]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) <= float(r[3]) <= float(r[5])  # median within p10..p90
        assert float(r[8]) < bk.TOLERANCE["ours"] and "FAIL" not in r[8]
        assert r[9] == ""  # no kt-kernel row to compare with
    assert float(rows[0][6]) == pytest.approx(8 * EXPERT_BYTES / 1e6, abs=0.006)  # 8 distinct experts a token
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["settings"]["experts"] == 16 and data["settings"]["kt_kernel"] is None
    assert [(r["tokens"], r["engine"], r["calls"]) for r in data["rows"]] == [(1, "ours", 4), (16, "ours", 4)]
    assert data["rows"][0]["mb_per_call"] == pytest.approx(8 * EXPERT_BYTES / 1e6)
    assert all(r["ok"] and 0 < r["rel_err"] < 0.03 for r in data["rows"])


def test_a_failed_check_is_marked_and_sets_the_exit_status(monkeypatch, capsys):
    monkeypatch.setitem(bk.TOLERANCE, "ours", 1e-9)
    assert bk.main(["--engines", "ours", "--threads", "1", "--tokens", "1", *TINY]) == 3
    text = capsys.readouterr().out
    assert "FAIL" in table_rows(text)[0][8]
    assert "FAILED: ours, 1 tokens: rel err" in text


def test_missing_kt_kernel_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kt_kernel", None)  # import kt_kernel raises ImportError
    assert bk.main(["--threads", "2", *TINY]) == 2  # (default engines: ours and kt)
    cap = capsys.readouterr()
    assert cap.out == ""  # nothing built or measured
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kt-kernel is not importable here") and "--engines ours" in lines[0]
    with pytest.raises(SystemExit):
        bk.main(["--engines", "ours,gpu"])
    with pytest.raises(SystemExit):
        bk.main(["--kt-methods", "AMXINT2"])


def test_several_thread_counts_run_one_child_each(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bk.main(["--engines", "ours", "--threads", "1,2", "--tokens", "1", *TINY, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "all thread counts:" in text
    data = json.loads(out.read_text())
    assert [(r["threads"], r["engine"]) for r in data["rows"]] == [(1, "ours"), (2, "ours")]
    assert [r[0] for r in table_rows(text.split("all thread counts:")[1])] == ["1", "2"]
    assert bk._child_argv(["--threads=8,15", "--json", "a.json", "--tokens", "1"], 8, "b.json") == \
        ["--tokens", "1", "--threads", "8", "--json", "b.json"]


def test_blocks_stand_in_returns_the_gguf_layout_blocks():
    """What LlamafileMoEWrapper.load_weights asks its GGUF loader for, answered from our stacks: the
    raw (not row-interleaved) blocks as a flat uint8 tensor and gguf's type, as kt-kernel's
    GGUFLoader.get_undequanted_tensor_and_ggml_type returns them."""
    import gguf

    args = bk.parse(["--engines", "ours", *TINY])
    layers = bk.build_layers(args)
    blocks = bk._Blocks(layers, "Q4_0")
    for kind, i in (("gate", 0), ("up", 1), ("down", 2)):
        data, qtype = blocks.get_undequanted_tensor_and_ggml_type(f"blk.2.ffn_{kind}_exps.weight")
        assert qtype == gguf.GGMLQuantizationType.Q4_0
        assert str(data.dtype) == "torch.uint8" and data.is_contiguous()
        assert np.array_equal(data.numpy(), layers[2].raw[i].data.reshape(-1))
    assert layers[2].packed[0].interleaved and not layers[2].raw[0].interleaved
    with pytest.raises(KeyError, match="unexpected tensor name"):
        blocks.get_undequanted_tensor_and_ggml_type("blk.0.ffn_gate_inp.weight")


def test_reference_is_the_routed_sum_of_dequantised_experts():
    args = bk.parse(["--engines", "ours", *TINY])
    layer = bk.build_layers(args)[0]
    x, ids, w = bk.make_calls(np.random.default_rng(1), 1, 3, 16, 8, 256)[0]
    ref = bk.reference(layer, x, ids, w, 256, 64)
    gate, up, down = (m.dequantize().astype(np.float64) for m in layer.raw)
    t, j = 2, 5
    e = int(ids[t, j])
    g, u = gate[e * 64:(e + 1) * 64] @ x[t], up[e * 64:(e + 1) * 64] @ x[t]
    y = down[e * 256:(e + 1) * 256] @ (g / (1 + np.exp(-g)) * u)
    others = bk.reference(layer, x[t:t + 1], np.delete(ids[t:t + 1], j, axis=1), np.delete(w[t:t + 1], j, axis=1),
                          256, 64)
    assert np.allclose(ref[t], others[0] + w[t, j] * y, rtol=1e-9, atol=1e-12)


def fake_kt_kernel(monkeypatch) -> list[dict]:
    """A stand-in kt_kernel with 0.6.1's Python surface as this tool uses it (KTMoEWrapper's signature,
    LlamafileMoEWrapper's loader singleton and load_weights, load_weights_from_tensors, moe.forward_task
    over raw pointers, cpu_infer.submit / sync), computing in numpy what kt-kernel computes: it checks the
    tool's glue (arguments, dtypes, layouts, pointers), not kt-kernel. Returns the constructor calls."""
    import ctypes
    import types

    import gguf
    import torch

    made = []

    def at(ptr, ctype, n):
        return np.ctypeslib.as_array((ctype * n).from_address(ptr))

    class CPUInfer:
        def submit(self, task):
            task()

        def sync(self):
            pass

    class Moe:
        def __init__(self, gate, up, down):  # float [E, I, D], [E, I, D], [E, D, I]
            self.w = gate, up, down

        def forward_task(self, bsz, k, ids, weights, x, out, incremental):
            assert incremental is False

            def task():
                gate, up, down = self.w
                T, D = int(at(bsz, ctypes.c_int32, 1)[0]), gate.shape[2]
                e_ids = at(ids, ctypes.c_int64, T * k).reshape(T, k)
                w = at(weights, ctypes.c_float, T * k).reshape(T, k)
                xs = (at(x, ctypes.c_uint16, T * D).astype(np.uint32) << 16).view(np.float32).reshape(T, D)
                y = np.zeros((T, D), np.float32)
                for t in range(T):
                    for j in range(k):
                        g, u = gate[e_ids[t, j]] @ xs[t], up[e_ids[t, j]] @ xs[t]
                        y[t] += w[t, j] * (down[e_ids[t, j]] @ (g / (1 + np.exp(-g)) * u))
                at(out, ctypes.c_uint16, T * D)[:] = torch.from_numpy(y.ravel()).to(torch.bfloat16).view(
                    torch.int16).numpy().view(np.uint16)
            return task

    class Wrapper:
        _gguf_loader_instance = None

        def __init__(self, kw):
            self.kw, self.cpu_infer, self.moe = kw, CPUInfer(), None

        def load_weights(self, physical_to_logical_map_cpu=None):
            E, I, D, n = (self.kw[a] for a in ("num_experts", "moe_intermediate_size", "hidden_size", "layer_idx"))
            mats = []
            for kind, shape in (("gate", (E, I, D)), ("up", (E, I, D)), ("down", (E, D, I))):
                data, qtype = Wrapper._gguf_loader_instance.get_undequanted_tensor_and_ggml_type(
                    f"blk.{n}.ffn_{kind}_exps.weight")
                mats.append(gguf.quants.dequantize(data.numpy(), qtype).reshape(shape))
            self.moe = Moe(*mats)

        def load_weights_from_tensors(self, gate_proj, up_proj, down_proj, physical_to_logical_map_cpu):
            assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (gate_proj, up_proj, down_proj))
            assert physical_to_logical_map_cpu.dtype == torch.int64
            self.moe = Moe(*(t.float().numpy() for t in (gate_proj, up_proj, down_proj)))

    def KTMoEWrapper(layer_idx, num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size,
                     gpu_experts_mask, cpuinfer_threads, threadpool_count, weight_path, chunked_prefill_size,
                     cpu_save=False, max_deferred_experts_per_token=None, method="AMXINT4", numa_nodes=None,
                     mode="inference", num_gpu_experts=0, lora_rank=16, lora_alpha=32.0, max_cache_depth=1,
                     group_size=128, zero_point=True):  # 0.6.1's KTMoEWrapper.__new__
        kw = dict(locals())
        made.append(kw)
        assert Path(weight_path).is_dir()
        return Wrapper(kw)

    kt = types.ModuleType("kt_kernel")
    kt.KTMoEWrapper, kt.__version__, kt.__cpu_variant__ = KTMoEWrapper, "0.6.1", "amx"
    utils = types.ModuleType("kt_kernel.utils")
    llamafile = types.ModuleType("kt_kernel.utils.llamafile")
    llamafile.LlamafileMoEWrapper, llamafile._HAS_LLAMAFILE_SUPPORT = Wrapper, True
    amx = types.ModuleType("kt_kernel.utils.amx")
    amx._HAS_AMXINT4_SUPPORT = amx._HAS_AMXINT8_SUPPORT = True
    kt.utils, utils.llamafile, utils.amx = utils, llamafile, amx
    for name, mod in (("kt_kernel", kt), ("kt_kernel.utils", utils), ("kt_kernel.utils.llamafile", llamafile),
                      ("kt_kernel.utils.amx", amx)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (KTMoEWrapper pins memory: CUDA there)
    return made


def test_kt_half_against_a_stand_in_kt_kernel(tmp_path, monkeypatch, capsys):
    made = fake_kt_kernel(monkeypatch)
    out = tmp_path / "r.json"
    assert bk.main(["--threads", "2", "--tokens", "1,16", "--experts", "16", "--hidden", "256", "--inter", "256",
                    "--layers", "3", "--repeats", "1", "--burst", "1", "--gap-ms", "0",
                    "--kt-dir", str(tmp_path / "kt"), "--json", str(out)]) == 0  # (LLAMAFILE needs the intermediate size a multiple of 256)
    text, best = capsys.readouterr().out.split("ours against the fastest kt-kernel method:")
    rows = table_rows(text)
    engines = ["ours", "kt LLAMAFILE", "kt AMXINT4", "kt AMXINT8"]
    assert [(r[1], r[2]) for r in rows] == [(t, e) for t in ("1", "16") for e in engines]
    # the summary: per token count, ours beside the fastest kt method of the same run, ratio theirs / ours
    summary = [r for r in table_rows(best) if r[1] != "tokens"]
    assert [r[1] for r in summary] == ["1", "16"]
    for s, t in zip(summary, ("1", "16")):
        mine = [r for r in rows if r[1] == t]
        kt = min(mine[1:], key=lambda r: float(r[3]))
        assert s[4] == kt[2] and float(s[3]) == pytest.approx(float(kt[3]), abs=0.51)
        assert float(s[2]) == pytest.approx(float(mine[0][3]), abs=0.51)
        assert float(s[5].rstrip("x")) == pytest.approx(float(kt[3]) / float(mine[0][3]), rel=0.02, abs=0.01)
    for r in rows:
        assert float(r[8]) < 0.03  # the stand-in computes in float: the same function, bfloat16 rounding aside
        assert (r[9] == "") == (r[2] == "ours") and (r[2] == "ours" or float(r[9].rstrip("x")) > 0)
    assert float(rows[1][6]) == float(rows[0][6]) == pytest.approx(8 * 3 * 256 * 256 * 18 / 32 / 1e6, abs=0.006)
    assert float(rows[2][6]) == pytest.approx(8 * (3 * 256 * 256 / 2 + 4 * (2 * 256 + 256)) / 1e6, abs=0.006)
    assert len(made) == 3 * 3  # three layers, three methods
    assert {(m["method"], m["layer_idx"]) for m in made} == {(m, n) for m in bk.KT_METHODS for n in range(3)}
    # (the chunk: the most tokens, rounded up to the AMX methods' M_STEP of 32 rows)
    assert all(m["cpuinfer_threads"] == 2 and m["chunked_prefill_size"] == 32 and m["gpu_experts_mask"] is None
               for m in made)
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["settings"]["kt_kernel"] == "0.6.1"
    assert "forward():" in text  # the public call tried once (here it cannot reach a GPU)
