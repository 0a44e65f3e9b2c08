"""``autotune.current_config()``: the config a script trial asks the user's own loop to train with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["current_config", "write_config_file", "CONFIG_ENV"]

CONFIG_ENV = "AUTOTUNE_CONFIG"  # the path of a JSON file: config, workload, grad_accum_steps, frameworks


def write_config_file(path: Path, config: TrialConfig, workload: Workload, *, device_type: str) -> None:
    """The file ``AUTOTUNE_CONFIG`` names: the config for a plain loop to read, and what each framework
    is handed (:mod:`autotune.scripts.frameworks`): the hf export's TrainingArguments values, Lightning's
    and Accelerate's precision and accumulation."""
    from autotune.prepare.training_args import (
        accelerate_arguments,
        accelerate_deepspeed_plugin,
        lightning_arguments,
        lightning_strategy,
        trainer_arguments,
    )

    accelerate = accelerate_arguments(config, workload)
    if config.uses_deepspeed:  # the hook builds the DeepSpeedPlugin of these arguments
        accelerate["deepspeed_plugin"] = accelerate_deepspeed_plugin(config, workload, device_type=device_type)
        if device_type == "cpu":  # Accelerate drops DeepSpeed for cpu=True; without a GPU, False is the CPU too
            accelerate["cpu"] = False
    lightning = lightning_arguments(config, workload)
    if config.uses_deepspeed and device_type == "cuda":  # Lightning runs DeepSpeed on CUDA only
        lightning["strategy"] = lightning_strategy(config, workload)  # the lightning export's, for this model
    path.write_text(
        json.dumps(
            {
                "config": config.to_dict(),
                "workload": workload.to_dict(),
                "grad_accum_steps": config.grad_accum_steps(workload),
                "frameworks": {
                    "transformers": trainer_arguments(config, workload, device_type=device_type),
                    "lightning": lightning,
                    "accelerate": accelerate,
                },
            }
        )
    )


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
