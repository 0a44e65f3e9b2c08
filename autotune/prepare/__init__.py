"""What a config does to a model: LoRA adapters, activation checkpointing, the chunked loss (and,
next, attention and compile), applied the same way in trials and in users' jobs, and the facts about a
model that say which of them it can take, found before any trial.

May import ``config`` and ``models``; trials and the estimator use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload


def refusal_before_trial(workload: Workload, config: TrialConfig, task: str | None = None) -> str | None:
    """Why this config cannot be prepared for this workload's model, said before any trial; or None.
    ``task``: the workload's, resolved here only when a knob needs it."""
    if config.loss_chunks is not None:
        from autotune.models.sources import resolve_task
        from autotune.prepare.loss import chunked_loss_refusal

        refusal = chunked_loss_refusal(workload, task or resolve_task(workload))
        if refusal is not None:
            return refusal
    if config.checkpoint_every > 1:
        from autotune.prepare.checkpointing import every_n_refusal

        return every_n_refusal(workload)
    return None
