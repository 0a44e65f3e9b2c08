"""Rebuilding what a published measurement ran beyond autotune's knobs (``MeasuredWith``): bitsandbytes before
0.43.2, whose 4-bit layers kept their input for the backward, and Lightning's way of quantizing a base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.estimate.measured_with import MeasuredWith

bnb = pytest.importorskip("bitsandbytes")

WIDE_LLAMA = Path(__file__).resolve().parents[2] / "bench" / "data" / "llama-wide.json"
OLD_BNB = MeasuredWith(bnb_4bit_keeps_input=True)


def _layer_output(x: torch.Tensor) -> torch.Tensor:
    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes its weight
    return layer(x)


def test_old_bitsandbytes_keeps_the_input_of_a_4bit_layer_and_only_while_in_effect():
    x = torch.randn(3, 64, requires_grad=True)
    assert _layer_output(x).grad_fn.tensors[0] is None  # bitsandbytes here keeps only the weight
    with OLD_BNB.in_effect():
        kept = _layer_output(x)
    assert kept.grad_fn.tensors[0] is x
    kept.sum().backward()  # the backward still runs on it
    assert x.grad is not None
    assert _layer_output(x).grad_fn.tensors[0] is None  # put back


def test_the_estimate_with_old_bitsandbytes_adds_the_inputs_no_other_tensor_keeps():
    config = json.loads(WIDE_LLAMA.read_text())
    seq, layers = 256, config["num_hidden_layers"]
    workload = Workload(model=str(WIDE_LLAMA), seq_len=seq, global_batch=1, gpu="A100-80GB")
    qlora = TrialConfig(lora_rank=16, precision="bf16-true", quantize_base="nf4")
    now = predict_memory(workload, qlora)
    then = predict_memory(workload, qlora, measured_with=OLD_BNB)
    # Per layer, in bf16: the MLP's input (the norm's output, which gate and up read) and the down projection's.
    # The attention's projections add nothing: q and v's adapters keep their input already, and the output
    # projection reads a view of the attention's output, which its kernel keeps.
    kept = (2 * config["hidden_size"] + 2 * config["intermediate_size"]) * seq * layers
    assert then.activations_bytes - now.activations_bytes == kept, (then.to_dict(), now.to_dict())
    assert then.predicted_peak_bytes - now.predicted_peak_bytes == kept


def test_measured_with_goes_through_json_and_refuses_a_mode_lightning_does_not_have():
    both = MeasuredWith(pytorch1_step=True, bnb_4bit_keeps_input=True, lightning_bnb="nf4-dq")
    assert MeasuredWith.from_dict(json.loads(json.dumps(both.to_dict()))) == both
    assert MeasuredWith.from_dict(None) == MeasuredWith()
    with pytest.raises(ValueError, match="nf4"), MeasuredWith(lightning_bnb="fp8").in_effect():
        pass


def test_a_cuda_trace_multiplies_a_4bit_layer_in_the_type_its_weight_was_quantized_from():
    from autotune.estimate.patches import bnb_4bit_matmul_as_on_cuda

    def quantized_from_float16() -> torch.nn.Module:  # as Lightning's plugin quantizes
        layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        weight = torch.randn(32, 64, dtype=torch.float16)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4").to("cpu")
        return layer

    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    # bitsandbytes 0.49's CPU matmul_4bit retyped the weight's dequantized type to the input's (0.50 no
    # longer does); whichever is installed, the trace must multiply as CUDA's MatMul4Bit does.
    as_on_cuda = quantized_from_float16()
    with bnb_4bit_matmul_as_on_cuda():
        out = as_on_cuda(x)
    # CUDA's keeps it: MatMul4Bit dequantizes to float16 and casts that copy to bf16 (two copies of the weight).
    assert as_on_cuda.weight.quant_state.dtype == torch.float16
    assert out.dtype == torch.bfloat16
    out.sum().backward()
    assert x.grad is not None
