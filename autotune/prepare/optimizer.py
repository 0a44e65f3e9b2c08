"""The public path of the optimizer's helpers that exports name in users' loops
(``autotune.prepare.optimizer.build_optimizer``, ``parameter_groups``); they live in
:mod:`autotune.levers.optimizer`."""

from __future__ import annotations

from autotune.levers.optimizer import StepInBackward, build_optimizer, parameter_groups

__all__ = ["build_optimizer", "parameter_groups", "StepInBackward"]
