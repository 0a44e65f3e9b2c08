"""``--grad-sync`` and ``--reduce-dtype``: when and in what type FSDP2 reduces the gradients.

``--grad-sync each`` (the default) reduce-scatters every micro step's gradients in its backward, so a rank
holds only its shard of them between micro steps. ``--grad-sync last`` turns the reduction off on every
micro step but the last (FSDP2's ``set_requires_gradient_sync(False)``, as KempnerForge's ``maybe_no_sync``,
Accelerate's ``accumulate()`` without ``sync_each_batch`` and Lightning Fabric's ``no_backward_sync`` do): one
reduce-scatter a step instead of one a micro step, but each rank keeps every parameter's unsharded gradient from
the first micro step to the last reduction. FSDP2 keeps them in the reduce dtype (``FSDPParam.
to_accumulated_grad_if_needed`` casts each unsharded gradient to ``reduce_dtype`` when its group's backward
does not reduce, ``accumulate_unsharded_grad_if_needed`` adds the next ones into it; PyTorch's
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``).

``--reduce-dtype auto`` reduces as the precision implies: in fp32 under the mixed precisions (their
``MixedPrecisionPolicy``), in the gradients' own type otherwise (bf16-true shards without a policy).
``--reduce-dtype fp32`` reduces a bf16-true model's gradients in fp32 too: ``MixedPrecisionPolicy(param_dtype
=bfloat16, reduce_dtype=float32)`` on bf16 parameters, as KempnerForge's ``default_mp_policy`` does.

Both are FSDP2's: DDP already reduces on the last micro step only (its ``no_sync``), in the gradients' type.
The trial runs them and the estimator traces them (FSDP2 runs on fake tensors there), nothing added by hand.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "GRAD_SYNCS",
    "REDUCE_DTYPES",
    "GradReductionFields",
    "GradReductionLever",
    "asks_fsdp_reduction",
    "fsdp_precision",
    "gradient_sync",
    "reducing_micro_steps",
]

GRAD_SYNCS = ("each", "last")
REDUCE_DTYPES = ("auto", "fp32")


@dataclass(frozen=True, kw_only=True)
class GradReductionFields:
    grad_sync: str = field(
        default="each",
        metadata={
            "help": "With --fsdp and gradient accumulation: reduce-scatter the gradients on each micro step "
            "(each), or only on the last (last: FSDP2's set_requires_gradient_sync(False) on the others, "
            "one reduction a step, but every unsharded gradient kept in the reduce dtype between micro steps).",
            "omit_at_default": True,  # added after studies were stored: a config's dict reads as before at it
        },
    )
    reduce_dtype: str = field(
        default="auto",
        metadata={
            "help": "With --fsdp: the type FSDP2 reduces gradients in: auto (fp32 under mixed precision, the "
            "gradients' own under bf16-true) or fp32 (also under bf16-true: MixedPrecisionPolicy's "
            "reduce_dtype=float32 on bf16 parameters).",
            "omit_at_default": True,
        },
    )


def asks_fsdp_reduction(config: TrialConfig) -> bool:
    """Whether ``config`` asks FSDP2 for its reduction beside its sharding (either value not the default): what
    FSDP over one data-parallel rank, which shards nothing, is then for."""
    return config.grad_sync != "each" or config.reduce_dtype != "auto"


def fsdp_precision(config: TrialConfig) -> tuple[str, str] | None:
    """torch's names of the ``param_dtype`` and ``reduce_dtype`` of FSDP2's ``MixedPrecisionPolicy`` for
    ``config``, or None: no policy (its gradients reduced in their own type)."""
    if config.autocast_type is not None:  # mixed precision: 16-bit compute copies, fp32 reduction
        return config.autocast_type, "float32"
    if config.reduce_dtype == "fp32" and config.true_16_bit and config.sixteen_bit is not None:
        return config.sixteen_bit, "float32"  # the parameters' own type: no cast before the all-gather
    return None


def reducing_micro_steps(config: TrialConfig, accum: int, traced_micro_steps: int) -> int:
    """How many times one optimizer step pays a trace's gradient reductions per micro step (the trace's mean over
    its ``traced_micro_steps``): every micro step reduces under ``each`` (``accum`` of them); under ``last`` only
    the last does, which the trace's mean spread over its micro steps (so as many as it traced, whatever the
    accumulation of the config timed from it)."""
    return traced_micro_steps if config.grad_sync == "last" else accum


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, config: TrialConfig, *, last: bool) -> Iterator[None]:
    """The context one micro step's forward and backward run in: with ``--grad-sync last`` on a micro step but
    the last, FSDP2's reduction off for it (``set_requires_gradient_sync(False)`` on the root, which every
    ``fully_shard`` unit under it follows), on again after (as KempnerForge's ``maybe_no_sync``)."""
    skip = config.grad_sync == "last" and not last and hasattr(model, "set_requires_gradient_sync")
    if not skip:
        yield
        return
    sharded: Any = model
    sharded.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        sharded.set_requires_gradient_sync(True)


class GradReductionLever(Lever):
    name = "grad_reduction"
    fields = ("grad_sync", "reduce_dtype")
    flags = (
        Flag("grad_sync", ("--grad-sync",), str, "each", "each or last. "),
        Flag("reduce_dtype", ("--reduce-dtype",), str, "auto", "auto or fp32. "),
    )

    def check(self, config: TrialConfig) -> None:
        if config.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"--grad-sync {config.grad_sync!r} must be each or last")
        if config.reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"--reduce-dtype {config.reduce_dtype!r} must be auto or fp32")

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        if config.uses_fsdp:
            return None
        if config.grad_sync != "each":
            return (
                "--grad-sync last turns FSDP2's per-micro-step reduction off; without --fsdp, DDP already "
                "reduces on the last micro step only: use --grad-sync each"
            )
        if config.reduce_dtype != "auto":
            return (
                "--reduce-dtype fp32 is FSDP2's MixedPrecisionPolicy; without --fsdp the gradients are reduced "
                "in their own type: use --reduce-dtype auto"
            )
        return None

    def labels(self, config: TrialConfig) -> list[str]:
        words = ["sync-last"] if config.grad_sync == "last" else []
        return words + (["reduce-fp32"] if config.reduce_dtype == "fp32" else [])

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.grad_sync != "each":
            raise ConfigError(
                f"--format torchtitan: this config reduces gradients on the last micro step only (--grad-sync "
                f"{config.grad_sync}), and torchtitan reduces them on each; pick a config with --grad-sync each, "
                "or export --format json"
            )
        if not config.uses_fsdp:
            return {}
        if config.true_16_bit and fsdp_precision(config) is None:  # FSDP2 reduces in the 16-bit gradients' type
            raise ConfigError(
                f"--format torchtitan: this config's FSDP reduces gradients in their own type ({config.sixteen_bit}), "
                "and torchtitan's always in float32; pick a config with --reduce-dtype fp32, or export --format json"
            )
        return {"training": {"mixed_precision_reduce": "float32"}}

    def in_code(self, config: TrialConfig) -> list[str]:
        lines = []
        if config.grad_sync == "last":
            lines.append(
                "grad sync: on every micro step but the last, model.set_requires_gradient_sync(False) before its "
                "forward and True after its backward (FSDP2; Accelerate: sync_each_batch=False)"
            )
        if config.reduce_dtype == "fp32":
            lines.append(
                "reduce dtype: fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32)) on each unit and the root"
            )
        return lines
