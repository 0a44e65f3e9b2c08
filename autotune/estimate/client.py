"""The caller's side of the estimate server (:mod:`autotune.estimate.worker`): :func:`predict_memory` asks it for
an estimate, each traced in a process forked from it, so the caller's process stays clean; the device probe can
be forked from it too. One server per caller process, started on first use and killed when the caller exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from autotune.errors import ConfigError
from autotune.estimate.measured_with import AS_INSTALLED, MeasuredWith
from autotune.estimate.results import EstimateError, MemoryEstimate
from autotune.trial.fork_server import ServerGone, ServerProcess

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "estimate_server_process",
    "predict_memory",
    "predict_memories",
    "probe_in_estimate_server",
    "start_estimate_server",
    "wait_for_estimate_server",
]


class _Proxy(Protocol):
    """What ``predict_memory(proxy=)`` takes: :class:`autotune.estimate.depth_proxy.DepthProxy`."""

    def to_dict(self) -> dict[str, Any]: ...


def predict_memory(
    workload: Workload,
    config: TrialConfig,
    *,
    task: str | None = None,
    timeout_s: float = 300,
    measured_with: MeasuredWith = AS_INSTALLED,
    proxy: _Proxy | None = None,
    ahead: Sequence[TrialConfig] = (),
) -> MemoryEstimate:
    """:func:`autotune.estimate.trace.estimate_memory` in a fresh process, like a trial: the caller's process
    stays clean.

    Fake tensors, PEFT and Transformers' model code leave state behind that can crash a later
    estimate in the same process, so each runs in its own process, forked by a server that has
    the libraries imported already (:mod:`autotune.estimate.worker`, started on first use and
    kept for the caller's lifetime), which keeps the traced steps: a config that differs from one
    estimated before only in ZeRO's stage or offload is arithmetic on that trace. Raises
    EstimateError when the estimate fails or takes longer than ``timeout_s``.

    ``proxy``: the workload's model drawn from its 2- and 4-layer copies
    (:mod:`autotune.estimate.depth_proxy`), not traced whole. ``measured_with``: what a published
    measurement ran beyond autotune's knobs, to rebuild it (:mod:`autotune.estimate.measured_with`).
    ``ahead``: configs the caller will ask for next, with the same ``proxy``: where this estimate traces, the
    first of them that needs a trace of its own is traced beside it (see :meth:`worker._Traces.get_all`).
    """
    from autotune.prepare import refusal_before_trial

    refusal = refusal_before_trial(workload, config, task)  # refused in words, as a trial refuses it
    if refusal is not None:
        raise ConfigError(refusal)
    proxied = proxy is not None and config.pp == 1  # pipeline stages cut the real depth: a copy has too few layers
    request = {
        "workload": workload.to_dict(),
        "config": config.to_dict(),
        "task": task,
        "measured_with": measured_with.to_dict(),
        "proxy": proxy.to_dict() if proxy is not None and proxied else None,
        # Only what would be asked for through the proxy too. A hint: what it traces changes no answer.
        "ahead": [c.to_dict() for c in ahead if proxied and c.pp == 1],
    }
    reply = _SERVER.ask(request, timeout_s)
    if "error" in reply:
        raise EstimateError(f"the estimate failed: {reply['error']}")
    return MemoryEstimate.from_dict(reply["ok"])


def predict_memories(
    workload: Workload, configs: list[TrialConfig], *, task: str | None = None, timeout_s: float = 300
) -> list[MemoryEstimate | EstimateError | ConfigError]:
    """:func:`predict_memory` for each of ``configs``, their steps traced together, as many at once as there are
    cores (a trace is one core's work: two configs on two cores take one trace's wall time). Each config's
    estimate, or the error :func:`predict_memory` would raise for it."""
    from autotune.prepare import refusal_before_trial

    refusals = [refusal_before_trial(workload, config, task) for config in configs]
    asked = [config for config, refusal in zip(configs, refusals, strict=True) if refusal is None]
    request = {
        "workload": workload.to_dict(),
        "configs": [config.to_dict() for config in asked],
        "task": task,
        "measured_with": AS_INSTALLED.to_dict(),
    }
    replies = iter(_SERVER.ask({"all": request}, timeout_s * len(asked))["all"] if asked else [])

    def answer(refusal: str | None) -> MemoryEstimate | EstimateError | ConfigError:
        if refusal is not None:
            return ConfigError(refusal)
        reply = next(replies)  # an asked config's: in the order asked
        return (
            MemoryEstimate.from_dict(reply["ok"])
            if "ok" in reply
            else EstimateError(f"the estimate failed: {reply['error']}")
        )

    return [answer(refusal) for refusal in refusals]


class _EstimateServer:
    """The caller's handle on the estimate server (``python -m autotune.estimate.worker``), one request at a time."""

    def __init__(self) -> None:
        self._server = ServerProcess("autotune.estimate.worker")
        self._lock = threading.Lock()

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self._lock:
            started = time.monotonic()
            try:
                self._server.send(request)  # it waits in the pipe while the server imports
                self._server.wait_ready(timeout_s)
                return self._server.reply(timeout_s - (time.monotonic() - started))
            except TimeoutError:
                self._server.close()  # a late answer must not be read as the next request's
                raise EstimateError(f"the estimate took more than {timeout_s:g} s") from None
            except (ServerGone, BrokenPipeError):
                self._server.close()
                raise EstimateError("the estimate server exited") from None

    def start(self, *, forked: bool = False) -> None:
        """Start the server now, if it is not running, without waiting for its imports (``forked``: a fork of
        this process, see :meth:`ServerProcess.start`)."""
        with self._lock:
            self._server.start(forked=forked)

    @property
    def process(self) -> ServerProcess:
        return self._server

    def wait_if_starting(self) -> None:
        """Wait until a server started already has imported everything (a server that died is left for
        the next estimate to find out); nothing where none was started."""
        with self._lock:
            if self._server.started:
                with contextlib.suppress(TimeoutError, ServerGone):
                    self._server.wait_ready()

    def close(self) -> None:
        self._server.close()


_SERVER = _EstimateServer()
atexit.register(_SERVER.close)


def start_estimate_server(*, forked: bool = False) -> None:
    """Start the estimate server in the background now, its imports beside the caller's own checks;
    the first estimate's request waits in its pipe until it reads it. Not beside trials or the device
    probe: its imports would take a core their free cores are read from (:func:`wait_for_estimate_server`).
    ``forked``: a fork of this process, which has imported torch and Transformers (``autotune.cli.servers``)."""
    _SERVER.start(forked=forked)


def estimate_server_process() -> ServerProcess:
    """The handle on this process's estimate server, for the trial server to fork it beside its own start
    (:func:`autotune.trial.runner.start_trial_server`): one import of the libraries for the two."""
    return _SERVER.process


def probe_in_estimate_server(device_type: str, what: str, *, timeout_s: float) -> Any:
    """The device probe's ``what`` (see :func:`autotune.trial.device_probe.run_probe`) forked from the estimate
    server, started now if it is not running, once its imports are done: what it measured, or None where it
    failed (the caller then probes in a new interpreter)."""
    try:
        return _SERVER.ask({"probe": [device_type, what], "env": dict(os.environ)}, timeout_s).get("probe")
    except EstimateError:
        return None


def wait_for_estimate_server() -> None:
    """Wait until an estimate server started in the background has done its imports (nothing where none
    was started): before what reads the free cores, as the device probe does."""
    _SERVER.wait_if_starting()
