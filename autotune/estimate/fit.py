"""Whether an estimated config fits: the device it is judged against, the budget there, the limit the
headroom leaves, and the rule itself (``autotune estimate``'s fits column, ``find --plan``'s budget).

A config fits when what it holds stays within the limit (reserved bytes on CUDA, live tensors on a
CPU: :meth:`autotune.estimate.results.MemoryEstimate.fits`) and, for a named card (``--gpu``),
when what ``nvidia-smi`` would show stays within the card's memory too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.errors import AutotuneError, ConfigError

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate

__all__ = ["estimated_device", "card_budget", "memory_limit", "estimate_fits"]


def estimated_device(workload: Workload) -> DeviceInfo | None:
    """The device an estimate is checked against: the named card, the one here, or None (a CUDA
    workload estimated on a machine without a GPU, no card named: checked for what it can be)."""
    from autotune.config.device import detect_device
    from autotune.config.gpus import device_info, gpu_spec

    if workload.gpu is not None:
        return device_info(gpu_spec(workload.gpu), count=workload.nproc)
    try:
        return detect_device(workload.device)
    except AutotuneError:  # --device cuda with no GPU here: estimating for another machine
        return None


def card_budget(budget_bytes: int | None, device: DeviceInfo) -> int:
    """A named card's budget: its memory unless --memory-budget says less; more is refused."""
    from autotune.sizes import format_size

    assert device.total_memory_bytes is not None  # a named card's memory is known
    if budget_bytes is None:
        return device.total_memory_bytes
    if budget_bytes > device.total_memory_bytes:
        raise ConfigError(
            f"--memory-budget {format_size(budget_bytes)} is more than {device.name}'s "
            f"{format_size(device.total_memory_bytes)}; use at most that, or leave it out"
        )
    return budget_bytes


def memory_limit(budget_bytes: int | None, headroom: float) -> int | None:
    """What a config may hold: the budget less the headroom (None: no budget, nothing to fit)."""
    return int(budget_bytes * (1 - headroom)) if budget_bytes is not None else None


def estimate_fits(
    estimate: MemoryEstimate, *, limit_bytes: int | None, workload: Workload, device: DeviceInfo | None
) -> bool | None:
    """Whether ``estimate`` fits under ``limit_bytes``, and on a named card within its memory as
    ``nvidia-smi`` counts it; None without a limit."""
    if limit_bytes is None:
        return None
    if not estimate.fits(limit_bytes):
        return False
    shown = estimate.predicted_device_bytes
    if shown is None or workload.gpu is None or device is None or device.total_memory_bytes is None:
        return True
    return shown <= device.total_memory_bytes
