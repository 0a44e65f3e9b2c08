"""The package's folders read as the data flow, and imports run one way along it (docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

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
    assert parts[0] in ORDER, f"{module} sits outside the folders docs/design.md names; add its folder to ORDER (and to that page)"
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
