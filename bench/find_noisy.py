"""`autotune find` on a quiet and on a busy machine, each pick checked against the measured grid.

    python bench/find_noisy.py [--budget 160MiB]     # writes results/find_noisy_cpu.json

The workload is one no test uses: the grouped-query-attention Llama of ``bench/data/llama-gqa``
(seq 128, global batch 16), the ``default`` space (on this CPU: every micro batch x fp32/bf16/fp16
x checkpointing). ``find`` runs twice with fresh storage: once as is, once with another process
spinning on one of the two cores for the whole search. Each pick is then looked up in
``bench/data/llama-gqa.jsonl``, the grid of every config measured on a quiet machine: its quiet
tokens/s over the best fitting config's there (fits: peak under the budget less 10% headroom).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.search.grid import read_grid
from autotune.sizes import parse_size

GRID = Path("bench/data/llama-gqa.jsonl")
HEADROOM = 0.10


def find(budget: str, storage: str, *, busy: bool) -> tuple[dict, float, int]:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        start = time.monotonic()
        proc = subprocess.run(
            [
                "autotune",
                "find",
                "--model",
                "bench/data/llama-gqa",
                "--seq-len",
                "128",
                "--global-batch",
                "16",
                "--memory-budget",
                budget,
                "--storage",
                storage,
                "--json",
            ],
            capture_output=True,
            text=True,
        )
        return json.loads(proc.stdout or "{}"), time.monotonic() - start, proc.returncode
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def _threads_used(storage: str) -> dict[str, int]:
    """How many of the study's trials ran with how many torch threads (the free cores they saw)."""
    import optuna

    counts: dict[str, int] = {}
    for name in optuna.get_all_study_names(storage):
        for trial in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
            threads = (trial.user_attrs.get("result") or {}).get("cpu_threads")
            if threads is not None:
                counts[str(threads)] = counts.get(str(threads), 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="160MiB")
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_noisy_cpu.json"))
    args = parser.parse_args()
    limit = parse_size(args.budget) * (1 - HEADROOM)
    grid = {TrialConfig.from_dict(line["config"]): line for line in read_grid(GRID)}
    fitting = {
        c: line["tokens_per_s"]
        for c, line in grid.items()
        if line["status"] == "ok" and line["peak_memory_bytes"] <= limit
    }
    optimum = max(fitting, key=fitting.get)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (False, True):
            summary, wall, code = find(args.budget, f"sqlite:///{tmp}/{'busy' if busy else 'quiet'}.db", busy=busy)
            best = summary.get("best")
            pick = TrialConfig.from_dict(best["config"]) if best else None
            quiet_figure = fitting.get(pick) if pick else None
            rows.append(
                {
                    "machine": "one core spinning" if busy else "as is",
                    "exit_code": code,
                    "wall_s": wall,
                    "pick": pick.describe() if pick else None,
                    "certainty": best.get("certainty") if best else None,
                    "measured_tokens_per_s": best.get("tokens_per_s") if best else None,
                    "quiet_grid_tokens_per_s": quiet_figure,
                    "of_optimum": quiet_figure / fitting[optimum] if quiet_figure else None,
                    "trials": summary.get("n_trials"),
                    "trials_by_cpu_threads": _threads_used(f"sqlite:///{tmp}/{'busy' if busy else 'quiet'}.db"),
                }
            )
            report = {
                "command": f"python bench/find_noisy.py --budget {args.budget}",
                "grid": str(GRID),
                "optimum": optimum.describe(),
                "optimum_tokens_per_s": fitting[optimum],
                "runs": rows,
            }
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each run: a stopped script keeps it
    print(f"optimum of the quiet grid under {args.budget}: {optimum.describe()} at {fitting[optimum]:,.0f} tokens/s")
    print(
        f"{'machine':<18} {'exit':>4} {'trials':>6} {'wall':>7}  {'pick':<22} {'quiet figure':>12} {'of optimum':>10}"
    )
    for r in rows:
        quiet = f"{r['quiet_grid_tokens_per_s']:,.0f}" if r["quiet_grid_tokens_per_s"] else "-"
        share = f"{r['of_optimum']:.1%}" if r["of_optimum"] else "-"
        print(
            f"{r['machine']:<18} {r['exit_code']:>4} {r['trials'] or 0:>6} {r['wall_s']:>6.0f}s  "
            f"{r['pick'] or '-':<22} {quiet:>12} {share:>10}"
        )
        print(f"{'':<18} trials by torch threads: {r['trials_by_cpu_threads']}")
        if r["certainty"]:
            print(f"{'':<18} how sure: {r['certainty']}")


if __name__ == "__main__":
    main()
