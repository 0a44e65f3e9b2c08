"""A study read from its SQLite file with the standard library: what ``show``, ``export`` and ``studies`` need.

Opening Optuna's RDBStorage costs more than half a second before the first row is read
(SQLAlchemy, Alembic, the schema check), longer than the whole command should take. This reads
the few tables autotune uses (studies, their user attributes, trials with their state, times and
user attributes) read-only, and only from a database whose schema this code knows: the Optuna
version it was written for (``SCHEMA_VERSION``, ``ALEMBIC_REVISION``; a test compares them with
the installed Optuna). Anything else (another database, another schema, any SQLite error) returns
None and the caller reads through Optuna, which stays the reference: a test checks both paths give
the same summary. Nothing here imports Optuna.
"""

from __future__ import annotations

import datetime
import json
import re
import sqlite3
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "ALEMBIC_REVISION",
    "StoredTrial",
    "StoredStudy",
    "StudyFile",
    "read_study_file",
    "sqlite_path",
]

SCHEMA_VERSION = 12  # optuna.storages._rdb.models.SCHEMA_VERSION this reader was written for
ALEMBIC_REVISION = "v3.2.0.a"  # the head of Optuna's Alembic migrations, as stamped in alembic_version
_LOCK_TIMEOUT_S = 60  # a writer's commit holds the file briefly: wait, as the Optuna path does
# Only plain URLs whose path SQLAlchemy would take as it is (no %-escapes, query, or user/host part):
# then the file opened and the URL shown are the same as on the Optuna path.
_PLAIN_SQLITE = re.compile(r"^sqlite:///([^?#%@]+)$")


@dataclass(frozen=True)
class StoredTrial:
    """The parts of Optuna's FrozenTrial autotune reads; ``state`` is TrialState's name."""

    number: int
    state: str
    user_attrs: dict[str, Any]
    datetime_start: datetime.datetime | None
    datetime_complete: datetime.datetime | None


@dataclass(frozen=True)
class StoredStudy:
    """The parts of ``optuna.Study`` autotune reads."""

    study_name: str
    user_attrs: dict[str, Any]
    trials: list[StoredTrial] = field(default_factory=list)

    def get_trials(self, deepcopy: bool = False) -> list[StoredTrial]:
        return list(self.trials)


@dataclass(frozen=True)
class StudyFile:
    """One consistent read of a study database: every study's name, and the studies asked for."""

    names: list[str]  # sorted, as autotune.study.storage.study_names gives them
    studies: dict[str, StoredStudy]


def sqlite_path(url: str) -> str | None:
    """The file a plain ``sqlite:///PATH`` URL names; None for any other URL."""
    match = _PLAIN_SQLITE.match(url)
    return None if match is None or match[1] == ":memory:" else match[1]


def read_study_file(url: str, only: str | None = None) -> StudyFile | None:
    """Every study in the SQLite database at ``url`` (only study ``only`` when given), or None when
    this reader cannot be sure to read it as Optuna would: then read it through Optuna."""
    path = sqlite_path(url)
    if path is None or not Path(path).is_file():
        return None
    try:
        uri = f"file:{urllib.parse.quote(str(Path(path).absolute()))}?mode=ro"
        connection = sqlite3.connect(uri, uri=True, timeout=_LOCK_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        connection.execute("BEGIN")  # one snapshot: trials and their attributes from the same moment
        if not _known_schema(connection):
            return None
        ids = dict(connection.execute("SELECT study_name, study_id FROM studies"))
        wanted = [only] if only is not None else list(ids)
        studies = {name: _study(connection, name, ids[name]) for name in wanted if name in ids}
        return StudyFile(names=sorted(ids), studies=studies)
    except (sqlite3.Error, ValueError, TypeError, KeyError):  # not the tables or values Optuna writes
        return None
    finally:
        connection.close()


def _known_schema(connection: sqlite3.Connection) -> bool:
    versions = connection.execute("SELECT schema_version FROM version_info").fetchall()
    revisions = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    return versions == [(SCHEMA_VERSION,)] and revisions == [(ALEMBIC_REVISION,)]


def _study(connection: sqlite3.Connection, name: str, study_id: int) -> StoredStudy:
    user_attrs = {
        key: json.loads(value)
        for key, value in connection.execute(
            "SELECT key, value_json FROM study_user_attributes WHERE study_id = ? ORDER BY study_user_attribute_id",
            (study_id,),
        )
    }
    trial_attrs: dict[int, dict[str, Any]] = {}
    for trial_id, key, value in connection.execute(
        "SELECT a.trial_id, a.key, a.value_json FROM trial_user_attributes a JOIN trials t ON a.trial_id = "
        "t.trial_id WHERE t.study_id = ? ORDER BY a.trial_user_attribute_id",
        (study_id,),
    ):
        trial_attrs.setdefault(trial_id, {})[key] = json.loads(value)
    trials = [
        StoredTrial(
            number=number,
            state=state,
            user_attrs=trial_attrs.get(trial_id, {}),
            datetime_start=_local(start),
            datetime_complete=_local(complete),
        )
        for trial_id, number, state, start, complete in connection.execute(
            "SELECT trial_id, number, state, datetime_start, datetime_complete FROM trials "
            "WHERE study_id = ? ORDER BY trial_id",
            (study_id,),
        )
    ]
    return StoredStudy(study_name=name, user_attrs=user_attrs, trials=trials)


def _local(stored: str | None) -> datetime.datetime | None:
    """Optuna keeps naive UTC (SQLAlchemy's text form) and hands out naive local time: the same here."""
    if stored is None:
        return None
    utc = datetime.datetime.fromisoformat(stored).replace(tzinfo=datetime.timezone.utc)
    return utc.astimezone().replace(tzinfo=None)
