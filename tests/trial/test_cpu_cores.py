"""A CPU trial computes on the cores that are free when it starts, and its result says which."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.search.workers import cpu_turn
from autotune.trial.cpu_cores import pick_free_cores, rank_cores
from autotune.trial.result import TrialResult, TrialStatus
from autotune.trial.runner import run_trial

TINY = Workload(model="factories:tiny", seq_len=16, global_batch=4)
two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or 0 not in os.sched_getaffinity(0), reason="needs cores 0 and 1"
)


def test_free_cores_are_the_least_busy_as_many_as_their_idle_time_adds_up_to():
    assert pick_free_cores({0: 0.03, 1: 0.05}) == [0, 1]
    assert pick_free_cores({0: 1.0, 1: 0.02}) == [1]  # a process spinning on core 0
    assert pick_free_cores({0: 0.5, 1: 0.55}) == [0]  # one spinner hopping between the two
    assert pick_free_cores({0: 1.0, 1: 0.97, 2: 1.0}) == [1]  # all busy: still one, the least busy
    assert pick_free_cores({0: 0.0, 1: 1.0, 2: 0.1, 3: 0.9}) == [0, 2]


def test_each_rank_gets_its_own_slice_where_there_are_enough_cores():
    assert [rank_cores([0, 1, 2, 3], r, 2) for r in (0, 1)] == [([0, 1], 2), ([2, 3], 2)]
    assert [rank_cores([1, 3, 5], r, 3) for r in (0, 1, 2)] == [([1], 1), ([3], 1), ([5], 1)]
    assert rank_cores([1], 1, 2) == ([1], 1)  # fewer cores than ranks: shared, a thread each


def test_results_stored_before_the_cores_were_recorded_still_load():
    old = TrialResult(config=TrialConfig(micro_batch=2), status=TrialStatus.OK).to_dict()
    del old["cpu_cores"], old["cpu_threads"]
    assert TrialResult.from_dict(old).cpu_cores is None


def test_a_cpu_trial_records_the_cores_and_threads_it_ran_on():
    result = run_trial(TINY, TrialConfig(micro_batch=2), warmup_steps=1, measure_steps=1)
    assert result.status is TrialStatus.OK, result.error
    assert result.cpu_cores and set(result.cpu_cores) <= os.sched_getaffinity(0)
    assert result.cpu_threads == len(result.cpu_cores)
    assert TrialResult.from_dict(result.to_dict()).cpu_cores == result.cpu_cores


@pytest.fixture()
def spinner_on_core_0():
    """Another process keeping core 0 busy for the whole test, which holds the CPU turn as the tuner
    does (autotune runs beside it wait); skipped when something else keeps core 1 busy too."""
    with cpu_turn("cpu"):
        spinner = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
        try:
            time.sleep(0.3)  # started and spinning before anything looks
            if psutil.cpu_percent(interval=0.3, percpu=True)[1] > 50:
                pytest.skip("core 1 is busy too (another process on this machine): nothing free to pick")
            yield
        finally:
            spinner.kill()
            spinner.wait()


@two_cores
@pytest.mark.alone
@pytest.mark.slow  # alone: every other test waits for it
@pytest.mark.parametrize("server", ["on", "off"])
def test_a_trial_leaves_out_the_core_another_process_keeps_busy(monkeypatch, spinner_on_core_0, server):
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", server)
    result = run_trial(TINY, TrialConfig(micro_batch=2), warmup_steps=1, measure_steps=1)
    assert result.status is TrialStatus.OK, result.error
    assert 0 not in result.cpu_cores
    assert result.cpu_threads == len(result.cpu_cores)


@two_cores
@pytest.mark.alone
@pytest.mark.slow  # alone: every other test waits for it
def test_torchrun_ranks_leave_out_the_busy_core_too(monkeypatch, spinner_on_core_0):
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "off")  # torchrun's ranks, pinned by the child itself
    two_ranks = Workload(model="factories:tiny", seq_len=16, global_batch=4, nproc=2)
    result = run_trial(two_ranks, TrialConfig(micro_batch=1), warmup_steps=1, measure_steps=1)
    assert result.status is TrialStatus.OK, result.error
    assert 0 not in result.cpu_cores and result.cpu_threads == 1


@two_cores
@pytest.mark.alone
@pytest.mark.slow  # alone: every other test waits for it
def test_a_script_trial_leaves_out_the_busy_core_too(spinner_on_core_0):
    from pathlib import Path

    from autotune.scripts.runner import run_script_trial

    loop = Path(__file__).parents[1] / "scripts" / "plain_loop.py"
    result = run_script_trial(
        [sys.executable, str(loop), "20"],
        Workload(seq_len=64, global_batch=8),
        TrialConfig(micro_batch=8),
        measure_steps=2,
    )
    assert result.status is TrialStatus.OK, result.error
    assert result.cpu_cores == [1] and result.cpu_threads == 1
