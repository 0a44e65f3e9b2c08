"""LoRA where PEFT has no default targets (DistilBERT, a factory's model) or where its own lookup
fails (Mixtral's MoE under transformers 5): real PEFT, real trials, and the export that matches them."""

from __future__ import annotations

import json
from pathlib import Path

import commands
import pytest
import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.models.sources import build_model
from autotune.prepare.workload_facts import lora_targets_for
from autotune.study.summary import what_is_trained
from autotune.trial.result import TrialStatus
from autotune.trial.runner import run_trial

DISTILBERT_FALLBACK = ("k_lin", "lin1", "lin2", "out_lin", "q_lin", "v_lin")


@pytest.fixture(scope="module")
def distilbert(tmp_path_factory) -> Path:
    from transformers import DistilBertConfig

    folder = tmp_path_factory.mktemp("distilbert")
    DistilBertConfig(
        vocab_size=256, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, num_labels=2
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    from transformers import MixtralConfig

    folder = tmp_path_factory.mktemp("mixtral")
    MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    ).save_pretrained(folder)
    return folder


def _trainable(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_distilbert_default_targets_are_every_linear_layer_but_the_head(distilbert):
    workload = Workload(model=str(distilbert), seq_len=16)
    plan = lora_targets_for(workload, None, task="seq-cls")  # no model given: built on the meta device
    assert plan.target_modules == DISTILBERT_FALLBACK  # pre_classifier belongs to the head PEFT trains in full
    assert plan.modules_to_save == ("classifier",) and plan.task_type == "SEQ_CLS"
    assert plan.note == "every linear layer but the task head (PEFT has no default targets for distilbert)"


@pytest.mark.slow  # a new interpreter and a real trial: about 20 s on a busy 2-core machine
def test_distilbert_lora_trial_trains_adapters_and_the_classifier(distilbert):
    proc = commands.autotune(
        "trial",
        "--model",
        str(distilbert),
        "--lora-rank",
        "8",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--micro-batch",
        "2",
        "--warmup-steps",
        "0",
        "--steps",
        "1",
        "--json",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "ok"
    # per layer rank-8 A and B of q, k, v, out (32 -> 32), lin1 (32 -> 64), lin2 (64 -> 32); then
    # pre_classifier (32x32 + 32) and classifier (32x2 + 2) in full
    assert result["trainable_params"] == 2 * (4 * 8 * (32 + 32) + 2 * 8 * (32 + 64)) + 32 * 32 + 32 + 32 * 2 + 2


def test_distilbert_trains_line_says_which_layers(distilbert):
    note = what_is_trained(TrialConfig(micro_batch=2, lora_rank=8), Workload(model=str(distilbert), seq_len=16))["note"]
    assert note == (
        "LoRA r=8 adapters, on every linear layer but the task head (PEFT has no default targets for "
        "distilbert), plus the classification head in full, trained in fp32"
    )


def test_distilbert_peft_export_adapts_what_the_trial_adapted(distilbert, tmp_path):
    from peft import LoraConfig, get_peft_model

    from autotune.output.exporters import export_config
    from autotune.trial.engine import build_engine

    workload = Workload(model=str(distilbert), seq_len=16, global_batch=2)
    config = TrialConfig(micro_batch=2, lora_rank=8)
    (tmp_path / "adapter_config.json").write_text(export_config(config, workload, fmt="peft"))
    loaded = LoraConfig.from_pretrained(str(tmp_path))
    assert loaded.target_modules == set(DISTILBERT_FALLBACK) and loaded.task_type == "SEQ_CLS"
    users_job = get_peft_model(build_model(workload, task="seq-cls", device=torch.device("cpu")), loaded)
    trial = build_engine(workload=workload, config=config, task="seq-cls", device=torch.device("cpu"), world_size=1)
    assert _trainable(users_job) == _trainable(trial.model)


def test_mixtral_lora_with_default_targets_trains(mixtral):
    workload = Workload(model=str(mixtral), seq_len=16, global_batch=2)
    assert lora_targets_for(workload, None, task="causal-lm").target_modules == ("q_proj", "v_proj")
    r = run_trial(workload, TrialConfig(micro_batch=2, lora_rank=8), warmup_steps=0, measure_steps=1, timeout_s=300)
    assert r.status is TrialStatus.OK, r.error
    # q_proj (64 -> 64) and v_proj (64 -> 32, two KV heads) in 2 layers, rank 8
    assert r.trainable_params == 2 * (8 * (64 + 64) + 8 * (64 + 32))


@pytest.mark.slow
def test_a_factory_model_gets_its_linear_layers_but_the_vocabulary_projection():
    workload = Workload(model="factories:mlp", seq_len=8, global_batch=2)
    plan = lora_targets_for(workload, None, task="causal-lm")  # built on the meta device in a child process
    assert (plan.target_modules, plan.modules_to_save, plan.task_type) == (("hidden",), None, None)
    r = run_trial(workload, TrialConfig(micro_batch=2, lora_rank=4), warmup_steps=0, measure_steps=1, timeout_s=300)
    assert r.status is TrialStatus.OK, r.error
    assert r.trainable_params == 4 * (32 + 32)


def test_under_16_bit_precision_the_frozen_base_is_held_in_16_bits_and_the_estimator_counts_it():
    """What LoRA recipes run (PEFT with torch_dtype=bfloat16): the frozen weights' bytes halve."""
    import torch

    from autotune.estimate.client import predict_memory
    from autotune.study.summary import what_is_trained
    from autotune.trial.engine import build_engine
    from autotune.trial.runner import run_trial

    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4)
    fp32, bf16 = TrialConfig(micro_batch=4, lora_rank=8), TrialConfig(micro_batch=4, lora_rank=8, precision="bf16")
    engine = build_engine(workload=workload, config=bf16, task="causal-lm", device=torch.device("cpu"), world_size=1)
    dtypes = {(p.requires_grad, p.dtype) for p in engine.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}  # adapters stay fp32
    full, half = (predict_memory(workload, c) for c in (fp32, bf16))
    assert half.parameters_bytes == pytest.approx(full.parameters_bytes / 2, rel=0.01)
    measured = run_trial(workload, bf16, measure_steps=1)
    assert measured.ok, measured.error
    assert half.predicted_peak_bytes == pytest.approx(measured.peak_memory_bytes, rel=0.05)
    assert measured.peak_memory_bytes < run_trial(workload, fp32, measure_steps=1).peak_memory_bytes
    assert what_is_trained(bf16)["note"].endswith("; the frozen base held in bf16")
