"""Faults injected through the public custom-model entry point (`--model module:function`), in a
real tuning study: each is recorded with its status and the error's last lines, the study goes on
(or stops cleanly when the workload itself is broken), and no finished trial is lost.
Kill -9 and Ctrl-C of the tuner itself are in test_tuner.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import commands
import optuna
import pytest

from autotune.study.records import ANSWER_ATTR
from autotune.study.storage import open_storage

# tests/factories.py FaultyLM: the micro batch picks the fault (OOM at the largest, since larger
# micro batches than an OOM are never tried).
FAULT_SPACE = """\
n_trials: 7
patience: 7
knobs:
  micro_batch: [1, 2, 4, 8, 16, 32, 64]
  precision: [fp32]
  checkpointing: [false]
"""
EXPECTED = {  # micro batch -> (status, a piece of the recorded error)
    1: ("ok", None),
    2: ("nan", "the training loss is nan"),
    4: ("crashed", "SIGSEGV"),
    8: ("timeout", "--trial-timeout 10"),
    16: ("crashed", "without writing a result"),
    32: ("error", "the model's forward exploded on purpose"),
    64: ("oom", "CPU memory budget exceeded"),
}
COMMON = (
    "--global-batch",
    "64",
    "--seq-len",
    "8",
    "--memory-budget",
    "256MiB",
    "--trial-timeout",
    "10",
    "--no-estimate",
    "--warmup-steps",
    "0",
    "--steps",
    "1",
)


def tune(work: Path, study: str, model: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return commands.autotune("tune", "--study", study, "--model", model, *COMMON, *extra, cwd=work, timeout=600)


def trials(work: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    """The study's measured trials (the confirmed answer's own copy left out)."""
    storage = open_storage(f"sqlite:///{work}/storage/autotune.db")
    return [t for t in optuna.load_study(study_name=study, storage=storage).trials if ANSWER_ATTR not in t.user_attrs]


@pytest.mark.slow
def test_a_study_survives_every_trial_fault_and_keeps_every_trial(tmp_path):
    (tmp_path / "faults.yaml").write_text(FAULT_SPACE)
    proc = tune(tmp_path, "faults", "factories:faulty", "--space", "faults.yaml", "--json")
    assert proc.returncode == 0, proc.stderr  # it went on to the end and confirmed the one healthy config
    result = json.loads(proc.stdout)
    assert result["best"]["config"]["micro_batch"] == 1
    recorded = {t.user_attrs["config"]["micro_batch"]: t for t in trials(tmp_path, "faults")}
    assert sorted(recorded) == sorted(EXPECTED)  # every fault injected once, every trial kept
    for micro_batch, (status, error) in EXPECTED.items():
        trial = recorded[micro_batch]
        assert trial.user_attrs["status"] == status, (micro_batch, trial.user_attrs)
        if error is not None:
            assert error in trial.user_attrs["result"]["error"], (micro_batch, trial.user_attrs["result"]["error"])
    assert recorded[1].value > 0


@pytest.mark.slow
def test_a_factory_that_raises_stops_the_study_cleanly_after_two_trials(tmp_path):
    proc = tune(tmp_path, "broken", "factories:broken", "--space", "quick")
    assert proc.returncode == 1, proc.stderr  # no config fits: not an input error, not a crash
    assert "Traceback" not in proc.stderr
    assert "every trial so far ended in error" in proc.stderr and "the workload itself fails" in proc.stderr
    assert "autotune trial with the same --model shows the whole error" in proc.stderr
    recorded = trials(tmp_path, "broken")
    assert [t.user_attrs["status"] for t in recorded] == ["error", "error"]
    assert all("factory exploded on purpose" in t.user_attrs["result"]["error"] for t in recorded)


@pytest.mark.slow
def test_a_model_module_that_cannot_be_imported_stops_cleanly(tmp_path):
    proc = tune(tmp_path, "unimportable", "broken_module:build", "--space", "quick")
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "a_package_that_is_not_installed" in proc.stderr
    db = tmp_path / "storage" / "autotune.db"
    if proc.returncode == 1:  # ran and stopped: both trials say why
        recorded = trials(tmp_path, "unimportable")
        assert len(recorded) == 2 and {t.user_attrs["status"] for t in recorded} == {"error"}
    else:  # refused before a study was written
        assert not db.exists() or not optuna.get_all_study_names(storage=f"sqlite:///{db}")
