from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

TESTS = Path(__file__).parent
# Tests live in folders mirroring the package's; factories.py and broken_module.py stay here, importable
# as `factories` from any of them (and from trial processes, through PYTHONPATH below).
sys.path.insert(0, str(TESTS))

from processes import MARK_ENV, RUN_MARK  # noqa: E402 - importable once the path above is set

os.environ[MARK_ENV] = RUN_MARK  # every process this run starts carries it (tests/processes.py)
# DeepSpeed on a CPU compiles its shared-memory op at its first init (40-60 s on 2 cores) into torch's cache,
# ~/.cache/torch_extensions/py311_cpu, which every environment of this Python on the machine shares: a run
# in another virtual environment (a clean clone's CI beside a checkout's) changes its build command, and
# each then rebuilds it over the other's (CI's 157 s ZeRO script test was mostly such rebuilds). One cache
# per environment: one build, kept with the torch and DeepSpeed it was built against.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# torchrun makes a torchelastic_* folder of logs in the temporary directory and leaves it there: the tests' own
# jobs, and the exports' launch scripts they run, log in one folder of this run instead, removed as it ends.
# (autotune's trials log in each trial's own folder: tests/trial/test_trial_server.py checks that without this.)
_TORCHRUN_LOGS = tempfile.mkdtemp(prefix="autotune-tests-torchrun-")
os.environ.setdefault("PET_LOG_DIR", _TORCHRUN_LOGS)
atexit.register(shutil.rmtree, _TORCHRUN_LOGS, ignore_errors=True)
# A suite started in the background of a script (`pytest ... &` without job control) inherits SIGINT ignored,
# and so would every autotune process a test starts: the Ctrl-C tests' SIGINT would do nothing. Python's own
# handler here makes the processes the tests start take SIGINT's default again, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _offline_and_factories(monkeypatch: pytest.MonkeyPatch) -> None:
    # Trials never reach the Hub in tests, and find tests/factories.py as `factories:NAME`.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


# The cores this run may use, as it started. In a parallel run each worker computes on its own share of them
# (_worker_cores): a trial pins itself to the cores free when it starts, and autotune's trials take turns per
# core (autotune.search.workers.cpu_turn), so the workers' trials run side by side, each on its own cores,
# where on shared cores one worker's trial waited for the other's, or ran its threads on a core the other
# then took (an OpenMP region waits for its slowest thread).
ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _worker_cores(alone: bool) -> list[int]:
    """This xdist worker's share of ALL_CORES; all of them for a test that runs alone (and in a run of one
    process). With more workers than cores, the workers take the cores in turn (gw0 and gw2 both on the
    first of two)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if alone or worker is None or not ALL_CORES:
        return ALL_CORES
    index = int(worker.removeprefix("gw"))
    if count >= len(ALL_CORES):
        return [ALL_CORES[index % len(ALL_CORES)]]
    share = len(ALL_CORES) // count
    return ALL_CORES[index * share : (index + 1) * share]


def _compute_on(cores: list[int]) -> None:
    """Pin this process (and so every process a test starts) to ``cores``, with as many torch threads, as a
    trial pins itself."""
    if not cores or sorted(os.sched_getaffinity(0)) == cores:
        return
    import torch  # imported already, by the collection (pytest_collection_modifyitems)

    from autotune.trial.cpu_cores import use_cores

    use_cores(cores, len(cores), torch)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """In a parallel run (pytest -n), a test marked ``alone`` runs while no other test does, on every core: it
    reads which cores are busy, or how its ranks interleave, which another worker's test would change. The
    others share, each worker on its own cores. One marked ``one_at_a_time(NAME)`` never runs beside another of
    that name (a cluster's jobs). The locks are held over the whole protocol: the set-up and tear-down of
    module-wide fixtures (a tuned study) too."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process runs every test: each is alone already
        return (yield)
    alone = _alone(item)
    names = sorted({str(mark.args[0]) for mark in item.iter_markers("one_at_a_time")})
    locks = Path(tempfile.gettempdir()) / f"autotune-tests-{run}"
    global _ALONE_HELD
    run_wide, _ALONE_HELD = _ALONE_HELD, None  # held already: the alone test before this one kept it for this one
    if run_wide is None:
        run_wide = contextlib.ExitStack()
        # A test that runs alone waits only for the tests running now: while it waits, no other test starts. flock
        # favours no one, and the other worker, taking the run-wide lock shared test after test, kept one waiting
        # 48 s over three of its tests. The gate holds the others back: taken by the alone test until it holds the
        # run-wide lock, and by every other test for as long as it takes that lock.
        with open(f"{locks}-gate.lock", "a") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            lock = run_wide.enter_context(open(f"{locks}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)  # released as the file closes
    # Alone tests one after another keep the run-wide lock between them: let go of, the other worker took it for a
    # test of its own each time, and the next alone test waited for that one (62 s of one worker idle over
    # test_cpu_cores.py's four, in a run that queued that file early).
    keep = alone and nextitem is not None and _alone(nextitem)
    with contextlib.ExitStack() as held:
        if keep:
            _ALONE_HELD = run_wide
        else:
            held.push(run_wide)
        # Then the named locks in order, after the run-wide one: no two tests wait on each other in a circle.
        for name in names:
            fcntl.flock(held.enter_context(open(f"{locks}-{name}.lock", "a")), fcntl.LOCK_EX)
        _compute_on(_worker_cores(alone))
        return (yield)


_ALONE_HELD: contextlib.ExitStack | None = None  # the run-wide lock, kept from one alone test to the next


def _alone(item: pytest.Item) -> bool:
    return item.get_closest_marker("alone") is not None


@pytest.fixture
def _fresh_accelerate_state() -> Iterator[None]:
    """TrainingArguments sets Accelerate's process-wide state; leave none behind for other tests."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def pytest_configure(config: pytest.Config) -> None:
    # -n 2 --dist loadfile hands a worker the next file of a queue whenever it is done with one. xdist orders that
    # queue by each file's number of tests (--loadscope-reorder, on by default), which leaves the files of one or
    # two long tests (the GPU check's rehearsal) for the end, where one worker runs them while the other has
    # nothing left to do. The queue keeps the collection's order instead: longest first (_longest_files_first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Order the files by their number of ``slow`` tests, most first (the rest keep pytest's order), so that the
    two workers end together on short files, and a file of ``alone`` tests last. Files whose tests share a
    ``one_at_a_time`` name would make one worker
    wait for the other if the two took them at once, as the queue's neighbours: only the longest of them goes
    first, the second after every other file with slow tests, and any more after every other file."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {name: sum(item.get_closest_marker("slow") is not None for item in tests) for name, tests in files.items()}
    groups: dict[str, list[str]] = {}
    for name, tests in files.items():
        for group in sorted({str(mark.args[0]) for item in tests for mark in item.iter_markers("one_at_a_time")}):
            groups.setdefault(group, []).append(name)
    # Each file's place among the files it shares a name with, longest first (0 for a file that shares none).
    turn = {name: i for members in groups.values() for i, name in enumerate(sorted(members, key=lambda n: -slow[n]))}
    order = {name: i for i, name in enumerate(files)}

    # A file of tests that run alone goes last: each waits for the test the other worker is running, and there the
    # other worker's tests are short ones (queued early, the first waited 22 s), or it has none left.
    alone = {name for name, tests in files.items() if any(_alone(item) for item in tests)}

    def key(name: str) -> tuple[int, int, int]:
        place = turn.get(name, 0)
        rank = 4 if name in alone else 3 if place > 1 else 1 if place else 0 if slow[name] else 2
        return (rank, -slow[name], order[name])

    items[:] = [item for name in sorted(files, key=key) for item in files[name]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_files_first(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
