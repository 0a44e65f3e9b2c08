"""Measure every config of a space: the ground truth that search strategies are replayed against.

Each line of the output is one ``autotune trial --json`` object plus ``trial_seconds`` (the wall
time the trial cost, launch to exit, which a replay charges for it) and ``workload``. Lines are
appended and flushed as trials finish, so a stopped grid keeps what it measured; running it
again measures only the configs missing from the file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from autotune.device import detect_device
from autotune.errors import ConfigError
from autotune.knobs import TrialConfig
from autotune.runner import run_trial
from autotune.space import SearchSpace
from autotune.workload import Workload

__all__ = ["measure_grid", "read_grid"]


def measure_grid(workload: Workload, space: SearchSpace, out: Path, *, memory_budget_bytes: int | None,
                 trial_timeout_s: float, warmup_steps: int, measure_steps: int,
                 on_trial: Callable[[int, int, dict[str, Any]], None] | None = None) -> int:
    """Measure the configs of ``space`` not yet in ``out``; return how many were measured now."""
    configs = space.candidates(workload, detect_device(workload.device))
    done = {_key(TrialConfig.from_dict(line["config"])) for line in read_grid(out, workload)} if out.exists() else set()
    todo = [c for c in configs if _key(c) not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        for index, config in enumerate(todo, start=1):
            started = time.monotonic()
            result = run_trial(workload, config, memory_budget_bytes=memory_budget_bytes, timeout_s=trial_timeout_s,
                               warmup_steps=warmup_steps, measure_steps=measure_steps)
            line = {**result.to_dict(), "trial_seconds": time.monotonic() - started, "workload": workload.to_dict()}
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            if on_trial is not None:
                on_trial(index, len(todo), line)
    return len(todo)


def read_grid(path: Path, workload: Workload | None = None) -> Iterator[dict[str, Any]]:
    """The grid's lines; with ``workload``, refuse a file measured for another one."""
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            raise ConfigError(f"{path}:{number} is not a JSON line of a grid") from None
        if workload is not None and line.get("workload") != workload.to_dict():
            raise ConfigError(f"{path} was measured for another workload ({line.get('workload')}); "
                              "use a new -o file or the same workload flags")
        yield line


def _key(config: TrialConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)
