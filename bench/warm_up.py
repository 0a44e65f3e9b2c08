"""A trial's warm-up: one micro batch and the optimizer step, against a whole step of every micro batch.

    python bench/warm_up.py     # writes results/warm_up_cpu.txt; about a minute on 2 cores

For each model (the wide-vocabulary Qwen2 of ``data/peers/wide-vocab`` and ``builtin:gpt2-deep-tiny``, seq 128,
global batch 16, micro batch 2: 8 micro batches a step), an engine is built as a trial builds it, warmed up one
way or the other, then 4 steps are timed. The two ways alternate in each of 3 rounds, each with an engine of its
own, in this one process, so both see the same machine. What is compared: the warm-up's seconds, and whether the
first timed step after it is slower than the ones after it (a warm-up that left something cold would show there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.models.sources import resolve_task
from autotune.trial.engine import build_engine

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"wide-vocab": "bench/data/peers/wide-vocab/config.json", "gpt2-deep-tiny": "builtin:gpt2-deep-tiny"}


def measure(model: str, rounds: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Per way ("one micro batch", "whole step"): its warm-up seconds, its first timed step, its later steps."""
    workload = Workload(model=model, seq_len=128, global_batch=16, device="cpu")
    task = resolve_task(workload)
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for way in ("one micro batch", "whole step"):
            torch.manual_seed(0)
            config = TrialConfig(micro_batch=2)
            engine = build_engine(workload=workload, config=config, task=task, device=torch.device("cpu"), world_size=1)
            begin = time.perf_counter()
            (engine.warm_up if way == "one micro batch" else engine.step)()
            warm_s = time.perf_counter() - begin
            times = []
            for _ in range(steps):
                begin = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - begin)
            row = figures.setdefault(way, {"warm-up": [], "first step": [], "later steps": []})
            row["warm-up"].append(warm_s)
            row["first step"].append(times[0])
            row["later steps"].append(statistics.median(times[1:]))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "warm_up_cpu.txt")
    args = parser.parse_args()
    lines = [
        "python bench/warm_up.py",
        f"seq 128, global batch 16, micro batch 2 (8 a step), {args.rounds} rounds alternating the two ways, "
        f"{args.steps} timed steps each; seconds, median (min-max) over the rounds; load {_load()}",
        "",
        "| model | warm-up | warm-up s | first timed step s | later steps s (each round's median) |",
        "|---|---|---|---|---|",
    ]
    for name, model in MODELS.items():
        path = str(ROOT / model) if model.endswith(".json") else model
        for way, row in measure(path, args.rounds, args.steps).items():
            cells = [_spread(row[key]) for key in ("warm-up", "first step", "later steps")]
            lines.append(f"| {name} | {way} | " + " | ".join(cells) + " |")
    lines.append(f"\nload after: {_load()}")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _load() -> str:
    import os

    return f"{os.getloadavg()[0]:.2f}"


if __name__ == "__main__":
    main()
