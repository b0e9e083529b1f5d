"""Argument mistakes: one line on stderr, exit code 2, found before any model loads.

Most run `hotcold.cli.main` in this process (no model is ever opened: each mistake is caught first);
the truncated-file case opens only a file's header."""

from __future__ import annotations

import pytest

from conftest import run_cli
from hotcold.cli import main


def one_line_error(capsys, *args: str) -> str:
    """The error line `hotcold ARGS` prints; fails unless it is one line, exit code 2, no traceback."""
    with pytest.raises(SystemExit) as done:
        main(list(map(str, args)))
    out = capsys.readouterr()
    assert done.value.code == 2, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("error: ") and "Traceback" not in out.err, out.err
    return lines[0]


@pytest.mark.parametrize("args, needles", [
    (("run", "--max-tokens", "0"), ("--max-tokens", "greater than or equal to 1", "hotcold run --help")),
    (("run", "-n", "0"), ("--max-tokens",)),
    (("run", "--top-p", "2"), ("--top-p", "less than or equal to 1")),
    (("perplexity", "--ctx", "many"), ("--ctx", "integer")),
    (("serve", "--port", "70000"), ("--port",)),
    (("run", "--promt", "hi"), ("No such option: --promt", "--prompt")),
    (("run", "--max-tokens"), ("--max-tokens", "requires an argument")),
    (("rnu",), ("No such command 'rnu'", "Did you mean 'run'")),
    (("plna",), ("Did you mean 'plan'",)),
])
def test_usage_mistakes_are_one_line(capsys, args, needles):
    line = one_line_error(capsys, *args)
    for n in needles:
        assert n in line, line


def test_plan_reports_a_bad_size_first(capsys, tmp_path):
    """A mistyped --vram comes before the missing profile (the model has none under tmp_path) and
    before any measurement of the machine."""
    line = one_line_error(capsys, "plan", "--vram", "12XB", "--profile", tmp_path / "none")
    assert "--vram" in line and "12XB" in line and "profile" not in line.split("12XB")[1]
    assert "--ram" in one_line_error(capsys, "plan", "--vram", "0", "--ram", "lots")
    assert "--hardware" in one_line_error(capsys, "plan", "--vram", "0", "--hardware", tmp_path / "nope.json")


def test_checked_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """Option values are refused before any weights are read: loading is made to fail loudly."""
    from hotcold.executors import from_plan
    from hotcold.models import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    for module in (loader, from_plan):  # from_plan holds its own reference
        monkeypatch.setattr(module, "load_model", no_load)
    assert "--heldout-tokens 256" in one_line_error(capsys, "profile", "--heldout-tokens", "256")
    assert "--json needs --prompt" in one_line_error(capsys, "run", "--json")
    assert "--dtype" in one_line_error(capsys, "run", "-p", "hi", "--dtype", "int3")
    assert "--device" in one_line_error(capsys, "run", "-p", "hi", "--device", "tpu")
    assert "--quantize" in one_line_error(capsys, "run", "-p", "hi", "--quantize", "q9")
    assert "no such file" in one_line_error(capsys, "perplexity", "--data", tmp_path / "missing.txt")
    assert "no such file" in one_line_error(capsys, "run", tmp_path / "missing.gguf", "-p", "hi")
    assert "no such file" in one_line_error(capsys, "profile", tmp_path / "missing.gguf")
    assert "no such file" in one_line_error(capsys, "profile", "--data", tmp_path / "missing.txt")
    (tmp_path / "a-file").write_text("x")
    assert "--out" in one_line_error(capsys, "profile", "--out", tmp_path / "a-file")
    assert "no plan here" in one_line_error(capsys, "run", "-p", "hi", "--plan", tmp_path / "none")


def test_serve_refuses_before_it_starts(capsys, monkeypatch, tmp_path):
    """serve's mistakes are said before it listens or logs anything: one line, not a server's start
    and shutdown log with the error after it."""
    import hotcold.server.command as command

    def no_listen(*a, **k):
        raise AssertionError("the server started before the arguments were checked")

    monkeypatch.setattr(command, "_listen", no_listen)
    assert "no plan here" in one_line_error(capsys, "serve", "--plan", tmp_path / "none")
    assert "--no-plan" in one_line_error(capsys, "serve", "--plan", tmp_path, "--no-plan")
    assert "--quantize" in one_line_error(capsys, "serve", "--quantize", "q9")
    assert "not a GGUF file" in one_line_error(capsys, "serve", _write(tmp_path / "text.gguf", b"hello"))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_truncated_gguf_in_the_users_terms(capsys, gemma3_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(gemma3_path, "rb") as src:
        cut.write_bytes(src.read(100_000))  # inside the header (the tokenizer's vocabulary)
    line = one_line_error(capsys, "run", cut, "-p", "hi")
    assert "cut.gguf: file is truncated or corrupt" in line and "100,000 bytes" in line and "re-download" in line
    assert "numpy" not in line and "buffer" not in line and "offset" not in line
    with open(gemma3_path, "rb") as src:
        cut.write_bytes(src.read(150_000_000))  # past the header, inside the tensor data
    for command in (("run", cut, "-p", "hi"), ("profile", cut), ("plan", cut, "--vram", "0")):
        line = one_line_error(capsys, *command)
        assert "cut.gguf: file is truncated" in line and "bytes of tensor data" in line and "re-download" in line


def test_help_and_version_exit_zero(capsys):
    for args in (["--version"], ["run", "--help"], []):
        with pytest.raises(SystemExit) as done:
            main(args)
        assert done.value.code == 0
    assert "hotcold" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the README's first command

def test_kernel_cache_check_sees_a_cold_and_a_warm_cache(tmp_path, monkeypatch):
    """cached_for_this_machine: False before a cache=True function's first compile, True after it
    (and in a new process, which is what a later run is)."""
    import subprocess
    import sys

    (tmp_path / "kern.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import kern; "
             "from hotcold.executors.kernel_cache import cached_for_this_machine as c; "
             "before = c(kern.twice); kern.twice(3); print(before, c(kern.twice))")
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env)
    assert first.stdout.split() == ["False", "True"], first.stderr
    again = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env)
    assert again.stdout.split() == ["True", "True"], again.stderr


def readme_first_command() -> list[str]:
    """The arguments of the README's first command (after `hotcold`), as README.md gives them."""
    import shlex

    from test_docs import _two_commands

    install_and_run, _ = _two_commands()
    (command,) = [c.strip() for c in install_and_run.split("&&") if c.strip().startswith("hotcold ")]
    return shlex.split(command)[1:]


def with_option(args: list[str], option: str, value: str) -> list[str]:
    """args with option's value replaced (or the option added)."""
    args = list(args)
    if option in args:
        args[args.index(option) + 1] = value
        return args
    return args + [option, value]


@pytest.mark.parametrize("change, needles", [
    (lambda a: with_option(a, "--max-tokens", "0"), ("--max-tokens", "greater than or equal to 1")),
    (lambda a: with_option(a, "--max-tokens", "forty"), ("--max-tokens", "integer")),
    (lambda a: ["rnu", *a[1:]], ("No such command 'rnu'", "Did you mean 'run'")),
    (lambda a: [w.replace("--prompt", "--promt") for w in a], ("No such option: --promt",)),
    (lambda a: with_option(a, "--dtype", "int3"), ("--dtype",)),
], ids=["range", "type", "command", "option", "dtype"])
def test_first_command_mistyped_is_one_line(change, needles):
    """The README's first command with a mistake, run as a user runs it (a new process, `python -m
    hotcold.cli`): one line on stderr naming the mistake, nothing on stdout, exit code 2."""
    args = readme_first_command()
    assert args[0] == "run" and "--max-tokens" in args and "--prompt" in args, args
    done = run_cli(*change(args), timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and not done.stdout, done.stderr
    assert lines[0].startswith("error: ") and all(n in lines[0] for n in needles), lines[0]


@pytest.mark.slow
def test_first_command_says_it_compiles_once_up_front(capsys, monkeypatch):
    """The README's first command (the embedded model, no plan; 3 tokens, on the CPU) with numba's
    cache cold says, before loading or generating anything, that it is compiling the CPU kernels,
    once; with it warm, nothing."""
    from hotcold.executors import kernel_cache

    args = with_option(with_option(readme_first_command(), "--max-tokens", "3"), "--device", "cpu")
    monkeypatch.setattr(kernel_cache, "cold_kernels", lambda: ["block step"])
    with pytest.raises(SystemExit) as done:
        main(args)
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    lines = out.err.strip().splitlines()
    assert lines[0] == f"note: {kernel_cache.COMPILE_NOTE}", out.err  # the first thing said
    assert sum("compil" in line for line in lines) == 1, out.err
    assert "3 generated" in lines[-1] and out.out.strip(), out.err
    monkeypatch.setattr(kernel_cache, "cold_kernels", lambda: [])
    with pytest.raises(SystemExit) as done:
        main(args)
    out = capsys.readouterr()
    assert done.value.code == 0 and "compil" not in out.err, out.err
