"""Which config to measure next: the one predicted fastest among those that should fit.

The problem has structure, and the proposer uses it instead of a black-box sampler:

* memory grows with the micro batch when the other knobs (a *family*) stay the same, so one
  out-of-memory trial, or one estimate over the limit, rules out every larger micro batch of
  its family, and one config that fits vouches for every smaller one;
* throughput grows with the micro batch until it saturates, so the config to try in a family
  is its largest that fits: its *frontier*;
* which family is fastest depends on the model and the device, so families are ranked by the
  step-time model (:mod:`autotune.search.step_prior`), corrected by every measured trial
  (:mod:`autotune.search.throughput`). A family is traced when its frontier is first estimated; a
  ranking that traced a family on the way is made again. Level families are traced LoRA first.

Each proposal is the open config ranked first whose memory is known, or predicted, to fit. No
estimate is spent on families predicted within the noise of a config already known to fit (a trial
could not tell them apart), and a config predicted over the limit (within the estimator's margin)
waits for a config predicted under it that nearly matches its speed times its chance to fit.
A family's frontier is found by bisecting its micro batches with the memory estimator (no
trial spent); without one, by measuring the middle of its unknown micro batches, so an OOM
halves what is left. A retry of an interrupted trial comes before anything else.

Evidence is owed before the search may end (:meth:`Proposer.owed_values`) for every knob value no trial
has measured (a prior is not evidence about this step), and for one whose measurement beat its prediction
(its family is re-ranked by the surprise). Past that, the search has settled (:class:`Outlook`) when no open
config's upper prediction (the model plus its error) beats the best measured by more than the noise.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from autotune.config.knobs import TrialConfig
from autotune.search.frontier import Estimator, Frontiers
from autotune.search.memory_bounds import implied_too_big, known_too_big, recomputes_more_than_fitting
from autotune.search.outlook import (
    MEASUREMENT_NOISE,
    WAIVE_FACTOR,
    Outlook,
    Value,
    best_fitting,
    measured_throughputs,
)
from autotune.search.space import LATER_KNOBS, later_knob_value
from autotune.search.step_prior import StepPrior
from autotune.search.throughput import ThroughputModel
from autotune.study.records import measured
from autotune.study.stale import MAX_LOST

if TYPE_CHECKING:
    import optuna

    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile
    from autotune.search.space import SearchSpace
    from autotune.study.summary import TrialRecord

__all__ = ["Proposer"]

SLOW_EVIDENCE = 4.0  # an owed value whose prior is this many times below the best waits for the rest: a slow trial


class Proposer:
    def __init__(
        self,
        space: SearchSpace,
        workload: Workload,
        device: DeviceInfo,
        *,
        estimator: Estimator | None = None,
        prefetcher: Callable[[list[TrialConfig]], None] | None = None,
        limit_bytes: int | None = None,
        margin: float = 0.0,
        precision_speed: dict[str, float] | None = None,
    ) -> None:
        self.space = space
        self.choices = space.choices(workload, device)
        self.candidates = space.candidates(workload, device)
        # True while an answer is wanted before the ranking settles (--max-time, none yet): a proposal
        # then traces its own family, not every family the re-ranking reaches on the way.
        self.hurry: Callable[[], bool] = lambda: False
        # True once --max-time leaves no room for another trial: no new estimate is made (on a model whose
        # trace costs seconds, a ranking pass over untraced families would overrun the limit).
        self.out_of_time: Callable[[], bool] = lambda: False
        self._workload = workload
        # The families' frontiers and the estimates made for them (kept for the step-time model: _prior).
        self._memory = Frontiers(
            list(self.choices["micro_batch"]),
            estimator=estimator,
            prefetcher=prefetcher,
            limit=limit_bytes,
            margin=margin,
            out_of_time=lambda: self.out_of_time(),
        )
        self._recompute_only_of: tuple[frozenset[TrialConfig], set[TrialConfig]] = (frozenset(), set())
        self._prior = StepPrior(workload, self._memory.traced, precision_speed)

    @property
    def profile(self) -> DeviceProfile | None:
        """This device's roofline: the step-time model's prior (set once the device is probed)."""
        return self._prior.profile

    @profile.setter
    def profile(self, profile: DeviceProfile | None) -> None:
        self._prior.profile = profile

    @property
    def precision_speed(self) -> dict[str, float] | None:
        """The device probe's matmul speed per precision over fp32's: where an untraced family sits."""
        return self._prior.precision_speed

    @precision_speed.setter
    def precision_speed(self, speed: dict[str, float] | None) -> None:
        self._prior.precision_speed = speed

    def suggest(self, trial: optuna.Trial) -> TrialConfig:
        """Define-by-run: the config of ``trial``'s parameters (fixed ones when it was enqueued)."""
        return self.space.config_of(
            {name: trial.suggest_categorical(name, list(values)) for name, values in self.choices.items()}
        )

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        """The config's value of each of the study's parameters (a knob the space moves only sometimes, such as
        the optimizer, is left out of ``SearchSpace.params_of`` at its default)."""
        params = self.space.params_of(config)
        later = {name: later_knob_value(config, name) for name in LATER_KNOBS if name in self.choices}
        return {**later, **params}

    def next_config(self, records: list[TrialRecord], *, unmeasured_only: bool = False) -> TrialConfig | None:
        """The next config to measure, or None when every runnable config is measured or implied.

        ``unmeasured_only``: only configs with a knob value evidence is owed for (see
        :meth:`owed_values`), so a prior never dismisses a value on its own.
        """
        too_big = known_too_big(records)
        fitting = [r.config for r in records if r.fits]
        open_configs = self._open_configs(records)
        if unmeasured_only:
            owed, waived = self._evidence(records)
            open_configs = [c for c in open_configs if owed & self._values(c) and not waived.keys() & self._values(c)]
        if not open_configs:
            return None
        retry = next((r.config for r in records if r.status == "interrupted" and r.config in open_configs), None)
        if retry is not None:
            return retry
        while True:  # again when the ranking traced a family on the way (its frontier's estimates): it moved
            traced = len(self._memory.traced)
            proposal = self._ranked_proposal(records, open_configs, fitting, too_big)
            if len(self._memory.traced) == traced or self.hurry():
                return proposal

    def outlook(self, records: list[TrialRecord]) -> Outlook:
        """The best measured, the open config predicted fastest that should fit, and how sure the model is."""
        too_big = known_too_big(records)
        fitting = [r.config for r in records if r.fits]
        open_configs = self._open_configs(records)
        best = best_fitting(records)
        owed, waived = self._evidence(records)
        while True:
            traced = len(self._memory.traced)
            model, ranked = self._ranking(records, open_configs)
            threshold = self._memory.threshold(records)
            # Before a trial fits, the outlook cannot settle the search: it need not estimate what the
            # proposal will not either.
            skipped = self._not_worth_an_estimate(model, ranked, fitting, too_big, threshold) if not best else set()
            self._memory.prefetch([c for c in ranked if c not in skipped], fitting, too_big, threshold)
            top = None
            for config in ranked:
                if config in skipped:
                    continue
                if self._may_fit(config, fitting, too_big, threshold):
                    top = config
                    break
                if self._moved(traced):
                    break  # the estimate traced a family: the ranking below it is stale
            if len(self._memory.traced) == traced or self.hurry():
                break
        return Outlook(
            best=best,
            top=top,
            predicted=math.exp(model.predict(top)) if top is not None and best > 0 else None,
            error=model.error_bound(),
            owed=frozenset(owed),
            untried=len(open_configs),
            waived=tuple(sorted(waived.items())),
            recompute_only=len(self._recompute_only(records)),
        )

    def _not_worth_an_estimate(
        self,
        model: ThroughputModel,
        ranked: list[TrialConfig],
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        threshold: float,
    ) -> set[TrialConfig]:
        """The configs ranked above the first one known to fit (by trials or the estimates made so far)
        that are predicted within the measurement noise of it and whose fit is not known: an estimate (a
        trace of their family) could only find a config no trial could tell apart from the known one. They
        stay open, and the known one is measured first; if its trial disappoints, they rank above it again."""
        skipped: set[TrialConfig] = set()
        for config in ranked:
            frontier = self._memory.frontier(config, fitting, too_big, threshold, cached_only=True)
            if frontier is not None and config.micro_batch <= frontier:
                bar = model.predict(config) + math.log1p(MEASUREMENT_NOISE)
                return {c for c in skipped if model.predict(c) <= bar}
            if frontier is None and self._prior.predicted(config) is not None:
                skipped.add(config)  # its own step (or a twin's) predicts it: a placed one is only a guess
        return set()

    def _moved(self, traced: int) -> bool:
        """A family was traced since ``traced`` families were, so a ranking made before is stale (unless an
        answer is wanted now: then the pass goes on down the ranking it has)."""
        return len(self._memory.traced) != traced and not self.hurry()

    def _ranking(
        self, records: list[TrialRecord], open_configs: list[TrialConfig]
    ) -> tuple[ThroughputModel, list[TrialConfig]]:
        model = self._prior.model(self.params_of, open_configs).fit(measured_throughputs(records))
        order = {c: i for i, c in enumerate(self.candidates)}
        # Level predictions (before any trace, every family is level) go to the family that does the least
        # work by construction: LoRA trains no weight gradients of the frozen base and steps no optimizer
        # over it. Only the order of the first traces changes; the traces then rank.
        return model, sorted(open_configs, key=lambda c: (-model.predict(c), c.lora_rank is None, order[c]))

    def _not_known_too_big(
        self, config: TrialConfig, fitting: list[TrialConfig], too_big: list[TrialConfig], threshold: float
    ) -> bool:
        """``config`` is not over its family's frontier as the trials and the estimates made so far put it."""
        frontier = self._memory.frontier(config, fitting, too_big, threshold, cached_only=True)
        return frontier is None or config.micro_batch <= frontier

    def _may_fit(
        self, config: TrialConfig, fitting: list[TrialConfig], too_big: list[TrialConfig], threshold: float
    ) -> bool:
        frontier = self._memory.frontier(config, fitting, too_big, threshold)
        return frontier is None or config.micro_batch <= frontier

    def _ranked_proposal(
        self,
        records: list[TrialRecord],
        open_configs: list[TrialConfig],
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
    ) -> TrialConfig | None:
        model, ranked = self._ranking(records, open_configs)
        threshold = self._memory.threshold(records)
        traced = len(self._memory.traced)
        proposal = self._first_worth_a_trial(records, open_configs, fitting, too_big, model, ranked, threshold)
        if self._moved(traced):
            return proposal  # the caller ranks again before going on
        return self._sure_first(proposal, records, model, ranked, fitting, too_big, threshold)

    def _first_worth_a_trial(
        self,
        records: list[TrialRecord],
        open_configs: list[TrialConfig],
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        model: ThroughputModel,
        ranked: list[TrialConfig],
        threshold: float,
    ) -> TrialConfig | None:
        best = best_fitting(records)
        owed, waived = self._evidence(records)
        error = model.error()
        first = possible = far_owed = None
        traced = len(self._memory.traced)
        skipped = self._not_worth_an_estimate(model, ranked, fitting, too_big, threshold)
        self._memory.prefetch([c for c in ranked if c not in skipped], fitting, too_big, threshold)
        for config in ranked:
            if config in skipped:
                continue
            frontier = self._memory.frontier(config, fitting, too_big, threshold)
            if frontier is None and self.out_of_time():
                continue  # not estimated in time: only what is known may be proposed
            if frontier is None:  # nothing can tell: measure the middle of what is unknown
                return first or self._memory.bisecting_trial(config, fitting, too_big, open_configs)
            if config.micro_batch > frontier:
                if self._moved(traced):
                    return first  # its estimate traced a family: the caller ranks again before going on
                continue
            first = first or config
            predicted = math.exp(model.predict(config))
            # Predicted to beat the best, or level with it within the noise (as likely as not to beat it): a
            # neighbour that close is measured before an owed value's first step, which the model ranks below.
            if predicted * (1 + MEASUREMENT_NOISE) > best:
                return first
            if error is not None and predicted * math.exp(error) > best * (1 + MEASUREMENT_NOISE):
                return first  # within the model's error of the best
            if error is None:
                possible = possible or config  # the error is unknown: within it, maybe
            if owed & self._values(config) and not waived.keys() & self._values(config):
                # A value's first measurement: at its most promising family's frontier, where its
                # throughput is highest (the micro batch saturates), not at a size the prior happens to like.
                largest = config.replace(micro_batch=frontier)
                chosen = largest if largest in open_configs else config
                # Before the model's error is known, a value not yet measured tells it more than a
                # neighbour of a measured config; unless its prior is far below the best, which makes
                # its trial slow for the evidence it brings: then it waits, still owed, for the rest.
                if error is not None or predicted * SLOW_EVIDENCE > best:
                    return chosen
                far_owed = far_owed or chosen
        return possible or far_owed or first  # None: every open config is predicted not to fit

    def _sure_first(
        self,
        proposal: TrialConfig | None,
        records: list[TrialRecord],
        model: ThroughputModel,
        ranked: list[TrialConfig],
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        threshold: float,
    ) -> TrialConfig | None:
        """``proposal``, or, where the estimator puts it over the limit (within its margin: a gamble), a config
        predicted under the limit whose throughput beats the gamble's times its chance to fit and may beat the
        best measured: an answer sooner, and a trial less spent over the limit. The gamble stays open: the outlook
        still wants its trial while it may beat the best, and a value it would have measured first stays owed."""
        if proposal is None or (chance := self._chance_to_fit(proposal, threshold)) >= 1.0:
            return proposal
        best = best_fitting(records)
        bar = model.predict(proposal) + math.log(max(chance, 1e-9))
        for config in ranked:
            predicted = model.predict(config)
            if predicted < bar:
                break
            if config == proposal:
                continue
            if math.exp(predicted) * (1 + MEASUREMENT_NOISE) <= best:
                continue  # cannot improve the answer: not worth a trial before the gamble
            frontier = self._memory.frontier(config, fitting, too_big, threshold)
            if frontier is not None and config.micro_batch <= frontier and self._chance_to_fit(config, threshold) >= 1:
                return config
        return proposal

    def _chance_to_fit(self, config: TrialConfig, threshold: float) -> float:
        """1 for a config predicted under the limit (or not estimated: trials or the straight line settled
        it); for one predicted over it by a share of the estimator's margin, 1 minus that share (the margin
        is what the estimator may over-predict by; its error taken as spread evenly over it)."""
        estimate = self._memory.estimates.get(config)
        if estimate is None or self._memory.limit is None or estimate.predicted_peak_bytes <= self._memory.limit:
            return 1.0
        margin = threshold / self._memory.limit - 1
        over = estimate.predicted_peak_bytes / self._memory.limit - 1
        return max(0.0, 1.0 - over / margin) if margin > 0 else 0.0

    def owed_values(self, records: list[TrialRecord]) -> set[Value]:
        """Knob values a measurement is owed for before the search may end: those no trial has
        measured, and those whose one measured config beat its prediction made without it by more
        than the noise (a surprise: the value's family is re-ranked, and its new top one measured)."""
        return self._evidence(records)[0]

    def _evidence(self, records: list[TrialRecord]) -> tuple[set[Value], dict[Value, float]]:
        """(owed values, waived values -> the most their configs may reach over the best). Waived: those
        :meth:`far_below` finds cannot pay, and the unmeasured values whose open configs that may fit (by the
        trials and the estimates made so far) all hold one of those too: measuring a value there is a slow
        trial (a 16-bit step on a CPU without 16-bit matmuls) about a config the answer cannot be."""
        unmeasured = self.unmeasured_values(records)
        far = self.far_below(records, unmeasured)
        waived = dict(far)
        open_configs = self._open_configs(records)
        fitting, too_big, threshold = (
            [r.config for r in records if r.fits],
            known_too_big(records),
            self._memory.threshold(records),
        )
        for value in sorted(unmeasured - far.keys()) if far else ():
            carriers = [
                self._values(c)
                for c in open_configs
                if value in self._values(c) and self._not_known_too_big(c, fitting, too_big, threshold)
            ]
            if carriers and all(far.keys() & held for held in carriers):
                waived[value] = max(far[w] for held in carriers for w in far.keys() & held)
        owed = unmeasured - waived.keys()
        still_open = set().union(*(self._values(c) for c in open_configs))
        points = measured_throughputs(records)
        best = best_fitting(records)
        configs_with: dict[Value, set[TrialConfig]] = {}
        for config, _ in points:
            for value in self._values(config):
                configs_with.setdefault(value, set()).add(config)
        for value, configs in configs_with.items():
            if len(configs) != 1 or value not in still_open or not self._multi_valued(value):
                continue
            (config,) = configs
            others = [(c, t) for c, t in points if c != config]
            if not others:
                continue
            without = self._prior.model(self.params_of, open_configs).fit(others)
            surprise = max(math.log(t) for c, t in points if c == config) - without.predict(config)
            if surprise <= math.log1p(MEASUREMENT_NOISE):
                continue  # no surprise: the ranking already holds what it says
            # Re-ranked by the whole surprise (the fit shrinks one trial's say), does the value's family
            # now promise more than the best?
            promising = max(without.predict(c) for c in open_configs if value in self._values(c)) + surprise
            if math.exp(promising) > best * (1 + MEASUREMENT_NOISE):
                owed.add(value)
        return owed, waived

    def far_below(self, records: list[TrialRecord], values: set[Value]) -> dict[Value, float]:
        """Those of ``values`` that cannot pay on this device: the open configs holding one are predicted, at
        the model's error above their predictions, ``WAIVE_FACTOR`` times or more below the best measured, the
        most promising of them from its own traced step (a placed guess proves nothing: its family is traced
        first). Value -> the highest upper prediction over the best. Nothing before two trials bound the model's
        error (:meth:`ThroughputModel.error_bound`)."""
        best = best_fitting(records)
        if not best or not values or self.profile is None:
            return {}
        open_configs = self._open_configs(records)
        model = self._prior.model(self.params_of, open_configs).fit(measured_throughputs(records))
        if model.error_bound() is None:
            return {}
        far: dict[Value, float] = {}
        smallest = min(self.choices["micro_batch"])
        # The families whose trace each value's judgement below needs first (placed: untraced), asked together.
        tops = self._tops_far_below(model, open_configs, values, best)
        self._memory.prefetch_all([t.replace(micro_batch=smallest) for t in tops if self._prior.predicted(t) is None])
        for value in sorted(values):
            holding = self._far_holders(model, open_configs, value, best)
            if not holding:
                continue  # it may pay (or nothing of it is open): it is measured
            top = max(holding, key=model.predict)
            if self._prior.predicted(top) is None:  # placed: trace its family, then judge again
                if self.out_of_time() or self._memory.estimate(top.replace(micro_batch=smallest)) is None:
                    continue
                model = self._prior.model(self.params_of, open_configs).fit(measured_throughputs(records))
                if self._prior.predicted(top) is None or model.error_bound() is None:
                    continue
            upper = self._upper(model, holding)
            if upper * WAIVE_FACTOR <= best:
                far[value] = upper / best
        return far

    def _tops_far_below(
        self, model: ThroughputModel, open_configs: list[TrialConfig], values: set[Value], best: float
    ) -> list[TrialConfig]:
        """For each of ``values`` whose open configs all lie ``WAIVE_FACTOR`` below ``best`` as ``model`` predicts
        them now, the most promising of those configs."""
        holders = (self._far_holders(model, open_configs, value, best) for value in sorted(values))
        return [max(holding, key=model.predict) for holding in holders if holding]

    def _far_holders(
        self, model: ThroughputModel, open_configs: list[TrialConfig], value: Value, best: float
    ) -> list[TrialConfig]:
        """The open configs holding ``value``, where all of them lie ``WAIVE_FACTOR`` below ``best`` at the model's
        error above their predictions; none where one may pay (or none is open)."""
        holding = [c for c in open_configs if value in self._values(c)]
        return holding if holding and self._upper(model, holding) * WAIVE_FACTOR <= best else []

    @staticmethod
    def _upper(model: ThroughputModel, configs: list[TrialConfig]) -> float:
        """The highest throughput any of ``configs`` may reach: its prediction at the model's error above."""
        error = model.error_bound() or 0.0
        return max(math.exp(model.predict(c) + error) for c in configs)

    def memory_estimate(self, config: TrialConfig) -> MemoryEstimate | None:
        """The estimator's prediction for ``config`` (cached, and its trace kept for the step-time model);
        None without an estimator or where it cannot say."""
        return self._memory.estimate(config)

    def unmeasured_values(self, records: list[TrialRecord]) -> set[tuple[str, Any]]:
        """Knob values (micro batch aside) the space offers that no trial has measured and that
        still have a config open: evidence is owed for them before the search may settle. An
        out-of-memory trial measured its size, not its speed; one that failed otherwise did measure
        that the value does not train (it is not owed again)."""
        offered = {(k, repr(v)) for k, values in self.choices.items() for v in values if self._multi_valued((k, v))}
        seen = set().union(*(self._values(r.config) for r in measured(records) if r.status != "oom"))
        still_open = set().union(*(self._values(c) for c in self._open_configs(records)))
        return (offered - seen) & still_open

    def _multi_valued(self, value: tuple[str, Any]) -> bool:
        """A knob (micro batch aside) the space lets move."""
        return value[0] != "micro_batch" and len(self.choices.get(value[0], ())) > 1

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
        too_big = known_too_big(records)
        recompute_only = self._recompute_only(records)
        return [
            c for c in self.candidates if c not in done and not implied_too_big(c, too_big) and c not in recompute_only
        ]

    def _recompute_only(self, records: list[TrialRecord]) -> set[TrialConfig]:
        """The candidates that checkpoint more layers than a config that fits, all else the same."""
        fitting = frozenset(r.config for r in records if r.fits)
        if fitting != self._recompute_only_of[0]:  # kept until another config fits: asked for each ranking
            offered = set(self.candidates)
            dominated = {c for c in self.candidates if recomputes_more_than_fitting(c, list(fitting), offered)}
            self._recompute_only_of = (fitting, dominated)
        return self._recompute_only_of[1]

    def take_ruled_out(self) -> list[TrialConfig]:
        """Configs the estimator put over the limit since the last call (for the study to record)."""
        return self._memory.take_ruled_out()
