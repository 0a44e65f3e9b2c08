"""Peers side by side: batch-size finders and `autotune find` on four models, each under a CPU budget.

    python bench/peers.py     # writes bench/results/peers_cpu.{json,md}; about 30 minutes on 2 quiet cores
    python bench/peers.py --models bert-cls --rounds 3    # one of the MODELS

The models (``MODELS``): three written for this bench, which no test uses (a GQA Llama, a BERT encoder
for sequence classification, a wide-vocabulary Qwen2 whose logits dominate its memory; their configs in
``bench/data/peers/``), and ``builtin:gpt2-deep-tiny``. Each budget is tight enough that the largest
micro batch does not fit at the default knobs.

Each tool tunes in its own process, the real library code:

- Lightning ``Tuner.scale_batch_size`` (mode power, and mode binsearch), on a LightningModule
  wrapping the workload's model (``autotune.models.sources.build_model``) and synthetic batches of its shapes;
- Accelerate ``find_executable_batch_size`` around a training loop, as Accelerate's
  ``automatic_gradient_accumulation`` example uses it: starting at the global batch, accumulation
  ``global batch // batch size``, two optimizer steps per attempt;
- ``autotune find`` (the CLI, ``--json``, a fresh SQLite storage in a temporary directory), once
  per ``--space``: by default ``default`` (every exact knob and the mixed precisions) and ``quick``
  (micro batch, checkpointing, fp32/bf16).

Inside each peer's process ``autotune.trial.memory.LiveBytesTracker`` enforces the budget: an
out-of-memory error carrying the CPU allocator's own words, which the peers' OOM matchers
(Lightning ``is_oom_error``, Accelerate ``should_reduce_batch_size``) recognise. The peers pick a
micro batch only (fp32, no checkpointing); each pick is then measured with ``autotune trial --json``
at the same budget, as its job would run it: micro batch m, accumulation ``global // m`` (Accelerate's
rule; the global batch is m x that), interleaved round by round with ``autotune find``'s pick.
For each peer's pick, the time each ``find`` run took to hold an answer at least as good
(``held_after``; the rule in ``HELD_RULE``), from the trials' times in its study, and when ``find``
printed its first answer (the simple answer: the one-knob finders' answer, measured first).
DeepSpeed's autotuner is listed but not run (see ``DEEPSPEED``).

    python bench/peers.py --remeasure --rounds 5   # the picks in the results, measured again
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("lightning-power", "lightning-binsearch", "accelerate")
MODELS = {  # name: the workload and budget of each model (paths relative to the repository root)
    "llama-gqa-3l": {"model": "bench/data/peers/llama-gqa-3l/config.json", "memory_budget": "160MiB"},
    "bert-cls": {"model": "bench/data/peers/bert-cls/config.json", "memory_budget": "160MiB"},
    "wide-vocab": {"model": "bench/data/peers/wide-vocab/config.json", "memory_budget": "320MiB"},
    "gpt2-deep-tiny": {"model": "builtin:gpt2-deep-tiny", "memory_budget": "84MiB"},
}
HEADROOM = 0.10  # autotune's default: a config fits when its peak stays 10% under the budget
PROBE_OPTIMIZER_STEPS = 2  # the second step holds optimizer states, gradients and activations at once
QUIET_SPREAD = 0.10  # a measurement whose step times spread wider (IQR / median) was disturbed
TOOLS = {
    "lightning-power": "Lightning `scale_batch_size` power",
    "lightning-binsearch": "Lightning `scale_batch_size` binsearch",
    "accelerate": "Accelerate `find_executable_batch_size`",
}
DEEPSPEED = (
    "not run: `deepspeed --autotuning run` starts every experiment through its launcher and "
    "ends each with pdsh over ssh (not installed here); it has no memory budget (it sizes "
    "configs against the accelerator's total memory) and no CPU live-bytes tracker to "
    "enforce one in its experiments' processes; it is made for GPU nodes"
)


# -- inside a peer's process ----------------------------------------------------------------------
def _synthetic_dataset(model: Any, *, task: str, seq_len: int, length: int = 100_000) -> Any:
    """Random tokens of the workload's shapes, as autotune's trials use (values change neither speed
    nor memory); long enough that no finder stops at the dataset's length."""
    import torch

    vocab = model.config.vocab_size

    class SyntheticTokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return length

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, vocab, (seq_len,))
            labels = ids if task == "causal-lm" else torch.randint(0, 2, ())
            return {"input_ids": ids, "labels": labels}

    return SyntheticTokens()


def _lightning(mode: str, workload: Any, task: str, attempts: list[dict[str, Any]], workdir: str) -> int:
    import lightning as L
    import torch
    from lightning.pytorch.tuner import Tuner

    from autotune.config.deepspeed_config import LEARNING_RATE
    from autotune.models.sources import build_model

    class PeerModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(workload, task=task, device=torch.device("cpu"))
            self.dataset = _synthetic_dataset(self.model, task=task, seq_len=workload.seq_len)
            self.batch_size = 2  # the attribute scale_batch_size adjusts

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE, weight_decay=0.0)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:  # the finder resets the loop for each size it tries
                attempts.append({"micro_batch": len(batch["input_ids"]), "steps_done": 0})

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            attempts[-1]["steps_done"] = batch_idx + 1

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=workdir,
    )
    return Tuner(trainer).scale_batch_size(PeerModule(), mode=mode)  # Lightning's defaults otherwise


def _accelerate(workload: Any, task: str, attempts: list[dict[str, Any]]) -> int:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    from autotune.config.deepspeed_config import LEARNING_RATE
    from autotune.models.sources import build_model

    accelerator = Accelerator(cpu=True)
    observed = workload.global_batch

    @find_executable_batch_size(starting_batch_size=observed)
    def train(batch_size: int) -> int:
        nonlocal accelerator
        accum = observed // batch_size
        attempts.append({"micro_batch": batch_size, "accumulation": accum, "steps_done": 0})
        accelerator.gradient_accumulation_steps = accum
        accelerator.free_memory()
        model = build_model(workload, task=task, device=accelerator.device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(
            _synthetic_dataset(model, task=task, seq_len=workload.seq_len), batch_size=batch_size
        )
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for micro, batch in zip(range(PROBE_OPTIMIZER_STEPS * accum), loader, strict=False):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            attempts[-1]["steps_done"] = micro + 1
        return batch_size

    return train()


def run_peer(name: str, workload: Any, budget: int, result_path: Path) -> None:
    """Tune with one peer under the budget; write its pick and attempts to ``result_path``."""
    from autotune.models.sources import resolve_task
    from autotune.trial.memory import LiveBytesTracker

    task = resolve_task(workload)
    attempts: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir, LiveBytesTracker(budget) as tracker:
        if name == "accelerate":
            picked = _accelerate(workload, task, attempts)
        else:
            picked = _lightning(name.removeprefix("lightning-"), workload, task, attempts, workdir)
    result_path.write_text(
        json.dumps(
            {
                "picked_micro_batch": picked,
                "attempts": attempts,
                "finder_s": time.perf_counter() - started,
                "tracker_peak_bytes": tracker.peak_bytes,
            }
        )
    )


# -- the bench ------------------------------------------------------------------------------------
def _workload_flags(args: argparse.Namespace) -> list[str]:
    model = ROOT / args.model  # the tools run in temporary directories: a config file by its absolute path
    return ["--model", str(model) if model.is_file() else args.model, "--seq-len", str(args.seq_len)]


def _turn() -> Any:
    """Take the CPU turn autotune's own trials take, so that no autotune trial of another run
    computes on these cores while a peer tunes or a pick is measured."""
    from autotune.search.workers import cpu_turn

    return cpu_turn("cpu")


def tune_with_peer(name: str, args: argparse.Namespace, budget: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, _turn():
        result_path = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--peer",
            name,
            "--result",
            str(result_path),
            "--budget-bytes",
            str(budget),
            "--global-batch",
            str(args.global_batch),
            *_workload_flags(args),
        ]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=600)
        wall = time.perf_counter() - started
        if proc.returncode != 0 or not result_path.exists():
            raise SystemExit(f"peer {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {**json.loads(result_path.read_text()), "wall_s": wall}


def tune_with_autotune(args: argparse.Namespace, space: str) -> dict[str, Any]:
    file = ROOT / space  # find runs in a temporary directory: a space file by its absolute path
    flags = [
        *_workload_flags(args),
        "--global-batch",
        str(args.global_batch),
        "--memory-budget",
        args.memory_budget,
        "--space",
        str(file) if file.is_file() else space,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"sqlite:///{tmp}/autotune.db"
        cmd = [sys.executable, "-m", "autotune", "find", *flags, "--storage", storage, "--json"]
        started_at = time.time()  # the wall clock, for the trials' stored times
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=3600)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"autotune find failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        study = json.loads(proc.stdout)
        timeline = find_timeline(storage, study["study"], started_at)
    ran = [t for t in study["trials"] if t["status"] != "skipped"]
    simple = next((t for t in timeline if t["number"] == study.get("simple_answer")), None)
    return {
        "picked": study["best"],
        "stopped": study.get("stopped"),
        "simple_answer": None if simple is None else {k: simple[k] for k in ("number", "describe", "complete_s")},
        "wall_s": wall,
        "trials_run": len(ran),
        "oom_trials": sum(t["status"] == "oom" for t in ran),
        "trial_s": sum(t["duration_s"] or 0.0 for t in ran),
        "trials": [
            {k: t.get(k) for k in ("describe", "status", "tokens_per_s", "peak_memory_bytes", "duration_s")}
            for t in study["trials"]
        ],
        "timeline": timeline,
        "space": space,
        "command": "autotune find "
        + " ".join([*_relative(flags[:-1]), space])
        + " --storage sqlite:///TMP/autotune.db --json",
    }


def _relative(flags: list[str]) -> list[str]:
    """The flags as a user in the repository's root would type them (no path of this machine)."""
    return [str(Path(f).relative_to(ROOT)) if f.startswith(str(ROOT)) else f for f in flags]


def find_timeline(storage: str, study_name: str, started_at: float) -> list[dict[str, Any]]:
    """``timeline_of`` ``find``'s study ``study_name`` in ``storage``."""
    from autotune.study.sqlite_reader import read_study_file

    read = read_study_file(storage, only=study_name)
    if read is not None:
        return timeline_of(read.studies[study_name], started_at)
    from autotune.study.storage import load_study, open_storage  # a schema the stdlib reader does not know

    return timeline_of(load_study(open_storage(storage), study_name, storage), started_at)


def timeline_of(study: Any, started_at: float) -> list[dict[str, Any]]:
    """Every trial of ``find``'s study (an Optuna study, or as autotune's SQLite reader reads it):
    its config, whether it fits, its first measured throughput (what the search compared) and
    ``complete_s``, the wall seconds from ``started_at`` (the epoch time ``find``'s process was
    started) until the trial completed."""
    from autotune.study.records import records_of

    completes = {t.number: t.datetime_complete for t in study.get_trials(deepcopy=False)}
    return [
        {
            "number": r.number,
            "describe": r.config.describe(),
            "config": r.config.to_dict(),
            "status": r.status,
            "fits": r.fits,
            "throughput": r.throughput,
            # Optuna hands out naive local times: .timestamp() reads them as local, as time.time() counts
            "complete_s": None if completes[r.number] is None else completes[r.number].timestamp() - started_at,
        }
        for r in records_of(study)
    ]


def held_after(
    timeline: list[dict[str, Any]],
    *,
    peer_config: dict[str, Any],
    same_global_batch: bool,
    find_pick: int,
    paired_ratio: float | None,
) -> dict[str, Any]:
    """How long ``find`` took to hold an answer at least as good as a peer's pick.

    ``timeline``: ``find``'s trials (``find_timeline``). The peer's pick is put on the scale of
    ``find``'s first figures: where ``find`` measured the pick's very config (``peer_config``, every
    knob, at the same global batch), that trial's first throughput; else ``find``'s pick's
    (trial ``find_pick``) first throughput times ``paired_ratio``, the median over the interleaved
    rounds of the peer's pick's throughput over ``find``'s pick's. Returns the rule used, that
    threshold, and the first trial to complete that fits and whose first figure is at least the
    threshold, with ``held_s``, its ``complete_s``; ``held_s`` None when no trial was that good.
    """
    same = [
        t
        for t in timeline
        if same_global_batch
        and t["config"] == peer_config
        and t["status"] == "ok"
        and t["throughput"] is not None
        and t["complete_s"] is not None
    ]
    pick = next((t for t in timeline if t["number"] == find_pick), None)
    if same:
        first = min(same, key=lambda t: t["complete_s"])
        rule, threshold = f"same config: trial {first['number']}", first["throughput"]
    elif paired_ratio is not None and pick is not None and pick["throughput"] is not None:
        rule, threshold = f"paired ratio {paired_ratio:.3f} x trial {find_pick}", paired_ratio * pick["throughput"]
    else:
        return {"rule": None, "threshold": None, "held_s": None, "trial": None, "describe": None}
    good = [
        t
        for t in timeline
        if t["fits"] and t["throughput"] is not None and t["throughput"] >= threshold and t["complete_s"] is not None
    ]
    held = min(good, key=lambda t: t["complete_s"], default=None)
    return {
        "rule": rule,
        "threshold": threshold,
        "held_s": None if held is None else held["complete_s"],
        "trial": None if held is None else held["number"],
        "describe": None if held is None else held["describe"],
    }


def measure(config: dict[str, Any], global_batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``autotune trial --json`` of ``config`` at ``global_batch``, under the budget."""
    flags = trial_flags(config)
    cmd = [
        sys.executable,
        "-m",
        "autotune",
        "trial",
        *_workload_flags(args),
        "--global-batch",
        str(global_batch),
        *flags,
        "--memory-budget",
        args.memory_budget,
        "--warmup-steps",
        "1",
        "--steps",
        str(args.steps),
        "--json",
    ]
    with tempfile.TemporaryDirectory() as tmp, _turn():
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=600)
    if not proc.stdout.strip():
        raise SystemExit(f"autotune trial printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    run = {
        key: result.get(key)
        for key in (
            "status",
            "tokens_per_s",
            "peak_memory_bytes",
            "step_time_median_s",
            "step_time_iqr_s",
            "measured_steps",
            "error",
        )
    }
    run["error"] = _without_paths(run["error"])
    median, iqr = run["step_time_median_s"], run["step_time_iqr_s"]
    run["spread"] = iqr / median if median and iqr is not None else None
    run["load_before"] = load
    return run


def _without_paths(text: str | None) -> str | None:
    """An error's text with this machine's paths cut to what a reader can place: the repository's files
    relative to its root, installed packages from ``site-packages/`` on."""
    if text is None:
        return None
    return re.sub(r"/\S*?/site-packages/", "site-packages/", text.replace(str(ROOT) + "/", ""))


def trial_flags(config: dict[str, Any]) -> list[str]:
    """``autotune trial``'s flags for a config (the knobs a one-rank CPU space moves)."""
    every = config.get("checkpoint_every", 1)
    checkpointing = ("on" if every == 1 else f"every-{every}") if config["checkpointing"] else "off"
    flags = ["--micro-batch", str(config["micro_batch"]), "--precision", config["precision"]]
    flags += ["--checkpointing", checkpointing]
    flags += ["--loss", config.get("loss", "standard"), "--attention", config.get("attention", "auto")]
    flags += ["--fused-optimizer", "on" if config.get("fused_optimizer") else "off"]
    if config.get("optimizer"):
        flags += ["--optimizer", config["optimizer"]]
    if config.get("lora_rank"):
        flags += ["--lora-rank", str(config["lora_rank"])]
    if config.get("zero_stage") is not None:
        flags += ["--zero-stage", str(config["zero_stage"]), "--offload", config["offload"]]
    return flags


def measure_picks(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Measure each distinct pick ``args.rounds`` times, interleaved (A B C A B C ...) so that
    each sees the same conditions; the runs go into each row's ``measured``."""
    from autotune.config.knobs import TrialConfig

    distinct: dict[str, list[dict[str, Any]]] = {}
    for row in rows:  # one config (every knob as TrialConfig spells it) at one global batch is measured once
        config = TrialConfig.from_dict(row["config"]).to_dict()
        row["measured"] = distinct.setdefault(json.dumps([config, row["global_batch"]], sort_keys=True), [])
    for round_ in range(args.rounds):
        for key, runs in distinct.items():
            config, global_batch = json.loads(key)
            runs.append(measure(config, global_batch, args))
            run = runs[-1]
            print(
                f"round {round_ + 1}: {_describe(config)} global {global_batch}: {run['status']} "
                f"{run['tokens_per_s'] or 0:,.0f} tokens/s, spread {run['spread'] or 0:.0%}, "
                f"peak {_mib(run['peak_memory_bytes'])}",
                flush=True,
            )


def _describe(config: dict[str, Any]) -> str:
    from autotune.config.knobs import TrialConfig

    return TrialConfig.from_dict(config).describe()


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _figures(runs: list[dict[str, Any]]) -> str:
    """Tokens/s: the median of the settled runs (their steps' spread within QUIET_SPREAD), and of all."""
    if any(r["status"] != "ok" for r in runs):
        return ", ".join(r["status"] for r in runs)
    quiet = [r["tokens_per_s"] for r in runs if r["spread"] is not None and r["spread"] <= QUIET_SPREAD]
    every = [r["tokens_per_s"] for r in runs]
    head = f"**{statistics.median(quiet):,.0f}** ({len(quiet)} of {len(runs)})" if quiet else f"- (0 of {len(runs)})"
    return f"{head}; all: {statistics.median(every):,.0f} ({min(every):,.0f}-{max(every):,.0f})"


def _ratios(runs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[float]:
    """This pick's tokens/s over autotune's pick's, round by round (where both ran ok)."""
    return [
        r["tokens_per_s"] / o["tokens_per_s"]
        for r, o in zip(runs, ours, strict=True)
        if r["status"] == o["status"] == "ok"
    ]


def _paired(runs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> str:
    """The median over rounds of this pick's tokens/s over autotune's pick's in the same round:
    a slow phase of the machine that spans a round slows both."""
    ratios = _ratios(runs, ours)
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


HELD_RULE = (
    "`find` held one as good after: for each `find` run, the wall seconds from the start of its process "
    "(start-up included: what a user waits) until the first of its trials to complete that fits with headroom "
    "and whose first measured tokens/s (what its search compared) is at least the peer's pick's, both on "
    "`find`'s scale: where that `find` measured the pick's very config at the same global batch, that "
    "trial's first figure (same config); else that `find`'s pick's first figure times the median over the "
    "rounds above of the peer's pick's tokens/s over that `find` pick's (ratio). `-`: it never held one that good."
)


def add_held_after(rows: list[dict[str, Any]]) -> None:
    """Into each peer's row, ``held_after``: per ``find`` run (by space), ``held_after()``'s answer."""
    from autotune.config.knobs import TrialConfig

    finds = [row for row in rows if row.get("peer", "").startswith("autotune:")]
    for row in rows:
        if row.get("peer") not in PEERS:
            continue
        row["held_after"] = {}
        for found in finds:
            timeline = found["tuned"].get("timeline")
            if timeline is None:  # a report written before the trials' times were kept
                row["held_after"][found["tuned"]["space"]] = {"rule": None, "held_s": None, "unrecorded": True}
                continue
            ratios = _ratios(row["measured"], found["measured"])
            row["held_after"][found["tuned"]["space"]] = held_after(
                timeline,
                peer_config=TrialConfig.from_dict(row["config"]).to_dict(),
                same_global_batch=row["global_batch"] == found["global_batch"],
                find_pick=found["tuned"]["picked"]["number"],
                paired_ratio=statistics.median(ratios) if ratios else None,
            )


def _held_cell(row: dict[str, Any]) -> str:
    cells = []
    for space, held in (row.get("held_after") or {}).items():
        label = f"`{Path(space).stem}`"
        if held.get("unrecorded"):
            cells.append(f"{label}: not recorded")
        elif held["rule"] is None:
            cells.append(f"{label}: - (no figure to compare)")
        elif held["held_s"] is None:
            cells.append(f"{label}: -")
        else:
            how = "same config" if held["rule"].startswith("same config") else "ratio"
            cells.append(f"{label}: {held['held_s']:.0f} s (trial {held['trial']} {held['describe']}; {how})")
    return "; ".join(cells)


def markdown(report: dict[str, Any]) -> str:
    budget = report["memory_budget_bytes"]
    limit = budget * (1 - HEADROOM)
    lines = [
        f"    {report['command']}",
        *([f"    {report['remeasured']}   # the same picks measured again"] if report.get("remeasured") else []),
        "",
        f"{report['workload']}; budget {report['memory_budget']}, fits with headroom when the peak is at most "
        f"{_mib(int(limit))} (10% under). Each pick measured {report['rounds']} times with `autotune trial "
        f"--steps {report['steps']}`, interleaved; tokens/s: the median of the settled runs (step-time spread "
        f"<= {QUIET_SPREAD:.0%} of the median: not disturbed by other processes), then of all runs (min-max); "
        "next to it the median over the rounds of the pick's tokens/s over `autotune find`'s pick's "
        "in the same round (min-max). "
        f"{HELD_RULE} "
        f"{_machine(report)}",
        "",
        "| tool | picked | measured as | tokens/s: settled runs; all runs | vs autotune's pick, same round | peak "
        "| fits with headroom | tuning wall time | `find` held one as good after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ours = next(row["measured"] for row in report["rows"] if row.get("peer", "").startswith("autotune"))
    for row in report["rows"]:
        if row.get("not_run"):
            lines.append(f"| {row['tool']} | {row['not_run']} | - | - | - | - | - | - | - |")
            continue
        runs = row["measured"]
        peak = max((r["peak_memory_bytes"] or 0) for r in runs) or None
        ok = all(r["status"] == "ok" for r in runs)
        fits = "yes" if ok and peak is not None and peak <= limit else "no"
        fits += f" ({peak / budget:.0%} of the budget)" if peak is not None else ""
        lines.append(
            f"| {row['tool']} | {row['picked']} | {row['measured_as']} | {_figures(runs)} "
            f"| {_paired(runs, ours)} | {_mib(peak)} "
            f"| {fits} | {row['wall_s']:.0f} s{row['wall_note']} | {_held_cell(row)} |"
        )
    lines += ["", "How each tool got there:", ""]
    lines += [f"- {row['tool']}: {row['how']}" for row in report["rows"] if row.get("how")]
    return "\n".join(lines) + "\n"


def peer_row(name: str, tuned: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    m = tuned["picked_micro_batch"]
    accum = max(1, args.global_batch // m)
    if name.startswith("lightning"):
        how = ", ".join(f"{a['micro_batch']} {'ok' if a['steps_done'] >= 3 else 'OOM'}" for a in tuned["attempts"])
        if name == "lightning-binsearch":
            how += f"; then its 5% margin: {m}"
        how += " (3 steps per size, no accumulation)"
    else:
        how = ", ".join(
            f"{a['micro_batch']}x{a['accumulation']} "
            f"{'ok' if a['steps_done'] >= PROBE_OPTIMIZER_STEPS * a['accumulation'] else 'OOM'}"
            for a in tuned["attempts"]
        )
        how += f" (micro batch x accumulation, {PROBE_OPTIMIZER_STEPS} optimizer steps per attempt)"
    config = {"micro_batch": m, "precision": "fp32", "checkpointing": False}
    return {
        "tool": TOOLS[name],
        "peer": name,
        "tuned": tuned,
        "picked": f"micro batch {m}",
        "config": config,
        "global_batch": m * accum,
        "measured_as": f"{_describe(config)} x{accum} (global {m * accum})",
        "wall_s": tuned["wall_s"],
        "wall_note": f" ({tuned['finder_s']:.0f} s in the finder)",
        "how": how,
    }


def autotune_row(found: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    best = found["picked"]
    accum = args.global_batch // best["config"]["micro_batch"]
    trains = best.get("trains")
    trials = ", ".join(
        f"{t['describe']} {t['status']}" + (f" {t['tokens_per_s']:,.0f}" if t["tokens_per_s"] else "")
        for t in found["trials"]
    )
    return {
        "tool": f"`autotune find --space {found['space']}`",
        "peer": f"autotune:{found['space']}",
        "tuned": found,
        "picked": f"{best['describe']}, accumulation {accum}",
        "config": best["config"],
        "global_batch": args.global_batch,
        "measured_as": f"{best['describe']} x{accum} (global {args.global_batch})",
        "wall_s": found["wall_s"],
        "wall_note": f" ({found['trials_run']} trials, {found['oom_trials']} OOM, {found['trial_s']:.0f} trial-s)",
        "how": f"trials (tokens/s): {trials}; its confirming re-run of the pick: "
        f"{best['tokens_per_s'] or 0:,.0f} tokens/s; trains: "
        f"{trains.get('note') if isinstance(trains, dict) else trains}",
    }


def _machine(report: dict[str, Any]) -> str:
    def loads(xs: list[float]) -> str:
        return " / ".join(f"{x:.1f}" for x in xs)

    return (
        f"The machine: {report['cores']} cores shared with other agents' work (their autotune trials kept "
        f"off these runs by autotune's CPU turns, the rest not); 1-minute load average "
        f"{loads(report['load']['tuning'])} at the start, after the peers and after each find, "
        f"{loads(report['load']['measuring'])} before and after measuring."
    )


def tune_all(args: argparse.Namespace, budget: int, load: list[float]) -> list[dict[str, Any]]:
    rows = []
    for name in PEERS:
        rows.append(peer_row(name, tune_with_peer(name, args, budget), args))
        print(f"{name}: {rows[-1]['picked']} in {rows[-1]['wall_s']:.1f} s ({rows[-1]['how']})", flush=True)
    load.append(os.getloadavg()[0])
    for space in args.space:
        found = tune_with_autotune(args, space)
        if found["picked"] is None:
            raise SystemExit(f"autotune find --space {space} answered no config")
        rows.append(autotune_row(found, args))
        print(f"autotune find --space {space}: {rows[-1]['picked']} in {found['wall_s']:.1f} s", flush=True)
        load.append(os.getloadavg()[0])
    return rows


def run_model(args: argparse.Namespace) -> dict[str, Any]:
    """Tune ``args``'s workload with every peer and each ``find`` space, then measure the picks interleaved."""
    from autotune.sizes import parse_size

    command = "python bench/peers.py" + "".join(f" {a}" for a in sys.argv[1:])
    tuning_load = [os.getloadavg()[0]]
    rows = tune_all(args, parse_size(args.memory_budget), tuning_load)
    report = {
        "command": command,
        "args": {k: getattr(args, k) for k in ("model", "seq_len", "global_batch", "memory_budget", "space")},
        "workload": f"`{args.model}`, seq {args.seq_len}, global batch {args.global_batch}, 1 rank, CPU",
        "memory_budget_bytes": parse_size(args.memory_budget),
        "headroom": HEADROOM,
        "cores": os.cpu_count(),
        "load": {"tuning": tuning_load},
        "rows": [*rows, {"tool": "DeepSpeed autotuner", "not_run": DEEPSPEED}],
        "versions": _versions(),
    }
    remeasure(report, args)
    return report


def remeasure(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Measure the report's picks (again), interleaved over ``args.rounds``, and when ``find`` held each."""
    measuring_load = [os.getloadavg()[0]]
    measure_picks([row for row in report["rows"] if not row.get("not_run")], args)
    add_held_after(report["rows"])
    report["load"]["measuring"] = [*measuring_load, os.getloadavg()[0]]
    report.update(memory_budget=args.memory_budget, rounds=args.rounds, steps=args.steps)


def summary(reports: dict[str, dict[str, Any]]) -> str:
    """One line per model and ``find`` space: its wall time, when it printed its first answer, and its pick
    against every peer's pick that fits with headroom (median paired ratio over the rounds)."""
    lines = [
        "| model | `find --space` | pick | whole `find` | first answer printed | held as good as each peer's pick "
        "| pick vs each peer's pick that fits with headroom (median, min-max over rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, report in reports.items():
        limit = report["memory_budget_bytes"] * (1 - HEADROOM)
        peers = [row for row in report["rows"] if row.get("peer") in PEERS]
        fitting = [row for row in peers if _fits(row["measured"], limit)]
        for found in (row for row in report["rows"] if row.get("peer", "").startswith("autotune:")):
            space = found["tuned"]["space"]
            simple = found["tuned"].get("simple_answer")
            first = f"{simple['complete_s']:.0f} s ({simple['describe']})" if simple else "-"
            held = "; ".join(
                f"{p['peer']}: "
                + (
                    f"{p['held_after'][space]['held_s']:.0f} s (peer {p['wall_s']:.0f} s)"
                    if p["held_after"][space].get("held_s") is not None
                    else "-"
                )
                for p in peers
            )
            against = (
                "; ".join(
                    f"{p['peer']}: "
                    + ("same config, 1.00x" if _same(p, found) else _paired(found["measured"], p["measured"]))
                    for p in fitting
                )
                or "no peer pick fits with headroom"
            )
            lines.append(
                f"| {name} | `{Path(space).stem}` | {found['picked']} | {found['wall_s']:.0f} s | {first} | {held} "
                f"| {against} |"
            )
    return "\n".join(lines) + "\n"


def _same(row: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two picks are one config at one global batch (every knob, as TrialConfig spells it)."""
    from autotune.config.knobs import TrialConfig

    def normal(config: dict[str, Any]) -> dict[str, Any]:
        return TrialConfig.from_dict(config).to_dict()

    return row["global_batch"] == other["global_batch"] and normal(row["config"]) == normal(other["config"])


def _fits(runs: list[dict[str, Any]], limit: float) -> bool:
    return all(
        r["status"] == "ok" and r["peak_memory_bytes"] is not None and r["peak_memory_bytes"] <= limit for r in runs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--model", help="one other model instead (with --memory-budget)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--memory-budget", help="with --model")
    parser.add_argument(
        "--space", action="append", help="a search space for autotune find, one find each (default: default, quick)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurements of each pick")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each measurement")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "results" / "peers_cpu",
        help="results prefix: writes PREFIX.json and PREFIX.md",
    )
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="keep the picks in PREFIX.json and measure them again (--rounds, --steps)",
    )
    parser.add_argument("--markdown", action="store_true", help="only write PREFIX.md again from PREFIX.json")
    parser.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # inside a peer's process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from autotune.config.workload import Workload

    if args.peer:
        model = ROOT / args.model
        workload = Workload(
            model=str(model) if model.is_file() else args.model,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            device="cpu",
        )
        run_peer(args.peer, workload, args.budget_bytes, args.result)
        return

    args.space = args.space or ["default", "quick"]
    chosen = (
        {args.model: {"model": args.model, "memory_budget": args.memory_budget}}
        if args.model
        else {name: MODELS[name] for name in args.models.split(",")}
    )
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    kept = json.loads(json_path.read_text()).get("models", {}) if json_path.exists() else {}
    reports: dict[str, dict[str, Any]] = {}
    for name, spec in chosen.items() if not args.markdown else {}.items():
        print(f"== {name}", flush=True)
        model_args = argparse.Namespace(**{**vars(args), **spec})
        if args.remeasure:
            report = kept[name]
            for key in ("model", "seq_len", "global_batch", "memory_budget", "space"):
                setattr(model_args, key, report["args"][key])
            report["remeasured"] = "python bench/peers.py" + "".join(f" {a}" for a in sys.argv[1:])
            remeasure(report, model_args)
        else:
            report = run_model(model_args)
        reports[name] = report
        kept[name] = report  # other models' results stay as they were
        args.out.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"models": kept}, indent=2) + "\n")
    md_path.write_text(
        "# Peers on four models\n\n"
        + summary(
            {name: kept[name] for name in MODELS if name in kept} | {k: v for k, v in kept.items() if k not in MODELS}
        )
        + "".join(f"\n## {name}\n\n{markdown(report)}" for name, report in kept.items())
    )
    print(md_path.read_text())


def _versions() -> dict[str, str]:
    import accelerate
    import lightning
    import torch

    return {"torch": torch.__version__, "lightning": lightning.__version__, "accelerate": accelerate.__version__}


if __name__ == "__main__":
    main()
