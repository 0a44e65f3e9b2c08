"""What people read: uncertain figures marked, and a 'nothing fits' that says what to change."""

from __future__ import annotations

import io

from rich.console import Console

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.output.render import nothing_fits, print_summary
from autotune.study.summary import StudySummary, TrialRecord

MIB = 2**20


def _summary(trials: list[TrialRecord], best: TrialRecord | None = None, **kwargs) -> StudySummary:
    return StudySummary(
        name="s",
        storage="sqlite:///x.db",
        workload=Workload(model="builtin:gpt2-tiny"),
        space="quick",
        device={"type": "cpu", "name": "x86_64"},
        memory_budget_bytes=100 * MIB,
        memory_limit_bytes=90 * MIB,
        trials=trials,
        best=best,
        **kwargs,
    )


def _printed(summary: StudySummary) -> str:
    out = io.StringIO()
    print_summary(summary, console=Console(file=out, width=200))
    return out.getvalue()


def test_nothing_fits_says_what_was_tried_the_smallest_peak_and_what_to_change():
    trials = [
        TrialRecord(number=0, config=TrialConfig(micro_batch=4), status="oom", peak_memory_bytes=120 * MIB),
        TrialRecord(
            number=1,
            config=TrialConfig(micro_batch=1),
            status="ok",
            tokens_per_s=10.0,
            peak_memory_bytes=95 * MIB,
            fits=False,
        ),
        TrialRecord(number=2, config=TrialConfig(micro_batch=2), status="skipped", predicted_peak_bytes=110 * MIB),
    ]
    lines = nothing_fits(_summary(trials))
    text = "\n".join(lines)
    assert lines[0].startswith("no config fits: 2 trials measured (")
    assert "1 oom" in lines[0] and "1 over the memory limit" in lines[0] and "1 skipped" in lines[0]
    assert "smallest peak seen: 95.0 MiB (measured, mb=1 fp32) against the limit 90.0 MiB" in text
    assert "--memory-budget 105.6 MiB or more" in text  # 95 MiB / (1 - 10% headroom)
    assert "activation checkpointing" in text and "a 16-bit precision" in text and "LoRA" in text
    assert "no config fits" in _printed(_summary(trials))


def test_configs_that_fit_but_were_not_re_run_are_not_called_too_big():
    trials = [
        TrialRecord(number=0, config=TrialConfig(micro_batch=1), status="ok", tokens_per_s=10.0, fits=True),
        TrialRecord(number=1, config=TrialConfig(micro_batch=2), status="oom", peak_memory_bytes=120 * MIB),
    ]
    (line,) = nothing_fits(_summary(trials))
    assert line.startswith("no confirmed config yet: 2 trials measured (1 fit, not confirmed yet, 1 oom)"), line
    assert "without --no-confirm" in line and "no config fits" not in line


def test_a_study_without_trials_says_so():
    assert nothing_fits(_summary([])) == ["no confirmed config yet: no trial measured"]


def test_an_unsettled_figure_shows_its_spread_and_the_answer_says_how_sure_it_is():
    noisy = TrialRecord(
        number=0,
        config=TrialConfig(micro_batch=2),
        status="ok",
        tokens_per_s=1000.0,
        peak_memory_bytes=10 * MIB,
        fits=True,
        step_time_spread=0.4,
    )
    steady = TrialRecord(
        number=1,
        config=TrialConfig(micro_batch=4),
        status="ok",
        tokens_per_s=1200.0,
        peak_memory_bytes=20 * MIB,
        fits=True,
        step_time_spread=0.02,
        confirmed=True,
        confirmed_tokens_per_s=1150.0,
        decided_rank=0,
    )
    text = _printed(_summary([noisy, steady], best=steady, certainty="clearly faster than the runner-up"))
    assert "1,000.0 ±20%" in text and "1,200.0 ±" not in text
    assert "how sure: clearly faster than the runner-up" in text


def test_an_image_study_counts_images_and_ranks_by_them():
    from autotune.study.records import ranking

    slow = TrialRecord(
        number=0,
        config=TrialConfig(micro_batch=2),
        status="ok",
        samples_per_s=50.0,
        throughput_unit="images/s",
        peak_memory_bytes=10 * MIB,
        fits=True,
    )
    fast = TrialRecord(
        number=1,
        config=TrialConfig(micro_batch=4),
        status="ok",
        samples_per_s=80.0,
        throughput_unit="images/s",
        peak_memory_bytes=20 * MIB,
        fits=True,
        confirmed=True,
        confirmed_samples_per_s=78.0,
        decided_rank=0,
    )
    assert slow.tokens_per_s is None and fast.throughput == 80.0 and fast.confirmed_throughput == 78.0
    assert ranking([slow, fast]) == [fast, slow]
    summary = _summary([slow, fast], best=fast)
    text = _printed(summary)
    assert summary.throughput_unit == "images/s"
    assert "images/s" in text and "78.0 images/s" in text and "tokens/s" not in text


def test_a_trial_stopped_after_one_outpaced_step_says_so_in_its_line():
    from autotune.output.render import ConsoleProgress

    out = io.StringIO()
    best = TrialRecord(number=0, config=TrialConfig(micro_batch=2), status="ok", tokens_per_s=1400.0, fits=True)
    slow = TrialRecord(
        number=1,
        config=TrialConfig(micro_batch=2, precision="bf16"),
        status="ok",
        tokens_per_s=73.0,
        fits=True,
        outpaced=True,
    )
    ConsoleProgress(Console(file=out, width=300)).trial_finished(record=slow, best=best, elapsed_s=40.0)
    line = out.getvalue()
    assert "-> ok: 73 tokens/s" in line or "-> ok: 73.0 tokens/s" in line
    assert "one timed step: far slower than the best, not worth more" in line
