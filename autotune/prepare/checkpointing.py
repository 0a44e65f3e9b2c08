"""Activation checkpointing: turning it on in a built model, and knowing before any trial whether
a model can do it at all (a space then leaves the knob out instead of measuring failures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from autotune.errors import ConfigError
from autotune.models.sources import (
    meta_model,
    parse_model_source,
    resolve_task,
)
from autotune.prepare.model_facts import (
    CHECKPOINTING_METHODS,
    NO_CHECKPOINTING_METHOD,
    checkpointing_gap,
    factory_facts,
    hf_model_class,
)

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = [
    "enable_checkpointing",
    "checkpointing_method",
    "checkpointing_call",
    "missing_checkpointing",
    "every_n_refusal",
    "transformers_release",
    "EVERY_N_SINCE",
    "ACTIVATION_NAMES_SINCE",
]

# The Transformers release whose checkpointing takes every_n_layers, and that renamed TrainingArguments'
# gradient_checkpointing to activation_checkpointing.
EVERY_N_SINCE = (5, 23)
# A release known to name the model's method activation_checkpointing_enable(activation_checkpointing_kwargs=...)
# (gradient_checkpointing_enable and is_gradient_checkpointing warn there, and go in v6). Every release before v6
# keeps the old names, so a release before this one is told the old name: right whether or not it has the new one.
ACTIVATION_NAMES_SINCE = (5, 24)


def transformers_release() -> tuple[int, int] | None:
    """(major, minor) of the installed transformers, read without importing it; None if unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("transformers").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None
    return major, minor


def checkpointing_method(model: Any) -> tuple[Callable[..., Any], str] | None:
    """The model's method that turns activation checkpointing on and the name of its keyword argument for
    ``torch.utils.checkpoint``'s options, in the names the model has (current first); None without one."""
    for name, kwargs in CHECKPOINTING_METHODS:
        method = getattr(model, name, None)
        if callable(method):
            return method, kwargs
    return None


def checkpointing_call(every: int = 1) -> str:
    """The call that turns checkpointing on in a user's job, in the names the installed Transformers reads
    (found without importing it), e.g. ``model.activation_checkpointing_enable(...)``."""
    release = transformers_release()
    name, kwargs = CHECKPOINTING_METHODS[0 if release is None or release >= ACTIVATION_NAMES_SINCE else 1]
    every_n = f", every_n_layers={every}" if every > 1 else ""
    return f'model.{name}({kwargs}={{"use_reentrant": False}}{every_n})'


def enable_checkpointing(model: torch.nn.Module, every: int = 1, *, source: str = "the model") -> None:
    """Non-reentrant activation checkpointing of every layer, or of every ``every``-th decoder layer.
    ``source``: the model in words, for errors (e.g. "the model from --model builtin:llama-tiny")."""
    found = checkpointing_method(model)
    if found is None:
        raise ConfigError(f"--checkpointing on: {source} {NO_CHECKPOINTING_METHOD}; add one or use --checkpointing off")
    enable, kwargs = found
    # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DeepSpeed.
    if every == 1:
        try:
            enable(**{kwargs: {"use_reentrant": False}})
        except ValueError as exc:  # Transformers: "... does not support activation checkpointing"
            raise ConfigError(
                f"--checkpointing on: {str(exc).splitlines()[0]} ({source}); use --checkpointing off"
            ) from None
    else:
        try:
            enable(**{kwargs: {"use_reentrant": False}}, every_n_layers=every)
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
