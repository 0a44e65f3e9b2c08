"""What autotune needs from Optuna and Optuna offers no public API for: one function per need, each
saying why. Everywhere else autotune goes through Optuna's public API (``Study``, ``Trial``,
``FrozenTrial``, ``BaseStorage``'s and ``RDBStorage``'s documented methods); nothing outside this module
reads ``Study._storage``, ``Trial._trial_id`` or ``optuna.storages._rdb``, nor writes SQL into Optuna's
tables (``tests/test_layout.py`` checks it). ``sqlite_reader`` reads Optuna's SQLite tables on its own,
read-only and only at the schema version it knows.

Checked against the Optuna releases ``pyproject.toml`` allows (``optuna>=5.0``: autotune's trials call
``Trial.set_constraint``, new in 5.0): run against 5.0.0. ``Study._storage``,
``BaseHeartbeat._get_stale_trial_ids``, ``_CachedStorage._backend``, ``RDBStorage.scoped_session`` and
``optuna.storages._rdb.models.TrialSystemAttributeModel`` are older than 4.0; the ``constraints:<name>``
key is what 5.0's ``Trial.set_constraint`` writes, which autotune's trials call. When Optuna changes one
of them, only this module follows it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna

__all__ = ["storage_of", "stale_trial_ids", "set_finished_trials_constraint"]


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The storage ``study`` reads and writes through (for an RDB, Optuna's caching wrapper of it).

    ``Study`` keeps it in ``_storage`` and has no public accessor; Optuna's own public
    ``optuna.storages.fail_stale_trials(study)`` reads it the same way. autotune needs it for what
    ``Study`` has no method for: a running trial's heartbeat (``RDBStorage.record_heartbeat``), a user
    attribute on another worker's trial known by its number (``BaseStorage.set_trial_user_attr``), and a
    trial's id from its number (``BaseStorage.get_trial_id_from_study_id_trial_number``), which those
    methods take.
    """
    return study._storage


def stale_trial_ids(storage: optuna.storages.BaseStorage, study_id: int) -> list[int]:
    """Ids of the study's RUNNING trials whose heartbeat in Optuna's heartbeat table is older than the
    storage's grace period, by the database server's clock; ``storage`` has heartbeats (an RDB one).

    Optuna's one public use of this query is ``optuna.storages.fail_stale_trials``, which fails those
    trials at once. autotune must first record why each was lost (``status`` and ``lost`` user
    attributes, which a finished trial no longer takes) and whose it was, so it asks the query itself:
    ``BaseHeartbeat._get_stale_trial_ids``, which ``RDBStorage`` and its caching wrapper implement.
    """
    return list(storage._get_stale_trial_ids(study_id))  # type: ignore[attr-defined]


def set_finished_trials_constraint(
    storage: optuna.storages.BaseStorage, trial_ids: Iterable[int], name: str, value: float
) -> bool:
    """Set the constraint ``name`` (set on them already, by ``Trial.set_constraint``) of finished trials to
    ``value`` in an RDB storage's own table; False, writing nothing, where the storage is not an RDB one
    (the journal).

    Optuna refuses to change a finished trial through any of its APIs (``UpdateFinishedTrialError``), and
    autotune needs it once: a new answer makes the earlier answer trials infeasible (their ``answer``
    constraint). Optuna keeps a constraint as the trial system attribute ``constraints:<name>``
    (``optuna.study._constrained_optimization``), so this updates ``trial_system_attributes`` through
    Optuna's own SQLAlchemy model, on any database ``RDBStorage`` runs on. Optuna's trial cache in this
    process does not see the change: read the constraint from a freshly loaded study.
    """
    import json

    from optuna.storages._rdb import models

    backend = getattr(storage, "_backend", storage)  # under Optuna's _CachedStorage, the RDBStorage itself
    ids = list(trial_ids)
    if not hasattr(backend, "scoped_session"):
        return False
    if not ids:
        return True
    session = backend.scoped_session()
    try:
        session.query(models.TrialSystemAttributeModel).filter(
            models.TrialSystemAttributeModel.trial_id.in_(ids),
            models.TrialSystemAttributeModel.key == f"constraints:{name}",
        ).update({"value_json": json.dumps(value)}, synchronize_session=False)
        session.commit()
    finally:
        session.close()
    return True
