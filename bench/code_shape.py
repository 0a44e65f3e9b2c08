"""The shape of the package's code: its largest modules and its longest functions, and how many are over the limits.

    python bench/code_shape.py [--top 10]     # the table in results/code_shape.txt

A module's size is its number of lines. A function's (or method's, nested ones too) is the lines of its ``def``
from its first decorator to its last line, docstring included: ``end_lineno - lineno + 1`` of the ``ast`` node, the
first decorator's line standing for ``lineno`` where it has decorators. The limits: no module over
``MODULE_LIMIT`` lines, no function over ``FUNCTION_LIMIT``. ``tests/test_code_shape.py`` holds today's offenders
to their sizes (``tests/code_shape_allowed.json``): none may grow, none may join them, and the list only shrinks.
Paths are relative to the repository root, with ``/`` between folders.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "autotune"
MODULE_LIMIT = 600
FUNCTION_LIMIT = 80


@dataclass(frozen=True)
class Sized:
    """A module (``autotune/x.py``) or a function (``autotune/x.py::Class.method``) and its lines."""

    name: str
    lines: int


def _modules(root: Path) -> list[Path]:
    return sorted((root / PACKAGE).rglob("*.py"))


def module_sizes(root: Path = ROOT) -> list[Sized]:
    """Every module of the package and its lines, largest first (then by path)."""
    sizes = [
        Sized(p.relative_to(root).as_posix(), len(p.read_text(encoding="utf-8").splitlines())) for p in _modules(root)
    ]
    return sorted(sizes, key=lambda s: (-s.lines, s.name))


def _functions(tree: ast.AST, prefix: str) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function below ``tree``, nested ones named ``outer.inner``."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                assert node.end_lineno is not None
                found.append((name, node.end_lineno - first + 1))
            found += _functions(node, f"{name}.")
        else:  # a def inside an if, a try, a with: named as if it were not
            found += _functions(node, prefix)
    return found


def function_sizes(root: Path = ROOT) -> list[Sized]:
    """Every function and method of the package and its lines, longest first (then by name).

    A name defined twice in one scope (a property's setter, a def in each branch of an ``if``) is told apart by
    ``#2``, ``#3`` after it, in the order of the source."""
    sizes = []
    for path in _modules(root):
        module = path.relative_to(root).as_posix()
        seen: dict[str, int] = {}
        for name, lines in _functions(ast.parse(path.read_text(encoding="utf-8")), ""):
            seen[name] = seen.get(name, 0) + 1
            suffix = f"#{seen[name]}" if seen[name] > 1 else ""
            sizes.append(Sized(f"{module}::{name}{suffix}", lines))
    return sorted(sizes, key=lambda s: (-s.lines, s.name))


def offenders(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """What is over the limits today: ``{"modules": {path: lines}, "functions": {path::name: lines}}``."""
    return {
        "modules": {s.name: s.lines for s in module_sizes(root) if s.lines > MODULE_LIMIT},
        "functions": {s.name: s.lines for s in function_sizes(root) if s.lines > FUNCTION_LIMIT},
    }


def report(root: Path = ROOT, top: int = 10) -> str:
    modules, functions = module_sizes(root), function_sizes(root)
    over = offenders(root)
    lines = [f"largest modules of {PACKAGE}/ (lines; limit {MODULE_LIMIT})"]
    lines += [f"{s.lines:>6}  {s.name}" for s in modules[:top]]
    lines += ["", f"longest functions and methods (lines, decorators and docstring included; limit {FUNCTION_LIMIT})"]
    lines += [f"{s.lines:>6}  {s.name}" for s in functions[:top]]
    lines += [
        "",
        f"over the limits: {len(over['modules'])} of {len(modules)} modules over {MODULE_LIMIT} lines, "
        f"{len(over['functions'])} of {len(functions)} functions over {FUNCTION_LIMIT} lines",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of each to list (default 10)")
    print(report(top=parser.parse_args().top))


if __name__ == "__main__":
    main()
