"""`hotcold plan` chooses by its cost model whether a quantised model's 4-bit matrices stay int4 on
the GPU (--gpu-int4) or are expanded to the dtype (--no-gpu-int4); plan.json records the choice."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
from gguf import GGMLQuantizationType as QT

from conftest import smollm2_gguf
from hotcold.planner.hardware import preset
from test_gguf_loader import base_kv, quantize, rnd, write_gguf
from test_planner import TINY, _cli, make_model_folder

H200 = ("--uniform", "--hardware", "h200")


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOTCOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")


def _plan(tmp_path, model, *args) -> dict:
    """plan.json's weights of `hotcold plan model args --json` (in a fresh folder)."""
    out = tmp_path / f"p{len(list(tmp_path.glob('p*')))}"
    r = _cli("plan", model, *args, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    meta = json.loads(r.output)  # --json: nothing but plan.json on stdout
    assert meta == json.loads((out / "plan.json").read_text())
    return meta["weights"]


def _tiny_gguf(tmp_path, qtype) -> str:
    """A 2-layer llama whose matrices are all qtype (the norms float)."""
    D, L, I, V = 64, 2, 128, 64
    shapes = {"attn_q": (D, D), "attn_k": (32, D), "attn_v": (32, D), "attn_output": (D, D),
              "ffn_gate": (I, D), "ffn_up": (I, D), "ffn_down": (D, I)}
    tensors = {"token_embd.weight": (quantize(rnd(V, D), qtype), qtype), "output_norm.weight": rnd(D, seed=1)}
    for l in range(L):
        tensors.update({f"blk.{l}.{n}.weight": (quantize(rnd(*s, seed=l), qtype), qtype) for n, s in shapes.items()})
        tensors.update({f"blk.{l}.attn_norm.weight": rnd(D, seed=2), f"blk.{l}.ffn_norm.weight": rnd(D, seed=3)})
    return write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", "llama", base_kv("llama", D=D, L=L, I=I, vocab_size=V),
                      tensors)


def test_auto_keeps_4bit_int4_where_predicted_faster_and_the_flags_force(tmp_path):
    """SmolLM2 Q4_1 on an H200 with 1 GiB: int4 fits all on the GPU, expanded does not, so auto picks
    int4 and records both predictions; --no-gpu-int4 / --gpu-int4 force a side; --vram 0: expanded."""
    path = smollm2_gguf()
    w = _plan(tmp_path, path, *H200, "--vram", "1GiB")
    c = w["gpu_int4_choice"]
    assert w["gpu_int4"] and w["format"] == "q4_1/bf16+int4"
    assert c["mode"] == "auto" and c["int4_tok_s"] > 1.05 * c["expanded_tok_s"] > 0
    r = _cli("plan", path, *H200, "--vram", "1GiB", "--out", tmp_path / "text")
    assert r.exit_code == 0, r.output
    assert f"GPU weights: int4 (predicted {c['int4_tok_s']:.1f} tok/s; expanded {c['expanded_tok_s']:.1f})" in r.output

    w = _plan(tmp_path, path, *H200, "--vram", "1GiB", "--no-gpu-int4")
    assert not w["gpu_int4"] and w["format"] == "q4_1/bf16"
    assert w["gpu_int4_choice"] == {"mode": "flag", "int4_tok_s": None, "expanded_tok_s": c["expanded_tok_s"]}
    w = _plan(tmp_path, path, *H200, "--vram", "1GiB", "--gpu-int4")
    assert w["gpu_int4"] and w["gpu_int4_choice"] == {"mode": "flag", "int4_tok_s": c["int4_tok_s"],
                                                      "expanded_tok_s": None}
    # no GPU in the plan: nothing to keep int4, one plan
    w = _plan(tmp_path, path, *H200, "--vram", "0")
    assert not w["gpu_int4"] and w["gpu_int4_choice"]["mode"] == "auto"
    assert w["gpu_int4_choice"]["int4_tok_s"] is None and w["gpu_int4_choice"]["expanded_tok_s"] > 0


@pytest.mark.parametrize("qtype, int4", [(QT.Q4_0, True), (QT.Q8_0, False)], ids=["q4_0", "q8_0"])
def test_auto_needs_4bit_matrices(tmp_path, qtype, int4):
    """A Q8_0 model has nothing the int4 kernels hold: auto plans it expanded, once; the same model
    in Q4_0 gets both plans (a tiny model: within 0.5%, int4 holds fewer GPU bytes)."""
    w = _plan(tmp_path, _tiny_gguf(tmp_path, qtype), *H200, "--vram", "1GiB")
    c = w["gpu_int4_choice"]
    assert w["gpu_int4"] == int4 and c["mode"] == "auto" and c["expanded_tok_s"] > 0
    assert (c["int4_tok_s"] is not None) == int4


@pytest.mark.parametrize("kind, int4", [("q4_0", True), ("q8_0", False)])
def test_auto_with_quantize(tmp_path, kind, int4):
    """An HF checkpoint planned for `--quantize`: the same choice as a GGUF of that type."""
    model = make_model_folder(tmp_path, "tiny", dict(TINY["llama_relu"], num_hidden_layers=2, intermediate_size=96))
    w = _plan(tmp_path, model, *H200, "--vram", "1GiB", "--quantize", kind)
    assert w["gpu_int4"] == int4 and w["cpu_kind"] == kind and w["gpu_int4_choice"]["mode"] == "auto"
    assert (w["gpu_int4_choice"]["int4_tok_s"] is not None) == int4


def test_auto_asks_whether_this_machine_runs_the_int4_kernels(tmp_path, monkeypatch):
    """A hardware profile of this host: torch says whether the GPU runs the int4 kernels; one of
    another host cannot be checked, so auto stays expanded there (and says --gpu-int4 plans int4)."""
    import hotcold.sparse_ops.gpu_quant as gq

    path = smollm2_gguf()
    for host, kernels, int4 in ((socket.gethostname(), True, True), (socket.gethostname(), False, False),
                                ("elsewhere", True, False)):
        hw = tmp_path / f"hw-{host}-{kernels}.json"
        hw.write_text(dataclasses.replace(preset("h200"), hostname=host, source="measured").to_json())
        monkeypatch.setattr(gq, "cuda_int4_available", lambda device="cuda", k=kernels: k)
        w = _plan(tmp_path, path, "--uniform", "--hardware", hw, "--vram", "1GiB")
        assert w["gpu_int4"] == int4 and w["gpu_int4_choice"]["mode"] == "auto"
        assert (w["gpu_int4_choice"]["int4_tok_s"] is not None) == int4
    r = _cli("plan", path, "--uniform", "--hardware", hw, "--vram", "1GiB", "--out", tmp_path / "text")
    assert r.exit_code == 0, r.output
    assert "GPU weights: expanded" in r.output and "--gpu-int4 plans int4 for it" in r.output


def test_cuda_int4_available_is_torchs_answer():
    import torch

    from hotcold.sparse_ops.gpu_quant import cuda_int4_available

    expected = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 0)
    assert cuda_int4_available() == expected


def test_a_run_without_a_plan_keeps_4bit_matrices_int4_where_the_gpu_runs_the_kernels(tmp_path, monkeypatch):
    """`run`/`serve` without a plan (dense) on CUDA: a model with Q4_0/Q4_1/Q4_K matrices stays 4-bit
    by default (0.31x bfloat16's VRAM) where the GPU runs torch's int4 kernels; not on the CPU, not
    for Q8_0, not for a float HF folder unless --quantize q4_0|q4_k."""
    import torch

    import hotcold.sparse_ops.gpu_quant as gq
    from hotcold.executors.from_plan import dense_int4_default

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    folder = make_model_folder(tmp_path, "tiny", dict(TINY["llama_relu"], num_hidden_layers=2, intermediate_size=96))
    q8 = _tiny_gguf(tmp_path, QT.Q8_0)
    monkeypatch.setattr(gq, "cuda_int4_available", lambda device="cuda": True)
    assert dense_int4_default(smollm2_gguf(), None, cuda)  # Q4_1
    assert dense_int4_default(_tiny_gguf(tmp_path, QT.Q4_0), None, cuda)
    assert not dense_int4_default(q8, None, cuda)
    assert not dense_int4_default(smollm2_gguf(), None, cpu)
    assert dense_int4_default(folder, "q4_k", cuda) and not dense_int4_default(folder, "q8_0", cuda)
    assert not dense_int4_default(folder, None, cuda)
    monkeypatch.setattr(gq, "cuda_int4_available", lambda device="cuda": False)
    assert not dense_int4_default(smollm2_gguf(), None, cuda)
