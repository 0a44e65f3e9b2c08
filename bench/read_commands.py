"""How long the commands that only read a study take: ``show``, ``show --json``, ``export`` in each format,
``studies``, next to ``--help`` and a bare interpreter.

    python bench/read_commands.py [--runs 9] [--out bench/results/read_commands_cpu.txt]
    python bench/read_commands.py --storage sqlite:///some.db --study NAME --lora-study NAME2   # existing studies

Without ``--storage`` it first makes two fresh studies in a temporary directory with real
``autotune tune`` runs on ``builtin:gpt2-tiny`` (a plain one and a LoRA one, ~1 min together).
Each command is a new interpreter (what a user types), run ``--runs`` times interleaved with the
others so machine noise hits them alike; the table gives the median and the spread (min-max).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_SPACE = "n_trials: 3\nknobs:\n  micro_batch: [4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n"
LORA_SPACE = (
    "n_trials: 2\nknobs:\n  micro_batch: [8]\n  precision: [fp32]\n  checkpointing: [false]\n"
    "  lora_rank: [8]\n  lora_targets: [default, all-linear]\n"
)
FORMATS = ("json", "yaml", "deepspeed", "hf", "accelerate", "lightning")


def _tune(work: Path, study: str, space: str, storage: str) -> None:
    (work / f"{study}.yaml").write_text(space)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "tune",
            "--study",
            study,
            "--model",
            "builtin:gpt2-tiny",
            "--space",
            str(work / f"{study}.yaml"),
            "--memory-budget",
            "2GiB",
            "--global-batch",
            "8",
            "--steps",
            "2",
            "--no-estimate",
            "--storage",
            storage,
            "--json",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=work,
    )


def _commands(storage: str, plain: str, lora: str | None) -> dict[str, list[str]]:
    at = ["-m", "autotune"]
    commands = {
        "python -c pass": ["-c", "pass"],
        "autotune --help": [*at, "--help"],
        "show": [*at, "show", "--study", plain, "--storage", storage],
        "show --json": [*at, "show", "--study", plain, "--storage", storage, "--json"],
        "studies": [*at, "studies", "--storage", storage],
    }
    for fmt in FORMATS:
        commands[f"export --format {fmt}"] = [*at, "export", "--study", plain, "--format", fmt, "--storage", storage]
    if lora is not None:
        commands["show (LoRA study)"] = [*at, "show", "--study", lora, "--storage", storage]
        commands["export --format peft (LoRA)"] = [
            *at,
            "export",
            "--study",
            lora,
            "--format",
            "peft",
            "--storage",
            storage,
        ]
        commands["export --format yaml (LoRA)"] = [
            *at,
            "export",
            "--study",
            lora,
            "--format",
            "yaml",
            "--storage",
            storage,
        ]
    return commands


def _time(argv: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *argv], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{proc.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--storage", help="an existing study database (default: make fresh studies)")
    parser.add_argument("--study", default="plain")
    parser.add_argument("--lora-study", default="lora")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        storage = args.storage
        if storage is None:
            storage = f"sqlite:///{work}/studies.db"
            started = time.perf_counter()
            _tune(work, args.study, PLAIN_SPACE, storage)
            _tune(work, args.lora_study, LORA_SPACE, storage)
            print(f"made 2 studies in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        commands = _commands(storage, args.study, args.lora_study)
        for argv in commands.values():  # once untimed: page cache and .pyc files warm
            _time(argv, work)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, argv in commands.items():
                times[name].append(_time(argv, work))

    lines = [
        f"# {shlex.join(['python', 'bench/read_commands.py', *sys.argv[1:]])}",
        f"# {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{args.runs} runs each, interleaved; seconds from launch to exit",
        f"{'command':<32} {'median':>7} {'min':>7} {'max':>7}",
    ]
    for name, values in times.items():
        lines.append(f"{name:<32} {statistics.median(values):>7.3f} {min(values):>7.3f} {max(values):>7.3f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
