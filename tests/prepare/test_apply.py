"""``autotune.prepare(model, config)``: a user's model gets exactly what the trial's model got."""

from __future__ import annotations

import json

import pytest
import torch

import autotune
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.models.sources import build_model
from autotune.output.exporters import export_config
from autotune.trial.engine import build_engine

WORKLOAD = Workload(model="builtin:llama-tiny-32k", seq_len=32, global_batch=4)
CONFIG = TrialConfig(
    micro_batch=2, precision="bf16", checkpointing=True, checkpoint_every=2, lora_rank=8, loss="chunked:4"
)


def _facts(model: torch.nn.Module) -> dict:
    """What the knobs change in a model: which weights train, in which dtype, which layers
    checkpoint, and which loss runs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "parameters": {name: (p.dtype, p.requires_grad) for name, p in model.named_parameters()},
        "checkpointed": [getattr(layer, "gradient_checkpointing", False) for layer in base.model.layers],
        "loss": type(base.loss_function).__name__,
    }


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_prepare_from_an_export_gives_the_users_model_what_the_trial_measured(tmp_path, fmt):
    export = tmp_path / f"autotune.{fmt}"
    export.write_text(export_config(CONFIG, WORKLOAD, fmt=fmt, device_type="cpu"))
    trial = build_engine(workload=WORKLOAD, config=CONFIG, task="causal-lm", device=torch.device("cpu"), world_size=1)
    users = autotune.prepare(build_model(WORKLOAD, task="causal-lm", device=torch.device("cpu")), export)
    assert _facts(users) == _facts(trial.model)
    assert _facts(users)["checkpointed"][:2] == [True, False]  # every 2nd layer
    assert _facts(users)["loss"] == "_ChunkedCrossEntropy"
    ids = torch.randint(0, 32000, (2, 16))
    users(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in users.parameters() if p.requires_grad)


def test_prepare_with_knobs_applies_only_those():
    model = autotune.prepare(build_model(WORKLOAD, task="causal-lm", device=torch.device("cpu")), loss="chunked:8")
    facts = _facts(model)
    assert facts["loss"] == "_ChunkedCrossEntropy" and not any(facts["checkpointed"])
    assert all(dtype == torch.float32 and trains for dtype, trains in facts["parameters"].values())
    from autotune.prepare import prepare

    assert prepare is autotune.prepare.apply.prepare


def test_prepare_refuses_what_it_cannot_apply_in_one_line(tmp_path):
    model = build_model(WORKLOAD, task="causal-lm", device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"LoRA's targets depend on the model; pass workload="):
        autotune.prepare(model, TrialConfig(lora_rank=8))
    (tmp_path / "notes.json").write_text("not json")
    with pytest.raises(ConfigError, match=r"notes.json is not an autotune export"):
        autotune.prepare(model, tmp_path / "notes.json")
    (tmp_path / "other.json").write_text(json.dumps({"fp16": True}))
    with pytest.raises(ConfigError, match=r"other.json has no config; write one with autotune export"):
        autotune.prepare(model, tmp_path / "other.json")
    with pytest.raises(ConfigError, match=r"unknown knob\(s\) \['los'\]"):
        autotune.prepare(model, los="chunked")
    with pytest.raises(ConfigError, match=r"--loss 'chunked:1' is not known"):
        autotune.prepare(model, loss="chunked:1")
