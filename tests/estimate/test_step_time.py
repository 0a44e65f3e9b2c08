"""The step-time model: the traced operators (FLOPs, bytes, per sample), timed against a roofline."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autotune.config.gpus import gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate import step_time
from autotune.estimate.client import predict_memory
from autotune.estimate.results import MemoryEstimate
from autotune.estimate.step_costs import OpCost, StepCosts
from autotune.estimate.step_time import DeviceProfile, card_profile, predict_step_time
from autotune.models.presets import _TINY_VOCAB

VOCAB = _TINY_VOCAB
LLAMA = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, device="cpu")


def _ops(costs: StepCosts, phase: str) -> set[str]:
    return {op.name for op in costs.ops if op.phase == phase}


@pytest.mark.slow
def test_the_trace_counts_kernels_not_views_and_keeps_the_recompute():
    plain = predict_memory(LLAMA, TrialConfig(micro_batch=2)).step_costs
    ckpt = predict_memory(LLAMA, TrialConfig(micro_batch=2, checkpointing=True)).step_costs
    names = _ops(plain, "forward") | _ops(plain, "backward") | _ops(plain, "update")
    assert {"mm", "bmm"} & names and not {"view", "_unsafe_view", "t", "transpose", "expand", "device"} & names
    assert _ops(plain, "update")  # the optimizer's step, traced

    def flops(costs: StepCosts, phase: str) -> float:
        return sum(op.flops * op.count for op in costs.ops if op.phase == phase)

    # The backward does twice the forward's matmul work; checkpointing runs the layers' forward again in it.
    assert flops(plain, "backward") == pytest.approx(2 * flops(plain, "forward"), rel=0.02)
    # ... not the LM head, outside the layers (2 x seq x hidden x vocab a sample), nor what the backward does
    # not need: non-reentrant checkpointing stops once the saved tensors are back (each layer's down_proj
    # output is never recomputed: 4 of the MLP's 6 matmuls).
    recompute = flops(ckpt, "backward") - flops(plain, "backward")
    layers = flops(plain, "forward") - 2 * 128 * 128 * VOCAB
    mlp = 2 * 128 * 128 * 352  # one MLP matmul of a sample
    assert recompute == pytest.approx(layers - 2 * mlp, rel=1e-9)
    assert ckpt.forward_flops_per_sample == plain.forward_flops_per_sample


def test_a_checkpointed_twin_reruns_the_layers_forward_of_a_plain_trace():
    """A checkpointed family's step, derived from the plain family's trace without tracing it: the forward of
    the layers checkpointing wraps (marked in the trace) runs again in the backward, the LM head's does not.
    It is at most the traced checkpointed step: non-reentrant checkpointing stops once the saved tensors are
    back, so each layer's last MLP matmul is never rerun."""
    plain = predict_memory(LLAMA, TrialConfig(micro_batch=2)).step_costs
    ckpt = predict_memory(LLAMA, TrialConfig(micro_batch=2, checkpointing=True)).step_costs
    assert plain.layers_marked and any(op.in_layer for op in plain.ops)

    def flops(costs: StepCosts, phase: str) -> float:
        return sum(op.flops * op.count for op in costs.ops if op.phase == phase)

    layers = flops(plain, "forward") - 2 * 128 * 128 * VOCAB  # the forward less the LM head
    for share in (1.0, 0.5):
        twin = plain.with_forward_rerun(share)
        assert flops(twin, "forward") == flops(plain, "forward")
        assert flops(twin, "backward") - flops(plain, "backward") == pytest.approx(share * layers, rel=1e-9)
    mlp = 2 * 128 * 128 * 352
    traced_recompute = flops(ckpt, "backward") - flops(plain, "backward")
    assert traced_recompute == pytest.approx(layers - 2 * mlp, rel=1e-9)
    # A trace whose layers were not marked (a model without Transformers' checkpointing layers): the whole
    # forward stands for theirs.
    unmarked = dataclasses.replace(plain, layers_marked=False)
    rerun = flops(unmarked.with_forward_rerun(1.0), "backward") - flops(plain, "backward")
    assert rerun == pytest.approx(flops(plain, "forward"), rel=1e-9)
    assert StepCosts.from_dict(plain.to_dict()) == plain


def test_a_lora_trace_placed_as_full_fine_tuning_adds_the_bases_weight_gradients():
    """Full fine-tuning's step from a LoRA trace, where an untraced family is placed: every forward matmul
    gains its weight gradient's (the LM head's too), and the update moves every parameter. Near the traced
    full step: the adapters' own weight gradients count twice, a few percent of a rank-8 model's work."""
    full = predict_memory(LLAMA, TrialConfig(micro_batch=2)).step_costs
    lora = predict_memory(LLAMA, TrialConfig(micro_batch=2, lora_rank=8)).step_costs
    placed = lora.with_all_weights_trained()

    def total(costs: StepCosts, phase: str, field: str) -> float:
        return sum(getattr(op, field) * op.count for op in costs.ops if op.phase == phase)

    assert total(lora, "backward", "flops") < 0.55 * total(full, "backward", "flops")  # what the base lacks
    assert total(placed, "backward", "flops") == pytest.approx(total(full, "backward", "flops"), rel=0.03)
    assert total(placed, "update", "fixed_bytes") == pytest.approx(total(full, "update", "fixed_bytes"), rel=0.03)
    assert placed.trainable_parameters == lora.parameters
    assert full.with_all_weights_trained() == full  # nothing frozen: nothing to add


def test_one_trace_answers_every_micro_batch_of_its_family():
    """FLOPs grow with the micro batch exactly; bytes nearly: model states (and what is made of them alone)
    are moved whole, the rest per sample; a weight's gradient, made from activations, counts per sample."""
    small = predict_memory(LLAMA, TrialConfig(micro_batch=1)).step_costs
    large = predict_memory(LLAMA, TrialConfig(micro_batch=8)).step_costs

    def totals(costs: StepCosts, micro_batch: int) -> tuple[float, float]:
        ops = costs.micro_step(micro_batch)
        return sum(f * n for _, _, f, _, n in ops), sum(b * n for _, _, _, b, n in ops)

    assert totals(small, 8)[0] == pytest.approx(totals(large, 8)[0], rel=1e-9)
    assert totals(small, 8)[1] == pytest.approx(totals(large, 8)[1], rel=0.15)
    assert StepCosts.from_dict(large.to_dict()) == large


def _profile(kind: str) -> DeviceProfile:
    return DeviceProfile(
        name="hand",
        type=kind,
        matmul_flops={"float32": 1e12},
        memory_bandwidth=1e11,
        kernel_s=1e-5,
        dispatch_s=2e-5,
        link_bandwidth=1e10,
        host_link_bandwidth=1e10,
        peak_flops=2e12,
        collective_s=1e-4,
    )


def _hand_estimate(config: TrialConfig, costs: StepCosts) -> MemoryEstimate:
    return MemoryEstimate(
        config=config,
        predicted_peak_bytes=0,
        parameters_bytes=0,
        gradients_bytes=4 * 10**9,
        optimizer_state_bytes=0,
        activations_bytes=0,
        temporaries_bytes=0,
        overhead_bytes=None,
        method="hand",
        seconds=0.0,
        step_costs=costs,
    )


HAND = StepCosts(
    (
        OpCost("forward", "matmul", "mm", "float32", 1e9, 0.0, 1e6, 1.0),  # compute-bound
        OpCost("backward", "other", "add", "float32", 0.0, 1e7, 1e8, 2.0),  # memory-bound
        OpCost("update", "other", "_foreach_add_", "float32", 0.0, 1e8, 0.0, 1.0),
    ),
    forward_flops_per_sample=1e9,
    trainable_parameters=10**9,
)


def test_a_compiled_chain_moves_what_its_fused_kernel_reads_and_writes():
    """torchao's float8 cast of a bf16 tensor as eager runs it: the amax (abs, then max), then the cast (upcast,
    scale, clamp, downcast). Compiled, each chain is one kernel, as Inductor makes it: the amax reads x once (2
    bytes an element) and the cast reads x and writes float8 (3), where the chains' heads alone move 4 and 6."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from autotune.estimate.step_costs import CostRecorder

    recorder = CostRecorder(lambda tensor: False)
    recorder.phase = "forward"

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            recorder.record(func, args, kwargs or {}, tree_leaves((args, kwargs)), tree_leaves(out), 0.0)
            return out

    n = 2**20
    x = torch.randn(n, dtype=torch.bfloat16)
    with Recording():
        amax = torch.max(torch.abs(x))
        scale = 448.0 / amax.float()
        (x.to(torch.float32) * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    costs = recorder.costs(micro_batch=1, micro_steps=1, trainable_parameters=0)

    def moved(fused: bool) -> float:
        return sum(nbytes * count for _, _, _, nbytes, count in costs.micro_step(1, fused=fused))

    assert moved(fused=True) == pytest.approx(5 * n, rel=1e-3)
    heads = sum(op.fixed_bytes + op.sample_bytes for op in costs.ops if not op.fusable)
    assert heads == pytest.approx(10 * n, rel=1e-3)  # what the chains' heads move: the rule before this one
    assert moved(fused=False) > heads  # eager: every operator's kernel, each through memory
    profile = _profile("cpu")
    config = TrialConfig(micro_batch=1)
    device, _ = step_time._phase_times(costs.micro_step(1, fused=True), profile, config, 1.0)
    kernels = sum(op.count for op in costs.ops if not op.fusable)  # two chains and the scale's division
    assert device == pytest.approx(5 * n / profile.memory_bandwidth + kernels * profile.kernel_s, rel=1e-3)


def test_each_operator_takes_the_longer_of_its_flops_and_its_bytes_plus_a_kernel():
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, device="cpu")
    config = TrialConfig(micro_batch=2)  # 4 micro steps a step
    matmul = 2 * 1e9 / 1e12 + 1e-5  # 2 samples of FLOPs (their bytes would take 2e-5 s)
    add = 2 * ((1e7 + 2 * 1e8) / 1e11 + 1e-5)  # model-state bytes once, the rest per sample
    update = 1e8 / 1e11 + 1e-5
    gpu = predict_step_time(_hand_estimate(config, HAND), workload.replace(device="auto"), _profile("cuda"))
    # On a GPU the host runs ahead: a micro step takes the longer of the device's work and the host's.
    assert gpu.compute_s == pytest.approx(4 * max(matmul + add, 3 * 2e-5))
    assert gpu.update_s == pytest.approx(max(update, 2e-5))
    # On a CPU the host computes: they add.
    cpu = predict_step_time(_hand_estimate(config, HAND), workload, _profile("cpu"))
    assert cpu.compute_s == pytest.approx(4 * (matmul + add + 3 * 2e-5))
    assert cpu.step_s == pytest.approx(cpu.compute_s + cpu.update_s)
    assert cpu.samples_per_s == pytest.approx(8 / cpu.step_s) and cpu.tokens_per_s == pytest.approx(
        128 * 8 / cpu.step_s
    )
    assert cpu.mfu == pytest.approx(3 * 1e9 * cpu.samples_per_s / 2e12)


def test_ddp_waits_for_the_all_reduce_the_last_backward_does_not_hide():
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, nproc=2)
    estimate = _hand_estimate(TrialConfig(micro_batch=4), HAND)  # one micro step a rank
    step = predict_step_time(estimate, workload, _profile("cuda"))
    gradients = 2 * 10**9  # the estimate's 4 GB hold DDP's bucket copy
    all_reduce = 2 * gradients * (1 / 2) / 1e10
    backward = 2 * ((1e7 + 4 * 1e8) / 1e11 + 1e-5)
    bucket = 25 * 2**20 * 2 * (1 / 2) / 1e10
    latency = math.ceil(gradients / (25 * 2**20)) * 1e-4  # one collective per 25 MiB bucket
    assert step.communication_s == pytest.approx(all_reduce - backward + bucket + latency)
    assert predict_step_time(estimate, workload.replace(nproc=1, global_batch=4), _profile("cuda")).communication_s == 0


def test_a_named_card_is_its_published_peak_at_the_matmul_rate_it_sustains():
    profile = card_profile(gpu_spec("H100-80GB"))
    assert profile.matmul_flops["bfloat16"] == pytest.approx(745e12)  # an H200's MSMF: the same chip and power
    assert card_profile(gpu_spec("A100-80GB")).matmul_flops["bfloat16"] == pytest.approx(257e12)
    assert profile.peak_flops == 989e12 and profile.type == "cuda"
    assert DeviceProfile.from_dict(profile.to_dict()) == profile


def test_a_cuda_workload_is_timed_on_its_card_with_the_kernels_cuda_would_pick():
    workload = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=32, gpu="A100-80GB")
    estimate = predict_memory(workload, TrialConfig(micro_batch=8, precision="bf16"))
    step = predict_step_time(estimate, workload, card_profile(gpu_spec("A100-80GB")))
    slower = predict_step_time(estimate, workload, card_profile(gpu_spec("V100-16GB")))
    assert 0 < step.mfu < 1 and step.step_s < slower.step_s
    assert {op.dtype for op in estimate.step_costs.ops if op.kind == "matmul"} == {"bfloat16"}
    assert math.isclose(step.tokens_per_s, step.samples_per_s * 256)
    assert dataclasses.asdict(step) == step.to_dict()


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_a_sixteen_bit_siblings_matmuls_at_a_slower_precisions_rate_are_a_floor_under_its_step(precision):
    """What lets a plan leave a slower precision's family untraced (autotune.search.plan._SpeedFloor): the bf16
    trace's matmul and attention FLOPs, at fp32's or tf32's rate, are under that precision's own trace's matmuls
    (the same projections; its attention runs as the math path's bmm, the whole square where flash skips causal
    masking's half), and so under the step it predicts."""
    workload = Workload(model="builtin:llama-tiny", seq_len=256, global_batch=32, gpu="H100-80GB")
    profile = card_profile(gpu_spec("H100-80GB"))
    sibling = predict_memory(workload, TrialConfig(micro_batch=8, precision="bf16", checkpointing=True))
    for micro_batch in (4, 8):
        config = TrialConfig(micro_batch=micro_batch, precision=precision, checkpointing=True)
        own = predict_memory(workload, config)
        floor = step_time.matmul_floor_s(sibling, config, workload, profile)
        own_matmuls = step_time.matmul_floor_s(own, config, workload, profile)
        assert 0.8 * own_matmuls < floor <= own_matmuls < predict_step_time(own, workload, profile).compute_s
    # At bf16's own rate the floor is the bf16 step's matmuls: under its step too.
    same = step_time.matmul_floor_s(sibling, sibling.config, workload, profile)
    assert 0 < same < predict_step_time(sibling, workload, profile).compute_s


def test_a_cuda_8bit_step_is_one_kernel_that_moves_each_tensor_once():
    # bitsandbytes' fused 8-bit step, traced as torchao's eager one: none of its fp32 temporaries goes
    # through memory; it reads the weights, gradients and moments once and writes weights and moments back.
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, gpu="A100-80GB")
    eight = predict_memory(workload, TrialConfig(micro_batch=8, precision="bf16", optimizer="adamw-8bit"))
    plain = predict_memory(workload, TrialConfig(micro_batch=8, precision="bf16"))
    update = [op for op in eight.step_costs.ops if op.phase == "update"]
    assert [op.name for op in update] == ["one_kernel"]
    params, moved = eight.step_costs.trainable_parameters, update[0].fixed_bytes + update[0].sample_bytes
    # fp32 weight and gradient, two uint8 moments (tensors under 4,096 values keep fp32 ones), read;
    # weight and moments written back: 16 bytes a parameter, and the block scales
    assert 16 * params <= moved < 20 * params
    assert moved < sum(op.fixed_bytes + op.sample_bytes for op in plain.step_costs.ops if op.phase == "update")


def test_zero_communicates_as_deepspeed_runs_each_stage():
    """ZeRO-1 reduces once a step, ZeRO-2 every micro step, ZeRO-3 also gathers every weight (frozen ones
    too) in each forward and backward; each bucket (hidden^2 elements) and gathered tensor costs a latency."""
    costs = dataclasses.replace(
        HAND, trainable_parameters=10**6, parameters=4 * 10**6, parameter_tensors=10, hidden_size=100
    )
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, nproc=2, device="cpu")
    profile = _profile("cpu")

    def comm(stage: int) -> float:
        config = TrialConfig(micro_batch=2, zero_stage=stage)  # 4 micro steps a rank
        return predict_step_time(_hand_estimate(config, costs), workload, profile).communication_s

    weights, buckets, link = 4 * 10**6 * 0.5, 100, 1e10  # fp32 bytes over 2 ranks, 10**6 / 100**2 buckets
    once = weights / link + buckets * 1e-4
    assert comm(1) == pytest.approx(2 * once)
    assert comm(2) == pytest.approx(4 * once + once)
    gathers = 2 * 4 * (4 * 4 * 10**6 * 0.5) / link + 2 * 4 * 10 * 1e-4  # nothing hidden on a CPU
    assert comm(3) == pytest.approx(5 * once + gathers)


def test_hybrid_gathers_within_its_shard_group_and_all_reduces_across_nodes():
    """HSDP on 2 nodes x 8 GPUs, shard groups of one node: the traced all-gather and reduce-scatter move 7/8 of
    their bytes over NVLink, the all-reduce of each reduced shard 2 x 1/2 of it over InfiniBand (one port a GPU)."""
    gathered, reduced = 8e9, 1e9  # bytes per micro step, as traced on the (replicate, shard) mesh
    costs = dataclasses.replace(
        HAND,
        ops=(
            *HAND.ops,
            OpCost("forward", "collective", "_allgather_base_", "float32", 0.0, gathered / 2, 0.0, 1.0),
            OpCost("backward", "collective", "_reduce_scatter_base_", "float32", 0.0, gathered / 2, 0.0, 1.0),
            OpCost("backward", "collective", "allreduce_", "float32", 0.0, reduced, 0.0, 1.0),
        ),
    )
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, nproc=16, nodes=2, gpu="H100-80GB")
    profile = card_profile(gpu_spec("H100-80GB"))
    hybrid = predict_step_time(_hand_estimate(TrialConfig(micro_batch=1, fsdp="hybrid"), costs), workload, profile)
    nvlink, infiniband = 450e9 * 0.75, 50e9 * 0.75  # NCCL's bus bandwidth: 3/4 of each link's
    traced = gathered * 7 / 8 / nvlink + 2 * reduced * (1 / 2) / infiniband
    assert hybrid.communication_s == pytest.approx(max(traced - hybrid.compute_s, 0.0) + 0.05 * traced)
    # The same bytes as one FSDP group of 16 ranks over two nodes: every gather on the slower link.
    full = predict_step_time(_hand_estimate(TrialConfig(micro_batch=1, fsdp="full"), costs), workload, profile)
    assert hybrid.communication_s < full.communication_s
    # Shard groups of 16 over 8 nodes of 4 GPUs: each group spans nodes, its gathers on the network too.
    wide = workload.replace(nproc=32, nodes=8, global_batch=32)
    spanning = TrialConfig(micro_batch=1, fsdp="hybrid", shard_group=16)
    step = predict_step_time(_hand_estimate(spanning, costs), wide, profile)
    traced = gathered * 15 / 16 / infiniband + 2 * reduced * (1 / 2) / infiniband
    assert step.communication_s == pytest.approx(max(traced - step.compute_s, 0.0) + 0.05 * traced)


@pytest.mark.parametrize("card, sms", [("H100-80GB", 132), ("A100-80GB", 108), ("A100-40GB", 108)])
@pytest.mark.parametrize("gathered", [8e9, 400e9])  # a gather shorter than the compute, one much longer
def test_fsdp_computes_beside_its_collectives_on_the_sms_nccls_24_channels_leave(card, sms, gathered):
    """While FSDP's collectives overlap the compute, NCCL's kernel holds one SM per channel (24 ring channels on an
    8-GPU NVSwitch node of A100s or H100s, NCCL 2.18): the compute runs at (SMs - 24) / SMs of its rate for as long
    as both run, the overlapped collectives' seconds (all but the 5% not hidden) or the compute's own if it ends
    first. What is left of the collectives after the slower compute waits, as before."""
    costs = dataclasses.replace(
        HAND,
        ops=(*HAND.ops, OpCost("forward", "collective", "_allgather_base_", "float32", 0.0, gathered, 0.0, 1.0)),
    )
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, nproc=8, gpu=card)
    profile = card_profile(gpu_spec(card))
    assert profile.collective_sm_share == pytest.approx(24 / sms)
    estimate = _hand_estimate(TrialConfig(micro_batch=1, fsdp="full"), costs)
    step = predict_step_time(estimate, workload, profile)
    alone = predict_step_time(estimate, workload, dataclasses.replace(profile, collective_sm_share=None))
    traced = gathered * 7 / 8 / (gpu_spec(card).link_bandwidth * 0.75)
    share = 24 / sms
    displaced = share * min(0.95 * traced, alone.compute_s / (1 - share))
    assert step.collective_sms_s == pytest.approx(displaced) and displaced > 0
    assert step.compute_s == pytest.approx(alone.compute_s + displaced)
    assert step.communication_s == pytest.approx(max(traced - step.compute_s, 0.0) + 0.05 * traced)
    if traced > alone.compute_s / (1 - share):  # the compute ends first: the step is the collectives' time
        assert step.compute_s + step.communication_s == pytest.approx(1.05 * traced)
    # No contention where no channel count is sourced: a card outside the table, or ranks across nodes.
    l40s = card_profile(gpu_spec("L40S"))
    assert l40s.collective_sm_share is None
    assert predict_step_time(estimate, workload.replace(gpu="L40S"), l40s).collective_sms_s == 0.0
    nodes = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, nproc=16, nodes=2, gpu=card)
    assert predict_step_time(estimate, nodes, profile).collective_sms_s == 0.0
    # Nor with one rank, or under ZeRO-2's reductions, which autotune's configs do not overlap.
    one = predict_step_time(estimate, workload.replace(nproc=1, global_batch=1), profile)
    assert one.collective_sms_s == 0.0
    zero2 = predict_step_time(_hand_estimate(TrialConfig(micro_batch=1, zero_stage=2), costs), workload, profile)
    assert zero2.collective_sms_s == 0.0


def test_ddp_computes_its_last_backward_beside_the_all_reduce_on_fewer_sms():
    """DDP's all-reduce overlaps the last backward: on an H100 node the compute loses 24/132 of its rate for the
    all-reduce's seconds, up to the backward's; the wait after it is as before (the all-reduce past the backward)."""
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8, nproc=8, gpu="H100-80GB")
    profile = card_profile(gpu_spec("H100-80GB"))
    estimate = _hand_estimate(TrialConfig(micro_batch=1), HAND)
    step = predict_step_time(estimate, workload, profile)
    alone = predict_step_time(estimate, workload, dataclasses.replace(profile, collective_sm_share=None))
    all_reduce = 2 * 2e9 * (7 / 8) / (450e9 * 0.75)  # the estimate's 4 GB hold DDP's bucket copy
    backward = 2 * ((1e7 + 1e8) / (3350e9 * 0.57) + 6e-6)  # micro batch 1, an eager add on Hopper
    assert step.collective_sms_s == pytest.approx(24 / 132 * min(all_reduce, backward))
    assert step.communication_s == pytest.approx(alone.communication_s)


@pytest.mark.parametrize(
    "card, gpus_per_node, link",
    [
        ("A100-80GB", None, 25e9),  # two DGX A100s: one 200 Gb/s HDR port a GPU
        ("H100-80GB", None, 50e9),  # two DGX H100s: one 400 Gb/s NDR port a GPU
        ("H100-80GB", 16, 450e9),  # one node of 16 (--gpus-per-node 16): NVLink between them all
        ("L40S", None, 6.25e9),  # PCIe servers of 8 on 400 Gb/s of Ethernet
    ],
)
def test_fsdp_over_two_nodes_moves_its_bytes_at_the_cards_network_per_gpu(card, gpus_per_node, link):
    """16 ranks of FSDP full on a named card fill the card's nodes (--gpus-per-node, else its reference node's):
    past one node each gather and reduce-scatter moves 15/16 of its bytes at the network's bandwidth per GPU, the
    slower of it and the node's link, at NCCL's 3/4 of either."""
    from autotune.config.gpus import on_card_nodes

    gathered = 8e9
    costs = dataclasses.replace(
        HAND,
        ops=(*HAND.ops, OpCost("forward", "collective", "_allgather_base_", "float32", 0.0, gathered, 0.0, 1.0)),
    )
    typed = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=16, nproc=16, gpu=card)
    workload = on_card_nodes(typed, gpus_per_node)
    assert workload.nodes == (1 if gpus_per_node == 16 else 2)
    profile = card_profile(gpu_spec(card))
    step = predict_step_time(_hand_estimate(TrialConfig(micro_batch=1, fsdp="full"), costs), workload, profile)
    traced = gathered * 15 / 16 / (min(link, gpu_spec(card).link_bandwidth) * 0.75)
    assert step.communication_s == pytest.approx(max(traced - step.compute_s, 0.0) + 0.05 * traced)


@pytest.mark.parametrize("accum", [1, 2, 8])
def test_fsdp_reduces_on_each_micro_step_or_once_a_step_as_grad_sync_says(accum):
    """A trace of two micro steps under --grad-sync last holds one reduce-scatter, a mean of one half per micro step:
    a step of any accumulation still pays one, where --grad-sync each pays one per micro step."""
    gathered, reduced = 8e9, 4e9  # bytes per micro step where each micro step reduces
    ops = (
        *HAND.ops,
        OpCost("forward", "collective", "_allgather_base_", "float32", 0.0, gathered, 0.0, 1.0),
        OpCost("backward", "collective", "_reduce_scatter_base_", "float32", 0.0, reduced, 0.0, 1.0),
    )
    each_costs = dataclasses.replace(HAND, ops=ops, micro_steps=2)
    last_costs = dataclasses.replace(  # the same trace with the first micro step's reduction skipped
        each_costs, ops=(*ops[:-1], dataclasses.replace(ops[-1], count=0.5))
    )
    workload = Workload(model="builtin:llama-tiny", seq_len=128, global_batch=8 * accum, nproc=8, gpu="H100-80GB")
    profile = card_profile(gpu_spec("H100-80GB"))
    link = 450e9 * 0.75  # NVLink at NCCL's bus bandwidth

    def traced_s(sync: str, costs: StepCosts) -> float:
        step = predict_step_time(
            _hand_estimate(TrialConfig(micro_batch=1, fsdp="full", grad_sync=sync), costs), workload, profile
        )
        assert step is not None
        return step.communication_s

    def waits(traced: float, compute: float) -> float:
        return max(traced - compute, 0.0) + 0.05 * traced

    step = predict_step_time(_hand_estimate(TrialConfig(micro_batch=1, fsdp="full"), each_costs), workload, profile)
    assert step is not None
    each = (accum * gathered + accum * reduced) * 7 / 8 / link
    last = (accum * gathered + reduced) * 7 / 8 / link
    assert traced_s("each", each_costs) == pytest.approx(waits(each, step.compute_s))
    assert traced_s("last", last_costs) == pytest.approx(waits(last, step.compute_s))
    assert StepCosts.from_dict(last_costs.to_dict()) == last_costs  # the traced micro steps travel with the costs


@pytest.mark.parametrize("accum", [1, 2, 8])
def test_hybrid_reduces_on_each_micro_step_or_once_a_step_as_grad_sync_says(accum):
    """Hybrid sharding under --grad-sync last: a step gathers in each micro step, and reduce-scatters within its
    shard group and all-reduces across the replicas once, whatever the accumulation."""
    gathered, scattered, reduced = 8e9, 4e9, 1e9  # bytes per micro step where each micro step reduces
    ops = (
        *HAND.ops,
        OpCost("forward", "collective", "_allgather_base_", "float32", 0.0, gathered, 0.0, 1.0),
        OpCost("backward", "collective", "_reduce_scatter_base_", "float32", 0.0, scattered, 0.0, 1.0),
        OpCost("backward", "collective", "allreduce_", "float32", 0.0, reduced, 0.0, 1.0),
    )
    each_costs = dataclasses.replace(HAND, ops=ops, micro_steps=2)
    last_costs = dataclasses.replace(  # the same trace with the first micro step's reductions skipped
        each_costs, ops=(*ops[:-2], *(dataclasses.replace(op, count=0.5) for op in ops[-2:]))
    )
    workload = Workload(
        model="builtin:llama-tiny", seq_len=128, global_batch=16 * accum, nproc=16, nodes=2, gpu="H100-80GB"
    )
    profile = card_profile(gpu_spec("H100-80GB"))
    nvlink, infiniband = 450e9 * 0.75, 50e9 * 0.75

    def traced_s(sync: str, costs: StepCosts) -> tuple[float, float]:
        step = predict_step_time(
            _hand_estimate(TrialConfig(micro_batch=1, fsdp="hybrid", grad_sync=sync), costs), workload, profile
        )
        assert step is not None
        return step.communication_s, step.compute_s

    def waits(traced: float, compute: float) -> float:
        return max(traced - compute, 0.0) + 0.05 * traced

    def traced(reductions: int) -> float:
        within = (accum * gathered + reductions * scattered) * 7 / 8 / nvlink
        return within + reductions * 2 * reduced * (1 / 2) / infiniband

    communication, compute = traced_s("each", each_costs)
    assert communication == pytest.approx(waits(traced(accum), compute))
    communication, compute = traced_s("last", last_costs)
    assert communication == pytest.approx(waits(traced(1), compute))


@pytest.mark.slow
def test_the_cpu_probe_of_a_study_of_several_ranks_times_a_collective_between_two_processes():
    """What a 2-rank study's roofline holds beyond a 1-rank one's (the tuner asks for it only then:
    tests/search/test_tuner_rules.py): the gloo all-reduce's latency, measured between two real processes."""
    from autotune.trial.device_probe import probe_profile

    probed = probe_profile("cpu", between_ranks=True)
    assert probed is not None, "the device probe failed"
    assert 0 < probed["collective_s"] < 1.0, probed
    assert DeviceProfile.from_dict(probed).collective_s == probed["collective_s"]


def test_the_roofline_an_estimate_is_timed_on_is_probed_in_a_fork_of_the_estimate_server(monkeypatch):
    """`autotune estimate` times its configs on this CPU's roofline: probed in a process forked from the
    estimate server (after its imports), not in a new interpreter importing torch."""
    from autotune.estimate.step_time import profile_for
    from autotune.trial import device_probe

    def no_interpreter(*args, **kwargs):
        raise AssertionError(f"the probe started an interpreter of its own: {args}")

    monkeypatch.setattr(device_probe.subprocess, "run", no_interpreter)
    profile = profile_for(Workload(model="builtin:gpt2-tiny", global_batch=2), "cpu")
    assert profile is not None and profile.source == "measured by the device probe"
    assert profile.collective_s is None and profile.matmul_flops["float32"] > 0  # one rank: no collective timed


@pytest.mark.parametrize(
    "card, config, micro_rate, update_rate",
    [
        # Hopper: eager PyTorch's memory-bound kernels at the 57% of HBM measured on an H200, compiled ones at 80%
        ("H100-80GB", TrialConfig(micro_batch=1), 0.57, 0.57),
        ("H100-80GB", TrialConfig(micro_batch=1, compile=True), 0.8, 0.57),  # the optimizer is not compiled
        ("H100-80GB", TrialConfig(micro_batch=1, fused_optimizer=True), 0.57, 0.8),
        ("A100-80GB", TrialConfig(micro_batch=1), 0.8, 0.8),  # not measured there: a large copy's rate
    ],
)
def test_eager_memory_bound_kernels_run_at_the_rate_measured_on_their_card(card, config, micro_rate, update_rate):
    from autotune.estimate.step_time import _phase_times

    profile = card_profile(gpu_spec(card))
    bandwidth = gpu_spec(card).memory_bandwidth
    micro = [op for op in HAND.micro_step(1) if op[0] == "other"]
    device, _ = _phase_times(micro, profile, config, 1.0)
    assert device == pytest.approx(2 * (1e7 + 1e8) / (bandwidth * micro_rate) + 2 * 6e-6)
    update, _ = _phase_times(HAND.update(), profile, config, 1.0, compiled=config.fused_optimizer)
    assert update == pytest.approx(1e8 / (bandwidth * update_rate) + 6e-6)
