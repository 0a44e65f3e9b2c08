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
import time
from typing import Any, Iterator, Sequence

from autotune.estimate.trace_children import TraceChildren, TraceFailed, one_line, traced_in_children
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
        self._children = TraceChildren()  # the traces under way, kept across requests
        # Each config's keys and refusal, once: a plan asks for the same configs ahead of hundreds of requests.
        self._key_of: dict[tuple[Any, ...], str] = {}
        self._refusal_of: dict[str, str | None] = {}

    def get(self, workload: Any, config: Any, task: str | None, measured_with: Any) -> Any:
        return self.get_all([workload], config, task, measured_with)[0]

    def get_all(
        self, workloads: list[Any], config: Any, task: str | None, measured_with: Any, ahead: Sequence[Any] = ()
    ) -> list[Any]:
        """``config``'s traced step for each workload (a plan's two proxy depths): those not kept are traced in
        children, as many at once as there are cores, so two depths cost one trace's wall time on two cores.

        ``ahead``: the configs the caller asks for next, in order. A core that is free of ``config``'s traces
        traces theirs (the deeper copy first, which takes longest), and those children run on while this request
        is answered and the next one asked: the cores are kept busy. Not where ``config`` is refused (its caller
        may learn from its answer what it asks next). A config of ``ahead`` that is the update twin of one traced
        (see :func:`autotune.levers.optimizer.update_twin`) is made by that one's trace."""
        asked = self._deepest_first(workloads, config, task, measured_with)
        keys = [key for key, _, _ in reversed(asked)]  # in the workloads' order
        if config.pp > 1:  # its stages are traced together (see _trace_missing)
            self._trace_missing(asked, task, measured_with)
        else:
            untraced = [item for item in asked if not self._done(item[0]) and item[0] not in self._children]
            refused = [self._refused(*item) for item in untraced]  # each said, none left to start
            later = iter(()) if any(refused) else self._later(workloads, ahead, task, measured_with)
            self._run(asked, later, set(ahead), task, measured_with)
        for key in keys:
            if key in self._failed:
                raise TraceFailed(self._failed[key])
            self._kept.move_to_end(key)
        return [self._kept[key] for key in keys]

    def _done(self, key: str) -> bool:
        return key in self._kept or key in self._failed

    def _keys(self, workloads: list[Any], config: Any, task: str | None, measured_with: Any) -> list[str]:
        from autotune.estimate.trace import trace_key

        keys = []
        for workload in workloads:
            asked = (workload, config, task, measured_with)
            if asked not in self._key_of:
                self._key_of[asked] = trace_key(workload, config, task=task, measured_with=measured_with)
            keys.append(self._key_of[asked])
        return keys

    def _deepest_first(
        self, workloads: list[Any], config: Any, task: str | None, measured_with: Any
    ) -> list[tuple[str, Any, Any]]:
        """``(key, workload, config)`` of ``config``'s trace on each workload, the last (the deepest copy, which
        takes longest) first."""
        keys = self._keys(workloads, config, task, measured_with)
        return list(zip(keys, workloads, [config] * len(keys), strict=True))[::-1]

    def _later(
        self, workloads: list[Any], ahead: Sequence[Any], task: str | None, measured_with: Any
    ) -> Iterator[tuple[str, Any, Any]]:
        """The traces of ``ahead``'s configs, each config's deepest copy first, but for those of a config refused
        before it starts (made when asked for)."""
        for config in ahead:
            items = self._deepest_first(workloads, config, task, measured_with)
            if not any(not self._done(key) and self._refused(key, workload, config) for key, workload, config in items):
                yield from items

    def _run(
        self,
        asked: list[tuple[str, Any, Any]],
        later: Iterator[tuple[str, Any, Any]],
        wanted: set[Any],
        task: str | None,
        measured_with: Any,
    ) -> None:
        """Trace until every step ``asked`` is kept or failed: those first, then ``later``'s on the cores they
        leave free. ``wanted``: the configs whose update twins' steps are made by the trace of theirs."""
        while True:
            missing = [item for item in asked if not self._done(item[0])]
            for item in missing:
                if self._children.free:
                    self._start(item, wanted, task, measured_with)
            while self._children.free and (next_item := next(later, None)) is not None:
                self._start(next_item, wanted, task, measured_with)
            if not missing:
                return
            if len(self._children):
                for key, step in self._children.wait():
                    if isinstance(step, TraceFailed):
                        self._failed[key] = str(step)
                    else:
                        self._keep(key, step)

    def _start(self, item: tuple[str, Any, Any], wanted: set[Any], task: str | None, measured_with: Any) -> None:
        """Start the trace of ``item`` in a child, and with it its update twin's where that is ``wanted``; nothing
        where it is kept, under way, failed or refused."""
        from autotune.levers.optimizer import update_twin

        key, workload, config = item
        if self._done(key) or key in self._children or self._refused(key, workload, config):
            return
        twin, twin_key = update_twin(config), None
        if twin is not None and twin in wanted:
            twin_key = self._keys([workload], twin, task, measured_with)[0]
            if self._done(twin_key) or twin_key in self._children:
                twin_key = None
        _preload_for(workload, config)
        self._children.start(key, workload, config, task, measured_with, twin_key=twin_key)

    def trace_all(self, workload: Any, configs: list[Any], task: str | None, measured_with: Any) -> None:
        """Trace the steps of ``configs`` not kept yet, as many at once as there are cores: each estimate asked
        next finds its step kept, or why its trace failed (until the request's end: :meth:`forget_failures`)."""
        from autotune.estimate.trace import trace_key

        keyed = [(trace_key(workload, c, task=task, measured_with=measured_with), workload, c) for c in configs]
        self._trace_missing(keyed, task, measured_with)

    def forget_failures(self) -> None:
        """A later request traces a failed step again (a child killed for memory may fit another time)."""
        self._failed.clear()

    def _trace_missing(self, items: list[tuple[str, Any, Any]], task: str | None, measured_with: Any) -> None:
        """Trace the steps of ``items`` not kept yet, as many at once as there are cores, and wait for them."""
        missing = {key: (w, c) for key, w, c in items if not self._done(key)}
        missing = {key: item for key, item in missing.items() if not self._refused(key, *item)}
        for workload, config in missing.values():  # once each: a module imported already costs nothing
            _preload_for(workload, config)
        plain = {key: item for key, item in missing.items() if item[1].pp == 1}
        for key, (workload, config) in missing.items():
            if config.pp > 1:  # each stage's rank traced in a child of its own, as many at once as there are cores
                from autotune.estimate.trace import pipeline_step

                try:
                    self._keep(key, pipeline_step(_stages_in_children(workload, config, task, measured_with)))
                except TraceFailed as exc:
                    self._failed[key] = str(exc)
        traced = traced_in_children(
            [(workload, config, task, measured_with, None) for workload, config in plain.values()]
        )
        for key, step in zip(plain, traced, strict=True):
            if isinstance(step, TraceFailed):
                self._failed[key] = str(step)
            else:
                self._keep(key, step)

    def _refused(self, key: str, workload: Any, config: Any) -> bool:
        """Whether the trace of ``config`` is refused before it starts (FSDP's offload on a GPU, say): its
        child would say only that, so none is forked (a plan asks for hundreds of such configs)."""
        from autotune.estimate.trace import refuse_untraceable

        if key not in self._refusal_of:
            try:
                refuse_untraceable(workload, config)
                self._refusal_of[key] = None
            except Exception as exc:  # noqa: BLE001 - said as the child would say it (see trace_children)
                self._refusal_of[key] = one_line(exc)
        refusal = self._refusal_of[key]
        if refusal is not None:
            self._failed[key] = refusal
        return refusal is not None

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

    model = (workload.model, workload.trust_remote_code)
    if model not in _IMPORTED_MODELS:  # reading its config again costs 10 ms, at every trace a plan starts
        import_model_module(workload.model, trust_remote_code=workload.trust_remote_code)
        _IMPORTED_MODELS.add(model)
    preload_libraries(config, adapters=may_hold_adapters(workload, config))


_IMPORTED_MODELS: set[tuple[str, bool]] = set()


def _answer(request: dict[str, Any], traces: _Traces) -> dict[str, Any]:
    """{"ok": the estimate} or {"error": why}. The trace runs in a child; the arithmetic on it here
    (plain Python over its figures: nothing of the traced state comes back but numbers)."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
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
            estimate = estimate_from_trace(_line(two, four, proxy["layers"]), workload, config, cuda_as=like)
        # What this answer cost: a kept trace is not paid for again.
        return {"ok": dataclasses.replace(estimate, seconds=time.perf_counter() - started).to_dict()}
    except TraceFailed as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the caller raises it as an EstimateError
        return {"error": one_line(exc)}


# The lines drawn last through two kept traces, with the traces (held: no other step takes their ids). The configs a
# plan asks for share traces (ZeRO's stages, compile and tf32 share a plain one): one line each.
_LINES: collections.OrderedDict[tuple[int, int, int], tuple[Any, Any, Any]] = collections.OrderedDict()


def _line(two: Any, four: Any, layers: int) -> Any:
    """:func:`autotune.estimate.depth_proxy.extrapolate` of the traced steps ``two`` and ``four`` at ``layers``,
    drawn once for each pair."""
    from autotune.estimate.depth_proxy import extrapolate

    key = (id(two), id(four), layers)
    if key not in _LINES:
        _LINES[key] = (two, four, extrapolate(two, four, layers))
        if len(_LINES) > _KEPT_TRACES:
            _LINES.popitem(last=False)
    _LINES.move_to_end(key)
    return _LINES[key][2]


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


def _stages_in_children(workload: Any, config: Any, task: str | None, measured_with: Any) -> list[Any]:
    """Every pipeline stage's traced step, in stage order, ``os.cpu_count()`` children at a time."""
    stages = traced_in_children([(workload, config, task, measured_with, rank) for rank in range(config.pp)])
    failed = next((stage for stage in stages if isinstance(stage, TraceFailed)), None)
    if failed is not None:
        raise failed
    return stages


if __name__ == "__main__":
    from autotune.trial.lifeline import die_with_parent

    die_with_parent()
    serve()
