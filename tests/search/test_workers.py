"""Many workers on one study: `autotune tune --workers 3` on the local SQLite default, on a
real PostgreSQL server (started by .ci/run; its URL in AUTOTUNE_TEST_POSTGRES_URL), and on one
journal file (Optuna's JournalStorage: a cluster's shared file system without a database server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import commands
import optuna
import psutil
import pytest
from optuna.trial import TrialState
from processes import alive

from autotune.study.records import ANSWER_ATTR
from autotune.study.storage import open_storage

# gpt2-tiny, seq 32, fp32: mb=1 ~15 MiB, mb=4 ~19 MiB, mb=16 ~38 MiB (over a 28 MiB budget: OOM).
# mb=4 runs about 4x faster than mb=1, a gap no contention between three workers on two cores hides.
SPACE = """\
description: three micro batches, one of them too big
n_trials: 3
knobs:
  micro_batch: [1, 4, 16]
  precision: [fp32]
  checkpointing: [false]
"""
ARGS = (
    "--model",
    "builtin:gpt2-tiny",
    "--seq-len",
    "32",
    "--memory-budget",
    "28MiB",
    "--space",
    "space.yaml",
    "--no-estimate",
    "--steps",
    "1",
    "--json",
)
POSTGRES_URL = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")


def start_tune(work: Path, study: str, storage: str | None, workers: int) -> commands.Command:
    (work / "space.yaml").write_text(SPACE)
    extra = ("--storage", storage) if storage else ()
    return commands.start("tune", "--study", study, *ARGS, *extra, "--workers", str(workers), cwd=work)


def tune(work: Path, study: str, storage: str | None, workers: int) -> subprocess.CompletedProcess[str]:
    return start_tune(work, study, storage, workers).finish(600)


def check_each_config_measured_once(storage: str, study: str, proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr
    assert "locked" not in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr
    every = optuna.load_study(study_name=study, storage=open_storage(storage)).trials
    trials = [t for t in every if ANSWER_ATTR not in t.user_attrs]  # measurements; the answer's copy aside
    answers = [t for t in every if ANSWER_ATTR in t.user_attrs]
    best = json.loads(proc.stdout)["best"]
    assert [t.user_attrs["config"] for t in answers] == [best["config"]]  # the one confirmation, once
    configs = [t.user_attrs["config"]["micro_batch"] for t in trials]
    assert sorted(configs) == [1, 4, 16], configs  # each config once, none lost
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}  # nothing left running
    assert {t.user_attrs["status"] for t in trials} == {"ok", "oom"}
    assert len({t.user_attrs["worker"]["pid"] for t in trials}) >= 2  # really shared between workers
    return json.loads(proc.stdout)


def _helpers_children(root: int) -> dict[int, tuple[int, list[str], list[str]]]:
    """The live processes the helper workers under ``root`` started, by pid: each one's helper's pid, the helper's
    command line and its own."""
    found: dict[int, tuple[int, list[str], list[str]]] = {}
    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for helper in descendants:
        try:
            line = helper.cmdline()
            if line[-1:] == ["worker"]:
                found.update(
                    {child.pid: (helper.pid, line, child.cmdline()) for child in helper.children() if alive(child)}
                )
        except psutil.Error:
            continue  # gone meanwhile
    return found


@pytest.mark.slow
def test_three_workers_on_local_sqlite_measure_each_config_once_and_find_the_answer(tmp_path):
    storage = f"sqlite:///{tmp_path}/storage/autotune.db"  # the default storage, under the working directory
    command = start_tune(tmp_path, "three", None, workers=3)
    first_children: dict[int, tuple[list[str], list[str]]] = {}  # by helper: its command line, its first child's
    while command.poll() is None:
        if sys.platform.startswith("linux"):
            for helper, line, child in _helpers_children(command.pid).values():
                first_children.setdefault(helper, (line, child))
        time.sleep(0.1)
    three = check_each_config_measured_once(storage, "three", command.finish(600))
    # The answer on this space and budget, which one worker also found when this test ran one beside.
    assert three["best"]["config"]["micro_batch"] == 4
    if sys.platform.startswith("linux"):
        # Each helper's trial server is a fork of the helper (its own command line), not a new interpreter that
        # would import torch and Transformers again (python -m autotune.trial.server). Its first one: a server
        # closed later (a probe that timed out on a loaded machine) is started again as a new interpreter, as it
        # must be once the helper's storage runs a heartbeat thread, which a fork would not copy.
        assert first_children
        assert {helper: child for helper, (line, child) in first_children.items() if child != line} == {}


@pytest.mark.skipif(
    not POSTGRES_URL and not os.environ.get("CI"),
    reason="no PostgreSQL server: .ci/run starts one and sets AUTOTUNE_TEST_POSTGRES_URL",
)
@pytest.mark.slow
def test_three_workers_on_a_postgresql_server(tmp_path):
    assert POSTGRES_URL, "CI must start PostgreSQL (.ci/postgres.sh) and set AUTOTUNE_TEST_POSTGRES_URL"
    study = f"workers-{uuid.uuid4().hex[:8]}"
    result = check_each_config_measured_once(POSTGRES_URL, study, tune(tmp_path, study, POSTGRES_URL, workers=3))
    assert result["best"]["config"]["micro_batch"] == 4


@pytest.mark.slow
def test_three_workers_on_one_journal_file(tmp_path):
    storage = f"journal://{tmp_path}/shared/study.log"
    result = check_each_config_measured_once(storage, "journal", tune(tmp_path, "journal", storage, workers=3))
    assert result["best"]["config"]["micro_batch"] == 4
    # Every command that reads a study reads it from the journal: studies, show, export.
    reads = (
        ["studies", "--json"],
        ["show", "--study", "journal", "--json"],
        ["export", "--study", "journal", "--format", "json"],
    )
    for command in reads:
        read = commands.autotune(*command, "--storage", storage, cwd=tmp_path, timeout=120)
        assert read.returncode == 0, read.stderr
        assert "mb=4" in read.stdout or '"micro_batch": 4' in read.stdout, read.stdout
    assert not (tmp_path / "storage").exists()  # nothing went to the default SQLite file


MULTI_RANK_SPACE = """\
description: ZeRO-2 and ZeRO-3 on two ranks
n_trials: 2
knobs:
  micro_batch: [2]
  precision: [fp32]
  checkpointing: [false]
  zero_stage: [2, 3]
  offload: [none]
"""


@pytest.mark.slow
def test_two_rank_zero_trials_in_a_study_report_the_largest_rank_peak(tmp_path):
    (tmp_path / "space.yaml").write_text(MULTI_RANK_SPACE)
    proc = commands.autotune(
        "tune",
        "--study",
        "ranks",
        "--model",
        "builtin:gpt2-tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--nproc",
        "2",
        "--memory-budget",
        "1GiB",
        "--space",
        "space.yaml",
        "--no-estimate",
        "--steps",
        "2",
        "--no-confirm",
        "--json",
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    storage = open_storage(f"sqlite:///{tmp_path}/storage/autotune.db")
    trials = optuna.load_study(study_name="ranks", storage=storage).trials
    assert sorted(t.user_attrs["config"]["zero_stage"] for t in trials) == [2, 3]
    for trial in trials:
        result = trial.user_attrs["result"]
        assert trial.user_attrs["status"] == "ok" and result["world_size"] == 2, result
        per_rank = result["peak_memory_per_rank"]
        assert len(per_rank) == 2 and all(p > 0 for p in per_rank)
        assert result["peak_memory_bytes"] == max(per_rank)


def test_each_worker_gets_its_own_slice_of_the_visible_gpus(monkeypatch):
    from types import SimpleNamespace

    from autotune.errors import ConfigError
    from autotune.search.workers import gpu_slices

    gpus = SimpleNamespace(type="cuda", count=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # indices count from the visible GPUs
    assert gpu_slices(2, 2, gpus) == ["4,5", "6,7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_slices(4, 1, gpus) == ["0", "1", "2", "3"]
    assert gpu_slices(1, 2, gpus) == [None]  # one worker: the environment stays as the user set it
    assert gpu_slices(3, 1, SimpleNamespace(type="cpu", count=1)) == [None] * 3
    with pytest.raises(ConfigError, match="--workers 3 x --nproc 2 needs 6 GPUs"):
        gpu_slices(3, 2, gpus)
