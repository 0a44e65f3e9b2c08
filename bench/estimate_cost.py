"""Cost of one memory estimate from the estimate server, and of the server's start, for each of two
checkouts of autotune: this one and another (a worktree of an earlier commit), alternating, so machine
noise hits them alike.

    git worktree add ../before <commit>
    python bench/estimate_cost.py --before ../before [--repeats 3] [--out bench/results/estimate_cost_cpu.json]

Each run is a new process that starts the server (``start_s``: until its imports are done) and asks it
for the estimates of a few configs of one model, none sharing a trace; an estimate's cost is the
seconds the server reports for it (fork, trace, collect: what ``find`` waits for per config before
its first trial). The checkouts run on the same installed packages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CONFIGS = {
    "adamw": {"micro_batch": 2},
    "adamw ckpt": {"micro_batch": 2, "checkpointing": True},
    "adafactor": {"micro_batch": 2, "optimizer": "adafactor"},
    "adamw-8bit": {"micro_batch": 2, "optimizer": "adamw-8bit"},
    "lora8": {"micro_batch": 2, "lora_rank": 8},
}

# Run inside each checkout: the server's start, then each config's estimate, as JSON on the last line.
ONE_RUN = """
import json, sys, time
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory, start_estimate_server, wait_for_estimate_server
workload = Workload(model=sys.argv[1], seq_len=32, global_batch=4)
started = time.perf_counter()
start_estimate_server()
wait_for_estimate_server()
figures = {"start_s": time.perf_counter() - started}
for name, knobs in json.loads(sys.argv[2]).items():
    figures[name] = predict_memory(workload, TrialConfig(**knobs)).seconds
print(json.dumps(figures))
"""


def one_run(tree: Path, model: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", ONE_RUN, model, json.dumps(CONFIGS)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="another checkout of autotune (a git worktree)")
    parser.add_argument("--model", default="builtin:gpt2-tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/estimate_cost_cpu.json"))
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": Path(__file__).resolve().parents[1]}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in trees.items():  # alternating: the same noise for both
            runs[name].append(one_run(tree, args.model))
            print(f"repeat {repeat + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{'median seconds':<16}" + "".join(f"{name:>10}" for name in trees))
    for key in medians["after"]:
        print(f"{key:<16}" + "".join(f"{medians[name][key]:>10.2f}" for name in trees))
    git = ["git", "rev-parse", "--short", "HEAD"]
    commits = {
        name: subprocess.run(git, cwd=tree, capture_output=True, text=True).stdout.strip()
        for name, tree in trees.items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                "model": args.model,
                "configs": CONFIGS,
                "commits": commits,
                "runs": runs,
                "medians": medians,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
