"""``--float8``: float8 training of the Linear layers, as torchtitan runs it (torchao's
``convert_to_float8_training`` with its default recipe: dynamic tensorwise scales, e4m3 for the inputs and
weights, e5m2 for the output gradients).

Each Linear layer but the output head, with both dimensions a multiple of 16 (what ``torch._scaled_mm`` takes
on CUDA, and torchtitan's filter), becomes torchao's ``Float8Linear``: its matmuls cast their operands to
float8 with one scale per tensor and run ``torch._scaled_mm``; the weights stay in their own type, and the
backward casts again. On CUDA that needs float8 tensor cores (compute capability 8.9 or newer: Ada, Hopper,
Blackwell); PyTorch's CPU ``_scaled_mm`` takes float8 too, so a CPU trial measures the layers' memory for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, a_bool

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["Float8Fields", "Float8Lever", "FLOAT8_SINCE", "convert_to_float8", "float8_layer", "float8_refusal"]

# The first compute capability with float8 tensor cores (Ada is 8.9, Hopper 9.0); torch._scaled_mm refuses older.
FLOAT8_SINCE = (8, 9)
_DIVISOR = 16  # torch._scaled_mm's CUDA kernels take dimensions that are multiples of 16
_NO_TORCHAO = "--float8 on needs torchao: pip install torchao, or use --float8 off"


@dataclass(frozen=True, kw_only=True)
class Float8Fields:
    float8: bool = field(
        default=False,
        metadata={
            "help": "float8 training of the Linear layers (torchao's convert_to_float8_training, tensorwise "
            "scales): their matmuls in float8, the weights kept in their type; CUDA needs compute capability "
            "8.9 or newer (H100, L40S, RTX 4090), a CPU runs it too."
        },
    )


def float8_layer(module: torch.nn.Module, head: torch.nn.Module | None) -> bool:
    """Whether ``module`` trains in float8: a Linear layer with both dimensions a multiple of 16, not the model's
    output head (``head``: the output embeddings, which torchtitan leaves in bf16 too)."""
    import torch

    if not isinstance(module, torch.nn.Linear) or module is head:
        return False
    return module.in_features % _DIVISOR == 0 and module.out_features % _DIVISOR == 0


def convert_to_float8(model: torch.nn.Module, *, source: str = "the model") -> torch.nn.Module:
    """``model`` with its Linear layers (:func:`float8_layer`) swapped for torchao's ``Float8Linear``, in place."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ConfigError(_NO_TORCHAO) from None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not any(float8_layer(module, head) for module in model.modules()):
        raise ConfigError(
            f"--float8 on: {source} has no Linear layer (but its head) with both dimensions a multiple of "
            f"{_DIVISOR}, so nothing would train in float8; use --float8 off"
        )
    return convert_to_float8_training(model, module_filter_fn=lambda module, _name: float8_layer(module, head))


def float8_refusal(device: DeviceInfo) -> str | None:
    """Why ``--float8 on`` cannot run on ``device`` with what is installed (None: it can; a CPU can)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return _NO_TORCHAO
    capability = device.compute_capability
    if device.type != "cuda" or capability is None or capability >= FLOAT8_SINCE:
        return None
    since = ".".join(map(str, FLOAT8_SINCE))
    return (
        f"--float8 on needs float8 tensor cores (compute capability {since} or newer: H100, H200, L40S, RTX 4090); "
        f"{device.name} is {'.'.join(map(str, capability))}; use --float8 off"
    )


class Float8Lever(Lever):
    name = "float8"
    fields = ("float8",)
    flags = (Flag.on_off("float8", "--float8"),)
    axes = (Axis("float8", "a list of true/false", False, a_bool, moved_only=True, added_later=True),)

    def check(self, config: TrialConfig) -> None:
        if not isinstance(config.float8, bool):
            raise ConfigError(f"--float8 {config.float8!r} must be on or off")

    def conflict(self, config: TrialConfig) -> str | None:
        if not config.float8:
            return None
        if config.uses_lora or config.quantizes_base:
            return "--float8 on trains the Linear layers' weights in full; with --lora-rank use --float8 off"
        if config.uses_deepspeed or config.model_parallel > 1:
            return (
                "--float8 on is measured on one rank, DDP and FSDP (torchtitan's layouts for it without tensor "
                "parallel); use --float8 off with ZeRO, --tp or --pp"
            )
        return None

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return float8_refusal(device) if config.float8 else None

    def on_refusal(self, key: str, device: DeviceInfo) -> str | None:
        return float8_refusal(device)

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        return convert_to_float8(model, source=source) if config.float8 else model

    def labels(self, config: TrialConfig) -> list[str]:
        return ["float8"] if config.float8 else []

    def maths_note(self, config: TrialConfig) -> str | None:
        return "the Linear layers' matmuls in float8 (tensorwise scales)" if config.float8 else None

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if not config.float8:
            return {}
        # torchtitan's converter of the same name, with the recipe the trials ran (torchao's default, tensorwise)
        # and its output head left out by name ("output" in torchtitan's models), as float8_layer leaves it.
        linear = {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
        return {"model": {"converters": ["quantize.linear.float8"]}, "quantize.linear.float8": linear}

    def in_code(self, config: TrialConfig) -> list[str]:
        if not config.float8:
            return []
        return [
            "float8: model = autotune.prepare(model, float8=True) before the optimizer is built (torchao's "
            "convert_to_float8_training of every Linear layer but the output head with dimensions that are "
            "multiples of 16; torchtitan: autotune export --format torchtitan)"
        ]
