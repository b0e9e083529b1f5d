"""The documentation against the code: docs/cli.md against the CLI's own help, every `hotcold ...`
command line in README.md and docs/ against the command tree, relative links against the files, and
the README's test command against .ci/run. Fast: nothing here loads a model."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]


def _cli_docs():
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "tools" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tree():
    """(group, root context): the command tree `hotcold` runs."""
    docs = _cli_docs()
    group = docs.command_tree()
    return group, docs._root_context(group)


# --- docs/cli.md is what --help says ---------------------------------------------------------------

def test_cli_md_is_generated_from_the_cli():
    expected = _cli_docs().render()
    current = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == expected, "docs/cli.md is out of date: run python tools/cli_docs.py"


def test_cli_md_lists_every_command_and_option(tree):
    group, root = tree
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name in group.list_commands(root):
        assert f"## `hotcold {name}`" in text
        for param in group.get_command(root, name).params:
            for opt in list(getattr(param, "opts", [])) + list(getattr(param, "secondary_opts", [])):
                if opt.startswith("-"):
                    assert opt in text, f"hotcold {name} {opt} is missing from docs/cli.md"


# --- every `hotcold ...` line in the docs names a real command and real options ------------------

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`(hotcold [^`]+)`")
_SEPARATORS = {"&&", "||", ";", "|"}


def command_lines(markdown: str) -> list[str]:
    """The `hotcold ...` command lines of a page: in shell code blocks, and in inline code spans."""
    lines = []
    for lang, body in _FENCE.findall(markdown):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        body = re.sub(r"\\\n\s*", " ", body)  # continuation lines
        for line in body.splitlines():
            line = line.strip().removeprefix("$ ")
            if "hotcold " in line:
                lines.append(line)
    lines += _INLINE.findall(markdown)
    return lines


def _commands(line: str) -> list[list[str]]:
    """Each `hotcold` invocation of a shell line, as its words after `hotcold`."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: split on spaces
        words = line.split("#", 1)[0].split()
    found, i = [], 0
    while i < len(words):
        if words[i] == "hotcold" and (i == 0 or words[i - 1] in _SEPARATORS):
            j = i + 1
            while j < len(words) and words[j] not in _SEPARATORS:
                j += 1
            found.append(words[i + 1:j])
            i = j
        else:
            i += 1
    return found


def _names(command) -> set[str]:
    return {o for p in command.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}


def command_errors(markdown: str, group, root) -> list[str]:
    """What in a page's `hotcold ...` lines the CLI would not accept: unknown commands and options."""
    errors = []
    root_opts = _names(group)
    for line in command_lines(markdown):
        for words in _commands(line):
            k = 0
            while k < len(words) and words[k] in root_opts:
                k += 1
            if k == len(words):
                continue
            name = words[k]
            if not re.fullmatch(r"[a-z][a-z-]*", name):  # `hotcold ...`, `hotcold COMMAND`
                continue
            command = group.get_command(root, name)
            if command is None:
                errors.append(f"{line!r}: no command `hotcold {name}`")
                continue
            known = _names(command) | {"--help"}
            for word in words[k + 1:]:
                for piece in word.strip("[]").split("|"):
                    if not re.match(r"--?[A-Za-z]", piece):
                        continue
                    option = piece.split("=", 1)[0]
                    if option not in known:
                        errors.append(f"{line!r}: `hotcold {name}` has no option {option}")
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_exist(page, tree):
    assert command_errors(page.read_text(encoding="utf-8"), *tree) == []


def test_command_check_can_fail(tree):
    page = "```bash\nhotcold run model.gguf --no-such-option 3\nhotcold frobnicate x\n```\n" \
           "and `hotcold plan M [--vram 8GiB] [--solver cbc|highs|--bogus]`"
    errors = command_errors(page, *tree)
    assert len(errors) == 3, errors
    assert command_errors("```bash\nhotcold --debug run m --max-tokens 4 -p hi --gpu-int4\n```", *tree) == []


def test_readme_has_the_workflow_commands(tree):
    group, root = tree
    used = {words[0] for line in command_lines(README.read_text(encoding="utf-8")) for words in _commands(line)
            if words}
    assert {"profile", "plan", "run", "serve"} <= used


# --- links and paths ---------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    body = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(m) for m in re.findall(r"^#+\s+(.*)$", body, re.M)}


def link_errors(page: Path) -> list[str]:
    errors = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            errors.append(f"{page.name}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            errors.append(f"{page.name}: {target}: no such heading")
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert link_errors(page) == []


def test_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nowhere) [d](https://example.com)\n")
    assert len(link_errors(page)) == 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_mentioned_repository_files_exist(page):
    text = page.read_text(encoding="utf-8")
    missing = sorted({p for p in re.findall(r"(?<![\w/.])((?:tools|tests|executors|models|planner|profiler|"
                                            r"predictors|sparse_ops|server|hotcold|docs)/[\w./-]*\w\.(?:py|md))",
                                            text) if not (ROOT / p).exists()})
    assert missing == []


# --- the README's two commands -----------------------------------------------------------------

def _two_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [body.strip() for lang, body in _FENCE.findall(section)]


def test_ci_runs_the_readme_test_command():
    install_and_run, install_and_test = _two_commands()
    assert install_and_test.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert install_and_test in ci.splitlines()


def test_readme_first_command_runs_the_embedded_default(tree):
    install_and_run, _ = _two_commands()
    (words,) = _commands(install_and_run)
    assert words[0] == "run" and words[1].startswith("-"), "no MODEL: the embedded default"
    assert command_errors(f"```bash\n{install_and_run}\n```", *tree) == []


# --- every environment variable the code reads is documented ------------------------------------

def test_every_environment_variable_is_documented():
    documented = set(re.findall(r"`(HOTCOLD_[A-Z0-9_]+)`", (ROOT / "docs" / "configuration.md").read_text()))
    used = set()
    for folder in ("hotcold", "models", "profiler", "planner", "executors", "predictors", "sparse_ops", "server",
                   "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bHOTCOLD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    assert used, "the scan found no variable at all"
    assert sorted(used - documented) == [], "add these to docs/configuration.md"
    assert sorted(documented - used) == [], "docs/configuration.md names variables the code no longer reads"


# --- the README stays a README --------------------------------------------------------------------

def test_readme_is_short_and_has_one_dated_performance_table():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    tables = re.findall(r"((?:^\|.*\|\n)+)", section, re.M)
    assert len(tables) == 1, "one performance table"
    header, _, *rows = tables[0].splitlines()
    for column in ("machine", "model", "budget", "hotcold", "llama.cpp", "ratio", "date"):
        assert column in header
    assert rows and all(re.search(r"\| 20\d\d-\d\d(-\d\d)? ", row) for row in rows), "every row is dated"
    assert all(re.search(r"`-ngl \d+", row) for row in rows), "every row gives llama.cpp's flags"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_notebook(page):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"\bsessions? \d", text, re.I)
    assert "shared/" not in text and "DESIGN.md" not in text
