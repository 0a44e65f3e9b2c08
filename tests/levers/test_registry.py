"""The registry: every lever is asked in its order, and the model's facts are read once for all of them."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers import LABEL_ORDER, LEVERS
from autotune.prepare import refusal_before_trial, workload_facts


def test_the_model_facts_are_read_once_for_every_lever(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(workload_facts, "resolve_task", lambda workload: calls.append(workload.model) or "causal-lm")
    config = TrialConfig(loss="chunked", attention="eager", checkpointing=True, checkpoint_every=2)
    assert refusal_before_trial(Workload(model="builtin:llama-tiny"), config) is None
    assert calls == ["builtin:llama-tiny"]  # the loss and attention both asked for the task: resolved once


def test_a_config_at_its_defaults_has_no_lever_words_but_its_precision() -> None:
    config = TrialConfig()
    assert [words for lever in LABEL_ORDER if (words := lever.labels(config))] == [["fp32"]]
    assert config.describe() == "mb=1 fp32"


def test_every_lever_names_its_fields_and_says_nothing_of_another_levers() -> None:
    config = TrialConfig(checkpointing=True, compile=True)
    for lever in LEVERS:
        words = lever.labels(config)
        assert bool(words) == (lever.name in ("precision", "checkpointing", "compile")), lever
