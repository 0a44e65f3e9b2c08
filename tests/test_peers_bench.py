"""`bench/peers.py`: Lightning's and Accelerate's batch-size finders, the real library code, meet
the CPU budget's OOM in their own process, recognise it and retry smaller."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def run_peer(name: str, tmp_path: Path) -> dict:
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers.py"),
            "--peer",
            name,
            "--result",
            str(result),
            "--budget-bytes",
            str(48 * MiB),
            "--model",
            "builtin:gpt2-deep-tiny",
            "--seq-len",
            "32",
            "--global-batch",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_lightning_power_scaling_stops_at_the_budget_oom_and_keeps_the_last_size_that_ran(tmp_path):
    tuned = run_peer("lightning-power", tmp_path)
    sizes = [(a["micro_batch"], a["steps_done"] >= 3) for a in tuned["attempts"]]
    # Doubling from 2 until the budget's OOM (48 MiB: 2 and 4 run, 8 does not), then the last that ran.
    assert sizes == [(2, True), (4, True), (8, False)]
    assert tuned["picked_micro_batch"] == 4


@pytest.mark.slow
def test_accelerate_shrinks_from_the_global_batch_until_a_size_runs_its_accumulated_steps(tmp_path):
    tuned = run_peer("accelerate", tmp_path)
    first, last = tuned["attempts"][0], tuned["attempts"][-1]
    assert (first["micro_batch"], first["accumulation"]) == (16, 1)
    assert first["steps_done"] < 2  # out of memory
    assert last["micro_batch"] == tuned["picked_micro_batch"] < 16
    assert last["steps_done"] == 2 * last["accumulation"]  # two whole optimizer steps ran
