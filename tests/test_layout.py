"""The package's folders read as the data flow, and imports run one way along it (docs/design.md); the
repository holds no working notes: no path of the machine it was written on, no number of its own issues."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import autotune

PACKAGE = Path(autotune.__file__).parent
# Lowest first: a module may import from its own folder and from any folder before it, never after.
ORDER = ["", "config", "models", "prepare", "trial", "scripts", "estimate", "study", "search", "output", "cli"]
_TOP = {"cli", "__init__", "__main__"}  # the command line and the public API sit on top of everything
_BASE = {"errors", "sizes", "version"}  # facts every layer uses


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every autotune module and the autotune modules it imports (at the top or inside functions)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autotune"):
                # from autotune.trial import result: the submodule; from autotune.trial.result import X: the module
                names = [f"{node.module}.{a.name}" for a in node.names]
                deps |= {n for n in names if n in modules} or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("autotune")}
        graph[name] = deps - {name}
    return graph


def _level(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts or parts[0] in _TOP:
        return ORDER.index("cli")
    if len(parts) == 1 and parts[0] in _BASE:
        return 0
    assert parts[0] in ORDER, (
        f"{module} sits outside the folders docs/design.md names; add its folder to ORDER and to that page"
    )
    return ORDER.index(parts[0])


def test_no_module_imports_a_folder_above_it() -> None:
    upward = [f"{name} -> {dep}" for name, deps in _imports().items() for dep in deps if _level(dep) > _level(name)]
    assert not upward, "imports against the data flow:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = _imports()
    # A package's __init__ importing its own modules is how it re-exports them: not a cycle of code.
    edges = {
        name: {d for d in deps if not (name.endswith("__init__") or d == name.rpartition(".")[0])}
        for name, deps in graph.items()
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(trail[trail.index(dep) :] + [dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_folder_says_what_lives_there() -> None:
    for folder in (PACKAGE / name for name in ORDER if name not in ("", "cli")):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and len(doc) > 40, f"{folder}/__init__.py needs a docstring: what lives here, what it may import"


ROOT = PACKAGE.parent
# An absolute path of a machine (its home, the work tree it ran in), where the repository's own files would be named
# relative to its root. Not after a letter, digit, dot, slash or dash: a URL's path or a relative path is no match.
_MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|home/[\w.-]+)/")
# "issue 30", "issue #30": a number of this project's own tracker, which means nothing to a reader of the files.
# Another project's issue stays (its URL, "PyTorch issue 107667", "pytorch/pytorch issue #12"): the word before names
# the project (capitalised, or owner/name).
_ISSUE = re.compile(r"(?:(\S+)\s+)?\bissue\s?#?\d+\b", re.IGNORECASE)
_NOT_A_PROJECT = {"see", "in", "the", "this", "that", "our", "per", "from", "since", "by", "for", "after", "as", "of"}


def _own_issue(line: str) -> bool:
    for match in _ISSUE.finditer(line):
        before = (match.group(1) or "").strip("(\"'`[")
        names_a_project = "/" in before or (before[:1].isupper() and before.lower() not in _NOT_A_PROJECT)
        if not names_a_project:
            return True
    return False


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: which files are tracked is unknown")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split("\0") if name]


def test_the_patterns_find_working_notes_and_leave_the_rest() -> None:
    assert _MACHINE_PATH.search("PATH=/root/x/.venv/bin:$PATH") and _MACHINE_PATH.search("'/work/a/bench/a.json'")
    assert not _MACHINE_PATH.search("https://example.org/work/x and bench/work/y and ../work/z")
    assert _own_issue("Acceptance (issue 30): an answer in 75 s") and _own_issue("the issue #12 asks")
    assert not _own_issue("maintainers' answers in PyTorch issues 107667 and 109888")
    assert not _own_issue("PyTorch issue 107667, pytorch/pytorch issue #1, github.com/o/r/issues/3")
    assert not _own_issue("the issue's floor, an issue tracker")


def test_no_tracked_file_holds_a_machine_path_or_an_own_issue_number() -> None:
    found = []
    for path in _tracked_files():
        if path == Path(__file__).resolve():  # this file: the patterns' own examples
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):  # binary, or deleted and not yet staged
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if _MACHINE_PATH.search(line) or _own_issue(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:160]}")
    assert not found, (
        "working notes in tracked files (name files relative to the repository root; say what an issue decided "
        "instead of its number):\n" + "\n".join(found)
    )
