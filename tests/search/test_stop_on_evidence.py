"""The stop on evidence: the model's error, what evidence is owed before the search may end, and
the time limit (a matmul probe is evidence about matmuls, not the step)."""

from __future__ import annotations

import math
import time

import pytest

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.search.clock import Clock
from autotune.search.outlook import MEASUREMENT_NOISE, Outlook
from autotune.search.presets import load_space
from autotune.search.proposer import Proposer
from autotune.search.throughput import ThroughputModel
from autotune.study.summary import TrialRecord

CPU = DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False)
PRECISIONS = "knobs:\n  micro_batch: [2, 4, 8]\n  precision: [fp32, bf16, fp16]\n  checkpointing: [false, true]\n"


def _space(tmp_path, text: str = PRECISIONS):
    (tmp_path / "space.yaml").write_text(text)
    return load_space(str(tmp_path / "space.yaml"))


def _ok(config: TrialConfig, tokens: float, number: int = 0) -> TrialRecord:
    return TrialRecord(number=number, config=config, status="ok", tokens_per_s=tokens, fits=True)


def test_the_models_error_is_the_spread_of_its_leave_one_out_residuals(tmp_path):
    space = _space(tmp_path)
    measured = [
        (TrialConfig(micro_batch=2), 100.0),
        (TrialConfig(micro_batch=4), 150.0),
        (TrialConfig(micro_batch=8), 160.0),
        (TrialConfig(micro_batch=2, checkpointing=True), 80.0),
        (TrialConfig(micro_batch=4, checkpointing=True), 125.0),
        (TrialConfig(micro_batch=8, checkpointing=True), 120.0),
    ]
    model = ThroughputModel(space.params_of).fit(measured)
    # The same, by brute force: each trial predicted by a fit without it.
    held_out = []
    for i, (config, tokens) in enumerate(measured):
        without = ThroughputModel(space.params_of).fit(measured[:i] + measured[i + 1 :])
        held_out.append(math.log(tokens) - without.predict(config))
    assert model.error() == pytest.approx(math.sqrt(sum(r * r for r in held_out) / len(held_out)), rel=1e-6)
    # Too few trials to predict any without itself: no error, so nothing can be ruled out by it.
    assert ThroughputModel(space.params_of).fit(measured[:3]).error() is None
    assert model.error_bound() == model.error()  # once known, the error is its own bound


def test_before_the_error_is_known_two_trials_bound_it_by_how_far_apart_the_priors_misses_lie(tmp_path):
    from autotune.search.throughput import PROVISIONAL_ERROR_FACTOR

    space = _space(tmp_path)
    prior = {2: math.log(100.0), 4: math.log(150.0), 8: math.log(300.0)}
    model = ThroughputModel(space.params_of, predicted=lambda c: prior[c.micro_batch])
    assert model.fit([(TrialConfig(micro_batch=2), 90.0)]).error_bound() is None  # one trial bounds nothing
    # Both missed by about the same factor: the prior told them apart well, the floor holds.
    close = [(TrialConfig(micro_batch=2), 90.0), (TrialConfig(micro_batch=4), 140.0)]
    fitted = ThroughputModel(space.params_of, predicted=lambda c: prior[c.micro_batch]).fit(close)
    assert fitted.error() is None
    assert fitted.error_bound() == pytest.approx(math.log(PROVISIONAL_ERROR_FACTOR))
    # One missed 3x, the other not at all: the prior's error between them is 3x, wider than the floor.
    apart = [(TrialConfig(micro_batch=2), 100.0), (TrialConfig(micro_batch=8), 100.0)]
    fitted = ThroughputModel(space.params_of, predicted=lambda c: prior[c.micro_batch]).fit(apart)
    assert fitted.error_bound() == pytest.approx(math.log(3.0))


def test_a_measured_precision_sets_its_own_factor_whatever_the_probe_said(tmp_path):
    space = _space(tmp_path)
    probe = {"fp32": 1.0, "bf16": 4.0, "fp16": 0.014}  # matmuls; this step's are too small to care
    model = ThroughputModel(space.params_of, unpredicted_factor=lambda c: math.log(probe[c.precision]))
    untried_bf16, untried_fp32 = TrialConfig(micro_batch=8, precision="bf16"), TrialConfig(micro_batch=8)
    assert math.exp(model.prior(untried_bf16) - model.prior(untried_fp32)) == pytest.approx(4.0)  # the probe
    model.fit([(TrialConfig(micro_batch=4), 1000.0), (TrialConfig(micro_batch=4, precision="bf16"), 900.0)])
    # One step in bf16 measured 0.9x fp32's: that, not a ridge-shrunk blend with the probe's 4x.
    assert math.exp(model.predict(untried_bf16) - model.predict(untried_fp32)) == pytest.approx(0.9, rel=0.01)
    # fp16 is still unmeasured: its factor is the probe's until a step says otherwise, taken from where
    # the measured precisions sit on average (the probe was off by 1 for fp32 and by 0.9/4 for bf16).
    fp16 = TrialConfig(micro_batch=8, precision="fp16")
    expected = 0.014 * math.sqrt(1.0 * 0.9 / 4.0)
    assert math.exp(model.predict(fp16) - model.predict(untried_fp32)) == pytest.approx(expected, rel=0.01)


def test_an_untraced_family_sits_at_the_traced_ones_by_its_precisions_matmul_speed(tmp_path):
    """Before its step is traced, a family of another precision is placed by the roofline's matmul rates
    relative to the traced families (their own precision's rate taken out), not level with them: a
    family far slower in matmuls is then not traced before the first trial."""
    from autotune.estimate.step_time import DeviceProfile, matmul_speedups

    space = _space(tmp_path)
    rates = {"float32": 1e11, "bfloat16": 4e11, "float16": 1e9}
    profile = DeviceProfile(
        name="cpu",
        type="cpu",
        matmul_flops=rates,
        memory_bandwidth=1e10,
        kernel_s=0.0,
        dispatch_s=1e-6,
        link_bandwidth=1e9,
        host_link_bandwidth=1e9,
    )
    speed = matmul_speedups(profile, ("fp32", "bf16", "fp16"))
    assert speed == pytest.approx({"fp32": 1.0, "bf16": 4.0, "fp16": 0.01})
    traced_bf16 = TrialConfig(micro_batch=8, precision="bf16")
    configs = [traced_bf16, TrialConfig(micro_batch=8), TrialConfig(micro_batch=8, precision="fp16")]
    model = ThroughputModel(
        space.params_of,
        lambda c: math.log(500.0) if c == traced_bf16 else None,  # only the bf16 family is traced
        configs,
        unpredicted_factor=lambda c: math.log(speed[c.precision]),
    )
    assert math.exp(model.prior(traced_bf16)) == pytest.approx(500.0)
    assert math.exp(model.prior(configs[1])) == pytest.approx(500.0 / 4)  # fp32: a quarter of bf16's
    assert math.exp(model.prior(configs[2])) == pytest.approx(500.0 / 400)


def _proposer(tmp_path) -> Proposer:
    proposer = Proposer(_space(tmp_path), Workload(global_batch=16), CPU)  # no estimator: everything may fit
    proposer.precision_speed = {"fp32": 1.0, "bf16": 4.0, "fp16": 0.014}
    return proposer


def test_a_precision_the_probe_timed_is_still_owed_a_measured_step(tmp_path):
    proposer = _proposer(tmp_path)
    records = [
        _ok(TrialConfig(micro_batch=8, precision="bf16"), 1000.0, 0),
        _ok(TrialConfig(micro_batch=8), 1100.0, 1),
        _ok(TrialConfig(micro_batch=8, checkpointing=True), 900.0, 2),
    ]
    owed = proposer.owed_values(records)
    assert ("precision", "'fp16'") in owed  # the probe's 0.014x is no evidence about this step
    assert ("precision", "'bf16'") not in owed and ("checkpointing", "True") not in owed
    assert not proposer.outlook(records).settled  # so the search may not end yet


def test_a_value_whose_first_step_beats_its_prior_owes_its_family_another_trial(tmp_path):
    proposer = _proposer(tmp_path)
    records = [
        _ok(TrialConfig(micro_batch=8, precision="bf16"), 1000.0, 0),
        _ok(TrialConfig(micro_batch=8), 1100.0, 1),
        _ok(TrialConfig(micro_batch=8, checkpointing=True), 950.0, 2),
        _ok(TrialConfig(micro_batch=8, precision="bf16", checkpointing=True), 870.0, 3),
        # fp16's first step: the probe put it at 1/70 of fp32, it ran at 1.2x (autocast skips most ops here).
        _ok(TrialConfig(micro_batch=4, precision="fp16"), 1300.0, 4),
    ]
    assert ("precision", "'fp16'") in proposer.owed_values(records)
    # Its family re-ranked by the surprise: the next trial is fp16's most promising config.
    proposed = proposer.next_config(records, unmeasured_only=True)
    assert proposed is not None and proposed.precision == "fp16" and proposed.micro_batch == 8
    # Once a second fp16 config is measured, nothing about fp16 is owed.
    records.append(_ok(proposed, 1350.0, 5))
    assert ("precision", "'fp16'") not in proposer.owed_values(records)


def test_a_first_step_that_does_not_beat_its_prior_owes_nothing_more(tmp_path):
    proposer = _proposer(tmp_path)
    records = [
        _ok(TrialConfig(micro_batch=8, precision="bf16"), 1000.0, 0),
        _ok(TrialConfig(micro_batch=8), 1100.0, 1),
        _ok(TrialConfig(micro_batch=8, checkpointing=True), 950.0, 2),
        _ok(TrialConfig(micro_batch=8, precision="fp16"), 15.0, 3),  # as slow as the probe said
    ]
    assert not any(knob == "precision" for knob, _ in proposer.owed_values(records))


def test_the_outlook_settles_only_when_nothing_is_owed_and_the_upper_prediction_is_within_noise():
    config = TrialConfig(micro_batch=8)
    within = Outlook(best=100.0, top=config, predicted=95.0, error=0.05, owed=frozenset(), untried=3)
    assert within.upper == pytest.approx(95.0 * math.exp(0.05)) and within.upper <= 100 * (1 + MEASUREMENT_NOISE)
    assert within.settled and "no untried config predicted to beat it" in within.describe()
    wide = Outlook(best=100.0, top=config, predicted=95.0, error=0.2, owed=frozenset(), untried=3)
    assert not wide.settled and "may be up to +16% faster" in wide.describe()
    unknown = Outlook(best=100.0, top=config, predicted=95.0, error=None, owed=frozenset(), untried=3)
    assert not unknown.settled  # before the error is known, nothing is ruled out by it
    owed = Outlook(
        best=100.0, top=config, predicted=50.0, error=0.01, owed=frozenset({("precision", "'fp16'")}), untried=3
    )
    assert not owed.settled and "precision=fp16" in owed.describe()


def test_the_time_limit_leaves_the_confirmation_its_share():
    clock = Clock(10.0)
    outlook = Outlook(best=1.0, top=None, predicted=None, error=None, owed=frozenset(), untried=7)
    assert clock.search_over(outlook) is None  # nothing timed yet, nothing spent
    clock.trial_seconds.append(2.0)  # the next trial takes ~2 s, and the leader's re-run ~5 s after it
    clock.started -= 2.5
    assert clock.search_over(outlook) is None  # 2.5 + 2 + 5 <= 10
    clock.started -= 1.0
    reason = clock.search_over(outlook)
    assert reason is not None and "--max-time 10 s" in reason and "7 configs stayed untried" in reason
    assert clock.holds_a_rerun()  # nothing re-run yet: the leader's first re-run always runs
    with clock.timing(rerun=True):
        time.sleep(0.01)
    clock.started -= 6.5
    assert not clock.holds_a_rerun()
    assert Clock(None).search_over(outlook) is None and Clock(None).holds_a_rerun()
