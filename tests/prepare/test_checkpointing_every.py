"""--checkpointing every-N: every N-th decoder layer recomputed, the others keep their activations."""

from __future__ import annotations

import json

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.client import predict_memory
from autotune.output.exporters import export_config
from autotune.search.presets import load_space
from autotune.trial.runner import run_trial

SIX_LAYERS = Workload(model="builtin:gpt2-deep-tiny", seq_len=128, global_batch=8)


@pytest.mark.slow  # three real trials and their estimates: ~40 s on a busy 2-core machine
def test_every_second_layer_lands_between_off_and_on_and_the_estimator_predicts_it():
    peaks = {}
    for label, config in (
        ("off", TrialConfig(micro_batch=8)),
        ("every-2", TrialConfig(micro_batch=8, checkpointing=True, checkpoint_every=2)),
        ("on", TrialConfig(micro_batch=8, checkpointing=True)),
    ):
        result = run_trial(SIX_LAYERS, config, measure_steps=1)
        assert result.ok, result.error
        assert predict_memory(SIX_LAYERS, config).predicted_peak_bytes == pytest.approx(
            result.peak_memory_bytes, rel=0.05
        ), label
        peaks[label] = result.peak_memory_bytes
    assert peaks["on"] < peaks["every-2"] < peaks["off"]


@pytest.mark.slow
def test_the_config_and_the_space_speak_every_n(tmp_path):
    config = TrialConfig(micro_batch=2, checkpointing=True, checkpoint_every=2)
    assert config.describe() == "mb=2 fp32 ckpt/2"
    with pytest.raises(ConfigError, match="needs checkpointing on"):
        TrialConfig(checkpoint_every=2)
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [2]\n  checkpointing: [false, true, every-2]\n")
    space = load_space(tmp_path / "space.yaml")
    from autotune.config.device import detect_device

    cpu = detect_device("cpu")
    assert space.choices(SIX_LAYERS, cpu)["checkpointing"] == (False, True, "every-2")
    assert config in space.candidates(SIX_LAYERS, cpu)
    assert space.config_of(space.params_of(config)) == config
    factory = Workload(model="factories:checkpointable", seq_len=16, global_batch=2)
    assert space.choices(factory, cpu)["checkpointing"] == (False, True)
    assert any(
        line.startswith("checkpointing every-2: --checkpointing every-N") for line in space.dropped_knobs(factory, cpu)
    )  # on/off stay: the factory has the method
    (tmp_path / "bad.yaml").write_text("knobs:\n  checkpointing: [every-1]\n")
    with pytest.raises(ConfigError, match="knobs.checkpointing: 'every-1' is not allowed"):
        load_space(tmp_path / "bad.yaml")


def test_the_hf_export_checkpoints_every_n_layers_through_the_trainer(tmp_path):
    from transformers import TrainingArguments

    config = TrialConfig(micro_batch=4, checkpointing=True, checkpoint_every=2)
    kwargs = json.loads(export_config(config, SIX_LAYERS, fmt="hf", device_type="cpu"))
    args = TrainingArguments(output_dir=str(tmp_path), **kwargs)
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 2}
    assert "every_n_layers=2" in export_config(config, SIX_LAYERS, fmt="yaml", device_type="cpu")
