"""``--zero-stage``: DeepSpeed's ZeRO, which partitions the optimizer state (stage 1), then the gradients (2),
then the parameters (3) over the data-parallel ranks, in flat buffers of its own. A config with a stage trains
in DeepSpeed's engine (``deepspeed.initialize`` from the config's DeepSpeed JSON); without one, plain PyTorch
(DDP across ranks), or FSDP2 (``autotune.levers.fsdp``): one sharding per config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever
from autotune.levers.offload import offload_suffix

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["ZeroFields", "ZeroLever", "ZERO_STAGES", "zero_flag"]

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True)
class ZeroFields:
    zero_stage: int | None = field(
        default=None,
        metadata={"help": "DeepSpeed ZeRO stage 0-3; off trains with plain PyTorch (DDP across ranks)."},
    )

    @property
    def uses_deepspeed(self) -> bool:
        """The config trains in DeepSpeed's engine (any ZeRO stage, 0 included)."""
        return self.zero_stage is not None

    @property
    def partitions_optimizer(self) -> bool:
        """ZeRO partitions the optimizer's state (stages 1-3), which it can then offload."""
        return self.zero_stage in (1, 2, 3)

    @property
    def partitions_parameters(self) -> bool:
        """ZeRO partitions the parameters too (stage 3), which it can then offload."""
        return self.zero_stage == 3


def zero_flag(config: TrialConfig) -> str | None:
    """The config's ``--zero-stage N`` as typed, for messages (None: no ZeRO)."""
    return None if config.zero_stage is None else f"--zero-stage {config.zero_stage}"


def _stage(value: str) -> dict[str, Any]:
    if value.lower() in ("off", "none"):
        return {"zero_stage": None}
    if value.isdigit():
        return {"zero_stage": int(value)}
    raise ConfigError(f"--zero-stage {value!r} is not known; use off, 0, 1, 2 or 3")


class ZeroLever(Lever):
    """Applied by the trial's engine (DeepSpeed builds the model's engine), not to the model."""

    name = "zero"
    fields = ("zero_stage",)
    flags = (Flag("zero_stage", ("--zero-stage",), str, "off", parse=_stage),)

    def check(self, config: TrialConfig) -> None:
        if config.zero_stage is not None and config.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"--zero-stage {config.zero_stage!r} is not known; use off, 0, 1, 2 or 3")

    # -- its share of a search space's ``zero`` parameter: the sharding with its offload (FSDP's too) -----------
    def sharding_values(
        self, stages: tuple[int | None, ...], offloads: tuple[str, ...], nproc: int, device_type: str
    ) -> tuple[str, ...]:
        """The parameter's values for a space's stages x offloads (``off``, ``2``, ``3+optimizer``): only the pairs
        that mean something on ``nproc`` ranks of a ``device_type`` device."""
        return tuple(
            _label(stage, offload)
            for stage in stages
            for offload in offloads
            if _pair_means_something(stage, offload, nproc, device_type)
        )

    def sharding_fields(self, value: str) -> dict[str, Any]:
        """The config's ZeRO and offload fields of one of its values."""
        stage, _, offload = value.partition("+")
        return {"zero_stage": None if stage == "off" else int(stage), "offload": offload or "none"}

    def sharding_param(self, config: TrialConfig) -> str:
        """The parameter's value for ``config`` (one without FSDP)."""
        return "off" if config.zero_stage is None else f"{config.zero_stage}{offload_suffix(config, named=True)}"

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        if config.zero_stage is not None and format_name == "lightning" and device_type != "cuda":
            # Trainer(...) accepts it, but fit() raises: Lightning's DeepSpeed strategy needs CUDA.
            return (
                f"--format lightning: this config uses --zero-stage {config.zero_stage} on a "
                f"{device_type}, and Lightning runs DeepSpeed only on CUDA GPUs; export "
                "--format accelerate or hf instead, or pick a config without ZeRO"
            )
        return None

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.zero_stage is None:
            return {}
        raise ConfigError(
            f"--format torchtitan: this config shards with DeepSpeed's ZeRO stage {config.zero_stage}, which "
            "torchtitan does not run (it shards with FSDP2); export --format deepspeed, or pick an --fsdp config"
        )

    def labels(self, config: TrialConfig) -> list[str]:
        if config.zero_stage is None:
            return []
        return [f"zero{config.zero_stage}{offload_suffix(config, named=True)}"]


def _label(stage: int | None, offload: str) -> str:
    if stage is None:
        return "off"
    return str(stage) if offload == "none" else f"{stage}+{offload}"


def _pair_means_something(stage: int | None, offload: str, nproc: int, device_type: str) -> bool:
    if stage is None:
        return offload == "none"
    if offload == "optimizer+params" and stage != 3 or offload == "optimizer" and stage == 0:
        return False
    if offload != "none" and device_type == "cpu":
        return False  # offloading from the CPU to the CPU changes nothing
    return nproc > 1 or offload != "none"  # sharding over one rank saves nothing; offload still does
