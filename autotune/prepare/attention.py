"""The attention kernel: Transformers' ``attn_implementation`` on a built model, and knowing before
any trial whether the model can take a kernel (whether the device and the install can run it is
``TrialConfig.validate_for``'s to say).

``auto`` leaves the model's own choice (Transformers picks ``sdpa`` where the model supports it).
``eager`` keeps the whole s x s scores for the backward; ``sdpa`` and the fused kernels do not, so
the kernel moves memory as well as speed on long sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.errors import ConfigError
from autotune.models.sources import parse_model_source

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = ["set_attention", "attention_refusal"]

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


def attention_refusal(workload: Workload, attention: str, task: str) -> str | None:
    """Why the workload's model cannot take ``attention`` (known before a trial), or None."""
    if attention == "auto":
        return None
    if parse_model_source(workload.model).kind == "factory":
        return (
            f"--attention {attention}: the model from --model {workload.model} is a factory's, whose attention "
            "autotune does not know; it applies to Transformers models (use auto)"
        )
    flag = _SUPPORT_FLAGS.get(attention)
    if flag is None:
        return None  # eager: every Transformers model has it
    from autotune.prepare.model_facts import hf_model_class

    model_class = hf_model_class(workload, task)
    if model_class is not None and not getattr(model_class, flag, False):
        return f"--attention {attention}: {model_class.__name__} (--model {workload.model}) does not support it"
    return None
