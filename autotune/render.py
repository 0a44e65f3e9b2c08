"""Human-readable output (Rich tables); the JSON forms come from the result types themselves."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autotune.result import TrialResult
from autotune.sizes import format_size
from autotune.workload import Workload

__all__ = ["print_trial"]


def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def print_trial(workload: Workload, result: TrialResult, *, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"trial: {result.config.describe()}  on {workload.model}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    phases = result.phases
    rows = [
        ("status", result.status.value),
        ("tokens/s", _num(result.tokens_per_s)),
        ("samples/s", _num(result.samples_per_s, "{:,.2f}")),
        ("step time (median ± IQR)", "-" if result.step_time_median_s is None else
         f"{result.step_time_median_s * 1000:.1f} ms ± {result.step_time_iqr_s * 1000:.1f} ms"),
        ("measured steps", f"{result.measured_steps} x {result.grad_accum_steps or '-'} micro-steps"),
        ("peak memory", format_size(result.peak_memory_bytes) + ("" if result.peak_reserved_bytes is None
                                                                 else " (reserved)")),
        ("peak allocated", format_size(result.peak_allocated_bytes)),
        ("memory budget", format_size(result.memory_budget_bytes)),
        ("optimizer state", format_size(result.optimizer_state_bytes)),
        ("trainable / total params", f"{_num(result.trainable_params, '{:,}')} / {_num(result.total_params, '{:,}')}"),
        ("device x ranks", f"{result.device or '-'} x {result.world_size}"),
        ("start-up / build", f"{_num(phases.startup_s, '{:.2f}')} s / {_num(phases.build_s, '{:.2f}')} s"),
        ("warm-up / measure", f"{_num(phases.warmup_s, '{:.2f}')} s / {_num(phases.measure_s, '{:.2f}')} s"),
    ]
    if result.peak_memory_per_rank:
        rows.append(("peak per rank", ", ".join(format_size(p) for p in result.peak_memory_per_rank)))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if result.error:
        console.print(f"[bold red]{result.status.value}[/]: last lines of the error:", highlight=False)
        console.print(result.error, markup=False, highlight=False)
