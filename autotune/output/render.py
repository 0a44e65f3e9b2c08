"""Human-readable output (Rich tables); the JSON forms come from the result types themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.sizes import format_size
from autotune.study.summary import StudySummary, TrialRecord, what_is_trained
from autotune.trial.measure import unsettled
from autotune.trial.result import TOKENS_PER_S, TrialResult

if TYPE_CHECKING:
    from autotune.search.plan import Plan, PlanRow

__all__ = ["print_trial", "print_summary", "print_plan", "nothing_fits", "ConsoleProgress"]


def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _figure(figure: float | None, spread: float | None) -> str:
    """tokens/s, with the step times' spread where they never settled (an uncertain figure)."""
    if figure is None or not unsettled(spread):
        return _num(figure)
    return f"{_num(figure)} ±{spread / 2:.0%}"


def _unsettled_why(spread: float) -> str:
    return f"its steps differed by {spread:.0%} of the median step even after extra steps; is something else running?"


def print_trial(
    workload: Workload, result: TrialResult, *, console: Console | None = None, command: list[str] | None = None
) -> None:
    """The table of one trial; ``command``: the user's own command, in script mode."""
    console = console or Console()
    what = " ".join(command) if command else workload.model
    table = Table(title=f"trial: {result.config.describe()}  on {what}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    phases = result.phases
    rows = [
        ("status", result.status.value),
        (result.throughput_unit, _num(result.throughput)),
        *([("samples/s", _num(result.samples_per_s, "{:,.2f}"))] if result.throughput_unit == TOKENS_PER_S else []),
        (
            "step time (median, IQR)",
            "-"
            if result.step_time_median_s is None or result.step_time_iqr_s is None
            else f"{result.step_time_median_s * 1000:.1f} ms, IQR {result.step_time_iqr_s * 1000:.1f} ms"
            + ("" if result.step_time_spread is None else f" ({result.step_time_spread:.0%} of the median)"),
        ),
        (
            "disturbed steps",
            "-"
            if result.disturbed_steps is None
            else f"{result.disturbed_steps} of {result.measured_steps} over 1.25x the median",
        ),
        ("measured steps", f"{result.measured_steps} x {result.grad_accum_steps or '-'} micro-steps"),
        (
            "peak memory",
            format_size(result.peak_memory_bytes) + ("" if result.peak_reserved_bytes is None else " (reserved)"),
        ),
        ("peak allocated", format_size(result.peak_allocated_bytes)),
        ("memory budget", format_size(result.memory_budget_bytes)),
        ("optimizer state", format_size(result.optimizer_state_bytes)),
        ("optimizer", result.optimizer or "-"),
        *([("quantized base", result.quantized_base)] if result.quantized_base else []),
        ("trainable / total params", f"{_num(result.trainable_params, '{:,}')} / {_num(result.total_params, '{:,}')}"),
        ("device x ranks", f"{result.device or '-'} x {result.world_size}"),
        ("start-up / build", f"{_num(phases.startup_s, '{:.2f}')} s / {_num(phases.build_s, '{:.2f}')} s"),
        ("warm-up / measure", f"{_num(phases.warmup_s, '{:.2f}')} s / {_num(phases.measure_s, '{:.2f}')} s"),
    ]
    if phases.compile_s is not None:
        payoff = (
            "never: a compiled step is no faster"
            if result.compile_payoff_steps is None
            else f"after {result.compile_payoff_steps:,} steps"
        )
        rows.append(
            (
                "compile (not in tokens/s)",
                f"{phases.compile_s:.2f} s; eager step {_num(result.eager_step_s, '{:.3f}')} s; pays off {payoff}",
            )
        )
    if result.peak_memory_per_rank:
        rows.append(("peak per rank", ", ".join(format_size(p) for p in result.peak_memory_per_rank)))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if unsettled(result.step_time_spread):
        console.print(f"[yellow]tokens/s is uncertain[/]: {_unsettled_why(result.step_time_spread)}", highlight=False)
    if result.error:
        console.print(f"[bold red]{result.status.value}[/]: last lines of the error:", highlight=False)
        console.print(result.error, markup=False, highlight=False)


# -- studies -------------------------------------------------------------------------------------
def _trains(config: TrialConfig, workload: Workload) -> str:
    return what_is_trained(config, workload)["note"]


def print_summary(summary: StudySummary, *, console: Console | None = None, all_trials: bool = True) -> None:
    """Every trial of a study, then the best config and what it trains."""
    console = console or Console(soft_wrap=True)  # long lines stay whole in logs and pipes
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log or pipe has no width: keep table rows on one line
    w = summary.workload
    console.print(f"study [bold]{summary.name}[/] in {summary.storage}", highlight=False)
    what = f"the command `{' '.join(summary.command)}`" if summary.command else w.model
    console.print(
        f"  {what}, seq {w.seq_len}{f' -> {w.target_len}' if w.target_len else ''}, "
        f"global batch {w.global_batch}, {w.nproc} rank(s)"
        f"{f' over {w.nodes} nodes ({w.ranks_per_node} each)' if w.nodes > 1 else ''} on "
        f"{summary.device.get('name')} ({summary.device.get('type')}); budget "
        f"{format_size(summary.memory_budget_bytes)}, fits under {format_size(summary.memory_limit_bytes)}; "
        f"space {summary.space}",
        highlight=False,
    )
    if summary.worker_jobs:
        console.print(f"  workers: {worker_jobs_line(summary.worker_jobs)}", highlight=False, markup=False)
    if all_trials:
        table = Table(show_edge=False)
        unit = summary.throughput_unit
        for column in ("#", "config", "status", unit, "peak memory", "fits", "re-run"):
            table.add_column(column, justify="right" if column in ("#", unit, "peak memory") else "left")
        for t in summary.trials:
            rerun = (
                "-" if t.confirmed is None else (f"{_num(t.confirmed_throughput)} {unit}" if t.confirmed else "refuted")
            )
            peak = (
                format_size(t.peak_memory_bytes)
                if t.status != "skipped"
                else f"{format_size(t.predicted_peak_bytes)} (predicted)"
            )
            table.add_row(
                str(t.number),
                t.config.describe(),
                _status(t),
                _figure(t.throughput, t.step_time_spread),
                peak,
                "yes" if t.fits else "no",
                rerun,
            )
        console.print(table)
        for t in summary.trials:
            if t.lost:
                retries = [r.number for r in summary.trials if r.retry_of == t.number]
                again = f"; measured again as trial {retries[0]}" if retries else ""
                console.print(f"  trial {t.number} lost: {t.lost}{again}", highlight=False, markup=False)
    if all_trials and any(t.status == "ok" and unsettled(t.step_time_spread) for t in summary.trials):
        console.print(
            "  ±: half the spread of a trial's step times where they never settled; such a "
            "figure is uncertain (a busy machine?)",
            highlight=False,
        )
    best = summary.best
    if best is None:
        for line in nothing_fits(summary):
            console.print(line, highlight=False, markup=False)
        return
    console.print(
        f"[bold green]best[/]: {best.config.describe()}  (trial {best.number}, confirmed in re-runs)",
        highlight=False,
    )
    if summary.certainty:
        console.print(f"  how sure: {summary.certainty}", highlight=False, markup=False)
    if summary.stopped:
        console.print(f"  search: {summary.stopped}", highlight=False, markup=False)
    samples = (
        f", {_num(best.confirmed_samples_per_s, '{:,.2f}')} samples/s" if best.throughput_unit == TOKENS_PER_S else ""
    )
    console.print(
        f"  {_num(best.confirmed_throughput)} {best.throughput_unit}{samples}, "
        f"peak {format_size(best.confirmed_peak_memory_bytes)} of "
        f"{format_size(summary.memory_budget_bytes)}; accumulation "
        f"{best.config.grad_accum_steps(summary.workload)}",
        highlight=False,
    )
    console.print(f"  trains: {_trains(best.config, summary.workload)}", highlight=False)


def worker_jobs_line(jobs: list[dict[str, Any]]) -> str:
    """The SLURM jobs that ran workers on a study, e.g. ``SLURM jobs 12 (worker 1 on node3), 13 (...)``."""
    return "SLURM jobs " + ", ".join(
        f"{job['job']} (worker {job.get('worker') or '?'} on {job.get('host') or '?'}"
        + (f", requeued {job['restarts']}x" if job.get("restarts") else "")
        + ")"
        for job in jobs
    )


def _status(t: TrialRecord) -> str:
    """A trial's status, saying when its worker was lost and which trial a retry measures again."""
    if t.lost:
        return f"{t.status} (worker lost)"
    return t.status if t.retry_of is None else f"{t.status} (retry of {t.retry_of})"


def nothing_fits(summary: StudySummary) -> list[str]:
    """Why there is no answer: what was tried, the smallest peak against the limit, what to change."""
    trials = summary.trials
    if summary.n_trials == 0 and not any(t.status == "skipped" for t in trials):
        return ["no confirmed config yet: no trial measured"]
    counts: dict[str, int] = {}
    for t in trials:
        key = "over the memory limit" if t.status == "ok" and not t.fits else t.status
        if t.status == "ok" and t.fits:
            key = "fit, refuted on the re-run" if t.confirmed is False else "fit, not confirmed yet"
        counts[key] = counts.get(key, 0) + 1
    tally = ", ".join(f"{n} {what}" for what, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if counts.get("fit, not confirmed yet"):  # configs fit: what is missing is their re-run, not memory
        return [
            f"no confirmed config yet: {summary.n_trials} trials measured ({tally}); "
            "run the same command without --no-confirm to re-run the fastest and confirm it"
        ]
    lines = [f"no config fits: {summary.n_trials} trials measured ({tally})"]
    peaks = [
        (t.peak_memory_bytes, t.config, "measured")
        for t in trials
        if t.status == "ok" and t.peak_memory_bytes is not None
    ]
    peaks += [
        (t.predicted_peak_bytes, t.config, "predicted")
        for t in trials
        if t.status == "skipped" and t.predicted_peak_bytes is not None
    ]
    limit = summary.memory_limit_bytes
    if peaks:
        peak, config, how = min(peaks, key=lambda p: p[0])
        headroom = 1 - limit / summary.memory_budget_bytes
        lines.append(
            f"  smallest peak seen: {format_size(peak)} ({how}, {config.describe()}) against the limit "
            f"{format_size(limit)} ({format_size(summary.memory_budget_bytes)} budget less "
            f"{headroom:.0%} headroom)"
        )
        if peak > limit:
            lines.append(f"  to fit it: --memory-budget {format_size(int(peak / (1 - headroom)) + 1)} or more")
    elif counts.get("oom"):
        lines.append(
            f"  every measured config ran out of memory under the {format_size(summary.memory_budget_bytes)} "
            "budget: raise --memory-budget"
        )
    untried = [
        hint
        for used, hint in (
            (any(t.config.checkpointing for t in trials), "activation checkpointing (checkpointing: [false, true])"),
            (any(t.config.sixteen_bit for t in trials), "a 16-bit precision (precision: [bf16])"),
            (any(t.config.uses_lora for t in trials), "LoRA (--space lora)"),
            (
                any(t.config.uses_deepspeed or t.config.uses_fsdp for t in trials) or summary.workload.nproc == 1,
                "ZeRO or FSDP sharding over the ranks (--space sharding)",
            ),
        )
        if not used
    ]
    if untried:
        lines.append("  knobs that save memory and were not tried: " + "; ".join(untried))
    if counts.get("fit, refuted on the re-run"):
        lines.append(
            "  configs that fit in their trial ran out of room on a re-run: "
            "a larger --memory-budget or a lower --headroom leaves them room"
        )
    return lines


class ConsoleProgress:
    """The tuner's progress as one line per event; on a terminal, a spinner with the trial's time too.

    Plain lines when not on a terminal (logs, pipes). Use as a context manager so that the
    spinner is gone however the tuning ends (Ctrl-C included).
    """

    def __init__(self, console: Console | None = None, *, prefix: str = "") -> None:
        self.console = console or Console(stderr=True, soft_wrap=True)  # one line per event, even in a log
        self.prefix = prefix  # a helper worker's lines say whose they are (and it draws no spinner)
        self._spinner: Progress | None = None

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_spinner()

    def started(self, *, study: str, storage: str, measured: int, target: int, recovered: list[int]) -> None:
        self._say(f"study {study} in {storage}: {measured} of {target} trials measured")
        if recovered:
            self._say(f"  trial(s) {', '.join(map(str, recovered))} were interrupted; retrying their configs")

    def lost(self, *, numbers: list[int]) -> None:
        self._say(f"trial(s) {', '.join(map(str, numbers))} lost their worker (killed or stopped); re-queued once")

    def trial_started(self, *, index: int, target: int, config: TrialConfig, retry: bool) -> None:
        text = f"trial {index}/{target}: {config.describe()}" + ("  (retry)" if retry else "")
        self._say(text)
        self._start_spinner(f"measuring {config.describe()}")

    def trial_finished(
        self, *, record: TrialRecord, best: TrialRecord | None, elapsed_s: float, leading: TrialRecord | None = None
    ) -> None:
        self._stop_spinner()
        figure = f"{_num(record.throughput)} {record.throughput_unit}" if record.throughput is not None else "no figure"
        fit = "" if record.status != "ok" else ("" if record.fits else ", over the memory limit")
        best_text = (
            f"{best.config.describe()} at {_num(best.throughput)} {best.throughput_unit}" if best else "none fits yet"
        )
        if best is not None and leading is not None and best.throughput and leading.throughput:
            gain = leading.throughput / best.throughput - 1
            best_text += f" (ahead on one measurement: {leading.config.describe()} {gain:+.0%}, re-runs decide)"
        warning = (
            f" (uncertain: {_unsettled_why(record.step_time_spread)})" if unsettled(record.step_time_spread) else ""
        )
        if record.outpaced:
            warning = " (one timed step: far slower than the best, not worth more)"
        self._say(
            f"  -> {record.status}: {figure}, peak {format_size(record.peak_memory_bytes)}{fit}; "
            f"best so far {best_text}; {elapsed_s:.0f} s elapsed{warning}"
        )

    def simple_answer(self, *, record: TrialRecord | None, elapsed_s: float, accumulation: int) -> None:
        if record is None:
            self._say("simple answer: no power-of-two micro batch fits at the space's default knobs")
            return
        self._say(
            f"simple answer (the largest power-of-two micro batch that fits, default knobs): "
            f"{record.config.describe()} x{accumulation} at {_num(record.throughput)} {record.throughput_unit}, "
            f"{elapsed_s:.0f} s elapsed; the search replaces it only with a config that beats it in re-runs"
        )

    def skipped(self, *, record: TrialRecord, limit_bytes: int) -> None:
        self._say(
            f"skipped {record.config.describe()}: predicted peak "
            f"{format_size(record.predicted_peak_bytes)} is over the limit {format_size(limit_bytes)}"
        )

    def confirming(self, *, record: TrialRecord, steps: int) -> None:
        self._stop_spinner()
        self._say(f"re-running {record.config.describe()} with {steps} steps (close candidates take turns)")
        self._start_spinner(f"re-running {record.config.describe()}")

    def dropped(self, *, reasons: list[str]) -> None:
        for reason in reasons:
            self._say(f"not searched: {reason}")

    def space_kept(self, *, name: str, added: list[str]) -> None:
        grown = f" (it now also searches {', '.join(added)})" if added else ""
        self._say(
            f"space {name}: this study goes on with the {name} space it was started with{grown}; "
            "a new --study searches the grown space"
        )

    def standing(self, *, text: str) -> None:
        self._say(f"     how sure: {text}")

    def stopped(self, *, reason: str) -> None:
        self._say(f"stopped: {reason}")

    def _say(self, text: str) -> None:
        self.console.print(self.prefix + text, highlight=False, markup=False)

    def _start_spinner(self, text: str) -> None:
        if not self.console.is_terminal or self.prefix:
            return
        self._spinner = Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console, transient=True
        )
        self._spinner.add_task(text, total=None)
        self._spinner.start()

    def _stop_spinner(self) -> None:
        if self._spinner is not None:
            self._spinner.stop()
            self._spinner = None


def _grouped(reasons: list[str]) -> dict[str, list[str]]:
    """'family: reason' lines by reason, so that one reason is said once."""
    grouped: dict[str, list[str]] = {}
    for line in reasons:
        family, _, why = line.partition(": ")
        grouped.setdefault(why, []).append(family)
    return grouped


def _plan_config(row: PlanRow) -> str:
    """The row's config in describe() words; where it stands for a twin too, the word they differ in as
    ``own/twin`` (``mb=2 bf16/fp16 zero1``)."""
    words = row.config.describe().split()
    if row.twin is None:
        return " ".join(words)
    theirs = row.twin.describe().split()
    if len(theirs) != len(words):
        return f"{' '.join(words)} (or {' '.join(theirs)})"
    return " ".join(own if own == twin else f"{own}/{twin}" for own, twin in zip(words, theirs, strict=True))


def print_plan(plan: Plan, workload: Workload, *, console: Console | None = None, top: int = 20) -> None:
    """``find --plan``: the fitting configs, fastest first (the first ``top``), and what the figures are."""
    from autotune.search.plan import PLAN_ERROR

    shown = plan.rows[:top]
    longest = max((len(_plan_config(row)) for row in shown), default=0)
    # One line per config, piped or not: the other columns take about 100 characters.
    console = console or Console(width=max(Console().width, 132, longest + 100))
    per = f"/s per {'GPU' if workload.device != 'cpu' else 'rank'}"
    unit = "tokens" if any(row.step.tokens_per_s for row in plan.rows) else "samples"
    nodes = f", {workload.nodes} nodes of {workload.ranks_per_node}" if workload.nodes > 1 else ""
    table = Table(title=f"plan for {workload.model} on {workload.nproc} x {plan.device}{nodes} (nothing was run)")
    for name in ("", "config", f"{unit}{per}", "step", "MFU", "memory", "nvidia-smi", "headroom", ""):
        table.add_column(name, justify="left" if name in ("", "config") else "right", no_wrap=True)
    for rank, row in enumerate(shown, start=1):
        per_step = row.step.tokens_per_s if unit == "tokens" else row.step.samples_per_s
        assert per_step is not None  # one workload: every row counts tokens, or none does
        figure = per_step / workload.nproc
        table.add_row(
            str(rank),
            _plan_config(row),
            f"{figure:,.0f}",
            f"{row.step.step_s:.3g} s",
            _num(row.step.mfu, "{:.0%}"),
            format_size(row.memory_bytes) + ("" if row.estimated else "~"),
            format_size(row.device_bytes) if row.device_bytes is not None else "-",
            format_size(plan.limit_bytes - row.memory_bytes),
            "verify first" if row.verify_first else "",
        )
    console.print(table)
    console.print(
        f"{plan.fitting} configs predicted to fit under {format_size(plan.limit_bytes)} "
        f"({format_size(plan.memory_budget_bytes)} less the headroom), in {len(plan.rows)} rows, {len(shown)} "
        f"shown; {plan.too_big} "
        f"predicted not to; {plan.estimates} estimates in {plan.seconds:.0f} s"
        + (
            f" ({plan.states_over} families not traced: their model states alone are over the limit)"
            if plan.states_over
            else ""
        )
    )
    if plan.slower:
        console.print(
            f"not traced: {plan.slower} configs of {plan.slower_families} families of a slower precision, whose "
            f"matmuls alone (a faster sibling's, at their own rate) take longer than the top row's step by more than "
            f"the model's {PLAN_ERROR:.0%} error: none could be verified first"
        )
    if plan.twin_note:
        console.print(f"a/b: {plan.twin_note}")
    console.print(
        f"memory: what the caching allocator reserves (~: its family's straight line through an estimate); "
        f"verify first: within the model's {PLAN_ERROR:.0%} error of the top one: the trials to run on the card"
    )
    console.print(f"step time: the traced step's operators timed against {plan.profile_source}")
    for why, families in _grouped(plan.not_estimated).items():
        console.print(
            f"not planned ({len(families)} families: {', '.join(families[:3])}"
            f"{', ...' if len(families) > 3 else ''}): {why}"
        )
