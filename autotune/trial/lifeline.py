"""Trial processes die with the process that started them, even when it is killed with SIGKILL.

``kill -9`` of ``autotune tune`` gives it no chance to stop its trial; without this, the
orphaned trial would go on using the device while the resumed study measures the next one.
Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

__all__ = [
    "die_with_parent",
    "become_subreaper",
    "name_process",
    "expected_parent",
    "PARENT_PID_ENV",
    "TRIAL_PROCESS_NAME",
]

PARENT_PID_ENV = "AUTOTUNE_PARENT_PID"
TRIAL_PROCESS_NAME = "autotune-trial"  # what a trial forked by the trial server is called in ps
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel for SIGKILL when our parent exits; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    parent = expected_parent if expected_parent is not None else os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def become_subreaper() -> bool:
    """Make this process the one its orphaned descendants are handed to (and reaped by), not init: whether it
    now is (Linux only; elsewhere False)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def name_process(name: str) -> None:
    """Set the name ``ps`` and ``psutil.Process.name()`` show (15 bytes at most), e.g. for a forked
    trial, whose command line is still its server's. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def expected_parent() -> int | None:
    value = os.environ.get(PARENT_PID_ENV)
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    # ``python -m autotune.trial.lifeline MODULE ARGS...``: run MODULE (torchrun) tied to our parent.
    die_with_parent(expected_parent())
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
