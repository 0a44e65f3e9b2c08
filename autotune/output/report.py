"""A study as one self-contained HTML page: header, three plots and a table of every trial.

The page embeds plotly.js once, so it opens offline and can be mailed or attached to an issue.
Plotly is imported inside the functions that draw, so ``import autotune.output.report`` stays cheap.
Every piece of text that comes from the study (its name, error messages, knob names) is
escaped: a study name is whatever the user typed.
"""

from __future__ import annotations

import html
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.sizes import format_size
from autotune.study.summary import StudySummary, TrialRecord, what_is_trained

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from autotune.config.workload import Workload

__all__ = ["render_report", "write_report"]

THROUGHPUT_TITLE = "Throughput per trial"
MEMORY_TITLE = "Memory against throughput"
IMPORTANCE_TITLE = "Parameter importance"
NO_BEST_TEXT = "No configuration fits yet"
NO_IMPORTANCE_TEXT = (
    "Parameter importance needs at least a few completed trials with varied knobs; this study does not have them yet."
)
FEW_VARIED_TEXT = "Parameter importance compares knobs that varied; among the trials with a throughput, {what}."
REFUTED_LABEL = "refuted by its re-run"

_MIB = 2**20
_PLOT_HEIGHT = 440
_ERROR_CHARS = 160
# status -> (colour, marker symbol); a status not listed here gets _OTHER_STYLE.
_STATUS_STYLE = {
    "ok": ("#1f77b4", "circle"),
    "oom": ("#d62728", "x"),
    "timeout": ("#ff7f0e", "hourglass"),
    "crashed": ("#7f7f7f", "triangle-down"),
    "nan": ("#9467bd", "diamond"),
    "error": ("#8c564b", "square"),
    "interrupted": ("#bcbd22", "circle-open"),
    "running": ("#17becf", "circle-open-dot"),
}
_OTHER_STYLE = ("#7f7f7f", "circle-open")
_OVER_LIMIT_SYMBOL = "circle-open"
_REFUTED_STYLE = ("#e377c2", "circle-x-open")
_BEST_STYLE = ("#e6b800", "star")
_Y_PAD = (0.05, 0.08)  # share of the top below 0 and above the top: markers at 0 or the top drawn whole

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: .2rem; } h2 { margin-top: 2.2rem; }
dl { display: grid; grid-template-columns: max-content auto; gap: .25rem 1rem; }
dt { font-weight: 600; } dd { margin: 0; }
.best { background: #fff7d6; border-left: 4px solid #e6b800; padding: .6rem 1rem; }
.note { color: #555; font-style: italic; }
table { border-collapse: collapse; width: 100%; font-size: .9rem; }
th, td { border-bottom: 1px solid #ddd; padding: .3rem .5rem; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best-row { background: #fff7d6; font-weight: 600; }
"""


# -- public API ---------------------------------------------------------------------------------


def render_report(summary: StudySummary) -> str:
    """A self-contained HTML page (plotly.js embedded, works offline) for one study."""
    importances, few_varied = _varied_importances(summary)
    importance = _importance_figure(importances)
    figures = [_throughput_figure(summary), _memory_figure(summary)]
    if importance is not None:
        figures.append(importance)
    divs = [_figure_html(fig, include_plotlyjs=i == 0) for i, fig in enumerate(figures)]
    sections = [
        _header_html(summary),
        _section(THROUGHPUT_TITLE, divs[0]),
        _section(MEMORY_TITLE, divs[1] + _memory_note(summary)),
        _section(
            IMPORTANCE_TITLE,
            divs[2] if importance is not None else f'<p class="note">{_esc(few_varied or NO_IMPORTANCE_TEXT)}</p>',
        ),
        _section("All trials", _trials_table(summary)),
    ]
    return _page(title=f"autotune report: {summary.name}", body="\n".join(sections))


def write_report(summary: StudySummary, path: str | Path) -> Path:
    """Write render_report() atomically (temp file + os.replace), creating parent dirs; return the path."""
    path = Path(path)
    _write_atomically(path, render_report(summary))
    return path


# -- the page -----------------------------------------------------------------------------------


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _page(*, title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


def _section(title: str, content: str) -> str:
    return f"<section>\n<h2>{_esc(title)}</h2>\n{content}\n</section>"


def _header_html(summary: StudySummary) -> str:
    w = summary.workload
    measured = summary.n_trials
    rows = [
        ("model", f"{w.model} ({w.task or 'task inferred from the model'})"),
        (
            "workload",
            f"seq_len {w.seq_len}{f', target_len {w.target_len}' if w.target_len else ''}, "
            f"global batch {w.global_batch}, {w.nproc} rank(s) per trial"
            f"{f' over {w.nodes} nodes' if w.nodes > 1 else ''}, "
            f"{w.optimizer}",
        ),
        ("device", _describe_device(summary.device)),
        (
            "memory",
            f"budget {format_size(summary.memory_budget_bytes)}, limit "
            f"{format_size(summary.memory_limit_bytes)} (budget minus headroom: a config fits below it)",
        ),
        (
            "trials",
            f"{measured} measured"
            + ("" if measured == len(summary.trials) else f" ({len(summary.trials)} in the study)"),
        ),
        ("search space", summary.space),
        ("storage", summary.storage),
    ]
    items = "\n".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in rows)
    return (
        f"<header>\n<h1>autotune report: {_esc(summary.name)}</h1>\n<dl>\n{items}\n</dl>\n"
        f"{_best_html(summary.best, summary.workload)}\n</header>"
    )


def _describe_device(device: dict[str, Any]) -> str:
    name = device.get("name") or device.get("type") or "unknown device"
    count = device.get("count")
    parts = [str(name) + (f" x {count}" if count else "")]
    if device.get("type") and device.get("type") != name:
        parts.append(str(device["type"]))
    if device.get("total_memory_bytes") is not None:
        parts.append(f"{format_size(device['total_memory_bytes'])} each")
    return ", ".join(parts)


def _best_html(best: TrialRecord | None, workload: Workload) -> str:
    if best is None:
        return f'<p class="best">{_esc(NO_BEST_TEXT)}: no trial has been confirmed under the memory limit.</p>'
    trains = what_is_trained(best.config, workload)
    return (
        f'<p class="best">Best: <strong>{_esc(best.config.describe())}</strong> (trial {best.number}): '
        f"{_esc(_num(best.confirmed_throughput))} {best.throughput_unit} confirmed, peak memory "
        f"{_esc(format_size(best.confirmed_peak_memory_bytes))}. Trains: {_esc(trains['note'])}.</p>"
    )


def _memory_note(summary: StudySummary) -> str:
    missing = [t for t in summary.trials if t.peak_memory_bytes is None and t.status != "oom"]
    if not missing:
        return ""
    statuses = ", ".join(sorted({t.status for t in missing}))
    return (
        f'<p class="note">{len(missing)} trial(s) without a memory figure ({_esc(statuses)}) '
        "are not drawn here; see the table.</p>"
    )


def _trials_table(summary: StudySummary) -> str:
    if not summary.trials:
        return '<p class="note">No trials yet.</p>'
    head = (
        "number",
        "config",
        "status",
        summary.throughput_unit,
        "peak memory",
        "fits",
        "confirmed",
        "error (last line)",
    )
    best_number = summary.best.number if summary.best is not None else None
    rows = []
    for t in _by_number(summary.trials):
        cells = [
            f'<td class="num">{t.number}</td>',
            f"<td>{_esc(t.config.describe())}</td>",
            f"<td>{_esc(t.status)}</td>",
            f'<td class="num">{_esc(_num(t.throughput))}</td>',
            f'<td class="num">{_esc(format_size(t.peak_memory_bytes))}</td>',
            f"<td>{'yes' if t.fits else 'no'}</td>",
            f"<td>{_esc(_confirmed(t))}</td>",
            f"<td>{_esc(_last_line(t.error) or '')}</td>",
        ]
        css = ' class="best-row"' if t.number == best_number else ""
        rows.append(f"<tr{css}>{''.join(cells)}</tr>")
    header = "".join(f"<th>{_esc(h)}</th>" for h in head)
    return f"<table>\n<thead><tr>{header}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"


def _confirmed(t: TrialRecord) -> str:
    if t.confirmed is None:
        return "-"
    if not t.confirmed:
        if t.confirmed_peak_memory_bytes is None:
            return "refuted: the re-run did not train"
        return (
            f"refuted: the re-run read {_num(t.confirmed_throughput)} {t.throughput_unit}, "
            f"{format_size(t.confirmed_peak_memory_bytes)}"
        )
    return f"yes: {_num(t.confirmed_throughput)} {t.throughput_unit}, {format_size(t.confirmed_peak_memory_bytes)}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _last_line(error: str | None) -> str | None:
    lines = [line for line in (error or "").splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[-1].strip()
    return line if len(line) <= _ERROR_CHARS else line[: _ERROR_CHARS - 1] + "…"


def _by_number(trials: Iterable[TrialRecord]) -> list[TrialRecord]:
    return sorted(trials, key=lambda t: t.number)


# -- the figures --------------------------------------------------------------------------------


def _figure_html(fig: go.Figure, *, include_plotlyjs: bool) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig, full_html=False, include_plotlyjs=include_plotlyjs, config={"displaylogo": False, "responsive": True}
    )


def _plot_text(value: Any) -> str:
    """Text for plotly's hover labels, which read a little HTML: show it literally instead."""
    return html.escape(str(value), quote=False)


def _hover(t: TrialRecord) -> str:
    lines = [
        f"trial {t.number}: {t.config.describe()}",
        f"status: {t.status}",
        f"{t.throughput_unit}: {_num(t.throughput)}",
        f"peak memory: {format_size(t.peak_memory_bytes)}",
        f"fits: {'yes' if t.fits else 'no'}",
    ]
    if t.confirmed is not None:
        lines.append(f"confirmed: {_confirmed(t)}")
    if _last_line(t.error):
        lines.append(f"error: {_last_line(t.error)}")
    return "<br>".join(_plot_text(line) for line in lines)


def _group(t: TrialRecord) -> tuple[str, tuple[str, str]]:
    """The legend entry a trial is drawn under, and its (colour, marker symbol)."""
    colour, symbol = _STATUS_STYLE.get(t.status, _OTHER_STYLE)
    if t.confirmed is False:  # fitted once, then its re-run did not fit or did not train
        return REFUTED_LABEL, _REFUTED_STYLE
    if t.throughput is not None and not t.fits:
        return f"{t.status}, over the memory limit", (colour, _OVER_LIMIT_SYMBOL)
    return t.status, (colour, symbol)


def _grouped(trials: Iterable[TrialRecord]) -> dict[tuple[str, tuple[str, str]], list[TrialRecord]]:
    groups: dict[tuple[str, tuple[str, str]], list[TrialRecord]] = {}
    for t in _by_number(trials):
        groups.setdefault(_group(t), []).append(t)
    return groups


def _scatter_traces(
    trials: Iterable[TrialRecord],
    *,
    x: Callable[[TrialRecord], float],
    y: Callable[[TrialRecord], float],
    suffix: str = "",
) -> list[go.Scatter]:
    import plotly.graph_objects as go

    traces = []
    for (label, (colour, symbol)), group in _grouped(trials).items():
        traces.append(
            go.Scatter(
                x=[x(t) for t in group],
                y=[y(t) for t in group],
                mode="markers",
                name=_plot_text(label + suffix),
                hovertext=[_hover(t) for t in group],
                hoverinfo="text",
                marker={"color": colour, "symbol": symbol, "size": 10, "line": {"width": 1.5, "color": colour}},
            )
        )
    return traces


def _throughput_of(trial: TrialRecord) -> float:
    assert trial.throughput is not None  # drawn only from the trials with a throughput
    return trial.throughput


def _peak_mib(trial: TrialRecord) -> float:
    assert trial.peak_memory_bytes is not None  # drawn only from the trials with a peak
    return trial.peak_memory_bytes / _MIB


def _best_trace(best: TrialRecord, *, x: float, y: float) -> go.Scatter:
    import plotly.graph_objects as go

    colour, symbol = _BEST_STYLE
    return go.Scatter(
        x=[x],
        y=[y],
        mode="markers",
        name="best (confirmed)",
        hovertext=[_hover(best)],
        hoverinfo="text",
        marker={"color": colour, "symbol": symbol, "size": 20, "line": {"width": 1, "color": "#333"}},
    )


def _base_layout(*, title: str, x_title: str, y_title: str) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "height": _PLOT_HEIGHT,
        "template": "plotly_white",
        "xaxis": {"title": {"text": x_title}},
        "yaxis": {"title": {"text": y_title}, "rangemode": "tozero"},
        # Entries without a group are each a group of one: the default 10 px between groups spreads them out.
        "legend": {"title": {"text": "status"}, "tracegroupgap": 2},
        "hovermode": "closest",
    }


def _padded_y_range(values: Iterable[float | None]) -> list[float]:
    """From a little below 0 to a little above the top: rangemode "tozero" would cut the markers at 0 in half."""
    top = max((v for v in values if v is not None), default=0.0) or 1.0
    return [-_Y_PAD[0] * top, (1 + _Y_PAD[1]) * top]


def _best_in_trials(summary: StudySummary) -> TrialRecord | None:
    """The best as recorded among the trials (its first measurement), or the summary's own record."""
    if summary.best is None:
        return None
    same = [t for t in summary.trials if t.number == summary.best.number]
    return same[0] if same else summary.best


def _throughput_figure(summary: StudySummary) -> go.Figure:
    """Throughput (tokens/s, images/s...) by trial number.

    Trials without a figure sit on the x axis, never at an invented height.
    """
    import plotly.graph_objects as go

    measured = [t for t in summary.trials if t.throughput is not None]
    failed = [t for t in summary.trials if t.throughput is None]
    fig = go.Figure(
        layout=_base_layout(title=THROUGHPUT_TITLE, x_title="trial number", y_title=summary.throughput_unit)
    )
    for trace in _scatter_traces(measured, x=lambda t: t.number, y=_throughput_of):
        fig.add_trace(trace)
    for trace in _scatter_traces(failed, x=lambda t: t.number, y=lambda t: 0, suffix=" (no throughput)"):
        fig.add_trace(trace)
    best = _best_in_trials(summary)
    ys = [t.throughput for t in measured]
    if best is not None:
        y = best.throughput if best.throughput is not None else best.confirmed_throughput
        if y is not None:
            fig.add_trace(_best_trace(best, x=best.number, y=y))
            ys.append(y)
    numbers = [t.number for t in summary.trials]
    if numbers:  # half a trial either side: trial 0 and the last one are drawn whole
        fig.update_xaxes(range=[min(numbers) - 0.5, max(numbers) + 0.5])
    fig.update_yaxes(range=_padded_y_range(ys))
    return fig


def _memory_figure(summary: StudySummary) -> go.Figure:
    """Throughput against peak MiB, with the budget and the limit drawn; OOM trials sit on the x axis."""
    import plotly.graph_objects as go

    budget_mib = summary.memory_budget_bytes / _MIB
    both = [t for t in summary.trials if t.throughput is not None and t.peak_memory_bytes is not None]
    peak_only = [t for t in summary.trials if t.throughput is None and t.peak_memory_bytes is not None]
    oom_no_peak = [
        t for t in summary.trials if t.status == "oom" and t.throughput is None and t.peak_memory_bytes is None
    ]
    fig = go.Figure(
        layout=_base_layout(title=MEMORY_TITLE, x_title="peak memory (MiB)", y_title=summary.throughput_unit)
    )
    for trace in _scatter_traces(both, x=_peak_mib, y=_throughput_of):
        fig.add_trace(trace)
    for trace in _scatter_traces(peak_only, x=_peak_mib, y=lambda t: 0, suffix=" (no throughput)"):
        fig.add_trace(trace)
    for trace in _scatter_traces(
        oom_no_peak, x=lambda t: budget_mib, y=lambda t: 0, suffix=" (no peak recorded: drawn at the budget)"
    ):
        fig.add_trace(trace)
    best = _best_in_trials(summary)
    if best is not None and best.throughput is not None and best.peak_memory_bytes is not None:
        fig.add_trace(_best_trace(best, x=best.peak_memory_bytes / _MIB, y=best.throughput))
    _add_memory_lines(fig, budget=summary.memory_budget_bytes, limit=summary.memory_limit_bytes)
    fig.update_yaxes(range=_padded_y_range(t.throughput for t in both))
    return fig


def _budget_label(budget: int) -> str:
    return f"memory budget {format_size(budget)}"


def _limit_label(limit: int) -> str:
    return f"memory limit {format_size(limit)} (budget minus headroom)"


def _add_memory_lines(fig: go.Figure, *, budget: int, limit: int) -> None:
    """The two lines, named in the legend: a label on the plot would sit on the points near them,
    and the best config is by design the one closest to the limit."""
    for x, label, line in (
        (limit, _limit_label(limit), {"color": "#ff7f0e", "dash": "dot"}),
        (budget, _budget_label(budget), {"color": "#d62728", "dash": "dash"}),
    ):
        fig.add_vline(
            x=x / _MIB,
            line=line,
            name=_plot_text(label),
            showlegend=True,
            legendgroup="lines",
            legendgrouptitle={"text": "memory"},
        )


def _varied_importances(summary: StudySummary) -> tuple[dict[str, float] | None, str | None]:
    """fANOVA's shares for the knobs that took more than one value among the trials with a
    throughput (the ones it explains), rescaled to sum to 1; or, when fewer than two knobs varied,
    no shares and a sentence saying so. fANOVA credits a knob that never varied with a share of
    the variance; such a knob explains none of it."""
    if not summary.importances:
        return None, None
    from autotune.search.space import SearchSpace

    values: dict[str, set[Any]] = {}
    for t in summary.trials:
        if t.status == "ok" and t.throughput is not None:
            for name, value in SearchSpace.params_of(t.config).items():
                values.setdefault(name, set()).add(value)
    # A name the trials do not show (not one of the tuner's parameters) is kept: nothing says it stayed put.
    varied = {k: v for k, v in summary.importances.items() if k not in values or len(values[k]) > 1}
    if len(varied) < 2:
        what = (f"only {', '.join(varied)} varied" if varied else "no knob varied") + "".join(
            f"; {k} was always {next(iter(values[k]))}" for k in summary.importances if k not in varied
        )
        return None, FEW_VARIED_TEXT.format(what=what)
    total = sum(varied.values())
    return ({k: v / total for k, v in varied.items()} if total > 0 else varied), None


def _importance_figure(importances: dict[str, float] | None) -> go.Figure | None:
    """Horizontal bars, largest on top; None when there is nothing to draw."""
    if not importances:
        return None
    import plotly.graph_objects as go

    ranked = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(
        go.Bar(
            x=[v for _, v in ranked],
            y=[_plot_text(k) for k, _ in ranked],
            orientation="h",
            marker={"color": "#1f77b4"},
            hovertemplate="%{y}: %{x:.1%}<extra></extra>",
        ),
        layout={
            "title": {"text": IMPORTANCE_TITLE},
            "template": "plotly_white",
            "height": max(240, 60 + 40 * len(ranked)),
            "xaxis": {"title": {"text": "share of throughput variance (fANOVA)"}, "tickformat": ".0%"},
        },
    )
    return fig


# -- writing ------------------------------------------------------------------------------------


def _write_atomically(path: Path, text: str) -> None:
    """Write beside the target, then rename over it: a reader never sees half a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
