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


def test_a_trace_refused_before_it_starts_forks_no_process(monkeypatch):
    # FSDP's CPU offload on a GPU: the server says why, as the trace would, without forking a child to say it.
    from autotune.estimate import worker
    from autotune.estimate.measured_with import AS_INSTALLED

    def forked(*args):
        raise AssertionError("a refused trace forked a child")

    monkeypatch.setattr(worker, "_fork_trace", forked)
    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2, gpu="A100-80GB")
    config = TrialConfig(micro_batch=2, fsdp="full", offload="optimizer+params")
    with pytest.raises(worker._TraceFailed, match=r"^EstimateError: --fsdp full --offload optimizer\+params: the"):
        worker._Traces().get(workload, config, None, AS_INSTALLED)


def test_a_trace_made_traces_the_first_config_ahead_that_needs_one_beside_it(monkeypatch):
    from autotune.estimate import worker
    from autotune.estimate.measured_with import AS_INSTALLED

    batches = []
    monkeypatch.setattr(
        worker, "_in_children", lambda traces: batches.append(traces) or [(object(), None) for _ in traces]
    )
    traces = worker._Traces()
    config, kept, refused = (
        TrialConfig(micro_batch=2),
        TrialConfig(micro_batch=2, compile=True),
        TrialConfig(micro_batch=2, activation_offload=True),
    )
    ahead = [kept, refused, TrialConfig(micro_batch=1), TrialConfig(micro_batch=4)]  # compile: the same trace
    traces.get_all([WORKLOAD], config, None, AS_INSTALLED, ahead)
    assert [[c for _, c, *_ in batch] for batch in batches if batch] == [[config, TrialConfig(micro_batch=1)]]
    traces.get_all([WORKLOAD], TrialConfig(micro_batch=1), None, AS_INSTALLED, ahead)  # kept: nothing traced
    assert len([batch for batch in batches if batch]) == 1


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


def test_only_an_unfused_adamw_trace_has_a_fused_twin_asked_for_it(monkeypatch):
    from autotune.estimate import worker
    from autotune.estimate.measured_with import AS_INSTALLED

    batches = []
    monkeypatch.setattr(
        worker, "_in_children", lambda traces: batches.append(traces) or [(object(), None) for _ in traces]
    )
    unfused, fused = TrialConfig(micro_batch=2), TrialConfig(micro_batch=2, fused_optimizer=True)
    worker._Traces().get_all([WORKLOAD], unfused, None, AS_INSTALLED, [])  # not asked for: no twin
    worker._Traces().get_all([WORKLOAD], unfused, None, AS_INSTALLED, [fused])
    worker._Traces().get_all([WORKLOAD], fused, None, AS_INSTALLED, [unfused])  # traced beside, not derived
    assert [[(c, with_twin) for _, c, *_, with_twin in batch] for batch in batches] == [
        [(unfused, False)],
        [(unfused, True)],
        [(fused, False), (unfused, False)],
    ]
