"""The scratch folders trials and scripts work in (a spec, the ranks' logs and records), and the sweep that
removes those a killed process left behind.

A folder goes when its ``with`` block ends. A tuner or worker killed with -9 runs no cleanup, and its
trials die with it (:mod:`autotune.trial.lifeline`), so nothing would ever remove their folders: each
folder's name says which process on which host made it, and the next folder of its kind made on that
host removes the ones whose maker is gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

# torchrun's --log-dir, read from the environment (torch.distributed.run's arguments take PET_<NAME>).
# Unset, each torchrun makes a torchelastic_* folder in the temporary directory and leaves it there.
TORCHRUN_LOG_DIR_ENV = "PET_LOG_DIR"


def scratch_folder(kind: str, *, parent: Path | None = None) -> tempfile.TemporaryDirectory[str]:
    """A new folder ``autotune-<kind>-<host>-<pid>-*`` in ``parent`` (the temporary directory by default),
    removed when its ``with`` block ends; first the folders of that kind that dead processes of this host
    left in ``parent``."""
    where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    sweep_left_behind(kind, where)
    return tempfile.TemporaryDirectory(prefix=f"{folder_prefix(kind)}{os.getpid()}-", dir=where)


def sweep_left_behind(kind: str, parent: Path) -> list[Path]:
    """Remove the ``kind`` folders in ``parent`` that this host's processes made and that are no longer
    running; those of live processes, other hosts (a shared file system) and other users stay. The ones
    removed."""
    prefix = folder_prefix(kind)
    removed = []
    for path in parent.glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and path.is_dir() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def torchrun_logs_in(work: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with torchrun's log folder inside ``work`` (unless the caller chose one), so that it goes with
    the trial's folder."""
    return {TORCHRUN_LOG_DIR_ENV: str(work / "torchrun"), **env}


def folder_prefix(kind: str) -> str:
    """What the names of this host's ``kind`` folders start with; the maker's pid follows."""
    # The host's name is hashed: a name may hold dashes, and pids mean nothing across hosts or containers.
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"autotune-{kind}-{host}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
