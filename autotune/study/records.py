"""Reading a study back: Optuna trials -> TrialRecords, the ranking of candidates, the best.

Only a confirmed config is ever called best: the tuner re-runs the top candidates longer,
interleaved (A B A B), and stores the order those paired runs decided (``DECISION_KEY``); the
candidates rank in that order from then on, ahead of any measured since.

The stored study agrees with that answer for anyone reading it with Optuna (``best_trial``,
optuna-dashboard): every measured trial carries an ``answer`` constraint of 1 (infeasible), and
the answer is one more trial (``ANSWER_ATTR``: the trial it confirms) with the answer's config,
its confirmed tokens/s as value and an ``answer`` constraint of 0.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.study.sqlite_reader import StoredStudy, read_study_file
from autotune.study.stale import LOST_ATTR, RETRY_ATTR, worker_jobs
from autotune.study.storage import (
    DEFAULT_STORAGE,
    META_KEY,
    display_url,
    no_such_study,
    not_autotune,
)
from autotune.study.stored_facts import FACTS_KEY, remember
from autotune.study.summary import StudySummary, TrialRecord
from autotune.trial.result import TOKENS_PER_S

if TYPE_CHECKING:
    import optuna

__all__ = [
    "load_summary",
    "load_summaries",
    "summarize",
    "records_of",
    "ranking",
    "retire_answers",
    "CONFIRM_PREFIX",
    "DECISION_KEY",
    "ANSWER_ATTR",
    "ANSWER_CONSTRAINT",
]

CONFIRM_PREFIX = "confirm:"  # study user attribute per re-run winner candidate: confirm:<number>
DECISION_KEY = "decision"  # study user attribute: the interleaved confirmation's order and lead
STOP_KEY = "stopped"  # study user attribute: why the last search ended, and what it left untried
SIMPLE_KEY = "simple_answer"  # study user attribute: the simple answer's trial number (None: none fits)
ANSWER_ATTR = "answer_for"  # trial user attribute of the answer trial: the number it confirms
ANSWER_CONSTRAINT = "answer"  # Optuna constraint: 0 on the answer trial, 1 on every measured one
_MEASURED = ("ok", "oom", "timeout", "crashed", "nan", "error")


def load_summary(*, study: str, storage: str | None = None, with_importances: bool = False) -> StudySummary:
    """Read study ``study`` from ``storage`` (default ``sqlite:///storage/autotune.db``).

    A SQLite file of the schema :mod:`autotune.study.sqlite_reader` knows is read without Optuna (a
    command that only reads a study starts in a fraction of a second); anything else, and the
    importances (Optuna's fANOVA), through Optuna.
    """
    from autotune.study.storage import load_study, open_storage

    if not with_importances:
        read = read_study_file(storage or DEFAULT_STORAGE, only=study)
        if read is not None:
            if study not in read.studies:
                raise no_such_study(study, storage, read.names)
            if META_KEY not in read.studies[study].user_attrs:
                raise not_autotune(study)
            return summarize(read.studies[study], url=storage)
    return summarize(load_study(open_storage(storage), study, storage), url=storage, with_importances=with_importances)


def load_summaries(storage: str | None = None) -> list[StudySummary]:
    """Every autotune study in ``storage``, by name (studies other tools keep there are left out)."""
    read = read_study_file(storage or DEFAULT_STORAGE)
    if read is not None:
        return [
            summarize(read.studies[name], url=storage)
            for name in read.names
            if META_KEY in read.studies[name].user_attrs
        ]
    from autotune.errors import StorageError
    from autotune.study.storage import load_study, open_storage, study_names

    backend = open_storage(storage)
    summaries = []
    for name in study_names(backend):
        try:
            summaries.append(summarize(load_study(backend, name, storage), url=storage))
        except StorageError:
            pass  # a study some other tool keeps in the same database
    return summaries


def summarize(study: optuna.Study | StoredStudy, *, url: str | None, with_importances: bool = False) -> StudySummary:
    """A study (Optuna's, or as :mod:`autotune.study.sqlite_reader` read it) as plain values."""
    meta = study.user_attrs[META_KEY]
    records = records_of(study)
    ranked = ranking(records)
    best = next((r for r in ranked if r.confirmed), None)
    decision = study.user_attrs.get(DECISION_KEY) or {}
    certainty = (
        decision.get("certainty") if best is not None and decision.get("order", [None])[0] == best.number else None
    )
    workload = Workload.from_dict(meta["workload"])
    remember(workload, study.user_attrs.get(FACTS_KEY))  # what the tuner stored: show and export need no torch
    return StudySummary(
        name=study.study_name,
        storage=display_url(url),
        workload=workload,
        space=meta["space"]["name"],
        device=meta["device"],
        memory_budget_bytes=meta["memory_budget_bytes"],
        memory_limit_bytes=memory_limit(meta),
        trials=records,
        best=best,
        importances=_importances(study) if with_importances else None,
        certainty=certainty,
        command=meta.get("command"),
        stopped=study.user_attrs.get(STOP_KEY),
        worker_jobs=worker_jobs(study.user_attrs),
        simple_answer=next((r for r in records if r.number == study.user_attrs.get(SIMPLE_KEY)), None),
    )


def memory_limit(meta: dict[str, Any]) -> int:
    """A config fits when its peak stays under the budget minus the headroom."""
    return int(meta["memory_budget_bytes"] * (1 - meta["headroom"]))


def records_of(study: optuna.Study | StoredStudy) -> list[TrialRecord]:
    meta = study.user_attrs[META_KEY]
    limit = memory_limit(meta)
    confirmations = {
        int(k.removeprefix(CONFIRM_PREFIX)): v for k, v in study.user_attrs.items() if k.startswith(CONFIRM_PREFIX)
    }
    order = (study.user_attrs.get(DECISION_KEY) or {}).get("order", [])
    records = []
    for trial in study.get_trials(deepcopy=False):
        config_data = trial.user_attrs.get("config")
        if config_data is None or ANSWER_ATTR in trial.user_attrs:
            continue  # asked but never given a config (the worker died inside Optuna), or the answer's copy
        result = trial.user_attrs.get("result") or {}
        if getattr(trial.state, "name", trial.state) == "RUNNING":  # Optuna's TrialState, or its name
            status = "running"
        else:
            status = trial.user_attrs.get("status", "interrupted")
        peak = result.get("peak_memory_bytes")
        confirm = confirmations.get(trial.number)
        records.append(
            TrialRecord(
                number=trial.number,
                config=TrialConfig.from_dict(config_data),
                status=status,
                tokens_per_s=result.get("tokens_per_s"),
                samples_per_s=result.get("samples_per_s"),
                throughput_unit=result.get("throughput_unit") or TOKENS_PER_S,
                peak_memory_bytes=peak,
                fits=status == "ok" and peak is not None and peak <= limit,
                duration_s=(trial.datetime_complete - trial.datetime_start).total_seconds()
                if trial.datetime_complete and trial.datetime_start
                else None,
                error=result.get("error") or trial.user_attrs.get("reason"),
                predicted_peak_bytes=(trial.user_attrs.get("estimate") or {}).get("predicted_peak_bytes"),
                confirmed=None if confirm is None else confirm["confirmed"],
                confirmed_tokens_per_s=None if confirm is None else confirm.get("tokens_per_s"),
                confirmed_samples_per_s=None if confirm is None else confirm.get("samples_per_s"),
                confirmed_peak_memory_bytes=None if confirm is None else confirm.get("peak_memory_bytes"),
                decided_rank=order.index(trial.number) if trial.number in order else None,
                step_time_spread=result.get("step_time_spread"),
                outpaced=bool(result.get("outpaced")),
                lost=trial.user_attrs.get(LOST_ATTR),
                retry_of=trial.user_attrs.get(RETRY_ATTR),
            )
        )
    return records


def ranking(records: list[TrialRecord]) -> list[TrialRecord]:
    """Winner candidates, fastest first: configs that fit and whose re-run did not refute that.

    The ones the interleaved confirmation compared come first, in the order it decided (paired
    runs under the same conditions); the others follow by their first figures, like with like
    (every trial measured the same way; a re-run on a busy machine reads lower).
    """
    candidates = [r for r in records if r.fits and r.confirmed is not False]
    return sorted(candidates, key=lambda r: (r.decided_rank is None, r.decided_rank or 0, -(r.throughput or 0.0)))


def retire_answers(study: optuna.Study) -> None:
    """Make earlier answer trials infeasible for Optuna: a new decision replaced them.

    A finished trial cannot be changed through Optuna's API, so this sets their ``answer``
    constraint in the storage's own table (any SQLAlchemy database Optuna's RDBStorage runs on; on the
    journal storage they stay as they were): see :mod:`autotune.study.optuna_private`.
    """
    from autotune.study.optuna_private import set_finished_trials_constraint, storage_of

    answers = [t.number for t in study.get_trials(deepcopy=False) if ANSWER_ATTR in t.user_attrs]
    if not answers:
        return
    storage = storage_of(study)
    study_id = storage.get_study_id_from_name(study.study_name)
    ids = [storage.get_trial_id_from_study_id_trial_number(study_id, number) for number in answers]
    set_finished_trials_constraint(storage, ids, ANSWER_CONSTRAINT, 1.0)


def measured(records: list[TrialRecord]) -> list[TrialRecord]:
    return [r for r in records if r.status in _MEASURED]


def _importances(study: optuna.Study | StoredStudy) -> dict[str, float] | None:
    """Share of the tokens/s variance each knob explains (Optuna's fANOVA); None with too few trials."""
    import optuna
    from optuna.trial import TrialState

    assert isinstance(study, optuna.Study), "load_summary reads importances through Optuna"

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
