"""Workers that die: who runs a trial, its heartbeat while it runs, and failing the trials of workers
that are gone, so that no trial stays RUNNING and its config is measured again.

A worker is gone when its process is (a worker on this host), or when its trial's heartbeat is older
than the grace period (a worker anywhere). The RDB storages keep heartbeats in Optuna's own table
(``heartbeat_interval``/``grace_period``: stale by the database server's clock); the journal storage
has no such table, so the heartbeat is a trial system attribute in the journal (stale by the
reader's clock: the cluster's nodes keep their clocks in step, and the grace period is minutes).

A lost trial is failed with status ``interrupted`` and the reason in its ``lost`` attribute; the
tuner then re-queues its config once (Optuna's ``RetryFailedTrialCallback`` with ``max_retry=1``),
the retry carrying ``retry_of``. A config whose retry is lost too is not tried a third time: a
config that kills its worker (host memory, a driver fault) would otherwise take every worker down.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna

__all__ = [
    "HEARTBEAT_ENV",
    "heartbeat_s",
    "grace_s",
    "worker_id",
    "record_heartbeat",
    "recover_stale_trials",
    "LOST_ATTR",
    "RETRY_ATTR",
    "MAX_LOST",
    "JOB_ATTR_PREFIX",
    "record_worker_job",
    "worker_jobs",
]

HEARTBEAT_ENV = "AUTOTUNE_HEARTBEAT_S"  # seconds between a running trial's heartbeats (default 20)
_DEFAULT_HEARTBEAT_S = 20
_MISSED_BEATS = 6  # a trial is stale after this many missed heartbeats
LOST_ATTR = "lost"  # trial user attribute: why its worker was taken for gone
RETRY_ATTR = "retry_of"  # trial user attribute: the number of the lost trial this one measures again
MAX_LOST = 2  # a config lost this many times (its first run and its one retry) is not re-queued
JOB_ATTR_PREFIX = "slurm_job:"  # study user attribute per SLURM worker job: slurm_job:<id> -> who ran it
_JOURNAL_BEAT = "autotune:heartbeat"  # trial system attribute on the journal storage: time.time()


def heartbeat_s() -> float:
    value = os.environ.get(HEARTBEAT_ENV, "")
    try:
        return max(0.1, float(value)) if value else _DEFAULT_HEARTBEAT_S
    except ValueError:
        return _DEFAULT_HEARTBEAT_S


def grace_s() -> float:
    return _MISSED_BEATS * heartbeat_s()


def worker_id() -> dict[str, Any]:
    """Who runs a trial: recovery tells a dead local worker from a live remote one by this; a SLURM
    worker also names its job."""
    who: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    if os.environ.get("SLURM_JOB_ID"):
        who["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return who


def record_heartbeat(study: optuna.Study, number: int) -> None:
    """One heartbeat of the running trial ``number`` of ``study``, in whichever storage holds it."""
    storage, trial_id = _storage_and_trial_id(study, number)
    if _has_heartbeats(storage):
        storage.record_heartbeat(trial_id)
    else:
        storage.set_trial_system_attr(trial_id, _JOURNAL_BEAT, time.time())


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials whose worker is gone (status ``interrupted``, ``lost`` says why);
    return their numbers. Call it under the study's proposal lock, so one worker fails each."""
    import optuna
    from optuna.trial import TrialState

    here = socket.gethostname()
    stale = _stale_by_heartbeat(study)
    lost = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker") or {}
        job = f", SLURM job {worker['slurm_job']}" if worker.get("slurm_job") else ""
        if worker.get("host") == here and not _alive(worker.get("pid"), worker.get("started")):
            reason = f"its worker (pid {worker.get('pid')} on {here}{job}) is gone"
        elif trial.number in stale:
            reason = f"its worker ({worker.get('host', 'host unknown')}{job}) sent no heartbeat for {grace_s():.0f} s"
        else:
            continue
        try:
            # Study has no method for a user attribute of a trial not in hand: the storage's, by the trial's id.
            storage, trial_id = _storage_and_trial_id(study, trial.number)
            storage.set_trial_user_attr(trial_id, "status", "interrupted")
            storage.set_trial_user_attr(trial_id, LOST_ATTR, reason)
            study.tell(trial.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue  # it finished meanwhile, or another worker failed it first
        lost.append(trial.number)
    return lost


def _stale_by_heartbeat(study: optuna.Study) -> set[int]:
    """Numbers of the running trials whose heartbeat is older than the grace period."""
    from optuna.trial import TrialState

    from autotune.study.optuna_private import stale_trial_ids, storage_of

    storage: Any = storage_of(study)
    if _has_heartbeats(storage):
        if storage.get_heartbeat_interval() is None:
            return set()
        # The heartbeat table's own rule, by the database server's clock.
        study_id = storage.get_study_id_from_name(study.study_name)
        return {storage.get_trial(trial_id).number for trial_id in stale_trial_ids(storage, study_id)}
    stale = set()
    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        beat = trial.system_attrs.get(_JOURNAL_BEAT)
        if beat is None:  # never beat: asked and not started, or its worker died at once
            worker = trial.user_attrs.get("worker") or {}
            beat = worker.get("started") or (trial.datetime_start.timestamp() if trial.datetime_start else now)
        if now - beat > grace_s():
            stale.add(trial.number)
    return stale


def _storage_and_trial_id(study: optuna.Study, number: int) -> tuple[Any, int]:
    """The study's storage and the id it knows trial ``number`` by (what the storage's methods take)."""
    from autotune.study.optuna_private import storage_of

    storage = storage_of(study)
    study_id = storage.get_study_id_from_name(study.study_name)
    return storage, storage.get_trial_id_from_study_id_trial_number(study_id, number)


def _has_heartbeats(storage: Any) -> bool:
    """Whether the storage keeps Optuna's heartbeats (``RDBStorage``, and Optuna's cache around it): the
    journal storage does not."""
    return callable(getattr(storage, "record_heartbeat", None))


def _alive(pid: Any, started: Any) -> bool:
    import psutil

    if not isinstance(pid, int):
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # killed, and its parent (a tune with helpers) not told yet
            return False
        # A recycled pid belongs to a process younger than the trial's worker.
        return not isinstance(started, (int, float)) or process.create_time() <= started + 1
    except psutil.NoSuchProcess:
        return False


def record_worker_job(study: optuna.Study, worker: int | None = None) -> None:
    """A worker inside a SLURM job names its job in the study (``show`` and ``studies`` list them)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    who = {
        "worker": worker,
        "host": socket.gethostname(),
        "nodes": os.environ.get("SLURM_JOB_NODELIST"),
        "started": time.time(),
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
    }
    study.set_user_attr(f"{JOB_ATTR_PREFIX}{job}", who)


def worker_jobs(user_attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """The SLURM worker jobs a study names, oldest first: job id, worker number, host, start time."""
    jobs = [
        dict(value, job=key.removeprefix(JOB_ATTR_PREFIX))
        for key, value in user_attrs.items()
        if key.startswith(JOB_ATTR_PREFIX) and isinstance(value, dict)
    ]
    return sorted(jobs, key=lambda job: job.get("started") or 0)
