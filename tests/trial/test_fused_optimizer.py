"""--fused-optimizer: the trial's AdamW is the fused one, with the same state and peak."""

from __future__ import annotations

import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.search.presets import load_space
from autotune.trial.engine import build_engine
from autotune.trial.runner import run_trial

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4)


def test_the_engine_builds_the_adamw_the_config_names():
    for fused, expected in ((False, None), (True, True)):
        engine = build_engine(
            workload=WORKLOAD,
            config=TrialConfig(micro_batch=4, fused_optimizer=fused),
            task="causal-lm",
            device=torch.device("cpu"),
            world_size=1,
        )
        assert engine.optimizer.defaults["fused"] is expected


def test_a_fused_trial_trains_with_the_same_peak():
    plain, fused = (
        run_trial(WORKLOAD, TrialConfig(micro_batch=4, fused_optimizer=f), measure_steps=1) for f in (False, True)
    )
    assert plain.ok and fused.ok, (plain.error, fused.error)
    assert fused.peak_memory_bytes == plain.peak_memory_bytes  # the same Adam states, in place
    assert fused.optimizer_state_bytes == plain.optimizer_state_bytes


def test_the_full_space_searches_it_without_zero():
    from autotune.config.device import detect_device

    two_ranks = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, nproc=2)
    candidates = load_space("full").candidates(two_ranks, detect_device("cpu"))
    assert any(c.fused_optimizer for c in candidates)
    assert not any(c.fused_optimizer and c.uses_deepspeed for c in candidates)
    assert any(c.uses_deepspeed for c in candidates)
