"""A worker killed (SIGKILL) the moment its new trial turns RUNNING, before anything else is written: the
next worker on the study fails that trial as lost, and its config is retried."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.stale import LOST_ATTR, recover_stale_trials
from autotune.study.storage import open_storage

# In a process of its own: create the study as tune does, then take a trial through the tuner's own ask,
# with Optuna's ask() wrapped so that the process dies (os._exit: no cleanup, as kill -9) as soon as the
# trial it returns is RUNNING.
CHILD = """
import os, sys
import optuna
from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.search.proposer import Proposer
from autotune.search.presets import load_space
from autotune.search.study_trials import ask
from autotune.search.tuner import question
from autotune.study.storage import create_study, open_storage

url, space_file = sys.argv[1], sys.argv[2]
workload = Workload(model="builtin:gpt2-tiny", seq_len=32)
device = detect_device("cpu")
space = load_space(space_file)
study = create_study(open_storage(url), "killed", question(
    workload=workload, space=space, device=device, memory_budget_bytes=2**30, headroom=0.1))
proposer = Proposer(space, workload, device)
real_ask = optuna.Study.ask

def ask_then_die(self, *args, **kwargs):
    real_ask(self, *args, **kwargs)
    os._exit(9)

optuna.Study.ask = ask_then_die
ask(study, proposer, TrialConfig(micro_batch=2))
"""


@pytest.mark.slow
def test_a_trial_killed_as_it_turns_running_is_failed_as_lost(tmp_path: Path) -> None:
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  precision: [fp32]\n")
    url = f"sqlite:///{tmp_path}/db.sqlite"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, url, str(tmp_path / "space.yaml")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 9, proc.stderr
    study = optuna.load_study(study_name="killed", storage=open_storage(url))
    (trial,) = study.trials
    assert trial.state is TrialState.RUNNING and trial.user_attrs["worker"]["pid"]  # who, from its creation
    assert recover_stale_trials(study) == [trial.number]  # its worker's process is gone
    trial = study.trials[0]
    assert trial.state is TrialState.FAIL and trial.user_attrs["status"] == "interrupted"
    assert "is gone" in trial.user_attrs[LOST_ATTR]
    assert trial.user_attrs["config"]["micro_batch"] == 2  # what a resume retries
