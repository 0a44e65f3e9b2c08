"""fp16 under ZeRO on a CPU: autotune's up-front answer is DeepSpeed's own, checked against a real trial.

DeepSpeed's CPU accelerator trains fp16 only where oneDNN has fp16 kernels; elsewhere its engine
stops with "Type fp16 is not supported on your device". autotune asks the same question first, so
`trial` refuses the config in one line and a search space drops it, instead of a failed trial.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import commands
import pytest

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.result import TrialStatus
from autotune.trial.runner import run_trial

CPU = detect_device("cpu")
FP16_ZERO2 = TrialConfig(micro_batch=2, precision="fp16", zero_stage=2)
WORKLOAD = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=4, device="cpu")


@pytest.mark.slow
def test_the_cpu_fp16_answer_is_deepspeeds_own():
    code = "from deepspeed.accelerator import get_accelerator; print(bool(get_accelerator().is_fp16_supported()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.stdout.strip().splitlines()[-1] == str(CPU.fp16_deepspeed)


def test_fp16_under_zero_trains_exactly_where_autotune_allows_it():
    # Skip autotune's own refusal and let DeepSpeed decide in a real 1-rank ZeRO-2 trial.
    r = run_trial(
        WORKLOAD,
        FP16_ZERO2,
        device=dataclasses.replace(CPU, fp16_deepspeed=True),
        warmup_steps=1,
        measure_steps=1,
        timeout_s=300,
    )
    if CPU.fp16_deepspeed:
        assert r.status is TrialStatus.OK, r.error
    else:
        assert r.status is TrialStatus.ERROR
        assert "Type fp16 is not supported on your device" in r.error


@pytest.mark.slow
def test_trial_refuses_fp16_under_zero_in_one_line_where_deepspeed_has_no_fp16(tmp_path):
    if CPU.fp16_deepspeed:
        pytest.skip("DeepSpeed trains fp16 on this CPU: the trial test above checks that it does")
    proc = commands.autotune(
        "trial",
        "--device",
        "cpu",
        "--model",
        "builtin:gpt2-tiny",
        "--zero-stage",
        "2",
        "--precision",
        "fp16",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "autotune: error: --precision fp16 with --zero-stage: DeepSpeed's accelerator on this device has no fp16 "
        "training; use bf16, or fp16 without --zero-stage"
    ]
