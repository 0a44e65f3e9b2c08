"""The estimator for a CUDA workload on a GPU: the step traced on fake CUDA tensors, against real CUDA trials.

Marked ``gpu``: skipped on machines without CUDA, run on the GPU machine (see README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.trial.runner import run_trial

pytestmark = pytest.mark.gpu

# Attention dropout on: the CPU's math attention would keep the s x s scores, CUDA's fused kernels do not.
CASES = [
    ("builtin:gpt2", TrialConfig(micro_batch=4, precision="bf16")),
    ("builtin:gpt2", TrialConfig(micro_batch=4)),
    ("builtin:bert-base", TrialConfig(micro_batch=8, precision="bf16")),
]


@pytest.mark.parametrize("model, config", CASES, ids=[f"{m}-{c.describe()}" for m, c in CASES])
def test_a_cuda_estimate_traces_cuda_kernels_and_is_within_10_percent_of_the_trial(model, config):
    workload = Workload(model=model, seq_len=512, global_batch=config.micro_batch, device="cuda")
    predicted = predict_memory(workload, config)
    assert predicted.traced_device == "cuda" and predicted.device_note is None
    assert sum(predicted.parts().values()) == predicted.predicted_peak_bytes
    measured = run_trial(workload, config, warmup_steps=1, measure_steps=2)
    assert measured.ok, measured.error
    error = predicted.predicted_peak_bytes / measured.peak_allocated_bytes - 1
    assert abs(error) <= 0.10, (predicted.to_dict(), measured.peak_allocated_bytes)


def test_without_a_gpu_the_cpu_trace_with_cuda_attention_is_close_to_the_cuda_trace():
    args = [
        sys.executable,
        "-m",
        "autotune",
        "estimate",
        "--model",
        "builtin:gpt2",
        "--seq-len",
        "512",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
        "--precision",
        "bf16",
        "--device",
        "cuda",
        "--json",
    ]
    on_gpu = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout)
    hidden = subprocess.run(
        args, capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    without = json.loads(hidden.stdout)
    assert on_gpu["traced_device"] == "cuda" and without["traced_device"] == "cpu"
    assert "no CUDA GPU here" in without["device_note"]
    assert abs(without["predicted_peak_bytes"] / on_gpu["predicted_peak_bytes"] - 1) <= 0.10, (on_gpu, without)


# The three CUDA figures against what the card reports. Allocated and reserved: the trial's
# max_memory_allocated / max_memory_reserved in a process that trained the step. The device figure:
# nvidia-smi's view of that process, read as the card's used memory (total - free) at its end, less
# what the card had in use before it started.
DEVICE_SCRIPT = """
import json, sys, torch
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.engine import build_engine
workload = Workload.from_dict(json.loads(sys.argv[1])); config = TrialConfig.from_dict(json.loads(sys.argv[2]))
engine = build_engine(workload=workload, config=config, task="causal-lm", device=torch.device("cuda"), world_size=1)
for _ in range(3):
    engine.step()
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"used": total - free, "allocated": torch.cuda.max_memory_allocated(),
                  "reserved": torch.cuda.max_memory_reserved()}))
"""

FIGURE_CASES = [
    ("builtin:gpt2", TrialConfig(micro_batch=4, precision="bf16")),
    ("builtin:llama-tiny-32k", TrialConfig(micro_batch=8)),
    ("builtin:gpt2", TrialConfig(micro_batch=2, precision="bf16", checkpointing=True)),
]


@pytest.mark.parametrize("model, config", FIGURE_CASES, ids=[f"{m}-{c.describe()}" for m, c in FIGURE_CASES])
def test_reserved_and_device_predictions_are_within_10_percent_of_the_card(model, config):
    import torch

    workload = Workload(model=model, seq_len=512, global_batch=config.micro_batch, device="cuda")
    predicted = predict_memory(workload, config)
    free, total = torch.cuda.mem_get_info()
    used_before = total - free  # everything but the child: this process's context, other processes, the driver
    measured = json.loads(
        subprocess.run(
            [sys.executable, "-c", DEVICE_SCRIPT, json.dumps(workload.to_dict()), json.dumps(config.to_dict())],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert abs(predicted.predicted_peak_bytes / measured["allocated"] - 1) <= 0.10, (predicted.to_dict(), measured)
    assert abs(predicted.predicted_reserved_bytes / measured["reserved"] - 1) <= 0.10, (predicted.to_dict(), measured)
    device_measured = measured["used"] - used_before  # the child alone: its context, its reserve, its workspaces
    assert abs(predicted.predicted_device_bytes / device_measured - 1) <= 0.15, (predicted.to_dict(), measured)


def test_the_step_time_on_the_probed_gpu_is_within_30_percent_of_a_trial():
    """The device probe measures this GPU's roofline; the traced step timed against it is checked
    against a real trial's step (the published rows' median error is 17%; this is one small model)."""
    from autotune.estimate.step_time import DeviceProfile, predict_step_time
    from autotune.trial.device_probe import probe_profile

    probed = probe_profile("cuda")
    assert probed is not None and probed["matmul_flops"]["float32"] > 1e12 and probed["type"] == "cuda"
    profile = DeviceProfile.from_dict(probed)
    workload = Workload(model="builtin:gpt2", seq_len=512, global_batch=8, device="cuda")
    config = TrialConfig(micro_batch=8, precision="bf16")
    step = predict_step_time(predict_memory(workload, config), workload, profile)
    measured = run_trial(workload, config, warmup_steps=2, measure_steps=5)
    assert measured.ok, measured.error
    assert abs(step.step_s / measured.step_time_median_s - 1) <= 0.30, (step.to_dict(), measured.step_time_median_s)


def test_lora_and_adafactor_estimates_on_a_gpu_machine_trace_on_fake_cuda_tensors():
    # bitsandbytes (under PEFT and Adafactor's module) initialises CUDA as it imports: the estimate server leaves
    # them to each forked trace where a GPU is visible; imported in the server, the next trace could not run.
    workload = Workload(model="builtin:gpt2-tiny", seq_len=128, global_batch=4, device="cuda")
    for config in (
        TrialConfig(micro_batch=4, lora_rank=8),
        TrialConfig(micro_batch=4, optimizer="adafactor"),
        TrialConfig(micro_batch=4),
    ):
        predicted = predict_memory(workload, config)
        assert predicted.traced_device == "cuda" and predicted.predicted_peak_bytes > 0, config.describe()
