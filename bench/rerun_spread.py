"""How far apart first figures of one config lie, measured in fresh processes as a search measures them.

    python bench/rerun_spread.py     # writes results/rerun_spread_cpu.txt; about 3 minutes on 2 cores

A search compares configs by their first figure: one ``autotune trial`` each, in a fresh process. Two first figures
of the same config differ by more than a trial's own step times do: the process starts on another core, the
allocator and caches warm differently, the machine's other work comes and goes. This bench runs a few configs of
two models (``builtin:gpt2-deep-tiny`` and the BERT encoder of ``data/peers/bert-cls``; seq 128, global batch 16,
micro batch 4, bf16), each one lever apart from the others, with ``autotune trial --json``, interleaved round by
round, and reports each config's figures over the rounds: the spread between runs ((max - min) / median) beside
the spread of its step times within a run (the median of the runs' IQR / median). ``TWIN_BAND`` in
``autotune/search/confirm.py`` reads the first against the second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--seq-len", "128", "--global-batch", "16", "--micro-batch", "4", "--precision", "bf16", "--steps", "5"]
CONFIGS = {  # name: (model, the levers' flags)
    "gpt2-deep-tiny plain": ("builtin:gpt2-deep-tiny", ["--fused-optimizer", "false", "--loss", "standard"]),
    "gpt2-deep-tiny fused-adam": ("builtin:gpt2-deep-tiny", ["--fused-optimizer", "true", "--loss", "standard"]),
    "gpt2-deep-tiny chunked-loss": ("builtin:gpt2-deep-tiny", ["--fused-optimizer", "false", "--loss", "chunked"]),
    "gpt2-deep-tiny chunked-loss fused-adam": (
        "builtin:gpt2-deep-tiny",
        ["--fused-optimizer", "true", "--loss", "chunked"],
    ),
    "bert-cls plain": ("bench/data/peers/bert-cls/config.json", ["--fused-optimizer", "false"]),
    "bert-cls fused-adam": ("bench/data/peers/bert-cls/config.json", ["--fused-optimizer", "true"]),
}


def run_once(model: str, flags: list[str]) -> dict[str, float]:
    """One trial in a fresh process, as a search runs one: its tokens/s and its step times' spread."""
    command = [sys.executable, "-m", "autotune", "trial", "--model", model, *COMMON, *flags, "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout
    result = json.loads(out[out.index("{") : out.rindex("}") + 1])
    if result.get("status") != "ok":
        raise SystemExit(f"{model} {' '.join(flags)}: {result.get('status')}: {result.get('error')}")
    return {"tokens_per_s": result["tokens_per_s"], "step_time_spread": result["step_time_spread"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rerun_spread_cpu.txt")
    args = parser.parse_args()

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):  # interleaved: every config once a round, so each round sees the same machine
        for name, (model, flags) in CONFIGS.items():
            runs[name].append(run_once(model, flags))

    lines = [
        f"# python bench/rerun_spread.py --rounds {args.rounds} ({started}, {os.cpu_count()}-core CPU; "
        f"1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)",
        "# Each config: its tokens/s in each round (fresh processes, interleaved); the spread between the runs,",
        "# (max - min) / median; and the median of each run's own step-time spread (IQR / median).",
        "",
        f"{'config':40} {'tokens/s by round':>40} {'between runs':>13} {'within a run':>13}",
    ]
    for name, results in runs.items():
        figures = [r["tokens_per_s"] for r in results]
        between = (max(figures) - min(figures)) / statistics.median(figures)
        within = statistics.median(r["step_time_spread"] for r in results)
        by_round = ", ".join(f"{f:,.0f}" for f in figures)
        lines.append(f"{name:40} {by_round:>40} {between:>12.0%} {within:>12.1%}")
    lines += ["", "Each run's figure over its model's plain config's in the same round (paired: one machine state):"]
    for name, results in runs.items():
        plain = runs[f"{name.split()[0]} plain"]
        ratios = [r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(results, plain, strict=True)]
        lines.append(f"{name:40} " + ", ".join(f"{x:.2f}" for x in ratios))
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
