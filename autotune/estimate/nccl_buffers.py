"""What NCCL holds on each GPU outside PyTorch's caching allocator: the buffers of every communicator the layout's
process groups talk through. nvidia-smi shows them; ``max_memory_reserved`` does not.

A communicator's buffers, from NCCL's sources (github.com/NVIDIA/nccl; master of 2026, the tags named below):
- Rings. A ring channel connects each rank to the next; each connection allocates the Simple, LL and LL128
  protocols' buffers (``computeBuffSizes`` in ``src/init.cc``, the sizes in ``src/include/device.h``; one side of
  each connection holds them, ``p2pSendSetup`` / ``p2pRecvSetup`` in ``src/transport/p2p.cc``, ``net.cc`` across
  nodes), each rounded up to cuMem's 2 MiB granularity (cuMem is on by default): 12 MiB a connection. NCCL's own
  ALLOC log on 8 H100s shows 12 MiB too, as a 10 MiB and a 2 MiB allocation per P2P/CUMEM connection, and 32
  channels between a pair of GPUs (NVIDIA/nccl issue 1685, Apr 2025).
- NVLS (NVLink SHARP: Hopper on an NVSwitch node) for a communicator with more than 2 GPUs in one node:
  ``nvlsChannels x 2 x NVLS_CHUNKSIZE x NCCL_STEPS`` per head rank, one head per local rank
  (``ncclNvlsBufferSetup``, ``src/transport/nvls.cc``, the same since v2.22.3: PyTorch 2.7 on): 256 MiB on 8
  Hoppers. Older NCCLs held more: v2.21.5 (PyTorch 2.5, 2.6) took every channel of the communicator and a 2 MiB
  alignment each (``comm->nChannels x 2 x (1 MiB + 2 MiB)`` per head), v2.20.5 (PyTorch 2.4) NCCL_BUFFSIZE instead
  of the chunk (``x (4 MiB + 2 MiB)``): 2,304 MiB on 8 H200s at 24 channels, the ``nvlsTotalSize`` NCCL's own log
  printed there (vllm-project/vllm issue 9699, Oct 2024).
- Left out: trees (all-reduce across nodes), CollNet, the proxy's host memory, NVLS's credits, and the rounding of
  NVLS's buffers up to the driver's recommended multicast granularity (``nvlsAllocateMem``), whose size no source
  read here states. A communicator no collective uses connects nothing (NCCL_RUNTIME_CONNECT, on by default since
  v2.22): the default group beside a mesh's groups is not counted.

The channels NCCL picks depend on the topology it finds; taken here as 32 for NVLink on Hopper (as that log shows),
16 before it and 2 over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config.gpus import GpuSpec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers import PIPELINE, TENSOR_PARALLEL

__all__ = ["Communicator", "communicator_bytes", "communicators", "describe_communicators", "nccl_bytes"]

_MiB = 2**20
NCCL_SIMPLE_BYTES = 4 * _MiB  # DEFAULT_BUFFSIZE, NCCL_BUFFSIZE's default
NCCL_LL128_BYTES = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8
NCCL_LL_BYTES = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x 16
_CUMEM_GRANULARITY = 2 * _MiB
_NVLS_CHANNELS_SM90 = 16  # NVLS_NCHANNELS_SM90
_NVLS_BUFFER = 128 * 1024 * 8  # NVLS_CHUNKSIZE x NCCL_STEPS
_NVLS_GPUS = 3  # NVLS runs for a communicator with more GPUs in one node than 2 (ncclNvlsInit)
_NVLINK = 64 * 10**9  # links faster than a PCIe Gen5 x16 are NVLink (or Infinity Fabric)


@dataclass(frozen=True)
class Communicator:
    """One process group's NCCL communicator as one rank sees it: its ranks, and how many of them share this
    rank's node."""

    ranks: int
    in_node: int


def communicator_bytes(*, ranks: int, channels: int, nvls_heads: int = 0, nvls_align_bytes: int = 0) -> int:
    """One communicator's device memory on each of its ranks: a connection of every ring channel, and NVLS's
    buffers for ``nvls_heads`` local ranks where it runs (more than 2). ``nvls_align_bytes``: 0 in current NCCL,
    2 MiB in v2.21. 0 for one rank: it talks to no one."""
    if ranks <= 1:
        return 0
    per_connection = sum(
        -(-size // _CUMEM_GRANULARITY) * _CUMEM_GRANULARITY
        for size in (NCCL_SIMPLE_BYTES, NCCL_LL_BYTES, NCCL_LL128_BYTES)
    )
    nvls = _NVLS_CHANNELS_SM90 * 2 * (_NVLS_BUFFER + nvls_align_bytes) * nvls_heads if nvls_heads >= _NVLS_GPUS else 0
    return channels * per_connection + nvls


def communicators(config: TrialConfig, workload: Workload) -> list[Communicator]:
    """The communicators each rank of ``config`` talks through, ranks laid out as torchtitan's and autotune's meshes
    order them (pipeline stages outermost, then replicas, shards, tensor-parallel ranks innermost) and numbered by
    torchrun node after node. A group whose ranks are ``stride`` apart has ``ranks_per_node // stride`` of them in
    one node. Pipeline stages talk to their neighbours only (a 2-rank communicator each way, its channels taken as a
    ring's: NCCL gives a peer at most those)."""
    if workload.nproc <= 1:
        return []
    per_node = workload.ranks_per_node
    groups: list[tuple[int, int]] = []  # (ranks, stride)
    stride = 1
    for size in (TENSOR_PARALLEL.model_ranks(config), *_data_parallel_groups(config, workload)):
        groups.append((size, stride))
        stride *= size
    groups += [(2, stride)] * min(2, PIPELINE.model_ranks(config) - 1)  # the stage before and the stage after
    return [Communicator(ranks, max(1, min(ranks, per_node // stride))) for ranks, stride in groups if ranks > 1]


def nccl_bytes(card: GpuSpec | None, config: TrialConfig, workload: Workload) -> int:
    """NCCL's device memory on each rank: every communicator of the layout (:func:`communicators`)."""
    nvlink = card is not None and card.link_bandwidth > _NVLINK
    channels = (32 if card is not None and card.compute_capability[0] >= 9 else 16) if nvlink else 2
    return sum(
        communicator_bytes(ranks=group.ranks, channels=channels, nvls_heads=_nvls_heads(card, group))
        for group in communicators(config, workload)
    )


def describe_communicators(card: GpuSpec | None, config: TrialConfig, workload: Workload) -> str:
    """What :func:`nccl_bytes` counted, in words: "2 communicators: 8 ranks (NVLS over its 8 GPUs in a node), 2
    ranks"; "" for one rank."""
    heads = [(group.ranks, _nvls_heads(card, group)) for group in communicators(config, workload)]
    groups = [f"{ranks} ranks" + (f" (NVLS over its {nvls} GPUs in a node)" if nvls else "") for ranks, nvls in heads]
    if len(groups) <= 1:
        return f"one communicator of {groups[0]}" if groups else ""
    return f"{len(groups)} communicators: {', '.join(groups)}"


def _nvls_heads(card: GpuSpec | None, group: Communicator) -> int:
    """The GPUs of the group in this rank's node that NVLS's buffers are for: 0 where NVLS does not run (no
    multicast on the card's node, or too few of the group's GPUs there)."""
    multicast = card is not None and card.nvlink_multicast
    return group.in_node if multicast and group.in_node >= _NVLS_GPUS else 0


def _data_parallel_groups(config: TrialConfig, workload: Workload) -> tuple[int, ...]:
    """The data-parallel groups inner first: hybrid sharding's shard group and its replicas, else one group."""
    replicas = config.replicate_degree(workload)
    if replicas > 1:
        return config.shard_degree(workload), replicas
    return (config.data_parallel(workload),)
