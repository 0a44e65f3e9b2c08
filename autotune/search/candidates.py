"""A search space's runnable configs: the product of its parameters' values, less what the checks refuse,
without building and checking each of the product's configs.

The ``full`` space on two GPU ranks is a product of 1.5 million configs, of which some 70,000 can run: built
and checked one by one they took half a minute before a tune's first trial. Each refusal is decided by the few
fields its check reads (``--fused-optimizer on with --zero-stage``): every config that agrees with the refused
one on those fields is refused by the same check, whatever else it holds. So each check runs on a config that
notes the fields it reads (:class:`_NotedReads`), and a refusal skips every config of the product that shares
the values of the parameters that made those fields, up to the last of them in the product's order: the
odometer moves on at that parameter. A config every check passes is made as any other.

A check must decide from the fields it reads, the workload and the device (no clock, no chance): the levers'
checks do (``Lever.check``, ``conflict``, ``refusal``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any, Callable, Mapping

from autotune.config.knobs import TrialConfig
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload

__all__ = ["FieldGroup", "runnable_configs"]

# Parameters of a space and what makes a config's fields out of their values (SearchSpace.field_groups).
FieldGroup = tuple[tuple[str, ...], Callable[[Mapping[str, Any]], dict[str, Any]]]

_FIELDS = tuple(dataclasses.fields(TrialConfig))
_FIELD_NAMES = frozenset(f.name for f in _FIELDS)
_READ: set[str] = set()  # the fields read since the check before


class _NotedReads(TrialConfig):
    """A config that notes each field read of it (in ``_READ``); made without its checks, which run one by one."""

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELD_NAMES:
            _READ.add(name)
        elif name == "__dict__":  # every field at once
            _READ.update(_FIELD_NAMES)
        return object.__getattribute__(self, name)


def _unchecked(fields: dict[str, Any]) -> _NotedReads:
    """A :class:`_NotedReads` of ``fields`` (the others at their defaults), normalised as a config is, unchecked."""
    config = object.__new__(_NotedReads)
    for f in _FIELDS:
        if f.name in fields:
            value = fields[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[operator]
        object.__setattr__(config, f.name, value)
    super(TrialConfig, config).__post_init__()  # the levers' normalising, before TrialConfig's checks
    return config


def runnable_configs(
    choices: dict[str, tuple[Any, ...]], groups: list[FieldGroup], workload: Workload, device: DeviceInfo
) -> tuple[list[TrialConfig], str | None]:
    """The configs of the product of ``choices`` (in its order) that every check passes, and the first refusal
    (None if none). ``groups``: which parameters make which fields (``SearchSpace.field_groups``)."""
    # Walked last parameter first: the levers that came last refuse most (a lean optimizer, float8), each with
    # one other, so their refusals fall early in the walk and skip the most (1.5 million: 6 s where the
    # product's own order took 16). The configs are then put back in the product's order.
    keys = list(reversed(choices))
    sizes = [len(choices[key]) for key in keys]
    made = [_group_fields(keys_of, make, choices) for keys_of, make in groups]
    # Which parameters each field depends on: those of each group that made it for some value.
    position = {key: index for index, key in enumerate(keys)}
    group_keys = [tuple(position[key] for key in keys_of if key in position) for keys_of, _ in groups]
    depends: dict[str, set[int]] = {}
    for own, by_places in zip(group_keys, made, strict=True):
        for made_fields in by_places.values():
            for name in made_fields:
                depends.setdefault(name, set()).update(own)

    found: list[tuple[tuple[int, ...], TrialConfig]] = []
    first_refusal: str | None = None
    index = [0] * len(keys)
    while True:
        fields: dict[str, Any] = {}
        for own, by_places in zip(group_keys, made, strict=True):
            fields.update(by_places[tuple(index[p] for p in own)])
        decided = _refused_by(fields, workload, device)
        if decided is None:
            config = TrialConfig(**fields)  # made as any config is (its checks passed as they ran above)
            found.append((tuple(reversed(index)), config))  # its place in the product's order
            last = len(keys) - 1
        else:
            message, read = decided
            first_refusal = first_refusal or message
            last = max((p for name in read for p in depends.get(name, ())), default=-1)
        if last < 0 or not _advance(index, last, sizes):
            return [config for _, config in sorted(found, key=lambda pair: pair[0])], first_refusal


def _group_fields(
    keys_of: tuple[str, ...], make: Callable[[Mapping[str, Any]], dict[str, Any]], choices: dict[str, tuple[Any, ...]]
) -> dict[tuple[int, ...], dict[str, Any]]:
    """A group's fields for each combination of its parameters' values, by their places in ``choices`` (True and 1
    would be one key as values). Those not in ``choices`` are not parameters here: the group reads its default."""
    own = [key for key in keys_of if key in choices]
    return {
        places: make({key: choices[key][i] for key, i in zip(own, places, strict=True)})
        for places in itertools.product(*(range(len(choices[key])) for key in own))
    }


def _refused_by(fields: dict[str, Any], workload: Workload, device: DeviceInfo) -> tuple[str, set[str]] | None:
    """The first refusal of the config of ``fields`` and the fields its check read; None if every check passes."""
    try:
        config = _unchecked(fields)
    except ConfigError as exc:  # a lever's normalising refused it: decided by everything
        return str(exc), set(_FIELD_NAMES)
    checks = itertools.chain(config.value_checks(), config.workload_checks(workload, device))
    for check in checks:
        _READ.clear()
        try:
            check()
        except ConfigError as exc:
            return str(exc), set(_READ)
    return None


def _advance(index: list[int], last: int, sizes: list[int]) -> bool:
    """Move the odometer ``index`` on at position ``last`` (the positions after it back to their first value);
    False once it has gone round."""
    for p in range(last, -1, -1):
        index[p] += 1
        if index[p] < sizes[p]:
            for q in range(p + 1, len(index)):
                index[q] = 0
            return True
        index[p] = 0
    return False
