"""One trial in the study: taking it (:func:`ask`), keeping it alive (:class:`heartbeat`), measuring it and
telling the study what happened (:func:`measure_in_study`), or recording it as skipped on its estimate; and the
estimator's predictions the search asks for (:class:`Oracle`)."""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

from autotune.errors import AutotuneError
from autotune.search.interrupt import measuring
from autotune.search.measuring import Measure, run_undisturbed
from autotune.study.records import ANSWER_CONSTRAINT, memory_limit, records_of
from autotune.study.stale import record_heartbeat, recover_stale_trials
from autotune.trial.result import TrialResult, TrialStatus

if TYPE_CHECKING:
    import optuna

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.search.backends import TrialBackend
    from autotune.search.progress import Progress
    from autotune.search.proposer import Proposer
    from autotune.study.summary import TrialRecord

__all__ = [
    "SKIP_MARGIN",
    "Oracle",
    "ask",
    "heartbeat",
    "measure_in_study",
    "record_ruled_out",
    "recover_lost",
    "retry_of",
    "skip_if_too_big",
]

SKIP_MARGIN = 0.05  # skip a config predicted more than 5% over the limit; closer ones still run


def ask(study: optuna.Study, proposer: Proposer, config: TrialConfig) -> tuple[optuna.Trial, TrialConfig]:
    """A new trial of the study holding ``config`` (enqueued, so the sampler is not consulted),
    and the config it really holds."""
    from autotune.study.stale import worker_id

    # Who runs it is stored with the trial as it is made: a worker killed the moment after study.ask() left
    # a RUNNING trial naming no worker, which no recovery could tell was lost (until its heartbeat aged).
    study.enqueue_trial(proposer.params_of(config), user_attrs={"worker": worker_id(), "config": config.to_dict()})
    with warnings.catch_warnings():
        # Optuna warns that heartbeats are meant for Study.optimize; heartbeat records them here.
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        trial = study.ask()
    record_heartbeat(study, trial.number)  # a trial without one is never stale on an RDB storage
    config = proposer.suggest(trial)  # the enqueued params (another worker may have taken ours)
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("worker", worker_id())
    return trial, config


class heartbeat:
    """Record heartbeats while a trial runs, so other workers can tell it is alive (:mod:`autotune.study.stale`)."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        from autotune.study.stale import heartbeat_s

        self._study = study
        self._number = trial.number
        self._stop = threading.Event()
        self._interval = heartbeat_s()
        self._thread = threading.Thread(target=self._beat, name="autotune-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                record_heartbeat(self._study, self._number)
            except Exception:  # a missed beat is not worth failing the trial for
                pass

    def __enter__(self) -> heartbeat:
        record_heartbeat(self._study, self._number)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure_in_study(
    study: optuna.Study,
    trial: optuna.Trial,
    config: TrialConfig,
    workload: Workload,
    measure: Measure,
    prediction: MemoryEstimate | None,
    backend: TrialBackend,
) -> TrialRecord:
    from optuna.trial import TrialState

    if prediction is not None:
        trial.set_user_attr("estimate", prediction.to_dict())  # predicted next to measured, for show
    try:
        with measuring():
            result = run_undisturbed(backend, workload, config, measure, trial)
    except KeyboardInterrupt:
        trial.set_user_attr("status", "interrupted")
        study.tell(trial, state=TrialState.FAIL)
        raise
    except AutotuneError as exc:  # refused before it started (the space let through what cannot run)
        result = TrialResult(config=config, status=TrialStatus.ERROR, error=str(exc))
    limit = memory_limit(study.user_attrs["autotune"])
    trial.set_user_attr("status", result.status.value)
    trial.set_user_attr("result", _stored(result))
    peak = result.peak_memory_bytes
    if result.ok:
        trial.set_constraint("memory", (peak / limit - 1) if peak is not None else 0.0)
        trial.set_constraint(ANSWER_CONSTRAINT, 1.0)  # a measurement; only a confirmed answer is feasible
        study.tell(trial, result.throughput)
    elif result.status in (TrialStatus.OOM, TrialStatus.TIMEOUT):
        if result.status is TrialStatus.OOM:
            trial.set_constraint("memory", max(peak or 0, measure.memory_budget_bytes) / limit - 1)
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)
    return next(r for r in records_of(study) if r.number == trial.number)


def _stored(result: TrialResult) -> dict[str, Any]:
    data = result.to_dict()
    del data["config"]  # stored once, as the trial's "config"
    return data


def skip_if_too_big(study: optuna.Study, trial: optuna.Trial, prediction: MemoryEstimate, progress: Progress) -> bool:
    """Record a config predicted well over the limit as skipped, unrun; borderline ones still run."""
    from optuna.trial import TrialState

    if not _too_big(study, prediction):
        return False
    limit = memory_limit(study.user_attrs["autotune"])
    trial.set_user_attr("status", "skipped")
    trial.set_user_attr("estimate", prediction.to_dict())
    trial.set_user_attr(
        "reason",
        f"not run: predicted peak {prediction.predicted_peak_bytes} B is more than "
        f"{SKIP_MARGIN:.0%} over the memory limit {limit} B",
    )
    trial.set_constraint("memory", prediction.predicted_peak_bytes / limit - 1)
    study.tell(trial, state=TrialState.PRUNED)  # the sampler learns from it as from an OOM
    record = next(r for r in records_of(study) if r.number == trial.number)
    progress.skipped(record=record, limit_bytes=limit)
    return True


def _too_big(study: optuna.Study, prediction: MemoryEstimate) -> bool:
    return prediction.predicted_peak_bytes > memory_limit(study.user_attrs["autotune"]) * (1 + SKIP_MARGIN)


def record_ruled_out(
    study: optuna.Study, proposer: Proposer, oracle: Oracle | None, records: list[TrialRecord], progress: Progress
) -> None:
    """Record the configs the proposer's estimates put over the limit as skipped trials, so the
    study shows why they never ran (and a resumed or parallel search does not estimate them again)."""
    known = {r.config for r in records}
    for config in proposer.take_ruled_out():
        prediction = oracle.estimate(config, records) if oracle else None
        if config in known or prediction is None or not _too_big(study, prediction):
            continue  # within the margin: it stays a candidate, never a trial asked for and left open
        known.add(config)
        trial, config = ask(study, proposer, config)
        skip_if_too_big(study, trial, prediction, progress)


class Oracle:
    """The estimator's predictions, each asked once per tune call: the proposer bisects with them,
    and a trial stores its config's next to what it measured."""

    def __init__(self, backend: TrialBackend, workload: Workload) -> None:
        self._backend = backend
        self._workload = workload
        self._cache: dict[TrialConfig, MemoryEstimate | None] = {}

    def estimate(self, config: TrialConfig, records: list[TrialRecord]) -> MemoryEstimate | None:
        """The prediction for a trial, unless a larger micro batch with the same knobs already fit."""
        from autotune.search.memory_bounds import implied_fits

        if config not in self._cache and implied_fits(config, [r.config for r in records if r.fits]):
            return None
        return self.lookup(config)

    def lookup(self, config: TrialConfig) -> MemoryEstimate | None:
        if config not in self._cache:
            self._cache[config] = self._backend.estimate(self._workload, config)
        return self._cache[config]

    def prefetch(self, configs: list[TrialConfig]) -> None:
        """Estimate ``configs`` together, where the backend traces several at once
        (:class:`autotune.search.backends.EstimatesTogether`): :meth:`lookup` then finds them."""
        from autotune.search.backends import EstimatesTogether

        missing = [c for c in dict.fromkeys(configs) if c not in self._cache]
        if len(missing) > 1 and isinstance(self._backend, EstimatesTogether):
            self._cache.update(self._backend.estimate_all(self._workload, missing))


def recover_lost(study: optuna.Study, progress: Progress) -> None:
    """Fail the trials of workers that died since (see :mod:`autotune.study.stale`), and say so."""
    lost = recover_stale_trials(study)
    if lost:
        progress.lost(numbers=lost)


def retry_of(records: list[TrialRecord], config: TrialConfig) -> int | None:
    """The interrupted trial of ``config`` that a trial of it now measures again (the latest), if any."""
    retried = {r.retry_of for r in records if r.retry_of is not None}
    return max(
        (r.number for r in records if r.status == "interrupted" and r.config == config and r.number not in retried),
        default=None,
    )
