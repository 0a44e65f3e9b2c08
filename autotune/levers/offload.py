"""``--offload``: the model states moved to CPU RAM between their uses. ``optimizer``: the optimizer state and
its step (ZeRO-Offload, stages 1-3); ``optimizer+params``: the parameters and gradients too (ZeRO-Infinity's
CPU tier under stage 3, or FSDP2's ``CPUOffloadPolicy``, which offloads all three together). Applied by the
sharding that offloads: DeepSpeed's JSON (``offload_optimizer``, ``offload_param``) or FSDP2's policy.

(What moves the activations instead is ``--activation-offload``, ``autotune.levers.activation_offload``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["OffloadFields", "OffloadLever", "OFFLOADS", "offload_flag", "offload_suffix"]

OFFLOADS = ("none", "optimizer", "optimizer+params")


@dataclass(frozen=True, kw_only=True)
class OffloadFields:
    offload: str = field(
        default="none",
        metadata={
            "help": "none, optimizer (ZeRO 1-3) or optimizer+params (ZeRO 3, or FSDP: parameters, gradients "
            "and the optimizer step on the CPU): move states to CPU RAM."
        },
    )

    @property
    def offloads_states(self) -> bool:
        """Some model states live in CPU RAM between their uses."""
        return self.offload != "none"

    @property
    def offloads_parameters(self) -> bool:
        """The parameters (and the gradients) live in CPU RAM too, not only the optimizer's state."""
        return self.offload == "optimizer+params"


def offload_flag(config: TrialConfig) -> str | None:
    """The config's ``--offload WHAT`` as typed, for messages (None: no offload)."""
    return None if config.offload == "none" else f"--offload {config.offload}"


def offload_suffix(config: TrialConfig, *, named: bool) -> str:
    """The offload's part of the sharding's word in a label: ``+optimizer`` (``named``: ZeRO's words), or
    ``+offload`` (FSDP's, which offloads all or nothing); empty without offload."""
    if config.offload == "none":
        return ""
    return f"+{config.offload}" if named else "+offload"


class OffloadLever(Lever):
    """Applied by the sharding that offloads (DeepSpeed's JSON, FSDP2's offload policy), not to the model.
    Its label is part of the sharding's word (``zero3+optimizer``, ``fsdp-full+offload``)."""

    name = "offload"
    fields = ("offload",)
    flags = (Flag("offload", ("--offload",), str, "none"),)

    def check(self, config: TrialConfig) -> None:
        """Its value, then what it needs of the sharding (checked before it: ZeRO, FSDP)."""
        if config.offload not in OFFLOADS:
            raise ConfigError(f"--offload {config.offload!r} is not known; use one of {', '.join(OFFLOADS)}")
        if config.offload == "optimizer" and config.uses_fsdp:
            raise ConfigError(
                "--offload optimizer with --fsdp: FSDP2 offloads parameters, gradients and the "
                "optimizer step together; use --offload optimizer+params"
            )
        if config.offload == "optimizer" and not config.partitions_optimizer:
            raise ConfigError("--offload optimizer needs ZeRO; add --zero-stage 1, 2 or 3")
        if config.offloads_parameters and not config.partitions_parameters and not config.uses_fsdp:
            raise ConfigError("--offload optimizer+params needs --zero-stage 3 or --fsdp (only they shard parameters)")

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.uses_fsdp and config.offloads_parameters:  # FSDP2's CPUOffloadPolicy, as torchtitan applies it
            return {"training": {"enable_cpu_offload": True}}
        return super().torchtitan_keys(config, workload)
