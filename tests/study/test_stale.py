"""Heartbeats on the real storages: a trial whose worker elsewhere stopped beating is failed once,
as interrupted with the reason, on SQLite and PostgreSQL (Optuna's heartbeat table; the server is
the one .ci/run starts, AUTOTUNE_TEST_POSTGRES_URL) and on a journal file (the heartbeat kept in the
journal); a live one is left alone."""

from __future__ import annotations

import os
import time
import uuid
import warnings

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.stale import HEARTBEAT_ENV, LOST_ATTR, record_heartbeat, recover_stale_trials
from autotune.study.storage import open_storage

POSTGRES_URL = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")
needs_postgres = pytest.mark.skipif(
    not POSTGRES_URL and not os.environ.get("CI"),
    reason="no PostgreSQL server: .ci/run starts one and sets AUTOTUNE_TEST_POSTGRES_URL",
)


@pytest.mark.parametrize("scheme", ["sqlite", "journal", pytest.param("postgresql", marks=needs_postgres)])
@pytest.mark.slow
def test_a_trial_whose_remote_worker_stopped_beating_is_failed_as_lost(tmp_path, monkeypatch, scheme):
    monkeypatch.setenv(HEARTBEAT_ENV, "1")  # grace: 6 missed beats
    urls = {
        "sqlite": f"sqlite:///{tmp_path}/s.db",
        "journal": f"journal://{tmp_path}/s.log",
        "postgresql": POSTGRES_URL,
    }
    url = urls[scheme]
    assert url, "CI must start PostgreSQL (.ci/postgres.sh) and set AUTOTUNE_TEST_POSTGRES_URL"
    study = optuna.create_study(storage=open_storage(url), study_name=f"stale-{uuid.uuid4().hex[:8]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna: heartbeats are meant for Study.optimize
        dead, live = study.ask(), study.ask()
    for trial, host in ((dead, "node-a"), (live, "node-b")):
        trial.set_user_attr("worker", {"host": host, "pid": 1, "started": time.time(), "slurm_job": "42"})
        record_heartbeat(study, trial.number)
    assert recover_stale_trials(study) == []  # both beat just now
    deadline = time.monotonic() + 7.5
    while time.monotonic() < deadline:  # node-b's worker keeps beating; node-a's is silent
        record_heartbeat(study, live.number)
        time.sleep(0.5)
    assert recover_stale_trials(study) == [dead.number]
    assert recover_stale_trials(study) == []  # failed once
    trials = {t.number: t for t in study.get_trials()}
    assert trials[dead.number].state is TrialState.FAIL
    assert trials[dead.number].user_attrs["status"] == "interrupted"
    assert "node-a, SLURM job 42) sent no heartbeat" in trials[dead.number].user_attrs[LOST_ATTR]
    assert trials[live.number].state is TrialState.RUNNING
