"""``autotune models``: the built-in models (``--model builtin:NAME``)."""

from __future__ import annotations

import json

from autotune.cli.options import command


@command
def models(as_json: bool) -> int:
    """List the built-in models (use them as --model builtin:NAME)."""
    from autotune.models.presets import PRESETS

    if as_json:
        print(json.dumps({name: {"task": p.task, "summary": p.summary} for name, p in PRESETS.items()}))
        return 0
    for name, preset in PRESETS.items():
        print(f"builtin:{name:<16} {preset.task:<10} {preset.summary}")
    return 0
