"""A deep model's estimate from its 2- and 4-layer copies: what find --plan traces for a model of many layers."""

from __future__ import annotations

import pytest

from autotune.config.gpus import gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.depth_proxy import depth_proxy
from autotune.estimate.estimator import predict_memory
from autotune.estimate.step_time import card_profile, predict_step_time

# TinyLlama's shape (22 layers, 2048 wide) on a card: full traces take seconds, proxies less.
WORKLOAD = Workload(model="builtin:tinyllama-1.1b", seq_len=512, global_batch=8, gpu="A100-80GB")


@pytest.mark.parametrize("config", [TrialConfig(micro_batch=2, precision="bf16", checkpointing=True),
                                    TrialConfig(micro_batch=1, precision="bf16", lora_rank=8)],
                         ids=["bf16 ckpt", "bf16 lora"])
def test_the_straight_line_through_two_shallow_copies_stands_for_the_whole_model(config):
    proxy = depth_proxy(WORKLOAD)
    assert proxy is not None and proxy.layers == 22
    whole = predict_memory(WORKLOAD, config)
    drawn = proxy.estimate(lambda workload, c, task: predict_memory(workload, c, task=task), config)
    assert drawn.parameters_bytes == pytest.approx(whole.parameters_bytes, rel=1e-3)
    assert drawn.predicted_peak_bytes == pytest.approx(whole.predicted_peak_bytes, rel=0.02)
    assert drawn.predicted_reserved_bytes == pytest.approx(whole.predicted_reserved_bytes, rel=0.1)
    profile = card_profile(gpu_spec("A100-80GB"))
    assert predict_step_time(drawn, WORKLOAD, profile).step_s == pytest.approx(
        predict_step_time(whole, WORKLOAD, profile).step_s, rel=0.01)
    assert "extrapolated to 22 layers" in drawn.method


def test_no_proxy_where_it_would_not_stand_for_the_model():
    assert depth_proxy(Workload(model="builtin:gpt2-deep-tiny")) is None        # 6 layers: a trace is cheap
    assert depth_proxy(Workload(model="factories:tiny")) is None                # no config to shorten
