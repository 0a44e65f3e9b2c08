"""Several tuning processes on one study: helper workers, and the lock that keeps proposals apart.

``tune(workers=N)`` runs N-1 helper processes (``python -m autotune worker``) beside itself on
the same study; workers on other machines join by running ``tune`` on the same storage URL
(PostgreSQL or MySQL: Optuna's own distributed mode). Every worker proposes under
:func:`proposal_lock`, which covers reading the study, choosing a config and creating its trial:
the next worker's proposal then sees that trial as taken, so no config is measured twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from autotune.errors import ConfigError

__all__ = ["proposal_lock", "cpu_turn", "turn_lock_paths", "start_helpers", "wait_helpers", "gpu_slices"]

_local_lock = threading.Lock()
_engines: dict[str, Any] = {}


@contextlib.contextmanager
def proposal_lock(url: str, study: str) -> Iterator[None]:
    """Hold the study's proposal lock, across processes and machines that share the storage.

    SQLite (one machine) and a journal file (on a shared file system: NFS passes ``flock`` on to
    the server): an exclusive ``flock`` on a file next to it. PostgreSQL and MySQL: a server-side
    advisory lock named after the study, so workers anywhere wait their turn.
    """
    from sqlalchemy.engine import make_url

    from autotune.study.journal import journal_path

    journal = journal_path(url)
    parsed = make_url(url) if journal is None else None
    backend = "journal" if parsed is None else parsed.get_backend_name()
    with _local_lock:
        if parsed is None or backend == "sqlite":
            if parsed is None:
                assert journal is not None  # not a database URL: a journal file
                database = journal
            else:
                assert parsed.database, "open_storage refuses an in-memory SQLite database"
                database = Path(parsed.database).expanduser()
            with _file_lock(database.with_suffix(".proposals.lock")):
                yield
        elif backend in ("postgresql", "mysql"):
            with _server_lock(url, backend, study):
                yield
        else:
            yield  # a backend without advisory locks: proposals may collide, nothing is lost


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        os.chmod(lock_path, 0o600)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _server_lock(url: str, backend: str, study: str) -> Iterator[None]:
    import sqlalchemy

    engine = _engines.get(url)
    if engine is None:
        engine = _engines[url] = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    key = int.from_bytes(hashlib.sha256(f"autotune:{study}".encode()).digest()[:8], "big", signed=True)
    release: tuple[str, dict[str, Any]]
    with engine.connect() as connection:
        if backend == "postgresql":
            connection.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            release = ("SELECT pg_advisory_unlock(:key)", {"key": key})
        else:
            connection.execute(sqlalchemy.text("SELECT GET_LOCK(:name, -1)"), {"name": f"autotune:{key}"})
            release = ("SELECT RELEASE_LOCK(:name)", {"name": f"autotune:{key}"})
        try:
            yield
        finally:
            connection.execute(sqlalchemy.text(release[0]), release[1])


@contextlib.contextmanager
def cpu_turn(device_type: str) -> Iterator[None]:
    """On a CPU, trials of this machine take turns on the cores they share: a trial timed while another
    one computes on the same cores measures the other as much as itself (with three workers on two cores,
    the fastest config read 10x slower than alone and lost). One exclusive ``flock`` per core this process
    may run on (its affinity, which its trial inherits), per user, in the temporary directory, so separate
    ``autotune`` runs take turns too; runs confined to cores of their own (``taskset``, a cgroup's cpuset)
    do not wait on each other. Workers with GPUs of their own (the only way workers get GPUs, see
    :func:`gpu_slices`) never wait.
    """
    if device_type != "cpu":
        yield
        return
    with contextlib.ExitStack() as held:
        # In the cores' order: two processes never hold one core's lock each while waiting for the other's.
        for path in turn_lock_paths():
            handle = held.enter_context(open(path, "a"))
            fcntl.flock(handle, fcntl.LOCK_EX)  # released as the file closes
        yield


def turn_lock_paths() -> list[Path]:
    """The lock files of :func:`cpu_turn`: one per core this process may run on, or one for the whole machine
    where a process cannot be pinned (macOS)."""
    prefix = Path(tempfile.gettempdir()) / f"autotune-{os.getuid()}-cpu"
    if not hasattr(os, "sched_getaffinity"):
        return [Path(f"{prefix}.turn.lock")]
    return [Path(f"{prefix}{core}.turn.lock") for core in sorted(os.sched_getaffinity(0))]


def gpu_slices(workers: int, ranks: int, device: Any) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each worker: its own GPUs when there are enough.

    None (the environment left as it is) on a CPU or for a single worker. The slices are taken
    from the GPUs already visible, since CUDA_VISIBLE_DEVICES counts from those, not from all.
    """
    if device.type != "cuda" or workers == 1:
        return [None] * workers
    if workers * ranks > device.count:
        raise ConfigError(
            f"--workers {workers} x --nproc {ranks} needs {workers * ranks} GPUs, {device.count} "
            "visible: workers sharing a GPU would measure each other's memory; use fewer workers"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",")] if visible else [str(i) for i in range(device.count)]
    return [",".join(ids[w * ranks : (w + 1) * ranks]) for w in range(workers)]


def start_helpers(spec: dict[str, Any], gpus: list[str | None]) -> list[subprocess.Popen[bytes]]:
    """Start one helper per entry of ``gpus`` (after the caller's own slice), each tuning ``spec``."""
    from autotune.trial.lifeline import PARENT_PID_ENV

    helpers = []
    for index, visible in enumerate(gpus, start=2):
        env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        worker_spec = dict(spec, worker=index)
        process = subprocess.Popen([sys.executable, "-m", "autotune", "worker"], stdin=subprocess.PIPE, env=env)
        assert process.stdin is not None
        process.stdin.write(json.dumps(worker_spec).encode())
        process.stdin.close()
        helpers.append(process)
    return helpers


def wait_helpers(helpers: list[subprocess.Popen[bytes]]) -> list[int]:
    return [process.wait() for process in helpers]
