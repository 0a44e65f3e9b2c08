"""``--float8``: torchao's float8 training of the Linear layers, real on a CPU (its ``_scaled_mm`` takes float8),
refused in one line where a card has no float8 tensor cores, traced by the estimator as the trial runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autotune.config.device import DeviceInfo
from autotune.config.gpus import device_info, gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import FLOAT8
from autotune.levers.float8 import convert_to_float8

pytest.importorskip("torchao.float8")

FLOAT8_CONFIG = TrialConfig(micro_batch=4, precision="bf16", float8=True)
CPU = DeviceInfo("cpu", "test-cpu", 1, 16 * 2**30, bf16=True, fp16_deepspeed=False)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    return LlamaForCausalLM(config)


def test_every_linear_layer_but_the_head_trains_in_float8() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = convert_to_float8(_llama())
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    linear = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert converted == linear - {"lm_head"} and len(converted) == 14  # 7 projections a layer
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_model_with_nothing_to_convert_is_refused_in_one_line() -> None:
    odd = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    with pytest.raises(ConfigError, match=r"^--float8 on: the model has no Linear layer .* multiple of 16") as no:
        convert_to_float8(odd)
    assert "\n" not in str(no.value)


@pytest.mark.parametrize(
    ("card", "refused"), [("V100-32GB", True), ("A100-80GB", True), ("H100-80GB", False), ("L40S", False)]
)
def test_a_card_without_float8_tensor_cores_is_refused_in_one_line(card: str, refused: bool) -> None:
    refusal = FLOAT8.refusal(FLOAT8_CONFIG, Workload(), device_info(gpu_spec(card)))
    if refused:
        assert refusal is not None and "compute capability 8.9 or newer" in refusal and "--float8 off" in refusal
        assert card in refusal and "\n" not in refusal
    else:
        assert refusal is None
    assert FLOAT8.refusal(FLOAT8_CONFIG, Workload(), CPU) is None  # a CPU's _scaled_mm takes float8


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (TrialConfig(float8=True, lora_rank=8), "with --lora-rank use --float8 off"),
        (TrialConfig(float8=True, zero_stage=2), "use --float8 off with ZeRO"),
    ],
)
def test_what_it_has_not_been_measured_with_is_refused(config: TrialConfig, words: str) -> None:
    assert words in (FLOAT8.conflict(config) or "")


def test_its_label_flag_and_export_line() -> None:
    assert FLOAT8_CONFIG.describe() == "mb=4 bf16 float8"
    assert FLOAT8.flags[0].fields_of("on") == {"float8": True}
    (line,) = FLOAT8.in_code(FLOAT8_CONFIG)
    assert "autotune.prepare(model, float8=True)" in line and FLOAT8.in_code(TrialConfig()) == []


def test_a_card_with_float8_cores_times_float8_matmuls_at_their_peak() -> None:
    from autotune.estimate.step_time import card_profile

    h100 = card_profile(gpu_spec("H100-80GB"))
    assert h100.matmul_flops["float8_e4m3fn"] == pytest.approx(2 * h100.matmul_flops["bfloat16"], rel=0.01)
    assert h100.peak_flops == gpu_spec("H100-80GB").bf16_flops  # MFU is counted against the 16-bit peak
    assert "float8_e4m3fn" not in card_profile(gpu_spec("A100-80GB")).matmul_flops


def test_the_probes_float8_product_runs() -> None:
    from autotune.trial.device_probe import _float8_rate

    rate = _float8_rate(torch, torch.device("cpu"), 64, lambda: None)
    assert rate is not None and rate > 0


ESTIMATE = """
import json, sys
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
estimate = predict_memory(Workload(model="builtin:llama-tiny", seq_len=64, global_batch=4, device="cpu"),
                          TrialConfig.from_dict(json.loads(sys.argv[1])))
print(json.dumps(estimate.to_dict()))
"""


@pytest.mark.slow
def test_the_estimate_times_the_layers_matmuls_in_float8() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", ESTIMATE, json.dumps(FLOAT8_CONFIG.to_dict())],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    estimate = json.loads(ran.stdout.strip().splitlines()[-1])
    matmuls = {(op[2], op[3]) for op in estimate["step_costs"]["ops"] if op[1] == "matmul"}
    # The projections forward (e4m3) and their input gradients (an e5m2 gradient); the head stays bf16.
    assert {("mm", "float8_e4m3fn"), ("mm", "float8_e5m2"), ("mm", "bfloat16")} <= matmuls


@pytest.mark.gpu
def test_on_a_gpu_a_float8_trial_runs_where_the_card_has_float8_cores_and_the_estimate_holds(tmp_path) -> None:
    from autotune.estimate.client import predict_memory
    from autotune.trial.runner import run_trial

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    # A Llama of nn.Linear layers a few hundred MB in all (GPT-2's are Conv1D: nothing to train in float8).
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = Workload(model=str(tmp_path / "config.json"), seq_len=512, global_batch=4, device="cuda")
    if torch.cuda.get_device_capability(0) < (8, 9):
        with pytest.raises(ConfigError, match="compute capability 8.9 or newer"):
            run_trial(workload, FLOAT8_CONFIG, warmup_steps=1, measure_steps=2)
        return
    measured = run_trial(workload, FLOAT8_CONFIG, warmup_steps=1, measure_steps=2)
    assert measured.ok, measured.error
    predicted = predict_memory(workload, FLOAT8_CONFIG)
    assert abs(predicted.predicted_peak_bytes / measured.peak_allocated_bytes - 1) <= 0.10


def test_every_output_says_the_matmuls_train_in_float8() -> None:
    from autotune.study.summary import what_is_trained

    assert what_is_trained(FLOAT8_CONFIG)["note"] == (
        "all weights trained in bf16 mixed precision; the Linear layers' matmuls in float8 (tensorwise scales)"
    )
    assert "float8" not in what_is_trained(TrialConfig(micro_batch=4, precision="bf16"))["note"]


def test_a_wrapper_of_float8_data_computes_in_float8_and_one_of_integer_codes_in_the_type_it_says() -> None:
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from torchao.optim.subclass_8bit import OptimState8bit

    from autotune.estimate.step_costs import _computed_in

    weight = torch.randn(64, 64, dtype=torch.bfloat16)
    scale = torch.ones(())
    float8 = Float8TrainingTensor(weight.to(torch.float8_e4m3fn), scale, torch.bfloat16, None)
    assert float8.dtype == torch.bfloat16 and _computed_in(float8) == "float8_e4m3fn"
    codes = OptimState8bit.zeros((256,), signed=True)  # uint8 codes standing for fp32 values
    assert _computed_in(codes) == "float32"
    assert _computed_in(weight) == "bfloat16"
