"""The rates a named card (``--gpu``) is timed at when it is not here: what it sustains through a training run
against its published peaks, each with its source (a measurement, a paper, NCCL's code), or said to be a guess.
:func:`autotune.estimate.step_time.card_profile` builds a card's roofline from them and the card's specs
(:mod:`autotune.config.gpus`).
"""

from __future__ import annotations

# Matmul FLOP/s a card sustains through a training run, over its dense peak. A matmul that keeps the
# card busy draws it to its power limit, and the clock settles below boost: the burst a short benchmark
# catches (the "maximum achievable matmul FLOPS", MAMF) is not what a run of back-to-back steps holds.
# S. Bekman's mamf-finder measures both (ml-engineering, compute/accelerator/benchmarks/README.md, "How
# MAMF and MSMF are defined"); its MSMF, "the steady rate under full load, which matches real training
# throughput", is what is used here:
# - H100 SXM and H200: 745 of 989 TFLOP/s bf16 (75.3%): an H200's MSMF, 743-746 over five runs (GPU0
#   alone 744.8, all 8 GPUs busy 755.5; its burst MAMF 848). The H100 SXM is the same GH100 chip at the
#   same 1,830 MHz, 989 TFLOP/s and 700 W (the MAMF table: "H200 is the same" as the H100's 794.5).
# - A100 SXM (both memories): 257 of 312 (82.4%): no MSMF is published for it; H. He measured cuBLAS's
#   8192^3 bf16 matmul on one at 257 TFLOP/s with random inputs, 295 with zeros, the card held to its
#   400 W ("Strangely, Matrix Multiplications on GPUs Run Faster When Given 'Predictable' Data",
#   thonking.ai, 2024); its MAMF is 271.2 (86.9%).
# - MI300X: 781.9 of 1,300 (60.1%, MAMF on ROCm 6.2), which mamf-finder's notes call power-capped
#   already ("the card hits its 750 W cap within one BF16 kernel").
# - H100-96GB-HBM2e (torchtitan's Grand Teton H100s at their 500 W limit): no measurement is published, nor its
#   peak (torchtitan: "between SXM and NVL"; autotune.config.gpus gives the SXM's). It takes the H100 SXM's 745 of
#   989, the same GH100 chip's sustained rate, measured at 700 W; at 500 W the clock holds lower, by an amount no
#   source measures, so this is likely above what the card sustains.
# Cards without a measurement take 80%, between the A100's and the H100's: a guess.
SUSTAINED = {
    "A100-40GB": 257 / 312,
    "A100-80GB": 257 / 312,
    "H100-80GB": 745 / 989,
    "H200": 745 / 989,
    "H100-96GB-HBM2e": 745 / 989,
    "MI300X": 781.9 / 1300,
}
SUSTAINED_UNMEASURED = 0.8
# Small and thin matmuls fall short of the large ones: XLA's measured sm_90 table (72 bf16 shapes on an
# H100, b x m x n x k from 1x256x512x256 at 11.5 TFLOP/s to 1x4096^3 at 783; xla/service/gpu/model/
# matmul_interpolator_data.h) fits time = max(FLOPs / MAMF, bytes / (80% of HBM's bandwidth)) + 6 us
# with a root-mean-square error of 9.5% (the worst shape 33%); see bench/README.md. XLA times short
# bursts (its large shapes reach MAMF); a training run holds the sustained rate above instead.
GPU_KERNEL_S = 6e-6
GPU_BANDWIDTH_EFFICIENCY = 0.8
# Fused attention reaches less of the peak than a matmul: FlashAttention-2 "50-73% of the theoretical
# maximum FLOPs/s on A100" (Dao, 2023), "only 35% utilization on H100" (FlashAttention-3, Shah et al.,
# 2024); PyTorch's flash SDPA kernel is FlashAttention-2. Elsewhere half the peak, a guess.
ATTENTION_SHARE = {8: 0.6, 9: 0.35}
ATTENTION_UNMEASURED = 0.5
# Eager PyTorch's memory-bound kernels in a training step run well under a large copy's rate. Measured on an H200
# (bench/gpu_step_parts.py; torch 2.11, CUDA 13; bench/results/gpu_step_parts_NVIDIA_H200.txt), each kernel put
# in the step-time model's kinds by its name and the traced bytes of those kinds over the kernels' time, after
# GPU_KERNEL_S a launch: the forward's and backward's other kernels 53%, 54% and 63% of HBM's 4.8 TB/s
# (MPT-760m mb24, MPT-1b mb14, Llama-3.2-3B seq 8192 ckpt), foreach AdamW's 57% in all three; a lone bf16 add
# reached 90% (4.30 TB/s). The compiled MPT-1b's Triton kernels came within 6% of GPU_BANDWIDTH_EFFICIENCY: a
# compiled phase keeps it. Hopper only (compute capability 9), where it was measured: the V100 rows of
# bench/plan_published.py, within 6% at 80%, would read 10-20% slow at 57%, and no A100 was measured.
EAGER_BANDWIDTH = {9: 0.57}
# Eager PyTorch's host time per operator (Python, dispatcher, launch): a few microseconds to ten;
# on a GPU it only shows where kernels are shorter (small models, small micro batches).
GPU_DISPATCH_S = 8e-6
LINK_EFFICIENCY = 0.75  # NCCL's bus bandwidth over the link's, on large messages
# The network between the nodes of a GPU here (probed, not a named card): a DGX H100's, one 400 Gb/s InfiniBand
# port a GPU (a named card's network is its own: autotune.config.gpus).
INFINIBAND = 50e9

# A collective that overlaps the compute holds SMs while it runs: NCCL launches its kernel with one CTA per
# channel (src/enqueue.cc, ncclLaunchKernel: `dim3 grid = {(unsigned)plan->channelCount, 1, 1}`, NCCL v2.18.1),
# and an all-gather or reduce-scatter of FSDP's size (tens to hundreds of MB a layer) runs on every channel
# (getAlgoInfo in src/enqueue.cc drops channels only below nChannels x 512 threads x 64 bytes, under 1 MB; NCCL
# 2.18 runs both on rings only, src/graph/tuning.cc). The compute overlapped with it runs on the other SMs.
# Within one 8-GPU NVSwitch node NCCL 2.18 builds 24 ring channels on an A100 and on an H100: the topology
# search (src/graph/search.cc, ncclTopoCompute) fills each GPU's NVLink bandwidth (src/graph/topo.cc: links x
# SM80_NVLINK_BW or SM90_NVLINK_BW, both 20 GB/s in src/graph/topo.h: 12 x 20 = 240 on an A100, 18 x 20 = 360
# on an H100) with rings at the first speed of its array (speedArrayIntra's 40 GB/s; sm90SpeedArrayIntra's 60):
# 6 channels on either card; it doubles them at its end (12), and ncclTopoPostset doubles them again (24;
# src/graph/connect.cc), with NCCL_MIN_NCHANNELS and NCCL_MAX_NCHANNELS unset (NVIDIA/nccl tags v2.18.1-1 and
# v2.18.3-1; v2.20.5-1's search still ends at 6 x 60 on an H100). An HGX A100's NCCL log prints "Channel 23/24"
# (NVIDIA/nccl-tests issue #100). llm-foundry's 2023 image ran PyTorch 2.1 (cu121), whose wheel requires
# nvidia-nccl-cu12==2.18.1. From NCCL 2.19 an H100 node may run them with NVLS instead (16 channels,
# NCCL_NVLS_NCHANNELS's default in src/transport/nvls.cc), not modelled. Across nodes the channels follow the
# NICs: not modelled either (no contention counted).
NCCL_RING_CHANNELS = 24
# The SMs of the cards whose NVLink count gives those channels: A100 SXM 108 (NVIDIA A100 Tensor Core GPU
# Architecture whitepaper, 2020: "108 SMs"), H100 SXM5 132 (NVIDIA H100 Tensor Core GPU Architecture whitepaper,
# 2022: "132 SMs" on the SXM5 board); the H200 is the same GH100 at 132 SMs and 18 NVLinks (NVIDIA H200 datasheet:
# NVLink 900 GB/s, the H100 SXM's). Other cards (the H100-96GB-HBM2e, whose SMs and links no source gives): none.
SMS = {"A100-40GB": 108, "A100-80GB": 108, "H100-80GB": 132, "H200": 132}
