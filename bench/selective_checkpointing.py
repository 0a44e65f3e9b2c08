"""Per-operator selective checkpointing against every layer, every 2nd layer and none, on a model no test uses
(``bench/data/mistral-narrow``: Mistral's shape, 4 layers, 256 wide, GQA), measured and predicted in one run.

    python bench/selective_checkpointing.py [--rounds 3] [--precision fp32]

Each config runs as a search runs it (``autotune trial --json``, a fresh process each time), the four
interleaved in every round so that a busy machine slows them alike; tokens/s is the median over the rounds with
the range beside it, the peak that of the first round (a CPU's peak does not vary between runs: the live-bytes
tracker counts tensors). Beside each, the estimate's predicted peak and tokens/s (the step-time model on one probe
of this CPU's roofline, the same for the four). Writes ``bench/results/selective_checkpointing_cpu.txt``.
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
WORKLOAD = ["--model", MODEL, "--seq-len", "512", "--micro-batch", "4", "--global-batch", "8", "--device", "cpu"]
CHECKPOINTING = ("off", "every-2", "selective", "on")
MiB = 2**20


def autotune(command: str, checkpointing: str, precision: str) -> dict[str, Any]:
    """One ``autotune <command> --json`` of the workload with ``checkpointing``, in a process of its own."""
    argv = [sys.executable, "-m", "autotune", command, *WORKLOAD, "--precision", precision]
    argv += ["--checkpointing", checkpointing, "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[2:])}: exit {done.returncode}\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    if command == "trial" and result["status"] != "ok":
        raise SystemExit(f"--checkpointing {checkpointing}: {result['status']}: {result.get('error')}")
    return result


def estimate_all(precision: str) -> dict[str, tuple[int, float]]:
    """Each mode's predicted peak and tokens/s, every step timed on one probe of this CPU (probed once, so that
    a busy moment during one probe does not move one config's figure against the others')."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.client import predict_memory
    from autotune.estimate.step_time import predict_step_time, profile_for
    from autotune.levers.checkpointing import checkpointing_flag

    workload = Workload(model=MODEL, seq_len=512, global_batch=8, device="cpu")
    profile = profile_for(workload, "cpu")
    assert profile is not None, "the CPU's probe failed"
    estimates = {}
    for mode in CHECKPOINTING:
        config = TrialConfig(micro_batch=4, precision=precision, **checkpointing_flag(mode))
        estimate = predict_memory(workload, config)
        step = predict_step_time(estimate, workload, profile)
        assert step is not None and step.tokens_per_s is not None, f"{mode}: no step time"
        estimates[mode] = (estimate.predicted_peak_bytes, step.tokens_per_s)
    return estimates


def machine() -> str:
    """The CPU's model name (``platform.processor()`` is empty on Linux), its cores and the load average now."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/selective_checkpointing_cpu.txt")
    args = parser.parse_args()

    started = machine()
    trials: dict[str, list[dict[str, Any]]] = {mode: [] for mode in CHECKPOINTING}
    for _ in range(args.rounds):
        for mode in CHECKPOINTING:
            trials[mode].append(autotune("trial", mode, args.precision))
    estimates = estimate_all(args.precision)

    lines = [
        f"# python bench/selective_checkpointing.py --rounds {args.rounds} --precision {args.precision}",
        f"# {started} at the start, {os.getloadavg()[0]:.1f} at the end; {args.rounds} rounds interleaved",
        f"# autotune trial|estimate {' '.join(WORKLOAD)} --precision {args.precision} --checkpointing ...",
        f"{'--checkpointing':<16}{'peak MiB':>10}{'estimate':>10}{'error':>8}"
        f"{'tokens/s median (range)':>28}{'vs off':>8}{'estimate':>10}{'error':>8}",
    ]
    off_speed = statistics.median(r["tokens_per_s"] for r in trials["off"])
    for mode in CHECKPOINTING:
        speeds = [r["tokens_per_s"] for r in trials[mode]]
        speed = statistics.median(speeds)
        peak = trials[mode][0]["peak_memory_bytes"]
        predicted, predicted_speed = estimates[mode]
        spread = f"{speed:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})"
        lines.append(
            f"{mode:<16}{peak / MiB:>10.1f}{predicted / MiB:>10.1f}{predicted / peak - 1:>+8.1%}"
            f"{spread:>28}{speed / off_speed:>8.2f}{predicted_speed:>10,.0f}{predicted_speed / speed - 1:>+8.1%}"
        )
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
