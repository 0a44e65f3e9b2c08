"""What autotune does past Optuna's public API (autotune/study/optuna_private.py), on the real storages: an
earlier answer's constraint turned infeasible on a finished trial, in SQLite; left as it was on a journal."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.records import ANSWER_ATTR, ANSWER_CONSTRAINT, retire_answers
from autotune.study.storage import open_storage


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # trials asked by hand, as a worker asks them
@pytest.mark.parametrize("scheme", ["sqlite", "journal"])
def test_retire_answers_makes_earlier_answers_infeasible_where_the_storage_allows(tmp_path, scheme):
    url = f"sqlite:///{tmp_path}/s.db" if scheme == "sqlite" else f"journal://{tmp_path}/s.log"
    study = optuna.create_study(storage=open_storage(url), study_name="answers", direction="maximize")
    for number, answer in ((0, False), (1, True)):
        trial = study.ask()
        if answer:
            trial.set_user_attr(ANSWER_ATTR, 0)
        trial.set_constraint(ANSWER_CONSTRAINT, 0.0 if answer else 1.0)
        study.tell(trial, 100.0 + number, state=TrialState.COMPLETE)
    retire_answers(study)
    again = {t.number: t for t in optuna.load_study(study_name="answers", storage=open_storage(url)).trials}
    assert again[0].constraints[ANSWER_CONSTRAINT] == 1.0  # not an answer: untouched
    assert again[1].constraints[ANSWER_CONSTRAINT] == (1.0 if scheme == "sqlite" else 0.0)
    assert again[1].state is TrialState.COMPLETE and again[1].value == 101.0
