"""FSDP2's and NCCL's buffers as arithmetic: each term against world size, dtype and reshard mode."""

from __future__ import annotations

import pytest

from autotune.estimate.fsdp_buffers import (
    all_gather_output_bytes,
    copy_in_stream_bytes,
    hybrid_all_reduce_bytes,
    kept_after_forward_bytes,
    no_sync_gradient_bytes,
    padded_numel,
    reduce_scatter_bytes,
)

MiB = 2**20
# A Llama-3-8B block: q, k, v, o, gate, up, down and two norms (218.1 M parameters).
BLOCK = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
BLOCK += [(4096,), (4096,)]
ROOT = [(128256, 4096), (128256, 4096), (4096,)]  # embedding, untied LM head, final norm: 1,050.7 M


def test_dim0_is_padded_to_a_multiple_of_the_ranks():
    assert padded_numel((10, 3), 4) == 12 * 3  # ceil(10 / 4) * 4 rows
    assert padded_numel((8, 3), 4) == 24  # even: no padding
    assert padded_numel((), 8) == 8  # a scalar: one row, padded
    assert padded_numel((5,), 1) == 5


def test_all_gather_output_is_the_whole_group_in_the_all_gather_dtype_whatever_the_ranks():
    block = sum(padded_numel(s, 8) for s in BLOCK)
    assert block == 218_112_000
    assert all_gather_output_bytes(BLOCK, 8, 2) == 2 * block  # bf16: 0.406 GiB
    assert all_gather_output_bytes(BLOCK, 128, 2) == 2 * block  # 4096 rows split evenly over 128
    assert all_gather_output_bytes(BLOCK, 8, 4) == 2 * all_gather_output_bytes(BLOCK, 8, 2)  # fp32: twice


def test_the_copy_in_stream_holds_two_outputs_in_forward_and_the_cast_shards():
    root, block = all_gather_output_bytes(ROOT, 8, 2), all_gather_output_bytes(BLOCK, 8, 2)
    assert copy_in_stream_bytes(ROOT, BLOCK, 8, 2, cast=False) == root + block
    assert copy_in_stream_bytes(ROOT, BLOCK, 8, 2, cast=True) == root + block + block // 8
    assert round((root + block) / 2**30, 2) == 2.36  # torchtitan's Llama-3-8B, as bench/fsdp2_cuda_memory.md


@pytest.mark.parametrize("ranks", [2, 8, 128])
def test_reduce_scatter_input_is_the_group_in_reduce_dtype_and_its_output_one_rank_s_share(ranks):
    fp32_in, fp32_out = reduce_scatter_bytes(BLOCK, ranks, 4)
    bf16_in, bf16_out = reduce_scatter_bytes(BLOCK, ranks, 2)
    assert fp32_in == 4 * sum(padded_numel(s, ranks) for s in BLOCK) and fp32_in == 2 * bf16_in
    assert fp32_out * ranks == fp32_in and bf16_out * ranks == bf16_in


def test_no_sync_keeps_every_held_parameter_s_gradient_in_the_reduce_dtype():
    assert no_sync_gradient_bytes(8_030_000_000, 4) / 2**30 == pytest.approx(29.9, abs=0.05)
    assert no_sync_gradient_bytes(8_030_000_000 // 2, 4) * 2 == no_sync_gradient_bytes(8_030_000_000, 4)  # TP 2
    assert no_sync_gradient_bytes(1000, 2) == 2000  # bf16 reduction


def test_reshard_after_forward_true_false_or_a_group_size():
    whole = all_gather_output_bytes(BLOCK, 8, 2)
    assert kept_after_forward_bytes(BLOCK, 8, 2, True) == 0
    assert kept_after_forward_bytes(BLOCK, 8, 2, False) == whole
    assert kept_after_forward_bytes(BLOCK, 8, 2, 4) == whole // 4
    assert kept_after_forward_bytes(BLOCK, 8, 2, 8) == whole // 8
    with pytest.raises(ValueError, match="must divide"):
        kept_after_forward_bytes(BLOCK, 8, 2, 3)


def test_the_traced_fsdp2_step_allocates_these_buffers_on_their_streams():
    # FSDP2's own code on fake tensors (2 ranks, bf16 compute, fp32 reduction): each group's all-gather
    # output is made on the copy-in stream (the first side stream entered) and each reduce-scatter output on
    # the reduce-scatter stream, in the sizes the arithmetic gives.
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.trace import prepare_tracing, trace_step
    from autotune.models.sources import meta_model, resolve_task
    from autotune.prepare.sharding import shard_units

    workload = Workload(model="builtin:llama-tiny", nproc=2, device="cuda", gpu="H100-80GB", global_batch=8)
    model = meta_model(workload, resolve_task(workload))
    units = [[tuple(p.shape) for p in unit.parameters()] for unit in shard_units(model)]
    in_units = {id(p) for unit in shard_units(model) for p in unit.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in in_units]
    prepare_tracing()
    events = trace_step(workload, TrialConfig(micro_batch=4, precision="bf16", fsdp="full")).events
    assert events is not None
    made_on = {stream: {e[1] for e in events if len(e) > 2 and e[2] == stream and e[1]} for stream in (1, 2)}
    for group in (root, *units):
        assert all_gather_output_bytes(group, 2, 2) in made_on[1]
        assert reduce_scatter_bytes(group, 2, 4)[1] in made_on[2]


def test_hybrid_holds_one_groups_reduced_shard_sized_by_the_shard_group_not_the_world():
    # 2 nodes x 8 GPUs, shard groups of one node: each rank's shard is 1/8 of a block, not 1/16.
    block = sum(padded_numel(s, 8) for s in BLOCK)
    assert hybrid_all_reduce_bytes(BLOCK, 8, 4) == block * 4 // 8  # fp32 reduction
    assert hybrid_all_reduce_bytes(BLOCK, 8, 4) == reduce_scatter_bytes(BLOCK, 8, 4)[1]
    assert hybrid_all_reduce_bytes(BLOCK, 8, 4) == 2 * reduce_scatter_bytes(BLOCK, 16, 4)[1]  # full over 16
