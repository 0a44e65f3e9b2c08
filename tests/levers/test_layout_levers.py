"""The layout's levers (ZeRO, FSDP, offload, tensor and pipeline parallel) answer what only a layout asks: the
model's splits and their words, the rules a split model has with the other levers, and a space's two composite
parameters (``zero``: the sharding with its offload; ``layout``: the splits)."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.errors import ConfigError
from autotune.levers import FSDP, LEVERS, PIPELINE, TENSOR_PARALLEL, ZERO
from autotune.search.space import layout_knobs, parse_space


def test_the_model_parallel_ranks_are_the_product_of_the_splits_and_say_their_flags():
    config = TrialConfig(tp=2, pp=3)
    assert config.model_parallel == 6
    assert [lever.model_ranks(config) for lever in (TENSOR_PARALLEL, PIPELINE)] == [2, 3]
    assert all(lever.model_ranks(config) == 1 for lever in LEVERS if lever not in (TENSOR_PARALLEL, PIPELINE))
    assert config.split_flags() == "--tp 2 --pp 3"
    assert config.split_flags(" x ") == "--tp 2 x --pp 3"
    assert config.layout == "tp2 pp3:1f1b"
    assert TrialConfig().model_parallel == 1 and TrialConfig().layout == "dp" and TrialConfig().split_flags() == ""


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"precision": "fp16"}, "--pp 2: --precision fp16's loss scaling would span the stages"),
        ({"loss": "chunked"}, "--pp 2: --loss chunked replaces the head the last stage runs"),
        ({"attention": "eager"}, "--pp 2: --attention eager needs the causal mask the stages do not build"),
        ({"compile": True}, "--pp 2: --compile on is not measured on pipeline stages yet"),
    ],
)
def test_pipeline_stages_refuse_a_lever_in_that_levers_own_words(knobs, words):
    TrialConfig(**knobs)  # alone it is a config
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrialConfig(pp=2, **knobs)


def test_every_layout_a_space_offers_reads_back_as_its_config():
    space = parse_space({"knobs": {"layout": "auto"}}, "auto")
    from autotune.config.workload import Workload

    labels = space._layouts(Workload(nproc=4))
    words = {"dp", "tp2", "tp2+sp", "tp4", "tp4+sp"} | {
        f"pp{n}:{schedule}" for n in (2, 4) for schedule in ("gpipe", "1f1b", "interleaved-1f1b")
    }
    assert set(labels) == words and len(labels) == len(words)
    for label in labels:
        config = TrialConfig(**layout_knobs(label))
        assert config.layout == label
    both = TrialConfig(**layout_knobs("tp2 pp2:gpipe"))
    assert (both.model_parallel, both.layout) == (4, "tp2 pp2:gpipe")
    for bad in ("tp1", "pp2:later", "tp2 tp2", "dp tp2", "zero2"):
        with pytest.raises(ConfigError, match="knobs.layout"):
            parse_space({"knobs": {"layout": [bad]}}, "bad")


@pytest.mark.parametrize(("nproc", "device_type"), [(1, "cpu"), (2, "cpu"), (1, "cuda"), (2, "cuda")])
def test_each_sharding_value_makes_its_config_and_the_config_gives_it_back(nproc, device_type):
    stages, modes = (None, 0, 1, 2, 3), (None, "full", "grad-op", "hybrid")
    offloads = ("none", "optimizer", "optimizer+params")
    values = ZERO.sharding_values(stages, offloads, nproc, device_type)
    values += FSDP.sharding_values(modes, offloads, nproc, device_type)
    assert "off" in values and len(values) == len(set(values))
    if device_type == "cpu":  # offloading from the CPU to the CPU changes nothing
        assert not any("+" in value for value in values)
    if nproc == 1:  # sharding over one rank saves nothing: only offload makes a sharding worth a trial
        assert all(value == "off" or "+" in value for value in values)
    for value in values:
        fields = FSDP.sharding_fields(value) or ZERO.sharding_fields(value)
        config = TrialConfig(**fields)
        assert (FSDP.sharding_param(config) or ZERO.sharding_param(config)) == value


def test_the_sharding_pairs_that_mean_nothing_are_not_offered():
    offered = ZERO.sharding_values((0, 1, 2, 3), ("none", "optimizer", "optimizer+params"), 2, "cuda")
    # ZeRO-0 partitions nothing to offload; only stage 3 partitions the parameters
    assert offered == ("0", "1", "1+optimizer", "2", "2+optimizer", "3", "3+optimizer", "3+optimizer+params")
    assert FSDP.sharding_values(("full",), ("optimizer",), 2, "cuda") == ()  # FSDP2 offloads all or nothing
