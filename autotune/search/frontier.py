"""Where each family's micro batches stop fitting (its *frontier*): the largest size the trials or the memory
estimates put under the limit, found with the fewest estimates (bisecting, then a straight line through the last
one), and the estimates made on the way, kept for the proposer and the step-time model
(:class:`autotune.search.proposer.Proposer` asks; a family is one config's knobs at every micro batch)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from autotune.search.memory_bounds import implied_fits, implied_too_big, straight_line

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.estimate.results import MemoryEstimate
    from autotune.study.summary import TrialRecord

__all__ = ["Frontiers", "Estimator"]

Estimator = Callable[["TrialConfig"], "MemoryEstimate | None"]  # None when it cannot say
_LINE_SLACK = 0.05  # a size the straight line puts more than 5% past the threshold is not estimated
TRACED_AT_ONCE = max(1, os.cpu_count() or 1)  # estimates prefetched together: a trace is one core's work


class Frontiers:
    """The families' frontiers under ``limit`` (None: no budget, nothing to estimate), from ``estimator``'s
    predictions within ``margin`` of it; no new estimate once ``out_of_time()``."""

    def __init__(
        self,
        sizes: list[int],
        *,
        estimator: Estimator | None,
        prefetcher: Callable[[list[TrialConfig]], None] | None = None,
        limit: int | None,
        margin: float,
        out_of_time: Callable[[], bool],
    ) -> None:
        self.sizes = sorted(sizes)
        self.estimator = estimator
        self.limit = limit
        self.margin = margin
        self.out_of_time = out_of_time
        # Asks for several estimates together, where the estimator traces them at once (None: one at a time).
        self.prefetcher = prefetcher
        self.estimates: dict[TrialConfig, MemoryEstimate | None] = {}
        self.traced: dict[TrialConfig, MemoryEstimate] = {}  # a family (micro batch 1) -> an estimate with its costs
        self.ruled_out: list[TrialConfig] = []

    def take_ruled_out(self) -> list[TrialConfig]:
        """Configs the estimator put over the limit since the last call (for the study to record)."""
        ruled_out, self.ruled_out = self.ruled_out, []
        return ruled_out

    def family_sizes(self, config: TrialConfig) -> list[TrialConfig]:
        return [config.replace(micro_batch=size) for size in self.sizes]

    def threshold(self, records: list[TrialRecord]) -> float:
        """The predicted peak up to which a config is worth a trial: the limit, plus the margin
        for the estimator's error. Once trials have measured peaks it predicted, the margin is no
        more than the largest over-prediction seen on this workload: an estimator that has been
        right (or low) here says a config predicted over the limit will not fit."""
        if self.limit is None:
            return 0.0
        over = [
            predicted / r.peak_memory_bytes - 1
            for r in records
            if r.status == "ok" and r.peak_memory_bytes and (predicted := self.predicted(r))
        ]
        margin = min(self.margin, max(0.0, *over)) if over else self.margin
        return self.limit * (1 + margin)

    def predicted(self, record: TrialRecord) -> int | None:
        if record.predicted_peak_bytes is not None:
            return record.predicted_peak_bytes
        estimate = self.estimates.get(record.config)
        return estimate.predicted_peak_bytes if estimate is not None else None

    def frontier(
        self,
        config: TrialConfig,
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        threshold: float,
        *,
        cached_only: bool = False,
    ) -> int | None:
        """The largest micro batch of ``config``'s family known or predicted to fit under
        ``threshold`` (0: none); None when neither trials nor the estimator can tell (``cached_only``, or
        out of time: nor the estimates made so far, without a new one).

        The first estimate probes the middle of what is unknown; from then on each estimate goes
        where a straight line through the last one says the limit is (model states stay, the
        rest grows with the micro batch), so a family usually costs two estimates. A size the
        line puts clearly over the limit is not estimated at all, nor one it puts clearly under (that
        one's own estimate, made before its trial, checks it if it is ever proposed).
        """
        cached_only = cached_only or self.out_of_time()
        while True:  # each pass goes as far as the estimates made so far take it
            frontier, needed = self._search(config, fitting, too_big, threshold)
            if needed is None:
                return frontier
            if cached_only or self.estimate(needed) is None:
                return None

    def prefetch(
        self, walk: list[TrialConfig], fitting: list[TrialConfig], too_big: list[TrialConfig], threshold: float
    ) -> None:
        """Ask together for the estimates the next families down ``walk`` need first, as many as the machine
        traces at once (one at a time, a trace leaves every core but one idle). A walk stops at the first config
        its family's frontier holds; the families after the first that needs an estimate are a guess, traced on
        cores that would idle."""
        if self.prefetcher is None or self.estimator is None or self.limit is None or self.out_of_time():
            return
        needed: list[TrialConfig] = []
        for config in walk:
            frontier, estimate = self._search(config, fitting, too_big, threshold)
            if estimate is None and (frontier is None or config.micro_batch <= frontier):
                break  # the walk stops here
            if estimate is not None and estimate not in needed:
                needed.append(estimate)
            if len(needed) >= TRACED_AT_ONCE:
                break
        self.prefetch_all(needed)

    def prefetch_all(self, configs: list[TrialConfig]) -> None:
        """Ask for the estimates of ``configs`` together (where there are two or more to make), for
        :meth:`estimate` to find."""
        needed = [c for c in dict.fromkeys(configs) if c not in self.estimates]
        if len(needed) > 1 and self.prefetcher is not None and self.limit is not None and not self.out_of_time():
            self.prefetcher(needed)

    def _search(
        self, config: TrialConfig, fitting: list[TrialConfig], too_big: list[TrialConfig], threshold: float
    ) -> tuple[int | None, TrialConfig | None]:
        """(``config``'s family's frontier, None) as far as the trials and the estimates made so far tell it;
        (None, the config to estimate next) where they do not; (None, None) where the estimator cannot say."""
        family = self.family_sizes(config)
        fit, big = self.known_bounds(family, fitting, too_big)
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
            if family[index] not in self.estimates:
                return None, family[index]
            estimate = self.estimates[family[index]]
            if estimate is None:
                return None, None
            line = straight_line(estimate)
            if estimate.predicted_peak_bytes <= threshold:
                fit = index
            else:
                big = index
                assert self.limit is not None  # estimate() gives None without a limit
                skip = self.limit * (1 + self.margin)  # what the study records as skipped; closer ones stay open
                if estimate.predicted_peak_bytes > skip and family[index] not in self.ruled_out:
                    self.ruled_out.append(family[index])
        return (family[fit].micro_batch if fit >= 0 else 0), None

    def known_bounds(
        self, family: list[TrialConfig], fitting: list[TrialConfig], too_big: list[TrialConfig]
    ) -> tuple[int, int]:
        """Indices into ``family``: the largest measured (or implied) to fit, the smallest that does not."""
        fit = max((i for i, c in enumerate(family) if implied_fits(c, fitting)), default=-1)
        big = min((i for i, c in enumerate(family) if c in too_big or implied_too_big(c, too_big)), default=len(family))
        return fit, big

    def estimate(self, config: TrialConfig) -> MemoryEstimate | None:
        """``config``'s estimate, asked once (None: no estimator, no limit, or it cannot say)."""
        if self.estimator is None or self.limit is None:
            return None
        if config not in self.estimates:
            estimate = self.estimates[config] = self.estimator(config)
            if estimate is not None and estimate.step_costs is not None:
                self.traced.setdefault(config.replace(micro_batch=1), estimate)
        return self.estimates[config]

    def bisecting_trial(
        self,
        config: TrialConfig,
        fitting: list[TrialConfig],
        too_big: list[TrialConfig],
        open_configs: list[TrialConfig],
    ) -> TrialConfig:
        family = self.family_sizes(config)
        fit, big = self.known_bounds(family, fitting, too_big)
        middle = family[(fit + big) // 2] if big - fit > 1 else config
        return middle if middle in open_configs else config
