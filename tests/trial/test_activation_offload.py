"""Activation offload in trials: refused on a CPU device (exit 2, one line, no study written), and on a real
CUDA GPU (``gpu``-marked) a peak below the plain step's, within the estimator's tolerance of its prediction."""

from __future__ import annotations

import subprocess

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload


def _autotune(*args: str, cwd: object) -> subprocess.CompletedProcess[str]:
    return commands.autotune(*args, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_trial_refuses_it_on_a_cpu_device_in_one_line_with_exit_2(tmp_path):
    proc = _autotune(
        "trial", "--model", "builtin:gpt2-tiny", "--device", "cpu", "--activation-offload", "on", cwd=tmp_path
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--activation-offload on" in proc.stderr and "use --activation-offload off" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no storage, no study


@pytest.mark.slow
def test_a_space_that_only_offloads_is_refused_on_a_cpu_device_before_a_study_is_written(tmp_path):
    (tmp_path / "offload.yaml").write_text("knobs:\n  micro_batch: [1]\n  activation_offload: [true]\n")
    proc = _autotune(
        "find", "--model", "builtin:gpt2-tiny", "--global-batch", "1", "--device", "cpu", "--space", "offload.yaml",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "knobs.activation_offload [true]" in proc.stderr and "add false" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["offload.yaml"]  # no storage/autotune.db


# A causal LM whose saved activations outweigh its model states many times (GPT-2 124M: 1.9 GiB of model states,
# 8.3 GiB of activations predicted at micro batch 8 x 1,024 tokens under bf16), so offloading them lowers the peak.
GPT2_LONG = Workload(model="builtin:gpt2", seq_len=1024, global_batch=8, device="cuda")
OFFLOAD_CASES = [
    TrialConfig(micro_batch=8, precision="bf16"),
    TrialConfig(micro_batch=8, precision="bf16", checkpointing=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("plain", OFFLOAD_CASES, ids=[c.describe() for c in OFFLOAD_CASES])
def test_on_cuda_offload_lowers_the_measured_peak_as_the_estimator_predicts(plain):
    from autotune.estimate.client import predict_memory
    from autotune.trial.runner import run_trial

    offloaded = plain.replace(activation_offload=True)
    before = run_trial(GPT2_LONG, plain, warmup_steps=1, measure_steps=2)
    after = run_trial(GPT2_LONG, offloaded, warmup_steps=1, measure_steps=2)
    assert before.ok and after.ok, (before.error, after.error)
    assert after.peak_allocated_bytes < before.peak_allocated_bytes, (
        after.peak_allocated_bytes,
        before.peak_allocated_bytes,
    )
    assert after.final_loss == pytest.approx(before.final_loss, rel=1e-2)  # the same step: offload changes no maths
    predicted = predict_memory(GPT2_LONG, offloaded)
    assert predicted.traced_device == "cuda"
    assert predicted.predicted_peak_bytes < predict_memory(GPT2_LONG, plain).predicted_peak_bytes
    # The CUDA estimator's tolerance against real trials (tests/estimate/test_estimator_gpu.py): 10% of allocated.
    error = predicted.predicted_peak_bytes / after.peak_allocated_bytes - 1
    assert abs(error) <= 0.10, (predicted.to_dict(), after.peak_allocated_bytes)
