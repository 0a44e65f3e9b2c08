"""The LoRA lever (autotune/levers/lora.py): its refusal of a model that its default targets cannot adapt comes
before any trial, from the model's facts, read once per workload."""

from __future__ import annotations

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers import LORA
from autotune.prepare import refusal_before_trial
from autotune.prepare.workload_facts import WorkloadFacts

# A factory whose only linear layer is its head (tests/factories.py): nothing for LoRA's default targets.
NO_TARGETS = Workload(model="factories:tiny", seq_len=64, global_batch=4)


def test_lora_on_default_targets_is_refused_before_a_trial_where_the_model_has_none():
    refusal = refusal_before_trial(NO_TARGETS, TrialConfig(lora_rank=8))
    assert refusal is not None and "has no linear layer besides its task head" in refusal
    assert "--lora-targets" in refusal  # what to do instead


def test_named_targets_and_models_with_defaults_ask_no_facts():
    named = TrialConfig(lora_rank=8, lora_targets=("head",))
    assert not LORA.needs_model_facts(named) and refusal_before_trial(NO_TARGETS, named) is None
    assert not LORA.needs_model_facts(TrialConfig())
    assert refusal_before_trial(Workload(model="builtin:gpt2-tiny"), TrialConfig(lora_rank=8)) is None


def test_the_facts_answer_once_per_workload():
    facts = WorkloadFacts(NO_TARGETS)
    assert facts.default_lora_refusal is not None
    assert WorkloadFacts(NO_TARGETS).default_lora_refusal is facts.default_lora_refusal  # cached, not probed again
