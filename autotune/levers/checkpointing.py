"""Activation checkpointing: its fields, turning it on in a built model (every layer, every N-th layer, or every
layer with per-operator selective checkpointing), and knowing before any trial whether a model can do it at all
(a space then leaves the knob out instead of measuring failures; the model's facts are found by
``autotune.prepare.model_facts``).
"""

from __future__ import annotations

import functools
from collections import defaultdict
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
    "selective_context",
    "SELECTIVE",
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


SELECTIVE = "selective"  # --checkpointing selective, and its value in a search space


@functools.lru_cache(maxsize=1)  # asked at every checkpointed layer's call: the same sets each time
def _selective_ops() -> tuple[frozenset[Any], frozenset[Any]]:
    """The operators whose outputs per-operator selective checkpointing keeps, as torchtitan's "selective op"
    mode keeps them (``_save_list`` in ``parallelize_llama``, at the commit its December 2024 benchmarks name):
    (the matmuls, of which every other output is kept; the rest, always kept). The attention kernels (with the
    CPU's fused kernel, which torchtitan never meets), the reduce-scatter of tensor parallel's sequence shards, and
    ``max`` (float8's scales). Linear layers with a bias dispatch ``addmm``, which torchtitan's biasless Llama
    never does: counted as a matmul. Operators this torch lacks are left out."""
    import torch

    def present(namespace: Any, names: tuple[str, ...]) -> frozenset[Any]:
        return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))

    matmuls = present(torch.ops.aten, ("mm", "addmm"))
    kept = present(
        torch.ops.aten,
        (
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        ),
    )
    kept |= frozenset({torch.ops.aten.max.default})
    if hasattr(torch.ops, "_c10d_functional") and hasattr(torch.ops._c10d_functional, "reduce_scatter_tensor"):
        kept |= frozenset({torch.ops._c10d_functional.reduce_scatter_tensor.default})
    return matmuls, kept


def selective_context() -> Any:
    """``torch.utils.checkpoint.checkpoint``'s ``context_fn`` for per-operator selective checkpointing: a fresh
    pair of contexts for each checkpointed call, whose policy keeps the outputs of :func:`_selective_ops` (every
    other matmul's, counted within the call, as torchtitan counts them: the odd ones kept) and recomputes every
    other operator in the backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls, kept = _selective_ops()
    counts: defaultdict[bool, int] = defaultdict(int)  # matmuls seen, in the forward and in the recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


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


def checkpointing_call(every: int = 1, *, selective: bool = False) -> str:
    """The call that turns checkpointing on in a user's job, in the names the installed Transformers reads
    (found without importing it), e.g. ``model.activation_checkpointing_enable(...)``."""
    release = transformers_release()
    name, kwargs = CHECKPOINTING_METHODS[0 if release is None or release >= ACTIVATION_NAMES_SINCE else 1]
    every_n = f", every_n_layers={every}" if every > 1 else ""
    policy = ', "context_fn": selective_context' if selective else ""
    call = f'model.{name}({kwargs}={{"use_reentrant": False{policy}}}{every_n})'
    return f"{call}, with selective_context from {__name__}" if selective else call


def enable_checkpointing(
    model: torch.nn.Module, every: int = 1, *, selective: bool = False, source: str = "the model"
) -> None:
    """Non-reentrant activation checkpointing of every layer, or of every ``every``-th decoder layer; with
    ``selective``, of every layer keeping what :func:`selective_context` keeps.
    ``source``: the model in words, for errors (e.g. "the model from --model builtin:llama-tiny")."""
    mode = SELECTIVE if selective else "on"
    found = checkpointing_method(model)
    if found is None:
        raise ConfigError(
            f"--checkpointing {mode}: {source} {NO_CHECKPOINTING_METHOD}; add one or use --checkpointing off"
        )
    enable, kwargs = found
    # Non-reentrant checkpointing works with frozen inputs (LoRA) and with DeepSpeed.
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        options["context_fn"] = selective_context
    if every == 1:
        try:
            enable(**{kwargs: options})
        except ValueError as exc:  # Transformers: "... does not support activation checkpointing"
            raise ConfigError(
                f"--checkpointing {mode}: {str(exc).splitlines()[0]} ({source}); use --checkpointing off"
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
    """A space file's checkpointing value: true, false, selective, or every-N with N >= 2 (None: anything else)."""
    if isinstance(value, bool) or value == SELECTIVE:
        return value
    kind, _, every = value.partition("-") if isinstance(value, str) else ("", "", "")
    return f"every-{int(every)}" if kind == "every" and every.isdigit() and int(every) >= 2 else None


def _every_n(value: Any) -> bool:
    """A space's checkpointing value is every-N."""
    return isinstance(value, str) and value != SELECTIVE


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
    checkpoint_selective: bool = field(
        default=False,
        metadata={
            "help": "With checkpointing on every layer: per-operator selective checkpointing (torchtitan's "
            "selective op): each layer keeps its attention's and every other matmul's outputs and recomputes "
            "the rest."
        },
    )


def checkpointing_flag(value: str) -> dict[str, Any]:
    """``--checkpointing off|on|every-N|selective`` as the lever's fields."""
    if value.lower() == SELECTIVE:
        return {"checkpointing": True, "checkpoint_selective": True}
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
        raise ConfigError(f"--checkpointing {value!r} must be on, off, every-N (e.g. every-2) or selective") from None


class CheckpointingLever(Lever):
    name = "checkpointing"
    fields = ("checkpointing", "checkpoint_every", "checkpoint_selective")
    flags = (
        Flag(
            "checkpointing",
            ("--checkpointing",),
            str,
            "off",
            "off, on, every-N (every N-th decoder layer), or selective (every layer, per operator). ",
            checkpointing_flag,
        ),
    )
    # One axis for the three fields: false, true (every layer), every-N or selective.
    axes = (
        Axis(
            "checkpointing",
            "a list of true/false, every-N (every N-th decoder layer, N >= 2) or selective",
            False,
            _in_space,
        ),
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
        if not isinstance(config.checkpoint_selective, bool):
            raise ConfigError(f"checkpoint_selective {config.checkpoint_selective!r} must be true or false")
        if config.checkpoint_selective and (not config.checkpointing or config.checkpoint_every > 1):
            raise ConfigError(
                "--checkpointing selective checkpoints every layer: it cannot go with checkpointing off or every-N"
            )

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.checkpointing

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        if config.checkpoint_every > 1:
            return every_n_refusal(facts)
        if not config.checkpointing:
            return None
        # A Hugging Face model's class says so from its config; a factory's model is asked by its trial.
        missing = None if facts.is_factory else facts.missing_checkpointing
        if missing is None:
            return None
        return f"--checkpointing {self.flag_value(config)}: {missing}; use --checkpointing off"

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
        refusal = every_n_refusal(facts) if any(_every_n(value) for value in kept) else None
        if refusal is not None:
            kept = tuple(value for value in kept if not _every_n(value))
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
        every_n = [value for value in space["checkpointing"] if _every_n(value)]
        refusal = every_n_refusal(facts) if every_n else None
        return [] if refusal is None else [f"checkpointing {', '.join(every_n)}: {refusal}"]

    def param_of(self, key: str, config: TrialConfig) -> Any:
        if config.checkpoint_selective:
            return SELECTIVE
        return config.checkpointing if config.checkpoint_every == 1 else f"every-{config.checkpoint_every}"

    def config_fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        value = params["checkpointing"]
        every = int(value.removeprefix("every-")) if _every_n(value) else 1
        return {"checkpointing": bool(value), "checkpoint_every": every, "checkpoint_selective": value == SELECTIVE}

    def flag_value(self, config: TrialConfig) -> str:
        """The ``--checkpointing`` value that gives ``config``'s fields."""
        if not config.checkpointing:
            return "off"
        if config.checkpoint_selective:
            return SELECTIVE
        return "on" if config.checkpoint_every == 1 else f"every-{config.checkpoint_every}"

    def trainer_applies(self, config: TrialConfig) -> bool:
        """Whether Transformers' Trainer applies ``config``'s checkpointing from its arguments: its arguments are
        JSON, which cannot carry selective checkpointing's policy (a function), so a job applies that itself."""
        return not config.checkpoint_selective

    def forward_rerun_share(self, config: TrialConfig) -> float | None:
        """The share of the layers' forward that the backward runs again under ``config``'s checkpointing, where
        arithmetic on a step traced without checkpointing gives it: 0 off, 1/N on every N-th layer; None for
        selective checkpointing, whose recompute leaves out the kept operators (its own trace says what it
        reruns)."""
        if config.checkpoint_selective:
            return None
        return 1 / config.checkpoint_every if config.checkpointing else 0.0

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        if config.checkpointing:
            enable_checkpointing(model, config.checkpoint_every, selective=config.checkpoint_selective, source=source)
        return model

    def labels(self, config: TrialConfig) -> list[str]:
        if not config.checkpointing:
            return []
        if config.checkpoint_selective:
            return ["ckpt-sel"]
        return ["ckpt" if config.checkpoint_every == 1 else f"ckpt/{config.checkpoint_every}"]

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        name = checkpointing_argument()
        if not config.checkpointing or not self.trainer_applies(config):
            return {name: False}
        # What the trials measured: non-reentrant (it works with LoRA and DeepSpeed); every n-th layer read by the
        # Trainer out of these kwargs (Transformers >= 5.23).
        every = {"every_n_layers": config.checkpoint_every} if config.checkpoint_every > 1 else {}
        return {name: True, f"{name}_kwargs": {"use_reentrant": False, **every}}

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        # torchtitan's [activation_checkpoint]: its selective modes are per operator ("op": every other matmul's
        # output kept, as --checkpointing selective) or every N-th layer (a number, as every-N); its default is
        # selective, so "none" is said.
        if not config.checkpointing:
            keys: dict[str, Any] = {"mode": "none"}
        elif config.checkpoint_selective:
            keys = {"mode": "selective", "selective_ac_option": "op"}
        elif config.checkpoint_every > 1:
            keys = {"mode": "selective", "selective_ac_option": str(config.checkpoint_every)}
        else:
            keys = {"mode": "full"}
        return {"activation_checkpoint": keys}

    def header_lines(self, config: TrialConfig) -> list[str]:
        if not config.checkpointing:
            return ["activation checkpointing: off"]
        call = checkpointing_call(config.checkpoint_every, selective=config.checkpoint_selective)
        return [f"activation checkpointing: {self.flag_value(config)}: {call}"]

    def in_code(self, config: TrialConfig) -> list[str]:
        if self.trainer_applies(config):
            return []
        return [
            "selective checkpointing: no library's config carries its policy (a function); call "
            f"{checkpointing_call(selective=True)}, before the hf Trainer (its activation_checkpointing stays false)"
        ]

    def recomputes_more(self, config: TrialConfig, lighter: TrialConfig) -> bool:
        """Whether ``config`` is ``lighter`` checkpointing more layers, all else the same: ``lighter``'s work and
        a recompute, for memory needed only where ``lighter`` does not fit."""
        if not config.checkpointing:
            return False
        as_config = {"checkpointing": True, "checkpoint_every": config.checkpoint_every}
        if config.checkpoint_selective:  # more than none, and not comparable with every N-th layer
            fewer = not lighter.checkpointing
            as_config["checkpoint_selective"] = True
        elif lighter.checkpoint_selective:  # every layer in full recomputes more than selectively
            fewer = config.checkpoint_every == 1
            as_config["checkpoint_selective"] = False
        else:
            fewer = not lighter.checkpointing or lighter.checkpoint_every > config.checkpoint_every
        return fewer and lighter.replace(**as_config) == config
