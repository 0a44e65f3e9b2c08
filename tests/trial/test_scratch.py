"""A trial's scratch folder goes with it, and one that a killed process left is removed by the next."""

from __future__ import annotations

import os
import subprocess

from autotune.trial.scratch import folder_prefix, scratch_folder, torchrun_logs_in


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_new_folder_removes_those_dead_processes_of_this_host_left_and_no_other(tmp_path):
    dead = _dead_pid()
    left = tmp_path / f"{folder_prefix('trial')}{dead}-k1ll3d"
    (left / "torchrun").mkdir(parents=True)
    (left / "spec.json").write_text("{}")
    live = tmp_path / f"{folder_prefix('trial')}{os.getpid()}-running"
    elsewhere = tmp_path / f"autotune-trial-00000000-{dead}-on-another-host"  # its pids are not this host's
    other_kind = tmp_path / f"{folder_prefix('script')}{dead}-another-kind"
    for kept in (live, elsewhere, other_kind):
        kept.mkdir()

    with scratch_folder("trial", parent=tmp_path) as made:
        assert os.path.basename(made).startswith(f"{folder_prefix('trial')}{os.getpid()}-")
        assert not left.exists()
        assert live.exists() and elsewhere.exists() and other_kind.exists()
    assert not os.path.exists(made)


def test_torchrun_logs_in_the_trial_s_folder_unless_the_caller_chose_a_place(tmp_path):
    assert torchrun_logs_in(tmp_path, {})["PET_LOG_DIR"] == str(tmp_path / "torchrun")
    assert torchrun_logs_in(tmp_path, {"PET_LOG_DIR": "/var/log/mine"})["PET_LOG_DIR"] == "/var/log/mine"
