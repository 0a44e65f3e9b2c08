"""Where a tuning may be interrupted: at once while a trial is measured (its process group is killed and the
trial recorded as interrupted), else at the next safe point, never inside a write to the study (a journal's
lock left held would stall every worker).

Ctrl-C raises KeyboardInterrupt wherever Python is; a SLURM worker's pre-termination notice (a signal handler)
asks for the same through :func:`interrupt_safely`. A signal reaches the process, so the request is the
process's: one :class:`_Request` per process.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["interrupt_safely", "stop_point", "measuring", "keeps_ctrl_c"]

_Call = TypeVar("_Call", bound=Callable[..., Any])


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


def keeps_ctrl_c(function: _Call) -> _Call:
    """``function`` with a Ctrl-C never lost while it runs. Python raises KeyboardInterrupt wherever the main thread
    is when SIGINT comes; inside a finalizer (a ``__del__``, a weakref callback: a database connection's, a
    temporary folder's) the exception is printed as ignored and the run goes on, as if no one had asked. So the
    handler also records the request, which the next safe point (:func:`stop_point`) obeys. A handler other than
    Python's own (a caller's, or SIGINT ignored) stays as it is."""

    @functools.wraps(function)
    def keeping(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return function(*args, **kwargs)
        before = signal.getsignal(signal.SIGINT)
        if before is not signal.default_int_handler:
            return function(*args, **kwargs)
        signal.signal(signal.SIGINT, _on_ctrl_c)
        try:
            return function(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, before)
            _REQUEST.requested = False  # asked of this call: the next one (a notebook's) starts afresh

    return keeping  # type: ignore[return-value]


def _on_ctrl_c(signum: int, frame: Any) -> None:
    _REQUEST.requested = True
    raise KeyboardInterrupt
