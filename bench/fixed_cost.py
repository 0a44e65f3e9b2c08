"""Fixed cost of one trial (launch to its first timed step): a new interpreter per trial against a
fork of the warm trial server, next to a bare import.

    python bench/fixed_cost.py [--model builtin:gpt2-tiny] [--repeats 5] [--out bench/results/fixed_cost_cpu.json]
    python bench/fixed_cost.py --nproc 2 --zero-stage 2 --out bench/results/fixed_cost_2rank_zero2_cpu.json

All three are measured in the same run, alternating, so machine noise hits them alike. A
trial's fixed cost is start-up + build + warm-up as the trial process itself reports them, from
the moment the runner launches it; ``wall_s`` is the runner's whole call, exit included. The
server's own start (once per tuning session) is paid by the first forked trial and reported
apart (``server_start_s``); the bare import is ``python -c "import torch, transformers"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.runner import run_trial


def bare_import_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True)
    return time.perf_counter() - start


def timed_trial(workload: Workload, config: TrialConfig, *, server: bool) -> dict[str, float]:
    os.environ["AUTOTUNE_TRIAL_SERVER"] = "on" if server else "off"
    start = time.perf_counter()
    result = run_trial(workload, config, warmup_steps=1, measure_steps=1)
    wall = time.perf_counter() - start
    assert result.ok, result.error
    p = result.phases
    return {
        "fixed_cost_s": p.fixed_cost_s,
        "startup_s": p.startup_s,
        "build_s": p.build_s,
        "warmup_s": p.warmup_s,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:gpt2-tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (new interpreter: under torchrun)")
    parser.add_argument("--zero-stage", type=int, default=None, help="DeepSpeed ZeRO stage (default: off)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fixed_cost_cpu.json"))
    args = parser.parse_args()

    workload = Workload(model=args.model, seq_len=128, global_batch=8 * args.nproc, nproc=args.nproc, device="cpu")
    config = TrialConfig(micro_batch=8, zero_stage=args.zero_stage)
    first = timed_trial(workload, config, server=True)  # starts the server: its imports, once
    rows = []
    for i in range(args.repeats):
        row = {
            "bare_import_s": bare_import_s(),
            "new_interpreter": timed_trial(workload, config, server=False),
            "forked": timed_trial(workload, config, server=True),
        }
        rows.append(row)
        print(
            f"run {i + 1}: bare import {row['bare_import_s']:.2f} s, fixed cost new interpreter "
            f"{row['new_interpreter']['fixed_cost_s']:.2f} s, forked {row['forked']['fixed_cost_s']:.2f} s",
            flush=True,
        )

    def median(key: str, field: str | None = None) -> float:
        return statistics.median(r[key] if field is None else r[key][field] for r in rows)

    fields = ("fixed_cost_s", "startup_s", "build_s", "warmup_s", "wall_s")
    summary = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}",
        "model": args.model,
        "nproc": args.nproc,
        "zero_stage": args.zero_stage,
        "repeats": args.repeats,
        "median": {
            "bare_import_s": median("bare_import_s"),
            "new_interpreter": {f: median("new_interpreter", f) for f in fields},
            "forked": {f: median("forked", f) for f in fields},
        },
        "server_start_s": first["startup_s"],
        "runs": rows,
    }
    m = summary["median"]
    summary["ratio_forked_to_new_interpreter"] = m["forked"]["fixed_cost_s"] / m["new_interpreter"]["fixed_cost_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nmedian of {args.repeats}: bare import {m['bare_import_s']:.2f} s")
    for mode in ("new_interpreter", "forked"):
        r = m[mode]
        print(
            f"{mode:<16} fixed cost {r['fixed_cost_s']:.2f} s = start-up {r['startup_s']:.2f} + build "
            f"{r['build_s']:.2f} + warm-up {r['warmup_s']:.2f}; whole call {r['wall_s']:.2f} s"
        )
    print(
        f"server start (once per session) {summary['server_start_s']:.2f} s; forked / new interpreter "
        f"{summary['ratio_forked_to_new_interpreter']:.2f}x"
    )


if __name__ == "__main__":
    main()
