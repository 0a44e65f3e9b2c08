"""LoRA and the quantized base: train PEFT's low-rank adapters instead of all weights (``--lora-rank``, its
``--lora-alpha`` and ``--lora-targets``), on a frozen base held as it loads or quantized by bitsandbytes
(``--quantize-base nf4|int8``: QLoRA). Both change what is trained, like the precision, so a search moves them
only where its space says.

Applied to a built model by ``autotune.prepare`` (:mod:`autotune.prepare.lora` resolves the targets for the
model's architecture, :mod:`autotune.prepare.quantize` swaps the base's linear layers first), between
checkpointing and the precision: PEFT makes its adapters fp32, and the precision then decides where the frozen
base is held. The search space's ``lora`` parameter (rank, quantization and targets in one label) is still
written out in ``autotune.search.space``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever, ModelFacts, is_count

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "LoraFields",
    "LoraLever",
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
    if config.uses_deepspeed or config.uses_fsdp:
        sharding = f"--zero-stage {config.zero_stage}" if config.uses_deepspeed else f"--fsdp {config.fsdp}"
        return (
            f"--quantize-base {config.quantize_base} with {sharding}: sharding a bitsandbytes-quantized base "
            "needs its storage type set to the compute type, which autotune does not measure yet; "
            "use --quantize-base off, or drop the sharding (a quantized base with LoRA fits on one rank)"
        )
    return None


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

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return quantize_refusal(config) if config.quantizes_base else None

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.uses_lora and config.lora_targets is None  # named targets need no facts

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        return facts.default_lora_refusal

    def labels(self, config: TrialConfig) -> list[str]:
        labels = []
        if config.uses_lora:
            targets = ":" + ",".join(config.lora_targets) if config.lora_targets else ""
            labels.append(f"lora{config.lora_rank}{targets}")
        if config.quantizes_base:
            labels.append(config.quantize_base)
        return labels
