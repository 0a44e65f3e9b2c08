"""Workers as SLURM jobs: ``tune``/``find --executor slurm --workers N`` submits N jobs, each holding
one trial's resources and running ``autotune worker`` on the shared study until it is done.

The jobs are submitted and watched with SLURM's own commands (``sbatch``, ``squeue``, ``scancel``,
``scontrol requeue``), not with submitit: submitit learns a job's state from ``sacct``, which needs
SLURM's accounting database; a cluster without one (and the one-node test cluster) gets a warning on
every poll and the state UNKNOWN. It also ships the job's function pickled, and nothing in autotune
unpickles. ``squeue`` answers from the controller itself: a job it no longer lists has ended, and how
it ended is in the study (what each worker measured), not in the job's exit code.

Each job runs ``python -m autotune worker`` with its spec (JSON, the same as a local helper's) on
stdin, from a file in ``autotune-slurm/`` under the submitting directory (a shared file system, as
the study's storage must be: a journal file on it, or a database server). The worker names its job in
the study (user attribute ``slurm_job:<id>``), which is how ``show`` and ``studies`` name the worker
jobs and how the submitter finds a ``find`` study whose name the workers derived.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config.workload import Workload

__all__ = [
    "Executor",
    "SlurmResources",
    "worker_spec",
    "check_executor",
    "batch_script",
    "submit_workers",
    "live_jobs",
    "wait_jobs",
    "cancel_jobs",
    "requeue_self",
    "parse_slurm_options",
    "tune_on_slurm",
]

_POLL_S = 2.0
# States of a job that has ended for good (squeue lists them for MinJobAge, then forgets the job).
_ENDED = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}
)
_SIGNAL = re.compile(r"^(B:)?[A-Z0-9]+(@\d+)?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmResources:
    """What each worker job asks SLURM for: one trial's nodes, GPUs and ranks, and the site's options."""

    nodes: int = 1
    nproc: int = 1  # the trial's ranks, in all: a core each unless --slurm-option cpus-per-task says otherwise
    gpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    constraint: str | None = None
    signal: str | None = "B:USR1@120"  # sent to the worker before the time limit or preemption
    options: tuple[tuple[str, str], ...] = ()  # --slurm-option KEY=VALUE, as given

    def sbatch_options(self) -> list[str]:
        ranks_per_node = -(-self.nproc // self.nodes)
        given = {key for key, _ in self.options}
        # A requeued job appends to its log: what its first run said stays beside what the next one says.
        options = [f"--nodes={self.nodes}", "--ntasks-per-node=1", "--requeue", "--open-mode=append"]
        if "cpus-per-task" not in given:
            options.append(f"--cpus-per-task={ranks_per_node}")
        for flag, value in (
            ("gpus-per-node", self.gpus_per_node),
            ("partition", self.partition),
            ("account", self.account),
            ("time", self.time),
            ("qos", self.qos),
            ("constraint", self.constraint),
            ("signal", self.signal),
        ):
            if value is not None and flag not in given:
                options.append(f"--{flag}={value}")
        return options + [f"--{key}={value}" for key, value in self.options]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Executor:
    """Where a search's workers run, as asked: ``local`` (processes on this machine) or ``slurm`` (a job
    each, holding one trial's nodes), with the SLURM job's options (``--executor`` and the flags after it)."""

    name: str = "local"
    nodes: int = 1
    gpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    constraint: str | None = None
    signal: str | None = None  # None: SlurmResources' default
    options: tuple[str, ...] = ()  # --slurm-option KEY=VALUE, as given

    def resources(self, *, nproc: int, command: list[str] | None = None) -> SlurmResources | None:
        """What each SLURM worker job holds for trials of ``nproc`` ranks (of the user's ``command``, in
        script mode); None for the local executor, which refuses the SLURM job's options."""
        if command and self.nodes > 1:
            from autotune.scripts.runner import SCRIPT_NODES_REFUSAL

            raise ConfigError(SCRIPT_NODES_REFUSAL.format(nodes=self.nodes))
        if self.name == "local":
            if self.nodes != 1:
                raise ConfigError(
                    f"--nodes {self.nodes}: the local executor runs a trial's ranks on this machine only; "
                    "add --executor slurm, or drop --nodes"
                )
            given = [flag for name, flag in _JOB_FLAGS.items() if getattr(self, name)]
            if given:
                raise ConfigError(f"{given[0]} is a SLURM job's option: add --executor slurm, or drop {given[0]}")
            return None
        if self.name != "slurm":
            raise ConfigError(f"--executor {self.name!r} is not known; use local or slurm")
        resources = SlurmResources(
            nodes=self.nodes,
            nproc=nproc,
            gpus_per_node=self.gpus_per_node,
            partition=self.partition,
            account=self.account,
            time=self.time,
            qos=self.qos,
            constraint=self.constraint,
            options=parse_slurm_options(list(self.options)),
        )
        return resources if self.signal is None else dataclasses.replace(resources, signal=self.signal)


# The Executor's fields that only a SLURM job takes, and their flags.
_JOB_FLAGS = {
    "gpus_per_node": "--gpus-per-node",
    "partition": "--partition",
    "account": "--account",
    "time": "--time",
    "qos": "--qos",
    "constraint": "--constraint",
    "signal": "--signal",
    "options": "--slurm-option",
}


def worker_spec(
    *,
    workload: Workload,
    nodes: int,
    space: str,
    memory_budget_bytes: int | None,
    timeout_s: float | None,
    trial_timeout_s: float,
    measure_steps: int,
    command: list[str] | None,
    **tune_args: Any,
) -> dict[str, Any]:
    """What each SLURM worker tunes: the arguments of :func:`autotune.search.tuner.tune` (``tune_args``:
    the rest of them, ``storage`` among them), as JSON. A space file keeps the name it was given: the
    jobs start in the submitting directory (sbatch's default), as a local run would."""
    return {
        # The study's question says the nodes: exports carry them.
        "workload": workload.replace(nodes=nodes).to_dict(),
        "space": space,
        "memory_budget_bytes": memory_budget_bytes,
        "timeout_s": timeout_s,
        "trial_timeout_s": trial_timeout_s,
        "measure_steps": measure_steps,
        "command": list(command) if command else None,
        **tune_args,
        # Several ranks start with srun and a torchrun rendezvous inside the worker's allocation.
        "srun": workload.nproc > 1,
    }


def parse_slurm_options(values: list[str]) -> tuple[tuple[str, str], ...]:
    """``--slurm-option KEY=VALUE`` (KEY as sbatch spells it without dashes: mem, exclusive=, ...)."""
    parsed = []
    for value in values:
        key, sep, setting = value.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not re.fullmatch(r"[a-z][a-z0-9-]*", key):
            raise ConfigError(
                f"--slurm-option {value!r}: write KEY=VALUE with sbatch's long option name, e.g. --slurm-option mem=64G"
            )
        parsed.append((key, setting))
    return tuple(parsed)


def check_executor(*, storage: str | None, resources: SlurmResources) -> None:
    """Refuse what SLURM workers could not run with, before anything is submitted."""
    from autotune.study.journal import journal_path
    from autotune.study.sqlite_reader import sqlite_path
    from autotune.study.storage import DEFAULT_STORAGE

    if shutil.which("sbatch") is None:
        raise ConfigError(
            "--executor slurm: sbatch is not found on PATH; run on a SLURM login node (or add SLURM's bin "
            "directory to PATH), or use --executor local"
        )
    url = storage or DEFAULT_STORAGE
    if url.startswith("sqlite:") or sqlite_path(url) is not None:
        raise ConfigError(
            f"--executor slurm: --storage {url} is a SQLite file, which the jobs on other nodes cannot share; "
            "use --storage journal:///shared/path/study.log (a shared file system) or postgresql://user@host/db"
        )
    if journal_path(url) is None and not url.startswith(("postgresql", "mysql")):
        raise ConfigError(
            f"--executor slurm: --storage {url} is not one the jobs can share; use "
            "journal:///shared/path/study.log or postgresql://user@host/db"
        )
    if resources.signal is not None and not _SIGNAL.match(resources.signal):
        raise ConfigError(f"--signal {resources.signal!r}: write it as sbatch does, e.g. B:USR1@120")
    if resources.nodes < 1 or resources.nproc < resources.nodes:
        raise ConfigError(
            f"--nodes {resources.nodes} with --nproc {resources.nproc}: each node runs at least one rank; "
            f"use --nproc {max(resources.nodes, 1)} or more"
        )
    if resources.nproc % resources.nodes:
        raise ConfigError(
            f"--nproc {resources.nproc} does not divide over --nodes {resources.nodes}; give each node the same ranks"
        )


def batch_script(*, spec_file: Path, log_dir: Path, name: str, resources: SlurmResources) -> str:
    """The job script of one worker: its #SBATCH lines, then the worker reading its spec."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --output={log_dir}/%x-%j.out"]
    lines += [f"#SBATCH {option}" for option in resources.sbatch_options()]
    lines += [
        "# A local helper's lifeline is its parent tune process; a SLURM worker's is its job.",
        "unset AUTOTUNE_PARENT_PID",
        # exec: the worker is the batch shell, so the --signal SLURM sends it (B:) reaches it.
        f"exec {shlex.quote(sys.executable)} -m autotune worker < {shlex.quote(str(spec_file))}",
    ]
    return "\n".join(lines) + "\n"


def submit_workers(
    specs: list[dict[str, Any]], *, resources: SlurmResources, job_name: str, directory: Path
) -> list[str]:
    """Submit one job per spec; return their job ids. The specs (they may hold a database URL with
    its password) are written readable by their owner only."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ids: list[str] = []
    try:
        for spec in specs:
            spec_file = directory / f"worker-{spec['worker']}.json"
            descriptor = os.open(spec_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                json.dump(spec, handle)
            script = batch_script(spec_file=spec_file, log_dir=directory, name=job_name, resources=resources)
            (directory / f"worker-{spec['worker']}.sbatch").write_text(script)
            done = subprocess.run(
                ["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=60, check=False
            )
            if done.returncode != 0:
                message = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
                raise ConfigError(f"--executor slurm: sbatch refused the worker job: {message}")
            ids.append(done.stdout.strip().split(";")[0])
    except BaseException:
        cancel_jobs(ids)  # all the workers or none
        raise
    return ids


def live_jobs(ids: list[str]) -> dict[str, str]:
    """The jobs of ``ids`` that have not ended, with their state (PENDING, RUNNING, REQUEUED, ...)."""
    if not ids:
        return {}
    # Every state: a job being requeued passes through states squeue leaves out by default.
    done = subprocess.run(
        ["squeue", "--noheader", "--me", "--states=all", "--format=%i %T"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise ConfigError(f"--executor slurm: squeue failed: {' '.join(done.stderr.split())}")
    wanted = set(ids)
    states = {}
    for line in done.stdout.splitlines():
        job, _, state = line.strip().partition(" ")
        if job in wanted and state not in _ENDED:
            states[job] = state
    return states


def wait_jobs(ids: list[str], *, on_change: Callable[[dict[str, str]], None] | None = None) -> None:
    """Until SLURM lists none of ``ids``; ``on_change`` hears each new set of states."""
    last: dict[str, str] | None = None
    while True:
        states = live_jobs(ids)
        if states != last and on_change is not None:
            on_change(states)
        last = states
        if not states:
            return
        time.sleep(_POLL_S)


def cancel_jobs(ids: list[str]) -> None:
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=60, check=False)


def requeue_self() -> bool:
    """Put this worker's own job back in the queue (after the pre-termination signal); False outside a job."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("scontrol") is None:
        return False
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False)
    return done.returncode == 0


def tune_on_slurm(
    *,
    study: str | None,
    spec: dict[str, Any],
    workers: int,
    confirm: bool,
    resources: SlurmResources,
    storage: str | None,
    directory: Path | None = None,
    on_submitted: Callable[[list[str], Path], None] | None = None,
    on_change: Callable[[dict[str, str]], None] | None = None,
) -> tuple[str, list[str]]:
    """Submit ``workers`` worker jobs on study ``study`` (None: the ``find`` study, named by the workers
    where they run), wait until SLURM lists none of them, and return the study's name and the job ids.

    ``spec`` is what a worker passes to :func:`autotune.search.tuner.tune`; worker 1 confirms the winner
    (when ``confirm``) once no trial is left running. Interrupting the wait cancels the jobs.
    """
    from autotune.errors import StorageError

    check_executor(storage=storage, resources=resources)
    if study is not None:
        _check_study(storage, study, spec["workload"])
    signal_name = None
    if resources.signal is not None:
        signal_name = resources.signal.removeprefix("B:").partition("@")[0]
    run = directory or Path("autotune-slurm") / f"{study or 'find'}-{time.strftime('%Y%m%d-%H%M%S')}"
    specs = [
        dict(spec, study=study, find=study is None, worker=i, confirm=confirm and i == 1, slurm_signal=signal_name)
        for i in range(1, workers + 1)
    ]
    ids = submit_workers(specs, resources=resources, job_name=f"autotune-{study or 'find'}", directory=run.absolute())
    if on_submitted is not None:
        on_submitted(ids, run)
    try:
        wait_jobs(ids, on_change=on_change)
    except BaseException:
        cancel_jobs(ids)
        raise
    if study is not None:
        return study, ids
    name = _study_of_jobs(storage, ids)
    if name is None:
        raise StorageError(
            f"--executor slurm: the worker jobs {', '.join(ids)} ended without creating a study; "
            f"their logs are in {run}/"
        )
    return name, ids


def _check_study(storage: str | None, study: str, workload: dict[str, Any]) -> None:
    """A study that exists answers its own question: workers for another workload (another --nodes,
    say) would each refuse it, so refuse them here, before any is submitted."""
    from autotune.errors import StorageError
    from autotune.study.journal import journal_path
    from autotune.study.storage import DEFAULT_STORAGE, open_storage, question_clash, stored_question

    path = journal_path(storage or DEFAULT_STORAGE)
    if path is not None and not path.exists():
        return  # no study yet, and no journal file to create for nothing
    stored = stored_question(open_storage(storage), study)
    clash = None if stored is None else question_clash(study, stored, {"workload": workload}, keys=("workload",))
    if clash is not None:
        raise StorageError(clash)


def _study_of_jobs(storage: str | None, ids: list[str]) -> str | None:
    """The study whose workers name one of these jobs."""
    from autotune.study.stale import JOB_ATTR_PREFIX
    from autotune.study.storage import open_storage

    for frozen in open_storage(storage).get_all_studies():
        if any(f"{JOB_ATTR_PREFIX}{job}" in frozen.user_attrs for job in ids):
            return frozen.study_name
    return None
