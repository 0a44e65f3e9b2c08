"""Where studies live: Optuna's RDB storage behind a SQLAlchemy URL, or its journal storage behind
``journal://PATH`` (:mod:`autotune.study.journal`), and what autotune keeps in it.

The database stays a plain Optuna study (``optuna-dashboard`` and ``optuna.load_study`` read
it). autotune adds, in the study's user attributes, the question the study answers
(workload, device, memory budget, search space), and in each trial's user attributes the
TrialConfig and the TrialResult.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from autotune.errors import StorageError
from autotune.study.stale import grace_s, heartbeat_s, recover_stale_trials, worker_id

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
    "question_clash",
    "META_KEY",
    "worker_id",
]

DEFAULT_STORAGE = "sqlite:///storage/autotune.db"
META_KEY = "autotune"  # study user attribute: the question the study answers
_SQLITE_LOCK_TIMEOUT_S = 60  # wait this long for another worker's write instead of failing
_SCHEMA_ATTEMPTS = 10  # processes creating one fresh schema at once: each try gets further
# The parts of the question that must match for a study to be resumed.
_IDENTITY = ("workload", "space_digest", "device", "memory_budget_bytes", "headroom", "command")


def open_storage(url: str | None = None) -> optuna.storages.BaseStorage:
    """Open (creating when missing) the storage at ``url``; default ``sqlite:///storage/autotune.db``.

    ``journal://PATH`` opens Optuna's journal storage on that file; anything else is a SQLAlchemy URL.
    """
    import optuna
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    from autotune.study.journal import journal_path, open_journal

    url = url or DEFAULT_STORAGE
    if journal_path(url) is not None:
        return open_journal(url)
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise StorageError(
            f"--storage {url!r} is not a database URL; use e.g. {DEFAULT_STORAGE}, postgresql://user@host/db "
            "or journal:///shared/path/study.log"
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
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=max(1, round(heartbeat_s())),
                grace_period=max(2, round(grace_s())),
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
    if sqlite_path(url) is not None or url.startswith("journal://"):  # no password: shown as it is
        return url
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def create_study(storage: optuna.storages.BaseStorage, name: str, meta: dict[str, Any]) -> optuna.Study:
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
    clash = question_clash(name, stored, meta)
    if clash is not None:
        raise StorageError(clash)
    return study


def question_clash(
    name: str, stored: dict[str, Any], meta: dict[str, Any], keys: tuple[str, ...] = _IDENTITY
) -> str | None:
    """Why study ``name``, made for question ``stored``, cannot answer ``meta`` (None: it can), on ``keys``.
    A workload that differs is named by its flags (``--nodes differs: stored 2, now 1``)."""
    for key in keys:
        if _canonical(stored.get(key)) == _canonical(meta.get(key)):
            continue
        what = f"{key} differs: stored {_short(stored.get(key))}, now {_short(meta.get(key))}"
        if key == "workload":
            what = _workload_differences(stored.get(key), meta.get(key)) or what
        return f"--study {name} answers another question ({what}); use a new --study name, or the same flags as before"
    return None


def _workload_differences(stored: Any, now: Any) -> str | None:
    """The workload flags whose values differ, each field at its default where a dict leaves it out."""
    import dataclasses

    from autotune.config.workload import Workload
    from autotune.errors import AutotuneError

    try:
        old, new = (dataclasses.asdict(Workload.from_dict(dict(w))) for w in (stored, now))
    except (AutotuneError, TypeError, ValueError):
        return None  # stored by a version this one cannot read: the plain difference says it
    fields = [f for f in old if old[f] != new[f]]
    return "; ".join(f"--{f.replace('_', '-')} differs: stored {old[f]}, now {new[f]}" for f in fields) or None


def stored_question(storage: optuna.storages.BaseStorage, name: str) -> dict[str, Any] | None:
    """The question study ``name`` was made for (None: no such study, or not autotune's)."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return storage.get_study_user_attrs(study_id).get(META_KEY)


def load_study(storage: optuna.storages.BaseStorage, name: str, url: str | None) -> optuna.Study:
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


def study_names(storage: optuna.storages.BaseStorage) -> list[str]:
    return sorted(s.study_name for s in storage.get_all_studies())


def find_study_name(meta: dict[str, Any], space_name: str) -> str:
    """A stable name for ``autotune find``: the same question always finds the same study."""
    model = re.sub(r"[^A-Za-z0-9.-]+", "-", meta["workload"]["model"].removeprefix("builtin:")).strip("-")[-40:]
    # Without a command the key is what it was before script mode, so earlier find studies are found.
    key = json.dumps({k: meta.get(k) for k in _IDENTITY if k != "command" or meta.get(k)}, sort_keys=True)
    space = re.sub(r"[^A-Za-z0-9.-]+", "-", Path(space_name).stem)
    return f"find-{model}-{space}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
