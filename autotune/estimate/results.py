"""What an estimate says: a config's predicted peak and its parts (:class:`MemoryEstimate`), the traced step it
is arithmetic on (:class:`TracedStep`), model-state bytes (:class:`ModelStates`), and :class:`EstimateError`.

Plain data that goes through JSON: the estimate server's traces and answers leave their process as it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.config.gpus import GpuSpec, gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.errors import AutotuneError
from autotune.estimate.step_costs import StepCosts

__all__ = ["EstimateError", "MODEL_STATES", "MemoryEstimate", "ModelStates", "TracedStep"]

# ModelStates' fields: the tags of the storages that are model states (the rest are activations or temporaries).
MODEL_STATES = ("parameters", "gradients", "optimizer_state")


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted peak bytes of one rank, and where they go."""

    config: TrialConfig
    predicted_peak_bytes: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int  # left by the forward for the backward, live at the peak
    temporaries_bytes: int  # the rest live at the peak: workspaces, casts, the backward's transients
    overhead_bytes: int | None  # what no tensor shows (GPU); None until calibrated
    method: str
    seconds: float
    # Model states not allocated at the peak moment (gradients not made yet), <= 0: the parts add up.
    not_live_at_peak_bytes: int = 0
    traced_device: str = "cpu"  # whose kernels the step was traced with: "cpu" or "cuda"
    device_note: str | None = None  # where those kernels differ from the workload's device
    # Matmul-class FLOPs of one sample's forward and backward, recomputation included, counted on
    # the traced step (torch.utils.flop_counter): what checkpointing costs, in compute, on this model.
    flops_per_sample: int | None = None
    # A CUDA workload's other two figures (None on a CPU): the caching allocator's peak reserved,
    # and what nvidia-smi would show (reserved + context + NCCL); cuda_parts says what each adds.
    predicted_reserved_bytes: int | None = None
    predicted_device_bytes: int | None = None
    cuda_parts: dict[str, int] | None = None
    gpu: str | None = None  # the card the device figure is for (--gpu)
    attention_kernels: dict[str, int] | None = None  # SDPA backend -> calls, as CUDA would pick them
    # Every operator of the traced step, FLOPs and bytes (device-free): estimate.step_time times them.
    step_costs: StepCosts | None = None
    # Pipeline stages: each rank's predicted peak tensor bytes (the figures above are the largest rank's).
    peak_per_rank_bytes: list[int] | None = None

    def fits(self, limit_bytes: int) -> bool:
        """Within ``limit_bytes``: what a CUDA job reserves (a trial's budget caps the allocator), or a
        CPU job's live tensors."""
        held = self.predicted_reserved_bytes if self.predicted_reserved_bytes is not None else self.predicted_peak_bytes
        return held <= limit_bytes

    def parts(self) -> dict[str, int]:
        """The peak's parts by name; they sum to ``predicted_peak_bytes``."""
        return {
            "parameters": self.parameters_bytes,
            "gradients": self.gradients_bytes,
            "optimizer state": self.optimizer_state_bytes,
            "activations": self.activations_bytes,
            "temporaries": self.temporaries_bytes,
            "not live at the peak": self.not_live_at_peak_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "describe": self.config.describe(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "parameters_bytes": self.parameters_bytes,
            "gradients_bytes": self.gradients_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "activations_bytes": self.activations_bytes,
            "temporaries_bytes": self.temporaries_bytes,
            "not_live_at_peak_bytes": self.not_live_at_peak_bytes,
            "overhead_bytes": self.overhead_bytes,
            "traced_device": self.traced_device,
            "device_note": self.device_note,
            "method": self.method,
            "seconds": self.seconds,
            "flops_per_sample": self.flops_per_sample,
            "predicted_reserved_bytes": self.predicted_reserved_bytes,
            "predicted_device_bytes": self.predicted_device_bytes,
            "cuda_parts": self.cuda_parts,
            "gpu": self.gpu,
            "attention_kernels": self.attention_kernels,
            "step_costs": self.step_costs.to_dict() if self.step_costs is not None else None,
            "peak_per_rank_bytes": self.peak_per_rank_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryEstimate:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        if "not_live_at_peak_bytes" not in data:  # stored before the parts added up: name the remainder
            listed = sum(
                data[k]
                for k in (
                    "parameters_bytes",
                    "gradients_bytes",
                    "optimizer_state_bytes",
                    "activations_bytes",
                    "temporaries_bytes",
                )
            )
            fields["not_live_at_peak_bytes"] = data["predicted_peak_bytes"] - listed
        if fields.get("step_costs") is not None:
            fields["step_costs"] = StepCosts.from_dict(fields["step_costs"])
        return cls(**{**fields, "config": TrialConfig.from_dict(data["config"])})


@dataclass(frozen=True, kw_only=True)
class TracedStep:
    """The plain step of a config traced on fake tensors, before ZeRO's and DDP's arithmetic.

    Configs that differ only in the ZeRO stage or its offload (and DDP's rank count) trace the same
    step: the estimate server keeps these and derives each such config's estimate from one trace.
    """

    peak_bytes: int
    at_peak: ModelStates  # model-state bytes live at the peak
    whole: ModelStates  # all of them
    activations_bytes: int  # live at the peak
    # The same before the optimizer step: the peak of the forwards and backwards. DeepSpeed's step is
    # not the traced one (its optimizer steps over a partition), so ZeRO's arithmetic starts here.
    backward_peak_bytes: int
    backward_at_peak: ModelStates
    backward_activations_bytes: int
    flops_per_sample: int
    step_costs: StepCosts
    total_params: int
    trainable_params: int
    # The storages' allocations and frees in order (CUDA workloads; None once extrapolated):
    # (key, new size) or (key, new size, side stream's number): see PeakPartsTracker.events.
    events: list[tuple[int, int] | tuple[int, int, int]] | None
    marks: dict[str, int]
    attention_kernels: dict[str, int]
    target: str  # the workload's device type
    traced_device: str  # whose kernels traced it
    device_note: str | None
    card: GpuSpec | None
    method: str
    seconds: float
    rank_peak_bytes: list[int] | None = None  # pipeline stages: each rank's traced peak (this step is the largest)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON): how a trace leaves the process that made it."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            **data,
            "at_peak": dataclasses.asdict(self.at_peak),
            "whole": dataclasses.asdict(self.whole),
            "backward_at_peak": dataclasses.asdict(self.backward_at_peak),
            "step_costs": self.step_costs.to_dict(),
            "card": None if self.card is None else self.card.name,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TracedStep:
        return cls(
            **{
                **data,
                "at_peak": ModelStates(**data["at_peak"]),
                "whole": ModelStates(**data["whole"]),
                "backward_at_peak": ModelStates(**data["backward_at_peak"]),
                "step_costs": StepCosts.from_dict(data["step_costs"]),
                "events": None if data["events"] is None else [tuple(e) for e in data["events"]],
                "card": None if data["card"] is None else gpu_spec(data["card"]),
            }
        )


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes: whole, or the part of them live at one moment."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


class EstimateError(AutotuneError):
    """The estimator could not trace this model or config."""
