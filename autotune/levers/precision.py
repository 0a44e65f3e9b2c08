"""Which type each weight is held in, per precision, as the recipes users run hold them.

* fp32, tf32, fp16, bf16 (mixed): fp32 weights; autocast computes in 16 bits. With LoRA the frozen
  base is 16-bit and the adapters fp32, as PEFT recipes load it (``from_pretrained(dtype=torch.bfloat16)``:
  PEFT keeps adapters in fp32). Keeping the base in fp32 would count bytes no user pays.
* bf16-true: every parameter in bf16, adapters included, so gradients and Adam states are bf16 too
  (Lightning's ``bf16-true``). Buffers keep their type, as ``from_pretrained(dtype=...)`` leaves
  them (e.g. rotary frequencies stay fp32).

DeepSpeed's fp16/bf16 modes cast the model themselves: nothing here applies under ZeRO.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, ModelFacts, one_of

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["PrecisionFields", "PrecisionLever", "PRECISIONS", "sixteen_bit_type", "trains_on", "hold_weights"]

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "bf16-true")
# Lightning's precision strings: mixed precision is autocast, -true holds the model in 16 bits.
_LIGHTNING_PRECISION = {"fp16": "16-mixed", "bf16": "bf16-mixed", "bf16-true": "bf16-true"}
# The 16-bit type each precision computes in (torch's name). fp16 and bf16 are mixed precision:
# fp32 weights, gradients and Adam states, matmuls under autocast. bf16-true holds all of them in
# bf16 (Lightning's "bf16-true"). No fp16-true: Adam's eps (1e-8) and small second moments
# underflow in fp16, so it does not train without an fp32 copy.
_SIXTEEN_BIT_TYPES = {"fp16": "float16", "bf16": "bfloat16", "bf16-true": "bfloat16"}


def sixteen_bit_type(precision: str) -> str | None:
    """torch's name of the 16-bit type ``precision`` computes in, or None for fp32/tf32."""
    return _SIXTEEN_BIT_TYPES.get(precision)


@dataclass(frozen=True, kw_only=True)
class PrecisionFields:
    precision: str = field(
        default="fp32",
        metadata={
            "help": "fp32, tf32 (CUDA only), fp16 (mixed, with loss scaling), bf16 (mixed) or bf16-true "
            "(weights, gradients and Adam states all in bf16: half the model states, less exact)."
        },
    )

    @property
    def sixteen_bit(self) -> str | None:
        """torch's name of the 16-bit type this config computes in (float16, bfloat16), or None."""
        return sixteen_bit_type(self.precision)

    @property
    def autocast_type(self) -> str | None:
        """torch's name of the type autocast computes in: the mixed precisions' 16-bit type; None for
        fp32, tf32 and bf16-true (whose weights are bf16 already)."""
        return None if self.true_16_bit else self.sixteen_bit

    @property
    def true_16_bit(self) -> bool:
        """Weights, gradients and optimizer state held in 16 bits (no fp32 copy, no autocast)."""
        return self.precision == "bf16-true"

    @property
    def scales_loss(self) -> bool:
        """fp16's mixed precision: the loss is scaled, and the whole gradient unscaled and checked before a step."""
        return self.precision == "fp16"


class PrecisionLever(Lever):
    name = "precision"
    fields = ("precision",)
    flags = (Flag("precision", ("--precision",), str, "fp32"),)
    axes = (Axis("precision", f"a list of {', '.join(PRECISIONS)}", "fp32", one_of(PRECISIONS)),)

    def check(self, config: TrialConfig) -> None:
        if config.precision not in PRECISIONS:
            raise ConfigError(f"--precision {config.precision!r} is not known; use one of {', '.join(PRECISIONS)}")

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        if config.precision == "tf32" and device.type != "cuda":
            return "--precision tf32 only exists on CUDA tensor cores; use fp32 or bf16 on a CPU"
        if config.sixteen_bit == "bfloat16" and not device.bf16:
            return f"--precision {config.precision}: {device.name} has no bfloat16; use fp16 or fp32"
        if config.true_16_bit and config.uses_deepspeed:
            return (
                f"--precision {config.precision} with --zero-stage: DeepSpeed's bf16 mode keeps fp32 master "
                "weights in its optimizer, which is --precision bf16; use that with ZeRO"
            )
        if config.precision == "fp16" and config.uses_deepspeed and not device.fp16_deepspeed:
            return (
                "--precision fp16 with --zero-stage: DeepSpeed's accelerator on this device has no fp16 "
                "training; use bf16, or fp16 without --zero-stage"
            )
        return None

    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        kept = tuple(precision for precision in values if trains_on(precision, device))
        if not kept:
            raise ConfigError(
                f"knobs.precision {list(values)}: none of them trains on {device.name} ({device.type}); add fp32"
            )
        return kept

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        hold_weights(model, config)  # after LoRA: PEFT makes its adapters fp32
        return model

    def stage_refusal(self, config: TrialConfig) -> str | None:
        if config.precision == "fp16":
            return "--precision fp16's loss scaling would span the stages; use bf16 or fp32"
        return None

    def labels(self, config: TrialConfig) -> list[str]:
        return [config.precision]

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        return {
            "bf16": config.sixteen_bit == "bfloat16",  # bf16-true: autocast on a bf16 model changes nothing
            "fp16": config.precision == "fp16",
            **({"tf32": True} if config.precision == "tf32" else {}),
        }

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        if format_name != "deepspeed" or not config.true_16_bit:
            return None
        return (
            f"--format deepspeed: this config trains in {config.precision}, and DeepSpeed's bf16 mode "
            "keeps fp32 master weights (that is --precision bf16); export --format hf, lightning "
            "or accelerate instead"
        )

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        # torchtitan's training dtype (the model's) and mixed_precision_param (FSDP's or autocast's compute type):
        # bfloat16 or float32 only, by its job config's Literals.
        if config.precision == "bf16-true":
            return {"training": {"dtype": "bfloat16"}}
        if config.precision in ("fp32", "bf16"):
            param = "bfloat16" if config.precision == "bf16" else "float32"
            return {"training": {"dtype": "float32", "mixed_precision_param": param}}
        raise ConfigError(
            f"--format torchtitan: this config trains in {config.precision}, and torchtitan trains in bfloat16 or "
            "float32 only (no fp16, no TF32 switch); export --format hf, lightning or accelerate, or pick a bf16 "
            "or fp32 config"
        )

    def lightning_arguments(self, config: TrialConfig) -> dict[str, Any]:
        return {"precision": _LIGHTNING_PRECISION.get(config.precision, "32-true")}

    def accelerate_arguments(self, config: TrialConfig) -> dict[str, Any]:
        # bf16-true: autocast on the bf16 model autotune.prepare made changes nothing, as in the Trainer's.
        return {"mixed_precision": {"float16": "fp16", "bfloat16": "bf16"}.get(config.sixteen_bit or "", "no")}

    def header_lines(self, config: TrialConfig) -> list[str]:
        if config.precision != "tf32":
            return []
        return ['tf32: call torch.set_float32_matmul_precision("high") before training']

    def in_code(self, config: TrialConfig) -> list[str]:
        if not config.true_16_bit:
            return []
        return [
            "bf16-true: load the model in bf16 "
            "(from_pretrained(..., dtype=torch.bfloat16), or model.to(torch.bfloat16)) "
            "and build the optimizer over its bf16 parameters; Lightning's precision: bf16-true does both"
        ]


def trains_on(precision: str, device: DeviceInfo) -> bool:
    """Whether ``device`` can train in ``precision`` at all (whatever the other knobs)."""
    if precision == "tf32":
        return device.type == "cuda"
    if sixteen_bit_type(precision) == "bfloat16":
        return device.bf16
    return True


def hold_weights(model: torch.nn.Module, config: TrialConfig) -> None:
    """Cast ``model``'s parameters (in place) to the types ``config``'s precision holds them in."""
    import torch

    if config.uses_deepspeed or config.sixteen_bit is None:
        return
    dtype = getattr(torch, config.sixteen_bit)
    for param in model.parameters():
        if param.is_floating_point() and (config.true_16_bit or not param.requires_grad and config.uses_lora):
            # .data, not Module.to(): also works on the estimator's fake parameters, and keeps them
            # the same Parameter objects (tied weights stay tied).
            param.data = param.data.to(dtype)
