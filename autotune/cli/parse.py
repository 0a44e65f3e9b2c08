"""Flag values turned into the API's: on/off, every-N, the knob options into a
:class:`~autotune.config.knobs.TrialConfig`, the executor options into an
:class:`~autotune.search.slurm.Executor`, sizes and durations. A bad value is refused naming its flag.
"""

from __future__ import annotations

from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.levers import LEVER_FLAGS
from autotune.search.slurm import Executor

__all__ = ["knobs", "executor", "size", "duration"]


def knobs(**values: Any) -> TrialConfig:
    """The knob options (as typed) as one config: each lever's from its flags (``autotune.levers``)."""
    fields: dict[str, Any] = {"micro_batch": values.pop("micro_batch")}
    for flag in LEVER_FLAGS:
        fields.update(flag.fields_of(values.pop(flag.field)))
    return TrialConfig(
        **fields,
        **values,  # none left: a knob option without a place here is a TypeError, not silently dropped
    )


def executor(
    executor: str,
    nodes: int,
    partition: str | None,
    account: str | None,
    slurm_time: str | None,
    qos: str | None,
    constraint: str | None,
    slurm_signal: str | None,
    slurm_option: list[str] | None,
) -> Executor:
    """The executor options (as typed) as one Executor (``--gpus-per-node``, shared with the plans, joins it in
    find and tune); the library checks them against the workload."""
    return Executor(
        name=executor,
        nodes=nodes,
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
