"""The HTML report, rendered from hand-built summaries (no trials run, no Optuna)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.output import report
from autotune.output.report import render_report, write_report
from autotune.study.summary import StudySummary, TrialRecord

GIB = 2**30
MIB = 2**20
EVIL_NAME = 'demo <script>alert("pwned")</script>'
PLOTLY_JS_BANNER = "* plotly.js v"  # the licence banner at the top of the embedded bundle

BEST = TrialRecord(
    number=2,
    config=TrialConfig(micro_batch=4, precision="bf16", checkpointing=True, lora_rank=16),
    status="ok",
    tokens_per_s=9000.0,
    peak_memory_bytes=10 * GIB,
    fits=True,
    confirmed=True,
    confirmed_tokens_per_s=8800.0,
    confirmed_peak_memory_bytes=11 * GIB,
)
TRIALS = [
    TrialRecord(
        number=0,
        config=TrialConfig(micro_batch=1),
        status="ok",
        tokens_per_s=3000.0,
        peak_memory_bytes=5 * GIB,
        fits=True,
    ),
    TrialRecord(
        number=1,
        config=TrialConfig(micro_batch=2),
        status="ok",
        tokens_per_s=5000.0,
        peak_memory_bytes=23 * GIB,
        fits=False,
    ),
    BEST,
    TrialRecord(
        number=3,
        config=TrialConfig(micro_batch=8),
        status="oom",
        peak_memory_bytes=24 * GIB,
        error="Traceback (most recent call last):\ntorch.OutOfMemoryError: <b>CUDA</b> out of memory",
    ),
    TrialRecord(number=4, config=TrialConfig(micro_batch=16), status="oom"),
    TrialRecord(
        number=5, config=TrialConfig(micro_batch=2, precision="fp16"), status="timeout", error="killed after 60 s"
    ),
]


def _summary(**changes) -> StudySummary:
    fields = dict(
        name=EVIL_NAME,
        storage="sqlite:///storage/autotune.db",
        workload=Workload(seq_len=512, global_batch=32),
        space="default",
        device={"type": "cuda", "name": "NVIDIA H100", "count": 1, "total_memory_bytes": 80 * GIB},
        memory_budget_bytes=24 * GIB,
        memory_limit_bytes=20 * GIB,
        trials=TRIALS,
        best=BEST,
        importances={"micro_batch": 0.7, "precision": 0.2, "checkpointing": 0.1},
    )
    fields.update(changes)
    return StudySummary(**fields)


@pytest.fixture(scope="module")
def page() -> str:
    return render_report(_summary())


@pytest.fixture(scope="module")
def page_without_best() -> str:
    return render_report(_summary(name="fresh", best=None, importances=None, trials=TRIALS[3:]))


def _json_text(text: str) -> str:
    """A string as plotly writes it into the page's JSON (it escapes / < > against </script>)."""
    return '"' + text.replace("/", "\\u002f") + '"'


def test_page_has_the_three_plots_the_best_and_the_memory_lines(page):
    for title in (report.THROUGHPUT_TITLE, report.MEMORY_TITLE, report.IMPORTANCE_TITLE):
        assert f"<h2>{title}</h2>" in page
        assert '"title":{"text":' + _json_text(title) in page
    assert page.count("Plotly.newPlot(") == 3
    assert "<strong>mb=4 bf16 ckpt lora16</strong> (trial 2)" in page
    assert "8,800.0 tokens/s confirmed, peak memory 11.0 GiB" in page
    assert (
        "LoRA r=16 adapters only, on c_attn (PEFT&#x27;s default targets for gpt2), trained in bf16 mixed precision"
        in page
    )
    assert '"name":"memory budget 24.0 GiB"' in page
    assert '"name":"memory limit 20.0 GiB (budget minus headroom)"' in page
    assert "seq_len 512, global batch 32, 1 rank(s) per trial" in page
    assert "6 measured" in page


def test_plotly_js_is_embedded_exactly_once(page, page_without_best):
    assert page.count(PLOTLY_JS_BANNER) == 1
    assert page_without_best.count(PLOTLY_JS_BANNER) == 1
    assert "<script src" not in page  # offline: no script fetched from a CDN


def test_user_text_is_escaped(page):
    assert EVIL_NAME not in page
    assert "<h1>autotune report: demo &lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;</h1>" in page
    assert "<title>autotune report: demo &lt;script&gt;" in page
    assert "<b>CUDA</b>" not in page
    assert "<td>torch.OutOfMemoryError: &lt;b&gt;CUDA&lt;/b&gt; out of memory</td>" in page
    # In hover labels too, where plotly would otherwise render the <b> as bold.
    assert "torch.OutOfMemoryError: &lt;b&gt;CUDA&lt;\\u002fb&gt; out of memory" in page


def test_table_lists_every_trial_and_marks_the_best(page):
    assert page.count("<tr>") + page.count('<tr class="best-row">') == len(TRIALS) + 1  # + header row
    assert '<tr class="best-row"><td class="num">2</td><td>mb=4 bf16 ckpt lora16</td><td>ok</td>' in page
    assert "<td>yes: 8,800.0 tokens/s, 11.0 GiB</td>" in page
    assert (
        '<td class="num">5</td><td>mb=2 fp16</td><td>timeout</td><td class="num">-</td>'
        '<td class="num">-</td><td>no</td>'
    ) in page


def test_page_without_best_or_importances_says_why(page_without_best):
    assert report.NO_BEST_TEXT == "No configuration fits yet"
    assert "No configuration fits yet" in page_without_best
    assert "Best:" not in page_without_best
    assert report.NO_IMPORTANCE_TEXT in page_without_best
    assert "at least a few completed trials with varied knobs" in page_without_best
    assert page_without_best.count("Plotly.newPlot(") == 2
    assert f"<h2>{report.IMPORTANCE_TITLE}</h2>" in page_without_best


def test_empty_study_renders():
    page = render_report(_summary(best=None, importances={}, trials=[]))
    assert "No trials yet." in page
    assert "0 measured" in page
    assert page.count(PLOTLY_JS_BANNER) == 1


def _traces(fig) -> dict[str, object]:
    return {trace.name: trace for trace in fig.data}


def test_throughput_plot_never_invents_a_throughput():
    traces = _traces(report._throughput_figure(_summary()))
    assert set(traces) == {
        "ok",
        "ok, over the memory limit",
        "oom (no throughput)",
        "timeout (no throughput)",
        "best (confirmed)",
    }
    assert list(traces["ok"].x) == [0, 2] and list(traces["ok"].y) == [3000.0, 9000.0]
    assert list(traces["oom (no throughput)"].x) == [3, 4]
    assert list(traces["oom (no throughput)"].y) == [0, 0]
    assert list(traces["timeout (no throughput)"].y) == [0]
    assert "status: timeout" in traces["timeout (no throughput)"].hovertext[0]
    assert "error: killed after 60 s" in traces["timeout (no throughput)"].hovertext[0]
    assert traces["oom (no throughput)"].marker.symbol != traces["ok"].marker.symbol
    best = traces["best (confirmed)"]
    assert (list(best.x), list(best.y), best.marker.symbol) == ([2], [9000.0], "star")


def test_memory_plot_draws_ooms_on_the_axis_and_the_two_lines():
    fig = report._memory_figure(_summary())
    traces = _traces(fig)
    assert list(traces["ok"].x) == [5 * 1024, 10 * 1024]
    assert "trial 0: mb=1 fp32" in traces["ok"].hovertext[0]
    oom = traces["oom (no throughput)"]
    assert (list(oom.x), list(oom.y)) == ([24 * 1024], [0])
    unknown_peak = traces["oom (no peak recorded: drawn at the budget)"]
    assert (list(unknown_peak.x), list(unknown_peak.y)) == ([24 * 1024], [0])
    assert not any("timeout" in name for name in traces)  # no memory figure: only in the table
    assert sorted(shape.x0 for shape in fig.layout.shapes) == [20 * 1024, 24 * 1024]


def test_importance_bars_put_the_largest_on_top():
    fig = report._importance_figure({"precision": 0.2, "micro_batch": 0.7, "checkpointing": 0.1})
    (bars,) = fig.data
    assert bars.orientation == "h"
    assert list(bars.y) == ["checkpointing", "precision", "micro_batch"]
    assert list(bars.x) == [0.1, 0.2, 0.7]
    assert report._importance_figure(None) is None
    assert report._importance_figure({}) is None


def test_write_report_creates_parents_and_replaces(tmp_path):
    summary = _summary(best=None, importances=None, trials=TRIALS[:1])
    target = tmp_path / "reports" / "nested" / "study.html"
    assert write_report(summary, str(target)) == target
    first = target.read_text(encoding="utf-8")
    assert first.startswith("<!DOCTYPE html>") and first.rstrip().endswith("</html>")
    target.write_text("stale", encoding="utf-8")
    assert write_report(summary, target) == target
    assert target.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in target.parent.iterdir()] == ["study.html"]  # no temp file left behind


def test_write_report_leaves_no_temp_file_when_it_fails(tmp_path):
    target = tmp_path / "study.html"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(OSError):
        write_report(_summary(best=None, importances=None, trials=[]), target)
    assert [p.name for p in tmp_path.iterdir()] == ["study.html"]


def test_importing_the_module_does_not_import_plotly():
    code = "import sys, autotune.output.report; print(any(m.split('.')[0] == 'plotly' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the figures as the page draws them (parsed from the Plotly.newPlot calls) ---------------------


def _figures(page: str) -> dict[str, dict]:
    """Each figure's {data, layout} as plotly.js receives it, by title."""
    decoder, figures = json.JSONDecoder(), {}
    for call in page.split("Plotly.newPlot(")[1:]:
        args, at = [], 0
        for _ in range(3):  # the div id, the data, the layout
            at = len(call) - len(call[at:].lstrip(" \n,"))
            value, at = decoder.raw_decode(call, at)
            args.append(value)
        figures[args[2]["title"]["text"]] = {"data": args[1], "layout": args[2]}
    return figures


def _trace(figure: dict, name: str) -> dict:
    (trace,) = [t for t in figure["data"] if t.get("name") == name]
    return trace


ALL_FP32 = [
    TrialRecord(
        number=i,
        config=TrialConfig(micro_batch=mb, checkpointing=ckpt),
        status="ok",
        tokens_per_s=1000.0 * mb,
        peak_memory_bytes=mb * GIB,
        fits=True,
    )
    for i, (mb, ckpt) in enumerate([(1, False), (2, False), (4, True), (8, True)])
]


def test_importance_leaves_out_a_knob_that_never_varied():
    # fANOVA credited precision with 16% in a study where every trial ran fp32.
    page = render_report(
        _summary(trials=ALL_FP32, best=None, importances={"micro_batch": 0.6, "checkpointing": 0.24, "precision": 0.16})
    )
    (bars,) = _figures(page)[report.IMPORTANCE_TITLE]["data"]
    assert bars["y"] == ["checkpointing", "micro_batch"]
    assert bars["x"] == pytest.approx([0.24 / 0.84, 0.6 / 0.84])  # shares of what the varied knobs explain


def test_importance_with_one_varied_knob_says_so_instead_of_a_chart():
    same_ckpt = [t for t in ALL_FP32 if not t.config.checkpointing]
    page = render_report(
        _summary(
            trials=same_ckpt, best=None, importances={"micro_batch": 0.6, "checkpointing": 0.24, "precision": 0.16}
        )
    )
    assert report.IMPORTANCE_TITLE not in _figures(page)
    assert (
        f'<h2>{report.IMPORTANCE_TITLE}</h2>\n<p class="note">Parameter importance compares knobs that varied; '
        "among the trials with a throughput, only micro_batch varied; checkpointing was always False; "
        "precision was always fp32.</p>"
    ) in page


def test_memory_line_labels_are_in_the_legend_not_over_the_points():
    memory = _figures(render_report(_summary()))[report.MEMORY_TITLE]
    assert not memory["layout"].get("annotations")  # a label on the plot covered the best point
    lines = {shape["name"]: shape["x0"] for shape in memory["layout"]["shapes"]}
    assert lines == {"memory limit 20.0 GiB (budget minus headroom)": 20 * 1024, "memory budget 24.0 GiB": 24 * 1024}
    assert all(shape["showlegend"] for shape in memory["layout"]["shapes"])


def test_points_at_the_edges_are_drawn_whole():
    figures = _figures(render_report(_summary()))
    throughput, memory = figures[report.THROUGHPUT_TITLE], figures[report.MEMORY_TITLE]
    assert throughput["layout"]["xaxis"]["range"] == [-0.5, 5.5]  # trial 0 is not cut at the left edge
    for figure in (throughput, memory):  # nor failed trials drawn at 0
        low, high = figure["layout"]["yaxis"]["range"]
        assert low < 0 and high > 9000.0


def test_a_refuted_trial_has_its_own_marker_and_legend_entry():
    refuted = TrialRecord(
        number=6,
        config=TrialConfig(micro_batch=4),
        status="ok",
        tokens_per_s=9500.0,
        peak_memory_bytes=19 * GIB,
        fits=True,
        confirmed=False,
        confirmed_tokens_per_s=9400.0,
        confirmed_peak_memory_bytes=21 * GIB,
    )
    page = render_report(_summary(trials=[*TRIALS, refuted]))
    for figure in _figures(page).values():
        if figure["layout"]["title"]["text"] == report.IMPORTANCE_TITLE:
            continue
        trace = _trace(figure, "refuted by its re-run")
        assert len(trace["x"]) == 1 and "trial 6: mb=4 fp32" in trace["hovertext"][0]
        others = {t["marker"]["symbol"] for t in figure["data"] if t["name"] != "refuted by its re-run"}
        assert trace["marker"]["symbol"] not in others
    assert "<td>refuted: the re-run read 9,400.0 tokens/s, 21.0 GiB</td>" in page
