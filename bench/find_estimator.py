"""`autotune find` with the memory estimator on and off: trial-seconds spent, same best config?

    python bench/find_estimator.py [--out bench/results/find_estimator_cpu.json]

Both runs use the same workload, budget and space (bench/spaces/fp32_micro_ckpt.yaml, every
config of which is measured or ruled out), each in a fresh storage. Trial-seconds are the wall
times of the trials run (OOMs included); estimator-seconds the estimates' own tracing time;
wall the whole find (including starting the estimate server once).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import optuna

from autotune.config.workload import Workload
from autotune.search.tuner import find
from autotune.study.storage import open_storage

SPACE = Path(__file__).parent / "spaces" / "fp32_micro_ckpt.yaml"


def run(estimate: bool, budget: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        summary = find(
            workload=Workload(model="builtin:gpt2-deep-tiny"),
            space=str(SPACE),
            memory_budget_bytes=budget,
            storage=f"sqlite:///{tmp}/autotune.db",
            estimate=estimate,
        )
        wall = time.perf_counter() - started
        study = optuna.load_study(study_name=summary.name, storage=open_storage(f"sqlite:///{tmp}/autotune.db"))
        estimate_s = sum((t.user_attrs.get("estimate") or {}).get("seconds", 0.0) for t in study.trials)
    ran = [t for t in summary.trials if t.status not in ("skipped", "interrupted", "running")]
    return {
        "estimate": estimate,
        "wall_s": wall,
        "estimator_s": estimate_s,
        "trial_s": sum(t.duration_s or 0.0 for t in ran),
        "trials_run": len(ran),
        "oom_trials": sum(t.status == "oom" for t in ran),
        "skipped": [t.config.describe() for t in summary.trials if t.status == "skipped"],
        "best": summary.best.config.describe() if summary.best else None,
        "best_tokens_per_s": summary.best.confirmed_tokens_per_s if summary.best else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_estimator_cpu.json"))
    args = parser.parse_args()
    budget = 84 * 2**20
    rows = [run(False, budget), run(True, budget)]
    for r in rows:
        print(
            f"estimator {'on ' if r['estimate'] else 'off'}: {r['trials_run']} trials ({r['oom_trials']} OOM) "
            f"{r['trial_s']:.1f} trial-s, estimator {r['estimator_s']:.1f} s, wall {r['wall_s']:.1f} s; "
            f"skipped {r['skipped']}; best {r['best']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/find_estimator.py",
                "budget_bytes": budget,
                "space": "bench/spaces/fp32_micro_ckpt.yaml",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
