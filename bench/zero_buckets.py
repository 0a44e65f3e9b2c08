"""What a ZeRO export's bucket sizes cost a real job: the accelerate export launched with
``accelerate launch``, as YAML keys alone (DeepSpeed's 5e8-element buckets, what the export wrote
before it named a DeepSpeed file) and as autotune writes it now (the trial's buckets, hidden size
squared, in the DeepSpeed file the YAML names).

    python bench/zero_buckets.py [--rounds 2] [--out bench/results/zero_buckets_cpu.json]

The job is tests/scripts/accelerate_zero_job.py: a 2-layer GPT-2 (128 wide, 1000-token vocabulary,
64 tokens a sample, micro batch 2) trained for 3 optimizer steps under ZeRO-2 by a plain Accelerate
loop (``Accelerator()``, its own AdamW and DataLoader); it counts its own peak of live tensor bytes
from before ``Accelerator()`` to the end with autotune's CPU tracker (the one every CPU trial uses).
Both exports, fp32 and bf16, each
round, interleaved. A job's wall time is printed too (start-up and DeepSpeed's set-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.output.exporters import export_files
from autotune.prepare.training_args import accelerate_arguments

WORKLOAD = Workload(model="builtin:gpt2-tiny", seq_len=64, global_batch=8)
CONFIGS = [TrialConfig(micro_batch=2, precision=p, zero_stage=2) for p in ("fp32", "bf16")]

JOB = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "accelerate_zero_job.py"
STEPS = 3


def yaml_keys_only(config: TrialConfig, path: Path) -> None:
    """The accelerate export as it was: ZeRO as ``deepspeed_config`` keys, no DeepSpeed file."""
    data = yaml.safe_load(
        next(
            text
            for file, text in export_files(config, WORKLOAD, path, fmt="accelerate", device_type="cpu")
            if file == path
        )
    )
    data["deepspeed_config"] = {
        "gradient_accumulation_steps": config.grad_accum_steps(WORKLOAD),
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": False,
        "zero_stage": config.zero_stage,
    }
    data["mixed_precision"] = accelerate_arguments(config, WORKLOAD)["mixed_precision"]
    path.write_text(yaml.safe_dump(data))


def as_exported(config: TrialConfig, path: Path) -> None:
    for file, text in export_files(config, WORKLOAD, path, fmt="accelerate", device_type="cpu"):
        file.write_text(text)


def launch(folder: Path, yaml_name: str) -> dict:
    started = time.perf_counter()
    ran = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", yaml_name, str(JOB), str(STEPS)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
    )
    if ran.returncode != 0:
        raise SystemExit(f"{yaml_name}: accelerate launch failed:\n{ran.stderr[-3000:]}")
    line = next(line for line in ran.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/zero_buckets_cpu.json"))
    args = parser.parse_args()
    exports = {"yaml keys only": yaml_keys_only, "as exported": as_exported}
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="zero-buckets-") as tmp:
        folder = Path(tmp)
        for config in CONFIGS:
            for name, write in exports.items():
                write(config, folder / f"{config.precision}-{name.replace(' ', '-')}.yaml")
        for _ in range(args.rounds):
            for config in CONFIGS:
                for name in exports:
                    key = f"{config.describe()} | {name}"
                    runs.setdefault(key, []).append(launch(folder, f"{config.precision}-{name.replace(' ', '-')}.yaml"))
    rows = []
    print(f"{'config | accelerate export':40} {'peak (all rounds)':>28} {'reduce bucket':>20} {'wall s (median)':>16}")
    for key, results in runs.items():
        peaks = sorted({r["peak_bytes"] for r in results})
        assert all(r["stage"] == 2 for r in results), results
        row = {
            "run": key,
            "peak_bytes": peaks,
            "reduce_bucket_size": results[0]["reduce"] or "DeepSpeed's default",
            "wall_s": [round(r["wall_s"], 2) for r in results],
        }
        rows.append(row)
        shown = ", ".join(f"{p / 2**20:.1f} MiB" for p in peaks)
        print(f"{key:40} {shown:>28} {str(row['reduce_bucket_size']):>20} {statistics.median(row['wall_s']):16.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/zero_buckets.py --rounds " + str(args.rounds),
                "rounds": args.rounds,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
