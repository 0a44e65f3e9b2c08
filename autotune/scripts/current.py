"""``autotune.current_config()``: the config a script trial asks the user's own loop to train with."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["current_config", "CONFIG_ENV"]

CONFIG_ENV = "AUTOTUNE_CONFIG"  # the path of a JSON file: config, workload, grad_accum_steps


def current_config() -> TrialConfig | None:
    """The TrialConfig of the script trial this process belongs to; None outside one.

    A plain training loop reads its micro batch (``config.micro_batch``), accumulation
    (``config.grad_accum_steps(workload)``, or ``grad_accum_steps`` in the JSON file) and precision
    here, and applies the rest with ``autotune.prepare(model, config)``.
    """
    from autotune.config.knobs import TrialConfig

    path = os.environ.get(CONFIG_ENV)
    if not path:
        return None
    with open(path) as file:
        return TrialConfig.from_dict(json.load(file)["config"])
