"""Where estimates run: a server process that imports the heavy libraries once and forks per estimate.

A traced estimate leaves its process unfit for another (fake tensors, PEFT and some models'
code leave state that can crash a later trace), so each estimate needs a fresh process, and
starting one from scratch pays PyTorch's, Transformers' and PEFT's imports every time. This
server (``python -m autotune.estimate.worker``) imports them once (a model's Transformers module at the
first trace of its architecture, PEFT at the first trace that may make adapters, an optimizer's library at its
first trace), then for each request line
on stdin forks a child that traces, writes the traced step's figures to a pipe as JSON and exits without
teardown; the server keeps the traced steps, derives the estimate from one (ZeRO and DDP are
arithmetic on the plain step, so configs differing only there share a trace) and writes one JSON
line per request on stdout, after a first ``{"ready": 1}`` once its imports are done. It dies with the
process that started it. A ``{"probe": [device type, what], "env"}`` request forks the device probe
(:mod:`autotune.trial.device_probe`) instead: ``{"probe": what it measured, or null}``. A ``{"all": [request,
...]}`` request traces what its estimates need together, as many at once as there are cores, and answers
``{"all": [reply, ...]}``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Sequence

from autotune.trial import fork_server
from autotune.trial.fork_server import Reply

__all__ = ["serve"]


def serve() -> None:
    traces = _Traces()

    def answer(request: dict[str, Any], reply: Reply) -> None:
        if "probe" in request:
            answered = _probe(request)
        elif "all" in request:
            answered = {"all": _answer_all(request["all"], traces)}
        else:
            answered = _answer(request, traces)
        traces.forget_failures()
        reply(answered)

    fork_server.serve(_import_once, answer)


def _import_once() -> None:
    # An estimate for a CUDA workload traces on fake CUDA tensors, which would make a context here: each trace
    # runs forked, and the server itself makes none (fork_server.serve).
    import torch  # noqa: F401 - imported once here, inherited by every forked estimate
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    from transformers import (  # noqa: F401
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    import autotune.trial.engine  # noqa: F401
    import autotune.trial.memory  # noqa: F401
    from autotune.estimate.trace import prepare_tracing

    prepare_tracing()


def _probe(request: dict[str, Any]) -> dict[str, Any]:
    """{"probe": what the device probe measured, or None}: forked from here, as the trial server forks it
    (:func:`autotune.trial.device_probe.forked_probe`), instead of a new interpreter importing torch."""
    from autotune.trial.device_probe import forked_probe

    device_type, what = request["probe"]
    return {"probe": forked_probe(device_type, what, request["env"], forked=lambda pid: None)}


_KEPT_TRACES = 128  # a plan's families at two proxy depths; a 7B's whole trace is 20k allocation events


class _Traces:
    """The traced steps this server has made, newest last: configs that differ only in ZeRO's stage or
    offload share one (their estimates are arithmetic on it), and so do a plan's proxies."""

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._failed: dict[str, str] = {}  # why a trace of this request failed: said again, not traced again

    def get(self, workload: Any, config: Any, task: str | None, measured_with: Any) -> Any:
        return self.get_all([workload], config, task, measured_with)[0]

    def get_all(
        self, workloads: list[Any], config: Any, task: str | None, measured_with: Any, ahead: Sequence[Any] = ()
    ) -> list[Any]:
        """``config``'s traced step for each workload (a plan's two proxy depths): those not kept are traced in
        children forked together, as many at once as there are cores, so two depths cost one trace's wall time
        on two cores. Where ``config`` is traced, so is the first config of ``ahead`` (the caller's next) that
        needs traces of its own: the deeper copies of both first, then the shallower, so that the cores trace
        steps of one depth, which take about as long, side by side (a 2-layer copy traces in about two thirds of a
        4-layer one's time: alone beside it, its core would idle for the rest). Not where ``config`` is refused:
        its next would be traced alone, and the one after it with nothing beside it."""
        keys = self._keys(workloads, config, task, measured_with)
        items = list(zip(keys, workloads, [config] * len(keys), strict=True))
        untraced = [item for item in items if item[0] not in self._kept and item[0] not in self._failed]
        twins: dict[str, tuple[str, Any]] = {}
        if untraced and not any(self._refused(*item) for item in untraced):
            twins = self._wanted_twins(items, ahead, task, measured_with)
            taken = {*keys, *(twin_key for twin_key, _ in twins.values())}
            partner = self._first_untraced(workloads, ahead, taken, task, measured_with)
            twins.update(self._wanted_twins(partner, ahead, task, measured_with))
            items += partner
            items.sort(key=lambda item: -workloads.index(item[1]))  # the last workload is the deepest copy
        self._trace_missing(items, task, measured_with, twins)
        for key in keys:
            if key in self._failed:
                raise _TraceFailed(self._failed[key])
            self._kept.move_to_end(key)
        return [self._kept[key] for key in keys]

    @staticmethod
    def _keys(workloads: list[Any], config: Any, task: str | None, measured_with: Any) -> list[str]:
        from autotune.estimate.trace import trace_key

        return [trace_key(workload, config, task=task, measured_with=measured_with) for workload in workloads]

    def _wanted_twins(
        self, items: list[tuple[str, Any, Any]], ahead: Sequence[Any], task: str | None, measured_with: Any
    ) -> dict[str, tuple[str, Any]]:
        """For each item's key, the key and config of its update twin (see :func:`trace.trace_step`'s
        ``fork_update``), where the caller asks for that twin next (it is in ``ahead``) and it is not traced yet: a
        trace that forks as its update begins makes both, for little more than one."""
        from autotune.levers.optimizer import update_twin

        wanted = set(ahead)
        twins = {}
        for key, workload, config in items:
            twin = update_twin(config)
            if twin is not None and twin in wanted:
                twin_key = self._keys([workload], twin, task, measured_with)[0]
                if twin_key not in self._kept and twin_key not in self._failed:
                    twins[key] = (twin_key, twin)
        return twins

    def _first_untraced(
        self, workloads: list[Any], ahead: Sequence[Any], taken: set[str], task: str | None, measured_with: Any
    ) -> list[tuple[str, Any, Any]]:
        """The traces of the first config of ``ahead`` whose steps are none of those kept, failed or ``taken``, and
        are not refused before they start."""
        for config in ahead:
            keys = self._keys(workloads, config, task, measured_with)
            items = list(zip(keys, workloads, [config] * len(keys), strict=True))
            if not any(key in self._kept or key in self._failed or key in taken for key, _, _ in items):
                if not any(self._refused(*item) for item in items):
                    return items
        return []

    def trace_all(self, workload: Any, configs: list[Any], task: str | None, measured_with: Any) -> None:
        """Trace the steps of ``configs`` not kept yet, as many at once as there are cores: each estimate asked
        next finds its step kept, or why its trace failed (until the request's end: :meth:`forget_failures`)."""
        from autotune.estimate.trace import trace_key

        keyed = [(trace_key(workload, c, task=task, measured_with=measured_with), workload, c) for c in configs]
        self._trace_missing(keyed, task, measured_with)

    def forget_failures(self) -> None:
        """A later request traces a failed step again (a child killed for memory may fit another time)."""
        self._failed.clear()

    def _trace_missing(
        self,
        items: list[tuple[str, Any, Any]],
        task: str | None,
        measured_with: Any,
        twins: dict[str, tuple[str, Any]] | None = None,
    ) -> None:
        """Trace the steps of ``items`` not kept yet; ``twins``: for an item's key, its update twin's key and
        config, kept from the same trace (see :meth:`_wanted_twins`)."""
        twins = twins or {}
        missing = {key: (w, c) for key, w, c in items if key not in self._kept and key not in self._failed}
        missing = {key: item for key, item in missing.items() if not self._refused(key, *item)}
        for workload, config in missing.values():  # once each: a module imported already costs nothing
            _preload_for(workload, config)
        plain = {key: item for key, item in missing.items() if item[1].pp == 1}
        for key, (workload, config) in missing.items():
            if config.pp > 1:  # each stage's rank traced in a child of its own, as many at once as there are cores
                from autotune.estimate.trace import pipeline_step

                try:
                    self._keep(key, pipeline_step(_stages_in_children(workload, config, task, measured_with)))
                except _TraceFailed as exc:
                    self._failed[key] = str(exc)
        traced = _in_children(
            [(workload, config, task, measured_with, None, key in twins) for key, (workload, config) in plain.items()]
        )
        for key, (step, twin_step) in zip(plain, traced, strict=True):
            if isinstance(step, _TraceFailed):
                self._failed[key] = str(step)
            else:
                self._keep(key, step)
            if twin_step is not None:  # a twin whose trace failed is traced on its own, when asked for
                self._keep(twins[key][0], twin_step)

    def _refused(self, key: str, workload: Any, config: Any) -> bool:
        """Whether the trace of ``config`` is refused before it starts (FSDP's offload on a GPU, say): its
        child would say only that, so none is forked (a plan asks for hundreds of such configs)."""
        from autotune.estimate.trace import refuse_untraceable

        try:
            refuse_untraceable(workload, config)
        except Exception as exc:  # noqa: BLE001 - said as the child would say it (see _trace)
            self._failed[key] = _one_line(exc)
            return True
        return False

    def _keep(self, key: str, traced: Any) -> None:
        self._kept[key] = traced
        while len(self._kept) > _KEPT_TRACES:
            self._kept.popitem(last=False)


def _preload_for(workload: Any, config: Any) -> None:
    """Import here, before the fork, what the trace of ``config`` imports first: the model's Transformers module
    (1.6 of a tiny model's 2.0 s estimate went to it in each child), PEFT where the trace may make adapters
    (LoRA's, a factory's) and the optimizer's library (see :func:`autotune.trial.server.preload_libraries`)."""
    from autotune.estimate.trace import may_hold_adapters
    from autotune.models.sources import import_model_module
    from autotune.trial.server import preload_libraries

    import_model_module(workload.model, trust_remote_code=workload.trust_remote_code)
    preload_libraries(config, adapters=may_hold_adapters(workload, config))


def _answer(request: dict[str, Any], traces: _Traces) -> dict[str, Any]:
    """{"ok": the estimate} or {"error": why}. The trace runs in a child; the arithmetic on it here
    (plain Python over its figures: nothing of the traced state comes back but numbers)."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.depth_proxy import extrapolate
    from autotune.estimate.measured_with import MeasuredWith
    from autotune.estimate.trace import estimate_from_trace

    started = time.perf_counter()
    workload, config = Workload.from_dict(request["workload"]), TrialConfig.from_dict(request["config"])
    task, measured_with = request.get("task"), MeasuredWith.from_dict(request.get("measured_with"))
    try:
        proxy = request.get("proxy")
        if proxy is None:
            estimate = estimate_from_trace(traces.get(workload, config, task, measured_with), workload, config)
        else:
            shallow, deeper = Workload.from_dict(proxy["shallow"]), Workload.from_dict(proxy["deeper"])
            ahead = [TrialConfig.from_dict(c) for c in request.get("ahead", ())]
            two, four = traces.get_all([shallow, deeper], config, task, measured_with, ahead)
            like = estimate_from_trace(four, deeper, config)  # its allocator's reserve stands for the whole model's
            estimate = estimate_from_trace(extrapolate(two, four, proxy["layers"]), workload, config, cuda_as=like)
        # What this answer cost: a kept trace is not paid for again.
        return {"ok": dataclasses.replace(estimate, seconds=time.perf_counter() - started).to_dict()}
    except _TraceFailed as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the caller raises it as an EstimateError
        return {"error": _one_line(exc)}


def _answer_all(request: dict[str, Any], traces: _Traces) -> list[dict[str, Any]]:
    """``{"workload", "configs", "task", "measured_with"}``: each config's reply, as :func:`_answer` gives it,
    after tracing the steps they need together."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.measured_with import MeasuredWith

    workload = Workload.from_dict(request["workload"])
    configs = [TrialConfig.from_dict(c) for c in request["configs"]]
    task, measured_with = request.get("task"), MeasuredWith.from_dict(request.get("measured_with"))
    try:
        traces.trace_all(workload, configs, task, measured_with)
    except Exception:  # noqa: BLE001 - each estimate below traces again on its own and says why it failed
        pass
    return [_answer({**request, "config": c.to_dict(), "proxy": None}, traces) for c in configs]


class _TraceFailed(Exception):
    """A trace's exception, in words (it happened in the child)."""


def _one_line(exc: BaseException) -> str:
    message = (str(exc).strip().splitlines() or [""])[-1]
    return f"{type(exc).__name__}: {message}"


def _stages_in_children(workload: Any, config: Any, task: str | None, measured_with: Any) -> list[Any]:
    """Every pipeline stage's traced step, in stage order, ``os.cpu_count()`` children at a time."""
    stages = [
        step
        for step, _ in _in_children([(workload, config, task, measured_with, rank, False) for rank in range(config.pp)])
    ]
    failed = next((stage for stage in stages if isinstance(stage, _TraceFailed)), None)
    if failed is not None:
        raise failed
    return stages


def _in_children(traces: list[tuple[Any, Any, str | None, Any, int | None, bool]]) -> list[tuple[Any, Any]]:
    """Each ``(workload, config, task, measured_with, pipeline_rank, with_twin)``'s traced step, or the
    :class:`_TraceFailed` that says why not, in order, each beside its update twin's traced step where
    ``with_twin`` (None where that trace failed): traced in forked children ``os.cpu_count()`` at a time (a
    trace is one core's work; a twin's update, forked from its trace, little more)."""
    at_once = max(1, os.cpu_count() or 1)
    traced: list[tuple[Any, Any]] = []
    for first in range(0, len(traces), at_once):
        children = [_fork_trace(*trace) for trace in traces[first : first + at_once]]
        for child in children:  # every child collected, so none is left behind when one failed
            traced.append(_collect(*child))
    return traced


def _fork_trace(
    workload: Any,
    config: Any,
    task: str | None,
    measured_with: Any,
    pipeline_rank: int | None = None,
    with_twin: bool = False,
) -> tuple[int, int, int | None]:
    """Fork; the child traces and writes the result (or why it failed) to a pipe as JSON, then exits. With
    ``with_twin``, the child forks again as the update begins, and its own child writes the update twin's
    step to a second pipe (see :func:`autotune.estimate.trace.trace_step`'s ``fork_update``). Returns the
    child's pid and the pipes' read ends (the second None without a twin), for :func:`_collect`."""
    read_end, write_end = os.pipe()
    twin_read, twin_write = os.pipe() if with_twin else (None, None)
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        if twin_read is not None:
            os.close(twin_read)
        out, forked = [write_end, twin_write], []

        def fork_update() -> bool:
            """Fork; True in the new process, which writes the twin's step from here on."""
            branch = os.fork()
            if branch == 0:
                os.close(out.pop(0))
                return True
            forked.append(branch)
            os.close(out.pop())
            return False

        result = _trace(workload, config, task, measured_with, pipeline_rank, fork_update if with_twin else None)
        with os.fdopen(out[0], "w") as pipe:
            pipe.write(json.dumps(result))
        for branch in forked:  # the twin's process: written and gone before this one is
            os.waitpid(branch, 0)
        os._exit(0)  # skip teardown: the traced state's finalisers are not worth waiting (or crashing) for
    os.close(write_end)
    if twin_write is not None:
        os.close(twin_write)
    return pid, read_end, twin_read


def _collect(pid: int, read_end: int, twin_read: int | None = None) -> tuple[Any, Any]:
    """The traced step a child of :func:`_fork_trace` wrote (or the :class:`_TraceFailed` that says why not) and
    its twin's (None without one, or where its trace failed), once it has exited. Both pipes are read before
    the wait: the child waits for its twin's process, which may be waiting for its pipe to be read."""
    from autotune.estimate.results import TracedStep

    with os.fdopen(read_end) as reply:
        text = reply.read()
    twin_text = ""
    if twin_read is not None:
        with os.fdopen(twin_read) as reply:
            twin_text = reply.read()
    _, status = os.waitpid(pid, 0)
    twin = json.loads(twin_text) if twin_text else {}
    twin_step = TracedStep.from_dict(twin["ok"]) if "ok" in twin else None
    if not text:
        return _TraceFailed(f"the estimate's process died ({_describe(status)})"), twin_step
    result = json.loads(text)
    if "error" in result:
        return _TraceFailed(result["error"]), twin_step
    return TracedStep.from_dict(result["ok"]), twin_step


def _trace(
    workload: Any,
    config: Any,
    task: str | None,
    measured_with: Any,
    pipeline_rank: int | None = None,
    fork_update: Any = None,
) -> dict[str, Any]:
    from autotune.estimate.trace import trace_step

    try:
        traced = trace_step(
            workload,
            config,
            task=task,
            measured_with=measured_with,
            pipeline_rank=pipeline_rank,
            fork_update=fork_update,
        )
        return {"ok": traced.to_dict()}
    except Exception as exc:
        return {"error": _one_line(exc)}


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


if __name__ == "__main__":
    from autotune.trial.lifeline import die_with_parent

    die_with_parent()
    serve()
