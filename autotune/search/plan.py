"""A plan without trials: every config of a space predicted to fit, ranked by predicted throughput.

``find --plan`` answers before the hardware is there: for a named card (``--gpu``) it predicts
each config's memory (the estimator's traced step and its CUDA figures) and its step time
(:mod:`autotune.estimate.step_time`, the same trace against the card's roofline). Nothing runs.

A model of many layers is traced as two shallow copies of itself, 2 and 4 layers, and its traced
step drawn by the straight line through them (:mod:`autotune.estimate.depth_proxy`): a 7B then costs
two traces of a second, not one of ten; configs that trace the same step (compile, tf32, every ZeRO
stage and offload of one precision) share one.
Per family (the configs that differ only in the micro batch) the largest micro batch that fits is
found by bisecting with the estimator, as the driver does (a straight line through each estimate
says where the next one goes); each config of the family up to it is timed from the family's traced
operators, which are kept per sample, so one trace times every micro batch. The configs whose
predicted throughput is within the model's error of the top one are marked "verify first": those are
the trials worth running once the card is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from autotune.search.memory_bounds import straight_line

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile, StepTime
    from autotune.search.space import SearchSpace

__all__ = ["Plan", "PlanRow", "plan", "plan_space", "PLAN_ERROR"]

# The step-time model's error on published GPU runs (bench/results/plan_published.txt): configs
# predicted within it of the top one cannot be told apart by prediction alone.
PLAN_ERROR = 0.2


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    config: TrialConfig
    step: StepTime
    memory_bytes: int  # what the fit is judged on: reserved on CUDA, live tensors on a CPU
    device_bytes: int | None  # what nvidia-smi would show (CUDA)
    estimated: bool  # this config's own estimate (else its family's straight line)
    verify_first: bool = False

    def to_dict(self, limit_bytes: int) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "describe": self.config.describe(),
            **self.step.to_dict(),
            "memory_bytes": self.memory_bytes,
            "device_bytes": self.device_bytes,
            "headroom_bytes": limit_bytes - self.memory_bytes,
            "memory_from": ("its own estimate" if self.estimated else "its family's straight line"),
            "verify_first": self.verify_first,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    profile_source: str
    memory_budget_bytes: int
    limit_bytes: int
    rows: list[PlanRow]  # fitting configs, fastest first
    too_big: int  # configs predicted not to fit
    not_estimated: list[str] = field(default_factory=list)  # families the estimator could not trace, why
    estimates: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "profile": self.profile_source,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_limit_bytes": self.limit_bytes,
            "model_error": PLAN_ERROR,
            "rows": [row.to_dict(self.limit_bytes) for row in self.rows],
            "too_big": self.too_big,
            "not_estimated": self.not_estimated,
            "estimates": self.estimates,
            "seconds": self.seconds,
        }


Estimator = Callable[["TrialConfig"], "MemoryEstimate"]


def plan(
    *,
    workload: Workload,
    space: SearchSpace,
    profile: DeviceProfile,
    device: Any,
    limit_bytes: int,
    memory_budget_bytes: int,
    estimator: Estimator,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Every config of ``space`` predicted to fit under ``limit_bytes`` on ``device``, fastest first.

    ``estimator(config)`` predicts one config's memory and traced costs (raising
    :class:`autotune.estimate.results.EstimateError` where it cannot).
    """
    from autotune.estimate.results import EstimateError
    from autotune.estimate.step_time import predict_step_time

    started = time.monotonic()
    families: dict[TrialConfig, list[TrialConfig]] = {}
    for config in space.candidates(workload, device):
        families.setdefault(config.replace(micro_batch=1), []).append(config)
    rows: list[PlanRow] = []
    too_big = estimates = 0
    not_estimated: list[str] = []
    for index, members in enumerate(families.values(), start=1):
        members.sort(key=lambda c: c.micro_batch)
        try:
            fitting, made = _fitting(members, estimator, limit_bytes)
        except EstimateError as exc:
            not_estimated.append(f"{members[0].replace(micro_batch=1).describe()}: {exc}")
            continue
        estimates += len(made)
        too_big += len(members) - len(fitting)
        for config, estimate, memory, device_bytes in fitting:
            step = predict_step_time(_as(estimate, config), workload, profile)
            if step is not None:
                rows.append(
                    PlanRow(
                        config=config,
                        step=step,
                        memory_bytes=int(memory),
                        device_bytes=device_bytes,
                        estimated=estimate.config == config,
                    )
                )
        if progress is not None:
            progress(index, len(families))
    rows.sort(key=lambda row: -row.step.samples_per_s)
    if rows:
        top = rows[0].step.samples_per_s
        rows = [_verify(row, row.step.samples_per_s >= top * (1 - PLAN_ERROR)) for row in rows]
    return Plan(
        device=profile.name,
        profile_source=profile.describe(),
        memory_budget_bytes=memory_budget_bytes,
        limit_bytes=limit_bytes,
        rows=rows,
        too_big=too_big,
        not_estimated=not_estimated,
        estimates=estimates,
        seconds=time.monotonic() - started,
    )


def _verify(row: PlanRow, verify: bool) -> PlanRow:
    return replace(row, verify_first=verify)


def _as(estimate: MemoryEstimate, config: TrialConfig) -> MemoryEstimate:
    """``estimate`` of a twin of ``config`` as ``config``'s: another micro batch of the same family (its
    operators are kept per sample), or fp16's bf16 twin on a card that multiplies both at one rate."""
    return estimate if estimate.config == config else replace(estimate, config=config)


def _held(estimate: MemoryEstimate) -> int:
    return (
        estimate.predicted_reserved_bytes
        if estimate.predicted_reserved_bytes is not None
        else estimate.predicted_peak_bytes
    )


def _fitting(
    members: list[TrialConfig], estimator: Estimator, limit: int
) -> tuple[list[tuple[TrialConfig, MemoryEstimate, float, int | None]], list[MemoryEstimate]]:
    """The family's configs predicted to fit, each with the estimate that times it, its memory and its
    device figure; and the estimates made. Bisects as the driver does: the first estimate in the
    middle, then where the straight line through the last one puts the limit."""
    made: dict[int, MemoryEstimate] = {}
    fit, big = -1, len(members)

    def estimate(index: int) -> MemoryEstimate:
        if index not in made:
            made[index] = estimator(members[index])
        return made[index]

    index = (fit + big) // 2
    while big - fit > 1:
        result = estimate(index)
        if result.fits(limit):
            fit = index
        else:
            big = index
        line = straight_line(result)
        ratio = _held(result) / max(result.predicted_peak_bytes, 1)  # reserved over live tensors, as measured there
        below = [i for i in range(fit + 1, big) if line(members[i].micro_batch) * ratio <= limit]
        index = max(below, default=fit + 1) if below else fit + 1
        if index >= big:
            break
    fitting = []
    for i in range(fit + 1):
        nearest = made.get(i) or made[min(made, key=lambda k: abs(k - i))]
        if i in made:
            memory, device_bytes = float(_held(nearest)), nearest.predicted_device_bytes
        else:
            ratio = _held(nearest) / max(nearest.predicted_peak_bytes, 1)
            memory = straight_line(nearest)(members[i].micro_batch) * ratio
            extra = (nearest.predicted_device_bytes - _held(nearest)) if nearest.predicted_device_bytes else None
            device_bytes = int(memory + extra) if extra is not None else None
        fitting.append((members[i], nearest, memory, device_bytes))
    return fitting, list(made.values())


def plan_space(
    *,
    workload: Workload,
    space: str | SearchSpace = "default",
    memory_budget_bytes: int | None = None,
    headroom: float = 0.1,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """``find --plan``: plan ``workload`` on its named card (``workload.gpu``), or on the GPU here."""
    from autotune.config.device import detect_device
    from autotune.config.gpus import device_info, gpu_spec
    from autotune.errors import ConfigError
    from autotune.estimate.client import predict_memory
    from autotune.estimate.depth_proxy import depth_proxy
    from autotune.estimate.step_time import profile_for
    from autotune.search.space import SearchSpace, load_space

    space = space if isinstance(space, SearchSpace) else load_space(space)
    if workload.gpu is not None:
        device = device_info(gpu_spec(workload.gpu), count=workload.nproc)
    else:
        device = detect_device(workload.device if workload.device != "cpu" else "auto")
        if device.type != "cuda" or workload.device == "cpu":
            raise ConfigError(
                "--plan plans for a GPU and none is visible here: name the card with --gpu NAME "
                "(autotune estimate --help lists them), or run find without --plan"
            )
    profile = profile_for(workload, "cuda")
    if profile is None:
        raise ConfigError("--plan: the device probe failed on this GPU; name the card with --gpu NAME instead")
    budget = memory_budget_bytes or device.total_memory_bytes
    assert budget is not None  # a CUDA device's (or a named card's) memory is known
    proxy = depth_proxy(workload)

    # fp16 and bf16 hold the same tensors; where the card multiplies both as fast, one trace times both.
    # (compile, tf32 and ZeRO's stages share a trace in the estimate server already.)
    twins = profile.matmul_flops.get("float16") == profile.matmul_flops.get("bfloat16")

    def estimate(config: TrialConfig) -> MemoryEstimate:
        traced = config.replace(precision="bf16") if twins and config.precision == "fp16" else config
        return _as(predict_memory(workload, traced, proxy=proxy), config)

    return plan(
        workload=workload,
        space=space,
        profile=profile,
        device=device,
        limit_bytes=int(budget * (1 - headroom)),
        memory_budget_bytes=budget,
        estimator=estimate,
        progress=progress,
    )
