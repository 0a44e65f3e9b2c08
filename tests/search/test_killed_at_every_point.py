"""`autotune tune` killed with SIGKILL at each later point of a trial's life (test_killed_at_creation.py has the
moment it turns RUNNING): its worker recorded, its child measuring, its result being written. The same command
run again fails the trial as lost, leaves nothing RUNNING and measures the lost config again as its retry; a
trial child killed with its tune does not outlive it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import commands
import optuna
import psutil
import pytest
from optuna.trial import TrialState

from autotune.study.stale import LOST_ATTR, RETRY_ATTR
from autotune.study.storage import open_storage

SPACE = "knobs:\n  micro_batch: [1, 2]\n  precision: [fp32]\n  checkpointing: [false]\n"
COMMAND = ["tune", "--study", "killed", "--model", "builtin:gpt2-tiny", "--seq-len", "32", "--memory-budget", "1GiB"]
COMMAND += ["--space", "space.yaml", "--no-estimate", "--warmup-steps", "1", "--steps", "2", "--n-trials", "1"]
COMMAND += ["--no-confirm"]

# The same tune in a process of its own, with the function at the point wrapped so that the process kills itself
# there with SIGKILL: no handler, no cleanup, no finally.
CHILD = """
import json, os, runpy, signal, sys, time
import optuna
import psutil
import autotune.search.tuning as tuning
import autotune.trial.runner as runner

point, note = sys.argv[1], sys.argv[2]

def die(**facts):
    with open(note, "w") as f:
        json.dump(dict(facts, tune=os.getpid()), f)
    os.kill(os.getpid(), signal.SIGKILL)

if point == "worker recorded":  # the trial RUNNING, its worker and config stored, its first heartbeat recorded
    real_ask = tuning.ask
    def ask(*args, **kwargs):
        trial, config = real_ask(*args, **kwargs)
        die(number=trial.number)
    tuning.ask = ask  # where the search takes its trials
elif point == "measuring":  # the trial server forked the trial's child, and the child runs
    real_send, real_reply = runner._TrialServer._send, runner._TrialServer._reply
    forked = []
    def send(self, request):
        pid = real_send(self, request)
        forked.append(pid)
        return pid
    def reply(self, key, timeout_s):
        if key == "exit_code":
            # Inside the child's build: a trial of this model (build, a warm-up of one micro batch, two steps)
            # can end within half a second.
            time.sleep(0.1)
            die(pid=forked[-1], alive=psutil.pid_exists(forked[-1]))
        return real_reply(self, key, timeout_s)
    runner._TrialServer._send, runner._TrialServer._reply = send, reply
elif point == "result written":  # measure_in_study stored the trial's result, then tells Optuna
    def tell(self, trial, *args, **kwargs):
        die(number=trial if isinstance(trial, int) else trial.number)
    optuna.Study.tell = tell
else:
    raise SystemExit(f"no such point: {point}")

sys.argv = ["autotune", *sys.argv[3:]]
runpy.run_module("autotune", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # two tune runs each: 35 to 45 s on a shared 2-core CPU
@pytest.mark.parametrize("point", ["worker recorded", "measuring", "result written"])
def test_tune_killed_at_a_point_of_a_trial_is_resumed_by_the_same_command(tmp_path: Path, point: str) -> None:
    (tmp_path / "space.yaml").write_text(SPACE)
    note = tmp_path / "killed.json"
    killed = subprocess.run(
        [sys.executable, "-c", CHILD, point, str(note), *COMMAND],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9 and note.exists(), killed.stderr  # killed at the point, not before or after
    facts = json.loads(note.read_text())
    url = f"sqlite:///{tmp_path}/storage/autotune.db"
    (lost,) = optuna.load_study(study_name="killed", storage=open_storage(url)).trials
    assert lost.state is TrialState.RUNNING and lost.user_attrs["worker"]["pid"] == facts["tune"]
    assert "config" in lost.user_attrs
    if point == "measuring":
        assert facts["alive"], "the trial's child had ended before the kill"
        _gone(facts["pid"])  # it died with tune (trial/lifeline.py): nothing measures on the cores meanwhile
    if point == "result written":
        assert lost.user_attrs["status"] == "ok" and "result" in lost.user_attrs  # written, not yet told

    again = commands.autotune(*COMMAND, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"trial(s) {lost.number} were interrupted" in again.stderr
    trials = {t.number: t for t in optuna.load_study(study_name="killed", storage=open_storage(url)).trials}
    assert not [t.number for t in trials.values() if t.state is TrialState.RUNNING]  # nothing left running
    failed = trials[lost.number]
    assert failed.state is TrialState.FAIL and failed.user_attrs["status"] == "interrupted"
    assert "is gone" in failed.user_attrs[LOST_ATTR]
    (retry,) = [t for t in trials.values() if t.user_attrs.get(RETRY_ATTR) == lost.number]
    assert retry.state is TrialState.COMPLETE and retry.user_attrs["status"] == "ok"
    assert retry.user_attrs["config"] == failed.user_attrs["config"]  # the lost config, measured again


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError(f"the trial's child (pid {pid}) outlived the tune that was killed")
