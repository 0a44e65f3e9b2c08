"""Hand-made traced steps and a device to time them on, for tests whose ranking must be worked out by hand.

A toy step is one matmul of ``flops_per_sample`` a sample and one other operator per micro step; on
:data:`TOY_CPU` (1,000 FLOP/s, 0.05 s per operator, memory free) a step of global batch ``g`` at micro
batch ``mb`` takes ``g x flops / 1000 + (g / mb) x 0.1`` seconds.
"""

from __future__ import annotations

from autotune.estimate.step_costs import OpCost, StepCosts
from autotune.estimate.step_time import DeviceProfile

TOY_CPU = DeviceProfile(
    name="toy",
    type="cpu",
    matmul_flops={"float32": 1000.0},
    memory_bandwidth=1e18,
    kernel_s=0.0,
    dispatch_s=0.05,
    link_bandwidth=1e18,
    host_link_bandwidth=1e18,
)


def toy_costs(flops_per_sample: float) -> StepCosts:
    """A toy step whose operators all run outside any checkpointed layer (``layers_marked``, none of them in
    one): a checkpointed family not traced yet is placed level with its traced twin, so its own toy step
    ranks it once traced (a test of derived twins builds its own step)."""
    return StepCosts(
        (
            OpCost("forward", "matmul", "mm", "float32", flops_per_sample, 0.0, 0.0, 1.0),
            OpCost("forward", "other", "add", "float32", 0.0, 0.0, 0.0, 1.0),
        ),
        flops_per_sample / 3,
        layers_marked=True,
    )


def toy_step_s(flops_per_sample: float, global_batch: int, micro_batch: int) -> float:
    return global_batch * flops_per_sample / 1000 + global_batch / micro_batch * 0.1
