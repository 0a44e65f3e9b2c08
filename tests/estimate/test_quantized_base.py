"""A 4-bit (NF4) base in a traced step: its layers dequantize their weight and multiply, and the step-time
model counts those multiplications as matmuls, as it does an unquantized base's."""

from __future__ import annotations

import pytest

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.estimate.step_costs import BACKWARD, FORWARD, MATMUL, StepCosts
from autotune.models.presets import PRESETS

pytest.importorskip("bitsandbytes")

ON_A100 = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, gpu="A100-80GB")
ON_CPU = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, device="cpu")
QLORA = TrialConfig(
    micro_batch=2, precision="bf16-true", lora_rank=8, lora_targets=("q_proj", "v_proj"), quantize_base="nf4"
)


def _matmul_flops(costs: StepCosts, phase: str) -> float:
    """A sample's matmul FLOPs in ``phase`` (per micro step)."""
    return sum(op.flops * op.count for op in costs.ops if op.phase == phase and op.kind == MATMUL)


def _linear_forward_flops(seq: int, rank: int) -> float:
    """2 x tokens x in x out for each Linear of a sample's forward: in each layer the base's seven
    projections (4-bit) and q's and v's adapters (in -> rank -> out), then the LM head (left in 16 bits)."""
    config = PRESETS["llama-tiny"].config
    hidden, intermediate, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    base = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    base += [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    adapters = [(hidden, rank), (rank, hidden), (hidden, rank), (rank, kv)]
    per_layer = sum(fan_in * fan_out for fan_in, fan_out in base + adapters)
    return 2 * seq * (config["num_hidden_layers"] * per_layer + hidden * vocab)


@pytest.mark.parametrize("workload", [ON_A100, ON_CPU], ids=["a100", "cpu"])
def test_a_4bit_base_forward_counts_each_layers_matmul(workload: Workload) -> None:
    # bitsandbytes 0.50's one gemm_4bit operator traced as its fake kernel: no FLOPs, not a matmul.
    costs = predict_memory(workload, QLORA).step_costs
    assert QLORA.lora_rank is not None
    assert _matmul_flops(costs, FORWARD) == pytest.approx(_linear_forward_flops(workload.seq_len, QLORA.lora_rank))
    assert costs.forward_flops_per_sample >= _matmul_flops(costs, FORWARD)  # what MFU counts
    forward = {op.name for op in costs.ops if op.phase == FORWARD}
    assert "dequantize_4bit" in forward and "gemm_4bit" not in forward  # the weight's copy, then the matmul


def test_a_4bit_base_costs_the_matmuls_of_a_frozen_16_bit_one() -> None:
    """The forward's matmuls and the backward's input gradients against the dequantized weight: a frozen
    bf16 base's, FLOP for FLOP, in the same type."""
    nf4 = predict_memory(ON_A100, QLORA).step_costs
    bf16 = predict_memory(ON_A100, QLORA.replace(quantize_base="off")).step_costs
    for phase in (FORWARD, BACKWARD):
        assert _matmul_flops(nf4, phase) == pytest.approx(_matmul_flops(bf16, phase)) and _matmul_flops(nf4, phase)
    assert nf4.forward_flops_per_sample == pytest.approx(bf16.forward_flops_per_sample)
    assert {op.dtype for op in nf4.ops if op.kind == MATMUL} == {"bfloat16"}
