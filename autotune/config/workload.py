"""The workload: what the user trains. The tuner never changes it.

Model, task, sequence length, global batch, ranks per trial, device and optimizer are fixed
by the user; the knobs in :mod:`autotune.config.knobs` are what the tuner moves around them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import WorkloadError

__all__ = ["Workload", "TASKS", "DEVICES", "DEFAULT_MODEL"]

TASKS = ("causal-lm", "seq-cls", "masked-lm")
DEVICES = ("auto", "cuda", "cpu")
OPTIMIZERS = ("adamw",)
DEFAULT_MODEL = "builtin:gpt2-tiny"


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and the batch it trains on; see ``autotune trial --help`` for each field."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "builtin:NAME, a config.json or model directory, a Hub id "
                          "(from the local cache), or module:function returning a torch.nn.Module."},
    )
    task: str | None = field(
        default=None,
        metadata={"help": "causal-lm, seq-cls or masked-lm; inferred from the model config when left out."},
    )
    seq_len: int = field(default=128, metadata={"help": "Tokens per sample."})
    global_batch: int = field(
        default=16,
        metadata={"help": "Samples per optimizer step over all ranks (micro batch x accumulation x ranks)."},
    )
    nproc: int = field(default=1, metadata={"help": "Ranks per trial; more than 1 runs under torchrun."})
    device: str = field(default="auto", metadata={"help": "auto (CUDA when visible), cuda or cpu."})
    optimizer: str = field(default="adamw", metadata={"help": "The optimizer trained with (adamw)."})
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow model code from a Hub repository or directory to run (off by default)."},
    )

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise WorkloadError(f"--task {self.task!r} is not known; use one of {', '.join(TASKS)}")
        for flag, value in (("--seq-len", self.seq_len), ("--global-batch", self.global_batch),
                            ("--nproc", self.nproc)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WorkloadError(f"{flag} {value!r} must be a whole number of at least 1")
        if self.device not in DEVICES:
            raise WorkloadError(f"--device {self.device!r} is not known; use one of {', '.join(DEVICES)}")
        if self.optimizer not in OPTIMIZERS:
            raise WorkloadError(
                f"optimizer {self.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
        if self.global_batch % self.nproc:
            raise WorkloadError(
                f"--global-batch {self.global_batch} does not split over --nproc {self.nproc} ranks; "
                f"use a global batch that is a multiple of {self.nproc}")
        if not self.model:
            raise WorkloadError("--model is empty; use e.g. builtin:gpt2-tiny")

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise WorkloadError(f"unknown workload field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
