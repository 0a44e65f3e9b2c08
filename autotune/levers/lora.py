"""LoRA and the quantized base: train PEFT's low-rank adapters instead of all weights (``--lora-rank``, its
``--lora-alpha`` and ``--lora-targets``), on a frozen base held as it loads or quantized by bitsandbytes
(``--quantize-base nf4|int8``: QLoRA). Both change what is trained, like the precision, so a search moves them
only where its space says.

Which layers LoRA adapts (:func:`lora_targets`: PEFT's default targets for the architecture where PEFT has
them, else every linear layer but the task head) is resolved here from the model's facts, for trials, the
estimator and the peft export alike, so a user's job adapts what was measured. Applied to a built model by
``autotune.prepare`` (:meth:`LoraLever.adapt`; :mod:`autotune.prepare.quantize` swaps the base's linear layers
first), between checkpointing and the precision: PEFT makes its adapters fp32, and the precision then decides
where the frozen base is held. The search space's ``lora`` parameter (rank, quantization and targets in one
label) and the quantized base's applying are still outside this module (``autotune.search.space``,
``autotune.prepare.quantize``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from autotune.errors import ConfigError, WorkloadError
from autotune.levers.base import Flag, Lever, ModelFacts, is_count
from autotune.levers.fsdp import fsdp_flag
from autotune.levers.zero import zero_flag

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "LoraFields",
    "LoraLever",
    "LoraTargets",
    "lora_targets",
    "lora_targets_note",
    "QUANTIZATIONS",
    "QUANTIZE_REFUSAL",
    "quantize_library_refusal",
    "quantize_refusal",
]

# QLoRA's frozen base under LoRA: off, NF4 (4-bit, double-quantized scales) or LLM.int8() (bitsandbytes).
QUANTIZATIONS = ("off", "nf4", "int8")

QUANTIZE_REFUSAL = (
    "--quantize-base needs bitsandbytes (pip install 'bitsandbytes>=0.48'; it runs on a CPU too), "
    "which is not installed; install it, or use --quantize-base off"
)


@dataclass(frozen=True, kw_only=True)
class LoraFields:
    lora_rank: int | None = field(
        default=None,
        metadata={"help": "Train LoRA adapters of this rank (PEFT) instead of all weights."},
    )
    lora_alpha: int | None = field(
        default=None,
        metadata={"help": "LoRA scaling alpha (default: 2 x rank)."},
    )
    lora_targets: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "Comma-separated module names LoRA adapts, or all-linear "
            "(default: PEFT's choice for the architecture)."
        },
    )
    quantize_base: str = field(
        default="off",
        metadata={
            "help": "With LoRA: hold the frozen base's linear layers quantized (bitsandbytes, as "
            "BitsAndBytesConfig loads them): nf4 (QLoRA's 4-bit NormalFloat, double-quantized scales), "
            "int8 (LLM.int8()) or off. Changes the maths, like precision."
        },
    )

    def __post_init__(self) -> None:
        # Normalise list-like targets so equal configs compare (and hash) equal.
        if self.lora_targets is not None and not isinstance(self.lora_targets, tuple):
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))

    @property
    def uses_lora(self) -> bool:
        return self.lora_rank is not None

    @property
    def quantizes_base(self) -> bool:
        """The frozen base is held quantized (``--quantize-base nf4`` or ``int8``)."""
        return self.quantize_base != "off"

    @property
    def effective_lora_alpha(self) -> int | None:
        if self.lora_rank is None:
            return None
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank


def quantize_library_refusal() -> str | None:
    """Why no base can be quantized here (bitsandbytes is not installed), or None."""
    return QUANTIZE_REFUSAL if importlib.util.find_spec("bitsandbytes") is None else None


def quantize_refusal(config: TrialConfig) -> str | None:
    """Why ``config``'s base cannot be quantized here (None: it can)."""
    refusal = quantize_library_refusal()
    if refusal is not None:
        return refusal
    sharding = zero_flag(config) or fsdp_flag(config)
    if sharding is not None:
        return (
            f"--quantize-base {config.quantize_base} with {sharding}: sharding a bitsandbytes-quantized base "
            "needs its storage type set to the compute type, which autotune does not measure yet; "
            "use --quantize-base off, or drop the sharding (a quantized base with LoRA fits on one rank)"
        )
    return None


@dataclass(frozen=True)
class LoraTargets:
    """What ``LoraConfig`` gets for a model and config, and the same said in words.

    Trials and the peft export both use it, so the user's job adapts what was measured.
    """

    target_modules: str | tuple[str, ...]  # "all-linear" (PEFT's keyword) or module names
    modules_to_save: tuple[str, ...] | None  # heads trained in full (a classifier's), as PEFT saves them
    task_type: str | None  # PEFT's TaskType value; None for a factory's plain module
    note: str  # e.g. "q_proj, v_proj (PEFT's default targets for llama)"

    def peft_kwargs(self) -> dict[str, Any]:
        """``LoraConfig`` keyword arguments: what a trial applies and the peft export writes."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        # PEFT's SEQ_CLS adds classifier and score to modules_to_save itself: name only other heads.
        own = ("classifier", "score") if self.task_type == "SEQ_CLS" else ()
        extra = [name for name in self.modules_to_save or () if name not in own]
        return {"target_modules": targets, "modules_to_save": extra or None, "task_type": self.task_type}


# PEFT has no masked-LM type: a masked LM's LoRA is a plain PeftModel.
_PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq-lm": "SEQ_2_SEQ_LM"}


def lora_targets(facts: ModelFacts, targets: tuple[str, ...] | None) -> LoraTargets:
    """Resolve ``--lora-targets`` (None: the default) for the model ``facts`` describe.

    The default is PEFT's own targets for the architecture where PEFT has them, else every linear layer but the
    task head, and a classifier's head then trains in full (as PEFT's SEQ_CLS does). WorkloadError where the
    model's layers cannot be found, or none but its head is linear.
    """
    task_type = None if facts.is_factory else _PEFT_TASK_TYPES.get(facts.task)
    note = lora_targets_note(facts, targets)
    if targets == ("all-linear",):
        return LoraTargets("all-linear", None, task_type, note)
    if targets is not None:
        return LoraTargets(tuple(targets), None, task_type, note)
    defaults = _peft_default_targets(facts.model_type)
    if defaults is not None:  # named here: PEFT's own lookup fails on some (Mixtral under transformers 5)
        # PEFT has no image task type: its recipe names the classifier to train in full.
        return LoraTargets(defaults, ("classifier",) if facts.task == "image-cls" else None, task_type, note)
    layers = facts.linear_layers
    if layers is None:
        raise WorkloadError(
            f"--model {facts.model}: building it on the meta device failed, so its linear "
            "layers are unknown; name the modules to adapt with --lora-targets"
        )
    found, heads = layers
    if not found:
        raise WorkloadError(
            f"--lora-rank: the model from --model {facts.model} has no linear layer besides "
            "its task head to adapt; name the modules with --lora-targets"
        )
    return LoraTargets(found, heads if facts.new_head and heads else None, task_type, note)


def lora_targets_note(facts: ModelFacts, targets: tuple[str, ...] | None) -> str:
    """Which layers LoRA adapts, in words, without building the model."""
    if targets == ("all-linear",):
        return "every linear layer but the output layer or classifier (PEFT's all-linear)"
    if targets is not None:
        return ", ".join(targets)
    name = facts.model_type
    defaults = _peft_default_targets(name)
    if defaults is not None:
        return f"{', '.join(defaults)} (PEFT's default targets for {name})"
    return f"every linear layer but the task head (PEFT has no default targets for {name or 'a custom model'})"


def _peft_default_targets(model_type: str | None) -> tuple[str, ...] | None:
    if model_type is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return tuple(targets) if targets else None


def _targets(value: str | None) -> tuple[str, ...] | None:
    """``--lora-targets q_proj,v_proj`` as the field's tuple (None: the default targets)."""
    return tuple(target.strip() for target in value.split(",")) if value is not None else None


class LoraLever(Lever):
    name = "lora"
    fields = ("lora_rank", "lora_alpha", "lora_targets", "quantize_base")
    flags = (
        Flag("lora_rank", ("--lora-rank",), Optional[int], None),
        Flag("lora_alpha", ("--lora-alpha",), Optional[int], None),
        Flag(
            "lora_targets",
            ("--lora-targets",),
            Optional[str],
            None,
            parse=lambda value: {"lora_targets": _targets(value)},
        ),
        Flag("quantize_base", ("--quantize-base",), str, "off"),
    )

    def check(self, config: TrialConfig) -> None:
        if config.lora_rank is not None and not is_count(config.lora_rank):
            raise ConfigError(f"--lora-rank {config.lora_rank!r} must be a whole number of at least 1")
        if config.lora_rank is None and (config.lora_alpha is not None or config.lora_targets is not None):
            flag = "--lora-alpha" if config.lora_alpha is not None else "--lora-targets"
            raise ConfigError(f"{flag} is set but LoRA is off; add --lora-rank R to train LoRA adapters")
        if config.lora_alpha is not None and not is_count(config.lora_alpha):
            raise ConfigError(f"--lora-alpha {config.lora_alpha!r} must be a whole number of at least 1")
        if config.lora_targets is not None and (not config.lora_targets or not all(config.lora_targets)):
            raise ConfigError("--lora-targets is empty; name modules (e.g. q_proj,v_proj) or use all-linear")
        if config.quantize_base not in QUANTIZATIONS:
            raise ConfigError(
                f"--quantize-base {config.quantize_base!r} is not known; use one of {', '.join(QUANTIZATIONS)}"
            )
        if config.quantizes_base and not config.uses_lora:
            raise ConfigError(
                f"--quantize-base {config.quantize_base} quantizes the frozen base that LoRA trains adapters on; "
                "add --lora-rank R, or use --quantize-base off"
            )

    # -- a search space's ``lora`` parameter: rank, quantized base and targets in one value ---------------------
    def lora_values(
        self, ranks: tuple[int | None, ...], targets: tuple[str, ...], quantizations: tuple[str, ...]
    ) -> tuple[str, ...]:
        """The parameter's values for a space's ranks x targets x quantizations (``off``, ``16``, ``16/nf4``,
        ``16:q_proj,v_proj``), each once: the sampler never proposes a quantized base or targets without LoRA."""
        return tuple(
            dict.fromkeys(_lora_label(rank, target, q) for rank in ranks for target in targets for q in quantizations)
        )

    def lora_fields(self, value: str, alpha: int | None) -> dict[str, Any]:
        """The config's LoRA fields of one of the parameter's values (``alpha``: the space's, not searched)."""
        rank_and_quantization, _, targets = value.partition(":")
        rank, _, quantization = rank_and_quantization.partition("/")
        return {
            "lora_rank": None if rank == "off" else int(rank),
            "lora_alpha": alpha if rank != "off" else None,
            "lora_targets": tuple(targets.split(",")) if targets else None,
            "quantize_base": quantization or "off",
        }

    def lora_param(self, config: TrialConfig) -> str:
        """The parameter's value for ``config``."""
        if not config.uses_lora:
            return "off"
        targets = ",".join(config.lora_targets) if config.lora_targets else "default"
        return _lora_label(config.lora_rank, targets, config.quantize_base)

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return quantize_refusal(config) if config.quantizes_base else None

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.uses_lora and config.lora_targets is None  # named targets need no facts

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        return facts.default_lora_refusal

    def adapt(self, model: torch.nn.Module, config: TrialConfig, facts: ModelFacts) -> torch.nn.Module:
        """PEFT's LoRA adapters on a built model (``facts``: the built model's), on the targets
        :func:`lora_targets` resolves; the model as it is without LoRA. A quantized base is swapped in before
        (``autotune.prepare``): the adapters wrap its quantized layers."""
        if not config.uses_lora:
            return model
        from peft import LoraConfig, get_peft_model

        try:
            targets = lora_targets(facts, config.lora_targets)
        except WorkloadError as exc:
            raise ConfigError(str(exc)) from exc
        assert config.lora_rank is not None and config.effective_lora_alpha is not None, "a LoRA config only"
        lora = LoraConfig(
            r=config.lora_rank, lora_alpha=config.effective_lora_alpha, lora_dropout=0.0, **targets.peft_kwargs()
        )
        try:
            return get_peft_model(model, lora)
        except (ValueError, TypeError) as exc:  # TypeError: e.g. a target inside a head PEFT trains in full
            raise ConfigError(
                f"--lora-targets: {str(exc).splitlines()[0]}; name the modules to adapt, "
                "e.g. --lora-targets q_proj,v_proj, or --lora-targets all-linear"
            ) from exc

    def labels(self, config: TrialConfig) -> list[str]:
        labels = []
        if config.uses_lora:
            targets = ":" + ",".join(config.lora_targets) if config.lora_targets else ""
            labels.append(f"lora{config.lora_rank}{targets}")
        if config.quantizes_base:
            labels.append(config.quantize_base)
        return labels


def _lora_label(rank: int | None, targets: str, quantization: str = "off") -> str:
    if rank is None:
        return "off"
    rank_part = str(rank) if quantization == "off" else f"{rank}/{quantization}"
    return rank_part if targets == "default" else f"{rank_part}:{targets}"
