"""A ratchet on the package's shape (`bench/code_shape.py`): no module over 600 lines, no function over 80.

Today's offenders stay, each held to the size `tests/code_shape_allowed.json` records for it: none may grow past
it, nothing new may go over a limit, and an offender brought under its limit must leave the list, so the list only
shrinks. The sizes are the bench's: a module's lines; a function's from its first decorator to its last line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = Path(__file__).resolve().parent / "code_shape_allowed.json"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_code_shape", ROOT / "bench" / "code_shape.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass looks its module up while it is built
    spec.loader.exec_module(module)
    return module


def _problems(allowed: dict[str, dict[str, int]], now: dict[str, dict[str, int]], limits: dict[str, int]) -> list[str]:
    problems = []
    for kind in ("modules", "functions"):
        limit = limits[kind]
        for name, lines in now[kind].items():
            if name not in allowed[kind]:
                problems.append(
                    f"{name}: {lines} lines, over the limit of {limit}; split it (an offender moved or renamed "
                    "unchanged takes its entry's place under the new name, no larger; nothing new joins the list)"
                )
            elif lines > allowed[kind][name]:
                problems.append(
                    f"{name}: {lines} lines, grown past the {allowed[kind][name]} the list allows; bring it back"
                )
        for name in allowed[kind]:
            if name not in now[kind]:
                problems.append(
                    f"{name}: now within the limit of {limit} (or gone); shrink the allowlist: remove its entry "
                    f"from tests/code_shape_allowed.json"
                )
    return problems


def test_no_module_or_function_grows_over_the_limits() -> None:
    bench = _bench()
    allowed = json.loads(ALLOWED.read_text())
    limits = {"modules": bench.MODULE_LIMIT, "functions": bench.FUNCTION_LIMIT}
    problems = _problems(allowed, bench.offenders(), limits)
    assert not problems, "the code's shape (python bench/code_shape.py):\n" + "\n".join(problems)


def test_the_ratchet_refuses_a_new_offender_growth_and_a_stale_entry() -> None:
    limits = {"modules": 600, "functions": 80}
    allowed = {"modules": {"autotune/a.py": 700}, "functions": {"autotune/a.py::f": 90, "autotune/b.py::g": 85}}
    assert not _problems(allowed, allowed, limits)
    assert not _problems(allowed, {"modules": {"autotune/a.py": 650}, "functions": allowed["functions"]}, limits)
    now = {"modules": {"autotune/a.py": 701, "autotune/c.py": 601}, "functions": {"autotune/a.py::f": 90}}
    problems = _problems(allowed, now, limits)
    assert len(problems) == 3
    assert "autotune/a.py: 701 lines, grown past the 700" in problems[0]
    assert "autotune/c.py: 601 lines, over the limit of 600; split it" in problems[1]
    assert "autotune/b.py::g: now within the limit of 80" in problems[2] and "shrink the allowlist" in problems[2]


def test_sizes_count_decorators_docstrings_and_nested_functions(tmp_path: Path) -> None:
    bench = _bench()
    (tmp_path / "autotune" / "sub").mkdir(parents=True)
    (tmp_path / "autotune" / "sub" / "m.py").write_text(
        "import functools\n"
        "\n"
        "@functools.cache\n"
        "@functools.wraps(print)\n"
        "def f():\n"
        '    """Doc."""\n'
        "    def inner():\n"
        "        return 1\n"
        "    return inner\n"
        "\n"
        "class C:\n"
        "    @property\n"
        "    def p(self):\n"
        "        return 1\n"
        "\n"
        "    @p.setter\n"
        "    def p(self, v):\n"
        "        pass\n"
        "\n"
        "if True:\n"
        "    def g(): return 2\n"
    )
    (tmp_path / "autotune" / "n.py").write_text("x = 1\n")
    sizes = {s.name: s.lines for s in bench.function_sizes(tmp_path)}
    assert sizes == {
        "autotune/sub/m.py::f": 7,
        "autotune/sub/m.py::f.inner": 2,
        "autotune/sub/m.py::C.p": 3,
        "autotune/sub/m.py::C.p#2": 3,
        "autotune/sub/m.py::g": 1,
    }
    assert [(s.name, s.lines) for s in bench.module_sizes(tmp_path)] == [
        ("autotune/sub/m.py", 21),
        ("autotune/n.py", 1),
    ]
