"""bf16-true: weights, gradients and Adam states all in bf16, as Lightning's ``bf16-true`` trains."""

from __future__ import annotations

import commands
import pytest
import yaml

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=64, global_batch=4)


@pytest.mark.parametrize("lora", [None, 8])
def test_bf16_true_holds_every_weight_and_adam_state_in_bf16(lora):
    import torch

    from autotune.trial.engine import build_engine

    config = TrialConfig(micro_batch=2, precision="bf16-true", lora_rank=lora)
    engine = build_engine(workload=WORKLOAD, config=config, task="causal-lm", device=torch.device("cpu"), world_size=1)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # adapters too
    assert engine.autocast_dtype is None and engine.scaler is None
    loss = engine.step()
    assert loss == loss  # trains: a number, not NaN
    states = {v.dtype for s in engine.optimizer.state.values() for v in s.values() if v.numel() > 1}
    assert states == {torch.bfloat16}
    # Buffers keep their type, as from_pretrained(dtype=bfloat16) leaves them (rotary frequencies).
    assert any(b.dtype == torch.float32 for b in engine.model.buffers())


def test_bf16_true_halves_the_model_states_of_mixed_bf16_and_the_estimator_predicts_the_peak():
    from autotune.estimate.client import predict_memory
    from autotune.trial.runner import run_trial

    mixed, true = (TrialConfig(micro_batch=2, precision=p) for p in ("bf16", "bf16-true"))
    measured = {c.precision: run_trial(WORKLOAD, c, warmup_steps=1, measure_steps=1) for c in (mixed, true)}
    assert all(r.ok for r in measured.values()), [r.error for r in measured.values()]
    assert measured["bf16-true"].optimizer_state_bytes == measured["bf16"].optimizer_state_bytes // 2
    assert measured["bf16-true"].peak_memory_bytes < measured["bf16"].peak_memory_bytes
    assert measured["bf16-true"].build_peak_bytes < 0.6 * measured["bf16"].build_peak_bytes  # built in bf16
    estimate = predict_memory(WORKLOAD, true)
    assert estimate.predicted_peak_bytes == pytest.approx(measured["bf16-true"].peak_memory_bytes, rel=0.02)
    assert estimate.optimizer_state_bytes == measured["bf16-true"].optimizer_state_bytes


@pytest.mark.slow
def test_bf16_true_is_refused_where_it_has_no_meaning():
    from autotune.config.device import DeviceInfo

    cpu = DeviceInfo(type="cpu", name="cpu", count=1, total_memory_bytes=2**34, bf16=True, fp16_deepspeed=True)
    with pytest.raises(ConfigError, match=r"--precision bf16-true with --zero-stage: .*--precision bf16"):
        TrialConfig(micro_batch=1, precision="bf16-true", zero_stage=2).validate_for(WORKLOAD, cpu)
    old = DeviceInfo(type="cuda", name="Tesla V100", count=1, total_memory_bytes=2**34, bf16=False, fp16_deepspeed=True)
    with pytest.raises(ConfigError, match=r"--precision bf16-true: Tesla V100 has no bfloat16"):
        TrialConfig(micro_batch=1, precision="bf16-true").validate_for(WORKLOAD, old)
    with pytest.raises(ConfigError, match=r"--precision 'fp16-true' is not known"):
        TrialConfig(precision="fp16-true")
    proc = commands.autotune(
        "trial",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--precision",
        "bf16-true",
        "--zero-stage",
        "2",
        timeout=120,
    )
    assert proc.returncode == 2 and "--zero-stage" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_exports_say_bf16_true_and_lightning_trains_it(tmp_path):
    import lightning.pytorch as pl

    from autotune.output.exporters import export_config

    config = TrialConfig(micro_batch=2, precision="bf16-true", lora_rank=8)
    trainer_kwargs = yaml.safe_load(export_config(config, WORKLOAD, fmt="lightning", device_type="cpu"))["trainer"]
    trainer = pl.Trainer(
        **trainer_kwargs,
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    assert trainer.precision == "bf16-true"
    header = export_config(config, WORKLOAD, fmt="yaml", device_type="cpu")
    assert "trains: LoRA" in header and "bf16 throughout (weights, gradients and Adam states" in header
    assert "# bf16-true: load the model in bf16" in header
    assert '"bf16": true' in export_config(config, WORKLOAD, fmt="hf", device_type="cpu")
    assert "mixed_precision: bf16" in export_config(config, WORKLOAD, fmt="accelerate", device_type="cpu")
    with pytest.raises(ConfigError, match=r"--format deepspeed: .*bf16-true.*fp32 master weights"):
        export_config(config, WORKLOAD, fmt="deepspeed", device_type="cpu")


def test_the_full_space_searches_bf16_true_beside_the_mixed_precisions_but_not_under_zero():
    from autotune.config.device import detect_device
    from autotune.search.presets import load_space

    space = load_space("full")
    candidates = space.candidates(WORKLOAD.replace(nproc=2), detect_device("cpu"))
    true = [c for c in candidates if c.precision == "bf16-true"]
    assert true and not any(c.uses_deepspeed for c in true)
    assert any(c.precision == "bf16" and c.uses_deepspeed for c in candidates)
    assert "bf16-true" not in load_space("default").precision  # it changes the maths: asked for, not assumed
