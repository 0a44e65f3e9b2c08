"""The levers' axes in a search space (``Lever.axes``, ``runnable``, ``dropped``, ``param_of``, ``config_fields``):
what a space file may give each, which values survive for a workload on a device, and why the others are dropped.
``autotune.search.space`` only loops over them (``tests/search/test_space.py`` checks the spaces as a whole)."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.config.device import DeviceInfo
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import AXIS_ORDER, LEVERS
from autotune.search.presets import load_space
from autotune.search.space import KNOBS, LATER_KNOBS, SearchSpace

CPU = DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False)
OLD_CPU = DeviceInfo("cpu", "old-cpu", 1, 16 * 2**30, bf16=False, fp16_deepspeed=False)
GPU = DeviceInfo("cuda", "test-gpu", 2, 80 * 2**30, bf16=True, fp16_deepspeed=True)
V100 = DeviceInfo("cuda", "V100", 2, 32 * 2**30, bf16=False, fp16_deepspeed=True)


def _space(tmp_path, text: str) -> SearchSpace:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return load_space(str(path))


# -- the registry ---------------------------------------------------------------------------------------------------
def test_each_axis_is_a_space_field_and_a_knob_of_its_lever_at_the_configs_default():
    spaces = {f.name: f.default for f in dataclasses.fields(SearchSpace)}
    config = TrialConfig()
    for lever in LEVERS:
        for axis in lever.axes:
            assert axis.key in lever.fields, f"{lever}: axis {axis.key} is none of its fields"
            assert spaces.get(axis.key) == (axis.default,), f"SearchSpace.{axis.key} must default to its axis's"
            assert getattr(config, axis.key) == axis.default, f"{axis.key}: the space's default is the config's"
            assert axis.key in KNOBS
            assert not axis.moved_only or axis.added_later, f"{axis.key}: a moved-only axis came later"
    assert [a.key for lever in AXIS_ORDER for a in lever.axes if a.moved_only] == list(LATER_KNOBS[:-1])


@pytest.mark.parametrize(
    "config",
    [
        TrialConfig(),
        TrialConfig(precision="bf16", checkpointing=True, checkpoint_every=3, loss="chunked:4", attention="sdpa"),
        TrialConfig(optimizer="adafactor", optimizer_in_backward=True, activation_offload=True, compile=True),
        TrialConfig(fused_optimizer=True, checkpointing=True),
        TrialConfig(precision="bf16", checkpointing=True, checkpoint_selective=True),
        TrialConfig(lora_rank=8, lora_targets=("q_proj", "v_proj")),
    ],
)
def test_each_levers_params_make_its_fields_again(config):
    for lever in (lever for lever in LEVERS if lever.axes):  # LoRA's parameter is still the space's (below)
        params = {axis.key: lever.param_of(axis.key, config) for axis in lever.axes}
        assert lever.config_fields(params) == {name: getattr(config, name) for name in lever.fields}
    assert SearchSpace.config_of(load_space("quick"), SearchSpace.params_of(config)) == config


def test_a_stored_config_without_the_axes_added_later_gets_their_defaults():
    params = SearchSpace.params_of(TrialConfig())
    old = {k: v for k, v in params.items() if k in ("micro_batch", "precision", "checkpointing", "zero", "lora")}
    assert load_space("quick").config_of(old) == TrialConfig()


# -- precision ------------------------------------------------------------------------------------------------------
def test_the_precision_axis_drops_what_the_device_cannot_train_in(tmp_path):
    space = _space(tmp_path, "knobs:\n  precision: [fp32, tf32, bf16, bf16-true, fp16]\n  micro_batch: [4]\n")
    workload = Workload(global_batch=4)
    assert space.choices(workload, GPU)["precision"] == ("fp32", "tf32", "bf16", "bf16-true", "fp16")
    assert space.choices(workload, V100)["precision"] == ("fp32", "tf32", "fp16")  # no bfloat16
    assert space.choices(workload, OLD_CPU)["precision"] == ("fp32", "fp16")  # nor tf32 off CUDA
    assert space.choices(workload, CPU)["precision"] == ("fp32", "bf16", "bf16-true", "fp16")
    assert space.dropped_knobs(workload, V100) == []  # the precisions a device lacks go unsaid
    only_bf16 = _space(tmp_path, "knobs:\n  precision: [bf16]\n")
    with pytest.raises(ConfigError, match=r"space.yaml: knobs.precision \['bf16'\]: none of them trains on V100 "):
        only_bf16.choices(workload, V100)


def test_precisions_the_device_lacks_are_dropped():
    precisions = {c.precision for c in load_space("default").candidates(Workload(), CPU)}
    assert "tf32" not in precisions and "fp32" in precisions
    # DeepSpeed's CPU accelerator has no fp16 here: no fp16 + ZeRO pair survives.
    assert not any(
        c.precision == "fp16" and c.uses_deepspeed for c in load_space("default").candidates(Workload(), CPU)
    )


# -- checkpointing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["every-1", "sometimes", "every-two", "null"])
def test_a_bad_checkpointing_value_in_a_space_file_is_one_line(tmp_path, value):
    with pytest.raises(ConfigError) as info:
        _space(tmp_path, f"knobs:\n  checkpointing: [false, {value}]\n")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'space.yaml'}: knobs.checkpointing: ")
    assert message.endswith(
        "is not allowed; allowed: a list of true/false, every-N (every N-th decoder layer, N >= 2) or selective"
    )


def test_the_checkpointing_axis_reads_every_n_and_gives_both_fields(tmp_path):
    space = _space(tmp_path, "knobs:\n  checkpointing: [false, true, every-02, every-2]\n  micro_batch: [4]\n")
    assert space.checkpointing == (False, True, "every-2")
    configs = space.candidates(Workload(global_batch=4), CPU)
    assert [(c.checkpointing, c.checkpoint_every) for c in configs] == [(False, 1), (True, 1), (True, 2)]
    assert [space.params_of(c)["checkpointing"] for c in configs] == [False, True, "every-2"]


@pytest.mark.slow
def test_checkpointing_is_dropped_for_a_factory_model_without_it():
    space = load_space("quick")
    plain = Workload(model="factories:tiny", global_batch=4, seq_len=8)  # TinyLM: no checkpointing method
    assert {c.checkpointing for c in space.candidates(plain, CPU)} == {False}
    assert space.choices(plain, CPU)["checkpointing"] == (False,)
    assert space.dropped_knobs(plain, CPU) == [
        "checkpointing on: the model from --model factories:tiny has no activation_checkpointing_enable() "
        "or gradient_checkpointing_enable()"
    ]
    able = plain.replace(model="factories:checkpointable")
    assert {c.checkpointing for c in space.candidates(able, CPU)} == {False, True}
    assert space.dropped_knobs(able, CPU) == []
    assert {c.checkpointing for c in space.candidates(Workload(), CPU)} == {False, True}  # a Hugging Face model


def test_a_space_of_checkpointing_only_is_refused_for_a_model_without_it(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  checkpointing: [true]\n")
    with pytest.raises(
        ConfigError,
        match=r"knobs.checkpointing \[true\]: the model from --model factories:tiny has "
        r"no activation_checkpointing_enable\(\) or gradient_checkpointing_enable\(\); add false",
    ):
        load_space(str(path)).candidates(Workload(model="factories:tiny", global_batch=4, seq_len=8), CPU)


# -- on/off axes refused on a device: compile, activation offload ---------------------------------------------------
def test_compile_is_left_out_on_a_cpu_device_and_said_once(tmp_path):
    space = _space(tmp_path, "knobs:\n  micro_batch: [4]\n  compile: [false, true]\n")
    workload = Workload(global_batch=4)
    assert space.choices(workload, CPU)["compile"] == (False,)  # a parameter since it was added, at off here
    assert space.choices(workload, GPU)["compile"] == (False, True)
    assert [
        line.startswith("--compile on is measured on CUDA GPUs only") for line in space.dropped_knobs(workload, CPU)
    ] == [True]
    assert space.dropped_knobs(workload, GPU) == []
    with pytest.raises(ConfigError, match=r"space.yaml: knobs.compile \[true\]: --compile on .*; add false$"):
        _space(tmp_path, "knobs:\n  compile: true\n").choices(workload, CPU)


def test_activation_offload_is_left_out_on_a_cpu_device_and_offered_on_cuda(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  micro_batch: [4]\n  activation_offload: [false, true]\n")
    space = load_space(str(path))
    workload = Workload(global_batch=16)
    # On the CPU the knob is no tuner parameter at all (the sampler can never propose it), as in a space without it.
    assert "activation_offload" not in space.choices(workload, CPU)
    assert [c.activation_offload for c in space.candidates(workload, CPU)] == [False]
    dropped = space.dropped_knobs(workload, CPU)
    assert any("--activation-offload on" in line and "cpu device" in line for line in dropped)
    assert space.choices(workload, GPU)["activation_offload"] == (False, True)
    on_gpu = space.candidates(workload, GPU)
    assert {c.activation_offload for c in on_gpu} == {False, True}
    assert all(space.config_of(space.params_of(c)) == c for c in on_gpu)
    assert not any("activation-offload" in line for line in space.dropped_knobs(workload, GPU))
    path.write_text("knobs:\n  activation_offload: [true]\n")
    with pytest.raises(ConfigError, match=r"knobs.activation_offload \[true\]: .*on a cpu device.*; add false"):
        load_space(str(path)).candidates(workload, CPU)
    # A space that never lists it searches what it searched before the knob existed (old studies resume).
    assert "activation_offload" not in load_space("default").choices(workload, GPU)
    path.write_text("knobs:\n  micro_batch: [4]\n")
    before = load_space(str(path)).digest
    path.write_text("knobs:\n  micro_batch: [4]\n  activation_offload: [false]\n")
    assert load_space(str(path)).digest == before


# -- the optimizer: parameters only where a space moves them ---------------------------------------------------------
def test_the_optimizer_is_a_parameter_only_where_the_space_moves_it(tmp_path, monkeypatch):
    workload = Workload(global_batch=4)
    plain = _space(tmp_path, "knobs:\n  micro_batch: [4]\n  optimizer: adamw\n")
    assert "optimizer" not in plain.choices(workload, CPU) and "optimizer_in_backward" not in plain.choices(
        workload, CPU
    )
    moved = _space(
        tmp_path,
        "knobs:\n  micro_batch: [4]\n  optimizer: [adamw, adafactor]\n  optimizer_in_backward: [false, true]\n",
    )
    choices = moved.choices(workload, CPU)
    assert choices["optimizer"] == ("adamw", "adafactor") and choices["optimizer_in_backward"] == (False, True)
    assert list(choices)[-2:] == ["optimizer", "optimizer_in_backward"]  # after ZeRO's and LoRA's, as they came
    import autotune.levers.optimizer as optimizer

    monkeypatch.setattr(optimizer, "eight_bit_library", lambda: None)
    eight_bit = _space(tmp_path, "knobs:\n  optimizer: [adamw-8bit, adafactor]\n")
    assert eight_bit.choices(workload, CPU)["optimizer"] == ("adafactor",)
    assert eight_bit.dropped_knobs(workload, CPU) == [optimizer.EIGHT_BIT_REFUSAL]
    with pytest.raises(ConfigError, match=r"knobs.optimizer \[adamw-8bit\]: --optimizer adamw-8bit needs torchao"):
        _space(tmp_path, "knobs:\n  optimizer: adamw-8bit\n").choices(workload, CPU)
