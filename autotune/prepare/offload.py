"""The public path of activation offload's hooks that exports name in users' loops
(``autotune.prepare.offload.offload_activations``); they live in :mod:`autotune.levers.activation_offload`."""

from __future__ import annotations

from autotune.levers.activation_offload import ActivationOffload, offload_activations

__all__ = ["offload_activations", "ActivationOffload"]
