"""Processes that open one fresh SQLite database at the same moment: all of them succeed, and the
schema they leave is the one a single process creates (workers and a resumed `find` do this)."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from autotune.study.storage import create_study, open_storage

PROCESSES = 8
RACES = 3  # before the fix every race of 8 lost 4-6 processes (20 of 20 races failed)


def _open_and_create(urls: list[str], barrier, results) -> None:
    import optuna  # noqa: F401  (imported before the first barrier: the processes really start together)

    for url in urls:
        barrier.wait()
        try:
            study = create_study(open_storage(url), "race", {"workload": {"model": "builtin:gpt2-tiny"}})
            results.put((url, "ok", study.study_name))
        except Exception as exc:
            results.put((url, "failed", f"{type(exc).__name__}: {exc}"))
            barrier.abort()  # the others stop at the next race instead of waiting for this one
            raise


def _schema(path: Path) -> set[tuple[str, str, str]]:
    with sqlite3.connect(path) as db:
        return set(db.execute("SELECT type, name, sql FROM sqlite_master"))


def _rows(path: Path, table: str) -> list[tuple]:
    with sqlite3.connect(path) as db:
        return list(db.execute(f"SELECT * FROM {table}"))


@pytest.mark.slow
def test_eight_processes_open_one_fresh_sqlite_database_at_once(tmp_path):
    databases = [tmp_path / f"race{i}" / "autotune.db" for i in range(RACES)]
    urls = [f"sqlite:///{db}" for db in databases]
    # Separate processes, each with its own connections, as separate commands would be: forks of one new
    # interpreter that has imported Optuna (a fork of this multi-threaded test process could inherit a held lock),
    # where eight new interpreters would each import Optuna and SQLAlchemy again.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["optuna", "autotune.study.storage", __name__])
    barrier, results = ctx.Barrier(PROCESSES, timeout=120), ctx.Queue()
    processes = [ctx.Process(target=_open_and_create, args=(urls, barrier, results)) for _ in range(PROCESSES)]
    for p in processes:
        p.start()
    outcomes = []
    try:
        for _ in range(PROCESSES * RACES):
            outcomes.append(results.get(timeout=120))
            if outcomes[-1][1] != "ok":
                break
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
    failed = [o for o in outcomes if o[1] != "ok"]
    assert not failed
    assert [p.exitcode for p in processes] == [0] * PROCESSES

    reference = tmp_path / "alone.db"
    open_storage(f"sqlite:///{reference}")
    for database in databases:
        # The schema is whole: every table and index one process alone creates, the version rows once.
        assert _schema(database) == _schema(reference)
        assert _rows(database, "alembic_version") == _rows(reference, "alembic_version")
        assert _rows(database, "version_info") == _rows(reference, "version_info")
        assert [row[1] for row in _rows(database, "studies")] == ["race"]
