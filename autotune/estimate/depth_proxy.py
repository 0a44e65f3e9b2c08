"""A deep model's trace from two shallow copies of it: what lets a plan trace a 7B in a second.

A decoder stack repeats one layer: the live bytes at the peak, the model states and every traced
operator grow by the same amount with each layer. So the same model built with 2 and with 4 layers
(its config otherwise unchanged) gives, by a straight line, the traced step of the real depth: the
tensor peak and its parts, the parameter counts, the FLOPs and each operator's count. ZeRO's and
DDP's arithmetic then runs on that line at the real depth, so ZeRO-3's cap on gathered weights
(``stage3_max_live_parameters``, which a 4-layer copy of a 7B already reaches) is applied to the
whole model's count. What does not grow layer by layer is taken from the 4-layer copy's estimate:
the caching allocator's reserve as a ratio of the tensor peak (its rounding and cached blocks scale
with the blocks it holds) and the device's fixed context.

Checked on Llama-2-7B at seq 4096 on 8 H100s, the full trace against the proxies' line: FSDP2 full
shard, bf16, checkpointing, micro batch 2: tensor peak 18.64 / 19.17 GiB, reserved 21.75 / 22.26
(read before the replay kept FSDP2's side streams' pools apart: those pools hold a root group and a
block whatever the depth, so the 4-layer copy's ratio, applied at full depth, scales them with the
tensor peak: an overstatement on the safe side, not measured), step time equal (9.7 s of tracing
against 1.6); ZeRO-2 bf16 micro batch 1: peak equal, reserved 49.13 / 51.69 GiB (+5%, on the safe
side), step time equal; ZeRO-3 bf16 micro batch 2: tensor peak 63.13 / 63.13 GiB, reserved 63.16 /
63.28, step time equal. Not used for encoder-decoder models (two stacks), factories (no config to
shorten), and models of 6 layers or fewer (a full trace is as cheap).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from autotune.estimate.results import ModelStates
from autotune.estimate.step_costs import OpCost, StepCosts
from autotune.trial.scratch import scratch_folder

if TYPE_CHECKING:
    from autotune.config.workload import Workload
    from autotune.estimate.results import TracedStep

__all__ = ["DepthProxy", "depth_proxy"]

SHALLOW, DEEPER = 2, 4
_WORTH_IT = 8  # layers from which two proxies cost less than the model's own trace


@dataclasses.dataclass(frozen=True)
class DepthProxy:
    """The workload's model at 2 and 4 layers (config files in a temporary directory)."""

    layers: int
    shallow: Workload
    deeper: Workload  # both with the workload's task, resolved
    directory: tempfile.TemporaryDirectory[str]  # kept alive with the proxy

    def to_dict(self) -> dict[str, Any]:
        """What the estimate server needs to trace the copies and draw the line (``predict_memory(proxy=)``)."""
        return {"layers": self.layers, "shallow": self.shallow.to_dict(), "deeper": self.deeper.to_dict()}


def depth_proxy(workload: Workload) -> DepthProxy | None:
    """Proxies of ``workload``'s model, or None where they would not stand for it (see the module)."""
    from autotune.models.sources import load_hf_config, parse_model_source, resolve_task

    source = parse_model_source(workload.model)
    if source.kind == "factory":
        return None
    config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < _WORTH_IT or getattr(config, "is_encoder_decoder", False):
        return None
    task = resolve_task(workload)
    directory = scratch_folder("proxy")
    proxies = []
    for depth in (SHALLOW, DEEPER):
        config.num_hidden_layers = depth
        path = Path(directory.name) / f"layers-{depth}"
        path.mkdir()
        data = config.to_dict()
        (path / "config.json").write_text(json.dumps(data))
        proxies.append(workload.replace(model=str(path), task=task))
    return DepthProxy(layers, proxies[0], proxies[1], directory)


def extrapolate(two: TracedStep, four: TracedStep, layers: int) -> TracedStep:
    """The traced step at ``layers`` by the straight line through the 2- and 4-layer ones (without its
    allocations, which no line draws: ``estimate_from_trace(cuda_as=)`` stands in for their replay)."""

    def line(a: float, b: float) -> float:
        return a + (b - a) * (layers - SHALLOW) / (DEEPER - SHALLOW)

    def whole(a: int, b: int) -> int:
        return int(round(line(a, b)))

    def states(a: ModelStates, b: ModelStates) -> ModelStates:
        return ModelStates(*(whole(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True)))

    return dataclasses.replace(
        four,
        peak_bytes=whole(two.peak_bytes, four.peak_bytes),
        at_peak=states(two.at_peak, four.at_peak),
        whole=states(two.whole, four.whole),
        activations_bytes=whole(two.activations_bytes, four.activations_bytes),
        backward_peak_bytes=whole(two.backward_peak_bytes, four.backward_peak_bytes),
        backward_at_peak=states(two.backward_at_peak, four.backward_at_peak),
        backward_activations_bytes=whole(two.backward_activations_bytes, four.backward_activations_bytes),
        flops_per_sample=whole(two.flops_per_sample, four.flops_per_sample),
        step_costs=_extrapolated_costs(two.step_costs, four.step_costs, line),
        total_params=whole(two.total_params, four.total_params),
        trainable_params=whole(two.trainable_params, four.trainable_params),
        events=None,
        marks={},
        attention_kernels={k: whole(two.attention_kernels.get(k, 0), v) for k, v in four.attention_kernels.items()},
        method=four.method + f" (extrapolated to {layers} layers from {SHALLOW}- and {DEEPER}-layer copies)",
        seconds=two.seconds + four.seconds,
    )


_ZERO = (0.0,) * 6  # a group's totals (see _totals) where one depth has none of its operators


def _totals(
    counted: Counter[OpCost], ops: set[OpCost]
) -> dict[tuple[str, str, str, str, bool, bool], tuple[float, ...]]:
    """Per (phase, kind, operator, dtype, fusable, in a layer): count, FLOPs, model-state bytes, per-sample
    bytes, and what fusing adds of each, in all."""
    totals: dict[tuple[str, str, str, str, bool, bool], tuple[float, ...]] = {}
    for op in ops:
        n = counted[op]
        key = (op.phase, op.kind, op.name, op.dtype, op.fusable, op.in_layer)
        figures = (1.0, op.flops, op.fixed_bytes, op.sample_bytes, op.fused_fixed_bytes, op.fused_sample_bytes)
        totals[key] = tuple(t + n * x for t, x in zip(totals.get(key, _ZERO), figures, strict=True))
    return totals


def _extrapolated_costs(two: StepCosts, four: StepCosts, line: Callable[[float, float], float]) -> StepCosts:
    def counts(costs: StepCosts) -> Counter[OpCost]:
        counted: Counter[OpCost] = Counter()
        for op in costs.ops:
            counted[dataclasses.replace(op, count=1.0)] += op.count  # type: ignore[assignment]
        return counted

    a, b = counts(two), counts(four)
    # An operator of each layer costs the same at both depths: its count grows on the line.
    ops = [dataclasses.replace(op, count=count) for op in a.keys() & b.keys() if (count := line(a[op], b[op])) > 0]
    # One whose size grows with the depth instead (foreach optimizer kernels over every weight, the
    # embedding's gradient...): its operators of a kind, their count and totals, each on its line.
    left_a, left_b = _totals(a, a.keys() - b.keys()), _totals(b, b.keys() - a.keys())
    for group in left_a.keys() | left_b.keys():
        count, flops, fixed, sample, fused_fixed, fused_sample = (
            line(x, y) for x, y in zip(left_a.get(group, _ZERO), left_b.get(group, _ZERO), strict=True)
        )
        if count > 0:
            phase, kind, name, dtype, fusable, in_layer = group
            ops.append(
                OpCost(
                    phase,
                    kind,
                    name,
                    dtype,
                    max(flops, 0.0) / count,
                    max(fixed, 0.0) / count,
                    max(sample, 0.0) / count,
                    count,
                    fusable,
                    in_layer,
                    fused_fixed / count,  # a saving may be negative
                    fused_sample / count,
                )
            )
    return StepCosts(
        tuple(ops),
        line(two.forward_flops_per_sample, four.forward_flops_per_sample),
        int(round(line(two.trainable_parameters, four.trainable_parameters))),
        int(round(line(two.parameters, four.parameters))),
        int(round(line(two.parameter_tensors, four.parameter_tensors))),
        four.hidden_size,
        two.layers_marked and four.layers_marked,
    )
