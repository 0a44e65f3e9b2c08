"""The few minutes of a lent GPU, spent on what no published row settles: autotune's own predictions
against real trials of the same configs on that card, allocated and reserved memory and tokens/s.

On the GPU machine (run it first there; it is made to end well inside 10 minutes):

    bash bench/gpu_check.sh            # writes bench/results/gpu_check_<card>.txt

For each config of ``CONFIGS`` on a 3B Llama (a config.json from the published rows, random weights) it runs
``autotune estimate --json`` (the prediction) and ``autotune trial --json`` (the measurement:
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, tokens/s, and what nvidia-smi shows the card using
during the trial over what it showed before), each command in this process so that one trial server and one
estimate server serve them all, and prints one table, each prediction's error beside it; beside it, what
``find --plan`` says of each config (its family planned: the same knobs, every micro batch), against the same
measurement. Then torchtune's Llama-3.2-3B levers T4, T5 and T5 + 8-bit AdamW as ``bench/gpu_published.py`` rebuilds
them (seq 4096, compiled), each trial with the CUDA allocator's history recorded (``AUTOTUNE_CUDA_MEMORY_HISTORY``):
the live blocks at the allocated peak grouped by the frames that allocated them (``bench/memory_history.py``) beside
the estimate's parts, and each snapshot written beside the results. Then a real ``autotune find`` on a 1B Llama
built from its config (90 s of search), then the ``gpu``-marked tests in what is left of ``DEADLINE_S``.

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
from memory_history import GROUPS, peak_parts, read_snapshot, write_snapshot  # bench/memory_history.py

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
# torchtune's levers from T4 on, as bench/gpu_published.py rebuilds them (Llama-3.2-3B, seq 4096, micro batch 2, pure
# bf16, every layer checkpointed, chunked cross-entropy kept, compiled, fused AdamW), each trial's allocator history
# recorded. One timed step: compile's three (two eager, one compiled) come before it.
TORCHTUNE_ROWS = ("T4", "T5", "T5+8bit")
TORCHTUNE_STEPS = ["--warmup-steps", "0", "--steps", "1"]
REHEARSAL_TORCHTUNE = ("builtin:gpt2-tiny", ["--seq-len", "64", "--global-batch", "2"])
REHEARSED_TORCHTUNE_ROW = "T5+8bit"  # the rehearsal runs this one: every lever of the three
CUDA_ONLY = {"compile": False, "activation_offload": False}  # left out of the rehearsal's torchtune trials
# The rehearsal plans for a named card (find --plan wants a GPU, here or named): its figures are that card's.
PLAN_REHEARSAL_CARD = "H200"
# The whole run on the GPU machine ends within this (a lease gives minutes): the gpu-marked tests get what is left.
DEADLINE_S = 480
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
    started = time.monotonic()
    out = args.out or ROOT / "bench" / "results" / f"gpu_check_{card.replace(' ', '_')}.txt"
    predictions = json.loads(args.predictions.read_text()) if args.predictions else {}
    lines = [f"# bash bench/gpu_check.sh{' --rehearse' if args.rehearse else ''}: {card}"]
    if predictions:
        lines.append(f"predictions from {args.predictions.name}: {predictions['command']}")
    model, workload = ("builtin:gpt2-tiny", REHEARSAL_WORKLOAD) if args.rehearse else (GPU_MODEL, GPU_WORKLOAD)
    device = ["--device", "cpu"] if args.rehearse else ["--device", "cuda"]
    steps = ["--warmup-steps", "1", "--steps", "1" if args.rehearse else "5"]
    lines.append(f"model {model}, {' '.join(workload)}; each config estimated, then measured ({' '.join(steps)})")
    rows: list[Row] = []
    plans: dict[str, dict[str, Any]] = {}
    # The measurements first, each written as it lands: a lease that ends early still leaves them.
    for label, flags in CONFIGS:
        if args.rehearse and "nf4" in flags and not _has("bitsandbytes"):
            rows.append((label, None, None, "bitsandbytes not installed"))
            continue
        common = ["--model", model, *workload, *device, *flags]
        predicted = (predictions.get("configs") or {}).get(label) or _autotune(["estimate", *common, "--json"])
        target = ["--model", model, *workload, *(["--gpu", PLAN_REHEARSAL_CARD] if args.rehearse else device)]
        if args.rehearse and plans:  # the rehearsal plans its first config only (its time is the test suite's)
            plans[label] = {"status": "planned on the GPU (the rehearsal plans its first config only)"}
        else:
            plans[label] = (predictions.get("plans") or {}).get(label) or _plan_row(target, predicted)
        rows.append((label, predicted, _measured(common, steps, args.rehearse), None))
        _write(out, lines + _table(rows), args)
    lines += _table(rows) + _plan_table(rows, plans, args.rehearse)
    lines.append(f"({time.monotonic() - started:.0f} s so far)")
    _write(out, lines, args)
    lines += _torchtune(args.rehearse, predictions, out, lambda done: _write(out, lines + done, args), started)
    lines.append(f"({time.monotonic() - started:.0f} s so far)")
    lines += _find(args.rehearse)
    _write(out, lines, args)
    lines += _gpu_tests(args.rehearse, DEADLINE_S - (time.monotonic() - started))
    if args.rehearse:
        lines.append(
            "rehearsal: on the GPU machine the same steps run these configs on "
            f"{GPU_MODEL} ({' '.join(GPU_WORKLOAD)}, --device cuda, 5 timed steps): "
            "max_memory_allocated, max_memory_reserved, tokens/s and nvidia-smi's figure against the predictions "
            "and the plan's; then the torchtune rows (seq 4096, compiled, activation offload) with the allocator's "
            "history: the peak's live blocks by group beside the estimate's parts, the snapshots beside the results; "
            f"then find on {FIND_MODEL} ({' '.join(FIND_ARGS)}); then the gpu-marked tests in what is left of "
            f"{DEADLINE_S} s"
        )
    print("\n".join(lines))
    _write(out, lines, args)


Row = tuple[str, "dict[str, Any] | None", "dict[str, Any] | None", "str | None"]


def _measured(common: list[str], steps: list[str], rehearse: bool, extra: list[str] | None = None) -> dict[str, Any]:
    """``autotune trial --json`` of ``common``, with what nvidia-smi shows the card using during the trial over what
    it showed before (the trial's process: its CUDA context, the allocator's reserve, NCCL's buffers; nothing in a
    rehearsal)."""
    before = read_now(["memory.used"]) if not rehearse else None
    with Readings(["memory.used"], 100, enabled=before is not None) as used:
        measured = _autotune(["trial", *common, *steps, *(extra or []), "--json"])
    if before and used.rows:
        measured["device_bytes"] = int((max(used.column("memory.used")) - before[0]) * 2**20)  # MiB
    return measured


def _plan_row(target: list[str], predicted: dict[str, Any]) -> dict[str, Any]:
    """What ``find --plan`` says of the estimated config: its family planned (a space of its knobs, every micro batch
    the global batch allows), the row of this config, or why the plan has none. The plan's figures differ from the
    estimate's where the plan draws them otherwise: a model of 8 layers or more is traced as its 2- and 4-layer
    copies drawn to its depth (the estimate traces it whole), and a micro batch other than the family's middle one
    is judged by the straight line through that one's estimate (``autotune.search.plan``)."""
    from autotune.config.knobs import TrialConfig
    from autotune.search.space import KNOBS

    config = predicted.get("config")
    if not isinstance(config, dict):
        return {"status": "not planned: no estimate"}
    default = TrialConfig(micro_batch=config["micro_batch"]).to_dict()
    knobs: dict[str, Any] = {"micro_batch": "auto"}
    for name in KNOBS:
        if name not in ("micro_batch", "layout") and name in config and config[name] != default.get(name):
            knobs[name] = config[name] if name == "lora_alpha" else [config[name]]
    with tempfile.TemporaryDirectory() as tmp:
        space = Path(tmp) / "family.yaml"
        space.write_text(json.dumps({"description": "one config's family", "knobs": knobs}))  # JSON is YAML
        plan = _autotune(["find", "--plan", "--space", str(space), *target, "--json"])
    if not isinstance(plan.get("rows"), list):
        return {"status": f"not planned: {plan.get('error') or plan.get('status')}"}
    for row in plan["rows"]:
        if row.get("config") == config or (row.get("twin") and row["twin"] == predicted.get("describe")):
            return {**row, "plan_device": plan.get("device")}
    return {"status": f"not in the plan ({plan.get('too_big')} of the family predicted over its limit)"}


def _plan_table(rows: list[Row], plans: dict[str, dict[str, Any]], rehearse: bool) -> list[str]:
    """The measured figures beside the estimate's and the plan's, for each config."""
    where = f" (rehearsal: the plan is {PLAN_REHEARSAL_CARD}'s, the rest the CPU's)" if rehearse else ""
    out = [
        f"find --plan over each config's family{where}: a model of 8 layers or more traced as its 2- and 4-layer "
        "copies drawn to its depth, a micro batch other than the family's middle one judged by the straight line "
        "through that one's estimate; where neither applies the plan's figures are the estimate's",
        "config | reserved: measured / estimate / plan (plan error; its memory from) "
        "| tokens/s: measured / estimate / plan (plan error)",
    ]
    for label, predicted, measured, why in rows:
        plan = plans.get(label) or {}
        if why is not None or predicted is None or measured is None or measured.get("status") != "ok":
            continue
        if "memory_bytes" not in plan:
            out.append(f"{label} (plan) | {plan.get('status', 'not planned')}")
            continue
        cuda = measured.get("peak_reserved_bytes") is not None
        memory = measured.get("peak_reserved_bytes") or measured.get("peak_allocated_bytes")
        estimate = predicted.get("predicted_reserved_bytes" if cuda else "predicted_peak_bytes")
        rate = measured.get("tokens_per_s")
        out.append(
            f"{label} (plan) | {_three(memory, estimate, plan['memory_bytes'], _size)}; {plan.get('memory_from')} "
            f"| {_three(rate, (predicted.get('step_time') or {}).get('tokens_per_s'), plan.get('tokens_per_s'), _rate)}"
        )
    return out


def _three(measured: float | None, estimate: float | None, plan: float | None, show: Callable[[float], str]) -> str:
    def text(value: float | None) -> str:
        return "-" if value is None else show(value)

    error = f" ({plan / measured - 1:+.1%})" if plan and measured else ""
    return f"{text(measured)} / {text(estimate)} / {text(plan)}{error}"


def _size(value: float) -> str:
    return f"{value / GiB:.3f} GiB"


def _torchtune_rows(rehearse: bool) -> list[tuple[str, str, list[str]]]:
    """(key, what, the model and workload flags and the knob flags) of each torchtune row of
    ``bench/gpu_published.py``; in a rehearsal, the configs' tiny GPT-2 (traced already: the suite's time) without
    the CUDA-only levers."""
    import gpu_published  # bench/gpu_published.py

    rows = []
    for row in gpu_published.ROWS:
        if row.key not in TORCHTUNE_ROWS:
            continue
        if rehearse:
            model, workload = REHEARSAL_TORCHTUNE
            config = row.config.replace(**CUDA_ONLY)
        else:
            model = str(Path(row.workload.model).resolve().relative_to(ROOT))
            workload = ["--seq-len", str(row.workload.seq_len), "--global-batch", str(row.workload.global_batch)]
            config = row.config
        rows.append((row.key, row.what, ["--model", model, *workload, *_knob_flags(config)]))
    return rows


def _knob_flags(config: Any) -> list[str]:
    """The command-line knobs that make ``config`` (checked: the CLI's own parsing of them gives it back)."""
    from autotune.cli.parse import knobs
    from autotune.config.knobs import TrialConfig
    from autotune.levers import LEVER_FLAGS

    default = TrialConfig(micro_batch=config.micro_batch)
    flags, typed = ["--micro-batch", str(config.micro_batch)], {}
    for flag in LEVER_FLAGS:
        value = getattr(config, flag.field)
        if value == getattr(default, flag.field):
            typed[flag.field] = flag.default
            continue
        text = ("on" if value else "off") if isinstance(value, bool) else str(value)
        text = ",".join(value) if isinstance(value, tuple) else text
        flags += [flag.names[0], text]
        typed[flag.field] = text
    if knobs(micro_batch=config.micro_batch, **typed) != config:
        raise SystemExit(f"gpu_check: {' '.join(flags)} does not make {config.describe()}")
    return flags


def _torchtune(
    rehearse: bool, predictions: dict[str, Any], out: Path, progress: Callable[[list[str]], None], started: float
) -> list[str]:
    """The torchtune rows, each estimated and measured, with the allocator's history recorded in the trial
    (``AUTOTUNE_CUDA_MEMORY_HISTORY``): the peak's live blocks by group beside the estimate's parts, and the
    snapshot beside the results (``<results>_<row>.pickle.gz``)."""
    from autotune.trial.memory import MEMORY_HISTORY_ENV

    device = ["--device", "cpu" if rehearse else "cuda"]
    lines = [
        "torchtune's Llama-3.2-3B levers (bench/gpu_published.py's rows; the trial with the CUDA allocator's history, "
        f"{' '.join(TORCHTUNE_STEPS)} after compile's three steps)"
        + (": on a CPU, the tiny GPT-2 without compile and activation offload (CUDA only)" if rehearse else ""),
    ]
    rows: list[Row] = []
    details: list[str] = []
    for key, what, flags in _torchtune_rows(rehearse):
        left = DEADLINE_S - (time.monotonic() - started)
        if rehearse and key != REHEARSED_TORCHTUNE_ROW:  # the suite's time: one row runs, every row's flags are made
            rows.append(
                (
                    key,
                    None,
                    None,
                    f"on the GPU only (the rehearsal runs {REHEARSED_TORCHTUNE_ROW}: every lever of the three)",
                )
            )
            details.append(f"{key} ({what}): {shlex.join(flags)}")
            continue
        if not rehearse and left < 60:
            rows.append((key, None, None, f"{left:.0f} s left of {DEADLINE_S} s"))
            continue
        common = [*flags, *device]
        predicted = (predictions.get("configs") or {}).get(key) or _autotune(["estimate", *common, "--json"])
        with tempfile.TemporaryDirectory() as tmp:
            history = Path(tmp) / "history.pickle"
            os.environ[MEMORY_HISTORY_ENV] = str(history)
            try:
                timeout = ["--trial-timeout", f"{max(left - 30, 60):.0f}"] if not rehearse else []
                measured = _measured(common, TORCHTUNE_STEPS, rehearse, timeout)
            finally:
                del os.environ[MEMORY_HISTORY_ENV]
            details += [f"{key} ({what}): {shlex.join(flags)}"]
            details += _breakdown(key, history, predicted, measured, out, rehearse)
        rows.append((key, predicted, measured, None))
        progress(lines + _table(rows) + details)
    return lines + _table(rows) + details


def _breakdown(
    key: str, history: Path, predicted: dict[str, Any], measured: dict[str, Any], out: Path, rehearse: bool
) -> list[str]:
    """The peak part by part from the trial's allocator history, beside the estimate's parts."""
    estimate = (
        "  the estimate's parts: "
        + ", ".join(f"{name.replace('_', ' ')} {_gib(predicted.get(f'{name}_bytes'))}" for name in _ESTIMATE_PARTS)
        + " GiB"
    )
    if not history.exists():
        if rehearse:
            return [
                "  history: none on a CPU (AUTOTUNE_CUDA_MEMORY_HISTORY is inert there); on the GPU: the live blocks "
                f"at the allocated peak by group ({', '.join(GROUPS)}) beside the estimate's parts, and the snapshot "
                "beside the results",
                estimate,
            ]
        return [f"  history: not written ({measured.get('status')}: {measured.get('error') or 'no file'})", estimate]
    snapshot = read_snapshot(history)
    parts = peak_parts(snapshot)
    by = parts["parts"]
    written = write_snapshot(
        snapshot, out.with_name(f"{out.stem}_{key.replace('+', '_')}.pickle.gz"), peak_index=parts["peak_index"]
    )
    allocated = measured.get("peak_allocated_bytes")
    rest = sum(by[g] for g in ("recompute", "offload", "backward", "other", "before the history"))
    return [
        f"  the peak part by part (the history replayed: {_gib(parts['peak_bytes'])} GiB, max_memory_allocated "
        f"{_gib(allocated)}; reached by a {parts['reached_by']} allocation; {parts['events']:,} events, "
        f"{parts['blocks']:,} blocks live): " + ", ".join(f"{group} {_gib(by[group])}" for group in GROUPS) + " GiB",
        estimate,
        "  side by side, estimate / measured: "
        f"parameters {_gib(predicted.get('parameters_bytes'))} / build {_gib(by['build'])}; optimizer state "
        f"{_gib(predicted.get('optimizer_state_bytes'))} / optimizer {_gib(by['optimizer'])}; activations "
        f"{_gib(predicted.get('activations_bytes'))} / forward + loss {_gib(by['forward'] + by['loss'])}; "
        f"gradients + temporaries {_gib(_sum(predicted, 'gradients_bytes', 'temporaries_bytes'))} / the rest "
        f"{_gib(rest)} GiB",
        f"  snapshot: {written}",
    ]


_ESTIMATE_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "not_live_at_peak")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def _sum(data: dict[str, Any], *keys: str) -> int | None:
    values = [data.get(k) for k in keys]
    return None if any(v is None for v in values) else sum(values)  # type: ignore[misc]


def _write(out: Path, lines: list[str], args: argparse.Namespace) -> None:
    if not args.rehearse or args.out:
        out.write_text("\n".join(lines) + "\n")


def _predict_for(card: str, out: Path | None) -> None:
    """Each config's estimate for CARD, made here (a trace needs no GPU), as the GPU run reads them."""
    command = f"python bench/gpu_check.py --predict-for {card}"
    configs, plans = {}, {}
    for label, flags in CONFIGS:
        configs[label] = _autotune(["estimate", "--model", GPU_MODEL, *GPU_WORKLOAD, "--gpu", card, *flags, "--json"])
        plans[label] = _plan_row(["--model", GPU_MODEL, *GPU_WORKLOAD, "--gpu", card], configs[label])
        print(f"{label}: {configs[label].get('status', 'predicted')}, plan {plans[label].get('status', 'planned')}")
    for key, _, flags in _torchtune_rows(rehearse=False):
        configs[key] = _autotune(["estimate", *flags, "--gpu", card, "--json"])
        print(f"{key}: {configs[key].get('status', 'predicted')}", flush=True)
    path = out or ROOT / "bench" / "results" / f"gpu_check_predicted_{card}.json"
    document = {"command": command, "card": card, "configs": configs, "plans": plans}
    path.write_text(json.dumps(document, indent=1) + "\n")


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


def _gpu_tests(rehearse: bool, left_s: float) -> list[str]:
    # One line per failure, each test cut at 60 s (pytest-timeout is on the GPU machine): a lease's few
    # minutes end with every failure's reason printed, not with tracebacks that never came. They run in what is
    # left of DEADLINE_S, at most 240 s (gpu_tests_H200.txt: a whole run takes longer; run them on their own then).
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "--tb=line", "-rfE"]
    command += ["--continue-on-collection-errors", *(["--timeout=60"] if _has("pytest_timeout") else [])]
    if rehearse:
        return [f"gpu-marked tests: would run `{shlex.join(command[1:])}` (skipped on a CPU)"]
    limit = min(240.0, left_s - 5)
    if limit < 30:
        return [f"gpu-marked tests: not run, {left_s:.0f} s left of {DEADLINE_S} s (`{shlex.join(command[1:])}`)"]
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return [f"gpu-marked tests: not finished in {limit:.0f} s (`{shlex.join(command[1:])}`)"]
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
