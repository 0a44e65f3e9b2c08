"""The values of one lever side by side on a model no test uses (``bench/data/mistral-narrow``: Mistral's shape,
4 layers, 256 wide, GQA), measured and predicted in one run.

    python bench/lever_values.py checkpointing [--rounds 3] [--precision fp32]   # off, every-2, selective, on
    python bench/lever_values.py float8 [--rounds 3] [--precision bf16]          # off, on
    python bench/lever_values.py grad-sync [--rounds 1] [--precision bf16-true]  # each, last (FSDP on 4 ranks)

Each config runs as a search runs it (``autotune trial --json``, a fresh process each time), the values
interleaved in every round so that a busy machine slows them alike; tokens/s is the median over the rounds with
the range beside it, the peak that of the first round (a CPU's peak does not vary between runs: the live-bytes
tracker counts tensors). Beside each, the estimate's predicted peak and tokens/s (the step-time model on one probe
of this CPU's roofline, the same for every value). Writes ``bench/results/lever_values_<lever>_cpu.txt``.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench/data/mistral-narrow/config.json"
SEQ_LEN, MICRO_BATCH, GLOBAL_BATCH = 512, 4, 8
WORKLOAD = ["--model", MODEL, "--seq-len", str(SEQ_LEN), "--global-batch", str(GLOBAL_BATCH), "--device", "cpu"]
VALUES = {
    "checkpointing": ("off", "every-2", "selective", "on"),
    "float8": ("off", "on"),
    "grad-sync": ("each", "last"),
}
# What a lever needs around it: --grad-sync is FSDP's accumulation (4 CPU ranks, 2 micro steps each), measured as
# KempnerForge runs it (checkpointed, fp32 reduction of bf16 weights, its loop's loss).
SETUP: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "grad-sync": (
        {"nproc": 4, "global_batch": 4 * 2 * MICRO_BATCH},
        {"fsdp": "full", "checkpointing": True, "reduce_dtype": "fp32", "loss": "plain"},
    ),
}
MiB = 2**20


def setup_flags(lever: str) -> list[str]:
    """The command line of ``SETUP``'s workload and knobs for ``lever`` (none for most)."""
    workload, knobs = SETUP.get(lever, ({}, {}))
    typed = {"checkpointing": lambda on: "on" if on else "off"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]
    return flags + [f"--{k.replace('_', '-')}={typed.get(k, str)(v)}" for k, v in knobs.items()]


def autotune(command: str, flags: list[str]) -> dict[str, Any]:
    """One ``autotune <command> --json`` of the workload with ``flags``, in a process of its own."""
    argv = [sys.executable, "-m", "autotune", command, *WORKLOAD, "--micro-batch", str(MICRO_BATCH), *flags, "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:])}: exit {done.returncode}\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    if command == "trial" and result["status"] != "ok":
        raise SystemExit(f"{' '.join(flags)}: {result['status']}: {result.get('error')}")
    return result


def estimate_all(lever: str, precision: str) -> dict[str, tuple[int, float]]:
    """Each value's predicted peak and tokens/s, every step timed on one probe of this CPU (probed once, so that
    a busy moment during one probe does not move one value's figure against the others')."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.client import predict_memory
    from autotune.estimate.step_time import predict_step_time, profile_for
    from autotune.levers import LEVER_FLAGS

    flag = next(flag for flag in LEVER_FLAGS if flag.names == (f"--{lever}",))
    around, knobs = SETUP.get(lever, ({}, {}))
    workload = Workload(model=MODEL, seq_len=SEQ_LEN, device="cpu", **{"global_batch": GLOBAL_BATCH, **around})
    profile = profile_for(workload, "cpu")
    assert profile is not None, "the CPU's probe failed"
    estimates = {}
    for value in VALUES[lever]:
        config = TrialConfig(micro_batch=MICRO_BATCH, precision=precision, **knobs, **flag.fields_of(value))
        estimate = predict_memory(workload, config)
        step = predict_step_time(estimate, workload, profile)
        assert step is not None and step.tokens_per_s is not None, f"--{lever} {value}: no step time"
        estimates[value] = (estimate.predicted_peak_bytes, step.tokens_per_s)
    return estimates


def machine() -> str:
    """The CPU's model name (``platform.processor()`` is empty on Linux), its cores and the load average now."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lever", choices=sorted(VALUES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    out = ROOT / f"bench/results/lever_values_{args.lever}_cpu.txt"

    started = machine()
    values = VALUES[args.lever]
    trials: dict[str, list[dict[str, Any]]] = {value: [] for value in values}
    for _ in range(args.rounds):
        for value in values:
            flags = ["--precision", args.precision, *setup_flags(args.lever), f"--{args.lever}", value]
            trials[value].append(autotune("trial", flags))
    estimates = estimate_all(args.lever, args.precision)

    lines = [
        f"# python bench/lever_values.py {args.lever} --rounds {args.rounds} --precision {args.precision}",
        f"# {started} at the start, {os.getloadavg()[0]:.1f} at the end; {args.rounds} rounds interleaved",
        f"# autotune trial|estimate {' '.join(WORKLOAD)} --micro-batch {MICRO_BATCH} --precision {args.precision} "
        f"{' '.join(setup_flags(args.lever))} --{args.lever} ...".replace("  ", " "),
        f"{'--' + args.lever:<16}{'peak MiB':>10}{'estimate':>10}{'error':>8}"
        f"{'tokens/s median (range)':>28}{'vs ' + values[0]:>8}{'estimate':>10}{'error':>8}",
    ]
    baseline = statistics.median(r["tokens_per_s"] for r in trials[values[0]])
    for value in values:
        speeds = [r["tokens_per_s"] for r in trials[value]]
        speed = statistics.median(speeds)
        peak = trials[value][0]["peak_memory_bytes"]
        predicted, predicted_speed = estimates[value]
        spread = f"{speed:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})"
        lines.append(
            f"{value:<16}{peak / MiB:>10.1f}{predicted / MiB:>10.1f}{predicted / peak - 1:>+8.1%}"
            f"{spread:>28}{speed / baseline:>8.2f}{predicted_speed:>10,.0f}{predicted_speed / speed - 1:>+8.1%}"
        )
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
