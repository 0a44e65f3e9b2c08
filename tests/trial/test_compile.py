"""--compile: refused where a trial cannot measure it; its payoff arithmetic; its exports.
The compiled trial itself runs on CUDA (tests/trial/test_gpu.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import commands
import pytest

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.output.exporters import export_config
from autotune.search.presets import load_space
from autotune.trial.measure import compile_payoff_steps

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4)


def test_the_payoff_is_the_compile_cost_over_what_each_step_saves():
    # 10.1 s to compile and run one 0.1 s compiled step; each step saves 0.05 s: 200 steps.
    assert compile_payoff_steps(10.1, 0.15, 0.10) == 200
    assert compile_payoff_steps(0.05, 0.15, 0.10) == 1  # cheaper than a step: pays at once
    assert compile_payoff_steps(10.0, 0.10, 0.10) is None  # no faster: never
    assert compile_payoff_steps(10.0, 0.09, 0.10) is None


@pytest.mark.slow
def test_compile_on_a_cpu_is_refused_in_one_line_with_the_reason(tmp_path):
    proc = commands.autotune(
        "trial",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--compile",
        "on",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--compile on is measured on CUDA GPUs only" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())
    bad = commands.autotune("estimate", "--model", "builtin:llama-tiny", "--compile", "maybe", timeout=120)
    assert bad.returncode == 2 and "--compile 'maybe' must be on or off" in bad.stderr


@pytest.mark.slow
def test_compile_runs_on_a_gpu_with_or_without_zero_and_the_full_space_leaves_it_out_on_a_cpu():
    from autotune.config.device import DeviceInfo

    gpu = DeviceInfo(type="cuda", name="H100", count=1, total_memory_bytes=80 * 2**30, bf16=True, fp16_deepspeed=True)
    TrialConfig(micro_batch=1, compile=True).validate_for(WORKLOAD, gpu)  # runs there
    TrialConfig(micro_batch=1, compile=True, zero_stage=2, offload="optimizer").validate_for(WORKLOAD, gpu)
    space = load_space("full")
    cpu = detect_device("cpu")
    assert space.choices(WORKLOAD, cpu)["compile"] == (False,)
    assert any(
        line.startswith("--compile on is measured on CUDA GPUs only") for line in space.dropped_knobs(WORKLOAD, cpu)
    )
    assert any(c.compile for c in space.candidates(WORKLOAD, gpu))


# The DeepSpeed engine of a trial, compiled through DeepSpeed's own engine.compile(), in a fresh
# process (it joins a process group). The "eager" backend checks the wiring without the minutes an
# inductor build takes on a CPU; the compiled CUDA trial is in tests/trial/test_gpu.py.
_COMPILED_ZERO = """
import math
import deepspeed, torch
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.engine import build_engine

deepspeed.init_distributed(dist_backend="gloo")
engine = build_engine(workload=Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4),
                      config=TrialConfig(micro_batch=2, zero_stage=2), task="causal-lm",
                      device=torch.device("cpu"), world_size=1)
first = engine.step()
engine.compile(backend="eager")
losses = [engine.step() for _ in range(2)]
print("RESULT", engine.engine.is_compiled, all(math.isfinite(x) for x in losses), losses[-1] < first)
"""


@pytest.mark.slow
def test_a_zero_trial_compiles_through_deepspeeds_own_engine_compile(tmp_path):
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILED_ZERO], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert "RESULT True True True" in proc.stdout, proc.stderr[-3000:]


def test_exports_compile_where_the_library_has_a_flag_and_say_how_where_not(tmp_path):
    from transformers import TrainingArguments

    config = TrialConfig(micro_batch=2, compile=True)
    assert config.describe() == "mb=2 fp32 compiled"
    kwargs = json.loads(export_config(config, WORKLOAD, fmt="hf", device_type="cuda"))
    kwargs.pop("deepspeed", None)
    assert TrainingArguments(output_dir=str(tmp_path), **{**kwargs, "use_cpu": True}).torch_compile is True
    assert "dynamo_backend: INDUCTOR" in export_config(config, WORKLOAD, fmt="accelerate", device_type="cuda")
    assert "# compile: model = torch.compile(model)" in export_config(
        config, WORKLOAD, fmt="lightning", device_type="cuda"
    )


def test_an_old_result_without_the_compile_fields_still_loads():
    from autotune.trial.result import TrialResult

    old = {"config": {"micro_batch": 2, "precision": "fp32"}, "status": "ok", "phases": {"startup_s": 1.0}}
    result = TrialResult.from_dict(old)
    assert result.config.compile is False and result.phases.compile_s is None and result.compile_payoff_steps is None
