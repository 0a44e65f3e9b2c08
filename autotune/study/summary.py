"""A study read back as plain values: what ``show``, ``report``, ``export`` and ``--json`` print.

Built from the Optuna study by :mod:`autotune.study.records`; nothing here imports Optuna or torch,
so the types are cheap to build in tests and to render (saying which layers a LoRA config
adapts takes what the study stored, or reads the model's config and PEFT's table for a study
that stored nothing: see :mod:`autotune.study.stored_facts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers import LEVERS
from autotune.study.stored_facts import lora_where
from autotune.trial.result import TOKENS_PER_S, pick_throughput

__all__ = ["TrialRecord", "StudySummary", "what_is_trained"]


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One trial of a study. ``status`` is a TrialStatus value, or ``interrupted``, ``running``, or
    ``skipped`` (not run: the estimator predicted it over the memory limit)."""

    number: int
    config: TrialConfig
    status: str
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    throughput_unit: str = TOKENS_PER_S  # of throughput: tokens/s, images/s or samples/s
    peak_memory_bytes: int | None = None
    fits: bool = False  # ok and its peak is under the memory limit
    duration_s: float | None = None  # wall time of the whole trial (start-up included)
    error: str | None = None
    predicted_peak_bytes: int | None = None  # the estimator's prediction, when it was asked
    # The re-run of a winner candidate: None when not re-run; else whether it held up.
    confirmed: bool | None = None
    confirmed_tokens_per_s: float | None = None
    confirmed_samples_per_s: float | None = None
    confirmed_peak_memory_bytes: int | None = None
    decided_rank: int | None = None  # place in the interleaved confirmation (0: the answer)
    step_time_spread: float | None = None  # IQR / median of its step times (0.1 = within 10%)
    outpaced: bool = False  # one timed step showed it far slower than the best: not measured further
    lost: str | None = None  # interrupted because its worker died: why it was taken for gone
    retry_of: int | None = None  # the interrupted trial whose config this one measures again

    @property
    def throughput(self) -> float | None:
        """Its first measured figure, in ``throughput_unit``: what the tuner maximised."""
        return pick_throughput(self.throughput_unit, self.tokens_per_s, self.samples_per_s)

    @property
    def confirmed_throughput(self) -> float | None:
        return pick_throughput(self.throughput_unit, self.confirmed_tokens_per_s, self.confirmed_samples_per_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "config": self.config.to_dict(),
            "describe": self.config.describe(),
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s,
            "throughput_unit": self.throughput_unit,
            "peak_memory_bytes": self.peak_memory_bytes,
            "fits": self.fits,
            "duration_s": self.duration_s,
            "error": self.error,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "confirmed": self.confirmed,
            "confirmed_tokens_per_s": self.confirmed_tokens_per_s,
            "confirmed_samples_per_s": self.confirmed_samples_per_s,
            "confirmed_peak_memory_bytes": self.confirmed_peak_memory_bytes,
            "decided_rank": self.decided_rank,
            "step_time_spread": self.step_time_spread,
            "lost": self.lost,
            "retry_of": self.retry_of,
        }


@dataclass(frozen=True, kw_only=True)
class StudySummary:
    """A whole study: its question (workload, device, budget, space) and every trial."""

    name: str
    storage: str  # URL with any password masked
    workload: Workload
    space: str  # preset name or file the study was created with
    device: dict[str, Any]  # type, name, count, total_memory_bytes
    memory_budget_bytes: int
    memory_limit_bytes: int  # budget minus headroom: a config fits below it
    trials: list[TrialRecord] = field(default_factory=list)
    best: TrialRecord | None = None  # the confirmed winner, if any
    importances: dict[str, float] | None = None  # knob -> share of tokens/s variance (Optuna fANOVA)
    certainty: str | None = None  # how sure the answer is, in words (from the confirmation)
    command: list[str] | None = None  # script mode: the user's training command each trial ran
    stopped: str | None = None  # why the last search ended, and what it left untried
    worker_jobs: list[dict[str, Any]] = field(default_factory=list)  # SLURM jobs that ran workers on it
    # What a one-knob batch-size finder answers, measured first (autotune.search.simple); None: none fits,
    # or a study that did not measure one.
    simple_answer: TrialRecord | None = None

    @property
    def throughput_unit(self) -> str:
        """What its trials measured: tokens/s, images/s or samples/s."""
        return next((t.throughput_unit for t in self.trials if t.throughput is not None), TOKENS_PER_S)

    @property
    def n_trials(self) -> int:
        """Trials that measured something (interrupted, running and skipped ones are not counted)."""
        return sum(t.status not in ("interrupted", "running", "skipped") for t in self.trials)

    def to_dict(self) -> dict[str, Any]:
        best = None
        if self.best is not None:
            best = {
                "number": self.best.number,
                "config": self.best.config.to_dict(),
                "describe": self.best.config.describe(),
                "status": self.best.status,
                "tokens_per_s": self.best.confirmed_tokens_per_s,
                "samples_per_s": self.best.confirmed_samples_per_s,
                "throughput_unit": self.best.throughput_unit,
                "peak_memory_bytes": self.best.confirmed_peak_memory_bytes,
                "first_measured_tokens_per_s": self.best.tokens_per_s,
                "trains": what_is_trained(self.best.config, self.workload),
                "certainty": self.certainty,
            }
        return {
            "study": self.name,
            "storage": self.storage,
            "workload": self.workload.to_dict(),
            "command": self.command,
            "worker_jobs": self.worker_jobs,
            "space": self.space,
            "device": self.device,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_limit_bytes": self.memory_limit_bytes,
            "n_trials": self.n_trials,
            "best": best,
            "simple_answer": None if self.simple_answer is None else self.simple_answer.number,
            "importances": self.importances,
            "stopped": self.stopped,
            "trials": [t.to_dict() for t in self.trials],
        }


def what_is_trained(config: TrialConfig, workload: Workload | None = None) -> dict[str, Any]:
    """The two knobs that change the maths, said plainly: every output carries this.

    With the workload, LoRA's note also says which layers it adapts (PEFT's default targets for
    the architecture, or every linear layer but the task head) and that a classifier's head
    trains in full: as the study stored it at tune time, else from the model's config (and
    PEFT's table, only for default targets).
    """
    precision = {
        "fp32": "fp32",
        "tf32": "fp32 with tf32 matmuls",
        "fp16": "fp16 mixed precision",
        "bf16": "bf16 mixed precision",
        "bf16-true": "bf16 throughout (weights, gradients and Adam states; no fp32 copy)",
    }[config.precision]
    lora: dict[str, Any] | None = None
    note = f"all weights trained in {precision}"
    if config.uses_lora:
        lora = {
            "rank": config.lora_rank,
            "alpha": config.effective_lora_alpha,
            "targets": list(config.lora_targets) if config.lora_targets else None,
        }
        note = f"LoRA adapters only trained in {precision}"
        where = lora_where(config, workload) if workload is not None else None
        if where is not None:
            lora["targets_note"], head = where
            note = (
                f"LoRA r={config.lora_rank} adapters"
                + ("" if head else " only")
                + f", on {lora['targets_note']}"
                + (", plus the classification head in full" if head else "")
                + f", trained in {precision}"
            )
        if config.precision in ("fp16", "bf16"):  # as PEFT recipes load it: dtype=the 16-bit type
            note += f"; the frozen base held in {config.precision}"
    note += "".join(f"; {said}" for lever in LEVERS if (said := lever.maths_note(config)))
    return {"precision": config.precision, "lora": lora, "note": note}
