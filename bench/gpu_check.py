"""The few minutes of a lent GPU, spent on what no published row settles: autotune's own predictions
against real trials of the same configs on that card, allocated and reserved memory and tokens/s.

On the GPU machine (run it first there; it is made to end well inside 10 minutes):

    bash bench/gpu_check.sh            # writes bench/results/gpu_check_<card>.txt

For each config of ``CONFIGS`` on a 3B Llama (a config.json from the published rows, random weights) it runs
``autotune estimate --json`` (the prediction) and ``autotune trial --json`` (the measurement:
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, tokens/s, and what nvidia-smi shows the card using
during the trial over what it showed before), each command in this process so that one trial server and one
estimate server serve them all, and prints one table, each prediction's error beside it. Then a real
``autotune find`` on a 1B Llama built from its config (90 s of search), then the ``gpu``-marked tests.

On a CPU, ``--rehearse`` runs the same steps on a tiny model for one step each (no GPU figure comes of it:
it proves the script and its commands work) and says what the GPU run would measure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gpu_readings import Readings, read_now  # bench/gpu_readings.py

ROOT = Path(__file__).resolve().parent.parent
GPU_MODEL = "bench/data/published/llama-3.2-3b.json"
GPU_WORKLOAD = ["--seq-len", "1024", "--global-batch", "8"]
REHEARSAL_WORKLOAD = ["--seq-len", "64", "--global-batch", "8"]
# What a published row cannot settle on one card: the model states, activations with and without
# checkpointing, the chunked loss's logits, LoRA and QLoRA's frozen bases, and the 8-bit optimizer.
CONFIGS = [
    ("bf16, ckpt, mb=2", ["--precision", "bf16", "--checkpointing", "on", "--micro-batch", "2"]),
    ("bf16, mb=1", ["--precision", "bf16", "--micro-batch", "1"]),
    (
        "bf16, ckpt, chunked loss, mb=4",
        ["--precision", "bf16", "--checkpointing", "on", "--loss", "chunked", "--micro-batch", "4"],
    ),
    ("bf16, LoRA 16, mb=4", ["--precision", "bf16", "--lora-rank", "16", "--micro-batch", "4"]),
    (
        "bf16, QLoRA nf4, mb=4",
        ["--precision", "bf16", "--lora-rank", "16", "--quantize-base", "nf4", "--micro-batch", "4"],
    ),
    (
        "bf16, ckpt, 8-bit AdamW, mb=2",
        ["--precision", "bf16", "--checkpointing", "on", "--optimizer", "adamw-8bit", "--micro-batch", "2"],
    ),
    (
        # Stepped inside the backward: no accumulation, so the micro batch is the global batch.
        "bf16, ckpt, AdamW in backward, mb=8",
        ["--precision", "bf16", "--checkpointing", "on", "--optimizer-in-backward", "on", "--micro-batch", "8"],
    ),
]
# A real search, as a user starts one: a 1B Llama built from its config, bounded in time.
FIND_MODEL = "bench/data/published/llama-3.2-1b.json"
FIND_ARGS = ["--seq-len", "1024", "--global-batch", "16", "--max-time", "90s"]
REHEARSAL_FIND = ("builtin:llama-tiny", ["--seq-len", "64", "--global-batch", "8", "--max-time", "6s"])
GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="on a CPU: a tiny model, one step each")
    parser.add_argument("--out", type=Path, help="the results file (default: bench/results/gpu_check_<card>.txt)")
    parser.add_argument(
        "--predict-for",
        metavar="CARD",
        help="no measuring: write each config's prediction for CARD (an `estimate --gpu` name) as JSON to --out, "
        "made on any machine so that the lent GPU's minutes go to measuring",
    )
    parser.add_argument(
        "--predictions", type=Path, help="a file --predict-for wrote: take the predictions from it, estimate none"
    )
    parser.add_argument(
        "--recheck",
        nargs=2,
        type=Path,
        metavar=("RESULTS", "PREDICTIONS"),
        help="no measuring: a lease's measured tokens/s (RESULTS, the table this script wrote) against a newer "
        "--predict-for file, beside the lease's own predictions",
    )
    args = parser.parse_args()
    if args.recheck:
        print("\n".join(_recheck(*args.recheck)))
        return
    # This process is the command's own, as ``python -m autotune`` marks its process: the servers of the commands
    # run in it (_autotune) are forks of it where they may be (no CUDA context yet, one thread; see
    # autotune.cli.servers), not new interpreters.
    from autotune.cli.servers import this_is_the_command

    this_is_the_command()
    args.out = args.out.resolve() if args.out else None
    args.predictions = args.predictions.resolve() if args.predictions else None
    os.chdir(ROOT)  # the configs' model paths are the repository's
    if args.predict_for:
        _predict_for(args.predict_for, args.out)
        return
    card = _card(args.rehearse)
    out = args.out or ROOT / "bench" / "results" / f"gpu_check_{card.replace(' ', '_')}.txt"
    predictions = json.loads(args.predictions.read_text()) if args.predictions else {}
    lines = [f"# bash bench/gpu_check.sh{' --rehearse' if args.rehearse else ''}: {card}"]
    if predictions:
        lines.append(f"predictions from {args.predictions.name}: {predictions['command']}")
    model, workload = ("builtin:gpt2-tiny", REHEARSAL_WORKLOAD) if args.rehearse else (GPU_MODEL, GPU_WORKLOAD)
    device = ["--device", "cpu"] if args.rehearse else ["--device", "cuda"]
    steps = ["--warmup-steps", "1", "--steps", "1" if args.rehearse else "5"]
    lines.append(f"model {model}, {' '.join(workload)}; each config estimated, then measured ({' '.join(steps)})")
    rows = []
    # The measurements first, each written as it lands: a lease that ends early still leaves them.
    for label, flags in CONFIGS:
        if args.rehearse and "nf4" in flags and not _has("bitsandbytes"):
            rows.append((label, None, None, "bitsandbytes not installed"))
            continue
        common = ["--model", model, *workload, *device, *flags]
        predicted = (predictions.get("configs") or {}).get(label) or _autotune(["estimate", *common, "--json"])
        # What nvidia-smi shows the card using while the trial runs, over what it showed before: the trial's
        # process (its CUDA context, the allocator's reserve, NCCL's buffers); nothing in a rehearsal.
        before = read_now(["memory.used"]) if not args.rehearse else None
        with Readings(["memory.used"], 100, enabled=before is not None) as used:
            measured = _autotune(["trial", *common, *steps, "--json"])
        if before and used.rows:
            measured["device_bytes"] = int((max(used.column("memory.used")) - before[0]) * 2**20)  # MiB
        rows.append((label, predicted, measured, None))
        _write(out, lines + _table(rows), args)
    lines += _table(rows)
    lines += _find(args.rehearse)
    _write(out, lines, args)
    lines += _gpu_tests(args.rehearse)
    if args.rehearse:
        lines.append(
            "rehearsal: on the GPU machine the same steps run these configs on "
            f"{GPU_MODEL} ({' '.join(GPU_WORKLOAD)}, --device cuda, 5 timed steps): "
            "max_memory_allocated, max_memory_reserved, tokens/s and nvidia-smi's figure against the predictions; "
            f"then find on {FIND_MODEL} ({' '.join(FIND_ARGS)}); then the gpu-marked tests"
        )
    print("\n".join(lines))
    _write(out, lines, args)


def _write(out: Path, lines: list[str], args: argparse.Namespace) -> None:
    if not args.rehearse or args.out:
        out.write_text("\n".join(lines) + "\n")


def _predict_for(card: str, out: Path | None) -> None:
    """Each config's estimate for CARD, made here (a trace needs no GPU), as the GPU run reads them."""
    command = f"python bench/gpu_check.py --predict-for {card}"
    configs = {}
    for label, flags in CONFIGS:
        configs[label] = _autotune(["estimate", "--model", GPU_MODEL, *GPU_WORKLOAD, "--gpu", card, *flags, "--json"])
        print(f"{label}: {configs[label].get('status', 'predicted')}", flush=True)
    path = out or ROOT / "bench" / "results" / f"gpu_check_predicted_{card}.json"
    path.write_text(json.dumps({"command": command, "card": card, "configs": configs}, indent=1) + "\n")


def _recheck(results: Path, predictions: Path) -> list[str]:
    """The lease's tokens/s (measured / its predicted) beside the tokens/s ``predictions`` holds for each config."""
    configs = json.loads(predictions.read_text())["configs"]
    lines = [
        f"# python bench/gpu_check.py --recheck {results} {predictions}",
        "config | measured tokens/s | the lease's prediction (error) | now (error)",
    ]
    errors = []
    for line in results.read_text().splitlines():
        cells = line.split(" | ")
        if cells[0] not in configs or len(cells) < 4:
            continue
        before, measured = (float(v.split()[0].replace(",", "")) for v in cells[3].split(" / "))
        now = configs[cells[0]]["step_time"]["tokens_per_s"]
        errors.append((abs(before / measured - 1), abs(now / measured - 1)))
        lines.append(
            f"{cells[0]} | {measured:,.0f} | {before:,.0f} ({before / measured - 1:+.1%}) | {now:,.0f} "
            f"({now / measured - 1:+.1%})"
        )
    if errors:
        lines.append(
            f"median |error|: {statistics.median(e[0] for e in errors):.1%} in the lease, "
            f"{statistics.median(e[1] for e in errors):.1%} now"
        )
    return lines


def _card(rehearse: bool) -> str:
    if rehearse:
        return "rehearsal on the CPU (no GPU figure)"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible: run with --rehearse on a CPU")
    return torch.cuda.get_device_name(0)


def _find(rehearse: bool) -> list[str]:
    """A real ``autotune find`` on a 1B Llama built from its config (a tiny Llama on a CPU), bounded in time: what it
    answered, from how many trials, in how long."""
    model, flags = REHEARSAL_FIND if rehearse else (FIND_MODEL, FIND_ARGS)
    device = ["--device", "cpu" if rehearse else "cuda"]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        result = _autotune(
            ["find", "--model", model, *flags, *device, "--storage", f"sqlite:///{tmp}/find.db", "--json"]
        )
        wall = time.monotonic() - started
    head = f"find --model {model} {' '.join(flags)} {' '.join(device)}: {wall:.0f} s"
    best = result.get("best")
    if not isinstance(best, dict) or not best.get("config"):
        return [f"{head}, no answer: {result.get('error') or result.get('stopped') or 'none'}"]
    rate = best.get("confirmed_tokens_per_s") or best.get("tokens_per_s")
    peak = best.get("confirmed_peak_memory_bytes") or best.get("peak_memory_bytes")
    measured = sum(1 for t in result.get("trials", []) if t.get("status") == "ok")
    return [
        f"{head}, {result.get('n_trials')} trials ({measured} ok); answer {best.get('describe')}: "
        f"{_rate(rate or 0)} tokens/s, peak {(peak or 0) / GiB:.2f} GiB",
        *([f"  {result['stopped']}"] if result.get("stopped") else []),
    ]


def _gpu_tests(rehearse: bool) -> list[str]:
    # One line per failure, each test cut at 60 s (pytest-timeout is on the GPU machine): a lease's few
    # minutes end with every failure's reason printed, not with tracebacks that never came.
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "--tb=line", "-rfE"]
    command += ["--continue-on-collection-errors", *(["--timeout=60"] if _has("pytest_timeout") else [])]
    if rehearse:
        return [f"gpu-marked tests: would run `{shlex.join(command[1:])}` (skipped on a CPU)"]
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return [f"gpu-marked tests: not finished in 240 s (`{shlex.join(command[1:])}`)"]
    output = proc.stdout.strip().splitlines() or ["no output"]
    failures = [line for line in output if line.startswith(("FAILED", "ERROR"))]
    return [f"gpu-marked tests ({time.monotonic() - started:.0f} s, exit {proc.returncode}): {output[-1]}", *failures]


def _autotune(args: list[str]) -> dict[str, Any]:
    """``autotune ARGS --json``'s last line, run in this process: one trial server and one estimate server
    serve every config (a new interpreter each would spend a lease's minutes importing torch again), forks of this
    process where they may be (see :func:`main`)."""
    from autotune.cli.app import main as autotune_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = autotune_main(args)
    try:
        return json.loads(out.getvalue().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"status": "error", "error": (err.getvalue().strip().splitlines() or [f"exit {code}, no output"])[-1]}


def _table(rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None, str | None]]) -> list[str]:
    out = [
        "config | allocated: predicted / measured (error) | reserved: predicted / measured (error) "
        "| tokens/s: predicted / measured (error) | nvidia-smi: predicted / measured (error)"
    ]
    for label, predicted, measured, why in rows:
        if why is not None or predicted is None or measured is None:
            out.append(f"{label} | not run: {why}")
            continue
        if measured.get("status") != "ok":
            out.append(f"{label} | measured {measured.get('status')}: {measured.get('error')}")
            continue
        allocated = _pair(predicted.get("predicted_peak_bytes"), measured.get("peak_allocated_bytes"))
        reserved = _pair(predicted.get("predicted_reserved_bytes"), measured.get("peak_reserved_bytes"))
        tokens = _pair((predicted.get("step_time") or {}).get("tokens_per_s"), measured.get("tokens_per_s"), _rate)
        device = _pair(predicted.get("predicted_device_bytes"), measured.get("device_bytes"))
        out.append(f"{label} | {allocated} | {reserved} | {tokens} | {device}")
    return out


def _pair(
    predicted: float | None, measured: float | None, show: Callable[[float], str] = lambda v: f"{v / GiB:.3f} GiB"
) -> str:
    """``predicted / measured (error)``, each value as ``show`` writes it (a size by default), ``-`` where none."""

    def text(value: float | None) -> str:
        return "-" if value is None else show(value)

    error = f" ({predicted / measured - 1:+.1%})" if predicted and measured else ""
    return f"{text(predicted)} / {text(measured)}{error}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value else "-"


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


if __name__ == "__main__":
    main()
