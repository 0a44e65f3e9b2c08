"""``autotune studies``: the studies in a storage, with their trial counts and best configs."""

from __future__ import annotations

import json
from typing import Optional

from autotune.cli.options import command


@command
def studies(storage: Optional[str], as_json: bool) -> int:
    """List the studies in the storage, with their trial counts and best configs."""
    from autotune.study.records import load_summaries

    rows = load_summaries(storage)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "study": s.name,
                        "model": s.workload.model,
                        "n_trials": s.n_trials,
                        "best": s.best.config.describe() if s.best else None,
                        "tokens_per_s": s.best.confirmed_tokens_per_s if s.best else None,
                        "throughput": s.best.confirmed_throughput if s.best else None,
                        "throughput_unit": s.throughput_unit,
                        "worker_jobs": s.worker_jobs,
                    }
                    for s in rows
                ]
            )
        )
        return 0
    if not rows:
        print("no autotune studies here yet; run autotune find")
    for s in rows:
        best = (
            f"{s.best.config.describe()} ({s.best.confirmed_throughput:,.1f} {s.throughput_unit})"
            if s.best
            else "no confirmed config"
        )
        print(f"{s.name}  {s.workload.model}  {s.n_trials} trials  best: {best}")
        if s.worker_jobs:
            from autotune.output.render import worker_jobs_line

            print(f"  workers: {worker_jobs_line(s.worker_jobs)}")
    return 0
