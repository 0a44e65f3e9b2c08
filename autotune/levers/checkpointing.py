"""Activation checkpointing: its fields, turning it on in a built model, and knowing before any trial whether
a model can do it at all (a space then leaves the knob out instead of measuring failures; the model's facts
are found by ``autotune.prepare.model_facts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, ModelFacts, is_count, on_off

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "CheckpointingFields",
    "CheckpointingLever",
    "enable_checkpointing",
    "checkpointing_method",
    "checkpointing_call",
    "every_n_refusal",
    "CHECKPOINTING_METHODS",
    "NO_CHECKPOINTING_METHOD",
    "transformers_release",
    "EVERY_N_SINCE",
    "ACTIVATION_NAMES_SINCE",
]

# A model's method that turns activation checkpointing on and the name of its argument for checkpoint()'s keywords:
# the current name first (Transformers 5.24 warns on the old one, which goes in v6), then the old one, for older
# Transformers (down to the oldest pyproject.toml allows) and for factories' models written for them.
CHECKPOINTING_METHODS = (
    ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
    ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
)
NO_CHECKPOINTING_METHOD = "has no " + " or ".join(f"{name}()" for name, _ in CHECKPOINTING_METHODS)
# The Transformers release whose checkpointing takes every_n_layers, and that renamed TrainingArguments'
# gradient_checkpointing to activation_checkpointing.
EVERY_N_SINCE = (5, 23)
# A release known to name the model's method activation_checkpointing_enable(activation_checkpointing_kwargs=...)
# (gradient_checkpointing_enable and is_gradient_checkpointing warn there, and go in v6). Every release before v6
# keeps the old names, so a release before this one is told the old name: right whether or not it has the new one.
ACTIVATION_NAMES_SINCE = (5, 24)


def checkpointing_argument() -> str:
    """Transformers 5.23 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name
    goes in v6): the name the installed version reads, found without importing transformers."""
    release = transformers_release()
    return "activation_checkpointing" if release is None or release >= EVERY_N_SINCE else "gradient_checkpointing"


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


def every_n_refusal(facts: ModelFacts) -> str | None:
    """Why ``--checkpointing every-N`` cannot apply here, or None (known before a trial)."""
    if facts.is_factory:
        return (
            f"--checkpointing every-N: the model from --model {facts.model} is a factory's, whose layers "
            "autotune does not know; it applies to Hugging Face models (on or off work for factories)"
        )
    installed = transformers_release()
    if installed is not None and installed < EVERY_N_SINCE:
        return (
            f"--checkpointing every-N needs transformers >= {'.'.join(map(str, EVERY_N_SINCE))} "
            f"(every_n_layers); {'.'.join(map(str, installed))} is installed"
        )
    return None


def _in_space(value: Any) -> bool | str | None:
    """A space file's checkpointing value: true, false, or every-N with N >= 2 (None: anything else)."""
    if isinstance(value, bool):
        return value
    kind, _, every = value.partition("-") if isinstance(value, str) else ("", "", "")
    return f"every-{int(every)}" if kind == "every" and every.isdigit() and int(every) >= 2 else None


@dataclass(frozen=True, kw_only=True)
class CheckpointingFields:
    checkpointing: bool = field(
        default=False,
        metadata={"help": "Activation checkpointing: recompute activations in backward."},
    )
    checkpoint_every: int = field(
        default=1,
        metadata={
            "help": "With checkpointing on: recompute only every N-th decoder layer (Transformers' "
            "every_n_layers); 1 is every layer."
        },
    )


def checkpointing_flag(value: str) -> dict[str, Any]:
    """``--checkpointing off|on|every-N`` as the lever's fields."""
    kind, _, every = value.lower().partition("-")
    if kind == "every":
        if not every.isdigit() or int(every) < 2:
            raise ConfigError(
                f"--checkpointing {value!r}: write every-N with N a whole number of 2 or more, e.g. every-2"
            )
        return {"checkpointing": True, "checkpoint_every": int(every)}
    try:
        return {"checkpointing": on_off(value, "--checkpointing")}
    except ConfigError:
        raise ConfigError(f"--checkpointing {value!r} must be on, off or every-N (e.g. every-2)") from None


class CheckpointingLever(Lever):
    name = "checkpointing"
    fields = ("checkpointing", "checkpoint_every")
    flags = (
        Flag(
            "checkpointing",
            ("--checkpointing",),
            str,
            "off",
            "off, on, or every-N (every N-th decoder layer). ",
            checkpointing_flag,
        ),
    )
    # One axis for both fields: false, true (every layer) or every-N.
    axes = (
        Axis("checkpointing", "a list of true/false, or every-N (every N-th decoder layer, N >= 2)", False, _in_space),
    )

    def check(self, config: TrialConfig) -> None:
        if not isinstance(config.checkpointing, bool):
            raise ConfigError(f"--checkpointing {config.checkpointing!r} must be on or off")
        if not is_count(config.checkpoint_every):
            raise ConfigError(
                f"--checkpointing every-{config.checkpoint_every!r}: N must be a whole number of 2 or more"
            )
        if config.checkpoint_every > 1 and not config.checkpointing:
            raise ConfigError(f"--checkpointing every-{config.checkpoint_every} needs checkpointing on")

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.checkpointing

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        if config.checkpoint_every > 1:
            return every_n_refusal(facts)
        if not config.checkpointing:
            return None
        # A Hugging Face model's class says so from its config; a factory's model is asked by its trial.
        missing = None if facts.is_factory else facts.missing_checkpointing
        return None if missing is None else f"--checkpointing on: {missing}; use --checkpointing off"

    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        kept = values
        missing = facts.missing_checkpointing if any(values) else None
        if missing is not None:
            kept = tuple(value for value in values if not value)
            if not kept:
                on = ", ".join("true" if value is True else str(value) for value in values if value)
                raise ConfigError(f"knobs.checkpointing [{on}]: {missing}; add false")
        refusal = every_n_refusal(facts) if any(isinstance(value, str) for value in kept) else None
        if refusal is not None:
            kept = tuple(value for value in kept if not isinstance(value, str))
            if not kept:
                every = ", ".join(str(value) for value in values)
                raise ConfigError(f"knobs.checkpointing [{every}]: {refusal}; add true or false")
        return kept

    def dropped(
        self, space: Mapping[str, tuple[Any, ...]], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> list[str]:
        missing = facts.missing_checkpointing if any(space["checkpointing"]) else None
        if missing is not None:
            return [f"checkpointing on: {missing}"]
        every_n = [value for value in space["checkpointing"] if isinstance(value, str)]
        refusal = every_n_refusal(facts) if every_n else None
        return [] if refusal is None else [f"checkpointing {', '.join(every_n)}: {refusal}"]

    def param_of(self, key: str, config: TrialConfig) -> Any:
        return config.checkpointing if config.checkpoint_every == 1 else f"every-{config.checkpoint_every}"

    def config_fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        value = params["checkpointing"]
        every = int(value.removeprefix("every-")) if isinstance(value, str) else 1
        return {"checkpointing": bool(value), "checkpoint_every": every}

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        if config.checkpointing:
            enable_checkpointing(model, config.checkpoint_every, source=source)
        return model

    def labels(self, config: TrialConfig) -> list[str]:
        if not config.checkpointing:
            return []
        return ["ckpt" if config.checkpoint_every == 1 else f"ckpt/{config.checkpoint_every}"]

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        name = checkpointing_argument()
        if not config.checkpointing:
            return {name: False}
        # What the trials measured: non-reentrant (it works with LoRA and DeepSpeed); every n-th layer read by the
        # Trainer out of these kwargs (Transformers >= 5.23).
        every = {"every_n_layers": config.checkpoint_every} if config.checkpoint_every > 1 else {}
        return {name: True, f"{name}_kwargs": {"use_reentrant": False, **every}}

    def header_lines(self, config: TrialConfig) -> list[str]:
        call = f"on: {checkpointing_call(config.checkpoint_every)}" if config.checkpointing else "off"
        return [f"activation checkpointing: {call}"]

    def recomputes_more(self, config: TrialConfig, lighter: TrialConfig) -> bool:
        """Whether ``config`` is ``lighter`` checkpointing more layers, all else the same: ``lighter``'s work and
        a recompute, for memory needed only where ``lighter`` does not fit."""
        if not config.checkpointing:
            return False
        fewer = not lighter.checkpointing or lighter.checkpoint_every > config.checkpoint_every
        return fewer and lighter.replace(checkpointing=True, checkpoint_every=config.checkpoint_every) == config
