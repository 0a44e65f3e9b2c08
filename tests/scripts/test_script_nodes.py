"""Script mode runs the user's command on one node: a study of a command over several nodes (``--executor
slurm --nodes 2 -- python train.py``) is refused in one line, exit 2, before anything is stored or submitted,
and so is a script trial of a multi-node workload through the API."""

from __future__ import annotations

import sys
from pathlib import Path

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.scripts.runner import run_script_trial

REFUSAL = "--nodes 2: a script trial runs your command on one node only"


@pytest.mark.parametrize("command", [("tune", "--study", "s"), ("find",)], ids=["tune", "find"])
def test_a_study_of_a_command_over_two_nodes_is_refused_before_anything_is_written(tmp_path: Path, command) -> None:
    (tmp_path / "train.py").write_text("print('trained')\n")
    args = [*command, "--model", "builtin:gpt2-tiny", "--nproc", "2", "--executor", "slurm", "--nodes", "2"]
    args += ["--storage", f"journal://{tmp_path}/study.log", "--", sys.executable, "train.py"]
    ran = commands.autotune(*args, cwd=tmp_path)
    assert ran.returncode == 2 and ran.stdout == "", (ran.returncode, ran.stderr)
    assert len(ran.stderr.strip().splitlines()) == 1 and REFUSAL in ran.stderr, ran.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # no study, no worker job's files


def test_a_script_trial_of_a_two_node_workload_is_refused(tmp_path: Path) -> None:
    workload = Workload(model="builtin:gpt2-tiny", seq_len=16, global_batch=4, nproc=2, nodes=2, device="cpu")
    with pytest.raises(ConfigError, match=REFUSAL):
        run_script_trial([sys.executable, "-c", "pass"], workload, TrialConfig(micro_batch=2))
