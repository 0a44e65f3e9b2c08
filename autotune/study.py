"""Reading a study back: Optuna trials -> TrialRecords, the ranking of candidates, the best.

Only a confirmed config is ever called best: a winner candidate is re-run longer by the tuner,
and ranks by the re-run's figure from then on.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from autotune.knobs import TrialConfig
from autotune.storage import META_KEY, display_url
from autotune.summary import StudySummary, TrialRecord
from autotune.workload import Workload

if TYPE_CHECKING:
    import optuna

__all__ = ["load_summary", "summarize", "records_of", "ranking", "CONFIRM_PREFIX"]

CONFIRM_PREFIX = "confirm:"      # study user attribute per re-run winner candidate: confirm:<number>
_MEASURED = ("ok", "oom", "timeout", "crashed", "nan", "error")


def load_summary(*, study: str, storage: str | None = None, with_importances: bool = False) -> StudySummary:
    """Read study ``study`` from ``storage`` (default ``sqlite:///storage/autotune.db``)."""
    from autotune.storage import load_study, open_storage

    return summarize(load_study(open_storage(storage), study, storage), url=storage,
                     with_importances=with_importances)


def summarize(study: optuna.Study, *, url: str | None, with_importances: bool = False) -> StudySummary:
    meta = study.user_attrs[META_KEY]
    records = records_of(study)
    ranked = ranking(records)
    best = next((r for r in ranked if r.confirmed), None)
    return StudySummary(
        name=study.study_name,
        storage=display_url(url),
        workload=Workload.from_dict(meta["workload"]),
        space=meta["space"]["name"],
        device=meta["device"],
        memory_budget_bytes=meta["memory_budget_bytes"],
        memory_limit_bytes=memory_limit(meta),
        trials=records,
        best=best,
        importances=_importances(study) if with_importances else None,
    )


def memory_limit(meta: dict[str, Any]) -> int:
    """A config fits when its peak stays under the budget minus the headroom."""
    return int(meta["memory_budget_bytes"] * (1 - meta["headroom"]))


def records_of(study: optuna.Study) -> list[TrialRecord]:
    from optuna.trial import TrialState

    meta = study.user_attrs[META_KEY]
    limit = memory_limit(meta)
    confirmations = {int(k.removeprefix(CONFIRM_PREFIX)): v for k, v in study.user_attrs.items()
                     if k.startswith(CONFIRM_PREFIX)}
    records = []
    for trial in study.get_trials(deepcopy=False):
        config_data = trial.user_attrs.get("config")
        if config_data is None:
            continue  # asked but never given a config (the worker died inside Optuna)
        result = trial.user_attrs.get("result") or {}
        if trial.state is TrialState.RUNNING:
            status = "running"
        else:
            status = trial.user_attrs.get("status", "interrupted")
        peak = result.get("peak_memory_bytes")
        confirm = confirmations.get(trial.number)
        records.append(TrialRecord(
            number=trial.number,
            config=TrialConfig.from_dict(config_data),
            status=status,
            tokens_per_s=result.get("tokens_per_s"),
            samples_per_s=result.get("samples_per_s"),
            peak_memory_bytes=peak,
            fits=status == "ok" and peak is not None and peak <= limit,
            duration_s=(trial.datetime_complete - trial.datetime_start).total_seconds()
            if trial.datetime_complete and trial.datetime_start else None,
            error=result.get("error") or trial.user_attrs.get("reason"),
            predicted_peak_bytes=(trial.user_attrs.get("estimate") or {}).get("predicted_peak_bytes"),
            confirmed=None if confirm is None else confirm["confirmed"],
            confirmed_tokens_per_s=None if confirm is None else confirm.get("tokens_per_s"),
            confirmed_samples_per_s=None if confirm is None else confirm.get("samples_per_s"),
            confirmed_peak_memory_bytes=None if confirm is None else confirm.get("peak_memory_bytes"),
        ))
    return records


def ranking(records: list[TrialRecord]) -> list[TrialRecord]:
    """Winner candidates, fastest first: configs that fit and were not refuted by a re-run.

    They rank by their first figures, like with like: every trial measured the same number of
    steps, while a re-run measures more, and on a busy machine a longer run reads lower. The
    re-run's job is to refute (see the tuner's ``CONFIRM_TOLERANCE``); its figure is reported.
    """
    candidates = [r for r in records if r.fits and r.confirmed is not False]
    return sorted(candidates, key=lambda r: r.tokens_per_s or 0.0, reverse=True)


def measured(records: list[TrialRecord]) -> list[TrialRecord]:
    return [r for r in records if r.status in _MEASURED]


def _importances(study: optuna.Study) -> dict[str, float] | None:
    """Share of the tokens/s variance each knob explains (Optuna's fANOVA); None with too few trials."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 4:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError):  # e.g. every complete trial has the same knobs
        return None
    return {name: float(value) for name, value in values.items()} or None
