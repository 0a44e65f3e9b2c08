"""What ``autotune estimate`` prints: a fixed-width table, a row per config as its estimate comes
(the peak and its parts, the CUDA figures, whether it fits, the step), and the footer saying what the
columns mean; or, with ``--json``, one JSON object per config.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import StepTime
    from autotune.search.estimates import EstimateRow, Estimates

__all__ = ["estimate_json", "estimate_header", "estimate_line", "estimate_footer"]

_CONFIG_WIDTH = 34
_PART_WIDTHS = (10, 10, 10, 11, 11, 10)  # parameters, gradients, optimizer, activations, temporaries, not live


def estimate_json(row: EstimateRow, estimates: Estimates) -> str:
    """One config's estimate as one JSON object (a line of ``--json``)."""
    from autotune.estimate.cuda_memory import describe_figures

    profile = estimates.profile
    return json.dumps(
        {
            **row.estimate.to_dict(),
            "memory_budget_bytes": estimates.budget_bytes,
            "memory_limit_bytes": estimates.limit_bytes,
            "fits": row.fits,
            **({"figures": describe_figures()} if _cuda(row.estimate) else {}),
            "step_time": row.step.to_dict() if row.step is not None else None,
            "step_time_on": profile.describe() if profile is not None else None,
        }
    )


def estimate_header(row: EstimateRow, estimates: Estimates) -> str:
    """The table's header, its columns those of the first row (printed once that row exists: a
    refusal prints nothing)."""
    return (
        f"{'config':<{_CONFIG_WIDTH}} {'peak':>10} = {'params':>10} {'grads':>10} {'optimizer':>10} "
        f"{'activations':>11} {'temporaries':>11} {'not live':>10}"
        + (f" {'reserved':>10} {'nvidia-smi':>10}" if _cuda(row.estimate) else "")
        + ("  fits" if estimates.limit_bytes is not None else "")
        + (f" {'step':>9} {_rate_unit(row.step):>12}" if row.step is not None else "")
    )


def estimate_line(row: EstimateRow) -> str:
    """One config's row; a pipeline's also names each rank's peak on a line of its own."""
    from autotune.sizes import format_size

    result, step = row.estimate, row.step
    parts = list(result.parts().values())
    line = (
        f"{result.config.describe():<{_CONFIG_WIDTH}} {format_size(result.predicted_peak_bytes):>10} = "
        + " ".join(f"{format_size(p):>{w}}" for p, w in zip(parts, _PART_WIDTHS, strict=True))
        + (
            f" {format_size(result.predicted_reserved_bytes):>10} {format_size(result.predicted_device_bytes):>10}"
            if _cuda(result)
            else ""
        )
        + ("" if row.fits is None else ("  yes" if row.fits else "   no"))
        + (f" {step.step_s:>7.3g} s {_rate(step):>12,.0f}" if step is not None else "")
    )
    if result.peak_per_rank_bytes is not None:  # pipeline stages: the row is the rank that holds the most
        ranks = ", ".join(format_size(peak) for peak in result.peak_per_rank_bytes)
        line += f"\n{'':<{_CONFIG_WIDTH}} per rank (stage 0 first): {ranks}"
    return line


def estimate_footer(last: EstimateRow, estimates: Estimates) -> str:
    """What the columns mean, after the last row (whose trace says which kernels were used)."""
    result = last.estimate
    lines = [
        "peak = the parts; activations and temporaries: live at the peak; not live: model states "
        "not allocated at the peak (gradients the backward has not made yet)"
    ]
    if any(config.model_parallel > 1 or config.uses_fsdp or config.uses_deepspeed for config in estimates.configs):
        lines.append("figures are one rank's: a split or sharded model's share of it (pipeline: its largest stage)")
    if _cuda(result):
        lines.append(_cuda_footer(result, estimates))
    lines.append(result.device_note or f"traced with {result.traced_device.upper()} kernels")
    if estimates.profile is not None:
        nodes = estimates.profile.nodes(estimates.workload)
        lines.append(
            f"step: one optimizer step of the whole --global-batch, its traced operators timed against "
            f"{estimates.profile.describe()}{f', on {nodes}' if nodes else ''}; nothing was run"
        )
    return "\n".join(lines)


def _cuda(result: MemoryEstimate) -> bool:
    """A CUDA workload's estimate: it has the reserved and nvidia-smi figures."""
    return result.predicted_reserved_bytes is not None


def _rate_unit(step: StepTime) -> str:
    return "tokens/s" if step.tokens_per_s is not None else "samples/s"


def _rate(step: StepTime) -> float:
    return step.tokens_per_s if step.tokens_per_s is not None else step.samples_per_s


def _cuda_footer(result: MemoryEstimate, estimates: Estimates) -> str:
    from autotune.config.gpus import gpu_spec
    from autotune.estimate.nccl_buffers import describe_communicators
    from autotune.sizes import format_size

    parts, limit = result.cuda_parts, estimates.limit_bytes
    assert parts is not None  # a CUDA estimate's
    talking = describe_communicators(gpu_spec(result.gpu) if result.gpu else None, result.config, estimates.workload)
    lines = [
        f"reserved = peak + allocator cache ({format_size(parts['allocator cache'])}) + cuBLAS workspace "
        f"({format_size(parts['cuBLAS workspace'])}): {result.method.rpartition(' + ')[2]}",
        f"nvidia-smi = reserved + CUDA context ({format_size(parts['CUDA context'])}"
        + (f", {result.gpu}'s typical" if result.gpu else ", typical: name the card with --gpu")
        + f") + NCCL buffers ({format_size(parts['NCCL buffers'])}{f' in {talking}' if talking else ''})",
    ]
    if result.attention_kernels:
        lines.append(
            "attention as CUDA picks it: "
            + ", ".join(f"{kernel} ({calls} calls)" for kernel, calls in result.attention_kernels.items())
        )
    if limit is not None:
        lines.append(
            f"fits: reserved within {format_size(limit)} (the budget less the headroom)"
            + (f" and nvidia-smi within {result.gpu}'s memory" if result.gpu else "")
        )
    return "\n".join(lines)
