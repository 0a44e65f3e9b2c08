"""What one trial measured: a frozen ``TrialResult`` with a status that says what happened.

No sentinels: a figure that was not measured is ``None``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from autotune.config.knobs import TrialConfig

__all__ = ["TrialStatus", "PhaseTimings", "TrialResult", "pick_throughput", "TOKENS_PER_S"]

TOKENS_PER_S = "tokens/s"


def pick_throughput(unit: str, tokens_per_s: float | None, samples_per_s: float | None) -> float | None:
    """Tokens/s for text; a sample's own count (images/s, or samples/s for a factory's batch) else."""
    return tokens_per_s if unit == TOKENS_PER_S else samples_per_s


class TrialStatus(str, enum.Enum):
    OK = "ok"  # trained and measured
    OOM = "oom"  # ran out of device memory (or of the --memory-budget)
    TIMEOUT = "timeout"  # killed after --trial-timeout seconds
    CRASHED = "crashed"  # the process died without a result (signal, hard exit)
    NAN = "nan"  # the loss became NaN or infinite
    ERROR = "error"  # any other exception: bad model, bad config, library error

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class PhaseTimings:
    """Wall seconds of each phase of a trial, from the launch of its process."""

    startup_s: float | None = None  # process launch to the trial code starting (interpreter + imports)
    build_s: float | None = None  # model, LoRA, optimizer and engine
    compile_s: float | None = None  # --compile: the first compiled step, compilation included
    warmup_s: float | None = None  # untimed steps
    measure_s: float | None = None  # timed steps

    @property
    def fixed_cost_s(self) -> float | None:
        """Launch to the first timed step: what every trial pays before it measures anything."""
        parts = (self.startup_s, self.build_s, self.warmup_s)
        known = [p for p in parts if p is not None]
        return None if len(known) < len(parts) else sum(known) + (self.compile_s or 0.0)


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    config: TrialConfig
    status: TrialStatus
    tokens_per_s: float | None = None  # None where a sample is no sequence of tokens (images)
    samples_per_s: float | None = None
    throughput_unit: str = "tokens/s"  # what the tuner maximises: tokens/s, images/s or samples/s
    step_time_median_s: float | None = None
    step_time_iqr_s: float | None = None  # spread: interquartile range of step times
    step_time_spread: float | None = None  # that range over the median: 0.1 = the middle half within 10%
    disturbed_steps: int | None = None  # steps 25% slower than the median (another process, ...)
    measured_steps: int = 0
    outpaced: bool = False  # measuring stopped after a step too slow to compete (see trial.measure.time_steps)
    grad_accum_steps: int | None = None
    peak_memory_bytes: int | None = None  # reserved on CUDA, tracked tensor bytes on CPU; max over ranks
    peak_allocated_bytes: int | None = None  # CUDA allocated (tracked bytes on CPU); max over ranks
    peak_reserved_bytes: int | None = None  # CUDA only
    build_peak_bytes: int | None = None  # allocated/tracked peak before the first step (model + engine build)
    peak_memory_per_rank: list[int | None] | None = None  # None: a rank that wrote no record
    optimizer_state_bytes: int | None = None  # per rank, max over ranks
    optimizer: str | None = None  # the class that stepped the weights (torchao's 8-bit AdamW, DeepSpeed's, ...)
    quantized_base: str | None = None  # what held a quantized frozen base (bitsandbytes' NF4 layer, ...)
    trainable_params: int | None = None
    total_params: int | None = None
    final_loss: float | None = None
    eager_step_s: float | None = None  # --compile: one step of the same model uncompiled, for the payoff
    compile_payoff_steps: int | None = None  # --compile: steps before compiling has paid for itself; None: never
    device: str | None = None
    cpu_cores: list[int] | None = None  # CPU: the cores the trial ran on (the free ones; all ranks')
    cpu_threads: int | None = None  # CPU: torch threads per rank
    world_size: int = 1
    memory_budget_bytes: int | None = None
    phases: PhaseTimings = field(default_factory=PhaseTimings)
    error: str | None = None  # the error's last lines, for anything but ok
    exit_code: int | None = None  # the process's exit status; negative: killed by that signal

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    @property
    def throughput(self) -> float | None:
        """The figure the tuner maximises, in ``throughput_unit``."""
        return pick_throughput(self.throughput_unit, self.tokens_per_s, self.samples_per_s)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = self.config.to_dict()
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        data = dict(data)
        data["config"] = TrialConfig.from_dict(data["config"])
        data["status"] = TrialStatus(data["status"])
        data["phases"] = PhaseTimings(**(data.get("phases") or {}))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def replace(self, **changes: Any) -> TrialResult:
        return dataclasses.replace(self, **changes)
