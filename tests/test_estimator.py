"""The estimator against the CPU tracker: predicted peaks of real trials' configs, two architectures.

Estimates run as the tuner runs them: each in a fresh process (``predict_memory``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.estimator import predict_memory
from autotune.knobs import TrialConfig
from autotune.runner import run_trial
from autotune.workload import Workload

CASES = [
    ("builtin:gpt2-deep-tiny", TrialConfig(micro_batch=2)),
    ("builtin:gpt2-deep-tiny", TrialConfig(micro_batch=8, checkpointing=True)),
    ("builtin:llama-tiny", TrialConfig(micro_batch=4, lora_rank=8)),
    ("builtin:llama-tiny", TrialConfig(micro_batch=4, precision="bf16", checkpointing=True)),
]


@pytest.mark.parametrize("model, config", CASES, ids=[f"{m}-{c.describe()}" for m, c in CASES])
def test_predicted_peak_is_within_5_percent_of_the_measured_one(model, config):
    workload = Workload(model=model, seq_len=64)
    predicted = predict_memory(workload, config)
    measured = run_trial(workload, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    error = predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1
    assert abs(error) <= 0.05, (predicted.to_dict(), measured.peak_memory_bytes)
    parts = (predicted.parameters_bytes + predicted.gradients_bytes + predicted.optimizer_state_bytes
             + predicted.activations_bytes + predicted.temporaries_bytes)
    assert parts == predicted.predicted_peak_bytes and predicted.overhead_bytes is None


def test_model_states_follow_the_arithmetic():
    workload = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=8, nproc=2)
    full = predict_memory(workload, TrialConfig(micro_batch=4))
    params = full.parameters_bytes // 4  # fp32
    assert full.gradients_bytes == 4 * params and full.optimizer_state_bytes == 8 * params  # Adam m + v
    lora = predict_memory(workload, TrialConfig(micro_batch=4, lora_rank=8))
    assert lora.gradients_bytes < full.gradients_bytes / 20  # only the adapters train
    zero2 = predict_memory(workload, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2))
    assert zero2.parameters_bytes == 2 * params                       # 16-bit weights
    assert zero2.gradients_bytes == 2 * params // 2                   # sharded over 2 ranks
    assert zero2.optimizer_state_bytes == 12 * params // 2            # fp32 master + m + v, sharded
    zero3 = predict_memory(workload, TrialConfig(micro_batch=4, zero_stage=3, offload="optimizer+params"))
    assert zero3.parameters_bytes == 0 and zero3.optimizer_state_bytes == 0


def test_estimate_command_json_lines():
    proc = subprocess.run([sys.executable, "-m", "autotune", "estimate", "--model", "builtin:gpt2-tiny",
                           "--seq-len", "32", "--micro-batch", "4", "--memory-budget", "8MiB", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {"config", "predicted_peak_bytes", "parameters_bytes", "gradients_bytes", "optimizer_state_bytes",
            "activations_bytes", "temporaries_bytes"} <= result.keys()
    assert result["fits"] is False and result["predicted_peak_bytes"] > 8 * 2**20
