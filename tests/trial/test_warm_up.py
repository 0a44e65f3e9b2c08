"""A warm-up step is one micro batch and the optimizer step: the same kernels, buffers and optimizer state as a
whole step, in a fraction of its time."""

from __future__ import annotations

import pytest
import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.trial.engine import build_engine

WORKLOAD = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=8)


def _engine_counting_forwards() -> tuple[object, list[int]]:
    engine = build_engine(
        workload=WORKLOAD,
        config=TrialConfig(micro_batch=2),  # 4 micro batches a step
        task="causal-lm",
        device=torch.device("cpu"),
        world_size=1,
    )
    forwards: list[int] = []
    engine.model.register_forward_hook(lambda *_: forwards.append(1))
    return engine, forwards


@pytest.mark.slow
def test_a_warm_up_runs_one_micro_batch_and_makes_the_optimizer_state():
    engine, forwards = _engine_counting_forwards()
    assert engine.accum == 4 and engine.optimizer_state_bytes() == 0
    loss = engine.warm_up()
    assert len(forwards) == 1 and loss > 0
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    assert all("exp_avg" in engine.optimizer.state[p] for p in trainable)  # Adam's state, made by its first step
    assert all(p.grad is None for p in trainable)  # zeroed as a step's end zeroes them
    state = engine.optimizer_state_bytes()
    engine.step()
    assert len(forwards) == 1 + 4  # a timed step runs every micro batch
    assert engine.optimizer_state_bytes() == state  # nothing left for the timed step to allocate
