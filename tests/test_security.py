"""What a tuner that runs next to users' data must not do: run code it was not told to trust,
unpickle what a database hands it, go through a shell, or leave studies readable by everyone."""

from __future__ import annotations

import ast
import json
import stat
from pathlib import Path

import commands
import pytest

import autotune
from autotune.errors import ConfigError
from autotune.search.presets import load_space
from autotune.study.storage import create_study, open_storage

SOURCE = Path(autotune.__file__).parent


def test_a_new_sqlite_study_is_readable_by_its_owner_only(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path}/studies/autotune.db")
    create_study(storage, "private", {"version": 1})
    database = tmp_path / "studies" / "autotune.db"
    assert stat.S_IMODE(database.stat().st_mode) == 0o600
    assert stat.S_IMODE(database.parent.stat().st_mode) == 0o700


def test_a_search_space_yaml_cannot_construct_python_objects(tmp_path):
    marker = tmp_path / "pwned"
    space = tmp_path / "evil.yaml"
    space.write_text(f'knobs: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(ConfigError, match="evil.yaml"):
        load_space(space)
    assert not marker.exists()


@pytest.mark.slow
def test_model_code_from_a_folder_runs_only_with_trust_remote_code(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    marker = tmp_path / "ran"
    (model / "configuration_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    (model / "config.json").write_text(
        json.dumps(
            {"model_type": "evil", "vocab_size": 64, "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}
        )
    )
    proc = commands.autotune("estimate", "--model", str(model), timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--trust-remote-code" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not marker.exists()


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    found = []
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == name:
                    found.append((path, node))
    return found


def test_subprocesses_start_without_a_shell():
    calls = _calls("Popen") + _calls("run") + _calls("check_output") + _calls("call")
    assert any(path.name == "runner.py" for path, _ in calls)  # the scan sees the trial launcher
    for path, call in calls:
        shell = [k for k in call.keywords if k.arg == "shell"]
        assert not shell or (isinstance(shell[0].value, ast.Constant) and shell[0].value.value is False), path
        if call.args:
            assert not isinstance(call.args[0], (ast.Constant, ast.JoinedStr)), f"{path}: a command string"
    assert not _calls("system") and not _calls("popen")


def test_nothing_is_unpickled():
    for path in SOURCE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "joblib"}, path
        assert not [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr == "load"
            and isinstance(n.value, ast.Name)
            and n.value.id == "torch"
        ], f"{path}: torch.load unpickles"
