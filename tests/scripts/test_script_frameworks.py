"""Script mode with a framework: the trial's config reaches a Transformers Trainer script through its
own TrainingArguments, and a loop that batches otherwise than the config says is reported."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.scripts.runner import run_script_trial
from autotune.trial.result import TrialStatus

HERE = Path(__file__).parent
TRAINER = [sys.executable, str(HERE / "trainer_script.py"), "30"]
WORKLOAD = Workload(seq_len=64, global_batch=8)


@pytest.mark.slow
def test_a_trainer_script_trains_the_injected_micro_batch_and_checkpoints_through_its_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the script writes its output_dir here
    small, large, checkpointed = (
        run_script_trial(TRAINER, WORKLOAD, config, measure_steps=2)
        for config in (
            TrialConfig(micro_batch=1),
            TrialConfig(micro_batch=8),
            TrialConfig(micro_batch=8, checkpointing=True),
        )
    )
    for result in (small, large, checkpointed):
        assert result.status is TrialStatus.OK, result.error
        assert result.measured_steps == 2
    # The script asks for 8 per device and no accumulation: mb=1 is the trial's, with 8 accumulated steps.
    assert small.peak_memory_bytes < large.peak_memory_bytes
    # Checkpointing came through TrainingArguments (the script never calls autotune.prepare): less kept.
    assert checkpointed.peak_memory_bytes < large.peak_memory_bytes


@pytest.mark.slow
def test_a_trainer_script_runs_out_of_the_budget_with_its_own_allocations():
    result = run_script_trial(
        TRAINER, WORKLOAD, TrialConfig(micro_batch=8), memory_budget_bytes=12 * 2**20, measure_steps=2
    )
    assert result.status is TrialStatus.OOM, result.error


@pytest.mark.slow
def test_a_loop_that_ignores_the_injected_micro_batch_is_reported_not_measured():
    result = run_script_trial(
        [sys.executable, str(HERE / "fixed_batch_loop.py"), "20"], WORKLOAD, TrialConfig(micro_batch=2), measure_steps=2
    )
    assert result.status is TrialStatus.ERROR
    assert result.error.splitlines()[0] == (
        "the script ignored the injected micro batch: its DataLoader batches 4 samples, the config's micro "
        "batch is 2; read it from AUTOTUNE_CONFIG (autotune.current_config().micro_batch) or let the Trainer batch"
    )


@pytest.mark.parametrize("script", ["lightning_script.py", "accelerate_script.py"])
@pytest.mark.slow
def test_a_lightning_or_accelerate_script_trains_the_trials_precision(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Lightning writes its logs where it runs
    command = [sys.executable, str(HERE / script), "30"]
    # Micro batch 8: at 2, what bf16 saves of the Accelerate script's activations (tiny_lm.py) is about what
    # autocast's bf16 copies of its weights, kept for backward, cost: 14.81 MiB in fp32, 14.83 in bf16. At 8:
    # 24.27 and 21.73 (Lightning's 2-layer GPT-2: 33.32 and 29.17).
    fp32, bf16 = (
        run_script_trial(command, WORKLOAD, TrialConfig(micro_batch=8, precision=p), measure_steps=2)
        for p in ("fp32", "bf16")
    )
    for result in (fp32, bf16):
        assert result.status is TrialStatus.OK, result.error
    # Each script asks for 32-bit (32-true, "no"): bf16 came from the trial (autocast keeps bf16 activations).
    # The trial's accumulation reaching them: tests/scripts/test_script_tune.py, where each says what it got.
    assert bf16.peak_memory_bytes < fp32.peak_memory_bytes


@pytest.mark.slow
def test_the_patched_lightning_trainer_keeps_its_signature_for_pl_trainer_defaults():
    # Lightning applies PL_TRAINER_* by reading its Trainer's signature: the patched __init__ must show it.
    code = (
        "import inspect\n"
        "from autotune.scripts.frameworks import FrameworkHooks\n"
        "FrameworkHooks({}, {'precision': 'bf16-mixed'}, {}).install()\n"
        "import lightning.pytorch as pl\n"
        "from lightning.pytorch.utilities.argparse import _parse_env_variables\n"
        "print('precision' in inspect.signature(pl.Trainer).parameters, vars(_parse_env_variables(pl.Trainer)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PL_TRAINER_MAX_STEPS": "7"},
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "True {'max_steps': 7}"


@pytest.mark.slow
def test_find_on_a_trainer_script_hands_over_a_command_that_trains_it_with_the_answer(tmp_path):
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2]\n  precision: [bf16]\n")
    found = commands.autotune(
        "find",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--space",
        "space.yaml",
        "--memory-budget",
        "1GiB",
        "--steps",
        "2",
        "--export",
        "json",
        "-o",
        "autotune.json",
        "--json",
        "--",
        *TRAINER,
        cwd=tmp_path,
        timeout=600,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    answer = json.loads(found.stdout)
    assert answer["best"]["config"]["micro_batch"] == 2
    assert answer["export"] == "autotune.json" and "export_files" not in answer  # one file
    assert answer["train_command"] == shlex.join(["autotune", "run", "--config", "autotune.json", "--", *TRAINER])
    # The user's job, trained to its end with the answer (3 steps here): the script says what it got.
    trained = commands.autotune(
        "run", "--config", "autotune.json", "--", TRAINER[0], TRAINER[1], "3", cwd=tmp_path, timeout=600
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "trained with per_device_train_batch_size=2 gradient_accumulation_steps=4 bf16=True" in trained.stdout


def test_run_refuses_a_config_file_that_is_not_an_export(tmp_path):
    (tmp_path / "notes.json").write_text('{"micro_batch": 2}')
    proc = commands.autotune("run", "--config", "notes.json", "--", "true", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"autotune: error: --config: {Path('notes.json')} has no config; write one with autotune export --format "
        "json (or yaml)"
    ]


def test_a_framework_class_built_with_positional_arguments_gets_the_trials_values_over_them():
    from autotune.scripts.frameworks import _wrap

    class Accelerator:  # Accelerate's takes device_placement, split_batches, mixed_precision by position
        def __init__(self, device_placement=True, split_batches=False, mixed_precision=None, **kwargs):
            self.got = (device_placement, split_batches, mixed_precision, kwargs)

    _wrap(Accelerator, "__init__", before=lambda instance, kwargs: kwargs.update(mixed_precision="bf16"))
    assert Accelerator(False, True, "no", cpu=True).got == (False, True, "bf16", {"cpu": True})
    assert Accelerator(False).got == (False, False, "bf16", {})
    assert Accelerator(mixed_precision="fp16").got == (True, False, "bf16", {})


def test_a_zero_config_gives_a_lightning_trainer_on_cuda_the_lightning_export_s_deepspeed_strategy(tmp_path):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from autotune.scripts.current import write_config_file
    from autotune.scripts.frameworks import FrameworkHooks

    workload = Workload(seq_len=64, global_batch=8)

    def handed(config: TrialConfig, device_type: str) -> dict:
        """What the hook gives the script's Trainer over {strategy: ddp, accelerator: gpu}."""
        write_config_file(tmp_path / "config.json", config, workload, device_type=device_type)
        kwargs = {"strategy": "ddp", "accelerator": "gpu"}
        lightning = json.loads((tmp_path / "config.json").read_text())["frameworks"]["lightning"]
        FrameworkHooks({}, lightning, {})._lightning_trainer(None, kwargs)
        return kwargs

    zero2 = TrialConfig(micro_batch=2, zero_stage=2)
    assert handed(zero2, "cpu")["strategy"] == "ddp"  # Lightning runs DeepSpeed on CUDA only: nothing given
    given = handed(zero2, "cuda")  # a script's model is unknown: Lightning's own buckets, by registered name
    assert given["strategy"] == "deepspeed_stage_2" and given["accelerator"] == "gpu"
    assert given["accumulate_grad_batches"] == 4 and given["precision"] == "32-true"
    # No registered name for ZeRO-3 offloading the optimizer only: the class_path form, built as LightningCLI would.
    strategy = handed(TrialConfig(micro_batch=2, zero_stage=3, offload="optimizer"), "cuda")["strategy"]
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" in zero and "offload_param" not in zero
