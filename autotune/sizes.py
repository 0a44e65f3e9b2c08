"""Byte sizes as people write them (``512MiB``, ``24GiB``, ``1.5GB``) and back; durations (``90s``, ``5m``)."""

from __future__ import annotations

import re

from autotune.errors import ConfigError

__all__ = ["parse_size", "format_size", "parse_duration"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, flag: str = "--memory-budget") -> int:
    """Return the number of bytes in ``text``; raise ConfigError naming ``flag`` if unreadable."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size; write a number with a unit, e.g. 512MiB, 24GiB or 16GB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{flag} {text!r} must be larger than zero")
    return size


def format_size(size: int | None) -> str:
    """Render bytes with a binary unit; ``None`` (not measured) renders as a dash."""
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


_SECONDS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, *, flag: str) -> float:
    """Return the seconds in ``text`` (``90``, ``90s``, ``5m``, ``1.5h``); raise ConfigError naming ``flag``."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SECONDS:
        raise ConfigError(f"{flag} {text!r} is not a duration; write a number with a unit, e.g. 90s, 5m or 1h")
    seconds = float(match.group(1)) * _SECONDS[unit]
    if seconds <= 0:
        raise ConfigError(f"{flag} {text!r} must be longer than zero")
    return seconds
