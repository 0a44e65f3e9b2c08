"""tune in script mode: each trial runs the user's command; the study keeps the command it answers for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autotune.config.workload import Workload
from autotune.errors import StorageError
from autotune.search.space import load_space
from autotune.search.tuner import tune

LOOP = [sys.executable, str(Path(__file__).parent / "plain_loop.py"), "30"]


def test_a_study_of_a_command_measures_it_and_is_resumed_only_for_that_command(tmp_path):
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 4, 8]\n  precision: [fp32]\n")
    common = dict(study="loop", workload=Workload(seq_len=64, global_batch=8), space=load_space(tmp_path / "space.yaml"),
                  memory_budget_bytes=20 * 2**20, storage=f"sqlite:///{tmp_path}/db.sqlite", measure_steps=2)
    summary = tune(command=LOOP, **common)
    statuses = {t.config.micro_batch: t.status for t in summary.trials if t.number < 3}
    assert statuses[8] == "oom" and statuses[2] == "ok", statuses  # the loop's own allocations, under the budget
    assert summary.best is not None and summary.best.config.micro_batch in (2, 4)
    assert summary.command == LOOP and json.loads(json.dumps(summary.to_dict()))["command"] == LOOP
    with pytest.raises(StorageError, match="answers another question \\(command differs"):
        tune(command=[sys.executable, "other.py"], **common)
