"""Trials on a real CUDA device: real OOMs under a budget, allocated vs reserved peaks.

Marked ``gpu``: skipped on machines without CUDA, run on the GPU machine (see README).
"""

from __future__ import annotations

import pytest
from bench_modules import bench_module

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.result import TrialStatus
from autotune.trial.runner import run_trial

pytestmark = pytest.mark.gpu

GPT2 = Workload(model="builtin:gpt2", seq_len=512, global_batch=16, device="cuda")


def test_cuda_trial_reports_allocated_and_reserved_peaks():
    r = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16"), measure_steps=3)
    assert r.status is TrialStatus.OK, r.error
    assert r.device.startswith("cuda")
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes > 0
    assert r.peak_memory_bytes == r.peak_reserved_bytes


def test_a_budget_smaller_than_the_config_is_a_real_cuda_oom():
    r = run_trial(GPT2, TrialConfig(micro_batch=16), memory_budget_bytes=2 * 2**30)
    assert r.status is TrialStatus.OOM, r.error
    assert "OutOfMemoryError" in r.error


def test_the_same_config_fits_without_the_budget_and_tf32_runs():
    r = run_trial(GPT2, TrialConfig(micro_batch=16, precision="tf32"))
    assert r.status is TrialStatus.OK, r.error
    assert r.peak_reserved_bytes > 2 * 2**30  # so the budgeted OOM above was the budget's doing


def test_zero2_with_optimizer_offload_on_cuda():
    r = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2, offload="optimizer"))
    assert r.status is TrialStatus.OK, r.error


def test_a_cuda_trial_forked_from_the_trial_server_measures_what_a_new_interpreter_measures(monkeypatch):
    small = Workload(model="builtin:gpt2-tiny", seq_len=128, global_batch=8, device="cuda")
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "off")
    fresh = run_trial(small, TrialConfig(micro_batch=4), measure_steps=2)
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "on")
    forked = [run_trial(small, TrialConfig(micro_batch=4), measure_steps=2) for _ in range(2)]
    for r in (fresh, *forked):
        assert r.status is TrialStatus.OK, r.error  # the server never made a CUDA context to inherit
    assert forked[1].peak_allocated_bytes == fresh.peak_allocated_bytes
    assert forked[1].phases.startup_s < fresh.phases.startup_s


def test_a_compiled_trial_keeps_compile_time_out_of_tokens_per_s_and_says_when_it_pays_off():
    eager = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16"), measure_steps=5)
    compiled = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16", compile=True), measure_steps=5)
    assert eager.ok and compiled.ok, (eager.error, compiled.error)
    assert compiled.phases.compile_s > 5 * compiled.step_time_median_s  # compiling took longer than steps
    assert compiled.eager_step_s > 0
    # tokens/s is from the timed steps only: a compile phase in it would read far below the eager trial.
    assert compiled.tokens_per_s > 0.5 * eager.tokens_per_s
    if compiled.step_time_median_s < compiled.eager_step_s:
        assert compiled.compile_payoff_steps >= 1
    else:
        assert compiled.compile_payoff_steps is None


def test_attention_kernels_on_cuda():
    for attention in ("eager", "sdpa"):
        r = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16", attention=attention), measure_steps=2)
        assert r.ok, (attention, r.error)


def test_a_zero_trial_compiles_through_deepspeed_and_keeps_compile_time_out_of_tokens_per_s():
    config = TrialConfig(micro_batch=4, precision="bf16", zero_stage=2, offload="optimizer", compile=True)
    r = run_trial(GPT2, config, measure_steps=5)
    assert r.status is TrialStatus.OK, r.error
    assert r.phases.compile_s > 5 * r.step_time_median_s and r.eager_step_s > 0


def test_lora_and_adafactor_trials_on_cuda_leave_the_trial_server_forking(monkeypatch):
    # bitsandbytes (under PEFT and Adafactor's module) initialises CUDA as it imports: the server leaves them to
    # the trials where a GPU is visible, or it would refuse to fork from then on (new interpreters, seconds each).
    small = Workload(model="builtin:gpt2-tiny", seq_len=128, global_batch=8, device="cuda")
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "off")
    fresh = run_trial(small, TrialConfig(micro_batch=4), measure_steps=2)
    monkeypatch.setenv("AUTOTUNE_TRIAL_SERVER", "on")
    for config in (
        TrialConfig(micro_batch=4, lora_rank=8),
        TrialConfig(micro_batch=4, optimizer="adafactor"),
        TrialConfig(micro_batch=4),
    ):
        r = run_trial(small, config, measure_steps=2)
        assert r.status is TrialStatus.OK, r.error
        assert r.phases.startup_s < fresh.phases.startup_s, config.describe()  # forked, not a new interpreter


def test_a_trial_asked_for_the_allocators_history_writes_one_whose_replayed_peak_is_the_trials(monkeypatch, tmp_path):
    """AUTOTUNE_CUDA_MEMORY_HISTORY on a real card: the trial's snapshot, replayed by bench/memory_history.py,
    peaks where torch.cuda.max_memory_allocated did (the history spans the build and every step; its ring of
    events does not wrap on a GPT-2 of 4 steps), and its parts sum to that peak."""
    from autotune.trial.memory import MEMORY_HISTORY_ENV

    replay = bench_module("memory_history")
    history = tmp_path / "gpt2.pickle"
    monkeypatch.setenv(MEMORY_HISTORY_ENV, str(history))
    r = run_trial(GPT2, TrialConfig(micro_batch=4, precision="bf16"), measure_steps=2)
    assert r.status is TrialStatus.OK, r.error
    parts = replay.peak_parts(replay.read_snapshot(history))
    assert parts["peak_index"] >= 0 and sum(parts["parts"].values()) == parts["peak_bytes"]
    assert parts["peak_bytes"] == pytest.approx(r.peak_allocated_bytes, rel=0.02), (parts, r.peak_allocated_bytes)
