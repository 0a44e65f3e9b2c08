"""The workload: what the user trains. The tuner never changes it.

Model, task, sequence length, global batch, ranks per trial (and the nodes they span), device and
optimizer are fixed by the user; the knobs in :mod:`autotune.config.knobs` are what the tuner moves around them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import WorkloadError

__all__ = ["Workload", "TASKS", "TEXT_TASKS", "CLASSIFIER_TASKS", "DEVICES", "DEFAULT_MODEL", "DEFAULT_IMAGE_SIZE"]

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq-lm", "image-cls")
TEXT_TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq-lm")
CLASSIFIER_TASKS = ("seq-cls", "image-cls")  # a new head: LoRA trains it in full (PEFT's modules_to_save)
DEVICES = ("auto", "cuda", "cpu")
OPTIMIZERS = ("adamw",)
DEFAULT_MODEL = "builtin:gpt2-tiny"
DEFAULT_IMAGE_SIZE = 224  # ImageNet training crops, when neither the flag nor the config says
_ADDED_LATER = {"target_len": None, "image_size": None, "gpu": None, "nodes": 1}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model and the batch it trains on; see ``autotune trial --help`` for each field."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={
            "help": "builtin:NAME, a config.json or model directory, a Hub id "
            "(from the local cache), or module:function returning a torch.nn.Module."
        },
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": (
                "causal-lm, seq-cls, masked-lm, seq2seq-lm or image-cls; inferred from the model config when left out."
            )
        },
    )
    seq_len: int = field(default=128, metadata={"help": "Tokens per sample (an encoder-decoder's source)."})
    target_len: int | None = field(
        default=None,
        metadata={"help": "seq2seq-lm: decoder tokens per sample (default: --seq-len)."},
    )
    image_size: int | None = field(
        default=None,
        metadata={"help": "image-cls: pixels per side of each image (default: the model config's, else 224)."},
    )
    global_batch: int = field(
        default=16,
        metadata={"help": "Samples per optimizer step over all ranks (micro batch x accumulation x ranks)."},
    )
    nproc: int = field(default=1, metadata={"help": "Ranks per trial; more than 1 runs under torchrun."})
    nodes: int = field(
        default=1,
        metadata={
            "help": "Nodes a trial's ranks span (a SLURM job's), the same ranks on each; --nproc counts them all."
        },
    )
    device: str = field(default="auto", metadata={"help": "auto (CUDA when visible), cuda or cpu."})
    gpu: str | None = field(
        default=None,
        metadata={
            "help": "The card a CUDA workload is for, when it is not the one here: A100-80GB, H100-80GB, ... "
            "(estimates predict its reserved and nvidia-smi memory; implies --device cuda)."
        },
    )
    optimizer: str = field(default="adamw", metadata={"help": "The optimizer trained with (adamw)."})
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow model code from a Hub repository or directory to run (off by default)."},
    )

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise WorkloadError(f"--task {self.task!r} is not known; use one of {', '.join(TASKS)}")
        for flag, value in (
            ("--seq-len", self.seq_len),
            ("--global-batch", self.global_batch),
            ("--nproc", self.nproc),
            ("--nodes", self.nodes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WorkloadError(f"{flag} {value!r} must be a whole number of at least 1")
        if self.target_len is not None and (
            not isinstance(self.target_len, int) or isinstance(self.target_len, bool) or self.target_len < 1
        ):
            raise WorkloadError(f"--target-len {self.target_len!r} must be a whole number of at least 1")
        if self.target_len is not None and self.task not in (None, "seq2seq-lm"):
            raise WorkloadError(
                f"--target-len is the decoder's length of a seq2seq-lm task, not of --task {self.task}; leave it out"
            )
        if self.image_size is not None and (
            not isinstance(self.image_size, int) or isinstance(self.image_size, bool) or self.image_size < 1
        ):
            raise WorkloadError(f"--image-size {self.image_size!r} must be a whole number of pixels, at least 1")
        if self.image_size is not None and self.task not in (None, "image-cls"):
            raise WorkloadError(
                f"--image-size is the input of an image-cls task, not of --task {self.task}; leave it out"
            )
        if self.device not in DEVICES:
            raise WorkloadError(f"--device {self.device!r} is not known; use one of {', '.join(DEVICES)}")
        if self.gpu is not None:
            from autotune.config.gpus import gpu_spec

            if self.device == "cpu":
                raise WorkloadError(
                    f"--gpu {self.gpu} names a card for a CUDA workload, not --device cpu; "
                    "use --device cuda (or auto), or leave --gpu out"
                )
            object.__setattr__(self, "gpu", gpu_spec(self.gpu).name)  # the table's spelling
            object.__setattr__(self, "device", "cuda")  # a named card means a CUDA workload
        if self.optimizer not in OPTIMIZERS:
            raise WorkloadError(f"optimizer {self.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
        if self.nproc < self.nodes:
            raise WorkloadError(
                f"--nodes {self.nodes} with --nproc {self.nproc}: each node runs at least one rank; "
                f"use --nproc {self.nodes} or more"
            )
        if self.nproc % self.nodes:
            raise WorkloadError(
                f"--nproc {self.nproc} does not divide over --nodes {self.nodes}; give each node the same ranks"
            )
        if self.global_batch % self.nproc:
            raise WorkloadError(
                f"--global-batch {self.global_batch} does not split over --nproc {self.nproc} ranks; "
                f"use a global batch that is a multiple of {self.nproc}"
            )
        if not self.model:
            raise WorkloadError("--model is empty; use e.g. builtin:gpt2-tiny")

    @property
    def ranks_per_node(self) -> int:
        """The ranks each of the trial's nodes runs (torchrun's --nproc-per-node)."""
        return self.nproc // self.nodes

    @property
    def decoder_len(self) -> int:
        """An encoder-decoder's target tokens per sample: --target-len, else --seq-len."""
        return self.target_len or self.seq_len

    def tokens_per_sample(self, task: str) -> int | None:
        """The tokens one sample feeds the model, as tokens/s counts them: an encoder-decoder's
        source and target tokens; a text model's sequence; None for images."""
        if task not in TEXT_TASKS:
            return None
        return self.seq_len + self.decoder_len if task == "seq2seq-lm" else self.seq_len

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        # Fields added after studies were stored are left out at their default: a study stored
        # before them still answers the same question (and find still finds it by name).
        for name, default in _ADDED_LATER.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise WorkloadError(f"unknown workload field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
