"""The processes this test run started, and no other's: the machine may be running another autotune
(another test run, or a user's trial) with processes of the same names.

Every process the run starts inherits ``MARK_ENV`` from its environment: conftest.py sets it once per
run, and a test may set its own (``own_processes``) to tell its processes from the run's others.
"""

from __future__ import annotations

import os
import uuid

import psutil

from autotune.trial.lifeline import TRIAL_PROCESS_NAME

MARK_ENV = "AUTOTUNE_TEST_MARK"
RUN_MARK = uuid.uuid4().hex


def started_here(process: psutil.Process, mark: str | None = None) -> bool:
    """Whether ``process`` carries ``mark``, or without one this run's (or the current test's): False for a
    process gone or another user's."""
    try:
        found = process.environ().get(MARK_ENV)
    except psutil.Error:
        return False
    return found == mark if mark is not None else found in {RUN_MARK, os.environ.get(MARK_ENV)}


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a killed child its reaper has not collected yet is gone for good)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def trial_processes() -> list[psutil.Process]:
    """This run's trials: in a new interpreter (their command line) or forked by a trial server (their name)."""
    return [
        p
        for p in psutil.process_iter(["cmdline", "name"])
        if ("autotune.trial.child" in " ".join(p.info["cmdline"] or []) or p.info["name"] == TRIAL_PROCESS_NAME)
        and started_here(p)
    ]
