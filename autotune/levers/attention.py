"""The attention kernel: Transformers' ``attn_implementation`` on a built model, and knowing before
any trial whether the model can take a kernel, and whether the device and the install can run it.

``auto`` leaves the model's own choice (Transformers picks ``sdpa`` where the model supports it).
``eager`` keeps the whole s x s scores for the backward; ``sdpa`` and the fused kernels do not, so
the kernel moves memory as well as speed on long sequences.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, ModelFacts, one_of

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "AttentionFields",
    "AttentionLever",
    "ATTENTIONS",
    "set_attention",
    "attention_refusal",
    "attention_device_refusal",
]

ATTENTIONS = ("auto", "eager", "sdpa", "flash_attention_2", "flex_attention")  # Transformers' attn_implementation


@dataclass(frozen=True, kw_only=True)
class AttentionFields:
    attention: str = field(
        default="auto",
        metadata={
            "help": "The attention kernel (Transformers' attn_implementation): auto (the model's default), "
            "eager, sdpa, flash_attention_2 or flex_attention (CUDA only)."
        },
    )


# Which class attribute says a Transformers model supports a kernel (eager: every model).
_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def set_attention(model: torch.nn.Module, attention: str, *, source: str = "the model") -> None:
    """Switch ``model`` (a Transformers model) to the ``attention`` kernel; ``auto`` changes nothing."""
    if attention == "auto":
        return
    switch = getattr(model, "set_attn_implementation", None)
    if switch is None:
        raise ConfigError(
            f"--attention {attention}: {source} has no set_attn_implementation() (a Transformers "
            "model's); use --attention auto"
        )
    try:
        switch(attention)
    except (ValueError, ImportError) as exc:  # Transformers says why: unsupported, or the package is missing
        raise ConfigError(
            f"--attention {attention}: {str(exc).strip().splitlines()[0]}; use --attention auto"
        ) from None


def attention_refusal(attention: str, facts: ModelFacts) -> str | None:
    """Why the workload's model cannot take ``attention`` (known before a trial), or None."""
    if attention == "auto":
        return None
    if facts.is_factory:
        return (
            f"--attention {attention}: the model from --model {facts.model} is a factory's, whose attention "
            "autotune does not know; it applies to Transformers models (use auto)"
        )
    flag = _SUPPORT_FLAGS.get(attention)
    if flag is None:
        return None  # eager: every Transformers model has it
    model_class = facts.model_class
    if model_class is not None and not getattr(model_class, flag, False):
        return f"--attention {attention}: {model_class.__name__} (--model {facts.model}) does not support it"
    return None


def attention_device_refusal(attention: str, device_type: str) -> str | None:
    """Why a device of ``device_type``, with what is installed, cannot train with ``attention`` (None: it can)."""
    if attention == "flash_attention_2" and device_type != "cuda":
        return (
            "--attention flash_attention_2 runs on CUDA GPUs only (the flash-attn package's kernels); "
            "use sdpa or eager on a CPU"
        )
    if attention == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "--attention flash_attention_2 needs the flash-attn package, which is not installed; or use sdpa"
    if attention == "flex_attention" and device_type != "cuda":
        return "--attention flex_attention has no backward on a CPU in PyTorch; use sdpa or eager"
    return None


class AttentionLever(Lever):
    name = "attention"
    fields = ("attention",)
    flags = (Flag("attention", ("--attention",), str, "auto"),)
    axes = (Axis("attention", f"a list of {', '.join(ATTENTIONS)}", "auto", one_of(ATTENTIONS), added_later=True),)

    def check(self, config: TrialConfig) -> None:
        if config.attention not in ATTENTIONS:
            raise ConfigError(f"--attention {config.attention!r} is not known; use one of {', '.join(ATTENTIONS)}")

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return attention_device_refusal(config.attention, device.type)

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.attention != "auto"

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        return attention_refusal(config.attention, facts)

    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        kept = tuple(value for value in values if _space_refusal(value, device, facts) is None)
        if not kept:
            raise ConfigError(f"knobs.attention {list(values)}: {_space_refusal(values[0], device, facts)}; add auto")
        return kept

    def dropped(
        self, space: Mapping[str, tuple[Any, ...]], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> list[str]:
        refusals = [_space_refusal(value, device, facts) for value in space["attention"]]
        return [refusal for refusal in refusals if refusal is not None]  # each names the flag and the value

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        set_attention(model, config.attention, source=source)
        return model

    def stage_refusal(self, config: TrialConfig) -> str | None:
        if config.attention in ("eager", "flex_attention"):
            return f"--attention {config.attention} needs the causal mask the stages do not build; use sdpa or auto"
        return None

    def labels(self, config: TrialConfig) -> list[str]:
        return [] if config.attention == "auto" else [f"attn={config.attention}"]

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.attention in ("auto", "sdpa"):  # torchtitan's models attend with SDPA by default
            return {}
        return super().torchtitan_keys(config, workload)

    def in_code(self, config: TrialConfig) -> list[str]:
        if config.attention == "auto":
            return []
        return [
            f'attention: load the model with attn_implementation="{config.attention}" '
            f'(from_pretrained(..., attn_implementation="{config.attention}")), or '
            f'`model = autotune.prepare(model, attention="{config.attention}")`'
        ]


def _space_refusal(attention: str, device: DeviceInfo, facts: ModelFacts) -> str | None:
    """Why a space's ``attention`` cannot run for this model, device or install (None: it can)."""
    if attention == "auto":
        return None
    refusal = attention_device_refusal(attention, device.type)
    return refusal if refusal is not None else attention_refusal(attention, facts)
