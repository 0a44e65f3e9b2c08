"""find --plan: every config of a space predicted to fit a card, ranked by predicted throughput, nothing run."""

from __future__ import annotations

import json
import subprocess
import sys

from autotune.config.workload import Workload
from autotune.search.plan import PLAN_ERROR, plan_space

SPACE = "knobs:\n  micro_batch: [1, 2, 4, 8, 16, 32]\n  precision: [fp32, bf16]\n  checkpointing: [false, true]\n"
WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=32, gpu="A100-80GB")


def test_a_plan_ranks_what_fits_and_marks_the_configs_to_verify_first(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    plan = plan_space(workload=WORKLOAD, space=str(tmp_path / "space.yaml"), memory_budget_bytes=2**30)
    rates = [row.step.samples_per_s for row in plan.rows]
    assert rates == sorted(rates, reverse=True) and len(plan.rows) + plan.too_big == 24
    assert all(row.memory_bytes <= plan.limit_bytes for row in plan.rows)
    assert all(row.device_bytes > row.memory_bytes for row in plan.rows)  # the context, beyond the allocator
    top = rates[0]
    assert [row.verify_first for row in plan.rows] == [rate >= top * (1 - PLAN_ERROR) for rate in rates]
    assert plan.rows[0].verify_first and plan.estimates < 24  # families bisected, not every config estimated
    # A smaller budget: the largest micro batches no longer fit; what is left fits under it.
    small = plan_space(workload=WORKLOAD, space=str(tmp_path / "space.yaml"), memory_budget_bytes=300 * 2**20)
    assert small.too_big > plan.too_big and all(row.memory_bytes <= small.limit_bytes for row in small.rows)


def test_find_plan_prints_its_table_and_json_without_running_anything(tmp_path):
    # Two configs, one family: what is tested here is the command's output; the ranking of a whole
    # space is the test above's (each family costs the command seconds of tracing, twice).
    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  precision: [bf16]\n")
    args = [
        sys.executable,
        "-m",
        "autotune",
        "find",
        "--plan",
        "--device",
        "cuda",
        "--gpu",
        "H100-80GB",
        "--model",
        "builtin:llama-tiny",
        "--seq-len",
        "256",
        "--global-batch",
        "32",
        "--space",
        str(tmp_path / "space.yaml"),
    ]
    table = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "plan for builtin:llama-tiny on 1 x H100-80GB (nothing was run)" in table.stdout
    assert "verify first" in table.stdout and "tokens/s per GPU" in table.stdout
    data = json.loads(
        subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=600, cwd=tmp_path).stdout
    )
    assert data["device"] == "H100-80GB" and data["rows"][0]["verify_first"]
    assert {"tokens_per_s", "mfu", "memory_bytes", "device_bytes", "headroom_bytes"} <= set(data["rows"][0])
    assert not (tmp_path / "storage").exists()  # no study: nothing was measured
