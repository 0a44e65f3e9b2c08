"""A deep model's estimate from its 2- and 4-layer copies: what find --plan traces for a model of many layers."""

from __future__ import annotations

import pytest

from autotune.config.gpus import gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.estimate.depth_proxy import depth_proxy
from autotune.estimate.step_time import card_profile, predict_step_time

# TinyLlama's shape (22 layers, 2048 wide) on a card: full traces take seconds, proxies less.
WORKLOAD = Workload(model="builtin:tinyllama-1.1b", seq_len=512, global_batch=8, gpu="A100-80GB")


@pytest.mark.parametrize(
    "config",
    [
        TrialConfig(micro_batch=2, precision="bf16", checkpointing=True),
        TrialConfig(micro_batch=1, precision="bf16", lora_rank=8),
    ],
    ids=["bf16 ckpt", "bf16 lora"],
)
@pytest.mark.slow
def test_the_straight_line_through_two_shallow_copies_stands_for_the_whole_model(config):
    proxy = depth_proxy(WORKLOAD)
    assert proxy is not None and proxy.layers == 22
    drawn = _drawn_like_whole(WORKLOAD, config, proxy)
    assert "extrapolated to 22 layers" in drawn.method


def _drawn_like_whole(workload, config, proxy):
    """The proxies' estimate, checked against the whole model's trace: memory and step time."""
    whole, drawn = predict_memory(workload, config), predict_memory(workload, config, proxy=proxy)
    assert drawn.parameters_bytes == pytest.approx(whole.parameters_bytes, rel=1e-3)
    assert drawn.predicted_peak_bytes == pytest.approx(whole.predicted_peak_bytes, rel=0.02)
    assert drawn.predicted_reserved_bytes == pytest.approx(whole.predicted_reserved_bytes, rel=0.1)
    profile = card_profile(gpu_spec(workload.gpu))
    assert predict_step_time(drawn, workload, profile).step_s == pytest.approx(
        predict_step_time(whole, workload, profile).step_s, rel=0.01
    )
    return drawn


@pytest.mark.slow
def test_zero3_is_drawn_at_the_real_depth_where_its_cap_on_gathered_weights_applies():
    # Llama-2-7B's 4-layer copy holds 1.07e9 parameters, past ZeRO-3's 1e9 live cap already: a line
    # through two ZeRO-3 estimates would hold the whole 6.7e9 gathered. The line runs through the
    # plain traces instead, and ZeRO's arithmetic caps the real depth's count.
    workload = Workload(model="builtin:llama2-7b", seq_len=512, global_batch=16, nproc=8, gpu="H100-80GB")
    proxy = depth_proxy(workload)
    assert proxy is not None and proxy.layers == 32
    drawn = _drawn_like_whole(
        workload, TrialConfig(micro_batch=2, precision="bf16", checkpointing=True, zero_stage=3), proxy
    )
    # The whole model's 6.7e9 would be 12.5 GiB of gathered bf16 weights; capped, 1e9 of them: 1.9 GiB.
    assert drawn.temporaries_bytes < 6 * 2**30


def test_configs_that_differ_in_zero_stage_or_offload_share_one_trace():
    workload = Workload(model="builtin:llama-tiny", seq_len=64, global_batch=8, nproc=2, gpu="A100-80GB")
    first = predict_memory(workload, TrialConfig(micro_batch=2, zero_stage=1))
    second = predict_memory(workload, TrialConfig(micro_batch=2, zero_stage=3, offload="optimizer"))
    assert second.step_costs == first.step_costs
    assert second.seconds < first.seconds / 10  # arithmetic on the kept trace, not a trace
    assert second.optimizer_state_bytes == 0 < first.optimizer_state_bytes  # offloaded to the host
    assert second.parameters_bytes == first.parameters_bytes // 2  # ZeRO-3 shards the weights


def test_no_proxy_where_it_would_not_stand_for_the_model():
    assert depth_proxy(Workload(model="builtin:gpt2-deep-tiny")) is None  # 6 layers: a trace is cheap
    assert depth_proxy(Workload(model="factories:tiny")) is None  # no config to shorten
