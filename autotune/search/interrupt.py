"""Where a tuning may be interrupted: at once while a trial is measured (its process group is killed and the
trial recorded as interrupted), else at the next safe point, never inside a write to the study (a journal's
lock left held would stall every worker).

Ctrl-C raises KeyboardInterrupt wherever Python is; a SLURM worker's pre-termination notice (a signal handler)
asks for the same through :func:`interrupt_safely`. A signal reaches the process, so the request is the
process's: one :class:`_Request` per process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

__all__ = ["interrupt_safely", "stop_point", "measuring"]


@dataclass
class _Request:
    requested: bool = False  # a signal asked the tuning to stop
    in_trial: bool = False  # a trial is being measured: stopping now loses nothing of the study


_REQUEST = _Request()


def interrupt_safely() -> None:
    """For a signal handler (a SLURM worker's pre-termination notice): interrupt the tuning as Ctrl-C
    does, at once while a trial is measured, else at the next safe point."""
    _REQUEST.requested = True
    if _REQUEST.in_trial:
        raise KeyboardInterrupt


def stop_point() -> None:
    """A safe point: raise KeyboardInterrupt if a stop was asked for."""
    if _REQUEST.requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """While a trial is measured: a stop asked for now interrupts it at once."""
    stop_point()
    _REQUEST.in_trial = True
    try:
        stop_point()
        yield
    finally:
        _REQUEST.in_trial = False
