"""One-rank trials forked from the trial server: the same measurement as a new interpreter, the
same isolation, and a server that dies takes its trial with it without losing the next one."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from processes import alive

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.lifeline import TRIAL_PROCESS_NAME
from autotune.trial.result import TrialStatus
from autotune.trial.runner import run_trial

GPT2 = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=4)


def _run(monkeypatch, server: str, workload: Workload = GPT2, **kwargs):
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", server)
    return run_trial(workload, TrialConfig(micro_batch=2), warmup_steps=1, measure_steps=1, **kwargs)


@pytest.mark.slow
def test_a_forked_trial_measures_what_a_new_interpreter_measures(monkeypatch):
    fresh = _run(monkeypatch, "off")
    forked = _run(monkeypatch, "on")
    forked_again = _run(monkeypatch, "on")
    for r in (fresh, forked, forked_again):
        assert r.status is TrialStatus.OK, r.error
    # The CPU's live-tensor tracker counts the same tensors whichever way the process started.
    assert forked.peak_memory_bytes == fresh.peak_memory_bytes == forked_again.peak_memory_bytes
    assert forked.trainable_params == fresh.trainable_params
    # The fork skipped the interpreter's start and the imports the new interpreter paid.
    assert forked_again.phases.startup_s + forked_again.phases.build_s < fresh.phases.startup_s + fresh.phases.build_s


@pytest.mark.slow
def test_two_forked_ranks_measure_what_torchrun_s_ranks_measure(monkeypatch, tmp_path):
    two_ranks = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=8, nproc=2)
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "off")
    # Where torchrun would leave its torchelastic_* folder; the suite's own log folder (conftest.py) left out.
    own_temp = {**{k: v for k, v in os.environ.items() if k != "PET_LOG_DIR"}, "TMPDIR": str(tmp_path)}
    torchrun = run_trial(
        two_ranks, TrialConfig(micro_batch=2, zero_stage=2), warmup_steps=1, measure_steps=1, env=own_temp
    )
    assert not list(tmp_path.glob("torchelastic_*")), "torchrun's logs outlived the trial"
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "on")
    forked = run_trial(two_ranks, TrialConfig(micro_batch=2, zero_stage=2), warmup_steps=1, measure_steps=1)
    for r in (torchrun, forked):
        assert r.status is TrialStatus.OK, r.error
        assert r.world_size == 2 and len(r.peak_memory_per_rank) == 2
    # Real DeepSpeed ZeRO-2 over a real gloo group either way: the same partitioned states per rank.
    assert forked.optimizer_state_bytes == torchrun.optimizer_state_bytes
    # The same peaks, within what rank 0's own peak varies by from run to run, whichever way it starts and on
    # a quiet machine too: in 15 runs here (2026-11-27) rank 0 read 14,161,436 bytes or 426 kB (3.0%) more,
    # 14,587,416: torchrun 4 times of 11 (3 of the 6 with Python's gc disabled: not a cycle's garbage freed
    # earlier or later), forked once of 4. Rank 1 read 14,909,212 every time. Rank 0's storages are freed by
    # threads other than its main one too (C++ threads: DeepSpeed's collectives' or the engine's), 2 to 5 per
    # run of 4 logged, 4 B to 1 MiB each and different every run: whether one comes before the peak varies. A suite
    # run beside other work later read 15,111,704 for torchrun's rank 0 against the fork's 14,161,436 (928 KiB, 6.7%):
    # so within one such buffer, 1 MiB, rather than a share.
    for forked_peak, torchrun_peak in zip(forked.peak_memory_per_rank, torchrun.peak_memory_per_rank, strict=True):
        assert forked_peak == pytest.approx(torchrun_peak, abs=2**20)


def _servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if "autotune.trial.server" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_a_killed_server_takes_its_trial_along_and_the_next_trial_starts_a_new_one(monkeypatch):
    _run(monkeypatch, "on")  # the server is up
    (server,) = _servers()

    killed = threading.Event()
    trial_over = threading.Event()
    trials: list[psutil.Process] = []  # this server's trial: other runs on the machine may have their own

    def kill_server_once_the_trial_runs() -> None:
        # As long as the trial lasts: on a machine busy with other tests its start can take a while.
        while not trial_over.is_set():
            try:
                trials.extend(p for p in server.children() if p.name() == TRIAL_PROCESS_NAME)
            except psutil.NoSuchProcess:  # a child gone between the listing and its name: look again
                continue
            if trials:
                # The server says the trial's pid once it has forked its ranks; killed before that, the runner
                # would run the trial again in an interpreter of its own (as it must). A second is long enough.
                time.sleep(1.0)
                server.kill()
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_server_once_the_trial_runs)
    killer.start()
    try:
        hung = _run(
            monkeypatch, "on", workload=Workload(model="factories:hang", seq_len=16, global_batch=4), timeout_s=120
        )
    finally:
        trial_over.set()
        killer.join()
    assert killed.is_set(), f"the hanging trial never showed up under the server: {hung.status.value}, {hung.error}"
    assert hung.status is TrialStatus.CRASHED, hung.error
    deadline = time.monotonic() + 10  # PR_SET_PDEATHSIG delivers the trial's SIGKILL
    while any(alive(p) for p in trials) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in trials)
    after = _run(monkeypatch, "on")
    assert after.status is TrialStatus.OK, after.error
    assert [p.pid for p in _servers()] != [server.pid]


def test_a_process_whose_parent_died_before_it_asked_to_die_with_it_exits_at_once():
    # The race a forked trial runs: its server is killed between fork() and die_with_parent(). Asked
    # against the pid taken before the fork, the orphan notices (getppid() now names its reaper).
    started = time.monotonic()
    orphan = subprocess.run(
        [
            "sh",
            "-c",
            (
                f"{sys.executable} -c 'import sys, time; time.sleep(1); "
                "from autotune.trial.lifeline import die_with_parent; die_with_parent(int(sys.argv[1])); "
                "time.sleep(60); sys.exit(0)' $$ & echo $!"
            ),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(orphan.stdout.strip())
    deadline = time.monotonic() + 30
    while (
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert time.monotonic() - started < 30  # it did not sleep its 60 s


def _holding_the_turn(tmp_path: Path, cores: set[int]) -> subprocess.Popen[str]:
    """Another process, on ``cores``, holding the CPU turn (its locks under ``tmp_path``, away from the other
    tests' trials) until it is killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                f"import os, time\nos.sched_setaffinity(0, {cores!r})\nfrom autotune.search.workers import cpu_turn\n"
                "with cpu_turn('cpu'):\n    print('holding', flush=True)\n    time.sleep(30)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def _taken(path: Path) -> bool:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def test_trials_on_a_cpu_take_turns_across_processes(tmp_path, monkeypatch):
    from autotune.search.workers import cpu_turn, turn_lock_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cores = os.sched_getaffinity(0)
    holder = _holding_the_turn(tmp_path, cores)
    try:
        # Another process's turn on these cores: ours must wait, on each of them.
        assert turn_lock_paths() == [tmp_path / f"autotune-{os.getuid()}-cpu{core}.turn.lock" for core in sorted(cores)]
        assert all(_taken(path) for path in turn_lock_paths())
        with cpu_turn("cuda"):
            pass  # workers on GPUs of their own never wait
    finally:
        holder.kill()
        holder.wait()
    with cpu_turn("cpu"):
        pass  # released with the process that held it


# Read as the tests are collected, before a parallel run pins its worker to its share of them (tests/conftest.py).
CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_processes_on_cores_of_their_own_do_not_take_turns(tmp_path, monkeypatch):
    from autotune.search.workers import cpu_turn, turn_lock_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = CORES[:2]
    holder = _holding_the_turn(tmp_path, {first})
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {second})  # this thread only: what a process confined to the other core sees
        [own] = turn_lock_paths()
        assert own.name == f"autotune-{os.getuid()}-cpu{second}.turn.lock" and not _taken(own)
        with cpu_turn("cpu"):
            pass  # no wait
        os.sched_setaffinity(0, {first, second})  # a process on both cores waits for the one on the first
        assert [_taken(path) for path in turn_lock_paths()] == [True, False]
    finally:
        os.sched_setaffinity(0, mine)
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_the_device_probe_forked_from_the_server_measures_what_its_own_interpreter_measures(monkeypatch):
    from autotune.trial import device_probe

    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "off")  # no server to fork from: an interpreter of its own
    fresh = device_probe.probe_profile("cpu", between_ranks=False, trial_server=True)
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "on")

    def no_interpreter(*args, **kwargs):
        raise AssertionError(f"the probe started an interpreter of its own: {args}")

    monkeypatch.setattr(device_probe.subprocess, "run", no_interpreter)
    # Two ranks' roofline: the collective's two processes are spawned from the forked probe.
    forked = device_probe.probe_profile("cpu", between_ranks=True, trial_server=True)
    assert fresh is not None and forked is not None, "the device probe failed"
    assert forked.keys() - {"collective_s"} == fresh.keys() and 0 < forked["collective_s"] < 1.0, forked
    assert forked["source"] == fresh["source"] == "measured by the device probe"
    assert forked["matmul_flops"].keys() == fresh["matmul_flops"].keys() and forked["memory_bandwidth"] > 0
    speeds = device_probe.probe_precisions("cpu", ["fp32", "bf16"], trial_server=True)
    assert speeds is not None and speeds["fp32"] == 1.0 and speeds["bf16"] > 0


@pytest.mark.slow
def test_the_server_imports_peft_and_an_optimizers_library_only_before_a_trial_that_needs_them(tmp_path):
    # PEFT is over half of the server's imports, which a study without LoRA never needs (a trial without LoRA
    # does not import PEFT: the server imports it once, at the first LoRA trial). Adafactor's module
    # (Transformers' optimization) likewise, at the first Adafactor trial, where each fork paid it before.
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from autotune.config.knobs import TrialConfig\n"
        "from autotune.config.workload import Workload\n"
        "from autotune.trial.server import _preload_for_config\n"
        "from autotune.trial.spec import TrialSpec\n"
        "for config in ({}, {'lora_rank': 8}, {'optimizer': 'adafactor'}):\n"
        "    spec = Path(f'{sys.argv[1]}/{len(config)}{sorted(config)}.json')\n"
        "    TrialSpec(workload=Workload(), config=TrialConfig(**config), device_type='cpu',\n"
        "              memory_budget_bytes=None, warmup_steps=1, measure_steps=3).write(spec)\n"
        "    _preload_for_config(str(spec))\n"
        "    print('peft' in sys.modules, 'transformers.optimization' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["False False", "True False", "True True"], out.stderr
    # Not where a GPU is visible: bitsandbytes, under both, initialises CUDA as it imports, and the server
    # would fork no more trials (each imports them itself there).
    gpu = code.replace("import json, sys\n", "import json, sys, torch\ntorch.cuda.is_available = lambda: True\n")
    out = subprocess.run([sys.executable, "-c", gpu, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["False False"] * 3, out.stderr
