"""Fixed cost of one trial (process launch to its first timed step) next to a bare import.

    python bench/fixed_cost.py [--model builtin:gpt2-tiny] [--repeats 5] [--out bench/results/fixed_cost_cpu.json]

Both are measured in the same run, alternating, so machine noise hits them alike. The trial's
fixed cost is start-up + build + warm-up as the trial process itself reports them, from the
moment the runner launches it; the bare import is the wall time of
``python -c "import torch, transformers"``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from autotune.knobs import TrialConfig
from autotune.runner import run_trial
from autotune.workload import Workload


def bare_import_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:gpt2-tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/fixed_cost_cpu.json"))
    args = parser.parse_args()

    workload = Workload(model=args.model, seq_len=128, global_batch=8, device="cpu")
    config = TrialConfig(micro_batch=8)
    rows = []
    for i in range(args.repeats):
        bare = bare_import_s()
        result = run_trial(workload, config, warmup_steps=1, measure_steps=1)
        assert result.ok, result.error
        p = result.phases
        rows.append({"bare_import_s": bare, "fixed_cost_s": p.fixed_cost_s, "startup_s": p.startup_s,
                     "build_s": p.build_s, "warmup_s": p.warmup_s})
        print(f"run {i + 1}: bare import {bare:.2f} s, trial fixed cost {p.fixed_cost_s:.2f} s "
              f"(start-up {p.startup_s:.2f}, build {p.build_s:.2f}, warm-up {p.warmup_s:.2f})", flush=True)

    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "model": args.model, "repeats": args.repeats, "median": median,
        "ratio_fixed_cost_to_bare_import": median["fixed_cost_s"] / median["bare_import_s"],
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nmedian of {args.repeats}: bare import {median['bare_import_s']:.2f} s | trial fixed cost "
          f"{median['fixed_cost_s']:.2f} s = start-up {median['startup_s']:.2f} + build {median['build_s']:.2f} "
          f"+ warm-up {median['warmup_s']:.2f} | ratio {summary['ratio_fixed_cost_to_bare_import']:.2f}x")


if __name__ == "__main__":
    main()
