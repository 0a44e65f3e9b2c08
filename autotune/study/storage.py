"""Where studies live: Optuna's RDB storage behind a SQLAlchemy URL, and what autotune keeps in it.

The database stays a plain Optuna study (``optuna-dashboard`` and ``optuna.load_study`` read
it). autotune adds, in the study's user attributes, the question the study answers
(workload, device, memory budget, search space), and in each trial's user attributes the
TrialConfig and the TrialResult.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import socket
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from autotune.errors import StorageError

if TYPE_CHECKING:
    import optuna

__all__ = [
    "DEFAULT_STORAGE",
    "open_storage",
    "display_url",
    "create_study",
    "load_study",
    "study_names",
    "recover_stale_trials",
    "find_study_name",
    "stored_question",
    "META_KEY",
    "HEARTBEAT_S",
]

DEFAULT_STORAGE = "sqlite:///storage/autotune.db"
META_KEY = "autotune"  # study user attribute: the question the study answers
HEARTBEAT_S = 20  # a running trial's heartbeat; 6 missed ones make it stale
_GRACE_S = 6 * HEARTBEAT_S
_SQLITE_LOCK_TIMEOUT_S = 60  # wait this long for another worker's write instead of failing
_SCHEMA_ATTEMPTS = 10  # processes creating one fresh schema at once: each try gets further
# The parts of the question that must match for a study to be resumed.
_IDENTITY = ("workload", "space_digest", "device", "memory_budget_bytes", "headroom", "command")


def open_storage(url: str | None = None) -> optuna.storages.RDBStorage:
    """Open (creating when missing) the storage at ``url``; default ``sqlite:///storage/autotune.db``."""
    import optuna
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    url = url or DEFAULT_STORAGE
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise StorageError(
            f"--storage {url!r} is not a database URL; use e.g. {DEFAULT_STORAGE} or postgresql://user@host/db"
        ) from None
    engine_kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise StorageError(
                f"--storage {url}: an in-memory SQLite database would be lost at exit; "
                f"name a file, e.g. {DEFAULT_STORAGE}"
            )
        database = Path(parsed.database).expanduser()
        database.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Studies hold model names, paths and hosts: readable by their owner only. SQLite's journal
        # and WAL files copy the database's permissions.
        database.touch(mode=0o600, exist_ok=True)
        engine_kwargs["connect_args"] = {"timeout": _SQLITE_LOCK_TIMEOUT_S}

    def rdb_storage() -> optuna.storages.RDBStorage:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats
            return optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=_GRACE_S
            )

    try:
        for attempt in range(1, _SCHEMA_ATTEMPTS):
            try:
                return rdb_storage()
            except sqlalchemy.exc.DBAPIError as exc:
                if not _lost_schema_race(exc):
                    raise
                time.sleep(random.uniform(0.01, 0.05) * attempt)  # apart, so the next try finds it done
        return rdb_storage()
    except ImportError:
        extra = " (pip install 'autotune[postgres]')" if parsed.get_backend_name() == "postgresql" else ""
        raise StorageError(
            f"--storage {display_url(url)}: the database driver for {parsed.drivername} is not installed{extra}"
        ) from None
    except Exception as exc:  # server down, bad credentials, not a database file
        raise StorageError(f"--storage {display_url(url)}: cannot open it: {_one_line(exc)}") from None


def _lost_schema_race(exc: Exception) -> bool:
    """Another process created part of a fresh schema between Optuna's look and its own write.

    Optuna creates each missing table, then inserts its one version_info row and stamps
    alembic_version: the loser of each step gets "already exists" or a UNIQUE violation. Each
    step is idempotent, so trying again finds what the winner made and adds only what is missing;
    every table's indexes are made by whoever made the table, so the schema ends whole.
    """
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.IntegrityError):
        return True
    return isinstance(
        exc, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.ProgrammingError)
    ) and "already exists" in str(exc)


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna logs every study it creates; autotune reports its own progress instead."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def display_url(url: str | None) -> str:
    """The URL with any password hidden, for output and JSON."""
    from autotune.study.sqlite_reader import sqlite_path

    url = url or DEFAULT_STORAGE
    if sqlite_path(url) is not None:  # no password, and SQLAlchemy renders it unchanged: skip importing it
        return url
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def create_study(storage: optuna.storages.RDBStorage, name: str, meta: dict[str, Any]) -> optuna.Study:
    """Create study ``name``, or load it when it exists and asks the same question (``meta``)."""
    import optuna

    with quiet_optuna():
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
    stored = study.user_attrs.get(META_KEY)
    if stored is None:
        if study.trials:
            raise StorageError(f"--study {name} exists and was not created by autotune; use another --study name")
        study.set_user_attr(META_KEY, meta)
        return study
    for key in _IDENTITY:
        if _canonical(stored.get(key)) != _canonical(meta.get(key)):
            raise StorageError(
                f"--study {name} answers another question ({key} differs: stored {_short(stored.get(key))}, "
                f"now {_short(meta.get(key))}); use a new --study name, or the same flags as before"
            )
    return study


def stored_question(storage: optuna.storages.RDBStorage, name: str) -> dict[str, Any] | None:
    """The question study ``name`` was made for (None: no such study, or not autotune's)."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id).get(META_KEY)


def load_study(storage: optuna.storages.RDBStorage, name: str, url: str | None) -> optuna.Study:
    import optuna

    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise no_such_study(name, url, study_names(storage)) from None
    if META_KEY not in study.user_attrs:
        raise not_autotune(name)
    return study


def no_such_study(name: str, url: str | None, known: list[str]) -> StorageError:
    hint = f"studies there: {', '.join(known)}" if known else "it holds no study yet"
    return StorageError(f"--study {name}: no such study in {display_url(url)} ({hint})")


def not_autotune(name: str) -> StorageError:
    return StorageError(f"--study {name} was not created by autotune (no {META_KEY!r} attribute)")


def study_names(storage: optuna.storages.RDBStorage) -> list[str]:
    return sorted(s.study_name for s in storage.get_all_studies())


def find_study_name(meta: dict[str, Any], space_name: str) -> str:
    """A stable name for ``autotune find``: the same question always finds the same study."""
    model = re.sub(r"[^A-Za-z0-9.-]+", "-", meta["workload"]["model"].removeprefix("builtin:")).strip("-")[-40:]
    # Without a command the key is what it was before script mode, so earlier find studies are found.
    key = json.dumps({k: meta.get(k) for k in _IDENTITY if k != "command" or meta.get(k)}, sort_keys=True)
    space = re.sub(r"[^A-Za-z0-9.-]+", "-", Path(space_name).stem)
    return f"find-{model}-{space}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def worker_id() -> dict[str, Any]:
    """Who runs a trial: recovery tells a dead local worker from a live remote one by this."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Mark RUNNING trials whose worker is gone as interrupted (FAIL); return their numbers.

    A worker on this host is gone when its process is; one elsewhere when its heartbeat is
    older than the grace period (Optuna's own stale-trial rule).
    """
    import optuna
    from optuna.trial import TrialState

    here = socket.gethostname()
    stale = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker") or {}
        if worker.get("host") == here and not _alive(worker.get("pid"), worker.get("started")):
            study._storage.set_trial_user_attr(trial._trial_id, "status", "interrupted")
            study.tell(trial.number, state=TrialState.FAIL)
            stale.append(trial.number)
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # remote workers whose heartbeat stopped
    after = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    return sorted(stale + list(before - after))


def _alive(pid: Any, started: Any) -> bool:
    import psutil

    if not isinstance(pid, int):
        return False
    try:
        process = psutil.Process(pid)
        # A recycled pid belongs to a process younger than the trial's worker.
        return not isinstance(started, (int, float)) or process.create_time() <= started + 1
    except psutil.NoSuchProcess:
        return False


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
