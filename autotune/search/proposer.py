"""Which config to measure next: the one predicted fastest among those that should fit.

The problem has structure, and the proposer uses it instead of a black-box sampler:

* memory grows with the micro batch when the other knobs (a *family*) stay the same, so one
  out-of-memory trial, or one estimate over the limit, rules out every larger micro batch of
  its family, and one config that fits vouches for every smaller one;
* throughput grows with the micro batch until it saturates, so the config to try in a family
  is its largest that fits: its *frontier*;
* which family is fastest depends on the model and the device, so families are ranked by the
  step-time model (each family's traced step against this device's measured roofline), corrected
  by every measured trial (:mod:`autotune.search.throughput`). A family is traced when its
  frontier is first estimated; until then it sits at the mean of the traced ones, and a ranking
  that traced a family on the way is made again.

Each proposal is the open config ranked first whose memory is known, or predicted, to fit.
A family's frontier is found by bisecting its micro batches with the memory estimator (no
trial spent); without one, by measuring the middle of its unknown micro batches, so an OOM
halves what is left. A retry of an interrupted trial comes before anything else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable

from autotune.config.knobs import TrialConfig
from autotune.search.throughput import ThroughputModel
from autotune.study.records import measured
from autotune.study.stale import MAX_LOST

if TYPE_CHECKING:
    import optuna

    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.estimate.estimator import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile
    from autotune.search.space import SearchSpace
    from autotune.study.summary import TrialRecord

__all__ = ["Proposer", "implied_too_big", "implied_fits", "straight_line"]

Estimator = Callable[[TrialConfig], "MemoryEstimate | None"]  # None when it cannot say
_LINE_SLACK = 0.05  # a size the straight line puts more than 5% past the threshold is not estimated


class Proposer:
    def __init__(
        self,
        space: SearchSpace,
        workload: Workload,
        device: DeviceInfo,
        *,
        estimator: Estimator | None = None,
        limit_bytes: int | None = None,
        margin: float = 0.0,
        precision_speed: dict[str, float] | None = None,
    ) -> None:
        self.space = space
        self.choices = space.choices(workload, device)
        self.candidates = space.candidates(workload, device)
        self.precision_speed = precision_speed
        self.profile: DeviceProfile | None = None  # this device's roofline: the step-time model's prior
        self._workload = workload
        self._estimator = estimator
        self._limit = limit_bytes
        self._margin = margin
        self._estimates: dict[TrialConfig, MemoryEstimate | None] = {}
        self._traced: dict[TrialConfig, MemoryEstimate] = {}  # a family (micro batch 1) -> an estimate with its costs
        self._ruled_out: list[TrialConfig] = []

    def suggest(self, trial: optuna.Trial) -> TrialConfig:
        """Define-by-run: the config of ``trial``'s parameters (fixed ones when it was enqueued)."""
        return self.space.config_of(
            {name: trial.suggest_categorical(name, list(values)) for name, values in self.choices.items()}
        )

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        return self.space.params_of(config)

    def next_config(self, records: list[TrialRecord], *, unmeasured_only: bool = False) -> TrialConfig | None:
        """The next config to measure, or None when every runnable config is measured or implied.

        ``unmeasured_only``: only configs with a knob value no trial has measured yet (see
        :meth:`unmeasured_values`), so a prior never dismisses a value on its own.
        """
        too_big = _too_big(records)
        fitting = [r.config for r in records if r.fits]
        open_configs = self._open_configs(records)
        if unmeasured_only:
            unmeasured = self.unmeasured_values(records)
            open_configs = [c for c in open_configs if unmeasured & self._values(c)]
        if not open_configs:
            return None
        retry = next((r.config for r in records if r.status == "interrupted" and r.config in open_configs), None)
        if retry is not None:
            return retry
        while True:  # again when the ranking traced a family on the way (its frontier's estimates): it moved
            traced = len(self._traced)
            proposal = self._ranked_proposal(records, open_configs, fitting, too_big)
            if len(self._traced) == traced:
                return proposal

    def _ranked_proposal(
        self,
        records: list[TrialRecord],
        open_configs: list[TrialConfig],
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
    ) -> TrialConfig | None:
        model = ThroughputModel(self.params_of, self._predicted_throughput, open_configs).fit(
            [(r.config, r.throughput) for r in records if r.status == "ok" and r.throughput]
        )
        order = {c: i for i, c in enumerate(self.candidates)}
        ranked = sorted(open_configs, key=lambda c: (-model.predict(c), order[c]))
        threshold = self._threshold(records)
        best = max((r.throughput or 0.0 for r in records if r.fits), default=0.0)
        # The device probe measured each precision's speed here: that is evidence, not a prior.
        probed = {("precision", repr(p)) for p in self.precision_speed or {}}
        unmeasured = self.unmeasured_values(records) - probed
        first = None
        for config in ranked:
            frontier = self._frontier(config, fitting, too_big, threshold)
            if frontier is None:  # nothing can tell: measure the middle of what is unknown
                return first or self._bisecting_trial(config, fitting, too_big, open_configs)
            if config.micro_batch > frontier:
                continue
            # Predicted faster than the best measured, or no value left unmeasured: measure it.
            # Else no trial is expected to beat the best, and for the values no trial (nor the probe)
            # has measured only a prior speaks: the fastest config that carries one goes first.
            if math.exp(model.predict(config)) > best or not unmeasured or unmeasured & self._values(config):
                return config
            first = first or config
        return first  # None: every open config is predicted not to fit

    def unmeasured_values(self, records: list[TrialRecord]) -> set[tuple[str, Any]]:
        """Knob values (micro batch aside) the space offers that no trial has measured and that
        still have a config open: evidence is owed for them before the search may settle."""
        offered = {
            (k, repr(v)) for k, values in self.choices.items() if k != "micro_batch" and len(values) > 1 for v in values
        }
        seen = set().union(*(self._values(r.config) for r in measured(records)))
        still_open = set().union(*(self._values(c) for c in self._open_configs(records)))
        return (offered - seen) & still_open

    def _values(self, config: TrialConfig) -> set[tuple[str, Any]]:
        return {(k, repr(v)) for k, v in self.params_of(config).items() if k != "micro_batch"}

    def _open_configs(self, records: list[TrialRecord]) -> list[TrialConfig]:
        done = {r.config for r in measured(records)}
        done |= {r.config for r in records if r.status in ("running", "skipped")}
        lost: dict[TrialConfig, int] = {}
        for r in records:
            if r.lost:
                lost[r.config] = lost.get(r.config, 0) + 1
        done |= {c for c, n in lost.items() if n >= MAX_LOST}  # lost on its retry too: not a third time
        too_big = _too_big(records)
        return [c for c in self.candidates if c not in done and not implied_too_big(c, too_big)]

    def _predicted_throughput(self, config: TrialConfig) -> float | None:
        """log samples/s of ``config`` by the step-time model; None without a traced step of its family."""
        from autotune.estimate.step_time import predict_step_time

        estimate = self._traced.get(config.replace(micro_batch=1))
        if estimate is None or self.profile is None:
            return None
        if estimate.config != config:
            estimate = dataclasses.replace(estimate, config=config)  # its costs are kept per sample
        step = predict_step_time(estimate, self._workload, self.profile)
        return math.log(step.samples_per_s) if step is not None else None

    def take_ruled_out(self) -> list[TrialConfig]:
        """Configs the estimator put over the limit since the last call (for the study to record)."""
        ruled_out, self._ruled_out = self._ruled_out, []
        return ruled_out

    # -- memory ------------------------------------------------------------------------------------
    def _family_sizes(self, config: TrialConfig) -> list[TrialConfig]:
        return [config.replace(micro_batch=size) for size in sorted(self.choices["micro_batch"])]

    def _threshold(self, records: list[TrialRecord]) -> float:
        """The predicted peak up to which a config is worth a trial: the limit, plus the margin
        for the estimator's error. Once trials have measured peaks it predicted, the margin is no
        more than the largest over-prediction seen on this workload: an estimator that has been
        right (or low) here says a config predicted over the limit will not fit."""
        if self._limit is None:
            return 0.0
        over = [
            predicted / r.peak_memory_bytes - 1
            for r in records
            if r.status == "ok" and r.peak_memory_bytes and (predicted := self._predicted(r))
        ]
        margin = min(self._margin, max(0.0, *over)) if over else self._margin
        return self._limit * (1 + margin)

    def _predicted(self, record: TrialRecord) -> int | None:
        if record.predicted_peak_bytes is not None:
            return record.predicted_peak_bytes
        estimate = self._estimates.get(record.config)
        return estimate.predicted_peak_bytes if estimate is not None else None

    def _frontier(
        self, config: TrialConfig, fitting: list[TrialConfig], too_big: list[TrialConfig], threshold: float
    ) -> int | None:
        """The largest micro batch of ``config``'s family known or predicted to fit under
        ``threshold`` (0: none); None when neither trials nor the estimator can tell.

        The first estimate probes the middle of what is unknown; from then on each estimate goes
        where a straight line through the last one says the limit is (model states stay, the
        rest grows with the micro batch), so a family usually costs two estimates. A size the
        line puts clearly over the limit is not estimated at all, nor one it puts clearly under (that
        one's own estimate, made before its trial, checks it if it is ever proposed).
        """
        family = self._family_sizes(config)
        fit, big = self._known_bounds(family, fitting, too_big)
        line: Callable[[int], float] | None = None
        while big - fit > 1:
            if line is None:
                index = (fit + big) // 2
            else:
                below = [i for i in range(fit + 1, big) if line(family[i].micro_batch) <= threshold]
                if not below and line(family[fit + 1].micro_batch) > threshold * (1 + _LINE_SLACK):
                    break  # clearly over: the line is enough
                index = max(below, default=fit + 1)
                if below and line(family[index].micro_batch) <= threshold / (1 + _LINE_SLACK):
                    fit = index  # clearly under
                    continue
            estimate = self._estimate(family[index])
            if estimate is None:
                return None
            line = straight_line(estimate)
            if estimate.predicted_peak_bytes <= threshold:
                fit = index
            else:
                big = index
                skip = self._limit * (1 + self._margin)  # what the study records as skipped; closer ones stay open
                if estimate.predicted_peak_bytes > skip and family[index] not in self._ruled_out:
                    self._ruled_out.append(family[index])
        return family[fit].micro_batch if fit >= 0 else 0

    def _known_bounds(
        self, family: list[TrialConfig], fitting: list[TrialConfig], too_big: list[TrialConfig]
    ) -> tuple[int, int]:
        """Indices into ``family``: the largest measured (or implied) to fit, the smallest that does not."""
        fit = max((i for i, c in enumerate(family) if implied_fits(c, fitting)), default=-1)
        big = min((i for i, c in enumerate(family) if c in too_big or implied_too_big(c, too_big)), default=len(family))
        return fit, big

    def _estimate(self, config: TrialConfig) -> MemoryEstimate | None:
        if self._estimator is None or self._limit is None:
            return None
        if config not in self._estimates:
            estimate = self._estimates[config] = self._estimator(config)
            if estimate is not None and estimate.step_costs is not None:
                self._traced.setdefault(config.replace(micro_batch=1), estimate)
        return self._estimates[config]

    def _bisecting_trial(
        self,
        config: TrialConfig,
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        open_configs: list[TrialConfig],
    ) -> TrialConfig:
        family = self._family_sizes(config)
        fit, big = self._known_bounds(family, fitting, too_big)
        middle = family[(fit + big) // 2] if big - fit > 1 else config
        return middle if middle in open_configs else config


def _too_big(records: list[TrialRecord]) -> list[TrialConfig]:
    """Configs known not to fit: out of memory, skipped by the estimator, or measured over the limit."""
    return [r.config for r in records if r.status in ("oom", "skipped") or (r.status == "ok" and not r.fits)]


def straight_line(estimate: MemoryEstimate) -> Callable[[int], float]:
    """Peak bytes against the micro batch through one estimate: model states fixed, the rest per sample."""
    states = estimate.parameters_bytes + estimate.gradients_bytes + estimate.optimizer_state_bytes
    per_sample = max(estimate.predicted_peak_bytes - states, 0) / estimate.config.micro_batch
    return lambda micro_batch: states + per_sample * micro_batch


def implied_fits(config: TrialConfig, fitting: list[TrialConfig]) -> bool:
    """A smaller micro batch with the same other knobs as a config that fit needs less memory."""
    return any(
        config.micro_batch <= known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
        for known in fitting
    )


def implied_too_big(config: TrialConfig, too_big: list[TrialConfig]) -> bool:
    """A larger micro batch with the same other knobs as a config that did not fit needs more memory."""
    return any(
        config.micro_batch > known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
        for known in too_big
    )
