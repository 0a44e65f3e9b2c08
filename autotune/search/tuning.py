"""One call's tuning on an opened study, step by step: the simple answer first (:meth:`Tuning.simple_answer`),
then the search loop (:meth:`Tuning.search`), then the interleaved re-runs that decide the answer
(:meth:`Tuning.confirm`). :func:`autotune.search.tuner.tune` checks the question, opens the study and builds
one; each step reads on its own.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.search.confirm import held_answer
from autotune.search.confirming import confirm_winner
from autotune.search.interrupt import stop_point
from autotune.search.measuring import Measure, outpaced_step_s
from autotune.search.simple import SIMPLE_KEY, next_ramp_config, ramp_answer, ramp_family
from autotune.search.stopping import patience_spent, settled_reason, stop_reason, waits_on_others
from autotune.search.study_trials import (
    Oracle,
    ask,
    heartbeat,
    measure_in_study,
    record_ruled_out,
    recover_lost,
    retry_of,
    skip_if_too_big,
)
from autotune.search.workers import proposal_lock
from autotune.study.records import STOP_KEY, measured, memory_limit, ranking, records_of
from autotune.study.stale import RETRY_ATTR

if TYPE_CHECKING:
    import optuna

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.search.backends import TrialBackend
    from autotune.search.clock import Clock
    from autotune.search.outlook import Outlook
    from autotune.search.progress import Progress
    from autotune.search.proposer import Proposer
    from autotune.study.summary import TrialRecord

__all__ = ["Tuning"]

_WATCH_S = 2.0  # how often a worker with nothing left to start looks at the others' trials


@dataclass(kw_only=True)
class Tuning:
    """What one call tunes with: the opened study, the proposer and the estimator's predictions, how each trial
    is measured and run, and the call's limits (``--n-trials``, ``--patience``, ``--timeout``, ``--max-time``)."""

    study: optuna.Study
    storage: str | None
    proposer: Proposer
    oracle: Oracle | None
    workload: Workload
    measure: Measure
    backend: TrialBackend
    progress: Progress
    clock: Clock
    target: int
    patience: int | None
    timeout_s: float | None
    stop_on_evidence: bool
    started: float = dataclasses.field(default_factory=time.monotonic)  # --timeout counts from here

    # -- the simple answer first ------------------------------------------------------------------
    def simple_answer(self) -> None:
        """Measure the ramp of :mod:`autotune.search.simple` and store its answer, the first one held.

        The first trial of the call warms up one step more: the machine's first trial after the servers'
        start-up (caches, the first fork's page faults) is not measured cold. A warm-up step is one micro batch
        and an optimizer step (:meth:`autotune.trial.engine.TrainingEngine.warm_up`): the extra one is cheap."""
        from autotune.study.storage import DEFAULT_STORAGE

        family = ramp_family(self.proposer.candidates)
        limit = memory_limit(self.study.user_attrs["autotune"])
        first = dataclasses.replace(self.measure, warmup_steps=self.measure.warmup_steps + 1)
        estimates = self.proposer.memory_estimate if self.oracle else None
        while family:
            stop_point()
            with proposal_lock(self.storage or DEFAULT_STORAGE, self.study.study_name):
                recover_lost(self.study, self.progress)  # other workers' trials, as the search's loop does
                records = records_of(self.study)
                config = next_ramp_config(family, records, estimates, limit)
                if config is None or len(measured(records)) >= self.target:
                    break
                trial, config = ask(self.study, self.proposer, config)
            # Predicted well over the limit (the smallest size, where none is predicted under): skipped, as the
            # search skips it; the ramp ends with no answer, as a finder's would at its first size.
            if self._measure(trial, config, records, first):
                first = self.measure
        answer = ramp_answer(family, records_of(self.study))
        self.study.set_user_attr(SIMPLE_KEY, answer.number if answer is not None else None)
        accumulation = answer.config.grad_accum_steps(self.workload) if answer is not None else 0
        self.progress.simple_answer(record=answer, elapsed_s=self.clock.elapsed(), accumulation=accumulation)

    # -- the search -------------------------------------------------------------------------------
    def search(self) -> None:
        """Under the proposal lock, decide whether to stop and which config to take; then measure it (or skip it
        on its estimate), until a stop rule or the space says the search is over."""
        while True:
            stop_point()
            step = self._next_step()
            if step.waiting:  # another worker's trial may still be lost and owe a retry: watch until it ends
                time.sleep(_WATCH_S)
                continue
            if step.reason:
                self.progress.stopped(reason=step.reason)
                self.study.set_user_attr(STOP_KEY, step.reason)
                return
            assert step.trial is not None and step.config is not None  # no reason: a config was taken
            self._measure(step.trial, step.config, step.records, self.measure)

    def _next_step(self) -> _Step:
        """Choose and take a config atomically (other workers propose under the same lock), or say why not."""
        from autotune.study.storage import DEFAULT_STORAGE

        with proposal_lock(self.storage or DEFAULT_STORAGE, self.study.study_name):
            recover_lost(self.study, self.progress)  # trials of workers that died since
            records = records_of(self.study)
            outlook = self.proposer.outlook(records)
            if measured(records):
                self.progress.standing(text=outlook.describe())  # how sure the best so far is
            # Patience caps a search only once no evidence is owed (see Proposer.owed_values).
            owed = bool(outlook.owed) and patience_spent(records, self.patience)
            reason = self._why_stop(records, outlook, owed)
            config = None if reason else self.proposer.next_config(records, unmeasured_only=owed)
            if config is not None and self.clock.out_of_time():  # the estimates on the way spent the time
                reason, config = self.clock.search_over(outlook), None
            if owed and config is None:
                reason = stop_reason(records, target=self.target, patience=self.patience, timeout_s=None, elapsed_s=0.0)
            record_ruled_out(self.study, self.proposer, self.oracle, records, self.progress)
            if reason is None and config is None:
                reason = "every config of the space is measured, being measured or implied to run out of memory"
            if reason is not None:
                timed_out = self._timed_out() or self.clock.search_over(outlook) is not None
                patience = None if owed else self.patience
                waiting = waits_on_others(records, target=self.target, patience=patience, timed_out=timed_out)
                return _Step(records=records, reason=reason, waiting=waiting)
            assert config is not None  # no reason: a config is left
            trial, config = ask(self.study, self.proposer, config)
            return _Step(records=records, trial=trial, config=config)

    def _why_stop(self, records: list[TrialRecord], outlook: Outlook, owed: bool) -> str | None:
        return (
            stop_reason(
                records,
                target=self.target,
                patience=None if owed else self.patience,
                timeout_s=self.timeout_s,
                elapsed_s=time.monotonic() - self.started,
            )
            or self.clock.search_over(outlook)
            or (settled_reason(outlook) if self.stop_on_evidence else None)
        )

    def _timed_out(self) -> bool:
        return self.timeout_s is not None and time.monotonic() - self.started >= self.timeout_s

    # -- one trial --------------------------------------------------------------------------------
    def _measure(self, trial: optuna.Trial, config: TrialConfig, records: list[TrialRecord], measure: Measure) -> bool:
        """Measure a trial taken for ``config`` (True), or record it as skipped where its estimate is well over the
        limit (False)."""
        # The trial beats from its start: a worker that dies while estimating is found out too.
        with heartbeat(self.study, trial):
            prediction = self.oracle.estimate(config, records) if self.oracle else None
            if prediction is not None and skip_if_too_big(self.study, trial, prediction, self.progress):
                return False
            record = self._start_and_measure(trial, config, records, measure, prediction)
        self._report_finished(record)
        return True

    def _start_and_measure(
        self,
        trial: optuna.Trial,
        config: TrialConfig,
        records: list[TrialRecord],
        measure: Measure,
        prediction: MemoryEstimate | None,
    ) -> TrialRecord:
        """Measure a trial taken for ``config``, marked as the retry of a lost trial of it (another worker's, or
        this study's before a restart) where there is one."""
        retried = retry_of(records, config)
        if retried is not None:
            trial.set_user_attr(RETRY_ATTR, retried)
        self.progress.trial_started(
            index=len(measured(records)) + 1, target=self.target, config=config, retry=retried is not None
        )
        measure = dataclasses.replace(measure, outpaced_step_s=outpaced_step_s(records, self.workload))
        with self.clock.timing():
            return measure_in_study(self.study, trial, config, self.workload, measure, prediction, self.backend)

    def _report_finished(self, record: TrialRecord) -> None:
        records = records_of(self.study)
        held = held_answer(records, self.study.user_attrs.get(SIMPLE_KEY))
        top = max(ranking(records), key=lambda r: r.throughput or 0.0, default=None)
        leading = top if top is not None and held is not None and top.number != held.number else None
        self.progress.trial_finished(record=record, best=held, elapsed_s=self.clock.elapsed(), leading=leading)

    # -- the answer -------------------------------------------------------------------------------
    def confirm(self) -> None:
        """Re-run the contenders, interleaved, until a decided answer fits (:mod:`autotune.search.confirming`)."""
        confirm_winner(self.study, self.proposer, self.workload, self.measure, self.progress, self.backend, self.clock)


@dataclass(frozen=True, kw_only=True)
class _Step:
    """What the search loop does next: measure ``trial`` (``config``), watch other workers, or stop (``reason``)."""

    records: list[TrialRecord]
    trial: optuna.Trial | None = None
    config: TrialConfig | None = None
    reason: str | None = None
    waiting: bool = False
