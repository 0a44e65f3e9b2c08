"""``autotune trial``: one config measured in a fresh process, autotune's own step or the user's command."""

from __future__ import annotations

import json
from typing import Optional

from autotune.cli.options import Script, command
from autotune.cli.parse import size
from autotune.cli.servers import start_trial_server
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError


@command
def trial(
    workload: Workload,
    config: TrialConfig,
    memory_budget: Optional[str],
    trial_timeout: float,
    warmup_steps: int,
    steps: int,
    as_json: bool,
    script: Script = None,
) -> int:
    """Measure one training configuration in a fresh process: autotune's own step on the model, or your command.

    Exit status: 0 when the trial trained (ok), 1 when it ended otherwise (oom, timeout, crashed, nan, error),
    2 when the input was refused before running.
    """
    if trial_timeout <= 0:
        raise ConfigError(f"--trial-timeout {trial_timeout:g} must be more than 0 seconds")
    if warmup_steps < 0 or steps < 1:
        raise ConfigError("--warmup-steps must be 0 or more and --steps at least 1")
    budget = size(memory_budget)
    if script:
        from autotune.scripts.runner import run_script_trial

        result = run_script_trial(
            list(script),
            workload,
            config,
            memory_budget_bytes=budget,
            timeout_s=trial_timeout,
            warmup_steps=warmup_steps,
            measure_steps=steps,
        )
    else:
        from autotune.trial.runner import run_trial

        start_trial_server()  # its imports overlap the model and device checks run_trial starts with
        result = run_trial(
            workload,
            config,
            memory_budget_bytes=budget,
            timeout_s=trial_timeout,
            warmup_steps=warmup_steps,
            measure_steps=steps,
        )
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        from autotune.output.render import print_trial

        print_trial(workload, result, command=list(script) if script else None)
    return 0 if result.ok else 1
