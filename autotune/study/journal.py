"""Studies in a journal file: Optuna's JournalStorage, for clusters with a shared file system and no
database server (``--storage journal:///shared/path/study.log``).

Every change to a study is one line appended to the file under a lock that works over NFS (Optuna's
``JournalFileSymlinkLock``: a symlink is created atomically there), and a reader replays the lines.
Optuna's JournalStorage has no heartbeat table; :mod:`autotune.study.stale` keeps a running trial's
heartbeat in the journal itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import StorageError

if TYPE_CHECKING:
    import optuna

__all__ = ["JOURNAL_SCHEME", "journal_path", "open_journal"]

JOURNAL_SCHEME = "journal://"


def journal_path(url: str) -> Path | None:
    """The file a ``journal://PATH`` URL names (``journal:///abs/study.log``, or ``journal://rel.log``
    under the current directory); None for any other URL."""
    if not url.startswith(JOURNAL_SCHEME):
        return None
    path = url[len(JOURNAL_SCHEME) :]
    if not path or path.endswith("/"):
        raise StorageError(f"--storage {url}: name the journal file, e.g. journal:///shared/autotune/study.log")
    return Path(path).expanduser()


def open_journal(url: str) -> optuna.storages.JournalStorage:
    """The journal storage at ``url``, its file created (readable by its owner only) when missing."""
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = journal_path(url)
    assert path is not None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)  # studies hold model names, paths and hosts
        return JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:
        raise StorageError(
            f"--storage {url}: cannot open {path}: {exc.strerror or exc}; name a file in a directory you can write to"
        ) from None
    except Exception as exc:  # a file that is not a journal
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise StorageError(
            f"--storage {url}: {path} is not an Optuna journal ({type(exc).__name__}: {lines[0] if lines else ''})"
        ) from None
