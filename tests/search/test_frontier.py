"""Families' frontiers: the estimates the next families need first are asked together, as many as the machine
traces at once, and none past the config where the walk stops."""

from __future__ import annotations

from autotune.config.knobs import TrialConfig
from autotune.estimate.results import MemoryEstimate
from autotune.search import frontier as frontier_module
from autotune.search.frontier import Frontiers

MIB = 2**20
PER_SAMPLE = {False: 10 * MIB, True: 4 * MIB}  # checkpointing's family keeps less per sample


def _estimate(config: TrialConfig) -> MemoryEstimate:
    states = 40 * MIB
    activations = PER_SAMPLE[config.checkpointing] * config.micro_batch
    return MemoryEstimate(
        config=config,
        predicted_peak_bytes=states + activations,
        parameters_bytes=states // 4,
        gradients_bytes=states // 4,
        optimizer_state_bytes=states // 2,
        activations_bytes=activations,
        temporaries_bytes=0,
        overhead_bytes=None,
        method="toy",
        seconds=0.0,
    )


def _frontiers(asked: list[list[TrialConfig]]) -> Frontiers:
    frontiers = Frontiers(
        [1, 2, 4, 8, 16],
        estimator=_estimate,
        prefetcher=lambda configs: asked.append(list(configs)),
        limit=100 * MIB,
        margin=0.0,
        out_of_time=lambda: False,
    )
    return frontiers


def test_the_next_families_first_estimates_are_asked_together(monkeypatch):
    monkeypatch.setattr(frontier_module, "TRACED_AT_ONCE", 2)
    asked: list[list[TrialConfig]] = []
    frontiers = _frontiers(asked)
    plain, ckpt, fused = (
        TrialConfig(micro_batch=16),
        TrialConfig(micro_batch=16, checkpointing=True),
        TrialConfig(micro_batch=16, fused_optimizer=True),
    )
    frontiers.prefetch([plain, ckpt, fused], [], [], 100 * MIB)
    # Nothing known: each family's first estimate is the middle of its sizes (mb=4); two at once.
    assert asked == [[plain.replace(micro_batch=4), ckpt.replace(micro_batch=4)]]


def test_a_walk_stops_at_the_config_its_frontier_holds(monkeypatch):
    monkeypatch.setattr(frontier_module, "TRACED_AT_ONCE", 2)
    asked: list[list[TrialConfig]] = []
    frontiers = _frontiers(asked)
    ckpt = TrialConfig(micro_batch=8, checkpointing=True)
    assert frontiers.frontier(ckpt, [], [], 100 * MIB) == 8  # 40 + 4 x 8 = 72 MiB; 40 + 4 x 16 = 104 MiB
    frontiers.prefetch(
        [ckpt, TrialConfig(micro_batch=16), TrialConfig(micro_batch=16, fused_optimizer=True)], [], [], 100 * MIB
    )
    assert asked == []  # the walk stops at mb=8 ckpt: it fits, and the proposer takes it


def test_a_frontier_made_from_prefetched_estimates_is_the_one_made_one_at_a_time(monkeypatch):
    monkeypatch.setattr(frontier_module, "TRACED_AT_ONCE", 2)
    asked: list[list[TrialConfig]] = []
    together = _frontiers(asked)
    together.prefetcher = lambda configs: [together.estimate(c) for c in configs]  # as an Oracle's cache would
    alone = _frontiers([])
    alone.prefetcher = None
    walk = [TrialConfig(micro_batch=16), TrialConfig(micro_batch=16, checkpointing=True)]
    together.prefetch(walk, [], [], 100 * MIB)
    assert [together.frontier(c, [], [], 100 * MIB) for c in walk] == [
        alone.frontier(c, [], [], 100 * MIB) for c in walk
    ]
    assert [together.frontier(c, [], [], 100 * MIB) for c in walk] == [4, 8]  # 40 + 10 x 4 = 80 MiB; x8 = 120
