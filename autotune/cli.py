"""The ``autotune`` command line: parse, call the Python API, render. Nothing else lives here.

Every error autotune raises on purpose, and every usage error, ends as one line on stderr
and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated, Any, Optional

import typer

from autotune.errors import AutotuneError, ConfigError
from autotune.knobs import TrialConfig
from autotune.workload import DEFAULT_MODEL, Workload

app = typer.Typer(
    name="autotune",
    help="Find the fastest training configuration of a PyTorch model that fits on this hardware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _help(cls: type, name: str) -> str:
    """CLI help comes from the dataclass field, the same text the API documents."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


# -- shared options: the workload ----------------------------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", help=_help(Workload, "model"))]
TaskOpt = Annotated[Optional[str], typer.Option("--task", help=_help(Workload, "task"))]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help=_help(Workload, "seq_len"))]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", help=_help(Workload, "global_batch"))]
NprocOpt = Annotated[int, typer.Option("--nproc", help=_help(Workload, "nproc"))]
DeviceOpt = Annotated[str, typer.Option("--device", help=_help(Workload, "device"))]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help=_help(Workload, "trust_remote_code"))]
# -- the knobs -----------------------------------------------------------------------------
MicroBatchOpt = Annotated[int, typer.Option("--micro-batch", help=_help(TrialConfig, "micro_batch"))]
PrecisionOpt = Annotated[str, typer.Option("--precision", help=_help(TrialConfig, "precision"))]
CheckpointingOpt = Annotated[str, typer.Option("--checkpointing", help="off or on. " + _help(TrialConfig, "checkpointing"))]
LoraRankOpt = Annotated[Optional[int], typer.Option("--lora-rank", help=_help(TrialConfig, "lora_rank"))]
LoraAlphaOpt = Annotated[Optional[int], typer.Option("--lora-alpha", help=_help(TrialConfig, "lora_alpha"))]
LoraTargetsOpt = Annotated[Optional[str], typer.Option("--lora-targets", help=_help(TrialConfig, "lora_targets"))]
ZeroStageOpt = Annotated[str, typer.Option("--zero-stage", help=_help(TrialConfig, "zero_stage"))]
OffloadOpt = Annotated[str, typer.Option("--offload", help=_help(TrialConfig, "offload"))]
# -- measuring -----------------------------------------------------------------------------
BudgetOpt = Annotated[Optional[str], typer.Option(
    "--memory-budget", help="Memory a trial may use, e.g. 512MiB or 24GiB; enforced for real (OOM beyond it).")]
TimeoutOpt = Annotated[float, typer.Option("--trial-timeout", help="Seconds before a trial is killed (status timeout).")]
WarmupOpt = Annotated[int, typer.Option("--warmup-steps", help="Untimed optimizer steps before measuring.")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Timed optimizer steps.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def _on_off(value: str, flag: str) -> bool:
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{flag} {value!r} must be on or off")


def _zero_stage(value: str) -> int | None:
    if value.lower() in ("off", "none"):
        return None
    if value.isdigit():
        return int(value)
    raise ConfigError(f"--zero-stage {value!r} is not known; use off, 0, 1, 2 or 3")


@app.command()
def trial(
    model: ModelOpt = DEFAULT_MODEL,
    task: TaskOpt = None,
    seq_len: SeqLenOpt = 128,
    global_batch: GlobalBatchOpt = 16,
    nproc: NprocOpt = 1,
    device: DeviceOpt = "auto",
    trust_remote_code: TrustOpt = False,
    micro_batch: MicroBatchOpt = 1,
    precision: PrecisionOpt = "fp32",
    checkpointing: CheckpointingOpt = "off",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    zero_stage: ZeroStageOpt = "off",
    offload: OffloadOpt = "none",
    memory_budget: BudgetOpt = None,
    trial_timeout: TimeoutOpt = 600.0,
    warmup_steps: WarmupOpt = 1,
    steps: StepsOpt = 3,
    as_json: JsonOpt = False,
) -> int:
    """Measure one training configuration in a fresh process.

    Exit status: 0 when the trial trained (ok), 1 when it ended otherwise (oom, timeout, crashed, nan, error), 2 when the input was refused before running.
    """
    from autotune.runner import run_trial
    from autotune.sizes import parse_size

    workload = Workload(model=model, task=task, seq_len=seq_len, global_batch=global_batch, nproc=nproc,
                        device=device, trust_remote_code=trust_remote_code)
    config = TrialConfig(
        micro_batch=micro_batch, precision=precision, checkpointing=_on_off(checkpointing, "--checkpointing"),
        lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_targets=tuple(t.strip() for t in lora_targets.split(",")) if lora_targets is not None else None,
        zero_stage=_zero_stage(zero_stage), offload=offload)
    if trial_timeout <= 0:
        raise ConfigError(f"--trial-timeout {trial_timeout:g} must be more than 0 seconds")
    if warmup_steps < 0 or steps < 1:
        raise ConfigError("--warmup-steps must be 0 or more and --steps at least 1")
    budget = parse_size(memory_budget) if memory_budget is not None else None
    result = run_trial(workload, config, memory_budget_bytes=budget, timeout_s=trial_timeout,
                       warmup_steps=warmup_steps, measure_steps=steps)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        from autotune.render import print_trial

        print_trial(workload, result)
    return 0 if result.ok else 1


@app.command()
def models(as_json: JsonOpt = False) -> int:
    """List the built-in models (use them as --model builtin:NAME)."""
    from autotune.presets import PRESETS

    if as_json:
        print(json.dumps({name: {"task": p.task, "summary": p.summary} for name, p in PRESETS.items()}))
        return 0
    for name, preset in PRESETS.items():
        print(f"builtin:{name:<16} {preset.task:<10} {preset.summary}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m autotune``."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="autotune", standalone_mode=False)
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # Click's usage errors: unknown flag, bad value, ...
        ctx = getattr(exc, "ctx", None)
        where = f"autotune {ctx.info_name}" if ctx is not None and ctx.info_name != "autotune" else "autotune"
        message = " ".join(exc.format_message().split())
        print(f"{where}: error: {message}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    return code if isinstance(code, int) else 0


def run() -> None:
    sys.exit(main())
