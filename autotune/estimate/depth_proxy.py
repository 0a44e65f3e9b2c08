"""A deep model's estimate from two shallow copies of it: what lets a plan trace a 7B in a second.

A decoder stack repeats one layer: the live bytes at the peak, the model states and every traced
operator grow by the same amount with each layer. So the same model built with 2 and with 4 layers
(its config otherwise unchanged) gives, by a straight line, the figures of the real depth: the
tensor peak and its parts, the FLOPs, and each operator's count. What does not grow layer by layer
is taken from the 4-layer copy: the caching allocator's reserve, as a ratio of the tensor peak (its
rounding and cached blocks scale with the blocks it holds), and the device's fixed context.

Checked on Llama-2-7B at seq 4096 on 8 H100s (full traces against proxies, 2026-11-24): FSDP2 full
shard tensor peak 18.6 vs 19.2 GiB... (see bench/README.md, "find --plan"). Not used where a layer's
cost is not its own: ZeRO-3 (DeepSpeed gathers up to a fixed number of parameters at once),
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
    ops = tuple(dataclasses.replace(op, count=count) for op in a.keys() | b.keys()
                if (count := line(a.get(op, 0.0), b.get(op, 0.0))) > 0)
    return StepCosts(ops, line(two.forward_flops_per_sample, four.forward_flops_per_sample),
                     int(round(line(two.trainable_parameters, four.trainable_parameters))),
                     int(round(line(two.parameters, four.parameters))),
                     int(round(line(two.parameter_tensors, four.parameter_tensors))), four.hidden_size)
