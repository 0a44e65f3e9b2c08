"""The driver's rules without running trials: when to stop, what ranks first, what is best."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.search.stopping import stop_reason
from autotune.search.tuner import tune
from autotune.study.records import ranking
from autotune.study.summary import TrialRecord


def _ok(number: int, micro_batch: int, tokens: float, *, fits: bool = True, **confirm) -> TrialRecord:
    return TrialRecord(
        number=number,
        config=TrialConfig(micro_batch=micro_batch),
        status="ok",
        tokens_per_s=tokens,
        fits=fits,
        **confirm,
    )


def _failed(number: int, status: str, error: str = "boom") -> TrialRecord:
    return TrialRecord(number=number, config=TrialConfig(micro_batch=number + 1), status=status, error=error)


def test_stop_on_trial_count_counting_only_measured_trials():
    records = [
        _ok(0, 1, 10),
        TrialRecord(number=1, config=TrialConfig(micro_batch=2), status="interrupted"),
        _ok(2, 4, 20),
    ]
    assert stop_reason(records, target=3, patience=None, timeout_s=None, elapsed_s=0) is None
    assert "2 trials measured (--n-trials 2)" in stop_reason(
        records, target=2, patience=None, timeout_s=None, elapsed_s=0
    )


def test_stop_on_time():
    assert stop_reason([], target=5, patience=None, timeout_s=60, elapsed_s=59) is None
    assert stop_reason([], target=5, patience=None, timeout_s=60, elapsed_s=60) == "--timeout 60 s reached"


def test_stop_on_patience_counts_trials_since_the_last_faster_fit():
    records = [_ok(0, 1, 10), _ok(1, 2, 30), _failed(2, "oom"), _ok(3, 4, 50, fits=False), _ok(4, 8, 20)]
    # Since the best fit (trial 1): an OOM, one over the limit (faster but does not fit), a slower one.
    assert stop_reason(records, target=99, patience=4, timeout_s=None, elapsed_s=0) is None
    assert "in the last 3 trials (--patience 3)" in stop_reason(
        records, target=99, patience=3, timeout_s=None, elapsed_s=0
    )


def test_stop_when_every_trial_fails_with_the_same_workload_error():
    one = [_failed(0, "error", "Traceback\nValueError: factory exploded")]
    assert stop_reason(one, target=9, patience=None, timeout_s=None, elapsed_s=0) is None
    two = one + [_failed(1, "crashed", "trial process killed by SIGSEGV")]
    reason = stop_reason(two, target=9, patience=None, timeout_s=None, elapsed_s=0)
    assert "every trial so far ended in crashed (trial process killed by SIGSEGV)" in reason
    # An OOM says something about the config, not the workload: keep searching.
    assert stop_reason(one + [_failed(1, "oom")], target=9, patience=None, timeout_s=None, elapsed_s=0) is None


def test_ranking_compares_first_figures_and_drops_refuted_configs():
    # A re-run measures 3x the steps and reads lower on a busy machine: first figures rank, alike.
    confirmed = _ok(0, 16, 100, confirmed=True, confirmed_tokens_per_s=85)
    steady = _ok(1, 8, 90)
    refuted = _ok(2, 4, 120, confirmed=False)
    too_big = _ok(3, 2, 150, fits=False)
    assert [r.number for r in ranking([confirmed, steady, refuted, too_big])] == [0, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_trials": 0}, "--n-trials 0 must be a number of at least 1"),
        ({"timeout_s": 0}, "--timeout 0 must be a number of at least 1"),
        ({"trial_timeout_s": -1}, "--trial-timeout -1"),
        ({"patience": 0}, "--patience 0"),
        ({"headroom": 0.95}, "--headroom 0.95 must be a fraction from 0 to 0.9"),
        ({"measure_steps": 0}, "--steps 0"),
    ],
)
def test_bad_numbers_are_refused_before_anything_starts(tmp_path, kwargs, message):
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tune(study="s", storage=f"sqlite:///{tmp_path}/db.sqlite", **kwargs)
    assert not (tmp_path / "db.sqlite").exists()  # nothing half-written


class ScriptedBackend:
    """Trials answered from a table: first figures per micro batch, then each re-run's figure in turn
    (a list per micro batch: noisy conditions scripted run by run), or a status for a failing re-run."""

    def __init__(
        self,
        first: dict[int, float],
        reruns: dict[int, list],
        probe: dict | None = None,
        precision_factor: dict[str, float] | None = None,
    ) -> None:
        self.first, self.reruns, self.runs = first, {k: list(v) for k, v in reruns.items()}, []
        self.probed, self._probe, self._factor = [], probe, precision_factor or {}
        self.seen: set = set()  # configs run once: a config's next run is a confirming re-run
        self.steps: list[int] = []  # the steps each run measured
        self.warmups: list[int] = []  # and its warm-up steps

    def run(self, workload, config, *, measure_steps, warmup_steps=1, **_):
        from autotune.trial.result import TrialResult, TrialStatus

        confirming = config in self.seen
        self.seen.add(config)
        self.steps.append(measure_steps)
        self.warmups.append(warmup_steps)
        self.runs.append((config.micro_batch, confirming) if not self._factor else (config, confirming))
        tokens = self.reruns[config.micro_batch].pop(0) if confirming else self.first[config.micro_batch]
        if tokens == "oom":
            return TrialResult(config=config, status=TrialStatus.OOM, peak_memory_bytes=2**31)
        tokens *= self._factor.get(config.precision, 1.0)
        return TrialResult(
            config=config,
            status=TrialStatus.OK,
            tokens_per_s=tokens,
            peak_memory_bytes=2**20,
            measured_steps=measure_steps,
        )

    def estimate(self, workload, config):
        return None

    def probe(self, precisions):
        self.probed.append(precisions)
        return self._probe


def _tune(tmp_path, backend, knobs="  micro_batch: [1, 2, 4]\n  precision: [fp32]\n", **kwargs):
    from autotune.config.workload import Workload
    from autotune.search.presets import load_space

    (tmp_path / "space.yaml").write_text("knobs:\n" + knobs + "  checkpointing: [false]\n")
    return tune(
        study="s",
        workload=Workload(model="builtin:gpt2-tiny"),
        space=load_space(tmp_path / "space.yaml"),
        memory_budget_bytes=2**30,
        storage=f"sqlite:///{tmp_path}/db.sqlite",
        backend=backend,
        **{"estimate": False, **kwargs},
    )


def _confirming(backend):
    return [size for size, confirming in backend.runs if confirming]


def test_close_candidates_are_re_run_interleaved_and_ranked_by_paired_figures(tmp_path):
    # First figures: mb=4 100 (the simple answer: the ramp's largest), mb=2 97 (within the noise band: both
    # contend), mb=1 50 (not). The machine gets twice as busy for the second round; mb=2 is ahead of mb=4
    # in each round all the same (by 10% and 20%: neither lead decisive alone), so it replaces the simple answer.
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: [60.0, 30.0], 2: [66.0, 36.0]})
    summary = _tune(tmp_path, backend)
    assert _confirming(backend) == [4, 2, 4, 2]  # A B A B: each round under the same conditions
    # Every re-run measures as many steps as a trial: its figures pair with the others' of its round.
    assert backend.steps[-4:] == [3, 3, 3, 3]
    assert summary.best.config.micro_batch == 2
    assert "clearly faster than the runner-up mb=4 fp32" in summary.certainty
    assert "ahead in 2 of 2 rounds" in summary.certainty
    four = next(t for t in summary.trials if t.config.micro_batch == 4)
    assert four.confirmed is True and four.decided_rank == 1  # slower, still fits: demoted, not refuted


def test_a_lead_wider_than_one_configs_runs_ever_spread_is_proven_in_one_round(tmp_path):
    # mb=2 leads the simple answer (mb=4) by 30% in the first round: beyond the spread of one config's runs, so
    # the simple answer is out, and mb=2, alone, is not timed again.
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: [60.0, 60.0], 2: [78.0, 78.0]})
    summary = _tune(tmp_path, backend)
    assert _confirming(backend) == [4, 2]
    assert summary.best.config.micro_batch == 2
    assert "clearly faster than the runner-up mb=4 fp32" in summary.certainty
    assert "ahead in 1 of 1 rounds (+30%)" in summary.certainty
    # Two challengers both far ahead of it: the simple answer is out, and they race on between themselves.
    backend = ScriptedBackend(first={1: 96.0, 2: 97.0, 4: 100.0}, reruns={4: [60.0], 2: [78.0, 80.0], 1: [76.0, 70.0]})
    (tmp_path / "two").mkdir()
    summary = _tune(tmp_path / "two", backend)
    assert _confirming(backend) == [4, 2, 1, 2, 1]
    assert summary.best.config.micro_batch == 2


def test_a_machine_that_slows_down_between_rounds_does_not_flip_the_answer(tmp_path):
    # Round 2 reads half of round 1 for both: mb=4's round-2 figure (50) is below everything mb=2
    # ever read, yet paired with mb=2's (45) it is still ahead.
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: [100.0, 50.0], 2: [90.0, 45.0]})
    summary = _tune(tmp_path, backend)
    assert summary.best.config.micro_batch == 4


def test_a_slow_re_run_never_turns_a_config_that_fits_into_no_answer(tmp_path):
    # A busy machine: the only candidate re-runs at a tenth of its first figure. It still fits.
    backend = ScriptedBackend(first={1: 100.0}, reruns={1: [10.0]})
    summary = _tune(tmp_path, backend, knobs="  micro_batch: [1]\n  precision: [fp32]\n")
    assert summary.best is not None and summary.best.config.micro_batch == 1
    assert summary.best.confirmed_tokens_per_s == 10.0  # reported as re-measured, not hidden


def test_a_re_run_that_runs_out_of_memory_refutes_its_candidate(tmp_path):
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: ["oom"], 2: [80.0, 82.0]})
    summary = _tune(tmp_path, backend)
    # Refuted mb=4 is not timed again, and mb=2, left alone, has no one to be paired with: one round.
    assert _confirming(backend) == [4, 2]
    assert summary.best.config.micro_batch == 2
    four = next(t for t in summary.trials if t.config.micro_batch == 4)
    assert four.confirmed is False


def test_optuna_best_trial_names_the_answer_and_follows_a_new_decision(tmp_path):
    import optuna

    # Two trials, the ramp's: mb=2, then mb=4, the simple answer. mb=4 reads fastest first; mb=2, within the
    # noise band of it, beats it in every paired re-run: Optuna's best_trial must not name mb=4.
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: [60.0, 60.0], 2: [75.0, 70.0]})
    summary = _tune(tmp_path, backend, n_trials=2)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/db.sqlite")
    best = study.best_trial
    assert best.params["micro_batch"] == summary.best.config.micro_batch == 2
    assert best.value == summary.best.confirmed_tokens_per_s
    assert summary.n_trials == 2  # the answer's own trial is not a measurement
    # Resumed with one more trial: mb=1 reads fastest and beats the answer in every round: a new decision,
    # and best_trial follows.
    backend.first[1] = 120.0
    backend.reruns.update({1: [200.0, 200.0], 2: [70.0, 70.0], 4: [60.0, 60.0]})
    summary = _tune(tmp_path, backend, n_trials=3)
    assert summary.best.config.micro_batch == 1
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/db.sqlite")
    assert study.best_trial.params["micro_batch"] == 1


def test_patience_waits_until_every_precision_was_measured_once(tmp_path):
    # The probe says bf16 matmuls crawl here (0.1x), so the model ranks every bf16 config last;
    # yet bf16 trains 1.5x faster on this (scripted) device. Patience 1 would stop after the first
    # slower fp32 trial: a bf16 config is measured first, then the model follows it.
    backend = ScriptedBackend(
        first={1: 50.0, 2: 90.0, 4: 100.0},
        reruns={4: [150.0] * 8, 2: [135.0] * 8},
        probe={"fp32": 1.0, "bf16": 0.1},
        precision_factor={"bf16": 1.5},
    )
    summary = _tune(tmp_path, backend, knobs="  micro_batch: [1, 2, 4]\n  precision: [fp32, bf16]\n", patience=1)
    measured = [config.precision for config, confirming in backend.runs if not confirming]
    assert "bf16" in measured
    assert backend.probed == [["fp32", "bf16"]] or backend.probed == [["bf16", "fp32"]]
    assert summary.best.config.precision == "bf16"
    _tune(tmp_path, backend, knobs="  micro_batch: [1, 2, 4]\n  precision: [fp32, bf16]\n", patience=1)
    assert len(backend.probed) == 1  # stored in the study: probed once


def test_a_challenger_behind_the_held_answer_in_a_round_is_not_timed_again(tmp_path):
    # mb=4 is the simple answer. mb=2 reads behind it in the first paired round: it can no longer beat it in
    # every round, so a second round could not change the answer, and none runs.
    backend = ScriptedBackend(first={1: 50.0, 2: 97.0, 4: 100.0}, reruns={4: [100.0, 100.0], 2: [90.0, 120.0]})
    summary = _tune(tmp_path, backend)
    assert _confirming(backend) == [4, 2]
    assert summary.best.config.micro_batch == 4
    assert "ahead of the runner-up mb=2 fp32" in summary.certainty and "ahead in 1 of 1 rounds" in summary.certainty
    two = next(t for t in summary.trials if t.config.micro_batch == 2)
    assert two.confirmed is True and two.decided_rank == 1


def test_challengers_that_disagree_on_the_leader_by_more_than_the_noise_get_a_third_round(tmp_path):
    # mb=2 and mb=1 both beat the simple answer mb=4 in each round; between them, round 1 says mb=2 by 14%, round
    # 2 (a burst of load on mb=2's run) mb=1 by 4%: their paired figures lie 5% apart, and round 3 decides.
    backend = ScriptedBackend(
        first={1: 96.0, 2: 97.0, 4: 100.0},
        reruns={4: [100.0, 100.0, 100.0], 2: [120.0, 104.0, 121.0], 1: [105.0, 108.0, 106.0]},
    )
    summary = _tune(tmp_path, backend)
    assert _confirming(backend) == [4, 2, 1] * 3
    assert summary.best.config.micro_batch == 2
    assert "the runner-up mb=1 fp32" in summary.certainty and "ahead in 2 of 3 rounds" in summary.certainty


def test_challengers_within_the_noise_of_each_other_get_no_third_round(tmp_path):
    # The same, but the rounds disagree by 5% and 4%: their paired figures lie under 1% apart, which a third
    # round would most likely call within the noise again. Either is a proven improvement on the simple answer.
    backend = ScriptedBackend(
        first={1: 96.0, 2: 97.0, 4: 100.0},
        reruns={4: [100.0, 100.0, 100.0], 2: [110.0, 104.0, 111.0], 1: [105.0, 108.0, 106.0]},
    )
    summary = _tune(tmp_path, backend)
    assert _confirming(backend) == [4, 2, 1] * 2
    assert summary.best.config.micro_batch == 2
    assert (
        "within noise of the runner-up mb=1 fp32" in summary.certainty and "ahead in 1 of 2 rounds" in summary.certainty
    )


class _Said:
    def __init__(self) -> None:
        self.kept: list[dict] = []

    def space_kept(self, **kwargs):
        self.kept.append(kwargs)

    def __getattr__(self, name):
        return lambda **_: None


def test_a_study_of_a_preset_that_grew_since_resumes_with_the_space_it_was_started_with(tmp_path):
    import dataclasses

    from autotune.config.workload import Workload
    from autotune.search.presets import load_space

    # The `quick` preset as an older autotune shipped it: fewer micro batches, no checkpointing.
    older = dataclasses.replace(load_space("quick"), micro_batch=(1, 2), checkpointing=(False,))
    assert older.digest != load_space("quick").digest
    backend = ScriptedBackend(first={1: 50.0, 2: 60.0, 4: 70.0}, reruns={1: [50.0] * 4, 2: [60.0] * 4})
    common = dict(
        study="s",
        workload=Workload(model="builtin:gpt2-tiny", global_batch=4),
        memory_budget_bytes=2**30,
        storage=f"sqlite:///{tmp_path}/db.sqlite",
        estimate=False,
        backend=backend,
        confirm=False,
    )
    tune(space=older, n_trials=1, **common)
    said = _Said()
    summary = tune(space="quick", n_trials=3, progress=said, **common)
    assert said.kept == [{"name": "quick", "added": ["micro_batch auto", "checkpointing true"]}]
    assert len(summary.trials) == 3  # resumed: the first trial is still there
    assert {(t.config.micro_batch, t.config.checkpointing) for t in summary.trials} <= {(1, False), (2, False)}


def test_a_space_file_that_changed_still_refuses_the_study(tmp_path):
    from autotune.errors import StorageError

    backend = ScriptedBackend(first={1: 50.0, 2: 60.0, 4: 70.0}, reruns={})
    _tune(tmp_path, backend, n_trials=1, confirm=False)
    with pytest.raises(StorageError, match="space_digest differs"):
        _tune(tmp_path, backend, knobs="  micro_batch: [1, 2]\n  precision: [fp32]\n", n_trials=2, confirm=False)


def test_measure_all_turns_the_stop_on_evidence_off(tmp_path):
    # Throughput rising smoothly to mb=16: once the model has seen enough, the small micro batches
    # left are predicted far below the best and the search may end; --measure-all measures them.
    first = {1: 40.0, 2: 70.0, 4: 110.0, 8: 150.0, 16: 180.0}
    knobs = "  micro_batch: [1, 2, 4, 8, 16]\n  precision: [fp32]\n"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    reruns = {size: [tokens] * 4 for size, tokens in first.items()}
    settled = _tune(tmp_path / "a", ScriptedBackend(first=first, reruns=reruns), knobs=knobs)
    everything = _tune(tmp_path / "b", ScriptedBackend(first=first, reruns=reruns), knobs=knobs, stop_on_evidence=False)
    assert settled.stopped.startswith("settled") and settled.n_trials < 5, (settled.stopped, settled.n_trials)
    assert everything.n_trials == 5 and not everything.stopped.startswith("settled"), everything.stopped
    assert settled.best.config.micro_batch == everything.best.config.micro_batch == 16


class _ProfilingBackend(ScriptedBackend):
    """Records what the tuner asks of the device probe. ``meanwhile``: what another worker does while this
    one waits for its turn on the cores (LocalBackend reads ``stored`` once the turn comes)."""

    def __init__(self, meanwhile=lambda: None) -> None:
        super().__init__(first={1: 50.0, 2: 90.0}, reruns={1: [50.0, 50.0], 2: [90.0, 90.0]})
        self.asked: list[bool] = []
        self.probed = 0
        self._meanwhile = meanwhile

    def profile(self, *, between_ranks, stored):
        self.asked.append(between_ranks)
        self._meanwhile()
        if stored() is not None:
            return stored()
        self.probed += 1
        return dict(_ROOFLINE, name="probed here")


_ROOFLINE = {
    "name": "cpu",
    "type": "cpu",
    "matmul_flops": {"float32": 1e10},
    "memory_bandwidth": 1e10,
    "kernel_s": 0.0,
    "dispatch_s": 1e-5,
    "link_bandwidth": 1e9,
    "host_link_bandwidth": 1e9,
}


def test_the_device_probe_times_a_collective_only_for_a_study_of_several_ranks(tmp_path):
    from autotune.config.workload import Workload
    from autotune.search.presets import load_space

    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  precision: [fp32]\n")
    for nproc in (1, 2):
        backend = _ProfilingBackend()
        tune(
            study=f"ranks-{nproc}",
            workload=Workload(model="builtin:gpt2-tiny", global_batch=8, nproc=nproc),
            space=load_space(tmp_path / "space.yaml"),
            memory_budget_bytes=2**30,
            storage=f"sqlite:///{tmp_path}/db.sqlite",
            estimate=True,
            backend=backend,
            confirm=False,
        )
        assert backend.asked == [nproc > 1], (nproc, backend.asked)  # one rank communicates nothing
        assert backend.probed == 1


def test_a_worker_that_waited_its_turn_takes_the_roofline_another_worker_stored():
    from autotune.search.device_probes import ROOFLINE_KEY, device_profile

    class _Study:  # the study's user attributes, as another worker's process sees them
        user_attrs: dict = {}

        def set_user_attr(self, key, value):
            self.user_attrs = {**self.user_attrs, key: value}

    study = _Study()
    backend = _ProfilingBackend(meanwhile=lambda: study.set_user_attr(ROOFLINE_KEY, _ROOFLINE))
    profile = device_profile(study, backend, ranks=1)
    assert backend.probed == 0, "probed again what another worker had stored"
    assert profile is not None and profile.name == "cpu" and study.user_attrs[ROOFLINE_KEY] == _ROOFLINE


class _PerConfigBackend:
    """Trials answered per (precision, micro batch): a first figure, then each re-run's figure in turn."""

    def __init__(self, first: dict[tuple[str, int], float], reruns: dict[tuple[str, int], list[float]]) -> None:
        self.first, self.reruns, self.confirmed = first, {k: list(v) for k, v in reruns.items()}, []
        self.seen: set = set()  # configs run once: a config's next run is a confirming re-run

    def run(self, workload, config, *, measure_steps, **_):
        from autotune.trial.result import TrialResult, TrialStatus

        key = self.key(config)
        confirming = key in self.seen
        self.seen.add(key)
        if confirming:
            self.confirmed.append(key)
            tokens = self.reruns[key].pop(0) if self.reruns.get(key) else self.first[key]
        else:
            tokens = self.first[key]
        return TrialResult(
            config=config,
            status=TrialStatus.OK,
            tokens_per_s=tokens,
            peak_memory_bytes=2**20,
            measured_steps=measure_steps,
        )

    def key(self, config: TrialConfig) -> tuple:
        return (config.precision, config.micro_batch)

    def estimate(self, workload, config):
        return None


_TWO_PRECISIONS = "  micro_batch: [2, 4]\n  precision: [fp32, bf16]\n"
_FIRST = {("fp32", 2): 80.0, ("fp32", 4): 100.0, ("bf16", 2): 70.0, ("bf16", 4): 150.0}


def test_the_simple_answer_is_always_in_the_final_confirmation(tmp_path):
    # bf16 mb=4 reads 50% above the simple answer (fp32 mb=4) on its first measurement: far outside any noise
    # band, yet the simple answer is re-run beside it, and bf16 answers only because it beat it in every round.
    backend = _PerConfigBackend(_FIRST, {("fp32", 4): [100.0] * 3, ("bf16", 4): [150.0] * 3})
    summary = _tune(tmp_path, backend, knobs=_TWO_PRECISIONS)
    assert summary.simple_answer is not None and summary.simple_answer.config == TrialConfig(micro_batch=4)
    assert ("fp32", 4) in backend.confirmed and ("bf16", 4) in backend.confirmed
    assert summary.best.config.precision == "bf16"


def test_a_config_ahead_on_its_first_measurement_alone_does_not_replace_the_simple_answer(tmp_path):
    # bf16 mb=4 first reads 4% above the simple answer, then ahead in the first paired round, behind in the second.
    first = {**_FIRST, ("bf16", 4): 104.0}
    backend = _PerConfigBackend(first, {("fp32", 4): [100.0, 100.0, 100.0], ("bf16", 4): [103.0, 99.0, 103.0]})
    summary = _tune(tmp_path, backend, knobs=_TWO_PRECISIONS)
    assert backend.confirmed.count(("bf16", 4)) == 2  # compared; behind once, it can no longer replace it
    assert summary.best.config == TrialConfig(micro_batch=4)  # fp32: the simple answer held
    # Ahead in every round, by more than the noise: it replaces it.
    backend = _PerConfigBackend(first, {("fp32", 4): [100.0, 100.0, 100.0], ("bf16", 4): [106.0, 105.0, 107.0]})
    (tmp_path / "again").mkdir()
    summary = _tune(tmp_path / "again", backend, knobs=_TWO_PRECISIONS)
    assert summary.best.config.precision == "bf16"
    # Ahead in every round by 1-2%: a lead within the noise, and the simple answer holds (two configs of one
    # speed would otherwise swap on coin flips).
    backend = _PerConfigBackend(first, {("fp32", 4): [100.0, 100.0, 100.0], ("bf16", 4): [101.0, 102.0, 101.5]})
    (tmp_path / "within").mkdir()
    summary = _tune(tmp_path / "within", backend, knobs=_TWO_PRECISIONS)
    assert summary.best.config == TrialConfig(micro_batch=4)
    assert "within noise of the runner-up" in summary.certainty and "ahead in 0 of 2 rounds" in summary.certainty
    held = "held: a challenger replaces it only by leading it in every round, two at least, by more than 3%"
    assert held in summary.certainty


def test_a_lever_the_top_config_took_on_a_lucky_first_figure_is_re_run_beside_the_config_without_it(tmp_path):
    # bf16 with the fused optimizer reads 140 on its first figure, 12% above bf16 without it (125): outside a
    # trial's noise band (the step spread), so alone it would be re-run only beside the simple answer (fp32).
    # Its twin one knob apart is re-run beside it, leads it in every round, and answers.

    class WithFused(_PerConfigBackend):
        def key(self, config):
            return (config.precision, config.micro_batch, config.fused_optimizer)

    first = {("fp32", 4, False): 100.0, ("fp32", 4, True): 100.0, ("bf16", 4, False): 125.0, ("bf16", 4, True): 140.0}
    reruns = {("fp32", 4, False): [100.0] * 3, ("bf16", 4, True): [115.0] * 3, ("bf16", 4, False): [125.0] * 3}
    backend = WithFused(first, reruns)
    knobs = "  micro_batch: [4]\n  precision: [fp32, bf16]\n  fused_optimizer: [false, true]\n"
    summary = _tune(tmp_path, backend, knobs=knobs, stop_on_evidence=False)
    assert ("bf16", 4, False) in backend.confirmed, backend.confirmed
    assert ("fp32", 4, True) not in backend.confirmed  # one knob apart, but 29% under: outside the twins' band
    assert summary.best.config == TrialConfig(micro_batch=4, precision="bf16")


def test_twins_are_one_knob_apart_at_the_same_micro_batch():
    from autotune.search.confirm import MAX_TWINS, TWIN_BAND, contenders_of, one_knob_apart

    top = TrialConfig(micro_batch=4, precision="bf16", fused_optimizer=True, loss="chunked")
    assert one_knob_apart(top, TrialConfig(micro_batch=4, precision="bf16", fused_optimizer=True))
    assert one_knob_apart(top, TrialConfig(micro_batch=4, precision="bf16", loss="chunked"))
    assert not one_knob_apart(top, TrialConfig(micro_batch=4, precision="bf16"))  # two levers off
    assert not one_knob_apart(top, TrialConfig(micro_batch=2, precision="bf16", fused_optimizer=True, loss="chunked"))
    assert not one_knob_apart(top, top)
    # Checkpointing every 2nd layer against none: two fields of one lever, one knob.
    every_2nd = TrialConfig(micro_batch=4, precision="bf16", checkpointing=True, checkpoint_every=2)
    assert one_knob_apart(every_2nd, TrialConfig(micro_batch=4, precision="bf16"))

    def record(number: int, config: TrialConfig, tokens: float) -> TrialRecord:
        return TrialRecord(number=number, config=config, status="ok", tokens_per_s=tokens, fits=True)

    records = [
        record(0, TrialConfig(micro_batch=2), 80.0),  # the simple answer
        record(1, top, 100.0),
        record(2, TrialConfig(micro_batch=4, precision="bf16", fused_optimizer=True), 92.0),  # a twin, 8% under
        record(3, TrialConfig(micro_batch=4, precision="bf16", loss="chunked"), 100 / (1 + TWIN_BAND) - 1),  # out
        record(4, TrialConfig(micro_batch=4, precision="bf16"), 99.0),  # two levers apart: within the noise band
    ]
    assert [r.number for r in contenders_of(records, simple=0)] == [0, 1, 4, 2]
    assert MAX_TWINS >= 1


def test_a_trial_disturbed_by_other_work_is_measured_once_more_and_the_steadier_figure_kept(tmp_path):
    from autotune.trial.result import TrialResult, TrialStatus

    class Disturbed(_PerConfigBackend):
        """fp32 mb=4's first run shares the cores with something else: slow and spread out."""

        def run(self, workload, config, *, measure_steps, **kwargs):
            result = super().run(workload, config, measure_steps=measure_steps, **kwargs)
            self.runs = getattr(self, "runs", []) + [(config.precision, config.micro_batch)]
            if self.runs.count(("fp32", 4)) == 1 and config == TrialConfig(micro_batch=4):
                return TrialResult(
                    config=config,
                    status=TrialStatus.OK,
                    tokens_per_s=40.0,
                    peak_memory_bytes=2**20,
                    measured_steps=measure_steps,
                    step_time_spread=0.5,
                )
            return result

    backend = Disturbed(_FIRST, {})
    summary = _tune(tmp_path, backend, knobs="  micro_batch: [2, 4]\n  precision: [fp32]\n")
    four = next(t for t in summary.trials if t.config == TrialConfig(micro_batch=4))
    assert four.tokens_per_s == 100.0  # the steadier measurement, not the disturbed 40
    assert backend.runs[:2] == [("fp32", 4), ("fp32", 4)]


def test_the_first_trial_and_every_rerun_warm_up_one_step_more(tmp_path):
    # A warm-up step is one micro batch and the optimizer step, whatever the accumulation (global batch 16: mb=2
    # accumulates 8 micro batches, mb=16 one): the call's first trial warms up twice, the search's others once.
    for micro_batches in ([2, 4], [8, 16]):
        folder = tmp_path / f"mb{micro_batches[0]}"
        folder.mkdir()
        backend = ScriptedBackend(
            first={micro_batches[0]: 100.0, micro_batches[1]: 97.0},
            reruns={m: [100.0] * 3 for m in micro_batches},
        )
        _tune(folder, backend, knobs=f"  micro_batch: {micro_batches}\n  precision: [fp32]\n")
        searched = [warm for (_, again), warm in zip(backend.runs, backend.warmups, strict=True) if not again]
        assert searched[0] == 2 and searched[1:] and all(warm == 1 for warm in searched[1:])
        # A re-run is a fresh process after a pause, as the first trial is: it warms up as that one does.
        reruns = [warm for (_, again), warm in zip(backend.runs, backend.warmups, strict=True) if again]
        assert reruns and all(warm == 2 for warm in reruns)


class _PredictedBackend(ScriptedBackend):
    """Trials as scripted, and a memory estimate of ``peak_bytes`` for every config."""

    def __init__(self, peak_bytes: int) -> None:
        super().__init__(first={1: 100.0, 2: 150.0}, reruns={1: [100.0] * 3, 2: [150.0] * 3})
        self.peak_bytes = peak_bytes

    def estimate(self, workload, config):
        from autotune.estimate.results import MemoryEstimate

        return MemoryEstimate(
            config=config,
            parameters_bytes=2**20,
            gradients_bytes=2**20,
            optimizer_state_bytes=2**21,
            activations_bytes=self.peak_bytes - 2**22,
            temporaries_bytes=0,
            overhead_bytes=None,
            predicted_peak_bytes=self.peak_bytes,
            method="scripted",
            seconds=0.0,
        )


def test_a_ramp_predicted_well_over_the_limit_at_its_smallest_size_is_skipped_not_run(tmp_path):
    # The budget is 1 GiB, the limit 10% under it. Predicted at twice the budget, no size of the ramp is run:
    # the ramp's smallest size is recorded as skipped, as the search skips it, and nothing is measured.
    backend = _PredictedBackend(2**31)
    summary = _tune(tmp_path, backend, knobs="  micro_batch: [1, 2]\n  precision: [fp32]\n", estimate=True)
    assert backend.runs == []
    assert summary.best is None and summary.simple_answer is None
    assert {t.status for t in summary.trials} == {"skipped"}
    # Predicted just over the limit (within the skip margin): a prediction so close is no proof, so the
    # smallest size is measured all the same.
    (tmp_path / "close").mkdir()
    close = _PredictedBackend(int(2**30 * 0.9 * 1.03))
    _tune(tmp_path / "close", close, knobs="  micro_batch: [1, 2]\n  precision: [fp32]\n", estimate=True)
    assert (1, False) in close.runs


def test_each_trial_is_handed_three_times_the_fastest_fitting_configs_step_and_not_the_re_runs(tmp_path):
    """A trial may stop after a timed step three times as long as the fastest fitting config's so far (see
    autotune.search.measuring): at 4 samples/s (mb=4), global batch 16, that is 12 s. Before any config fits, no
    bound; a re-run is never cut short."""
    from autotune.config.workload import Workload
    from autotune.search.measuring import OUTPACED_FACTOR

    global_batch = Workload(model="builtin:gpt2-tiny").global_batch

    class Bounded(ScriptedBackend):
        def run(self, workload, config, *, measure_steps, outpaced_step_s=None, **kwargs):
            self.bounds = getattr(self, "bounds", []) + [outpaced_step_s]
            result = super().run(workload, config, measure_steps=measure_steps, **kwargs)
            return result.replace(samples_per_s=result.tokens_per_s / 25) if result.ok else result

    backend = Bounded(first={1: 50.0, 2: 80.0, 4: 100.0}, reruns={4: [100.0] * 3, 2: [80.0] * 3})
    _tune(tmp_path, backend)
    fastest = 0.0  # samples/s of the fastest trial so far (each fits)
    for (micro_batch, again), bound in zip(backend.runs, backend.bounds, strict=True):
        if again:
            assert bound is None
            continue
        assert bound == (pytest.approx(OUTPACED_FACTOR * global_batch / fastest) if fastest else None)
        fastest = max(fastest, backend.first[micro_batch] / 25)
    assert fastest == 4.0 and len(backend.runs) > 3
