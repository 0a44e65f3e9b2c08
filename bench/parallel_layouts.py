"""Layouts of the ranks on one model, in one run: data parallel (DDP, ZeRO-2, FSDP) against tensor parallel
(with sequence parallel), pipeline parallel (GPipe, 1F1B) and the 2-D layouts (FSDP x TP, PP x TP), on 2 and
4 gloo ranks of this CPU. Per rank: the measured peak, the estimator's, and tokens/s.

    python bench/parallel_layouts.py [--rounds 3] [--out bench/results/parallel_layouts_cpu.json]

The seeds' comparison in kind: pipeline parallelism trades memory per rank for idle time (the bubble), tensor
parallelism for communication (two all-reduces per layer, forward and backward). The model is four wide
layers over a small vocabulary (bench/data/llama-layers.json), so the layers' weights, which the layouts
split, dominate its states. The layouts run as real trials, interleaved (each round runs every layout once)
so a busy machine slows all alike; tokens/s is the median over the rounds with the range beside it, the peaks
those of the first round (a CPU's live-bytes tracker counts tensors: they do not vary between runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.estimate.step_time import predict_step_time, profile_for
from autotune.trial.runner import run_trial

MODEL = "bench/data/llama-layers.json"
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH = 128, 8, 1
# (ranks, layout name, knobs): every layout trains micro batches of one sample, the global batch of 8.
LAYOUTS = [
    (2, "DDP", {}),
    (2, "ZeRO-2", {"zero_stage": 2}),
    (2, "FSDP", {"fsdp": "full"}),
    (2, "TP", {"tp": 2}),
    (2, "TP + SP", {"tp": 2, "sequence_parallel": True}),
    (2, "PP 1F1B", {"pp": 2}),
    (2, "PP GPipe", {"pp": 2, "pp_schedule": "gpipe"}),
    (4, "DDP", {}),
    (4, "FSDP", {"fsdp": "full"}),
    (4, "FSDP x TP", {"fsdp": "full", "tp": 2}),
    (4, "PP x TP", {"pp": 2, "tp": 2}),
    (4, "PP 1F1B", {"pp": 4}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/parallel_layouts_cpu.json"))
    args = parser.parse_args()

    runs: dict[int, list] = {i: [] for i in range(len(LAYOUTS))}
    for _ in range(args.rounds):
        for i, (ranks, name, knobs) in enumerate(LAYOUTS):
            workload, config = _workload(ranks), TrialConfig(micro_batch=MICRO_BATCH, **knobs)
            result = run_trial(workload, config, warmup_steps=1, measure_steps=3)
            if not result.ok:
                raise SystemExit(f"{name} on {ranks} ranks: {result.status.value}: {result.error}")
            runs[i].append(result)
    rows = []
    profiles = {ranks: profile_for(_workload(ranks), "cpu") for ranks in {r for r, _, _ in LAYOUTS}}
    for i, (ranks, name, knobs) in enumerate(LAYOUTS):
        workload, config = _workload(ranks), TrialConfig(micro_batch=MICRO_BATCH, **knobs)
        estimate = predict_memory(workload, config)
        profile = profiles[ranks]
        step = predict_step_time(estimate, workload, profile) if profile is not None else None
        first = runs[i][0]
        speeds = [r.tokens_per_s for r in runs[i]]
        predicted = estimate.peak_per_rank_bytes or [estimate.predicted_peak_bytes]
        # A pipeline stage's tensor-parallel ranks share its prediction (PP x TP: ranks 0-1 stage 0, ...).
        per_stage = ranks // len(predicted)
        rows.append(
            {
                "ranks": ranks,
                "layout": name,
                "config": config.describe(),
                "accumulation": first.grad_accum_steps,
                "peak_per_rank_bytes": first.peak_memory_per_rank,
                "predicted_per_rank_bytes": [predicted[r // per_stage] for r in range(ranks)],
                "tokens_per_s_median": statistics.median(speeds),
                "tokens_per_s": speeds,
                "predicted_tokens_per_s": step.tokens_per_s if step is not None else None,
                "final_loss": first.final_loss,
            }
        )
        print(_line(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = _machine()
    command = f"python bench/parallel_layouts.py --rounds {args.rounds}"
    args.out.write_text(json.dumps({"machine": machine, "command": command, "rows": rows}, indent=1) + "\n")
    table = args.out.with_suffix(".md")
    table.write_text(_table(rows, machine, command))
    print(f"wrote {args.out} and {table}")


def _machine() -> str:
    """The CPU's model name (platform.processor() is empty on Linux) and its core count."""
    import os

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def _workload(ranks: int) -> Workload:
    return Workload(model=MODEL, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, nproc=ranks, device="cpu")


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _line(row: dict) -> str:
    peaks = "/".join(_mib(p) for p in row["peak_per_rank_bytes"])
    predicted = "/".join(_mib(p) for p in row["predicted_per_rank_bytes"])
    speeds = row["tokens_per_s"]
    return (
        f"{row['ranks']} ranks, {row['layout']} ({row['config']}): peak per rank {peaks} MiB "
        f"(estimate {predicted}), {row['tokens_per_s_median']:,.0f} tokens/s ({min(speeds):,.0f}-{max(speeds):,.0f})"
    )


def _table(rows: list[dict], machine: str, command: str) -> str:
    lines = [
        f"`{command}` on {machine}; model {MODEL}, seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, micro batch "
        f"{MICRO_BATCH}; tokens/s: median of the rounds (range); predicted: the step-time model on this CPU's "
        "probed roofline",
        "",
        "| ranks | layout | accumulation | peak per rank (MiB) | estimate (MiB) | largest vs estimate | tokens/s "
        "| predicted tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peaks, predicted = row["peak_per_rank_bytes"], row["predicted_per_rank_bytes"]
        miss = max(abs(p / m - 1) for p, m in zip(predicted, peaks, strict=True))
        speeds = row["tokens_per_s"]
        lines.append(
            f"| {row['ranks']} | {row['layout']} | {row['accumulation']} | {' / '.join(_mib(p) for p in peaks)} "
            f"| {' / '.join(_mib(p) for p in predicted)} | {miss:.1%} "
            f"| {row['tokens_per_s_median']:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f}) "
            f"| {_rate(row['predicted_tokens_per_s'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
