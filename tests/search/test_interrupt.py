"""A Ctrl-C that Python drops (raised inside a finalizer) still stops a tuning at its next safe point."""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from typing import Any

from autotune.search.interrupt import keeps_ctrl_c, stop_point


class _FinalizedDuringCtrlC:
    """An object whose finalizer is running when SIGINT comes: Python prints the KeyboardInterrupt raised there
    as ignored, and goes on."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the handler runs here, between two bytecodes of this loop
            pass


def _a_tuning_whose_ctrl_c_lands_in_a_finalizer() -> str:
    _FinalizedDuringCtrlC()  # dropped at once: its __del__ runs now
    gc.collect()
    try:
        stop_point()  # the next safe point
    except KeyboardInterrupt:
        return "stopped"
    return "went on"


def _dropped(monkeypatch: Any) -> list[type[BaseException]]:
    """The exceptions Python drops from now on (raised where nothing can catch them)."""
    dropped: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    return dropped


def test_a_ctrl_c_raised_inside_a_finalizer_stops_the_tuning_at_its_next_safe_point(monkeypatch):
    dropped = _dropped(monkeypatch)
    assert keeps_ctrl_c(_a_tuning_whose_ctrl_c_lands_in_a_finalizer)() == "stopped"
    assert dropped == [KeyboardInterrupt]  # the Ctrl-C did land in the finalizer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was
    stop_point()  # and the request was this call's: the next call starts afresh


def test_without_it_python_drops_that_ctrl_c(monkeypatch):
    dropped = _dropped(monkeypatch)
    assert _a_tuning_whose_ctrl_c_lands_in_a_finalizer() == "went on"
    assert dropped == [KeyboardInterrupt]
