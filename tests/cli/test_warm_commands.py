"""tests/commands.py: a command forked from the warm interpreter behaves as ``python -m autotune`` in a new one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import commands
import pytest


def _fresh(*args: str, cwd: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow  # a new interpreter beside the warm one
@pytest.mark.parametrize("args", [["models"], ["show", "--study", "none"], ["trial", "--micro-batch", "0"]])
def test_a_warm_command_prints_and_exits_as_a_new_interpreter_does(tmp_path, args):
    warm, fresh = commands.autotune(*args, cwd=tmp_path), _fresh(*args, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert warm.args == fresh.args


def test_a_started_command_is_polled_until_it_ends_and_runs_beside_another(tmp_path):
    first = commands.start("show", "--study", "none", cwd=tmp_path)
    second = commands.start("models", cwd=tmp_path)
    deadline = time.monotonic() + 60
    while first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.returncode == 2 and "no such study" in first.communicate()[1]
    assert second.wait(60) == 0 and "builtin:gpt2-tiny" in second.communicate()[0]


@pytest.mark.slow  # a trial
def test_a_signal_reaches_the_command_and_a_timeout_kills_it(tmp_path):
    tune = ("tune", "--study", "s", "--space", "quick", "--global-batch", "4", "--steps", "50", "--no-estimate")
    stopped = commands.start(*tune, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "storage" / "autotune.db").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped.send_signal(signal.SIGINT)
    assert stopped.wait(60) == 130 and "interrupted" in stopped.communicate()[1]
    with pytest.raises(subprocess.TimeoutExpired):
        commands.autotune(*tune, cwd=tmp_path, timeout=1)
