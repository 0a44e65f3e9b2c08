"""``--compile``: torch.compile the model. The trial's engine compiles it (each engine its own way: the
model, DDP's wrapper, DeepSpeed's ``engine.compile()``), after the first steps, so compile time is a phase
of its own and never in tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, a_bool

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["CompileFields", "CompileLever", "compile_device_refusal"]


@dataclass(frozen=True, kw_only=True)
class CompileFields:
    compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the model (CUDA trials): its compile time is a phase of its own, never in "
            "tokens/s, and the trial reports how many steps a run needs before compiling pays off."
        },
    )


def compile_device_refusal(device_type: str) -> str | None:
    """Why ``--compile on`` cannot be measured on a device of ``device_type`` (None: it can)."""
    if device_type != "cuda":
        # The CPU trial counts tensor bytes with a dispatch-mode tracker: TorchDynamo does not compile
        # under an active dispatch mode (measured: the "compiled" step ran eager), and the kernels it
        # compiles allocate where the tracker cannot see. A figure from it would not be compile's.
        return (
            "--compile on is measured on CUDA GPUs only: a CPU trial counts memory with a tracker under which "
            "torch.compile does not compile; use --compile off on a CPU"
        )
    return None


class CompileLever(Lever):
    name = "compile"
    fields = ("compile",)
    flags = (Flag.on_off("compile", "--compile"),)
    axes = (Axis("compile", "a list of true/false (true: CUDA only)", False, a_bool, added_later=True),)

    def check(self, config: TrialConfig) -> None:
        if not isinstance(config.compile, bool):
            raise ConfigError(f"--compile {config.compile!r} must be on or off")

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return compile_device_refusal(device.type) if config.compile else None

    def on_refusal(self, key: str, device: DeviceInfo) -> str | None:
        return compile_device_refusal(device.type)

    def stage_refusal(self, config: TrialConfig) -> str | None:
        return "--compile on is not measured on pipeline stages yet; use --compile off" if config.compile else None

    def labels(self, config: TrialConfig) -> list[str]:
        return ["compiled"] if config.compile else []

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        return {"torch_compile": True} if config.compile else {}

    def accelerate_config(self, config: TrialConfig) -> dict[str, Any]:
        # Accelerator(dynamo_backend=...) compiles the prepared model.
        return {"dynamo_config": {"dynamo_backend": "INDUCTOR"}} if config.compile else {}

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        # The trials compile the model, not the loss (torchtitan's components default to both).
        return {"compile": {"enable": True, "components": ["model"]} if config.compile else {"enable": False}}

    def in_code(self, config: TrialConfig) -> list[str]:
        if not config.compile:
            return []
        if config.uses_deepspeed:
            return [
                "compile: engine.compile() after deepspeed.initialize (DeepSpeed's JSON has no switch for it; "
                "the hf export sets torch_compile, the accelerate export dynamo_backend INDUCTOR); "
                "the first steps compile"
            ]
        return [
            "compile: model = torch.compile(model) before training (the hf export sets torch_compile, "
            "the accelerate export dynamo_backend INDUCTOR); the first steps compile"
        ]
