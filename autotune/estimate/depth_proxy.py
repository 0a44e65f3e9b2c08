"""A deep model's estimate from two shallow copies of it: what lets a plan trace a 7B in a second.

A decoder stack repeats one layer: the live bytes at the peak, the model states and every traced
operator grow by the same amount with each layer. So the same model built with 2 and with 4 layers
(its config otherwise unchanged) gives, by a straight line, the figures of the real depth: the
tensor peak and its parts, the FLOPs, and each operator's count. What does not grow layer by layer
is taken from the 4-layer copy: the caching allocator's reserve, as a ratio of the tensor peak (its
rounding and cached blocks scale with the blocks it holds), and the device's fixed context.

Checked on Llama-2-7B at seq 4096 on 8 H100s, the full trace against the proxies' line: FSDP2 full
shard, bf16, checkpointing, micro batch 2: tensor peak 18.64 / 19.17 GiB, reserved 21.75 / 22.26,
step time equal (9.7 s of tracing against 1.6); ZeRO-2 bf16 micro batch 1: peak equal, reserved
49.13 / 51.69 GiB (+5%, on the safe side), step time equal. Not used where a layer's cost is not
its own: ZeRO-3 (DeepSpeed gathers up to a fixed number of parameters at once),
encoder-decoder models (two stacks), factories (no config to shorten), models of 6 layers or fewer
(a full trace is as cheap).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from autotune.estimate.step_costs import OpCost, StepCosts

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.estimator import MemoryEstimate

__all__ = ["DepthProxy", "depth_proxy"]

SHALLOW, DEEPER = 2, 4
_WORTH_IT = 8   # layers from which two proxies cost less than the model's own trace


@dataclasses.dataclass(frozen=True)
class DepthProxy:
    """The workload's model at 2 and 4 layers (config files in a temporary directory)."""

    layers: int
    shallow: Workload
    deeper: Workload
    task: str
    directory: tempfile.TemporaryDirectory  # type: ignore[type-arg]  # kept alive with the proxy

    def estimate(self, estimator: Callable[[Workload, TrialConfig, str], MemoryEstimate],
                 config: TrialConfig) -> MemoryEstimate:
        """``config``'s estimate at the real depth, from ``estimator``'s at the two proxies'."""
        two = estimator(self.shallow, config, self.task)
        four = estimator(self.deeper, config, self.task)
        return extrapolate(two, four, self.layers)


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
    directory = tempfile.TemporaryDirectory(prefix="autotune-proxy-")
    proxies = []
    for depth in (SHALLOW, DEEPER):
        config.num_hidden_layers = depth
        path = Path(directory.name) / f"layers-{depth}"
        path.mkdir()
        data = config.to_dict()
        (path / "config.json").write_text(json.dumps(data))
        proxies.append(workload.replace(model=str(path), task=task))
    return DepthProxy(layers, proxies[0], proxies[1], task, directory)


def extrapolate(two: MemoryEstimate, four: MemoryEstimate, layers: int) -> MemoryEstimate:
    """The estimate at ``layers`` by the straight line through the 2- and 4-layer ones."""
    def line(a: float, b: float) -> float:
        return a + (b - a) * (layers - SHALLOW) / (DEEPER - SHALLOW)

    ints = ("predicted_peak_bytes", "parameters_bytes", "gradients_bytes", "optimizer_state_bytes",
            "activations_bytes", "temporaries_bytes", "not_live_at_peak_bytes")
    fields = {name: int(round(line(getattr(two, name), getattr(four, name)))) for name in ints}
    peak = fields["predicted_peak_bytes"]
    reserved = device = None
    if four.predicted_reserved_bytes is not None and four.predicted_device_bytes is not None:
        reserved = int(peak * four.predicted_reserved_bytes / max(four.predicted_peak_bytes, 1))
        device = reserved + four.predicted_device_bytes - four.predicted_reserved_bytes
    flops = (int(round(line(two.flops_per_sample, four.flops_per_sample)))
             if two.flops_per_sample is not None and four.flops_per_sample is not None else None)
    return dataclasses.replace(
        four, **fields, predicted_reserved_bytes=reserved, predicted_device_bytes=device,
        overhead_bytes=None if device is None else device - peak, flops_per_sample=flops,
        step_costs=_extrapolated_costs(two.step_costs, four.step_costs, line),
        method=four.method + f" (extrapolated to {layers} layers from {SHALLOW}- and {DEEPER}-layer copies)",
        seconds=two.seconds + four.seconds)


def _totals(counted: Counter[OpCost], ops: set[OpCost]) -> dict[tuple[str, str, str, str, bool], tuple[float, ...]]:
    """Per (phase, kind, operator, dtype, fusable): count, FLOPs, model-state bytes, per-sample bytes in all."""
    totals: dict[tuple[str, str, str, str, bool], tuple[float, ...]] = {}
    for op in ops:
        n = counted[op]
        key = (op.phase, op.kind, op.name, op.dtype, op.fusable)
        c, f, x, s = totals.get(key, (0.0, 0.0, 0.0, 0.0))
        totals[key] = (c + n, f + n * op.flops, x + n * op.fixed_bytes, s + n * op.sample_bytes)
    return totals


def _extrapolated_costs(two: StepCosts | None, four: StepCosts | None,
                        line: Callable[[float, float], float]) -> StepCosts | None:
    if two is None or four is None:
        return None

    def counts(costs: StepCosts) -> Counter[OpCost]:
        counted: Counter[OpCost] = Counter()
        for op in costs.ops:
            counted[dataclasses.replace(op, count=1.0)] += op.count  # type: ignore[assignment]
        return counted

    a, b = counts(two), counts(four)
    # An operator of each layer costs the same at both depths: its count grows on the line.
    ops = [dataclasses.replace(op, count=count) for op in a.keys() & b.keys()
           if (count := line(a[op], b[op])) > 0]
    # One whose size grows with the depth instead (foreach optimizer kernels over every weight, the
    # embedding's gradient...): its operators of a kind, their count and totals, each on its line.
    left_a, left_b = _totals(a, a.keys() - b.keys()), _totals(b, b.keys() - a.keys())
    for group in left_a.keys() | left_b.keys():
        zero = (0.0, 0.0, 0.0, 0.0)
        count, flops, fixed, sample = (line(x, y) for x, y in zip(left_a.get(group, zero), left_b.get(group, zero)))
        if count > 0:
            phase, kind, name, dtype, fusable = group
            ops.append(OpCost(phase, kind, name, dtype, max(flops, 0.0) / count, max(fixed, 0.0) / count,
                              max(sample, 0.0) / count, count, fusable))
    return StepCosts(tuple(ops), line(two.forward_flops_per_sample, four.forward_flops_per_sample),
                     int(round(line(two.trainable_parameters, four.trainable_parameters))),
                     int(round(line(two.parameters, four.parameters))),
                     int(round(line(two.parameter_tensors, four.parameter_tensors))), four.hidden_size)
