"""The estimator on a mixture-of-experts model (a tiny Mixtral): its grouped expert matmuls trace, and
the prediction matches a real trial's peak."""

from __future__ import annotations

import json

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.trial.runner import run_trial


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import MixtralConfig

    folder = tmp_path_factory.mktemp("mixtral")
    MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    ).save_pretrained(folder)
    return str(folder / "config.json")


CASES = [  # fp32 expert weights under bf16 autocast; fp32; LoRA on every linear layer and the fused experts
    TrialConfig(micro_batch=4, precision="bf16"),
    TrialConfig(micro_batch=8, checkpointing=True),
    TrialConfig(micro_batch=8, precision="bf16", lora_rank=8, lora_targets=("all-linear",)),
]


@pytest.mark.parametrize("config", CASES, ids=[c.describe() for c in CASES])
def test_a_mixture_of_experts_estimate_is_within_5_percent_of_its_trial(mixtral, config):
    workload = Workload(model=mixtral, seq_len=128, global_batch=8)
    predicted = predict_memory(workload, config)
    assert sum(predicted.parts().values()) == predicted.predicted_peak_bytes
    measured = run_trial(workload, config, warmup_steps=1, measure_steps=1)
    assert measured.ok, measured.error
    error = predicted.predicted_peak_bytes / measured.peak_memory_bytes - 1
    assert abs(error) <= 0.05, (predicted.to_dict(), measured.peak_memory_bytes)


@pytest.mark.slow
def test_estimate_command_on_a_mixtral_config_json(mixtral):
    proc = commands.autotune(
        "estimate",
        "--model",
        mixtral,
        "--seq-len",
        "128",
        "--micro-batch",
        "4",
        "--precision",
        "bf16",
        "--json",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["predicted_peak_bytes"] > 0
