"""Every export format of three stored studies, byte for byte as it was: `autotune export` of each study of
tests/data/golden_studies/ (plain, LoRA over an NF4 base, ZeRO-3 over 2 ranks) in each format against the files of
tests/data/golden_exports/<study>/: what it writes (``<format>.<ext>``, and the DeepSpeed file beside an Accelerate
ZeRO YAML), the lines it says on stderr (``<format>.stderr``), or its refusal (``<format>.error``, exit 2).

Nothing is stripped before comparing: no export holds a timestamp (the study's trial times stay in the study) and
the one path, the DeepSpeed file an Accelerate YAML names, is written as ``-o`` gives it, relative here.

A change that is meant to change an export: ``python tests/output/regen_golden_exports.py``, then read the diff of
tests/data/golden_exports/ before committing it. How the studies were built: that script's docstring."""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from autotune.output.exporters import FORMATS

HERE = Path(__file__).resolve().parent


def _regen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regen_golden_exports", HERE / "regen_golden_exports.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


regen = _regen()


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return regen.copy_studies(tmp_path_factory.mktemp("golden-studies"))


def _golden(name: str, fmt: str) -> dict[str, bytes]:
    folder = regen.EXPORTS / name
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith(f"{fmt}.")}


def _difference(file: str, want: bytes, got: bytes) -> str:
    try:
        lines = difflib.unified_diff(
            want.decode().splitlines(keepends=True),
            got.decode().splitlines(keepends=True),
            f"golden/{file}",
            f"exported/{file}",
        )
        return "".join(lines)
    except UnicodeDecodeError:
        return f"{file}: {len(want)} bytes golden, {len(got)} exported"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", regen.NAMES)
def test_every_export_of_a_stored_study_is_byte_identical(name: str, fmt: str, studies: Path, tmp_path: Path) -> None:
    golden = _golden(name, fmt)
    assert golden, f"no golden export of {name} in {fmt}: python tests/output/regen_golden_exports.py"
    exported = regen.export(name, fmt, tmp_path, studies)
    assert sorted(exported) == sorted(golden), f"{name}, --format {fmt}: other files than the golden ones"
    changed = [_difference(file, golden[file], exported[file]) for file in golden if exported[file] != golden[file]]
    assert not changed, (
        f"{name}, --format {fmt}: the export changed; if it is meant to, run python "
        "tests/output/regen_golden_exports.py and read the diff before committing it\n" + "\n".join(changed)
    )


def test_the_golden_exports_are_each_studys_formats_and_nothing_else() -> None:
    assert sorted(p.name for p in regen.EXPORTS.iterdir()) == sorted(regen.NAMES)
    assert sorted(p.name for p in regen.STUDIES.iterdir()) == sorted(f"{n}.db" for n in regen.NAMES)
    for name in regen.NAMES:
        files = {p.name for p in (regen.EXPORTS / name).iterdir()}
        claimed = {file for fmt in FORMATS for file in files if file.startswith(f"{fmt}.")}
        assert files == claimed, f"{name}: files of no format: {sorted(files - claimed)}"
