"""Activation checkpointing through the names Transformers has today, and through the older name where a model
has only that one (older Transformers releases, factories' models written for them)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from autotune.errors import ConfigError
from autotune.levers import checkpointing
from autotune.levers.checkpointing import checkpointing_call, enable_checkpointing


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("every", [1, 2])
def test_a_transformers_model_checkpoints_without_a_deprecation_warning(every: int) -> None:
    model = _tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        enable_checkpointing(model, every)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [i % every == 0 for i in range(4)]
    assert model.config.use_cache is False


class _OldStyle(torch.nn.Module):
    """A model with only the name Transformers used before activation_checkpointing_enable."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None, **kwargs: Any) -> None:
        self.calls.append((gradient_checkpointing_kwargs, kwargs))


def test_a_model_with_only_the_older_name_checkpoints_through_it() -> None:
    model = _OldStyle()
    enable_checkpointing(model)
    enable_checkpointing(model, 3)
    assert model.calls == [({"use_reentrant": False}, {}), ({"use_reentrant": False}, {"every_n_layers": 3})]


def test_a_model_without_either_name_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"has no activation_checkpointing_enable\(\) or gradient_checkpointing"):
        enable_checkpointing(torch.nn.Linear(2, 2), source="the model from --model factories:tiny")


def test_the_exported_call_names_what_the_installed_transformers_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpointing, "transformers_release", lambda: (5, 24))
    assert checkpointing_call(2) == (
        'model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, '
        "every_n_layers=2)"
    )
    monkeypatch.setattr(checkpointing, "transformers_release", lambda: (4, 45))  # the oldest pyproject.toml allows
    assert (
        checkpointing_call()
        == 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    )
