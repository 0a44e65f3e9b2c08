"""How long a config's optimizer step takes on a device: the traced operators against its roofline.

Each operator of the traced step (:mod:`autotune.estimate.step_costs`) takes the longer of its FLOPs
over the device's achievable FLOP/s for its dtype and its bytes over the achievable memory
bandwidth, plus a fixed time per kernel. The host issues one operator after another (eager
PyTorch): on a GPU that runs ahead of the device, so a step takes the longer of the device's work
and the host's; on a CPU the host *is* the device, so they add. A step is the micro steps (each
forward and backward, recomputation included, as traced) times the accumulation, then the
optimizer's update, then the communication no framework hides:

* DDP: one all-reduce of the gradients per step (the micro steps before the last skip it), overlapped
  with the last backward but for its last bucket;
* FSDP2: the collectives traced on its fake process group (all-gathers, reduce-scatters), overlapped
  with the compute but for the first layer's gather; hybrid sharding's gathers and reduce-scatters span its
  shard group (one node's links) and its gradients' all-reduce the replicas (the network between nodes);
* DeepSpeed ZeRO-1/2: a reduce-scatter of the gradients and an all-gather of the weights per step,
  not overlapped (``overlap_comm`` is off in the configs autotune writes); ZeRO-3 also gathers the
  weights in each forward and backward, overlapped (its default);
* offload: gradients down and weights up the host link, and the optimizer step on the host.

A collective that runs beside the compute holds some of the card's SMs (NCCL's kernel, one CTA per channel):
the compute overlapped with it runs on the rest, on a named card whose NCCL channels within a node are known
(see :data:`autotune.estimate.gpu_rates.NCCL_RING_CHANNELS`).

``torch.compile`` is timed from the same (eager) trace: each chain of elementwise operators, where
one reads what the one before it wrote, runs as one kernel, as Inductor fuses them: it reads the chain
head's inputs and every other tensor the chain reads from memory, and writes what the chain's last
operator writes (the tensors between them never go through memory); matmuls and attention stay as they
are.

Where the device profile comes from (:class:`DeviceProfile`): measured by the device probe on a
device that is here; for a named card (``--gpu``) that is not, the card's published peaks with
two measured efficiencies, see :func:`card_profile`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from autotune.config.knobs import sixteen_bit_type
from autotune.estimate import gpu_rates as rates
from autotune.estimate.step_costs import ATTENTION, BACKWARD, COLLECTIVE, FUSED, MATMUL, OTHER, UPDATE
from autotune.levers.grad_reduction import reducing_micro_steps

if TYPE_CHECKING:
    from autotune.config.gpus import GpuSpec
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_costs import StepCosts

__all__ = [
    "DeviceProfile",
    "StepTime",
    "card_profile",
    "matmul_floor_s",
    "matmul_speedups",
    "profile_for",
    "predict_step_time",
]

_DDP_BUCKET = 25 * 2**20  # DDP's last bucket is all-reduced after the backward ends
_HOST_ADAM_BYTES = 28  # per parameter: fp32 weight, gradient, m, v read; weight, m, v written
_HOST_BANDWIDTH = 50e9  # a host's memory bandwidth for the offloaded optimizer step
_NOT_HIDDEN = 0.05  # of overlapped communication: the first gather, the last reduce
# One NCCL collective's latency with DeepSpeed's host work around it: tens of microseconds (a guess
# in that range; a CPU's gloo collective is measured by the device probe instead).
_GPU_COLLECTIVE_S = 50e-6
_DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default bucket, in elements, without a hidden size


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """What a device achieves: the roofline each operator is timed against."""

    name: str
    type: str  # "cuda" or "cpu"
    matmul_flops: dict[str, float]  # dtype (float32, tf32, bfloat16, float16) -> achievable FLOP/s
    memory_bandwidth: float  # achievable bytes/s
    kernel_s: float  # fixed device time per kernel
    dispatch_s: float  # host time per operator
    link_bandwidth: float  # bytes/s between ranks (one direction)
    host_link_bandwidth: float  # bytes/s to and from host memory (offload)
    peak_flops: float | None = None  # what MFU counts against (dense bf16 on a GPU)
    collective_s: float | None = None  # one small collective between ranks, beyond its bytes
    attention_efficiency: float | None = None  # fused attention's FLOP/s over the matmuls' (None: as a matmul)
    network_bandwidth: float | None = None  # bytes/s per rank between nodes (None: a CPU's ranks share one machine)
    # The share of the SMs a collective's kernel holds within one node while it overlaps the compute (None: not
    # modelled, the compute runs at its full rate beside it)
    collective_sm_share: float | None = None
    # Bytes/s of eager PyTorch's memory-bound kernels (elementwise, reductions, norms, copies, foreach optimizer
    # steps), which fall short of a large copy's rate (None: memory_bandwidth's)
    eager_bandwidth: float | None = None
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.name}'s roofline ({self.source})"

    def between_nodes(self) -> float | None:
        """Bytes/s a rank moves to another node: a named card's network, else a DGX H100's for a GPU here; None
        for a CPU, whose ranks share one machine."""
        if self.network_bandwidth is not None or self.type != "cuda":
            return self.network_bandwidth
        return rates.INFINIBAND * rates.LINK_EFFICIENCY

    def nodes(self, workload: Workload) -> str:
        """Where ``workload``'s ranks are, as its collectives are timed: "" on one node."""
        if workload.nodes == 1:
            return ""
        network = self.between_nodes()
        between = f", {network / 1e9:.3g} GB/s a rank between them (NCCL's share of the network)" if network else ""
        return f"{workload.nodes} nodes of {workload.ranks_per_node} ranks{between}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step of one config, predicted; its parts add up to ``step_s``."""

    step_s: float
    compute_s: float  # the micro steps' forwards and backwards (with what the collectives' SMs displace)
    update_s: float  # the optimizer step
    communication_s: float  # not hidden by the compute
    offload_s: float  # host transfers and the host's optimizer step
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float | None  # model FLOPs (3x forward) per second over the device's peak
    collective_sms_s: float = 0.0  # of compute_s: its slowdown on the SMs the overlapped collectives hold

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def card_profile(card: GpuSpec) -> DeviceProfile:
    """A card that is not here: its published peaks, at the efficiencies measured on such cards."""
    efficiency = rates.SUSTAINED.get(card.name, rates.SUSTAINED_UNMEASURED)
    flops = {"float32": card.fp32_flops * efficiency, "float16": card.fp16_flops * efficiency}
    if card.bf16_flops is not None:
        flops["bfloat16"] = card.bf16_flops * efficiency
    if card.tf32_flops is not None:
        flops["tf32"] = card.tf32_flops * efficiency
    if card.fp8_flops is not None:  # torch._scaled_mm's operands (--float8): e4m3 forward, e5m2 gradients
        flops["float8_e4m3fn"] = flops["float8_e5m2"] = card.fp8_flops * efficiency
    major = card.compute_capability[0]
    attention = rates.ATTENTION_SHARE.get(major, rates.ATTENTION_UNMEASURED) / efficiency
    return DeviceProfile(
        name=card.name,
        type="cuda",
        matmul_flops=flops,
        attention_efficiency=attention,
        memory_bandwidth=card.memory_bandwidth * rates.GPU_BANDWIDTH_EFFICIENCY,
        kernel_s=rates.GPU_KERNEL_S,
        dispatch_s=rates.GPU_DISPATCH_S,
        link_bandwidth=card.link_bandwidth * rates.LINK_EFFICIENCY,
        host_link_bandwidth=card.host_link_bandwidth,
        network_bandwidth=card.network_bandwidth * rates.LINK_EFFICIENCY,
        peak_flops=card.bf16_flops or card.fp16_flops,
        collective_sm_share=rates.NCCL_RING_CHANNELS / rates.SMS[card.name] if card.name in rates.SMS else None,
        eager_bandwidth=card.memory_bandwidth * eager if (eager := rates.EAGER_BANDWIDTH.get(major)) else None,
        source=f"published peaks, matmuls at the {efficiency:.0%} of them a run sustains (autotune.estimate.step_time)",
    )


def profile_for(workload: Workload, device_type: str | None) -> DeviceProfile | None:
    """The roofline ``workload``'s step is timed on: its named card's (``--gpu``), else the device of
    ``device_type`` here, probed on the first call of this process; None without either (or when the probe
    fails)."""
    if workload.gpu is not None:
        from autotune.config.gpus import gpu_spec

        return card_profile(gpu_spec(workload.gpu))
    if device_type is None:
        return None
    between_ranks = workload.nproc > 1  # one rank communicates nothing
    probed = _PROBED.get((device_type, between_ranks)) or _probe(device_type, between_ranks)
    if probed:
        _PROBED[device_type, between_ranks] = probed
    return DeviceProfile.from_dict(probed) if probed else None


# What the device probe measured, per device and whether ranks communicate: once per process, so that the
# estimates of one caller are timed on one roofline (and a caller asking many, as bench/gpu_check.py does in one
# process, does not spend seconds of every estimate probing again).
_PROBED: dict[tuple[str, bool], dict[str, Any]] = {}


def _probe(device_type: str, between_ranks: bool) -> dict[str, Any] | None:
    from autotune.estimate.client import probe_in_estimate_server
    from autotune.trial.device_probe import PROBE_TIMEOUT_S, probe_profile, profile_request

    # Forked from the estimate server the estimates come from (no interpreter of its own to start), once its
    # imports are done: the probe computes on the cores free when it starts.
    probed = probe_in_estimate_server(device_type, profile_request(between_ranks), timeout_s=PROBE_TIMEOUT_S)
    if not isinstance(probed, dict):
        probed = probe_profile(device_type, between_ranks=between_ranks)
    return probed if isinstance(probed, dict) else None


def predict_step_time(
    estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile, *, task: str | None = None
) -> StepTime | None:
    """The step time of ``estimate``'s config on ``profile``; None without traced costs."""
    costs = estimate.step_costs
    if costs is None:
        return None
    config = estimate.config
    ranks = workload.nproc
    accum = config.grad_accum_steps(workload)
    share = _rank_share(profile, ranks)
    fused = config.compile
    micro_ops = costs.micro_step(config.micro_batch, fused=fused)
    micro_device, micro_host = _phase_times(micro_ops, profile, config, share)
    backward, _ = _phase_times(costs.micro_step(config.micro_batch, BACKWARD, fused=fused), profile, config, share)
    # The optimizer's step is not compiled with the model: eager foreach kernels, or fused AdamW's one kernel.
    update_device, update_host = _phase_times(costs.update(), profile, config, share, compiled=config.fused_optimizer)
    if config.uses_deepspeed:  # the traced update was plain AdamW on the whole model: ZeRO steps its partition
        update_device, update_host = update_device / ranks, update_host
    if config.fused_optimizer:  # one kernel for every tensor: the host issues a handful of operators
        update_host = profile.dispatch_s * 4
    if config.fsdp == "hybrid":
        traced_collectives = _hybrid_collectives_s(costs, config, accum, profile, workload)
    else:
        traced_collectives = _collectives_s(costs, config, accum, profile, workload)
    if profile.type == "cpu":  # the host computes: its time and the device's are one
        compute = accum * (micro_device + micro_host)
        update = update_device + update_host
    else:
        compute = accum * max(micro_device, micro_host)
        update = max(update_device, update_host)
    if config.pp > 1:  # the pipeline's bubble: each stage idles while the first micro batches fill the others
        compute *= 1 + _pipeline_bubble(config, accum)
    displaced = _collective_sms_s(estimate, workload, profile, compute, backward, traced_collectives)
    compute += displaced
    communication = _communication_s(estimate, workload, profile, compute, backward, traced_collectives)
    offload = _offload_s(estimate, workload, profile)
    step = compute + update + communication + offload
    samples_per_s = workload.global_batch / step
    tokens_per_sample = _tokens_per_sample(workload, task)
    tokens_per_s = samples_per_s * tokens_per_sample if tokens_per_sample else None
    # The traced FLOPs are one rank's: the whole model's under data parallel (each rank its share of the
    # samples), its shards' or its stage's under tensor and pipeline parallel (each of them every sample).
    model_flops = 3 * costs.forward_flops_per_sample * samples_per_s / config.data_parallel(workload)
    mfu = model_flops / profile.peak_flops if profile.peak_flops else None
    return StepTime(
        step_s=step,
        compute_s=compute,
        update_s=update,
        communication_s=communication,
        offload_s=offload,
        samples_per_s=samples_per_s,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        collective_sms_s=displaced,
    )


@functools.lru_cache(maxsize=64)
def _tokens_per_sample(workload: Workload, task: str | None) -> int | None:
    """Tokens a sample of ``workload`` holds (None where it holds none); cached: the driver times many
    configs of one workload, and the task comes from the model's config."""
    from autotune.models.sources import resolve_task

    return workload.tokens_per_sample(task or resolve_task(workload))


def _rank_share(profile: DeviceProfile, ranks: int) -> float:
    """The part of the device one rank computes on: a GPU each, or the CPU's cores split between ranks."""
    return 1.0 / ranks if profile.type == "cpu" else 1.0


def _phase_times(
    ops: list[tuple[str, str, float, float, float]],
    profile: DeviceProfile,
    config: TrialConfig,
    share: float,
    *,
    compiled: bool | None = None,
) -> tuple[float, float]:
    """(device seconds, host seconds) of one phase's operators; ``compiled``: its memory-bound kernels are
    generated ones (default: the model's forward and backward under ``--compile``), else eager PyTorch's."""
    compiled = config.compile if compiled is None else compiled
    eager = None if compiled else profile.eager_bandwidth
    device = host = 0.0
    for kind, dtype, flops, moved, count in ops:
        if kind == COLLECTIVE:
            continue  # timed on the link, apart
        if kind == FUSED:  # joins the kernel before it: its traffic (less what the fusion saves), no launch
            device += count * moved / (profile.memory_bandwidth * share)
            continue
        rate = _matmul_rate(profile, dtype, config.precision) * share
        if kind == ATTENTION and profile.attention_efficiency:
            rate *= profile.attention_efficiency
        bandwidth = eager if kind == OTHER and eager else profile.memory_bandwidth
        memory = moved / (bandwidth * share)
        compute = flops / rate if flops else 0.0
        device += count * (max(compute, memory) + profile.kernel_s)
        host += count * profile.dispatch_s
    return device, host


def matmul_speedups(profile: DeviceProfile, precisions: Iterable[str]) -> dict[str, float]:
    """Each precision's matmul FLOP/s over fp32's on this roofline: where the driver places a family whose
    step is not traced yet (a prior about matmuls, as the device probe's; the family's trace replaces it)."""
    fp32 = _matmul_rate(profile, "float32", "fp32")
    return {p: _matmul_rate(profile, sixteen_bit_type(p) or "float32", p) / fp32 for p in precisions}


def matmul_floor_s(sibling: MemoryEstimate, config: TrialConfig, workload: Workload, profile: DeviceProfile) -> float:
    """A floor under :func:`predict_step_time` of ``config``, from the traced step of ``sibling``, a config that differs
    from it only in its precision: the same matmuls (a precision changes their type, not their FLOPs), timed at
    ``config``'s rate and with nothing else (no memory traffic, launches, update or collectives). Operators the
    sibling ran in its own type take ``config``'s; others (fp32 under autocast, float8) keep theirs. Attention at the
    plain matmul rate: fp32's runs as PyTorch's math path, whose matmuls (``bmm``) do at least a fused kernel's FLOPs
    (the whole square where the fused kernel skips causal masking's half). 0.0 without traced costs."""
    costs = sibling.step_costs
    if costs is None:
        return 0.0
    own, theirs = (sixteen_bit_type(c.precision) or "float32" for c in (config, sibling.config))
    share = _rank_share(profile, workload.nproc)
    seconds = 0.0
    for kind, dtype, flops, _, count in costs.micro_step(config.micro_batch):
        if kind not in (MATMUL, ATTENTION) or not flops:
            continue
        seconds += count * flops / (_matmul_rate(profile, own if dtype == theirs else dtype, config.precision) * share)
    return config.grad_accum_steps(workload) * seconds


def _matmul_rate(profile: DeviceProfile, dtype: str, precision: str) -> float:
    if dtype == "float32" and precision == "tf32" and "tf32" in profile.matmul_flops:
        dtype = "tf32"
    rate = profile.matmul_flops.get(dtype) or profile.matmul_flops.get("float32")
    return rate if rate else math.inf


def _collectives_s(
    costs: StepCosts, config: TrialConfig, accum: int, profile: DeviceProfile, workload: Workload
) -> float:
    """The traced collectives of one optimizer step (FSDP2's, tensor parallel's), each moving (ranks-1)/ranks of its
    bytes: the gathers of every micro step, the gradients' reduce-scatters of the micro steps that reduce
    (``--grad-sync``). Collectives are never fused away."""
    ranks = workload.nproc
    if ranks <= 1:
        return 0.0
    gathered = reduced = 0.0  # whole buffers, per micro step
    for name, moved in _traced_collectives(costs, config.micro_batch):
        if "reduce_scatter" in name:
            reduced += moved
        else:
            gathered += moved
    moved = accum * gathered + reducing_micro_steps(config, accum, costs.micro_steps) * reduced
    return moved * (ranks - 1) / ranks / _link(profile, ranks, workload)


def _hybrid_collectives_s(
    costs: StepCosts, config: TrialConfig, accum: int, profile: DeviceProfile, workload: Workload
) -> float:
    """Hybrid sharding's traced collectives of one optimizer step. Its all-gathers and reduce-scatters span a shard
    group, each moving (shard-1)/shard of its bytes over that group's links; each reduce-scatter's output (its
    shard of the gradients) is then all-reduced across the replicas (``foreach_reduce`` in FSDP2's
    ``_fsdp_collectives.py``), a ring moving 2 (replicas-1)/replicas of it, over the network between nodes
    when the replicas span nodes. The gathers run every micro step, the reductions in the micro steps that
    reduce (``--grad-sync``)."""
    shard, replicas = config.shard_degree(workload), config.replicate_degree(workload)
    gathered = scattered = reduced = 0.0  # whole buffers, per micro step
    for name, moved in _traced_collectives(costs, config.micro_batch):
        if "allreduce" in name.replace("_", ""):
            reduced += moved
        elif "reduce_scatter" in name:
            scattered += moved
        else:
            gathered += moved
    reducing = reducing_micro_steps(config, accum, costs.micro_steps)
    # A replicate group takes every shard-th rank: it spans the nodes there are. A shard group spans them where it
    # is larger than one node's ranks (consecutive ranks, as torchrun numbers them).
    within = (accum * gathered + reducing * scattered) * (shard - 1) / shard / _link(profile, shard, workload)
    across = 2 * reducing * reduced * (replicas - 1) / replicas
    return within + across / _link(profile, workload.nproc, workload)


def _traced_collectives(costs: StepCosts, micro_batch: int) -> Iterator[tuple[str, float]]:
    """Each traced collective of a micro step at ``micro_batch``: its operator's name and the bytes of its whole
    buffers (all its runs in the micro step)."""
    for op in costs.ops:
        if op.kind == COLLECTIVE and op.phase != UPDATE:
            yield op.name, op.count * (op.fixed_bytes + op.sample_bytes * micro_batch)


def _link(profile: DeviceProfile, ranks: int, workload: Workload) -> float:
    """Bytes/s each rank of a collective over ``ranks`` consecutive ranks (as torchrun numbers them) moves: its
    node's link where the group fits in one of the workload's nodes (a named card's: ``on_card_nodes``), else the
    slower of that and the network between nodes."""
    network = profile.between_nodes()
    if network is None or ranks <= workload.ranks_per_node:
        return profile.link_bandwidth
    return min(profile.link_bandwidth, network)


def _overlapped_s(
    estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile, backward: float, traced: float
) -> float:
    """The link seconds of a step its framework runs beside the compute (before comparing them with it): FSDP's
    traced collectives and ZeRO-3's gathers but for the first gather and last reduce, DDP's all-reduce up to the
    last backward; none for tensor parallel's all-reduces (in line) and ZeRO-1/2's reductions (not overlapped)."""
    config, ranks = estimate.config, workload.nproc
    if ranks <= 1:
        return 0.0
    if config.uses_fsdp:
        return (1 - _NOT_HIDDEN) * traced
    if config.model_parallel > 1:
        return 0.0
    link = _link(profile, ranks, workload)
    if config.uses_deepspeed:
        return (1 - _NOT_HIDDEN) * _zero3_gathers_s(estimate, workload, link) if (config.zero_stage or 0) >= 3 else 0.0
    return min(_ddp_all_reduce_s(estimate, ranks, link), backward)


def _collective_sms_s(
    estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile, compute: float, backward: float, traced: float
) -> float:
    """What the compute loses to the SMs an overlapped collective holds: while one runs, the compute runs at
    1 - share of its rate (the share: NCCL's channels over the card's SMs, ``collective_sm_share``), for as long as
    both run: the collectives' overlapped seconds, or the compute's own if it ends first. Within one node only."""
    share = profile.collective_sm_share
    if not share or profile.type != "cuda" or workload.nodes > 1:
        return 0.0
    overlapped = _overlapped_s(estimate, workload, profile, backward, traced)
    return share * min(overlapped, compute / (1 - share))


def _communication_s(
    estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile, compute: float, backward: float, traced: float
) -> float:
    """What the step waits for on the link, after the overlap its framework gives."""
    config, ranks = estimate.config, workload.nproc
    if ranks <= 1:
        return 0.0
    link = _link(profile, ranks, workload)
    spread = (ranks - 1) / ranks
    if config.uses_fsdp:
        return max(traced - compute, 0.0) + _NOT_HIDDEN * traced
    if config.model_parallel > 1:  # no copies to average: tensor parallel's traced all-reduces wait in line
        return traced
    if config.uses_deepspeed:
        return _zero_s(estimate, workload, profile, compute, link)
    gradients = _ddp_gradients_bytes(estimate)
    all_reduce = _ddp_all_reduce_s(estimate, ranks, link)
    last_backward = backward if profile.type == "cuda" else 0.0  # gloo on a CPU competes for the same cores
    return (
        max(all_reduce - last_backward, 0.0)
        + min(_DDP_BUCKET, gradients) * 2 * spread / link
        + math.ceil(gradients / _DDP_BUCKET) * _collective_latency(profile)
    )


def _ddp_gradients_bytes(estimate: MemoryEstimate) -> float:
    return estimate.gradients_bytes / 2  # DDP's estimate counts its buckets: a second copy


def _ddp_all_reduce_s(estimate: MemoryEstimate, ranks: int, link: float) -> float:
    """DDP's all-reduce of every gradient (a ring: each byte twice, over all but a rank's own share)."""
    return 2 * _ddp_gradients_bytes(estimate) * ((ranks - 1) / ranks) / link


def _pipeline_bubble(config: TrialConfig, micro_batches: int) -> float:
    """The idle share of a pipeline step, over its busy time: (pp - 1) / micro batches for GPipe and 1F1B,
    divided by the stages each rank holds for interleaved 1F1B (Narayanan et al., 2021, section 2.2)."""
    per_rank = 2 if config.pp_schedule == "interleaved-1f1b" else 1
    return (config.pp - 1) / (per_rank * micro_batches)


def _collective_latency(profile: DeviceProfile) -> float:
    """One collective's time beyond its bytes: as probed, else a GPU's typical figure (none on a CPU
    whose probe did not measure it)."""
    if profile.collective_s is not None:
        return profile.collective_s
    return _GPU_COLLECTIVE_S if profile.type == "cuda" else 0.0


def _zero_s(estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile, compute: float, link: float) -> float:
    """DeepSpeed ZeRO as autotune configures it (overlap_comm off below stage 3): ZeRO-1 reduces the
    gradients at the step's end; ZeRO-2 reduces each micro step's in the backward, bucket by bucket;
    ZeRO-3 also gathers every weight, frozen ones too, in each forward and backward (overlapped). All
    gather the updated weights after the step. Each bucket or gathered module costs a collective's
    latency besides its bytes."""
    config, ranks, costs = estimate.config, workload.nproc, estimate.step_costs
    assert costs is not None
    stage, accum = config.zero_stage or 0, config.grad_accum_steps(workload)
    spread = (ranks - 1) / ranks
    latency = _collective_latency(profile)
    per_parameter = _weight_bytes(config)
    bucket = costs.hidden_size**2 if costs.hidden_size else _DEEPSPEED_BUCKET
    buckets = math.ceil(costs.trainable_parameters / bucket) if costs.trainable_parameters else 0
    reduces = accum if stage >= 2 else 1
    weights = costs.trainable_parameters * per_parameter
    seconds = reduces * (weights * spread / link + buckets * latency)  # gradients
    seconds += weights * spread / link + buckets * latency  # updated weights
    if stage >= 3:
        gathers = _zero3_gathers_s(estimate, workload, link)
        hidden = max(gathers - compute, 0.0) + _NOT_HIDDEN * gathers if profile.type == "cuda" else gathers
        seconds += hidden + 2 * accum * costs.parameter_tensors * latency
    return seconds


def _zero3_gathers_s(estimate: MemoryEstimate, workload: Workload, link: float) -> float:
    """ZeRO-3's gathers of every weight in each forward and backward of a step."""
    config, ranks, costs = estimate.config, workload.nproc, estimate.step_costs
    assert costs is not None
    return 2 * config.grad_accum_steps(workload) * costs.parameters * _weight_bytes(config) * (ranks - 1) / ranks / link


def _weight_bytes(config: TrialConfig) -> int:
    """Bytes of one weight as ZeRO reduces and gathers it: fp32 (and tf32) in full, the half precisions in 2."""
    return 4 if config.precision in ("fp32", "tf32") else 2


def _trainable(estimate: MemoryEstimate) -> float:
    return float(estimate.step_costs.trainable_parameters) if estimate.step_costs is not None else 0.0


def _offload_s(estimate: MemoryEstimate, workload: Workload, profile: DeviceProfile) -> float:
    """Offload: the host steps this rank's share of the weights; 16-bit gradients go down and weights
    come back over the host link (ZeRO-3's offloaded weights in every forward and backward too)."""
    config = estimate.config
    if config.offload == "none":
        return 0.0
    # ZeRO shards over every rank, FSDP over its shard group (every data-parallel rank but hybrid's).
    shards = workload.nproc if config.uses_deepspeed else config.shard_degree(workload)
    parameters = _trainable(estimate) / shards
    host_step = parameters * _HOST_ADAM_BYTES / _HOST_BANDWIDTH
    if profile.type == "cpu":
        return host_step  # the host is the device: no link to cross
    moved = parameters * (2 + 2)
    if config.offload == "optimizer+params":
        moved += parameters * 2 * 2 * config.grad_accum_steps(workload)
    return host_step + moved / profile.host_link_bandwidth
