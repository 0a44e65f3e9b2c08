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
ORDER = [
    "",
    "levers",
    "config",
    "models",
    "prepare",
    "trial",
    "scripts",
    "estimate",
    "study",
    "search",
    "output",
    "cli",
]
_TOP = {"cli", "__init__", "__main__"}  # the command line and the public API sit on top of everything
_BASE = {"errors", "sizes", "version"}  # facts every layer uses


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``: an import only a type checker runs makes no
    dependency (a lever's module names ``TrialConfig`` in its annotations, and ``config`` is built from levers)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _imports() -> dict[str, set[str]]:
    """Every autotune module and the autotune modules it imports at run time (at the top or inside functions)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in _run_time_nodes(ast.parse(path.read_text())):
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


# Optuna through its public API: what it offers no public way for lives in autotune/study/optuna_private.py, one
# function per need (docs/design.md). Elsewhere: no private attribute of Optuna's objects (a module's own self._x
# aside), no import of Optuna's private modules or names, no SQL on Optuna's tables. sqlite_reader.py reads those
# tables read-only (show and export without Optuna's start-up): SELECT only.
OPTUNA_PRIVATE = PACKAGE / "study" / "optuna_private.py"
_OPTUNA_READER = PACKAGE / "study" / "sqlite_reader.py"
_PRIVATE_ATTRS = {"_storage", "_trial_id", "_study_id", "_backend", "_get_stale_trial_ids", "_cached_frozen_trial"}
_PRIVATE_ATTRS |= {"scoped_session"}  # RDBStorage's SQLAlchemy session: SQL on Optuna's tables
_OPTUNA_TABLES = r"\b(?:studies|study_\w+|trials|trial_\w+|version_info|alembic_version)\b"
_SQL_WRITE = re.compile(r"\b(?:INSERT|UPDATE|DELETE|REPLACE|CREATE|DROP|ALTER)\b[\s\S]*" + _OPTUNA_TABLES)
_SQL_ANY = re.compile(r"\b(?:SELECT|INSERT|UPDATE|DELETE|REPLACE|CREATE|DROP|ALTER)\b[\s\S]*" + _OPTUNA_TABLES)


def _optuna_private_uses(source: str, *, reads_tables: bool = False) -> list[str]:
    """Where ``source`` reaches into Optuna past its public API: ``line: what``."""
    found = []
    sql = _SQL_WRITE if reads_tables else _SQL_ANY
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRS:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):  # a class's own attribute
                found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in _PRIVATE_ATTRS:  # getattr(study, "_storage")
                found.append(f"{line}: {node.value!r}")
            elif sql.search(node.value):
                found.append(f"{line}: SQL on Optuna's tables")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                parts = module.split(".")
                if parts[0] == "optuna" and (
                    any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names)
                ):
                    found.append(f"{line}: import of {module} {' '.join(names)}".rstrip())
    return found


def test_the_optuna_check_finds_private_uses_and_leaves_the_rest() -> None:
    private = """
storage = study._storage
heartbeat(trial._trial_id)
backend = getattr(storage, "_backend", storage)
from optuna.storages._rdb import models
from optuna.storages import _CachedStorage
import optuna.storages._heartbeat
session = storage.scoped_session()
connection.execute("UPDATE trial_system_attributes SET value_json = 1")
connection.execute("SELECT value_json FROM trial_user_attributes")
"""
    assert len(_optuna_private_uses(private)) == 9, _optuna_private_uses(private)
    assert _optuna_private_uses(private, reads_tables=True)[-1].startswith("9: SQL")  # the UPDATE, not the SELECT
    public = """
self._backend = backend
self._storage = storage
from optuna.storages import RDBStorage, fail_stale_trials
from optuna.trial import TrialState
storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), trial.number)
connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
"""
    assert _optuna_private_uses(public) == []


def test_only_optuna_private_reaches_into_optuna() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OPTUNA_PRIVATE:
            continue
        for use in _optuna_private_uses(path.read_text(), reads_tables=path == _OPTUNA_READER):
            found.append(f"{path.relative_to(ROOT)}:{use}")
    assert not found, (
        "Optuna past its public API outside autotune/study/optuna_private.py (use the public API, or add a "
        "function there saying why none serves):\n" + "\n".join(found)
    )
