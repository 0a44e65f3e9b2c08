"""A plan without trials: every config of a space predicted to fit, ranked by predicted throughput.

``find --plan`` answers before the hardware is there: for a named card (``--gpu``) it predicts
each config's memory (the estimator's traced step and its CUDA figures) and its step time
(:mod:`autotune.estimate.step_time`, the same trace against the card's roofline). Nothing runs.

A model of many layers is traced as two shallow copies of itself, 2 and 4 layers, and its traced
step drawn by the straight line through them (:mod:`autotune.estimate.depth_proxy`): a 7B then costs
two traces of a second, not one of ten; configs that trace the same step (compile, tf32, every ZeRO
stage and offload of one precision) share one.
Each family (the configs that differ only in the micro batch) is traced once, at its middle size: the
straight line through that estimate (model states fixed, the rest per sample) says which sizes fit, and
only a size the line puts within ``LINE_MARGIN`` of the limit is estimated itself. Each config of the
family that fits is timed from the family's traced operators, which are kept per sample, so one trace
times every micro batch. Before any trace, a family whose model states alone (parameters, gradients and
optimizer state per rank, from a traced family that holds the same ones) are over the limit is not
traced: nothing of it fits the card. Each estimate that traces is told the families the plan will estimate next
whatever it learns first, and the first of them that needs a trace of its own is traced beside it: two
families' copies of one depth side by side on two cores. On a card that multiplies fp16 and bf16 at one
rate, the two hold the same tensors and time alike: one row shows both (bf16 first: it needs no loss scaling).
The configs whose predicted throughput is within the model's error of the top one are marked "verify
first": those are the trials worth running once the card is there. The families whose precision multiplies
fastest are planned first; a family that differs from a traced one only in a slower precision (fp32 or tf32
beside bf16) does the same matmuls, so their FLOPs at its own rate are a floor under its step. Where that floor
is further from the fastest row so far than the model's error, none of its configs could be verified first and
it is not traced (:class:`_SpeedFloor`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from autotune.search.memory_bounds import straight_line

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile, StepTime
    from autotune.search.space import SearchSpace

__all__ = ["Plan", "PlanRow", "Twin", "plan", "plan_space", "PLAN_ERROR", "LINE_MARGIN"]

# The step-time model's error on published GPU runs (bench/results/plan_published.txt): configs
# predicted within it of the top one cannot be told apart by prediction alone.
PLAN_ERROR = 0.2
# Families the plan looks ahead to, past the one it estimates, for the next that needs a trace of its own: a default
# space lists the twelve shardings of each family, and compile's twin (the same trace) after them.
LOOK_AHEAD = 32
# A size the family's straight line puts within this share of the limit is estimated itself: the line's error
# (activations not quite per sample, the allocator's rounding) could turn its verdict.
LINE_MARGIN = 0.05


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    config: TrialConfig
    step: StepTime
    memory_bytes: int  # what the fit is judged on: reserved on CUDA, live tensors on a CPU
    device_bytes: int | None  # what nvidia-smi would show (CUDA)
    estimated: bool  # this config's own estimate (else its family's straight line)
    verify_first: bool = False
    twin: TrialConfig | None = None  # a config this row stands for too: the same figures (see plan_space)

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
            "twin": self.twin.describe() if self.twin is not None else None,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    profile_source: str
    memory_budget_bytes: int
    limit_bytes: int
    rows: list[PlanRow]  # fitting configs, fastest first (a twin of another row's config in its row)
    too_big: int  # configs predicted not to fit
    not_estimated: list[str] = field(default_factory=list)  # families the estimator could not trace, why
    estimates: int = 0
    seconds: float = 0.0
    states_over: int = 0  # families not traced: their model states alone are over the limit
    slower: int = 0  # configs not traced: a floor under their step is too slow to verify first (_SpeedFloor)
    slower_families: int = 0
    twin_note: str | None = None  # why a row shows one config of a twin pair and not the other

    @property
    def fitting(self) -> int:
        """Configs predicted to fit: a row's own and its twin's."""
        return len(self.rows) + sum(row.twin is not None for row in self.rows)

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
            "families_over_in_model_states": self.states_over,
            "slower_than_the_top": self.slower,
            "families_slower_than_the_top": self.slower_families,
            "fitting": self.fitting,
            "twin_note": self.twin_note,
        }


Estimator = Callable[["TrialConfig", "Sequence[TrialConfig]"], "MemoryEstimate"]


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
    twin: Twin | None = None,
) -> Plan:
    """Every config of ``space`` predicted to fit under ``limit_bytes`` on ``device``, fastest first.

    ``estimator(config, ahead)`` predicts one config's memory and traced costs (raising
    :class:`autotune.estimate.results.EstimateError` where it cannot); ``ahead``: the configs the plan will ask
    for next, which it may trace beside ``config`` (see :meth:`_Families.ahead`). ``twin``: the configs another
    config's row stands for (their figures are its own), and why that one is shown.
    """
    from autotune.estimate.results import EstimateError
    from autotune.estimate.step_time import matmul_speedups

    started = time.monotonic()
    configs = space.candidates(workload, device)
    speedup = matmul_speedups(profile, {config.precision for config in configs})
    families = _Families.of(configs, first=lambda config: -speedup[config.precision])
    floor = _SpeedFloor(workload, profile, speedup)
    rows: list[PlanRow] = []
    too_big = estimates = states_over = slower = slower_families = 0
    not_estimated: list[str] = []
    for index, members in enumerate(families.members):
        if families.twins[index] in families.over:  # nothing of it fits: not traced
            too_big, states_over = too_big + len(members), states_over + 1
            continue
        if floor.rules_out(members):
            slower, slower_families = slower + len(members), slower_families + 1
            continue
        try:
            fitting, made = _fitting(members, estimator, limit_bytes, families.ahead(index, floor.rules_out))
        except EstimateError as exc:
            not_estimated.append(f"{members[0].replace(micro_batch=1).describe()}: {exc}")
            continue
        families.learn(index, over=any(_states(estimate) > limit_bytes for estimate in made))
        floor.learn(made)
        estimates += len(made)
        too_big += len(members) - len(fitting)
        timed = _timed(fitting, workload, profile)
        rows += timed
        floor.timed(timed)
        if progress is not None:
            progress(index + 1, len(families.members))
    rows.sort(key=lambda row: -row.step.samples_per_s)
    rows = _twins_merged(rows, twin.of if twin is not None else None)
    if rows:
        top = rows[0].step.samples_per_s
        rows = [_verify(row, row.step.samples_per_s >= top * (1 - PLAN_ERROR)) for row in rows]
    return Plan(
        device=profile.name,
        profile_source=profile.describe() + (f", on {nodes}" if (nodes := profile.nodes(workload)) else ""),
        memory_budget_bytes=memory_budget_bytes,
        limit_bytes=limit_bytes,
        rows=rows,
        too_big=too_big,
        not_estimated=not_estimated,
        estimates=estimates,
        seconds=time.monotonic() - started,
        states_over=states_over,
        slower=slower,
        slower_families=slower_families,
        twin_note=twin.note if twin is not None and any(row.twin for row in rows) else None,
    )


@dataclass
class _Families:
    """A space's families (configs that differ only in the micro batch, smallest first) in the order planned, each
    with its model-states twin, and what the estimates so far said of those twins' states."""

    members: list[list[TrialConfig]]
    twins: list[TrialConfig]
    over: set[TrialConfig] = field(default_factory=set)  # twins whose states alone are over the limit
    under: set[TrialConfig] = field(default_factory=set)  # twins an estimate found within it

    @classmethod
    def of(cls, configs: Iterable[TrialConfig], first: Callable[[TrialConfig], float]) -> _Families:
        """The families of ``configs``, those of the lowest ``first`` first, in the space's order otherwise."""
        from autotune.levers import model_states_twin

        families: dict[TrialConfig, list[TrialConfig]] = {}
        for config in configs:
            families.setdefault(config.replace(micro_batch=1), []).append(config)
        members = [sorted(family, key=lambda c: c.micro_batch) for family in families.values()]
        members.sort(key=lambda family: first(family[0]))
        return cls(members, [model_states_twin(family[0]) for family in members])

    def learn(self, index: int, *, over: bool) -> None:
        (self.over if over else self.under).add(self.twins[index])

    def ahead(self, index: int, skipped: Callable[[list[TrialConfig]], bool]) -> list[TrialConfig]:
        """The middle configs of the families after ``index`` the plan will estimate whatever it learns first
        (``LOOK_AHEAD`` families at most): none whose twin is over or that is ``skipped`` (whose verdict stands:
        see :class:`_SpeedFloor`), and of a twin not estimated yet only its first family (an estimate before the
        others' may find its states over). Tracing them early changes no figure."""
        firsts: dict[TrialConfig, int] = {}
        for later, twin in enumerate(self.twins[: index + 1 + LOOK_AHEAD]):
            firsts.setdefault(twin, later)
        return [
            family[(len(family) - 1) // 2]
            for later, family in enumerate(self.members[index + 1 : index + 1 + LOOK_AHEAD], start=index + 1)
            if self.twins[later] not in self.over
            and (self.twins[later] in self.under or firsts[self.twins[later]] == later)
            and not skipped(family)
        ]


@dataclass
class _SpeedFloor:
    """Which families a traced sibling rules out of the plan's top. A family that differs from a traced one only in
    its precision does the same matmuls and attention, so those FLOPs at its own precision's rate are a floor under
    its step (:func:`autotune.estimate.step_time.matmul_floor_s`). Where the floor is further from the fastest row
    so far than the model's error (``PLAN_ERROR``), none of the family's configs could be verified first, and it is
    not traced. Only a sibling of a faster precision rules out: one of the same rate (fp16 beside bf16 on most
    cards) times alike. The fastest row only gets faster, so a family ruled out stays ruled out."""

    workload: Workload
    profile: DeviceProfile
    speedup: dict[str, float]  # each precision's matmul rate over fp32's (matmul_speedups)
    siblings: dict[TrialConfig, MemoryEstimate] = field(default_factory=dict)  # by _sibling_key
    fastest_step_s: float = math.inf
    # Each family's floor, by its first config, once its sibling is traced: the look-ahead asks again and again.
    floors: dict[TrialConfig, float] = field(default_factory=dict)

    def learn(self, made: list[MemoryEstimate]) -> None:
        if made:  # a family's traced operators are kept per sample: one estimate times them all
            self.siblings.setdefault(_sibling_key(made[0].config), made[0])

    def timed(self, new_rows: list[PlanRow]) -> None:
        self.fastest_step_s = min([self.fastest_step_s, *(row.step.step_s for row in new_rows)])

    def rules_out(self, members: list[TrialConfig]) -> bool:
        floor = self.floors.get(members[0])
        if floor is None:
            from autotune.estimate.step_time import matmul_floor_s

            sibling = self.siblings.get(_sibling_key(members[0]))
            if sibling is None or self.speedup[sibling.config.precision] <= self.speedup[members[0].precision]:
                return False
            floor = min(matmul_floor_s(sibling, config, self.workload, self.profile) for config in members)
            self.floors[members[0]] = floor
        return floor * (1 - PLAN_ERROR) > self.fastest_step_s


def _sibling_key(config: TrialConfig) -> TrialConfig:
    """What a config's family shares with its siblings of other precisions."""
    return config.replace(micro_batch=1, precision="fp32")


def _timed(
    fitting: list[tuple[TrialConfig, MemoryEstimate, float, int | None]], workload: Workload, profile: DeviceProfile
) -> list[PlanRow]:
    """A row for each fitting config of a family that the step-time model times."""
    from autotune.estimate.step_time import predict_step_time

    rows = []
    for config, estimate, memory, device_bytes in fitting:
        step = predict_step_time(_as(estimate, config), workload, profile)
        if step is not None:
            estimated = estimate.config == config
            rows.append(
                PlanRow(
                    config=config, step=step, memory_bytes=int(memory), device_bytes=device_bytes, estimated=estimated
                )
            )
    return rows


@dataclass(frozen=True)
class Twin:
    """Configs that hold the same tensors and time alike on a card: ``of(config)`` is the config whose row also
    stands for ``config`` (None: its own row); ``note`` says why that one is shown."""

    of: Callable[[TrialConfig], TrialConfig | None]
    note: str


def _twins_merged(rows: list[PlanRow], twin_of: Callable[[TrialConfig], TrialConfig | None] | None) -> list[PlanRow]:
    """``rows`` with each config whose twin has a row folded into that row."""
    if twin_of is None:
        return rows
    shown = {row.config for row in rows}
    folded = {shown_as: row.config for row in rows if (shown_as := twin_of(row.config)) in shown}
    return [replace(row, twin=folded.get(row.config)) for row in rows if twin_of(row.config) not in shown]


def _states(estimate: MemoryEstimate) -> int:
    """Model states per rank: what a config holds however small its micro batch."""
    return estimate.parameters_bytes + estimate.gradients_bytes + estimate.optimizer_state_bytes


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
    members: list[TrialConfig], estimator: Estimator, limit: int, ahead: Sequence[TrialConfig] = ()
) -> tuple[list[tuple[TrialConfig, MemoryEstimate, float, int | None]], list[MemoryEstimate]]:
    """The family's configs predicted to fit, each with the estimate that times it, its memory and its
    device figure; and the estimates made. One estimate, at the middle size; each size is judged by the
    straight line through the nearest estimate, and one the line puts within ``LINE_MARGIN`` of the limit
    gets an estimate of its own. Memory grows with the micro batch: the first size over the limit ends it."""
    made: dict[int, MemoryEstimate] = {}

    def judged(index: int) -> tuple[MemoryEstimate, float, int | None]:
        nearest = made.get(index) or made[min(made, key=lambda k: abs(k - index))]
        if index in made:
            return nearest, float(_held(nearest)), nearest.predicted_device_bytes
        ratio = _held(nearest) / max(nearest.predicted_peak_bytes, 1)  # reserved over live tensors, as there
        memory = straight_line(nearest)(members[index].micro_batch) * ratio
        extra = (nearest.predicted_device_bytes - _held(nearest)) if nearest.predicted_device_bytes else None
        return nearest, memory, int(memory + extra) if extra is not None else None

    made[(len(members) - 1) // 2] = estimator(members[(len(members) - 1) // 2], ahead)
    fitting = []
    for index, config in enumerate(members):
        nearest, memory, device_bytes = judged(index)
        if index not in made and abs(memory / limit - 1) <= LINE_MARGIN:
            made[index] = estimator(config, ())
            nearest, memory, device_bytes = judged(index)
        if memory > limit:
            break
        fitting.append((config, nearest, memory, device_bytes))
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
    from autotune.search.presets import load_space
    from autotune.search.space import SearchSpace

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

    def as_traced(config: TrialConfig) -> TrialConfig:
        return config.replace(precision="bf16") if twins and config.precision == "fp16" else config

    def estimate(config: TrialConfig, ahead: Sequence[TrialConfig]) -> MemoryEstimate:
        traced = predict_memory(workload, as_traced(config), proxy=proxy, ahead=[as_traced(c) for c in ahead])
        return _as(traced, config)

    def bf16_twin(config: TrialConfig) -> TrialConfig | None:
        return config.replace(precision="bf16") if config.precision == "fp16" else None

    return plan(
        workload=workload,
        space=space,
        profile=profile,
        device=device,
        limit_bytes=int(budget * (1 - headroom)),
        memory_budget_bytes=budget,
        estimator=estimate,
        progress=progress,
        twin=Twin(
            bf16_twin,
            "fp16 holds the same tensors as bf16 and multiplies as fast on this card: one row stands for both, "
            "bf16 first, as it needs no loss scaling (fp16's gradients can overflow without it)",
        )
        if twins
        else None,
    )
