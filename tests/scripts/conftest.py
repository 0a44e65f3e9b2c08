from __future__ import annotations

import uuid
from typing import Callable

import psutil
import pytest
from processes import MARK_ENV, started_here


@pytest.fixture
def own_processes(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], list[psutil.Process]]:
    """``own_processes("plain_loop.py")``: the live processes of that script started by this test, and
    no other's. Each test marks its environment, which every process it starts inherits: the machine
    may be running another copy of the same script (another test run, or a user's)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_ENV, mark)

    def find(script: str) -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if len(cmdline) < 2 or not cmdline[1].endswith(script):  # python SCRIPT ...: not a tuner naming it
                continue
            if started_here(process, mark):
                found.append(process)
        return found

    return find
