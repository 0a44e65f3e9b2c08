"""What the trial device can do: its type, name, memory and which precisions train on it."""

from __future__ import annotations

import platform
from dataclasses import dataclass

from autotune.errors import WorkloadError

__all__ = ["DeviceInfo", "detect_device"]


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" or "cpu"
    name: str
    count: int  # GPUs visible (1 for the CPU, whose ranks share its cores)
    total_memory_bytes: int | None
    bf16: bool
    fp16_deepspeed: bool  # DeepSpeed's accelerator trains fp16 here
    compute_capability: tuple[int, int] | None = None  # a CUDA card's (major, minor); None for a CPU


def detect_device(requested: str = "auto") -> DeviceInfo:
    """Resolve ``--device auto|cuda|cpu`` to what this machine has; refuse cuda without a GPU."""
    import torch

    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise WorkloadError("--device cuda: no CUDA device is visible here; use --device cpu or auto")
    if requested == "cuda" or (requested == "auto" and has_cuda):
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo(
            "cuda",
            props.name,
            torch.cuda.device_count(),
            props.total_memory,
            bf16=torch.cuda.is_bf16_supported(),
            fp16_deepspeed=True,
            compute_capability=(props.major, props.minor),
        )
    try:
        import psutil

        total = psutil.virtual_memory().total
    except ImportError:  # psutil comes with DeepSpeed; memory is only informative here
        total = None
    return DeviceInfo(
        "cpu",
        platform.processor() or platform.machine() or "cpu",
        1,
        total,
        bf16=True,
        fp16_deepspeed=_cpu_fp16_in_deepspeed(),
    )


def _cpu_fp16_in_deepspeed() -> bool:
    # DeepSpeed's CPU accelerator answers is_fp16_supported() with this same oneDNN probe, any
    # error meaning no; where it says no, its engine stops: "Type fp16 is not supported on your device".
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False
