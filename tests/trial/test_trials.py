"""Real trials in real processes on the CPU: the acceptance tests of the trial engine.

Small shapes keep each trial to a few seconds; nothing is mocked.
"""

from __future__ import annotations

import math
import re
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from processes import alive, started_here, trial_processes

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.measure import MAX_STEPS_FACTOR
from autotune.trial.result import TrialStatus
from autotune.trial.runner import run_trial

GPT2 = Workload(model="builtin:gpt2-tiny", seq_len=64, global_batch=8)
LLAMA = Workload(model="builtin:llama-tiny", seq_len=64, global_batch=8)


def trial(workload: Workload, **knobs):
    return run_trial(workload, TrialConfig(**knobs), warmup_steps=1, measure_steps=2, timeout_s=300)


@pytest.fixture(scope="module")
def gpt2_baseline():
    return trial(GPT2, micro_batch=8)


def test_a_trial_reports_what_it_measured(gpt2_baseline):
    r = gpt2_baseline
    assert r.status is TrialStatus.OK, r.error
    # 2 steps asked; more only while their spread was over 10% of the median (at most 3x).
    assert 2 <= r.measured_steps <= 2 * MAX_STEPS_FACTOR and r.grad_accum_steps == 1
    assert r.step_time_spread is not None and r.disturbed_steps is not None
    assert r.tokens_per_s == pytest.approx(r.samples_per_s * GPT2.seq_len)
    assert r.step_time_median_s > 0 and r.step_time_iqr_s >= 0
    assert r.peak_memory_bytes > r.optimizer_state_bytes > 0
    assert r.trainable_params == r.total_params > 0
    assert all(
        v is not None and v >= 0 for v in (r.phases.startup_s, r.phases.build_s, r.phases.warmup_s, r.phases.measure_s)
    )
    assert math.isfinite(r.final_loss)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_step_far_slower_than_the_best_ends_the_trial_after_it(nproc):
    """The search hands a trial the step time three times the best's: past it, one timed step is its figure."""
    workload = Workload(model="builtin:gpt2-tiny", seq_len=64, global_batch=8, nproc=nproc)
    config = TrialConfig(micro_batch=2)
    result = run_trial(workload, config, warmup_steps=1, measure_steps=3, timeout_s=300, outpaced_step_s=1e-6)
    assert result.status is TrialStatus.OK, result.error
    assert result.outpaced and result.measured_steps == 1 and result.throughput and result.throughput > 0
    far = run_trial(workload, config, warmup_steps=1, measure_steps=3, timeout_s=300, outpaced_step_s=1e6)
    assert far.status is TrialStatus.OK and not far.outpaced and far.measured_steps >= 3


def test_checkpointing_lowers_the_peak(gpt2_baseline):
    checkpointed = trial(GPT2, micro_batch=8, checkpointing=True)
    assert checkpointed.status is TrialStatus.OK, checkpointed.error
    assert checkpointed.peak_memory_bytes < gpt2_baseline.peak_memory_bytes


def test_lora_lowers_trainable_parameters_and_the_peak(gpt2_baseline):
    lora = trial(GPT2, micro_batch=8, lora_rank=4)
    assert lora.status is TrialStatus.OK, lora.error
    assert lora.trainable_params < gpt2_baseline.trainable_params / 10
    assert lora.peak_memory_bytes < gpt2_baseline.peak_memory_bytes
    assert lora.optimizer_state_bytes < gpt2_baseline.optimizer_state_bytes / 10


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precisions_train_with_a_finite_loss(precision):
    r = trial(LLAMA, micro_batch=4, precision=precision)
    assert r.status is TrialStatus.OK, r.error
    assert math.isfinite(r.final_loss)


@pytest.mark.parametrize(
    "stage, offload", [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer+params")]
)
def test_zero_stages_run_through_real_deepspeed(stage, offload):
    r = trial(GPT2, micro_batch=4, zero_stage=stage, offload=offload)
    assert r.status is TrialStatus.OK, r.error
    assert r.grad_accum_steps == 2 and math.isfinite(r.final_loss)


def test_zero3_builds_a_model_whose_embedding_has_a_padding_row():
    # Llama's embedding zeroes its padding row at init; under deepspeed.zero.Init the partitions are
    # empty, and Transformers 5's init indexed them (IndexError) until its init was left out there.
    r = trial(Workload(model="builtin:llama-tiny", seq_len=32, global_batch=8), micro_batch=4, zero_stage=3)
    assert r.status is TrialStatus.OK, r.error
    assert math.isfinite(r.final_loss)


@pytest.mark.slow
def test_zero2_holds_less_optimizer_state_per_rank_than_zero0_on_two_ranks():
    workload = GPT2.replace(nproc=2)
    zero0 = trial(workload, micro_batch=4, zero_stage=0)
    zero2 = trial(workload, micro_batch=4, zero_stage=2)
    assert zero0.status is zero2.status is TrialStatus.OK, (zero0.error, zero2.error)
    assert zero0.world_size == zero2.world_size == 2 and len(zero2.peak_memory_per_rank) == 2
    assert zero2.optimizer_state_bytes < 0.6 * zero0.optimizer_state_bytes


def test_sequence_classifier_trains():
    r = trial(Workload(model="builtin:bert-tiny", seq_len=32, global_batch=4), micro_batch=2, lora_rank=4)
    assert r.status is TrialStatus.OK, r.error
    assert r.trainable_params < r.total_params


# masked-lm and seq2seq-lm trials (plain, checkpointing, LoRA) run in tests/estimate/test_estimator.py.
def test_an_encoder_decoder_trains_on_its_source_and_target_tokens():
    r = trial(Workload(model="builtin:t5-tiny", seq_len=32, target_len=8, global_batch=4), micro_batch=2)
    assert r.status is TrialStatus.OK, r.error
    assert math.isfinite(r.final_loss)
    assert r.tokens_per_s == pytest.approx(r.samples_per_s * (32 + 8))  # what tokens/s counts for it


def test_an_image_classifier_counts_images_and_trains_its_head_under_lora():
    r = trial(Workload(model="builtin:vit-tiny", image_size=64, global_batch=4), micro_batch=2, lora_rank=4)
    assert r.status is TrialStatus.OK, r.error
    assert r.throughput_unit == "images/s" and r.tokens_per_s is None
    assert r.throughput == r.samples_per_s > 0
    # LoRA on query and value... and the classifier, which a new task's head needs, trained in full.
    assert 0 < r.trainable_params < r.total_params


def test_the_docs_factory_with_its_own_batch_is_fed_that_batch(tmp_path, monkeypatch):
    page = (Path(__file__).parents[2] / "docs" / "guides" / "models.md").read_text()
    example = re.search(r"```python\n( *# my_vision\.py.*?)\n *```", page, re.S).group(1)
    (tmp_path / "my_vision.py").write_text(textwrap.dedent(example))
    monkeypatch.chdir(tmp_path)
    r = trial(Workload(model="my_vision:convnet", global_batch=4), micro_batch=2)
    assert r.status is TrialStatus.OK, r.error
    assert r.throughput_unit == "samples/s" and r.tokens_per_s is None and r.samples_per_s > 0


def test_a_make_batch_the_forward_cannot_take_is_an_error_naming_the_factory():
    r = trial(Workload(model="factories:convnet_fed_tokens", global_batch=4), micro_batch=2)
    assert r.status is TrialStatus.ERROR
    assert "--model factories:convnet_fed_tokens: the model's forward cannot take make_batch's ['input_ids']" in r.error


def test_a_custom_factory_trains():
    r = trial(Workload(model="factories:tiny", seq_len=16, global_batch=4), micro_batch=2)
    assert r.status is TrialStatus.OK, r.error


def _sleepers() -> list[psutil.Process]:
    """The factory's orphaned ``sleep`` processes alive 5 s after the trial (at most). A killed process dies when it
    is next scheduled, and a loaded machine can list it a moment after the kill (a clean-clone CI run did); a
    zombie is dead, waiting only for its reaper (init, which adopted it). One the trial left running lives
    317 s."""
    found = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[:2] == ["sleep", "317"]]
    found = [p for p in found if started_here(p)]
    deadline = time.monotonic() + 5.0
    while True:
        left = [p for p in found if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_a_budget_too_small_is_an_oom_and_leaves_no_process():
    r = run_trial(
        Workload(model="factories:orphan_then_oom", seq_len=16, global_batch=4),
        TrialConfig(micro_batch=2),
        memory_budget_bytes=64 * 2**20,
        timeout_s=120,
    )
    assert r.status is TrialStatus.OOM, r.error
    assert "--memory-budget" in r.error
    assert r.peak_memory_bytes is not None and r.memory_budget_bytes == 64 * 2**20
    assert not _sleepers(), "the trial's grandchild outlived the trial"


def test_a_builtin_model_over_budget_is_an_oom():
    r = run_trial(GPT2, TrialConfig(micro_batch=8), memory_budget_bytes=8 * 2**20, timeout_s=120)
    assert r.status is TrialStatus.OOM, r.error


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.slow
def test_a_hanging_factory_times_out_within_the_limit(nproc):
    before = _children_but_servers()
    start = time.monotonic()
    r = run_trial(
        Workload(model="factories:hang", seq_len=16, global_batch=4, nproc=nproc),
        TrialConfig(micro_batch=2),
        timeout_s=3,
    )  # hung at build or still starting: a timeout either way
    elapsed = time.monotonic() - start
    assert r.status is TrialStatus.TIMEOUT
    assert elapsed < 3 + 10
    assert "--trial-timeout 3" in r.error
    assert not trial_processes() and _children_but_servers() <= before


def test_a_segfault_is_a_crash():
    r = run_trial(
        Workload(model="factories:segfault", seq_len=16, global_batch=4), TrialConfig(micro_batch=2), timeout_s=120
    )
    assert r.status is TrialStatus.CRASHED
    assert r.exit_code == -11 and "SIGSEGV" in r.error


def test_a_nan_loss_is_nan():
    r = run_trial(
        Workload(model="factories:nan_loss", seq_len=16, global_batch=4), TrialConfig(micro_batch=2), timeout_s=120
    )
    assert r.status is TrialStatus.NAN
    assert "NonFiniteLossError" in r.error


def test_an_exception_in_the_factory_is_an_error_with_its_last_lines():
    r = run_trial(
        Workload(model="factories:broken", seq_len=16, global_batch=4), TrialConfig(micro_batch=2), timeout_s=120
    )
    assert r.status is TrialStatus.ERROR
    assert "ValueError: factory exploded on purpose" in r.error


@pytest.mark.slow
def test_ctrl_c_during_a_trial_kills_it_and_leaves_no_process(tmp_path):
    import signal
    import subprocess
    import sys

    script = (
        "from autotune import TrialConfig, Workload, run_trial\n"
        "run_trial(Workload(model='factories:hang', seq_len=16, global_batch=4), TrialConfig(micro_batch=2),"
        " timeout_s=300)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not trial_processes() and time.monotonic() < deadline:  # wait until the trial is running
        time.sleep(0.5)
    assert trial_processes(), "the trial never started"
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=30)
    assert "KeyboardInterrupt" in stderr
    assert not trial_processes()


def _children_but_servers() -> set[int]:
    """This process's descendants, but the trial server (it stays for the next trial, by design)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "autotune.trial.server" not in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids
