"""`autotune grid` writes measured lines; `bench/search.py` replays strategies against them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import commands
import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.results import MemoryEstimate
from autotune.trial.result import TrialResult, TrialStatus

ROOT = Path(__file__).resolve().parents[2]
SPACE = """\
n_trials: 6
patience: 4
knobs:
  micro_batch: [1, 2, 4, 8]
  precision: [fp32]
  checkpointing: [false, true]
  zero_stage: [off]
  lora_rank: [off]
"""
MiB = 2**20


@pytest.fixture(scope="module")
def _search_main():
    """bench/search.py's ``main``, loaded once: a test runs it in this process (a new interpreter each spent 5-7 s on
    imports, and the CPU's probe again, which the module keeps for the run)."""
    spec = importlib.util.spec_from_file_location("bench_search", ROOT / "bench" / "search.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def replay(_search_main, monkeypatch, capsys):
    """``python bench/search.py ARGS --json``'s report, run in this process."""

    def run(*args: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["bench/search.py", *args])
        capsys.readouterr()
        _search_main()
        return json.loads(capsys.readouterr().out)

    return run


@pytest.mark.slow
def test_grid_measures_each_config_once_and_resumes(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE.replace("[1, 2, 4, 8]", "[1]").replace("[false, true]", "[false]"))
    command = [
        "grid",
        "-o",
        "g.jsonl",
        "--model",
        "builtin:gpt2-tiny",
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--space",
        "space.yaml",
        "--steps",
        "1",
    ]
    first = commands.autotune(*command, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "1 config(s) estimated now" in first.stderr
    again = commands.autotune(*command, cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "0 config(s) measured now" in again.stderr
    assert "0 config(s) estimated now" in again.stderr
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["status"] == "ok" and lines[0]["trial_seconds"] > 0
    assert lines[0]["config"]["micro_batch"] == 1 and lines[0]["workload"]["model"] == "builtin:gpt2-tiny"
    # The estimator's prediction beside the measured peak (on a CPU both count the same tensors).
    estimate = lines[0]["estimate"]
    assert abs(estimate["predicted_peak_bytes"] - lines[0]["peak_memory_bytes"]) <= 0.1 * lines[0]["peak_memory_bytes"]
    assert lines[0]["estimate_seconds"] > 0 and lines[0]["estimator_start_s"] >= 0
    # After the estimator changed: every line estimated again, nothing measured again.
    predicted = estimate["predicted_peak_bytes"]
    lines[0]["estimate"] = {**estimate, "predicted_peak_bytes": 1}
    (tmp_path / "g.jsonl").write_text(json.dumps(lines[0]) + "\n")
    refreshed = commands.autotune(*command, "--re-estimate", cwd=tmp_path, timeout=300)
    assert refreshed.returncode == 0 and "0 config(s) measured now" in refreshed.stderr
    assert "1 config(s) estimated now" in refreshed.stderr
    line = json.loads((tmp_path / "g.jsonl").read_text())
    assert line["estimate"]["predicted_peak_bytes"] == predicted
    assert line["trial_seconds"] == lines[0]["trial_seconds"]
    contradiction = commands.autotune(*command, "--re-estimate", "--no-estimate", cwd=tmp_path, timeout=300)
    assert contradiction.returncode == 2 and "--re-estimate" in contradiction.stderr


def _line(
    micro_batch: int, ckpt: bool, tokens: float, peak_mib: float, seconds: float, with_estimate: bool = False
) -> dict:
    workload = Workload(model="builtin:gpt2-tiny", seq_len=16)
    config = TrialConfig(micro_batch=micro_batch, checkpointing=ckpt)
    result = TrialResult(
        config=config, status=TrialStatus.OK, tokens_per_s=tokens, peak_memory_bytes=int(peak_mib * MiB)
    )
    line = {**result.to_dict(), "trial_seconds": seconds, "workload": workload.to_dict()}
    if with_estimate:  # an exact estimate: model states 0, every byte per sample
        line.update(
            estimate_seconds=1.0,
            estimator_start_s=2.0,
            estimate=MemoryEstimate(
                config=config,
                predicted_peak_bytes=int(peak_mib * MiB),
                parameters_bytes=0,
                gradients_bytes=0,
                optimizer_state_bytes=0,
                activations_bytes=int(peak_mib * MiB),
                temporaries_bytes=0,
                overhead_bytes=None,
                method="test",
                seconds=1.0,
            ).to_dict(),
        )
    return line


@pytest.mark.slow
def test_the_replayed_driver_with_estimates_finds_the_best_after_the_simple_answer_and_pays_for_its_estimates(
    tmp_path, replay
):
    # Same toy grid, with exact estimates: the driver finds each family's frontier with the
    # estimator (no trial): no-ckpt mb=4, ckpt mb=8 (24 MiB each; limit 36). The first trial is the simple
    # answer, the default knobs' largest micro batch predicted to fit (no-ckpt mb=4). The lines' estimates
    # hold no traced operators, so no step time is predicted: nothing tells the families apart but the
    # micro batch's saturation (8/10 against 4/6), and ckpt mb=8, the best, is the search's first trial.
    lines = [
        _line(
            mb,
            ckpt,
            tokens=100 * mb * (0.75 if ckpt else 1),
            peak_mib=mb * (3 if ckpt else 6),
            seconds=10,
            with_estimate=True,
        )
        for mb in (1, 2, 4, 8)
        for ckpt in (False, True)
    ]
    grid = tmp_path / "toy.jsonl"
    grid.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "toy.yaml").write_text(SPACE)
    driver = replay("--grid", str(grid), "--memory-budget", "40MiB", "--json")["strategies"]["driver"]
    assert driver["trials_to_2pct"] == 2 and driver["found_ratio"] == 1
    assert driver["estimates"] >= 2
    # Charged: a trial (10 s), the estimator's start (2 s) and at least two estimates (1 s each).
    assert driver["cost_fraction"] * 80 >= 10 + 2 + 2


@pytest.mark.slow
def test_replay_scores_every_strategy_against_the_grid(tmp_path, replay):
    # A hand-made grid: throughput grows with the micro batch, checkpointing costs a third and
    # halves the memory; mb=8 without checkpointing does not fit under 40 MiB (limit 36 MiB).
    lines = [
        _line(mb, ckpt, tokens=100 * mb * (0.75 if ckpt else 1), peak_mib=mb * (3 if ckpt else 6), seconds=10)
        for mb in (1, 2, 4, 8)
        for ckpt in (False, True)
    ]
    grid = tmp_path / "toy.jsonl"
    grid.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "toy.yaml").write_text(SPACE)
    report = replay("--grid", str(grid), "--memory-budget", "40MiB", "--seeds", "2", "--json")
    assert report["best_tokens_per_s"] == 600  # mb=8 with checkpointing: 800 x 0.75
    strategies = report["strategies"]
    assert set(strategies) == {"driver", "tpe", "random", "grid", "deepspeed", "lightning"}
    assert strategies["grid"]["found_ratio"] == 1 and strategies["grid"]["trials_to_2pct"] == 8
    assert abs(strategies["grid"]["cost_fraction"] - 1.0) < 1e-9  # the best is the last config in order
    # Lightning's finder keeps checkpointing off: it stops at mb=8 (does not fit) and never finds it.
    assert strategies["lightning"]["found_ratio"] == 0 and strategies["lightning"]["trials_run"] == 4
    # The real driver ran and found it, in fewer than the space's 6 trials: checkpointing at a size that fits
    # without it (mb <= 4) only adds a recompute, so it is never run.
    assert strategies["driver"]["found_ratio"] == 1 and strategies["driver"]["trials_run"] == 5
    for result in strategies.values():
        assert result["cost_fraction"] is None or 0 < result["cost_fraction"] <= 1
