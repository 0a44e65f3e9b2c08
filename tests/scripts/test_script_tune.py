"""tune in script mode: each trial runs the user's command; the study keeps the command it answers for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import commands
import optuna
import pytest

from autotune.config.workload import Workload
from autotune.errors import StorageError
from autotune.search.presets import load_space
from autotune.search.tuner import tune
from autotune.study.records import ANSWER_ATTR

LOOP = [sys.executable, str(Path(__file__).parent / "plain_loop.py"), "30"]


@pytest.mark.slow
def test_a_study_of_a_command_measures_it_and_is_resumed_only_for_that_command(tmp_path, capfd):
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 8]\n  precision: [fp32]\n")
    common = dict(
        study="loop",
        workload=Workload(seq_len=64, global_batch=8),
        space=load_space(tmp_path / "space.yaml"),
        memory_budget_bytes=20 * 2**20,
        storage=f"sqlite:///{tmp_path}/db.sqlite",
        measure_steps=2,
    )
    summary = tune(command=LOOP, workers=2, **common)  # two workers share the study (on a CPU, taking turns)
    statuses = {t.config.micro_batch: t.status for t in summary.trials if t.number < 2}
    assert statuses[8] == "oom" and statuses[2] == "ok", statuses  # the loop's own allocations, under the budget
    study = optuna.load_study(study_name="loop", storage=common["storage"])
    assert len([t for t in study.trials if ANSWER_ATTR not in t.user_attrs]) == 2  # each config once
    # The helper joined the same question, command included (which of the two measures what is a race).
    helper = capfd.readouterr().err
    assert "[worker 2] " in helper and "worker 2: error" not in helper, helper
    assert summary.best is not None and summary.best.config.micro_batch == 2
    assert summary.command == LOOP and json.loads(json.dumps(summary.to_dict()))["command"] == LOOP
    with pytest.raises(StorageError, match="answers another question \\(command differs"):
        tune(command=[sys.executable, "other.py"], **common)
    # The answer, exported, trains the loop: it says what it got.
    exported = commands.autotune(
        "export",
        "--study",
        "loop",
        "--storage",
        common["storage"],
        "--format",
        "json",
        "-o",
        "autotune.json",
        cwd=tmp_path,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr
    ran = commands.autotune("run", "--config", "autotune.json", "--", *LOOP[:2], "2", cwd=tmp_path, timeout=300)
    assert "trained with micro_batch=2 grad_accum_steps=4 precision=fp32" in ran.stdout, ran.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, trained",
    [
        ("lightning_script.py", "trained with micro_batch=2 precision=bf16-mixed accumulate_grad_batches=4 steps=3"),
        ("accelerate_script.py", "trained with micro_batch=2 mixed_precision=bf16 gradient_accumulation_steps=4"),
    ],
)
def test_a_framework_script_is_tuned_under_a_budget_and_its_answer_trains_it(tmp_path, script, trained):
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 8]\n  precision: [bf16]\n")
    command = [sys.executable, str(Path(__file__).parent / script)]

    def autotune(*args: str) -> subprocess.CompletedProcess:
        return commands.autotune(*args, cwd=tmp_path, timeout=600)

    # The scripts' own peaks here (bf16): Lightning's 15.7 MiB at micro batch 2 and 29.2 at 8, Accelerate's
    # (tiny_lm.py) 14.8 and 21.7. The budget sits between the higher at 2 and the lower at 8, about 3 MiB from each.
    tuned = autotune(
        "tune",
        "--study",
        "s",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--space",
        "space.yaml",
        "--memory-budget",
        "19MiB",
        "--steps",
        "2",
        "--json",
        "--",
        *command,
        "30",
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    trials = {t["config"]["micro_batch"]: t for t in json.loads(tuned.stdout)["trials"]}
    assert trials[8]["status"] == "oom" and trials[2]["status"] == "ok", trials
    assert trials[2]["tokens_per_s"] > 0 and 0 < trials[2]["peak_memory_bytes"] < 19 * 2**20
    exported = autotune("export", "--study", "s", "--format", "json", "-o", "autotune.json")
    assert exported.returncode == 0, exported.stderr[-3000:]
    ran = autotune("run", "--config", "autotune.json", "--", *command, "3")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert trained in ran.stdout


# Ctrl-C: the tuner kills its trial's process tree. Kill -9 gives it no chance to: the command must die
# with it on its own.
@pytest.mark.parametrize("stop", ["kill -9", "ctrl-c"])
@pytest.mark.slow
def test_stopping_a_script_tune_leaves_none_of_the_command_behind(tmp_path, stop, own_processes):
    import signal
    import time

    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2, 4]\n  precision: [fp32]\n")
    tuner = commands.start(
        "tune",
        "--study",
        "stop",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--space",
        "space.yaml",
        "--memory-budget",
        "1GiB",
        "--no-confirm",
        "--",
        # env execs the loop: the process the tuner started (its pid, parent and signals) is the loop's. Given in
        # the command, not to the tuner, the tuner runs in the warm interpreter of the suite's own environment.
        "env",
        "HANG_AFTER_FIRST_STEP=1",
        *LOOP[:2],
        "1000",
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not own_processes("plain_loop.py") and time.monotonic() < deadline:
            assert tuner.poll() is None, tuner.communicate()
            time.sleep(0.2)
        assert own_processes("plain_loop.py"), "the command never started"
        time.sleep(1)  # inside its first step or its hang
        tuner.send_signal(signal.SIGKILL if stop == "kill -9" else signal.SIGINT)
        _, stderr = tuner.communicate(timeout=60)
        if stop == "ctrl-c":
            assert tuner.returncode == 130 and "run the same command again" in stderr, stderr
        deadline = time.monotonic() + 10  # the kernel's SIGKILL on the tuner's death, or the tuner's own kill
        while own_processes("plain_loop.py") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not own_processes("plain_loop.py"), "the user's command outlived the tuner"
    finally:
        tuner.kill()
        for process in own_processes("plain_loop.py"):
            process.kill()
