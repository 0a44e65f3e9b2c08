"""The knobs of one trial: a frozen ``TrialConfig`` that flows from sampler to runner to storage.

Exact knobs (micro batch, checkpointing, ZeRO stage, offload) do not change what is trained;
precision and LoRA do, and are only moved where the user's search space allows them.

The knob families that are levers (``autotune/levers/``) bring their fields, values, refusals and labels as a
mixin and a registry entry; ``TrialConfig`` asks them in a loop. The families not yet levers (ZeRO, FSDP,
offload, tensor, sequence and pipeline parallel) are still written out here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import CHECK_ORDER, LABEL_ORDER, REFUSAL_ORDER
from autotune.levers.activation_offload import ActivationOffloadFields, offload_device_refusal
from autotune.levers.attention import ATTENTIONS, AttentionFields, attention_device_refusal
from autotune.levers.base import is_count as _is_count
from autotune.levers.checkpointing import CheckpointingFields
from autotune.levers.compile import CompileFields, compile_device_refusal
from autotune.levers.float8 import Float8Fields
from autotune.levers.grad_reduction import GradReductionFields, asks_fsdp_reduction
from autotune.levers.lora import LoraFields
from autotune.levers.loss import DEFAULT_LOSS_CHUNKS, LOSSES, LossFields, is_loss
from autotune.levers.optimizer import (
    EIGHT_BIT_REFUSAL,
    OPTIMIZERS,
    OptimizerFields,
    eight_bit_library,
    in_backward_refusal,
)
from autotune.levers.precision import PRECISIONS, PrecisionFields, sixteen_bit_type

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo

__all__ = [
    "TrialConfig",
    "PRECISIONS",
    "ATTENTIONS",
    "OFFLOADS",
    "ZERO_STAGES",
    "FSDP_MODES",
    "PP_SCHEDULES",
    "LOSSES",
    "OPTIMIZERS",
    "DEFAULT_LOSS_CHUNKS",
    "is_loss",
    "sixteen_bit_type",
    "attention_device_refusal",
    "compile_device_refusal",
    "in_backward_refusal",
    "offload_device_refusal",
    "eight_bit_library",
    "EIGHT_BIT_REFUSAL",
]

OFFLOADS = ("none", "optimizer", "optimizer+params")
ZERO_STAGES = (0, 1, 2, 3)
# FSDP2 (torch.distributed.fsdp.fully_shard): "full" reshards each unit's parameters after its
# forward (like ZeRO-3); "grad-op" keeps them gathered from forward to backward (like ZeRO-2); "hybrid" (HSDP)
# shards as "full" within each group of --shard-group ranks and replicates across the groups, on a 2-D device
# mesh (replicate, shard): FSDP1's HYBRID_SHARD, torchtitan's data_parallel_replicate_degree x _shard_degree.
FSDP_MODES = ("full", "grad-op", "hybrid")
# Fields added after studies were stored, left out of to_dict() at their default (as Workload does), so that a
# stored config, an export and a study's name read as they did before them.
_ADDED_LATER: dict[str, Any] = {"shard_group": None, "grad_sync": "each", "reduce_dtype": "auto"}
# torch.distributed.pipelining's schedules: GPipe (every micro batch's forward, then every backward), 1F1B
# (one forward, one backward: at most `pp` micro batches' activations in flight) and interleaved 1F1B
# (two stages per rank, a smaller bubble for more communication).
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True, kw_only=True)
class _MicroBatchField:
    micro_batch: int = field(
        default=1,
        metadata={
            "help": "Samples per forward/backward on one rank; accumulation is derived "
            "as global batch / (micro batch x ranks)."
        },
    )


# The fields of the levers that are modules of their own (autotune/levers/), then the rest below. A dataclass
# orders the fields of its bases from the last base to the first: the levers' mixins are listed last-first so that
# dataclasses.fields(TrialConfig) keeps the order it has always had (micro_batch, precision, checkpointing, ...).
@dataclass(frozen=True, kw_only=True)
class TrialConfig(
    GradReductionFields,
    Float8Fields,
    LoraFields,
    CompileFields,
    ActivationOffloadFields,
    OptimizerFields,
    AttentionFields,
    LossFields,
    CheckpointingFields,
    PrecisionFields,
    _MicroBatchField,
):
    """One point of the search space. ``None`` means a knob is off, never a sentinel number."""

    zero_stage: int | None = field(
        default=None,
        metadata={"help": "DeepSpeed ZeRO stage 0-3; off trains with plain PyTorch (DDP across ranks)."},
    )
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
            "all-reduces gradients across the groups); default: the ranks of one node (--nproc / --nodes)."
        },
    )
    offload: str = field(
        default="none",
        metadata={
            "help": "none, optimizer (ZeRO 1-3) or optimizer+params (ZeRO 3, or FSDP: parameters, gradients "
            "and the optimizer step on the CPU): move states to CPU RAM."
        },
    )

    tp: int = field(
        default=1,
        metadata={
            "help": "Tensor-parallel ranks: each decoder layer's attention and MLP weights split over this many "
            "ranks (the model's Transformers tp_plan, applied with PyTorch's parallelize_module); they all see "
            "the same micro batch. The other --nproc / (tp x pp) ranks are data parallel."
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={
            "help": "With --tp: the norms' activations (and the residual stream between layers) split over the "
            "tensor-parallel ranks along the sequence, instead of held whole on each."
        },
    )
    pp: int = field(
        default=1,
        metadata={
            "help": "Pipeline stages: the decoder layers split in order over this many ranks "
            "(torch.distributed.pipelining); the accumulation steps are the pipeline's micro batches."
        },
    )
    pp_schedule: str = field(
        default="1f1b",
        metadata={
            "help": "With --pp: gpipe (all forwards, then all backwards), 1f1b (at most --pp micro batches in "
            "flight) or interleaved-1f1b (two stages per rank: a smaller bubble, more transfers)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # the levers' normalising (LoRA's targets as a tuple)
        self._check_values()

    # -- derived values -------------------------------------------------------------------
    @property
    def uses_deepspeed(self) -> bool:
        return self.zero_stage is not None

    @property
    def uses_fsdp(self) -> bool:
        return self.fsdp is not None

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the model is spread over: tensor x pipeline parallel."""
        return self.tp * self.pp

    @property
    def layout(self) -> str:
        """How the ranks hold the model, as a search space writes it: ``dp`` (data parallel only), ``tp2``,
        ``tp2+sp``, ``pp2:1f1b``, or both splits: ``tp2 pp2:1f1b``."""
        parts = [f"tp{self.tp}" + ("+sp" if self.sequence_parallel else "")] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp{self.pp}:{self.pp_schedule}")
        return " ".join(parts) or "dp"

    def _layout_flags(self, joiner: str = " ") -> str:
        """The layout's flags for messages, e.g. ``--tp 2 --pp 2``."""
        return joiner.join(f"{flag} {n}" for flag, n in (("--tp", self.tp), ("--pp", self.pp)) if n > 1)

    def data_parallel(self, workload: Workload) -> int:
        """Ranks that each train on their own micro batches: --nproc / (tp x pp)."""
        return max(1, workload.nproc // self.model_parallel)

    def grad_accum_steps(self, workload: Workload) -> int:
        """Micro-steps per optimizer step so that micro x accumulation x data-parallel ranks = global batch
        (tensor- and pipeline-parallel ranks share their micro batches)."""
        ranks = self.data_parallel(workload)
        per_step = self.micro_batch * ranks
        if workload.global_batch % per_step:
            over = (
                f"--nproc {workload.nproc}"
                if ranks == workload.nproc
                else f"{ranks} data-parallel ranks (--nproc {workload.nproc} / {self.model_parallel})"
            )
            raise ConfigError(
                f"--micro-batch {self.micro_batch} x {over} does not divide "
                f"--global-batch {workload.global_batch}; pick a micro batch from "
                f"{_divisors(workload.global_batch // ranks) if workload.global_batch % ranks == 0 else [1]}"
            )
        return workload.global_batch // per_step

    # -- validation -----------------------------------------------------------------------
    def _check_values(self) -> None:
        if not _is_count(self.micro_batch):
            raise ConfigError(f"--micro-batch {self.micro_batch!r} must be a whole number of at least 1")
        for lever in CHECK_ORDER:
            lever.check(self)
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"--zero-stage {self.zero_stage!r} is not known; use off, 0, 1, 2 or 3")
        if self.offload not in OFFLOADS:
            raise ConfigError(f"--offload {self.offload!r} is not known; use one of {', '.join(OFFLOADS)}")
        if self.fsdp is not None and self.fsdp not in FSDP_MODES:
            modes = f"{', '.join(FSDP_MODES[:-1])} or {FSDP_MODES[-1]}"
            raise ConfigError(f"--fsdp {self.fsdp!r} is not known; use off, {modes}")
        self._check_shard_group()
        if self.fsdp is not None and self.zero_stage is not None:
            raise ConfigError(
                f"--fsdp {self.fsdp} with --zero-stage {self.zero_stage}: one sharding per config; "
                "use --fsdp off or --zero-stage off"
            )
        if self.offload == "optimizer" and self.uses_fsdp:
            raise ConfigError(
                "--offload optimizer with --fsdp: FSDP2 offloads parameters, gradients and the "
                "optimizer step together; use --offload optimizer+params"
            )
        if self.offload == "optimizer" and self.zero_stage not in (1, 2, 3):
            raise ConfigError("--offload optimizer needs ZeRO; add --zero-stage 1, 2 or 3")
        if self.offload == "optimizer+params" and self.zero_stage != 3 and not self.uses_fsdp:
            raise ConfigError("--offload optimizer+params needs --zero-stage 3 or --fsdp (only they shard parameters)")
        self._check_layout()

    def _check_shard_group(self) -> None:
        if self.shard_group is None:
            return
        if not _is_count(self.shard_group):
            raise ConfigError(f"--shard-group {self.shard_group!r} must be a whole number of ranks, 2 or more")
        if self.fsdp != "hybrid":
            raise ConfigError(
                f"--shard-group {self.shard_group} sizes the shard groups of hybrid sharding; "
                "add --fsdp hybrid, or drop --shard-group"
            )

    def shard_degree(self, workload: Workload) -> int:
        """Ranks FSDP shards one copy of the model over: --shard-group with --fsdp hybrid (default: the ranks
        of one node), else every data-parallel rank; 1 without FSDP."""
        if not self.uses_fsdp:
            return 1
        if self.fsdp == "hybrid":
            return self.shard_group or workload.ranks_per_node
        return self.data_parallel(workload)

    def replicate_degree(self, workload: Workload) -> int:
        """Copies of the sharded model that all-reduce their gradients: the hybrid's shard groups, else 1."""
        return self.data_parallel(workload) // self.shard_degree(workload) if self.uses_fsdp else 1

    def _check_hybrid_for(self, workload: Workload) -> None:
        """--fsdp hybrid's shard groups against the workload's ranks."""
        if self.fsdp != "hybrid":
            return
        if self.model_parallel > 1:
            raise ConfigError(
                f"--fsdp hybrid with {self._layout_flags()}: a 3-D mesh (replicate, shard, tensor) is not measured "
                "yet; use --fsdp full with --tp, or --tp 1"
            )
        nproc = workload.nproc
        if self.shard_group is None and workload.nodes == 1:
            raise ConfigError(
                f"--fsdp hybrid on one node shards over all --nproc {nproc} ranks (one node's) and replicates "
                f"nothing; add --shard-group N (N dividing {nproc}, 1 < N < {nproc}), or use --fsdp full"
            )
        group = self.shard_degree(workload)
        fits = [d for d in _divisors(nproc) if 1 < d < nproc] or "none (add ranks)"
        if nproc % group or not 1 < group < nproc:
            flag = f"--shard-group {group}" if self.shard_group else f"one node's {group} ranks (--shard-group)"
            raise ConfigError(
                f"--fsdp hybrid: {flag} must divide --nproc {nproc} and lie between 1 and {nproc} (exclusive), "
                f"to leave two or more replicas of two or more shards; use --shard-group from {fits}"
            )

    def _check_layout(self) -> None:
        """Tensor and pipeline parallel: the values, and the combinations no framework runs."""
        for flag, value in (("--tp", self.tp), ("--pp", self.pp)):
            if not _is_count(value):
                raise ConfigError(f"{flag} {value!r} must be a whole number of at least 1 (1: off)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"--pp-schedule {self.pp_schedule!r} is not known; use one of {', '.join(PP_SCHEDULES)}")
        if self.pp_schedule != "1f1b" and self.pp == 1:
            raise ConfigError(f"--pp-schedule {self.pp_schedule} schedules pipeline stages; add --pp 2 or more")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"--sequence-parallel {self.sequence_parallel!r} must be on or off")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "--sequence-parallel on splits activations over tensor-parallel ranks; add --tp 2 or more"
            )
        if self.model_parallel == 1:
            return
        layout = self._layout_flags()
        if self.uses_deepspeed:
            raise ConfigError(
                f"{layout} with --zero-stage {self.zero_stage}: DeepSpeed partitions its own flat buffers, not "
                "PyTorch's tensor-parallel and pipeline modules; shard the data-parallel ranks with --fsdp full "
                "(FSDP x TP, as torchtitan builds it), or use --zero-stage off"
            )
        if self.uses_lora or self.quantizes_base:
            raise ConfigError(
                f"{layout} with LoRA: PEFT's adapters on split layers are not measured yet; "
                "use --lora-rank off, or --tp 1 --pp 1"
            )
        if self.pp > 1 and (self.sequence_parallel or self.uses_fsdp):
            with_what = "--sequence-parallel on" if self.sequence_parallel else f"--fsdp {self.fsdp}"
            raise ConfigError(
                f"--pp {self.pp} with {with_what}: pipeline stages that are also sharded so are not measured yet; "
                "use --pp with --tp alone, or --pp 1"
            )
        if self.offload != "none":
            raise ConfigError(f"{layout} with --offload {self.offload}: not measured yet; use --offload none")
        if self.pp == 1:
            return
        pipeline_refusals = (
            (self.precision == "fp16", "--precision fp16's loss scaling would span the stages; use bf16 or fp32"),
            (self.loss != "standard", f"--loss {self.loss} replaces the head the last stage runs; use standard"),
            (
                self.attention in ("eager", "flex_attention"),
                f"--attention {self.attention} needs the causal mask the stages do not build; use sdpa or auto",
            ),
            (self.compile, "--compile on is not measured on pipeline stages yet; use --compile off"),
        )
        for refused, why in pipeline_refusals:
            if refused:
                raise ConfigError(f"--pp {self.pp}: {why}")

    def validate_for(self, workload: Workload, device: DeviceInfo) -> None:
        """Refuse combinations that cannot run for this workload on this device."""
        self.grad_accum_steps(workload)  # also refuses a micro batch larger than the per-rank batch
        if self.uses_fsdp and workload.nproc == 1 and self.offload == "none":
            raise ConfigError(
                f"--fsdp {self.fsdp} on one rank shards nothing; add --nproc 2 or more, or --offload optimizer+params"
            )
        self._check_hybrid_for(workload)
        for lever in REFUSAL_ORDER:
            conflict = lever.conflict(self)
            if conflict is not None:
                raise ConfigError(conflict)
        self._check_layout_for(workload)
        split = self.uses_deepspeed or self.uses_fsdp or self.model_parallel > 1
        if (self.optimizer != "adamw" or self.optimizer_in_backward) and split:
            what = f"--optimizer {self.optimizer}" if self.optimizer != "adamw" else "--optimizer-in-backward on"
            sharding = (
                f"--zero-stage {self.zero_stage}"
                if self.uses_deepspeed
                else f"--fsdp {self.fsdp}"
                if self.uses_fsdp
                else self._layout_flags()
            )
            why = (
                "DeepSpeed builds and steps its own optimizer over its partitions"
                if self.uses_deepspeed
                else "it steps sharded parameters (DTensors), which autotune does not measure yet"
            )
            raise ConfigError(f"{what} with {sharding}: {why}; use --optimizer adamw without it, or drop the sharding")
        for lever in REFUSAL_ORDER:
            refusal = lever.refusal(self, workload, device)
            if refusal is not None:
                raise ConfigError(refusal)

    def _check_layout_for(self, workload: Workload) -> None:
        """The layout's ranks against the workload's: tp x pp divides --nproc, and what runs the rest."""
        if self.model_parallel == 1:
            return
        if workload.nproc % self.model_parallel:
            layout = self._layout_flags(" x ")
            fits = [d for d in _divisors(workload.nproc) if d > 1] or "none (add ranks)"
            what = "product" if self.tp > 1 and self.pp > 1 else "value"
            raise ConfigError(
                f"{layout} does not divide --nproc {workload.nproc}: the ranks split as data x tensor x pipeline "
                f"parallel; use a {what} from {fits}"
            )
        data = self.data_parallel(workload)
        # FSDP over one data-parallel rank shards nothing; it runs where asked for its reduction alone, as
        # KempnerForge wraps its tensor-parallel models (its distributed/setup.py keeps a dp_shard mesh of 1).
        if self.tp > 1 and data == 1 and self.uses_fsdp and not asks_fsdp_reduction(self):
            raise ConfigError(
                f"--fsdp {self.fsdp} with --tp {self.tp} on --nproc {workload.nproc}: FSDP shards over the "
                "data-parallel ranks, and there is one; use --fsdp off, or more ranks (--nproc a multiple of --tp), "
                "or --grad-sync last / --reduce-dtype fp32 for its reduction alone"
            )
        if self.tp > 1 and data > 1 and not self.uses_fsdp:
            raise ConfigError(
                f"--tp {self.tp} on --nproc {workload.nproc} leaves {data} data-parallel copies, which DDP cannot "
                "hold (its buckets are not tensor-parallel); shard them with --fsdp full or grad-op (FSDP x TP), "
                f"or use --tp {workload.nproc}"
            )
        if self.pp > 1 and data > 1:
            raise ConfigError(
                f"--pp {self.pp} on --nproc {workload.nproc} leaves {data} data-parallel copies of each stage, "
                f"which autotune does not measure yet; use --pp {workload.nproc}"
            )
        accum = self.grad_accum_steps(workload)
        if self.pp > 1 and accum < self.pp and self.pp_schedule != "gpipe":
            raise ConfigError(
                f"--pp {self.pp} --pp-schedule {self.pp_schedule} with {accum} accumulation step(s): the pipeline's "
                f"micro batches are the accumulation steps and 1F1B needs at least one per stage; use a micro batch "
                f"of at most {workload.global_batch // data // self.pp}, or --pp-schedule gpipe"
            )

    # -- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, value in data.items():  # tuples (LoRA's targets) as the lists JSON and YAML write
            if isinstance(value, tuple):
                data[name] = list(value)
        for name, default in _ADDED_LATER.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown knob(s) {unknown}; known knobs: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A short human label, e.g. ``mb=4 bf16 ckpt lora16 zero2+offload``."""
        parts = [f"mb={self.micro_batch}"]
        for lever in LABEL_ORDER:
            parts.extend(lever.labels(self))
        if self.uses_deepspeed:
            parts.append(f"zero{self.zero_stage}" + ("" if self.offload == "none" else f"+{self.offload}"))
        if self.uses_fsdp:
            group = f"/{self.shard_group}" if self.shard_group else ""
            parts.append(f"fsdp-{self.fsdp}{group}" + ("" if self.offload == "none" else "+offload"))
        if self.model_parallel > 1:
            parts.append(self.layout)
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
