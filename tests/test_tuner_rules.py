"""The driver's rules without running trials: when to stop, what ranks first, what is best."""

from __future__ import annotations

import pytest

from autotune.knobs import TrialConfig
from autotune.study import ranking
from autotune.summary import TrialRecord
from autotune.tuner import _stop_reason, tune


def _ok(number: int, micro_batch: int, tokens: float, *, fits: bool = True, **confirm) -> TrialRecord:
    return TrialRecord(number=number, config=TrialConfig(micro_batch=micro_batch), status="ok",
                       tokens_per_s=tokens, fits=fits, **confirm)


def _failed(number: int, status: str, error: str = "boom") -> TrialRecord:
    return TrialRecord(number=number, config=TrialConfig(micro_batch=number + 1), status=status, error=error)


def test_stop_on_trial_count_counting_only_measured_trials():
    records = [_ok(0, 1, 10), TrialRecord(number=1, config=TrialConfig(micro_batch=2), status="interrupted"),
               _ok(2, 4, 20)]
    assert _stop_reason(records, target=3, patience=None, timeout_s=None, elapsed_s=0) is None
    assert "2 trials measured (--n-trials 2)" in _stop_reason(records, target=2, patience=None, timeout_s=None,
                                                             elapsed_s=0)


def test_stop_on_time():
    assert _stop_reason([], target=5, patience=None, timeout_s=60, elapsed_s=59) is None
    assert _stop_reason([], target=5, patience=None, timeout_s=60, elapsed_s=60) == "--timeout 60 s reached"


def test_stop_on_patience_counts_trials_since_the_last_faster_fit():
    records = [_ok(0, 1, 10), _ok(1, 2, 30), _failed(2, "oom"), _ok(3, 4, 50, fits=False), _ok(4, 8, 20)]
    # Since the best fit (trial 1): an OOM, one over the limit (faster but does not fit), a slower one.
    assert _stop_reason(records, target=99, patience=4, timeout_s=None, elapsed_s=0) is None
    assert "in the last 3 trials (--patience 3)" in _stop_reason(records, target=99, patience=3, timeout_s=None,
                                                                 elapsed_s=0)


def test_stop_when_every_trial_fails_with_the_same_workload_error():
    one = [_failed(0, "error", "Traceback\nValueError: factory exploded")]
    assert _stop_reason(one, target=9, patience=None, timeout_s=None, elapsed_s=0) is None
    two = one + [_failed(1, "crashed", "trial process killed by SIGSEGV")]
    reason = _stop_reason(two, target=9, patience=None, timeout_s=None, elapsed_s=0)
    assert "every trial so far ended in crashed (trial process killed by SIGSEGV)" in reason
    # An OOM says something about the config, not the workload: keep searching.
    assert _stop_reason(one + [_failed(1, "oom")], target=9, patience=None, timeout_s=None, elapsed_s=0) is None


def test_ranking_compares_first_figures_and_drops_refuted_configs():
    # A re-run measures 3x the steps and reads lower on a busy machine: first figures rank, alike.
    confirmed = _ok(0, 16, 100, confirmed=True, confirmed_tokens_per_s=85)
    steady = _ok(1, 8, 90)
    refuted = _ok(2, 4, 120, confirmed=False)
    too_big = _ok(3, 2, 150, fits=False)
    assert [r.number for r in ranking([confirmed, steady, refuted, too_big])] == [0, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"n_trials": 0}, "--n-trials 0 must be a number of at least 1"),
    ({"timeout_s": 0}, "--timeout 0 must be a number of at least 1"),
    ({"trial_timeout_s": -1}, "--trial-timeout -1"),
    ({"patience": 0}, "--patience 0"),
    ({"headroom": 0.95}, "--headroom 0.95 must be a fraction from 0 to 0.9"),
    ({"measure_steps": 0}, "--steps 0"),
])
def test_bad_numbers_are_refused_before_anything_starts(tmp_path, kwargs, message):
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tune(study="s", storage=f"sqlite:///{tmp_path}/db.sqlite", **kwargs)
    assert not (tmp_path / "db.sqlite").exists()  # nothing half-written


class ScriptedBackend:
    """Trials answered from a table: first figures, and the longer re-run's figures."""

    def __init__(self, first: dict[int, float], rerun: dict[int, float]) -> None:
        self.first, self.rerun, self.runs = first, rerun, []

    def run(self, workload, config, *, measure_steps, **_):
        from autotune.result import TrialResult, TrialStatus

        confirming = measure_steps > 3
        self.runs.append((config.micro_batch, confirming))
        tokens = (self.rerun if confirming else self.first)[config.micro_batch]
        return TrialResult(config=config, status=TrialStatus.OK, tokens_per_s=tokens, peak_memory_bytes=2**20,
                           measured_steps=measure_steps)

    def estimate(self, workload, config):
        return None


@pytest.mark.parametrize("rerun_of_4, best", [
    (60.0, 2),   # 40% below its first figure and below the runner-up's 90: fast by luck, mb=2 goes on
    (70.0, 2),   # 30% below, below 90: refuted too (mb=2's re-run, 75, is 17% below its 90: within tolerance)
    (95.0, 4),   # lower than its first figure, still faster than the runner-up: confirmed
])
def test_a_re_run_refutes_only_a_candidate_that_was_fast_by_luck(tmp_path, rerun_of_4, best):
    from autotune.space import load_space
    from autotune.workload import Workload

    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2, 4]\n  precision: [fp32]\n"
                                         "  checkpointing: [false]\n")
    backend = ScriptedBackend(first={1: 50.0, 2: 90.0, 4: 100.0}, rerun={1: 50.0, 2: 75.0, 4: rerun_of_4})
    summary = tune(study="s", workload=Workload(model="builtin:gpt2-tiny"), space=load_space(tmp_path / "space.yaml"),
                   memory_budget_bytes=2**30, storage=f"sqlite:///{tmp_path}/db.sqlite", estimate=False,
                   backend=backend)
    assert summary.best is not None and summary.best.config.micro_batch == best
    assert [size for size, confirming in backend.runs if confirming] == ([4] if best == 4 else [4, 2])
