"""What crosses into a trial's process: one typed spec, written as JSON by the side that starts the trial
and read back on the other side of the process boundary.

Two kinds of process read it: autotune's own trial child (:mod:`autotune.trial.child`, forked by the trial
server or started by torchrun or srun), and, in script mode, the measuring hook inside the user's own
command (:mod:`autotune.scripts.measure`). Both read the same fields, so a field is named and typed once.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload

__all__ = ["TrialSpec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """One trial: the question (workload, config), where it runs, and how it is measured."""

    workload: Workload
    config: TrialConfig
    device_type: str  # "cpu" or "cuda": the child initialises that device
    memory_budget_bytes: int | None  # the budget a CPU trial's live bytes are held to; None: no budget
    warmup_steps: int  # untimed steps before the timed ones
    measure_steps: int  # timed steps (more where their spread is still wide: up to ``max_measure_steps``)
    # The cores free when the trial was started, under the caller's CPU turn: its ranks run only on them.
    # None on a GPU, and under srun (SLURM gave the job its cores).
    cpu_cores: list[int] | None = None
    task: str | None = None  # the workload's task, resolved once by the runner (autotune's own trials)
    max_measure_steps: int | None = None  # None: the measuring module's own bound
    outpaced_step_s: float | None = None  # a timed step this long ends the measurement (see time_steps)
    enough_measured_s: float | None = None  # steps that took this long in all and agree end it (see time_steps)
    out_dir: str | None = None  # script mode: where each rank writes its record
    launched: float | None = None  # script mode: time.perf_counter() as the command was started

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "workload": self.workload.to_dict(), "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:  # a spec written by another autotune release: say so rather than guess
            raise ValueError(f"a trial spec with unknown fields {sorted(unknown)}: written by another autotune")
        return cls(
            **{
                **data,
                "workload": Workload.from_dict(data["workload"]),
                "config": TrialConfig.from_dict(data["config"]),
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict()))

    @classmethod
    def read(cls, path: Path | str) -> TrialSpec:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def grad_accum_steps(self) -> int:
        """Micro batches per optimizer step on each rank."""
        return self.config.grad_accum_steps(self.workload)
