"""The search's step prior (``autotune.search.step_prior``): which traced steps a family not traced yet may be
derived from."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.search.step_prior import StepPrior


def test_a_selective_family_is_never_derived_from_a_step_traced_without_checkpointing() -> None:
    selective = TrialConfig(micro_batch=4, checkpointing=True, checkpoint_selective=True)
    # A plain step traced: were it derived from, its costs (not a real estimate) would fail to be read.
    traced: dict[TrialConfig, Any] = {TrialConfig(): SimpleNamespace(step_costs=object())}
    prior = StepPrior(Workload(), traced, None)
    assert prior._twin(selective) is None  # its recompute is no share of the forward: its own trace says it
