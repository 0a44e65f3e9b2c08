"""The servers trials and estimates run in, started before the checks that precede the first trial
(trial, find, tune): their imports (torch, Transformers) overlap those checks."""

from __future__ import annotations

__all__ = ["start_trial_server"]


def start_trial_server(*, estimate: bool = False) -> None:
    """Trials will run in this process: start their server now, its imports beside the checks before them;
    with ``estimate``, the estimate server's too (the tuner's device probe waits for both)."""
    from autotune.trial.runner import start_trial_server as start

    if estimate:
        from autotune.estimate.client import estimate_server_process

        start(sibling=estimate_server_process())  # forked from the trial server: one import for the two
    else:
        start()
