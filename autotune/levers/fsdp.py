"""``--fsdp``: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of ZeRO, and ``--shard-group``
for its hybrid mode. ``full`` reshards each unit's parameters after its forward (like ZeRO-3); ``grad-op``
keeps them gathered from forward to backward (like ZeRO-2); ``hybrid`` (HSDP) shards as ``full`` within each
group of ``--shard-group`` ranks and replicates across the groups, on a 2-D device mesh (replicate, shard):
FSDP1's ``HYBRID_SHARD``, torchtitan's ``data_parallel_replicate_degree`` x ``_shard_degree``. Applied to the
built model after tensor parallel (``autotune.prepare.sharding``), as torchtitan's ``parallelize`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, cast

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever, divisors, is_count
from autotune.levers.offload import offload_suffix
from autotune.levers.zero import zero_flag

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["FsdpFields", "FsdpLever", "FSDP_MODES", "fsdp_flag"]

FSDP_MODES = ("full", "grad-op", "hybrid")


@dataclass(frozen=True, kw_only=True)
class FsdpFields:
    fsdp: str | None = field(
        default=None,
        metadata={
            "help": "PyTorch FSDP2 sharding instead of ZeRO: full (parameters resharded after each layer's "
            "forward, like ZeRO-3) or grad-op (kept gathered until the backward, like ZeRO-2); "
            "off trains with plain PyTorch (DDP across ranks); hybrid shards as full within groups of "
            "--shard-group ranks and replicates across the groups (HSDP)."
        },
    )
    shard_group: int | None = field(
        default=None,
        metadata={
            "help": "With --fsdp hybrid: the ranks each shard group spans (FSDP shards within a group and "
            "all-reduces gradients across the groups); default: the ranks of one node (--nproc / --nodes).",
            # Added after studies were stored: left out of a config's dict at its default, so that a stored
            # config, an export and a study's name read as they did before it.
            "omit_at_default": True,
        },
    )

    @property
    def uses_fsdp(self) -> bool:
        return self.fsdp is not None

    def shard_degree(self, workload: Workload) -> int:
        """Ranks FSDP shards one copy of the model over: --shard-group with --fsdp hybrid (default: the ranks
        of one node), else every data-parallel rank; 1 without FSDP."""
        if self.fsdp is None:
            return 1
        if self.fsdp == "hybrid":
            return self.shard_group or workload.ranks_per_node
        return cast("TrialConfig", self).data_parallel(workload)  # the mixin is always a TrialConfig's

    def replicate_degree(self, workload: Workload) -> int:
        """Copies of the sharded model that all-reduce their gradients: the hybrid's shard groups, else 1."""
        data = cast("TrialConfig", self).data_parallel(workload)
        return data // self.shard_degree(workload) if self.fsdp is not None else 1


def fsdp_flag(config: TrialConfig) -> str | None:
    """The config's ``--fsdp MODE`` as typed, for messages (None: no FSDP)."""
    return None if config.fsdp is None else f"--fsdp {config.fsdp}"


def _mode(value: str) -> dict[str, Any]:
    return {"fsdp": None if value.lower() in ("off", "none") else value.lower()}


class FsdpLever(Lever):
    name = "fsdp"
    fields = ("fsdp", "shard_group")
    flags = (
        Flag("fsdp", ("--fsdp",), str, "off", parse=_mode),
        Flag("shard_group", ("--shard-group",), Optional[int], None),
    )

    def check(self, config: TrialConfig) -> None:
        """Its values, then the one sharding per config (ZeRO is checked before it)."""
        if config.fsdp is not None and config.fsdp not in FSDP_MODES:
            modes = f"{', '.join(FSDP_MODES[:-1])} or {FSDP_MODES[-1]}"
            raise ConfigError(f"--fsdp {config.fsdp!r} is not known; use off, {modes}")
        if config.shard_group is not None:
            if not is_count(config.shard_group):
                raise ConfigError(f"--shard-group {config.shard_group!r} must be a whole number of ranks, 2 or more")
            if config.fsdp != "hybrid":
                raise ConfigError(
                    f"--shard-group {config.shard_group} sizes the shard groups of hybrid sharding; "
                    "add --fsdp hybrid, or drop --shard-group"
                )
        zero = zero_flag(config)
        if config.fsdp is not None and zero is not None:
            raise ConfigError(
                f"--fsdp {config.fsdp} with {zero}: one sharding per config; use --fsdp off or --zero-stage off"
            )

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        if config.fsdp is not None and workload.nproc == 1 and not config.offloads_states:
            return (
                f"--fsdp {config.fsdp} on one rank shards nothing; add --nproc 2 or more, or --offload optimizer+params"
            )
        return self._hybrid_refusal(config, workload) if config.fsdp == "hybrid" else None

    def _hybrid_refusal(self, config: TrialConfig, workload: Workload) -> str | None:
        """--fsdp hybrid's shard groups against the workload's ranks."""
        if config.model_parallel > 1:
            return (
                f"--fsdp hybrid with {config.split_flags()}: a 3-D mesh (replicate, shard, tensor) is not measured "
                "yet; use --fsdp full with --tp, or --tp 1"
            )
        nproc = workload.nproc
        if config.shard_group is None and workload.nodes == 1:
            return (
                f"--fsdp hybrid on one node shards over all --nproc {nproc} ranks (one node's) and replicates "
                f"nothing; add --shard-group N (N dividing {nproc}, 1 < N < {nproc}), or use --fsdp full"
            )
        group = config.shard_degree(workload)
        fits = [d for d in divisors(nproc) if 1 < d < nproc] or "none (add ranks)"
        if nproc % group or not 1 < group < nproc:
            flag = f"--shard-group {group}" if config.shard_group else f"one node's {group} ranks (--shard-group)"
            return (
                f"--fsdp hybrid: {flag} must divide --nproc {nproc} and lie between 1 and {nproc} (exclusive), "
                f"to leave two or more replicas of two or more shards; use --shard-group from {fits}"
            )
        return None

    # -- its share of a search space's ``zero`` parameter (ZeRO's, autotune.levers.zero): one sharding per config --
    def sharding_values(
        self, modes: tuple[str | None, ...], offloads: tuple[str, ...], nproc: int, device_type: str
    ) -> tuple[str, ...]:
        """The parameter's values for a space's modes x offloads (``fsdp-full``, ``fsdp-full+optimizer+params``):
        only the pairs that mean something on ``nproc`` ranks of a ``device_type`` device."""
        return tuple(
            _label(mode, offload)
            for mode in modes
            if mode
            for offload in offloads
            if _pair_means_something(offload, nproc, device_type)
        )

    def sharding_fields(self, value: str) -> dict[str, Any] | None:
        """The config's FSDP and offload fields of one of the parameter's values; None: the value is ZeRO's."""
        if not value.startswith("fsdp-"):
            return None
        mode, _, offload = value.removeprefix("fsdp-").partition("+")
        return {"fsdp": mode, "offload": offload or "none"}

    def sharding_param(self, config: TrialConfig) -> str | None:
        """The parameter's value for ``config``; None: it does not use FSDP (ZeRO's lever says it)."""
        return None if config.fsdp is None else f"fsdp-{config.fsdp}{offload_suffix(config, named=True)}"

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        if config.fsdp is None:
            return None
        if device_type != "cuda" and format_name in ("hf", "accelerate", "lightning"):
            # Accelerate (so the Trainer) turns FSDP on for GPU process groups only, and on a CPU wraps the
            # model in DDP, each rank holding it whole; Lightning's FSDPStrategy refuses a CPU accelerator.
            return (
                f"--format {format_name}: this config shards with --fsdp {config.fsdp} on a {device_type}, where "
                f"{'Lightning' if format_name == 'lightning' else 'Accelerate'} does not run FSDP (it needs GPUs); "
                "export --format json and apply it with autotune.prepare(model, 'config.json') in a "
                "torchrun job, or pick a config without FSDP"
            )
        if format_name == "deepspeed":  # a DeepSpeed config without ZeRO would train DDP: not the sharding measured
            return (
                f"--format deepspeed: this config shards with PyTorch's FSDP2 (--fsdp {config.fsdp}), which DeepSpeed "
                "does not run (its ZeRO stages are its own sharding); export --format accelerate, lightning or json"
            )
        if format_name == "hf" and config.fsdp == "hybrid":
            return (
                "--format hf: hybrid sharding is TrainingArguments' parallelism_config, an Accelerate "
                "ParallelismConfig object that no JSON file holds; export --format accelerate (its "
                "parallelism_config) and start the Trainer's script with accelerate launch, which hands it over"
            )
        return None

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.fsdp is None:
            return {}
        shard = config.shard_degree(workload)
        if shard == 1:  # torchtitan applies fully_shard over a shard degree of 2 or more only
            raise ConfigError(
                f"--format torchtitan: this config runs --fsdp {config.fsdp} over one data-parallel rank, where "
                "torchtitan applies no FSDP (and so no offload); export --format json, or pick a config over "
                "two or more ranks"
            )
        keys = {
            "data_parallel_replicate_degree": config.replicate_degree(workload),
            "data_parallel_shard_degree": shard,
            "fsdp_reshard_after_forward": "never" if config.fsdp == "grad-op" else "always",
        }
        return {"parallelism": keys}

    def labels(self, config: TrialConfig) -> list[str]:
        if config.fsdp is None:
            return []
        group = f"/{config.shard_group}" if config.shard_group else ""
        return [f"fsdp-{config.fsdp}{group}{offload_suffix(config, named=False)}"]


def _label(mode: str, offload: str) -> str:
    return f"fsdp-{mode}" + ("" if offload == "none" else f"+{offload}")


def _pair_means_something(offload: str, nproc: int, device_type: str) -> bool:
    if offload == "optimizer":
        return False  # FSDP2 offloads parameters, gradients and the optimizer step together
    if offload != "none" and device_type == "cpu":
        return False  # offloading from the CPU to the CPU changes nothing
    return nproc > 1 or offload != "none"
