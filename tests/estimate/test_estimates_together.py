"""Estimates asked together (``predict_memories``): traced as many at once as there are cores, each the estimate
it is when asked alone; a config whose estimate fails answers its error in its place."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memories, predict_memory
from autotune.estimate.results import EstimateError, MemoryEstimate

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, device="cpu")


def test_estimates_asked_together_are_the_ones_asked_alone():
    configs = [TrialConfig(micro_batch=2), TrialConfig(micro_batch=4, checkpointing=True), TrialConfig(micro_batch=1)]
    together = predict_memories(WORKLOAD, configs)
    assert all(isinstance(e, MemoryEstimate) for e in together)
    alone = [predict_memory(WORKLOAD, config) for config in configs]  # kept by the server: the same traces
    assert [e.config for e in together] == configs
    assert [e.predicted_peak_bytes for e in together] == [e.predicted_peak_bytes for e in alone]


def test_a_config_whose_estimate_fails_answers_its_error_in_its_place():
    refused = TrialConfig(micro_batch=2, activation_offload=True)  # the trace refuses it: nothing to offload to
    answers = predict_memories(WORKLOAD, [TrialConfig(micro_batch=2), refused, TrialConfig(micro_batch=1)])
    assert [type(a) for a in answers] == [MemoryEstimate, EstimateError, MemoryEstimate]
    assert "--activation-offload on" in str(answers[1])
    assert [a.config for a in answers if isinstance(a, MemoryEstimate)] == [
        TrialConfig(micro_batch=2),
        TrialConfig(micro_batch=1),
    ]


class _Children:
    """Stands in for the estimate server's trace children (two cores): each trace started is done at the next wait,
    and its update twin's with it."""

    def __init__(self) -> None:
        self.started: list[tuple[TrialConfig, bool]] = []
        self._running: dict[str, str | None] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._running or key in self._running.values()

    def __len__(self) -> int:
        return len(self._running)

    @property
    def free(self) -> int:
        return 2 - len(self._running)

    def start(self, key, workload, config, task, measured_with, *, pipeline_rank=None, twin_key=None) -> None:
        self.started.append((config, twin_key is not None))
        self._running[key] = twin_key

    def wait(self) -> list[tuple[str, object]]:
        done = [(key, object()) for key in self._running] + [(t, object()) for t in self._running.values() if t]
        self._running.clear()
        return done


def _traces_with(children: _Children):
    from autotune.estimate import worker

    traces = worker._Traces()
    traces._children = children
    return traces


def test_a_trace_refused_before_it_starts_forks_no_process(monkeypatch):
    # FSDP's CPU offload on a GPU: the server says why, as the trace would, without forking a child to say it.
    from autotune.estimate import trace_children, worker
    from autotune.estimate.measured_with import AS_INSTALLED

    def forked(*args):
        raise AssertionError("a refused trace forked a child")

    monkeypatch.setattr(trace_children, "_fork_trace", forked)
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2, gpu="A100-80GB")
    config = TrialConfig(micro_batch=2, fsdp="full", offload="optimizer+params")
    with pytest.raises(
        trace_children.TraceFailed, match=r"^EstimateError: --fsdp full --offload optimizer\+params: the"
    ):
        worker._Traces().get(workload, config, None, AS_INSTALLED)


def test_a_core_free_of_the_asked_traces_traces_the_next_config_ahead_that_needs_one():
    from autotune.estimate.measured_with import AS_INSTALLED

    children = _Children()
    traces = _traces_with(children)
    config, kept, refused = (
        TrialConfig(micro_batch=2),
        TrialConfig(micro_batch=2, compile=True),
        TrialConfig(micro_batch=2, activation_offload=True),
    )
    ahead = [kept, refused, TrialConfig(micro_batch=1), TrialConfig(micro_batch=4)]  # compile: the same trace
    traces.get_all([WORKLOAD], config, None, AS_INSTALLED, ahead)
    # Beside it, then on the core its trace leaves free as it answers: kept on into the next request.
    assert children.started == [
        (config, False),
        (TrialConfig(micro_batch=1), False),
        (TrialConfig(micro_batch=4), False),
    ]
    traces.get_all([WORKLOAD], TrialConfig(micro_batch=1), None, AS_INSTALLED, ahead)  # kept: nothing traced
    assert len(children.started) == 3
    with pytest.raises(Exception, match="--activation-offload on"):  # refused: nothing traced ahead of it either
        traces.get_all([WORKLOAD], refused, None, AS_INSTALLED, ahead)
    assert len(children.started) == 3


def test_a_refused_config_is_answered_at_once_while_every_core_traces_another():
    from autotune.estimate.measured_with import AS_INSTALLED
    from autotune.estimate.trace_children import TraceFailed

    children = _Children()
    children._running = {"one": None, "two": None}  # both cores busy with configs asked for next

    def wait():
        raise AssertionError("a refused config waited for a core")

    children.wait = wait
    refused = TrialConfig(micro_batch=2, activation_offload=True)
    with pytest.raises(TraceFailed, match="--activation-offload on"):  # at both depths: neither waits to be said
        _traces_with(children).get_all([WORKLOAD, WORKLOAD.replace(seq_len=64)], refused, None, AS_INSTALLED, [])


def test_only_an_unfused_adamw_trace_has_a_fused_twin_asked_for_it():
    from autotune.estimate.measured_with import AS_INSTALLED

    unfused, fused = TrialConfig(micro_batch=2), TrialConfig(micro_batch=2, fused_optimizer=True)
    started = []
    for config, ahead in ((unfused, []), (unfused, [fused]), (fused, [unfused])):
        children = _Children()
        _traces_with(children).get_all([WORKLOAD], config, None, AS_INSTALLED, ahead)
        started.append(children.started)
    assert started == [
        [(unfused, False)],  # its twin not asked for
        [(unfused, True)],  # its twin asked next: made by its trace, nothing else traced beside it
        [(fused, False), (unfused, False)],  # fused: no twin; the unfused config traced beside it
    ]


def test_a_trace_forks_at_its_update_for_a_fused_twin_asked_next_and_the_twin_is_its_own_trace_s_estimate():
    # Unfused and fused AdamW run the same forwards and backwards: the plan's trace of one makes both.
    from autotune.estimate import worker
    from autotune.estimate.measured_with import AS_INSTALLED
    from autotune.estimate.trace import estimate_from_trace

    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2, gpu="H100-80GB")
    config = TrialConfig(micro_batch=2, precision="bf16", fsdp="full")
    fused = config.replace(fused_optimizer=True)
    derived = worker._Traces()
    derived.get_all([workload], config, None, AS_INSTALLED, ahead=[fused])
    assert len(derived._kept) == 2  # the twin kept from the same trace: nothing traced beside it
    alone = worker._Traces().get(workload, fused, None, AS_INSTALLED)
    twin = derived.get(workload, fused, None, AS_INSTALLED)
    assert twin is not alone

    def figures(traced):
        estimate = estimate_from_trace(traced, workload, fused).to_dict()
        estimate.pop("seconds")
        return estimate

    assert figures(twin) == figures(alone)


def test_a_trace_that_made_a_cuda_context_leaves_its_twin_to_a_trace_of_its_own(monkeypatch):
    # On a GPU a trace makes a CUDA context (the card's properties); a fork of it could not use CUDA, so it does not
    # fork for the twin: the twin is traced when asked for, the same estimate as alone.
    import torch

    from autotune.estimate import worker
    from autotune.estimate.measured_with import AS_INSTALLED

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the trace children are forks: they see it
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, gpu="H100-80GB")
    config = TrialConfig(micro_batch=2, precision="bf16")
    fused = config.replace(fused_optimizer=True)
    traces = worker._Traces()
    traces.get_all([workload], config, None, AS_INSTALLED, ahead=[fused])
    assert len(traces._kept) == 1  # its own step only: no twin forked from a process with CUDA made
    twin = traces.get(workload, fused, None, AS_INSTALLED)
    alone = worker._Traces().get(workload, fused, None, AS_INSTALLED)
    assert twin.peak_bytes == alone.peak_bytes
