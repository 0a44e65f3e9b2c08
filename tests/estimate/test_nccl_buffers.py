"""NCCL's buffers on each GPU, communicator by communicator, as NCCL's sources size them."""

from __future__ import annotations

from autotune.config.gpus import gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.nccl_buffers import (
    Communicator,
    communicator_bytes,
    communicators,
    describe_communicators,
    nccl_bytes,
)

MiB = 2**20
PER_CHANNEL = 4 * MiB + 2 * MiB + 6 * MiB  # Simple 4, LL 0.5 and LL128 4.69 MiB, each rounded up to 2 MiB
NVLS_8 = 16 * 2 * 1 * MiB * 8  # 16 channels, 2 buffers of 128 KiB x 8 steps, 8 heads


def test_rings_grow_with_channels_and_nvls_with_the_node_and_release():
    assert communicator_bytes(ranks=1, channels=32) == 0
    assert communicator_bytes(ranks=8, channels=16) == 16 * PER_CHANNEL
    assert communicator_bytes(ranks=8, channels=32) == 32 * PER_CHANNEL  # 0.375 GiB
    assert communicator_bytes(ranks=8, channels=32, nvls_heads=2) == 32 * PER_CHANNEL  # NVLS wants 3 GPUs or more
    current = communicator_bytes(ranks=8, channels=32, nvls_heads=8)
    v221 = communicator_bytes(ranks=8, channels=32, nvls_heads=8, nvls_align_bytes=2 * MiB)
    assert current - 32 * PER_CHANNEL == NVLS_8 == 256 * MiB and v221 - 32 * PER_CHANNEL == 768 * MiB


def _workload(nproc: int, nodes: int = 1) -> Workload:
    return Workload(model="builtin:llama-tiny", seq_len=64, global_batch=128, nproc=nproc, nodes=nodes)


def test_each_layout_talks_through_its_own_groups():
    eight = _workload(8)
    assert communicators(TrialConfig(micro_batch=1), _workload(1)) == []
    assert communicators(TrialConfig(micro_batch=1), eight) == [Communicator(8, 8)]  # DDP: the world
    assert communicators(TrialConfig(micro_batch=1, fsdp="full"), eight) == [Communicator(8, 8)]
    # Tensor parallel innermost (consecutive ranks), data parallel across them.
    assert communicators(TrialConfig(micro_batch=1, tp=2, fsdp="full"), eight) == [
        Communicator(2, 2),
        Communicator(4, 4),
    ]
    # Hybrid on 2 nodes of 4: each shard group in one node, its replicas one a node.
    hybrid = communicators(TrialConfig(micro_batch=1, fsdp="hybrid"), _workload(8, nodes=2))
    assert hybrid == [Communicator(4, 4), Communicator(2, 1)]
    # Pipeline stages: a 2-rank communicator with each neighbour (two for a middle stage).
    assert communicators(TrialConfig(micro_batch=1, pp=4), _workload(4)) == [Communicator(2, 2)] * 2
    assert communicators(TrialConfig(micro_batch=1, pp=2), _workload(2)) == [Communicator(2, 2)]


def test_nvls_is_counted_on_hopper_nvswitch_nodes_only():
    fsdp8 = TrialConfig(micro_batch=1, fsdp="full")
    assert nccl_bytes(gpu_spec("H100-80GB"), fsdp8, _workload(8)) == 32 * PER_CHANNEL + NVLS_8
    assert nccl_bytes(gpu_spec("A100-80GB"), fsdp8, _workload(8)) == 16 * PER_CHANNEL  # NVSwitch, no multicast
    assert nccl_bytes(gpu_spec("MI300X"), fsdp8, _workload(8)) == 32 * PER_CHANNEL  # Infinity Fabric: no NVLS
    assert nccl_bytes(gpu_spec("L40S"), fsdp8, _workload(8)) == 2 * PER_CHANNEL  # PCIe
    # Llama-3.1-405B's FSDP 16 x TP 8 on 8-GPU nodes: TP in each node (rings and NVLS), FSDP one rank a node.
    split = TrialConfig(micro_batch=1, tp=8, fsdp="full")
    assert nccl_bytes(gpu_spec("H100-80GB"), split, _workload(128, nodes=16)) == 2 * 32 * PER_CHANNEL + NVLS_8
    assert nccl_bytes(None, fsdp8, _workload(8)) == 2 * PER_CHANNEL  # no card named: as over PCIe


def test_the_estimate_says_which_communicators_it_counted():
    h100 = gpu_spec("H100-80GB")
    hybrid = TrialConfig(micro_batch=1, fsdp="hybrid")
    assert describe_communicators(h100, hybrid, _workload(16, nodes=2)) == (
        "2 communicators: 8 ranks (NVLS over its 8 GPUs in a node), 2 ranks"
    )
    assert describe_communicators(gpu_spec("A100-80GB"), hybrid, _workload(16, nodes=2)) == (
        "2 communicators: 8 ranks, 2 ranks"
    )
    assert describe_communicators(h100, TrialConfig(micro_batch=1), _workload(2)) == "one communicator of 2 ranks"
    assert describe_communicators(h100, TrialConfig(micro_batch=1), _workload(1)) == ""
