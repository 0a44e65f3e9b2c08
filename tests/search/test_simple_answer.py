"""The simple answer first: the one-knob finders' ramp, and what may replace its answer."""

from __future__ import annotations

from autotune.config.knobs import TrialConfig
from autotune.estimate.results import MemoryEstimate
from autotune.search.simple import next_ramp_config, ramp_answer, ramp_family
from autotune.study.summary import TrialRecord

MIB = 2**20


def _family(*sizes: int) -> list[TrialConfig]:
    return [TrialConfig(micro_batch=m) for m in sizes]


def _record(number: int, micro_batch: int, status: str = "ok", *, fits: bool = True) -> TrialRecord:
    return TrialRecord(
        number=number,
        config=TrialConfig(micro_batch=micro_batch),
        status=status,
        tokens_per_s=100.0 if status == "ok" else None,
        fits=fits and status == "ok",
    )


def _estimates(peaks_mib: dict[int, float], asked: list[int]):
    """An estimator of ``peaks_mib`` per micro batch (10 MiB of model states), noting each size asked."""

    def estimate(config: TrialConfig) -> MemoryEstimate:
        asked.append(config.micro_batch)
        peak = int(peaks_mib[config.micro_batch] * MIB)
        return MemoryEstimate(
            config=config,
            parameters_bytes=4 * MIB,
            gradients_bytes=4 * MIB,
            optimizer_state_bytes=2 * MIB,
            activations_bytes=peak - 10 * MIB,
            temporaries_bytes=0,
            overhead_bytes=None,
            predicted_peak_bytes=peak,
            method="scripted",
            seconds=0.0,
        )

    return estimate


def test_the_ramp_is_the_first_candidates_family_at_power_of_two_micro_batches():
    base = TrialConfig(micro_batch=1)
    bf16 = base.replace(precision="bf16")
    candidates = [base.replace(micro_batch=m) for m in (1, 2, 3, 4, 6, 12)] + [bf16.replace(micro_batch=4)]
    assert [c.micro_batch for c in ramp_family(candidates)] == [1, 2, 4]
    assert all(c.precision == "fp32" for c in ramp_family(candidates))
    assert ramp_family([]) == []


def test_without_an_estimator_each_trial_of_the_ramp_halves_the_sizes_left():
    family = _family(1, 2, 4, 8, 16)
    assert next_ramp_config(family, [], None, 100 * MIB).micro_batch == 4
    records = [_record(0, 4)]
    assert next_ramp_config(family, records, None, 100 * MIB).micro_batch == 16
    records.append(_record(1, 16, "oom"))
    assert next_ramp_config(family, records, None, 100 * MIB).micro_batch == 8
    records.append(_record(2, 8, "oom"))
    assert next_ramp_config(family, records, None, 100 * MIB) is None  # 4 fits, 8 does not: the answer is known
    assert ramp_answer(family, records).config.micro_batch == 4
    assert next_ramp_config(family, [_record(0, 4, "oom")], None, 100 * MIB).micro_batch == 2


def test_a_size_another_worker_is_measuring_is_not_taken_again():
    family = _family(1, 2, 4, 8, 16)
    # Another worker took the middle size (its search proposed it) before this worker's ramp began.
    assert next_ramp_config(family, [_record(0, 4, "running")], None, 100 * MIB).micro_batch == 8
    assert next_ramp_config(family, [_record(0, 4, "running")], _estimates({1: 20, 2: 30, 8: 70, 16: 130}, []),
                            100 * MIB).micro_batch == 8  # fmt: skip
    # Lost with its worker: it is open again, and the ramp takes it as before.
    assert next_ramp_config(family, [_record(0, 4, "interrupted")], None, 100 * MIB).micro_batch == 4
    assert next_ramp_config(family, [_record(0, 1), _record(1, 8, "running")], None, 100 * MIB).micro_batch == 4


def test_a_size_measured_over_the_limit_or_failing_ends_the_ramp_below_it():
    family = _family(1, 2, 4)
    assert next_ramp_config(family, [_record(0, 1), _record(1, 2, fits=False)], None, 100 * MIB) is None
    assert next_ramp_config(family, [_record(0, 1), _record(1, 2, "crashed")], None, 100 * MIB) is None


def test_with_an_estimator_the_ramp_starts_at_the_largest_size_predicted_to_fit():
    family = _family(1, 2, 4, 8, 16)
    asked: list[int] = []
    estimate = _estimates({1: 20, 2: 30, 4: 50, 8: 90, 16: 170}, asked)
    assert next_ramp_config(family, [], estimate, 100 * MIB).micro_batch == 8
    assert asked == [16, 8]  # from the top down, and no further once one fits
    # It did not fit after all: one size down.
    records = [_record(0, 8, "oom")]
    assert next_ramp_config(family, records, estimate, 100 * MIB).micro_batch == 4
    records.append(_record(1, 4))
    assert next_ramp_config(family, records, estimate, 100 * MIB) is None
    assert ramp_answer(family, records).config.micro_batch == 4


def test_the_straight_line_passes_over_sizes_clearly_over_the_limit():
    family = _family(1, 2, 4, 8, 16, 32)
    asked: list[int] = []
    estimate = _estimates({1: 15, 2: 20, 4: 30, 8: 50, 16: 90, 32: 170}, asked)
    assert next_ramp_config(family, [], estimate, 60 * MIB).micro_batch == 8
    assert asked == [32, 8]  # the line through 32 puts 16 at 90 MiB: clearly over, not estimated


def test_where_everything_is_predicted_over_the_limit_the_smallest_size_is_still_measured():
    family = _family(1, 2, 4)
    estimate = _estimates({1: 120, 2: 140, 4: 180}, [])
    assert next_ramp_config(family, [], estimate, 100 * MIB).micro_batch == 1  # a prediction is not proof
    assert next_ramp_config(family, [_record(0, 1, "oom")], estimate, 100 * MIB) is None
    assert ramp_answer(family, [_record(0, 1, "oom")]) is None


def test_a_trial_that_fails_for_another_reason_than_memory_ends_the_ramp():
    family = _family(1, 2, 4, 8, 16)
    # An error says the workload may be broken, not that the size is too big: no smaller size is tried on it.
    assert next_ramp_config(family, [_record(0, 4, "error")], None, 100 * MIB) is None
    assert next_ramp_config(family, [_record(0, 4), _record(1, 16, "crashed")], None, 100 * MIB) is None
    assert ramp_answer(family, [_record(0, 4), _record(1, 16, "crashed")]).config.micro_batch == 4
