"""Flag values turned into the API's: on/off, every-N, the ZeRO stage, the knob options into a
:class:`~autotune.config.knobs.TrialConfig`, the executor options into an
:class:`~autotune.search.slurm.Executor`, sizes and durations. A bad value is refused naming its flag.
"""

from __future__ import annotations

from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.errors import ConfigError
from autotune.levers import LEVER_FLAGS
from autotune.levers.base import on_off
from autotune.search.slurm import Executor

__all__ = ["knobs", "executor", "size", "duration"]


def knobs(**values: Any) -> TrialConfig:
    """The knob options (as typed) as one config: each lever's from its flags (``autotune.levers``), then those of
    the families that are not levers yet."""
    fields: dict[str, Any] = {"micro_batch": values.pop("micro_batch")}
    for flag in LEVER_FLAGS:
        fields.update(flag.fields_of(values.pop(flag.field)))
    fsdp = values.pop("fsdp")
    return TrialConfig(
        **fields,
        zero_stage=_zero_stage(values.pop("zero_stage")),
        fsdp=None if fsdp.lower() in ("off", "none") else fsdp.lower(),
        shard_group=values.pop("shard_group"),
        offload=values.pop("offload"),
        tp=values.pop("tp"),
        sequence_parallel=on_off(values.pop("sequence_parallel"), "--sequence-parallel"),
        pp=values.pop("pp"),
        pp_schedule=values.pop("pp_schedule"),
        **values,  # none left: a knob option without a place here is a TypeError, not silently dropped
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


def _zero_stage(value: str) -> int | None:
    if value.lower() in ("off", "none"):
        return None
    if value.isdigit():
        return int(value)
    raise ConfigError(f"--zero-stage {value!r} is not known; use off, 0, 1, 2 or 3")
