"""Activation checkpointing: turning it on in a built model, and knowing before any trial whether
a model can do it at all (a space then leaves the knob out instead of measuring failures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.models.sources import (
    meta_model,
    parse_model_source,
    resolve_task,
)
from autotune.prepare.model_facts import (
    checkpointing_gap,
    factory_facts,
    hf_model_class,
)

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = ["enable_checkpointing", "missing_checkpointing", "every_n_refusal", "transformers_release", "EVERY_N_SINCE"]

# The Transformers release whose checkpointing takes every_n_layers, and that renamed TrainingArguments'
# gradient_checkpointing to activation_checkpointing.
EVERY_N_SINCE = (5, 23)


def transformers_release() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, read without importing it; None if unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("transformers").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None
    return major, minor


def enable_checkpointing(model: torch.nn.Module, every: int = 1, *, source: str = "the model") -> None:
    """Non-reentrant activation checkpointing of every layer, or of every ``every``-th decoder layer.
    ``source``: the model in words, for errors (e.g. "the model from --model builtin:llama-tiny")."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ConfigError(
            f"--checkpointing on: {source} has no gradient_checkpointing_enable(); add one or use --checkpointing off"
        )
    # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DeepSpeed.
    if every == 1:
        try:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        except ValueError as exc:  # Transformers: "... does not support activation checkpointing"
            raise ConfigError(
                f"--checkpointing on: {str(exc).splitlines()[0]} ({source}); use --checkpointing off"
            ) from None
    else:
        try:
            enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every)
        except TypeError as exc:
            raise ConfigError(
                f"--checkpointing every-{every}: {source} cannot checkpoint "
                f"every n-th layer ({exc}); use --checkpointing on or off"
            ) from None
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "use_cache"):
        model_config.use_cache = False


def every_n_refusal(workload: Workload) -> str | None:
    """Why ``--checkpointing every-N`` cannot apply here, or None (known before a trial)."""
    if parse_model_source(workload.model).kind == "factory":
        return (
            f"--checkpointing every-N: the model from --model {workload.model} is a factory's, whose layers "
            "autotune does not know; it applies to Hugging Face models (on or off work for factories)"
        )
    installed = transformers_release()
    if installed is not None and installed < EVERY_N_SINCE:
        return (
            f"--checkpointing every-N needs transformers >= {'.'.join(map(str, EVERY_N_SINCE))} "
            f"(every_n_layers); {'.'.join(map(str, installed))} is installed"
        )
    return None


def missing_checkpointing(workload: Workload) -> str | None:
    """Why the workload's model cannot checkpoint activations, or None when it can (or when that is
    unknown before a trial: a factory that fails to build fails its trials anyway).

    Hugging Face models: the model class's ``supports_gradient_checkpointing``, no model built.
    A factory: built once on the meta device in a separate process (its code may hang or crash).
    """
    source = parse_model_source(workload.model)
    task = resolve_task(workload)
    key = (workload.model, task, workload.seq_len, workload.trust_remote_code)
    if key not in _MISSING_CHECKPOINTING:  # the search space asks for every list of choices
        if source.kind == "factory":
            facts = factory_facts(workload, task)
            missing = None if facts is None else facts["missing_checkpointing"]
        else:
            model_class = hf_model_class(workload, task)
            if model_class is None:
                missing = checkpointing_gap(meta_model(workload, task), workload.model)
            elif not getattr(model_class, "supports_gradient_checkpointing", False):
                missing = f"{model_class.__name__} (--model {workload.model}) does not support gradient checkpointing"
            else:
                missing = None
        _MISSING_CHECKPOINTING[key] = missing
    return _MISSING_CHECKPOINTING[key]


_MISSING_CHECKPOINTING: dict[tuple[Any, ...], str | None] = {}
