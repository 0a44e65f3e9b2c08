"""The GPUs a CUDA workload can be planned for without one here: ``--gpu NAME``.

Each card's memory is what ``nvidia-smi`` shows as its total (MiB); FLOP/s are the vendors'
dense peaks (no 2:4 sparsity), bandwidths the vendors' figures. They are what a prediction
for a card this machine does not have starts from; a card that is present is measured instead.

``context_bytes`` is what a process holds on the card before its first tensor: the CUDA context,
its kernels and PyTorch's own (``nvidia-smi`` minus ``max_memory_reserved``). It depends on the
driver, the CUDA version and how many kernels get loaded. Since CUDA 11.7 kernels load lazily
(PyTorch's default), and reports run 287-426 MiB (PyTorch PR 86509: 287 MB lazy against 667 MB
eager; maintainers' answers in PyTorch issues 107667 and 109888: "~300MB", "around 400MB"; 426 MiB
on an RTX 6000 Ada with torch 2.10 and CUDA 13): 400 MiB is the typical figure here, except
where a source measured the card itself (said beside the value).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.config.device import DeviceInfo
from autotune.errors import WorkloadError

if TYPE_CHECKING:
    from autotune.config.workload import Workload

__all__ = ["GpuSpec", "GPUS", "gpu_spec", "gpu_names", "device_info", "on_card_nodes"]

_MiB = 2**20
_T = 10**12
_G = 10**9
_TYPICAL_CONTEXT = 400 * _MiB  # see the module's docstring


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One card: memory, compute capability, dense peaks per dtype, memory and link bandwidth."""

    name: str
    memory_bytes: int  # nvidia-smi's total
    compute_capability: tuple[int, int]
    bf16_flops: float | None  # dense tensor-core peak; None: no bf16 tensor cores
    fp16_flops: float
    tf32_flops: float | None  # None: no tf32 (before Ampere)
    fp32_flops: float
    memory_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s per GPU, one direction, to its peers (NVLink or PCIe)
    host_link_bandwidth: float  # bytes/s per GPU, one direction, to host memory (its PCIe generation, x16)
    context_bytes: int  # the CUDA context and kernels, before any tensor
    # The node such cards come in (see _CARDS' sources): how many share one node's links, and the network
    # between nodes, in bytes/s per GPU, one direction (the node's compute-fabric ports over its GPUs).
    gpus_per_node: int
    network_bandwidth: float
    fp8_flops: float | None = None  # dense float8 tensor-core peak (fp32 accumulation); None: no float8 cores
    # NVLink SHARP's multicast in the reference node: Hopper on NVSwitch (HGX and DGX H100/H200, and Grand Teton),
    # where NCCL allocates NVLS buffers (autotune.estimate.nccl_buffers). NCCL asks the driver
    # (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, ncclNvlsInit): Ampere's NVSwitch and AMD's links have none.
    nvlink_multicast: bool = False

    @property
    def bf16(self) -> bool:
        return self.bf16_flops is not None

    @property
    def flash_attention(self) -> bool:
        """PyTorch's flash SDPA kernel needs sm80 or newer (Ampere, Ada, Hopper)."""
        return self.compute_capability >= (8, 0)

    def flash_trains_head_size(self, head_size: int) -> bool:
        """Flash's backward on sm86/sm89 (the consumer and workstation Ampere/Ada parts) stops at
        head size 192 (sdp_utils.cpp); elsewhere at 256."""
        limit = 192 if self.compute_capability in ((8, 6), (8, 9)) else 256
        return self.flash_attention and head_size <= limit

    def cublas_workspace_bytes(self) -> int:
        """What PyTorch gives cuBLAS per handle by default (CublasHandlePool.cpp): ``:4096:8`` on Hopper,
        ``:4096:2:16:8`` before it."""
        return 4096 * 1024 * 8 if self.compute_capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


# Sources: NVIDIA's data sheets (V100, A100, H100, H200, L40S, RTX 4090 / Ada whitepaper) and AMD's
# MI300X data sheet; dense peaks, the tensor-core figures with fp32 accumulation (float8: half the sheets'
# figures "with sparsity"; the RTX 4090's 330 TFLOP/s is the Ada whitepaper's with FP32 accumulate, which
# torch._scaled_mm uses). Links: NVLink per direction (V100 NVLink2 300 GB/s both ways, A100 NVLink3 600,
# H100/H200 NVLink4 900, MI300X Infinity Fabric 896), PCIe x16 per direction for the host (Gen3 16 GB/s,
# Gen4 32, Gen5 64).
# Nodes: each card's reference system, its GPUs and its compute fabric's ports (Gb/s over 8 bits, over its GPUs):
# - V100: NVIDIA DGX-1 (V100), 8 GPUs, four 100 Gb/s EDR InfiniBand ports (its data sheet): 6.25 GB/s per GPU. A
#   DGX-2's 16 V100s with eight such ports give the same per GPU: --gpus-per-node 16.
# - A100: NVIDIA DGX A100, 8 GPUs, eight single-port 200 Gb/s HDR ConnectX-6 for the compute fabric (its user
#   guide, "Introduction to the NVIDIA DGX A100 System"): 25 GB/s per GPU.
# - H100, H200: NVIDIA DGX H100/H200, 8 GPUs, eight single-port 400 Gb/s NDR ConnectX-7 (its user guide): 50 GB/s.
# - H100-96GB-HBM2e: Meta's Grand Teton, 8 GPUs, "backend RDMA network with 400 Gb/s per GPU" (torchtitan's
#   benchmark notes, quoted at the card): 50 GB/s.
# - MI300X: the 8-GPU OAM platform, one 400 Gb/s InfiniBand port per GPU as Azure's ND MI300X v5 has: 50 GB/s.
# - L40S: PCIe servers without NVLink; AWS's g6e.48xlarge, 8 GPUs on 400 Gb/s of EFA: 6.25 GB/s per GPU.
# - RTX 4090: no reference system; a workstation server of 8 on one 100 Gb/s port, a guess: 1.5625 GB/s.
_CARDS = (
    GpuSpec(
        name="V100-16GB",
        memory_bytes=16_160 * _MiB,
        compute_capability=(7, 0),
        bf16_flops=None,
        fp16_flops=125 * _T,
        tf32_flops=None,
        fp32_flops=15.7 * _T,
        memory_bandwidth=900 * _G,
        link_bandwidth=150 * _G,
        host_link_bandwidth=16 * _G,
        # measured: Transformers' docs ("model memory anatomy") saw 1,343 MiB used by a process
        # that had loaded PyTorch's kernels and one tiny tensor on a V100 (CUDA 11.2: before
        # lazy loading, so every kernel was loaded)
        context_bytes=1_343 * _MiB,
        gpus_per_node=8,
        network_bandwidth=6.25 * _G,
    ),
    GpuSpec(
        name="V100-32GB",
        memory_bytes=32_510 * _MiB,
        compute_capability=(7, 0),
        bf16_flops=None,
        fp16_flops=125 * _T,
        tf32_flops=None,
        fp32_flops=15.7 * _T,
        memory_bandwidth=900 * _G,
        link_bandwidth=150 * _G,
        host_link_bandwidth=16 * _G,
        context_bytes=1_343 * _MiB,
        gpus_per_node=8,
        network_bandwidth=6.25 * _G,
    ),
    GpuSpec(
        name="A100-40GB",
        memory_bytes=40_960 * _MiB,
        compute_capability=(8, 0),
        bf16_flops=312 * _T,
        fp16_flops=312 * _T,
        tf32_flops=156 * _T,
        fp32_flops=19.5 * _T,
        memory_bandwidth=1_555 * _G,
        link_bandwidth=300 * _G,
        host_link_bandwidth=32 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=25 * _G,
    ),
    GpuSpec(
        name="A100-80GB",
        memory_bytes=81_920 * _MiB,
        compute_capability=(8, 0),
        bf16_flops=312 * _T,
        fp16_flops=312 * _T,
        tf32_flops=156 * _T,
        fp32_flops=19.5 * _T,
        memory_bandwidth=2_039 * _G,
        link_bandwidth=300 * _G,
        host_link_bandwidth=32 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=25 * _G,
    ),
    GpuSpec(
        name="H100-80GB",
        memory_bytes=81_559 * _MiB,
        compute_capability=(9, 0),
        bf16_flops=989 * _T,
        fp16_flops=989 * _T,
        tf32_flops=495 * _T,
        fp32_flops=67 * _T,
        memory_bandwidth=3_350 * _G,
        link_bandwidth=450 * _G,
        host_link_bandwidth=64 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=50 * _G,
        fp8_flops=1_979 * _T,
        nvlink_multicast=True,
    ),
    # The H100 torchtitan's published runs used (its Llama 3.1 benchmarks of Dec 2024 and async-TP notes of Jun 2025,
    # pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md and asyncTP_llama3_h100_2025-06_torchtitan.md):
    # "We ran our performance benchmarks on the Grand Teton platform, where - Each host has 8 NVIDIA H100 GPUs fully
    # connected with NVLink. - Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth.
    # - Hosts are inter-connected with backend RDMA network with 400 Gb/s per GPU. - We used the default 500W power
    # limit, although tuning it up to 700W TDP can potentially provide further speedups." and its footnote: "In our
    # test we used HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs number is between SXM and NVL, and we
    # don't know its exact value. So this MFU number is lower than actual MFU because we use the peak number of SXM
    # directly." No NVIDIA data sheet lists this part.
    # - memory: 97,871 MiB, derived (no nvidia-smi reading of the card is published). torchtitan's notes of Jan 2025
    #   (docs/performance.md at e6fcb96) say "NVIDIA H100 GPUs[^1] with 95 GiB memory"; its logs print the reserved peak
    #   in GiB and as a percentage of torch.cuda.get_device_properties().total_memory, and those of 8-H100 runs on
    #   95 GiB cards (torchao's docs/source/eager_tutorials/pretraining.rst, "30.99GiB(32.62%)" and five more lines;
    #   torchtitan's graph_trainer notes, "48.87GiB(51.44%)") bound that total to 97,270-97,303 MiB. The H20, the
    #   other 96 GB Hopper part, reports 97,285 MiB there ("total_memory=97285MB", a torch printout) and 97,871 MiB
    #   in nvidia-smi ("97871MiB"): the same total_memory, so nvidia-smi's total is taken as the H20's.
    # - compute capability 9.0: an H100 (GH100, Hopper).
    # - FLOP/s: the peak is "between SXM and NVL" and not known (above). Those given are the H100 SXM's dense peaks,
    #   the top of that range and what torchtitan counts its MFU against (torchtitan/tools/utils.py get_peak_flops:
    #   989e12 "for H100 SXM and other variants"); the NVL's, its bottom (NVIDIA's H100 data sheet, halved "with
    #   sparsity" figures): bf16/fp16 835.5, tf32 417.5, fp32 60, fp8 1,670.5. What a run sustains under the 500 W limit
    #   is in autotune.estimate.step_time's _SUSTAINED.
    # - memory bandwidth: "2.4 TB/sec peak memory bandwidth" (torchtitan, above).
    # - links: NVLink within the host (torchtitan: "fully connected with NVLink"; its Jan 2025 notes: "8 GPUs and
    #   NVSwitch"), its rate not stated: the SXM H100's NVLink4, 900 GB/s both ways, and its PCIe Gen5 x16 to the host.
    # - node: 8 GPUs, 400 Gb/s of RDMA network per GPU (torchtitan, above): 50 GB/s.
    GpuSpec(
        name="H100-96GB-HBM2e",
        memory_bytes=97_871 * _MiB,
        compute_capability=(9, 0),
        bf16_flops=989 * _T,
        fp16_flops=989 * _T,
        tf32_flops=495 * _T,
        fp32_flops=67 * _T,
        memory_bandwidth=2_400 * _G,
        link_bandwidth=450 * _G,
        host_link_bandwidth=64 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=50 * _G,
        fp8_flops=1_979 * _T,
        nvlink_multicast=True,
    ),
    GpuSpec(
        name="H200",
        memory_bytes=143_771 * _MiB,
        compute_capability=(9, 0),
        bf16_flops=989 * _T,
        fp16_flops=989 * _T,
        tf32_flops=495 * _T,
        fp32_flops=67 * _T,
        memory_bandwidth=4_800 * _G,
        link_bandwidth=450 * _G,
        host_link_bandwidth=64 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=50 * _G,
        fp8_flops=1_979 * _T,
        nvlink_multicast=True,
    ),
    GpuSpec(
        name="L40S",
        memory_bytes=46_068 * _MiB,
        compute_capability=(8, 9),
        bf16_flops=362 * _T,
        fp16_flops=362 * _T,
        tf32_flops=183 * _T,
        fp32_flops=91.6 * _T,
        memory_bandwidth=864 * _G,
        link_bandwidth=32 * _G,
        host_link_bandwidth=32 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=6.25 * _G,
        fp8_flops=733 * _T,
    ),
    GpuSpec(
        name="RTX-4090",
        memory_bytes=24_564 * _MiB,
        compute_capability=(8, 9),
        bf16_flops=165 * _T,
        fp16_flops=165 * _T,
        tf32_flops=82.6 * _T,
        fp32_flops=82.6 * _T,
        memory_bandwidth=1_008 * _G,
        link_bandwidth=32 * _G,
        host_link_bandwidth=32 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=1.5625 * _G,
        fp8_flops=330 * _T,
    ),
    GpuSpec(
        name="MI300X",
        memory_bytes=196_592 * _MiB,
        compute_capability=(9, 4),
        bf16_flops=1_307 * _T,
        fp16_flops=1_307 * _T,
        tf32_flops=654 * _T,
        fp32_flops=163 * _T,
        memory_bandwidth=5_300 * _G,
        link_bandwidth=448 * _G,
        host_link_bandwidth=64 * _G,
        context_bytes=_TYPICAL_CONTEXT,
        gpus_per_node=8,
        network_bandwidth=50 * _G,
        fp8_flops=2_615 * _T,
    ),
)
GPUS: dict[str, GpuSpec] = {card.name: card for card in _CARDS}


def gpu_names() -> list[str]:
    return list(GPUS)


def gpu_spec(name: str) -> GpuSpec:
    """The card named ``name`` (case does not matter); refuses an unknown name with the known ones."""
    for card in _CARDS:
        if card.name.lower() == name.strip().lower():
            return card
    # The chip's name first ("H200-141GB" means the H200, not the V100-16GB that spells most alike).
    typed = name.strip().upper()
    model = typed.split("-")[0]
    close = [card for card in GPUS if card.upper().split("-")[0] == model]
    # "H100-96GB" means the H100-96GB-HBM2e: a card whose name starts with what was typed comes first.
    close = [card for card in close if card.upper().startswith(typed)] or close
    close = close or difflib.get_close_matches(name.upper(), list(GPUS), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise WorkloadError(f"--gpu {name!r} is not a known card{hint}; use one of {', '.join(GPUS)}")


def device_info(card: GpuSpec, *, count: int = 1) -> DeviceInfo:
    """What the rest of autotune knows of a device, for a card that is not here."""
    return DeviceInfo(
        "cuda",
        card.name,
        count,
        card.memory_bytes,
        bf16=card.bf16,
        fp16_deepspeed=True,
        compute_capability=card.compute_capability,
    )


def on_card_nodes(workload: Workload, gpus_per_node: int | None = None) -> Workload:
    """``workload`` for its named card (``--gpu``) on the nodes its ranks fill: ``gpus_per_node`` GPUs each
    (``--gpus-per-node``), else the card's reference node's (8 for a DGX H100). Nodes the workload names already
    (``--nodes``) stay. Where the nodes are is what a plan prices between them (the network), and what hybrid
    sharding's groups default to (one node's ranks)."""
    if gpus_per_node is not None and (
        not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1
    ):
        raise WorkloadError(f"--gpus-per-node {gpus_per_node!r} must be a whole number of at least 1")
    if workload.gpu is None:
        if gpus_per_node is not None:
            raise WorkloadError(
                "--gpus-per-node sizes the nodes of a card planned for; add --gpu CARD, or leave it out"
            )
        return workload
    nproc, nodes = workload.nproc, workload.nodes
    if nodes > 1:
        if gpus_per_node is not None and gpus_per_node * nodes != nproc:
            raise WorkloadError(
                f"--nodes {nodes} of --gpus-per-node {gpus_per_node} hold {nodes * gpus_per_node} GPUs, not "
                f"--nproc {nproc}; give one of --nodes and --gpus-per-node"
            )
        return workload
    card = gpu_spec(workload.gpu)
    per_node = gpus_per_node or card.gpus_per_node
    if nproc <= per_node:
        return workload
    if nproc % per_node:
        source = f"--gpus-per-node {per_node}" if gpus_per_node else f"the {card.name}'s node; --gpus-per-node sets it"
        raise WorkloadError(
            f"--nproc {nproc} does not fill nodes of {per_node} GPUs ({source}); use a multiple of {per_node}, "
            f"or --gpus-per-node N with N dividing {nproc}"
        )
    return workload.replace(nodes=nproc // per_node)
