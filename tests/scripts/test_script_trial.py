"""Script mode: the user's own training command, unchanged, measured by the step hook."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.scripts.runner import run_script_trial, run_with_config
from autotune.trial.result import TrialStatus

HERE = Path(__file__).parent
LOOP = [sys.executable, str(HERE / "plain_loop.py")]
WORKLOAD = Workload(seq_len=64, global_batch=8)


@pytest.mark.slow
def test_a_plain_loop_is_measured_in_its_own_steps_and_its_peak_grows_with_the_injected_micro_batch():
    # The second as if the script trained an encoder-decoder: a sample is --seq-len plus --target-len tokens.
    seq2seq = Workload(task="seq2seq-lm", seq_len=64, target_len=16, global_batch=8)
    small, large = (
        run_script_trial([*LOOP, "20"], workload, TrialConfig(micro_batch=mb, precision="bf16"), measure_steps=2)
        for mb, workload in ((1, WORKLOAD), (8, seq2seq))
    )
    for result, tokens_per_sample in ((small, 64), (large, 64 + 16)):
        assert result.status is TrialStatus.OK, result.error
        assert result.measured_steps == 2 and result.grad_accum_steps in (8, 1)
        # A step trains the global batch: 8 samples, however it is split.
        assert result.samples_per_s == pytest.approx(8 / result.step_time_median_s)
        assert result.tokens_per_s == pytest.approx(8 * tokens_per_sample / result.step_time_median_s)
    assert large.peak_memory_bytes > small.peak_memory_bytes  # the script took the injected micro batch


@pytest.mark.slow
def test_a_budget_below_the_largest_micro_batch_is_an_oom_from_the_scripts_own_allocations():
    result = run_script_trial([*LOOP, "20"], WORKLOAD, TrialConfig(micro_batch=8), memory_budget_bytes=16 * 2**20)
    assert result.status is TrialStatus.OOM, result.error
    assert "autotune's CPU memory budget exceeded" in result.error


@pytest.mark.parametrize(
    "steps, expected",
    [
        ("2", "the script ended after 2 optimizer step(s); the trial measures 1 warm-up and 3 timed steps"),
        ("0", "no optimizer step in"),
    ],
)
@pytest.mark.slow
def test_a_script_that_stops_short_says_so(steps, expected):
    result = run_script_trial([*LOOP, steps], WORKLOAD, TrialConfig(micro_batch=8))
    assert result.status is TrialStatus.ERROR and expected in result.error, result.error


@pytest.mark.slow
def test_knobs_only_prepare_applies_need_the_script_to_call_it():
    config = TrialConfig(micro_batch=8, checkpointing=True)
    refused = run_script_trial([*LOOP, "20"], WORKLOAD, config, measure_steps=2)
    assert refused.status is TrialStatus.ERROR
    assert "did not call autotune.prepare(model, autotune.current_config()): --checkpointing on" in refused.error
    prepared = run_script_trial(
        [sys.executable, str(HERE / "prepared_loop.py"), "20"],
        Workload(seq_len=64, global_batch=8),
        config,
        measure_steps=2,
    )
    assert prepared.status is TrialStatus.OK, prepared.error


@pytest.mark.slow
def test_a_zero_config_is_measured_only_where_the_script_built_a_deepspeed_engine(capfd):
    config = TrialConfig(micro_batch=4, zero_stage=2)
    plain = run_script_trial([*LOOP, "20"], WORKLOAD, config, measure_steps=2)
    assert plain.status is TrialStatus.ERROR
    assert plain.error.splitlines()[0].startswith(
        "the script trained without DeepSpeed: --zero-stage 2 was not applied"
    ), plain.error
    # One process, no launcher: DeepSpeed finds the one-rank group the trial gives it (it looked for MPI).
    # An Accelerate script gets the DeepSpeedPlugin `accelerate launch` makes of the accelerate export.
    for script in ("deepspeed_loop.py", "trainer_script.py", "accelerate_script.py"):
        built = run_script_trial([sys.executable, str(HERE / script), "20"], WORKLOAD, config, measure_steps=2)
        assert built.status is TrialStatus.OK, (script, built.error)
    # Lightning runs DeepSpeed on CUDA only (gpu-marked: tests/scripts/test_script_gpu.py): said as such.
    lightning = run_script_trial(
        [sys.executable, str(HERE / "lightning_script.py"), "20"], WORKLOAD, config, measure_steps=2
    )
    assert lightning.status is TrialStatus.ERROR
    assert "Lightning runs DeepSpeed on CUDA GPUs only" in lightning.error.splitlines()[0], lightning.error
    assert run_with_config([sys.executable, str(HERE / "accelerate_script.py"), "2"], config, WORKLOAD) == 0
    assert (
        "trained with micro_batch=4 mixed_precision=no gradient_accumulation_steps=2 zero_stage=2"
        in capfd.readouterr().out
    )


def test_a_cpu_trial_s_command_sees_no_gpu(capfd):
    # On a host with GPUs, a --device cpu trial's script must train where its memory is counted.
    show = "import os; print('visible=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    cpu = Workload(seq_len=64, global_batch=8, device="cpu")
    assert run_with_config([sys.executable, "-c", show], TrialConfig(micro_batch=8), cpu) == 0
    assert "visible=''" in capfd.readouterr().out


@pytest.mark.slow
def test_a_launcher_failing_with_its_rank_leaves_the_rank_s_oom_standing():
    # torchrun has no RANK of its own, so its hook is 'rank 0' too; its ChildFailedError comes second.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(HERE / "ddp_loop.py"), "20"]
    result = run_script_trial(
        command, WORKLOAD, TrialConfig(micro_batch=8), memory_budget_bytes=4 * 2**20, measure_steps=2
    )
    assert result.status is TrialStatus.OOM, result.error
    assert "ChildFailedError" not in result.error


@pytest.mark.slow
def test_a_timeout_kills_the_whole_command_and_leaves_no_process(monkeypatch, own_processes):
    monkeypatch.setenv("HANG_AFTER_FIRST_STEP", "1")
    result = run_script_trial([*LOOP, "20"], WORKLOAD, TrialConfig(micro_batch=8), timeout_s=10)
    assert result.status is TrialStatus.TIMEOUT
    time.sleep(0.5)
    assert not own_processes("plain_loop.py")


@pytest.mark.slow
def test_the_command_line_takes_the_script_after_a_double_dash_and_refuses_one_that_does_not_exist(tmp_path):
    ok = commands.autotune(
        "trial",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "2",
        "--json",
        "--",
        *LOOP,
        "20",
        cwd=tmp_path,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["status"] == "ok"
    missing = commands.autotune("trial", "--", "no-such-command-xyz", cwd=tmp_path, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (
        "autotune: error: the command 'no-such-command-xyz' does not exist (not a file, and not on PATH)"
    )
    with pytest.raises(ConfigError, match="no command to run"):
        run_script_trial([], WORKLOAD, TrialConfig())


@pytest.mark.slow
def test_torchrun_as_the_command_measures_every_rank():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "ddp_loop.py"), "20"]
    result = run_script_trial(
        command, Workload(seq_len=64, global_batch=8, nproc=2), TrialConfig(micro_batch=2), measure_steps=2
    )
    assert result.status is TrialStatus.OK, result.error
    assert result.world_size == 2 and all(result.peak_memory_per_rank) and result.grad_accum_steps == 2
    # An Accelerate script under ZeRO-2 on two CPU ranks: Accelerate counts one process there (no backend
    # of its own), so an "auto" global batch had been 2 x 2 x 1 and DeepSpeed refused it.
    accelerate = [*command[:5], str(HERE / "accelerate_script.py"), "20"]
    zero = run_script_trial(
        accelerate,
        Workload(seq_len=64, global_batch=8, nproc=2),
        TrialConfig(micro_batch=2, zero_stage=2),
        measure_steps=2,
    )
    assert zero.status is TrialStatus.OK, zero.error
    assert zero.world_size == 2 and all(zero.peak_memory_per_rank)
    # A one-process command told it has two ranks: said, not measured as two.
    alone = run_script_trial(
        [*LOOP, "20"], Workload(seq_len=64, global_batch=8, nproc=2), TrialConfig(micro_batch=2), measure_steps=2
    )
    assert alone.status is TrialStatus.ERROR
    assert alone.error.splitlines()[0] == (
        "the command trained in 1 process(es), --nproc says 2: launch that many "
        "ranks (e.g. torchrun --nproc-per-node), or pass --nproc 1"
    )
