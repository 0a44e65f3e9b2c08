"""Flag values turned into the API's: on/off, every-N, the ZeRO stage, the knob options into a
:class:`~autotune.config.knobs.TrialConfig`, the executor options into an
:class:`~autotune.search.slurm.Executor`, sizes and durations. A bad value is refused naming its flag.
"""

from __future__ import annotations

from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.errors import ConfigError
from autotune.search.slurm import Executor

__all__ = ["knobs", "executor", "size", "duration"]


def knobs(
    micro_batch: int,
    precision: str,
    checkpointing: str,
    loss: str,
    attention: str,
    fused_optimizer: str,
    optimizer: str,
    optimizer_in_backward: str,
    activation_offload: str,
    compile: str,
    lora_rank: int | None,
    lora_alpha: int | None,
    lora_targets: str | None,
    quantize_base: str,
    zero_stage: str,
    fsdp: str,
    shard_group: int | None,
    offload: str,
    tp: int,
    sequence_parallel: str,
    pp: int,
    pp_schedule: str,
) -> TrialConfig:
    """The knob options (as typed) as one config."""
    return TrialConfig(
        micro_batch=micro_batch,
        precision=precision,
        **_checkpointing(checkpointing),
        loss=loss,
        attention=attention,
        fused_optimizer=_on_off(fused_optimizer, "--fused-optimizer"),
        optimizer=optimizer,
        optimizer_in_backward=_on_off(optimizer_in_backward, "--optimizer-in-backward"),
        activation_offload=_on_off(activation_offload, "--activation-offload"),
        compile=_on_off(compile, "--compile"),
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=tuple(t.strip() for t in lora_targets.split(",")) if lora_targets is not None else None,
        quantize_base=quantize_base,
        zero_stage=_zero_stage(zero_stage),
        fsdp=None if fsdp.lower() in ("off", "none") else fsdp.lower(),
        shard_group=shard_group,
        offload=offload,
        tp=tp,
        sequence_parallel=_on_off(sequence_parallel, "--sequence-parallel"),
        pp=pp,
        pp_schedule=pp_schedule,
    )


def executor(
    executor: str,
    nodes: int,
    gpus_per_node: int | None,
    partition: str | None,
    account: str | None,
    slurm_time: str | None,
    qos: str | None,
    constraint: str | None,
    slurm_signal: str | None,
    slurm_option: list[str] | None,
) -> Executor:
    """The executor options (as typed) as one Executor; the library checks them against the workload."""
    return Executor(
        name=executor,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        partition=partition,
        account=account,
        time=slurm_time,
        qos=qos,
        constraint=constraint,
        signal=slurm_signal,
        options=tuple(slurm_option or ()),
    )


def size(text: str | None) -> int | None:
    """``--memory-budget`` and the like: 512MiB, 24GiB (None: not given)."""
    from autotune.sizes import parse_size

    return parse_size(text) if text is not None else None


def duration(text: str | None, flag: str) -> float | None:
    """``--max-time``: 60s, 5m, 1h (None: not given)."""
    from autotune.sizes import parse_duration

    return parse_duration(text, flag=flag) if text is not None else None


def _on_off(value: str, flag: str) -> bool:
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{flag} {value!r} must be on or off")


def _checkpointing(value: str) -> dict[str, Any]:
    kind, _, every = value.lower().partition("-")
    if kind == "every":
        if not every.isdigit() or int(every) < 2:
            raise ConfigError(
                f"--checkpointing {value!r}: write every-N with N a whole number of 2 or more, e.g. every-2"
            )
        return {"checkpointing": True, "checkpoint_every": int(every)}
    try:
        return {"checkpointing": _on_off(value, "--checkpointing")}
    except ConfigError:
        raise ConfigError(f"--checkpointing {value!r} must be on, off or every-N (e.g. every-2)") from None


def _zero_stage(value: str) -> int | None:
    if value.lower() in ("off", "none"):
        return None
    if value.isdigit():
        return int(value)
    raise ConfigError(f"--zero-stage {value!r} is not known; use off, 0, 1, 2 or 3")
