"""The ``autotune`` command line: parse, call the Python API, render. Nothing else lives here.

Every error autotune raises on purpose, and every usage error, ends as one line on stderr
and exit status 2.

Each option is declared once, in :data:`OPTIONS` (help text from the dataclass fields where
there is one); a command names the options it takes by its parameters (see :func:`command`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import sys
from typing import Annotated, Any, Callable, Optional

import typer

from autotune.config.knobs import TrialConfig
from autotune.config.workload import DEFAULT_MODEL, Workload
from autotune.errors import AutotuneError, ConfigError

# torchao (8-bit AdamW) warns on import about each CUDA-only kernel library it cannot load, and torch's pytree
# about the Enums torchao registers: noise on every command once it is installed (Transformers imports it).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
# bitsandbytes (a quantized base) warns on import, on a CPU with bf16 instructions, that its optional inference
# kernel package is missing: training never uses that kernel.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

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


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option: its type as typed, its default, its flags and help."""

    type: Any
    default: Any
    flags: tuple[str, ...]
    help: str

    def parameter(self, name: str) -> inspect.Parameter:
        return inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=self.default,
            annotation=Annotated[self.type, typer.Option(*self.flags, help=self.help)],
        )


_REQUIRED = inspect.Parameter.empty

# -- the workload: what is trained, on what (a command's ``workload`` parameter) -------------------
WORKLOAD_OPTIONS = {
    "model": Option(str, DEFAULT_MODEL, ("--model",), _help(Workload, "model")),
    "task": Option(Optional[str], None, ("--task",), _help(Workload, "task")),
    "seq_len": Option(int, 128, ("--seq-len",), _help(Workload, "seq_len")),
    "target_len": Option(Optional[int], None, ("--target-len",), _help(Workload, "target_len")),
    "image_size": Option(Optional[int], None, ("--image-size",), _help(Workload, "image_size")),
    "global_batch": Option(int, 16, ("--global-batch",), _help(Workload, "global_batch")),
    "nproc": Option(int, 1, ("--nproc",), _help(Workload, "nproc")),
    "device": Option(str, "auto", ("--device",), _help(Workload, "device")),
    "trust_remote_code": Option(bool, False, ("--trust-remote-code",), _help(Workload, "trust_remote_code")),
}
# -- the knobs: one training configuration (a command's ``config`` parameter) ----------------------
KNOB_OPTIONS = {
    "micro_batch": Option(int, 1, ("--micro-batch",), _help(TrialConfig, "micro_batch")),
    "precision": Option(str, "fp32", ("--precision",), _help(TrialConfig, "precision")),
    "checkpointing": Option(
        str,
        "off",
        ("--checkpointing",),
        "off, on, or every-N (every N-th decoder layer). " + _help(TrialConfig, "checkpointing"),
    ),
    "loss": Option(str, "standard", ("--loss",), _help(TrialConfig, "loss")),
    "attention": Option(str, "auto", ("--attention",), _help(TrialConfig, "attention")),
    "fused_optimizer": Option(
        str, "off", ("--fused-optimizer",), "off or on. " + _help(TrialConfig, "fused_optimizer")
    ),
    "optimizer": Option(str, "adamw", ("--optimizer",), _help(TrialConfig, "optimizer")),
    "optimizer_in_backward": Option(
        str, "off", ("--optimizer-in-backward",), "off or on. " + _help(TrialConfig, "optimizer_in_backward")
    ),
    "activation_offload": Option(
        str, "off", ("--activation-offload",), "off or on. " + _help(TrialConfig, "activation_offload")
    ),
    "compile": Option(str, "off", ("--compile",), "off or on. " + _help(TrialConfig, "compile")),
    "lora_rank": Option(Optional[int], None, ("--lora-rank",), _help(TrialConfig, "lora_rank")),
    "lora_alpha": Option(Optional[int], None, ("--lora-alpha",), _help(TrialConfig, "lora_alpha")),
    "lora_targets": Option(Optional[str], None, ("--lora-targets",), _help(TrialConfig, "lora_targets")),
    "quantize_base": Option(str, "off", ("--quantize-base",), _help(TrialConfig, "quantize_base")),
    "zero_stage": Option(str, "off", ("--zero-stage",), _help(TrialConfig, "zero_stage")),
    "fsdp": Option(str, "off", ("--fsdp",), _help(TrialConfig, "fsdp")),
    "offload": Option(str, "none", ("--offload",), _help(TrialConfig, "offload")),
    "tp": Option(int, 1, ("--tp",), _help(TrialConfig, "tp")),
    "sequence_parallel": Option(
        str, "off", ("--sequence-parallel",), "off or on. " + _help(TrialConfig, "sequence_parallel")
    ),
    "pp": Option(int, 1, ("--pp",), _help(TrialConfig, "pp")),
    "pp_schedule": Option(str, "1f1b", ("--pp-schedule",), _help(TrialConfig, "pp_schedule")),
}
# -- every other option shared by commands: a command takes one by naming its parameter so --------
OPTIONS = {
    # measuring
    "memory_budget": Option(
        Optional[str],
        None,
        ("--memory-budget",),
        "Memory a trial may use, e.g. 512MiB or 24GiB; enforced for real (OOM beyond it).",
    ),
    "trial_timeout": Option(float, 600.0, ("--trial-timeout",), "Seconds before a trial is killed (status timeout)."),
    "warmup_steps": Option(int, 1, ("--warmup-steps",), "Untimed optimizer steps before measuring."),
    "steps": Option(int, 3, ("--steps",), "Timed optimizer steps."),
    "as_json": Option(bool, False, ("--json",), "Print one JSON object instead of a table."),
    "gpu": Option(Optional[str], None, ("--gpu",), _help(Workload, "gpu") + " --memory-budget defaults to its memory."),
    # tuning
    "space": Option(
        str,
        "default",
        ("--space",),
        "Search space: a preset (default, full, lean, lora, parallel, quick, sharding) or a YAML file.",
    ),
    "n_trials": Option(
        Optional[int],
        None,
        ("--n-trials",),
        "Measured trials the study should hold (default: the space's); an unfinished study carries on to it.",
    ),
    "timeout": Option(Optional[float], None, ("--timeout",), "Stop starting trials after this many seconds."),
    "max_time": Option(
        Optional[str],
        None,
        ("--max-time",),
        "End the whole command within this time (e.g. 60s, 5m, 1h): the search stops early enough to "
        "confirm the best so far, and says what stayed untried.",
    ),
    "patience": Option(
        Optional[int],
        None,
        ("--patience",),
        "Stop after this many trials without a faster config that fits (default: the space's).",
    ),
    "headroom": Option(
        float, 0.1, ("--headroom",), "A config fits when its peak stays this fraction under the budget (0.1 = 10%)."
    ),
    "estimate": Option(
        bool,
        True,
        ("--estimate/--no-estimate",),
        "Skip configs the memory estimator predicts more than 5% over the limit.",
    ),
    "workers": Option(
        int,
        1,
        ("--workers",),
        "Tuning processes on the study (each on its own GPUs when there are "
        "several); workers on other machines join through the same --storage URL.",
    ),
    "confirm": Option(
        bool,
        True,
        ("--confirm/--no-confirm",),
        "Re-run the winner longer at the end (leave it on for one worker of a study).",
    ),
    # where the workers run
    "executor": Option(
        str,
        "local",
        ("--executor",),
        "local: the --workers are processes on this machine; slurm: each worker is a SLURM job holding "
        "one trial's nodes, GPUs and ranks (needs a journal or PostgreSQL --storage).",
    ),
    "nodes": Option(int, 1, ("--nodes",), "Nodes one trial spans (--executor slurm); --nproc counts its ranks in all."),
    "gpus_per_node": Option(Optional[int], None, ("--gpus-per-node",), "GPUs each worker job asks for per node."),
    "partition": Option(Optional[str], None, ("--partition",), "SLURM partition of the worker jobs."),
    "account": Option(Optional[str], None, ("--account",), "SLURM account the worker jobs are charged to."),
    "slurm_time": Option(Optional[str], None, ("--time",), "Time limit of each worker job, as sbatch takes it."),
    "qos": Option(Optional[str], None, ("--qos",), "SLURM quality of service of the worker jobs."),
    "constraint": Option(Optional[str], None, ("--constraint",), "SLURM node features the worker jobs need."),
    "slurm_signal": Option(
        Optional[str],
        None,
        ("--signal",),
        "Signal SLURM sends a worker before its time limit or preemption (default B:USR1@120): its "
        "running trial is recorded as interrupted and the job requeues itself.",
    ),
    "slurm_option": Option(
        Optional[list[str]],
        None,
        ("--slurm-option",),
        "Any other sbatch option as KEY=VALUE (repeat it), e.g. --slurm-option mem=64G.",
    ),
    # studies
    "study": Option(str, _REQUIRED, ("--study",), "Study name (autotune studies lists them)."),
    "storage": Option(
        Optional[str],
        None,
        ("--storage",),
        "Where the study lives: a SQLAlchemy URL (default sqlite:///storage/autotune.db, under the current "
        "directory; postgresql://... for workers on several machines) or journal:///shared/path/study.log "
        "(a journal file on a shared file system).",
    ),
    "fmt": Option(
        str,
        "json",
        ("--format",),
        "json, yaml, deepspeed, hf, accelerate, lightning, peft, bnb (BitsAndBytesConfig's arguments for a "
        "quantized base), or launch (a bash script that starts your training script with the trials' ranks and "
        "nodes).",
    ),
}
_OUTPUT_HELP = (
    "a directory (existing, or ending in /) gets the format's usual file name inside it; --format peft "
    "writes DIR/adapter_config.json unless the name ends in .json."
)


def _on_off(value: str, flag: str) -> bool:
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{flag} {value!r} must be on or off")


def _checkpointing(value: str) -> dict[str, Any]:
    kind, _, every = value.lower().partition("-")
    if kind == "every":
        if not every.isdigit() or int(every) < 2:
            raise ConfigError(
                f"--checkpointing {value!r}: write every-N with N a whole number of 2 or more, e.g. every-2"
            )
        return {"checkpointing": True, "checkpoint_every": int(every)}
    try:
        return {"checkpointing": _on_off(value, "--checkpointing")}
    except ConfigError:
        raise ConfigError(f"--checkpointing {value!r} must be on, off or every-N (e.g. every-2)") from None


def _zero_stage(value: str) -> int | None:
    if value.lower() in ("off", "none"):
        return None
    if value.isdigit():
        return int(value)
    raise ConfigError(f"--zero-stage {value!r} is not known; use off, 0, 1, 2 or 3")


def _knobs(
    micro_batch: int,
    precision: str,
    checkpointing: str,
    loss: str,
    attention: str,
    fused_optimizer: str,
    optimizer: str,
    optimizer_in_backward: str,
    activation_offload: str,
    compile: str,
    lora_rank: int | None,
    lora_alpha: int | None,
    lora_targets: str | None,
    quantize_base: str,
    zero_stage: str,
    fsdp: str,
    offload: str,
    tp: int,
    sequence_parallel: str,
    pp: int,
    pp_schedule: str,
) -> TrialConfig:
    return TrialConfig(
        micro_batch=micro_batch,
        precision=precision,
        **_checkpointing(checkpointing),
        loss=loss,
        attention=attention,
        fused_optimizer=_on_off(fused_optimizer, "--fused-optimizer"),
        optimizer=optimizer,
        optimizer_in_backward=_on_off(optimizer_in_backward, "--optimizer-in-backward"),
        activation_offload=_on_off(activation_offload, "--activation-offload"),
        compile=_on_off(compile, "--compile"),
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=tuple(t.strip() for t in lora_targets.split(",")) if lora_targets is not None else None,
        quantize_base=quantize_base,
        zero_stage=_zero_stage(zero_stage),
        fsdp=None if fsdp.lower() in ("off", "none") else fsdp.lower(),
        offload=offload,
        tp=tp,
        sequence_parallel=_on_off(sequence_parallel, "--sequence-parallel"),
        pp=pp,
        pp_schedule=pp_schedule,
    )


# A command's parameter by one of these names takes the whole group, built into one object.
_GROUPS: dict[str, tuple[dict[str, Option], Callable[..., Any]]] = {
    "workload": (WORKLOAD_OPTIONS, Workload),
    "config": (KNOB_OPTIONS, _knobs),
}


def command(fn: Callable[..., int]) -> Callable[..., int]:
    """Register ``fn`` as a command. Its parameters say which options it takes: ``workload`` and
    ``config`` take the workload and knob options (built into a Workload and a TrialConfig), a name
    in :data:`OPTIONS` takes that option; a parameter annotated with its own ``typer.Option`` is an
    option of this command alone."""
    parameters: list[inspect.Parameter] = []
    for parameter in inspect.signature(fn, eval_str=True).parameters.values():
        if parameter.name in _GROUPS:
            parameters += [option.parameter(name) for name, option in _GROUPS[parameter.name][0].items()]
        elif parameter.name in OPTIONS and not _own_option(parameter):
            parameters.append(OPTIONS[parameter.name].parameter(parameter.name))
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(fn)
    def parsed(**values: Any) -> int:
        for group, (options, build) in _GROUPS.items():
            if group in wanted:
                values[group] = build(**{name: values.pop(name) for name in options})
        return fn(**values)

    wanted = inspect.signature(fn).parameters
    parsed.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what Typer reads
    parsed.__annotations__ = {p.name: p.annotation for p in parameters}
    return app.command(name=fn.__name__.rstrip("_"))(parsed)  # run_: the command run


def _own_option(parameter: inspect.Parameter) -> bool:
    return any(isinstance(meta, typer.models.OptionInfo) for meta in getattr(parameter.annotation, "__metadata__", ()))


# A user's own training command, after --: script mode (trial, find, tune).
_Script = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="[-- COMMAND...]",
        show_default=False,
        help="Your own training command, after --, run unchanged for each trial: its optimizer steps are timed, the "
        "config is in AUTOTUNE_CONFIG (autotune.current_config()), the workload options say what one step trains.",
    ),
]


@command
def trial(
    workload: Workload,
    config: TrialConfig,
    memory_budget: Optional[str],
    trial_timeout: float,
    warmup_steps: int,
    steps: int,
    as_json: bool,
    script: _Script = None,
) -> int:
    """Measure one training configuration in a fresh process: autotune's own step on the model, or your command.

    Exit status: 0 when the trial trained (ok), 1 when it ended otherwise (oom, timeout, crashed, nan, error),
    2 when the input was refused before running.
    """
    from autotune.sizes import parse_size

    if trial_timeout <= 0:
        raise ConfigError(f"--trial-timeout {trial_timeout:g} must be more than 0 seconds")
    if warmup_steps < 0 or steps < 1:
        raise ConfigError("--warmup-steps must be 0 or more and --steps at least 1")
    budget = parse_size(memory_budget) if memory_budget is not None else None
    if script:
        from autotune.scripts.runner import run_script_trial

        result = run_script_trial(
            list(script),
            workload,
            config,
            memory_budget_bytes=budget,
            timeout_s=trial_timeout,
            warmup_steps=warmup_steps,
            measure_steps=steps,
        )
    else:
        from autotune.trial.runner import run_trial

        _start_trial_server()  # its imports overlap the model and device checks run_trial starts with
        result = run_trial(
            workload,
            config,
            memory_budget_bytes=budget,
            timeout_s=trial_timeout,
            warmup_steps=warmup_steps,
            measure_steps=steps,
        )
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        from autotune.output.render import print_trial

        print_trial(workload, result, command=list(script) if script else None)
    return 0 if result.ok else 1


@command
def find(
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    n_trials: Optional[int],
    timeout: Optional[float],
    max_time: Optional[str],
    trial_timeout: float,
    headroom: float,
    storage: Optional[str],
    estimate: bool,
    warmup_steps: int,
    steps: int,
    export: Annotated[
        Optional[str], typer.Option("--export", help="Also write the best config in this format (see autotune export).")
    ] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="File for --export; " + _OUTPUT_HELP)] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Run nothing: rank every config of the space predicted to fit the card (--gpu) by "
            "predicted throughput, with memory, MFU and the configs to verify first.",
        ),
    ] = False,
    gpu: Optional[str] = None,
    as_json: bool = False,
    workers: int = 1,
    executor: str = "local",
    nodes: int = 1,
    gpus_per_node: Optional[int] = None,
    partition: Optional[str] = None,
    account: Optional[str] = None,
    slurm_time: Optional[str] = None,
    qos: Optional[str] = None,
    constraint: Optional[str] = None,
    slurm_signal: Optional[str] = None,
    slurm_option: Optional[list[str]] = None,
    script: _Script = None,
) -> int:
    """Find the fastest config that fits: asking the same question again answers from its study.

    Exit status: 0 with a confirmed config (--plan: with one predicted to fit), 1 when none fits, 2 when the
    input was refused.
    """
    from autotune.search.tuner import find as find_config

    if gpu is not None:
        workload = workload.replace(gpu=gpu)  # checks the name, and that the device is CUDA
    if plan:
        return _plan(
            workload,
            space=space,
            memory_budget=memory_budget,
            headroom=headroom,
            as_json=as_json,
            script=script,
            export=export,
        )
    if workload.gpu is not None:
        raise ConfigError(
            f"--gpu {workload.gpu} names a card to plan for, and find without --plan runs trials on "
            "the device here: add --plan, or leave --gpu out"
        )
    if export is not None:
        _check_format(export)
    elif output is not None:
        raise ConfigError("-o/--output is the file for --export; add --export FORMAT")
    resources = _slurm_resources(
        executor,
        workload=workload,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        partition=partition,
        account=account,
        slurm_time=slurm_time,
        qos=qos,
        constraint=constraint,
        slurm_signal=slurm_signal,
        slurm_option=slurm_option,
        script=script,
    )
    if resources is not None:
        spec = _worker_spec(
            workload=workload.replace(nodes=nodes),  # the study's question says the nodes: exports carry them
            space=space,
            memory_budget=memory_budget,
            n_trials=n_trials,
            timeout=timeout,
            trial_timeout=trial_timeout,
            patience=None,
            headroom=headroom,
            storage=storage,
            estimate=estimate,
            warmup_steps=warmup_steps,
            steps=steps,
            script=script,
        )
        summary = _on_slurm(None, spec, workers=workers, confirm=True, resources=resources, storage=storage)
        written = _export_best(summary, export, output) if export is not None and summary.best else None
        return _finish(summary, as_json=as_json, exported=written, wanted_export=export)
    if workers != 1:
        raise ConfigError(f"--workers {workers} on find is for --executor slurm; use autotune tune --workers here")
    if not script:
        _start_trial_server(estimate=estimate)
    with _progress(quiet=as_json) as progress:
        summary = find_config(
            workload=workload,
            space=space,
            memory_budget_bytes=_size(memory_budget),
            n_trials=n_trials,
            timeout_s=timeout,
            max_time_s=_duration(max_time, "--max-time"),
            trial_timeout_s=trial_timeout,
            headroom=headroom,
            storage=storage,
            estimate=estimate,
            warmup_steps=warmup_steps,
            measure_steps=steps,
            progress=progress,
            command=list(script) if script else None,
        )
    written = _export_best(summary, export, output) if export is not None and summary.best else None
    return _finish(summary, as_json=as_json, exported=written, wanted_export=export)


def _plan(
    workload: Workload,
    *,
    space: str,
    memory_budget: Optional[str],
    headroom: float,
    as_json: bool,
    script: Optional[list[str]],
    export: Optional[str],
) -> int:
    from autotune.search.plan import plan_space

    if script:
        raise ConfigError(
            "--plan predicts from autotune's own trace of the model, and a training command cannot be "
            "traced: drop the command after -- (and give --model), or drop --plan"
        )
    if export is not None:
        raise ConfigError(
            "--export writes a measured config; a plan has none yet: drop --export, or run find "
            "without --plan on the card"
        )
    budget = _size(memory_budget)
    if workload.gpu is not None:
        budget = _within_card(budget, _estimated_device(workload))
    from autotune.estimate.client import start_estimate_server

    start_estimate_server()  # its imports beside the model and space checks

    live = sys.stderr.isatty()  # a terminal sees one line counting up; a log, a line per tenth

    def progress(done: int, total: int) -> None:
        if as_json:
            return
        if live:
            print(f"\rplanning: {done}/{total} families estimated", end="", file=sys.stderr, flush=True)
        elif done == total or done % max(1, total // 10) == 0:
            print(f"planning: {done}/{total} families estimated", file=sys.stderr, flush=True)

    result = plan_space(
        workload=workload, space=space, memory_budget_bytes=budget, headroom=headroom, progress=progress
    )
    if live and not as_json:
        print(file=sys.stderr)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        from autotune.output.render import print_plan

        print_plan(result, workload)
    return 0 if result.rows else 1


@command
def tune(
    study: str,
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    n_trials: Optional[int],
    timeout: Optional[float],
    max_time: Optional[str],
    trial_timeout: float,
    patience: Optional[int],
    headroom: float,
    storage: Optional[str],
    estimate: bool,
    warmup_steps: int,
    steps: int,
    workers: int,
    confirm: bool,
    as_json: bool,
    executor: str,
    nodes: int,
    gpus_per_node: Optional[int],
    partition: Optional[str],
    account: Optional[str],
    slurm_time: Optional[str],
    qos: Optional[str],
    constraint: Optional[str],
    slurm_signal: Optional[str],
    slurm_option: Optional[list[str]],
    stop_on_evidence: Annotated[
        bool,
        typer.Option(
            "--stop-on-evidence/--measure-all",
            help="Stop when no untried config is predicted to beat the best by more than the noise; "
            "--measure-all measures configs until --n-trials, --patience or the space runs out.",
        ),
    ] = True,
    script: _Script = None,
) -> int:
    """Tune a named study; stop it any time (Ctrl-C) and run the same command to carry on.

    Exit status: 0 with a confirmed config (with --no-confirm: with any that fits), 1 when none fits, 2 when
    the input was refused, 130 when interrupted.
    """
    from autotune.search.tuner import tune as tune_study

    resources = _slurm_resources(
        executor,
        workload=workload,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        partition=partition,
        account=account,
        slurm_time=slurm_time,
        qos=qos,
        constraint=constraint,
        slurm_signal=slurm_signal,
        slurm_option=slurm_option,
        script=script,
    )
    if resources is not None:
        spec = _worker_spec(
            workload=workload.replace(nodes=nodes),  # the study's question says the nodes: exports carry them
            space=space,
            memory_budget=memory_budget,
            n_trials=n_trials,
            timeout=timeout,
            trial_timeout=trial_timeout,
            patience=patience,
            stop_on_evidence=stop_on_evidence,
            headroom=headroom,
            storage=storage,
            estimate=estimate,
            warmup_steps=warmup_steps,
            steps=steps,
            script=script,
        )
        summary = _on_slurm(study, spec, workers=workers, confirm=confirm, resources=resources, storage=storage)
        return _finish(summary, as_json=as_json, confirmed=confirm)
    if not script and workers == 1:  # several workers each start their own
        _start_trial_server(estimate=estimate)
    with _progress(quiet=as_json) as progress:
        summary = tune_study(
            study=study,
            workload=workload,
            space=space,
            memory_budget_bytes=_size(memory_budget),
            n_trials=n_trials,
            timeout_s=timeout,
            max_time_s=_duration(max_time, "--max-time"),
            trial_timeout_s=trial_timeout,
            patience=patience,
            stop_on_evidence=stop_on_evidence,
            headroom=headroom,
            storage=storage,
            warmup_steps=warmup_steps,
            measure_steps=steps,
            estimate=estimate,
            workers=workers,
            confirm=confirm,
            progress=progress,
            command=list(script) if script else None,
        )
    return _finish(summary, as_json=as_json, confirmed=confirm)


@command
def grid(
    output: Annotated[str, typer.Option("-o", "--output", help="The .jsonl file to write (appended to).")],
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    trial_timeout: float,
    warmup_steps: int,
    steps: int,
    estimate: bool,
    re_estimate: Annotated[
        bool,
        typer.Option(
            "--re-estimate",
            help="Estimate every line again, not only those without an estimate (after the estimator changed).",
        ),
    ] = False,
) -> int:
    """Measure every config of a space, one `autotune trial --json` line each (for replaying searches).

    A stopped grid keeps its lines; the same command measures only the configs still missing.
    Each line then gets the memory estimator's prediction for its config (--no-estimate: not).
    """
    from pathlib import Path

    from autotune.search.grid import estimate_grid, measure_grid
    from autotune.search.space import load_space
    from autotune.sizes import format_size
    from autotune.trial.result import TrialResult

    if trial_timeout <= 0:
        raise ConfigError(f"--trial-timeout {trial_timeout:g} must be more than 0 seconds")
    if re_estimate and not estimate:
        raise ConfigError("--re-estimate and --no-estimate contradict each other: drop one")

    def report(index: int, total: int, line: dict[str, Any]) -> None:
        result = TrialResult.from_dict(line)
        figure = f"{result.throughput:,.1f} {result.throughput_unit}" if result.throughput else "no figure"
        print(
            f"{index}/{total} {TrialConfig.from_dict(line['config']).describe()}: {line['status']}, {figure}, "
            f"{line['trial_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def report_estimate(index: int, total: int, line: dict[str, Any]) -> None:
        estimate = line["estimate"]
        figure = (
            format_size(estimate["predicted_peak_bytes"]) if "predicted_peak_bytes" in estimate else estimate["error"]
        )
        print(
            f"estimate {index}/{total} {TrialConfig.from_dict(line['config']).describe()}: {figure}, "
            f"{line['estimate_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    measured = measure_grid(
        workload,
        load_space(space),
        Path(output),
        memory_budget_bytes=_size(memory_budget),
        trial_timeout_s=trial_timeout,
        warmup_steps=warmup_steps,
        measure_steps=steps,
        on_trial=report,
    )
    print(f"{output}: {measured} config(s) measured now", file=sys.stderr)
    if estimate:
        estimated = estimate_grid(Path(output), on_estimate=report_estimate, again=re_estimate)
        print(f"{output}: {estimated} config(s) estimated now", file=sys.stderr)
    return 0


# -- reading studies -----------------------------------------------------------------------------
@command
def studies(storage: Optional[str], as_json: bool) -> int:
    """List the studies in the storage, with their trial counts and best configs."""
    from autotune.study.records import load_summaries

    rows = load_summaries(storage)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "study": s.name,
                        "model": s.workload.model,
                        "n_trials": s.n_trials,
                        "best": s.best.config.describe() if s.best else None,
                        "tokens_per_s": s.best.confirmed_tokens_per_s if s.best else None,
                        "throughput": s.best.confirmed_throughput if s.best else None,
                        "throughput_unit": s.throughput_unit,
                        "worker_jobs": s.worker_jobs,
                    }
                    for s in rows
                ]
            )
        )
        return 0
    if not rows:
        print("no autotune studies here yet; run autotune find")
    for s in rows:
        best = (
            f"{s.best.config.describe()} ({s.best.confirmed_throughput:,.1f} {s.throughput_unit})"
            if s.best
            else "no confirmed config"
        )
        print(f"{s.name}  {s.workload.model}  {s.n_trials} trials  best: {best}")
        if s.worker_jobs:
            from autotune.output.render import worker_jobs_line

            print(f"  workers: {worker_jobs_line(s.worker_jobs)}")
    return 0


@command
def show(study: str, storage: Optional[str], as_json: bool) -> int:
    """Every trial of a study (config, status, tokens/s, peak memory) and its best config."""
    summary = _summary(study, storage)
    if as_json:
        print(json.dumps(summary.to_dict()))
        return 0
    from autotune.output.render import print_summary

    print_summary(summary)
    return 0


@command
def export(
    study: str,
    fmt: str,
    output: Annotated[
        Optional[str], typer.Option("-o", "--output", help="File to write (default: print it); " + _OUTPUT_HELP)
    ] = None,
    storage: Optional[str] = None,
) -> int:
    """Write a study's best config in the format a training job reads."""
    _check_format(fmt)
    summary = _summary(study, storage)
    if summary.best is None:
        unconfirmed = any(t.status == "ok" and t.fits and t.confirmed is None for t in summary.trials)
        raise ConfigError(
            f"--study {study} has no confirmed config yet; run autotune tune --study {study} "
            + ("(without --no-confirm) to confirm its fastest fitting config" if unconfirmed else "first")
        )
    if output is None:
        if fmt == "accelerate" and summary.best.config.uses_deepspeed:
            raise ConfigError(
                f"--format accelerate: {summary.best.config.describe()} is two files, the Accelerate "
                "YAML and the DeepSpeed config it names; add -o accelerate_config.yaml to write both"
            )
        print(_export_text(summary, fmt), end="")
    else:
        print(
            f"wrote {', '.join(_export_best(summary, fmt, output))} ({fmt}: {summary.best.config.describe()})",
            file=sys.stderr,
        )
    print(_trains_line(summary.best.config, fmt, summary.workload), file=sys.stderr)
    if summary.workload.nodes > 1 and fmt != "launch":  # deepspeed and hf cannot say it in their files
        w = summary.workload
        print(
            f"nodes: {w.nodes}, {w.ranks_per_node} ranks on each: autotune export --study {study} --format launch "
            "writes the script that starts them",
            file=sys.stderr,
        )
    if fmt in ("json", "yaml") and output is not None and summary.command:
        print(f"train with it: {_train_with(summary, output)}", file=sys.stderr)
    return 0


@command
def run_(
    config_file: Annotated[
        str,
        typer.Option(
            "--config", help="An autotune export (--format json or yaml): the config and the workload it was tuned for."
        ),
    ],
    script: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="-- COMMAND...",
            show_default=False,
            help="Your training command, after --: run to its end with the config handed to it as the trials did.",
        ),
    ] = None,
) -> int:
    """Train with a tuned config: run your command with it, as its script-mode trials ran it, unmeasured.

    The config reaches the command the way it reached each trial: AUTOTUNE_CONFIG for a plain loop
    (autotune.current_config()), and a Trainer's TrainingArguments, a Lightning Trainer's and an
    Accelerator's arguments set for it. Exit status: the command's own; 2 when the input was refused.
    """
    from pathlib import Path

    from autotune.prepare.apply import read_export
    from autotune.scripts.runner import run_with_config

    data, workload = read_export(Path(config_file), reader="--config")
    if workload is None:
        raise ConfigError(f"--config {config_file} has no workload; write it with autotune export --format json")
    return run_with_config(list(script or []), TrialConfig.from_dict(data), workload)


def _train_with(summary: Any, export: str | None) -> str | None:
    """For a study of the user's command: the line that trains it with the answer (given its export)."""
    if not summary.command:
        return None
    from autotune.scripts.runner import command_with_config

    return command_with_config(summary.command, export or "autotune.json")


def _trains_line(config: TrialConfig, fmt: str, workload: Workload | None = None) -> str:
    """Precision and LoRA change what is trained: say so beside every export (with the workload,
    also which layers LoRA adapts)."""
    from autotune.output.exporters import in_code
    from autotune.study.summary import what_is_trained

    line = f"trains: {what_is_trained(config, workload)['note']}"
    if config.uses_lora and fmt != "peft":
        line += " (the adapters: autotune export --format peft)"
    return "\n".join([line, *in_code(config, workload)])


@command
def report(
    study: str,
    output: Annotated[str, typer.Option("-o", "--output", help="The HTML file to write.")] = "report.html",
    storage: Optional[str] = None,
) -> int:
    """An HTML report: throughput per trial, memory against throughput, knob importance."""
    from autotune.output.report import write_report

    path = write_report(_summary(study, storage, with_importances=True), output)
    print(f"wrote {path}", file=sys.stderr)
    return 0


# -- helpers of the commands ---------------------------------------------------------------------
def _slurm_resources(executor: str, *, workload: Workload, nodes: int, script: list[str] | None, **slurm: Any) -> Any:
    """What each SLURM worker job holds (None: the local executor, where the SLURM flags are refused)."""
    if script and nodes > 1:
        from autotune.scripts.runner import SCRIPT_NODES_REFUSAL

        raise ConfigError(SCRIPT_NODES_REFUSAL.format(nodes=nodes))
    flags = {
        "gpus_per_node": "--gpus-per-node",
        "partition": "--partition",
        "account": "--account",
        "slurm_time": "--time",
        "qos": "--qos",
        "constraint": "--constraint",
        "slurm_signal": "--signal",
        "slurm_option": "--slurm-option",
    }
    if executor == "local":
        if nodes != 1:
            raise ConfigError(
                f"--nodes {nodes}: the local executor runs a trial's ranks on this machine only; "
                "add --executor slurm, or drop --nodes"
            )
        given = [flag for name, flag in flags.items() if slurm[name]]
        if given:
            raise ConfigError(f"{given[0]} is a SLURM job's option: add --executor slurm, or drop {given[0]}")
        return None
    if executor != "slurm":
        raise ConfigError(f"--executor {executor!r} is not known; use local or slurm")
    from autotune.search.slurm import SlurmResources, parse_slurm_options

    resources = SlurmResources(
        nodes=nodes,
        nproc=workload.nproc,
        gpus_per_node=slurm["gpus_per_node"],
        partition=slurm["partition"],
        account=slurm["account"],
        time=slurm["slurm_time"],
        qos=slurm["qos"],
        constraint=slurm["constraint"],
        options=parse_slurm_options(slurm["slurm_option"] or []),
    )
    if slurm["slurm_signal"] is not None:
        resources = dataclasses.replace(resources, signal=slurm["slurm_signal"])
    return resources


def _worker_spec(
    *,
    workload: Workload,
    space: str,
    memory_budget: str | None,
    timeout: float | None,
    trial_timeout: float,
    steps: int,
    script: Optional[list[str]],
    **rest: Any,
) -> dict[str, Any]:
    """What each SLURM worker tunes (the arguments of autotune.tune), as JSON. A space file keeps the
    name it was given: the jobs start in the submitting directory (sbatch's default), as a local run would."""
    return {
        "workload": workload.to_dict(),
        "space": space,
        "memory_budget_bytes": _size(memory_budget),
        "timeout_s": timeout,
        "trial_timeout_s": trial_timeout,
        "measure_steps": steps,
        "command": list(script) if script else None,
        **rest,
    }


def _on_slurm(
    study: str | None, spec: dict[str, Any], *, workers: int, confirm: bool, resources: Any, storage: str | None
) -> Any:
    """Submit the worker jobs, say their ids and states on stderr while they run, read the study back."""
    from autotune.search.slurm import tune_on_slurm

    def submitted(ids: list[str], directory: Any) -> None:
        confirms = " (worker 1 confirms the winner)" if confirm else ""
        print(
            f"submitted SLURM job(s) {', '.join(ids)}{confirms}; their logs: {directory}/", file=sys.stderr, flush=True
        )

    def changed(states: dict[str, str]) -> None:
        now = ", ".join(f"{job} {state}" for job, state in sorted(states.items())) or "all ended"
        print(f"worker jobs: {now}", file=sys.stderr, flush=True)

    # Several ranks start with srun and a torchrun rendezvous inside the worker's allocation.
    srun = spec["workload"]["nproc"] > 1
    name, _ = tune_on_slurm(
        study=study,
        spec=dict(spec, storage=storage, srun=srun),
        workers=workers,
        confirm=confirm,
        resources=resources,
        storage=storage,
        on_submitted=submitted,
        on_change=changed,
    )
    return _summary(name, storage)


def _start_trial_server(*, estimate: bool = False) -> None:
    """Trials will run in this process: start their server now, its imports beside the checks before them;
    with ``estimate``, the estimate server's too (the tuner's device probe waits for both)."""
    from autotune.trial.runner import start_trial_server

    start_trial_server()
    if estimate:
        from autotune.estimate.client import start_estimate_server

        start_estimate_server()


def _duration(text: Optional[str], flag: str) -> Optional[float]:
    from autotune.sizes import parse_duration

    return parse_duration(text, flag=flag) if text is not None else None


def _size(text: str | None) -> int | None:
    from autotune.sizes import parse_size

    return parse_size(text) if text is not None else None


def _progress(*, quiet: bool) -> Any:
    """Progress on stderr; none with --json, whose stdout is the one JSON object."""
    import contextlib

    from autotune.output.render import ConsoleProgress

    return contextlib.nullcontext() if quiet else ConsoleProgress()


def _summary(study: str, storage: str | None, *, with_importances: bool = False) -> Any:
    from autotune.study.records import load_summary

    return load_summary(study=study, storage=storage, with_importances=with_importances)


def _check_format(fmt: str) -> None:
    from autotune.output.exporters import FORMATS

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not known; use one of {', '.join(FORMATS)}")


def _export_text(summary: Any, fmt: str) -> str:
    from autotune.output.exporters import export_config

    return export_config(
        summary.best.config,
        summary.workload,
        fmt=fmt,
        device_type=summary.device["type"],
        summary=_export_summary(summary),
    )


def _export_summary(summary: Any) -> dict[str, Any]:
    """What an export says of the study it came from (keys in json/yaml, header comments in YAML)."""
    best = summary.best
    return {
        "study": summary.name,
        "tokens_per_s": best.confirmed_tokens_per_s,
        "samples_per_s": best.confirmed_samples_per_s,
        "peak_memory_bytes": best.confirmed_peak_memory_bytes,
        "memory_budget_bytes": summary.memory_budget_bytes,
    }


def _export_best(summary: Any, fmt: str, output: str | None) -> list[str]:
    """Write the export where ``-o`` says; return the paths written, the export's own file first.

    ``-o`` naming a directory (one that exists, or a name ending in /) gets the format's usual file
    name inside it; so does any name for ``--format peft`` that does not end in .json, since PEFT
    loads adapter_config.json from a directory (``LoraConfig.from_pretrained(dir)``). Each file is
    replaced whole or not at all, and no temporary file is left behind; a companion file (the
    DeepSpeed config an Accelerate YAML names) is written before the file that names it.
    """
    import os
    from pathlib import Path

    from autotune.output.exporters import DEFAULT_FILENAMES, export_files

    path = Path(output or DEFAULT_FILENAMES[fmt])
    if output is not None and (
        path.is_dir() or output.endswith(("/", os.sep)) or fmt == "peft" and path.suffix.lower() != ".json"
    ):
        path = path / DEFAULT_FILENAMES[fmt]
    files = export_files(
        summary.best.config,
        summary.workload,
        path,
        fmt=fmt,
        device_type=summary.device["type"],
        summary=_export_summary(summary),
    )
    for file, _ in files:
        if file.is_dir():  # e.g. -o out/ where out/ds_config.json is itself a directory
            raise ConfigError(f"-o {output or path}: {file} is a directory; name a file to write, e.g. -o {path}.new")
    for file, text in reversed(files):
        _write_whole(file, text, output=output or str(path), mode=0o755 if fmt == "launch" else 0o644)
    return [str(file) for file, _ in files]


def _write_whole(path: Any, text: str, *, output: str, mode: int = 0o644) -> None:
    """``path`` replaced by ``text`` whole or not at all (never a half-written config)."""
    import os
    import tempfile
    from pathlib import Path

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise ConfigError(
            f"-o {output}: cannot write {path}: {exc.strerror or exc}; name a file in a directory you can write to"
        ) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _finish(
    summary: Any,
    *,
    as_json: bool,
    exported: list[str] | None = None,
    wanted_export: str | None = None,
    confirmed: bool = True,
) -> int:
    if as_json:
        data = summary.to_dict()
        if wanted_export is not None:
            data["export"] = exported[0] if exported else None
            if exported and len(exported) > 1:  # an Accelerate ZeRO export: the YAML and its DeepSpeed file
                data["export_files"] = exported
        if summary.best is not None and summary.command and exported and wanted_export in ("json", "yaml"):
            data["train_command"] = _train_with(summary, exported[0])
        print(json.dumps(data))
    else:
        from autotune.output.render import print_summary

        print_summary(summary)
        if exported:
            assert wanted_export is not None  # exported only when asked
            print(
                f"wrote {', '.join(exported)} ({wanted_export}); "
                f"{_trains_line(summary.best.config, wanted_export, summary.workload)}"
            )
        elif wanted_export:
            print("nothing exported: no config fits yet", file=sys.stderr)
        if summary.best is not None and summary.command:
            given = exported[0] if exported and wanted_export in ("json", "yaml") else None
            how = "" if given else f" (after autotune export --study {summary.name} --format json -o autotune.json)"
            print(f"train with it: {_train_with(summary, given)}{how}")
    if not confirmed:  # --no-confirm: another worker confirms; a measured fit is this one's success
        return 0 if any(t.fits for t in summary.trials) else 1
    return 0 if summary.best is not None else 1


@command
def estimate(
    workload: Workload,
    config: TrialConfig,
    space: Annotated[
        Optional[str],
        typer.Option(
            "--space", help="Estimate every config of this space (preset or YAML file) instead of the knobs given."
        ),
    ] = None,
    gpu: Optional[str] = None,
    memory_budget: Optional[str] = None,
    headroom: float = 0.1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per config, a line each.")] = False,
) -> int:
    """Predict peak memory per rank without training: the real step on fake tensors, split into parts.

    The parts add up to the peak. A CUDA workload gets two more figures: what the caching allocator
    reserves (the traced step's allocations replayed through a model of it) and what nvidia-smi
    shows (reserved + the CUDA context + NCCL's buffers); --gpu names the card, with or without one
    here. It is traced with CUDA's kernels where a GPU is visible, else with the CPU's, attention as
    CUDA would pick it, as the output says.
    """
    from autotune.estimate.client import predict_memory, start_estimate_server
    from autotune.estimate.cuda_memory import describe_figures
    from autotune.estimate.results import EstimateError
    from autotune.estimate.step_time import predict_step_time, profile_for
    from autotune.models.sources import resolve_task
    from autotune.sizes import format_size

    if gpu is not None:
        workload = workload.replace(gpu=gpu)  # checks the name, and that the device is CUDA
    start_estimate_server()  # its imports beside the device and model checks below
    device = _estimated_device(workload)
    budget = _size(memory_budget)
    if workload.gpu is not None:
        budget = _within_card(budget, device)
    if space is not None:
        from autotune.search.space import load_space

        if device is None:
            from autotune.config.device import detect_device

            device = detect_device(workload.device)  # refuses --device cuda without a GPU or --gpu
        configs = load_space(space).candidates(workload, device)
    else:
        configs = [config]
        configs[0].grad_accum_steps(workload)
        if device is not None:
            config.validate_for(workload, device)
    limit = int(budget * (1 - headroom)) if budget is not None else None
    resolved_task = resolve_task(workload)
    profile = profile_for(workload, device.type if device is not None else None)  # None: nowhere to time it
    for index, config in enumerate(configs):
        try:
            result = predict_memory(workload, config, task=resolved_task)
        except EstimateError as exc:  # the model cannot be built or traced: nothing printed yet for it
            raise ConfigError(f"--model {workload.model}: {exc}") from None
        cuda = result.predicted_reserved_bytes is not None
        step = predict_step_time(result, workload, profile, task=resolved_task) if profile is not None else None
        if index == 0 and not as_json:  # the header once the first row exists: a refusal prints nothing
            print(
                f"{'config':<34} {'peak':>10} = {'params':>10} {'grads':>10} {'optimizer':>10} "
                f"{'activations':>11} {'temporaries':>11} {'not live':>10}"
                + (f" {'reserved':>10} {'nvidia-smi':>10}" if cuda else "")
                + ("  fits" if limit is not None else "")
                + (f" {'step':>9} {_rate_unit(step):>12}" if step is not None else "")
            )
        fits = (
            None
            if limit is None
            else result.fits(limit)
            and (
                result.predicted_device_bytes is None
                or workload.gpu is None
                or result.predicted_device_bytes <= device.total_memory_bytes
            )
        )
        if as_json:
            print(
                json.dumps(
                    {
                        **result.to_dict(),
                        "memory_budget_bytes": budget,
                        "memory_limit_bytes": limit,
                        "fits": fits,
                        **({"figures": describe_figures()} if cuda else {}),
                        "step_time": step.to_dict() if step is not None else None,
                        "step_time_on": profile.describe() if profile is not None else None,
                    }
                ),
                flush=True,
            )
            continue
        parts = list(result.parts().values())
        print(
            f"{config.describe():<34} {format_size(result.predicted_peak_bytes):>10} = "
            + " ".join(f"{format_size(p):>{w}}" for p, w in zip(parts, (10, 10, 10, 11, 11, 10), strict=True))
            + (
                f" {format_size(result.predicted_reserved_bytes):>10} {format_size(result.predicted_device_bytes):>10}"
                if cuda
                else ""
            )
            + ("" if fits is None else ("  yes" if fits else "   no"))
            + (f" {step.step_s:>7.3g} s {_rate(step):>12,.0f}" if step is not None else ""),
            flush=True,
        )
        if result.peak_per_rank_bytes is not None:  # pipeline stages: the row is the rank that holds the most
            ranks = ", ".join(format_size(peak) for peak in result.peak_per_rank_bytes)
            print(f"{'':<34} per rank (stage 0 first): {ranks}", flush=True)
    if not as_json:
        print(
            "peak = the parts; activations and temporaries: live at the peak; not live: model states "
            "not allocated at the peak (gradients the backward has not made yet)"
        )
        if any(config.model_parallel > 1 or config.uses_fsdp or config.uses_deepspeed for config in configs):
            print("figures are one rank's: a split or sharded model's share of it (pipeline: its largest stage)")
        if result.predicted_reserved_bytes is not None:
            print(_cuda_footer(result, limit))
        print(result.device_note or f"traced with {result.traced_device.upper()} kernels")
        if profile is not None:
            print(
                f"step: one optimizer step of the whole --global-batch, its traced operators timed against "
                f"{profile.describe()}; nothing was run"
            )
    return 0


def _rate_unit(step: Any) -> str:
    return "tokens/s" if step.tokens_per_s is not None else "samples/s"


def _rate(step: Any) -> float:
    return step.tokens_per_s if step.tokens_per_s is not None else step.samples_per_s


def _estimated_device(workload: Workload) -> Any:
    """The device an estimate is checked against: the named card, the one here, or None (a CUDA
    workload estimated on a machine without a GPU, no card named: checked for what it can be)."""
    from autotune.config.device import detect_device
    from autotune.config.gpus import device_info, gpu_spec

    if workload.gpu is not None:
        return device_info(gpu_spec(workload.gpu), count=workload.nproc)
    try:
        return detect_device(workload.device)
    except AutotuneError:  # --device cuda with no GPU here: estimating for another machine
        return None


def _within_card(budget: int | None, device: Any) -> int:
    """A named card's budget: its memory unless --memory-budget says less; more is refused."""
    from autotune.sizes import format_size

    if budget is None:
        return device.total_memory_bytes
    if budget > device.total_memory_bytes:
        raise ConfigError(
            f"--memory-budget {format_size(budget)} is more than {device.name}'s "
            f"{format_size(device.total_memory_bytes)}; use at most that, or leave it out"
        )
    return budget


def _cuda_footer(result: Any, limit: int | None) -> str:
    from autotune.sizes import format_size

    parts = result.cuda_parts
    lines = [
        f"reserved = peak + allocator cache ({format_size(parts['allocator cache'])}) + cuBLAS workspace "
        f"({format_size(parts['cuBLAS workspace'])}): {result.method.rpartition(' + ')[2]}",
        f"nvidia-smi = reserved + CUDA context ({format_size(parts['CUDA context'])}"
        + (f", {result.gpu}'s typical" if result.gpu else ", typical: name the card with --gpu")
        + f") + NCCL buffers ({format_size(parts['NCCL buffers'])})",
    ]
    if result.attention_kernels:
        lines.append(
            "attention as CUDA picks it: "
            + ", ".join(f"{kernel} ({calls} calls)" for kernel, calls in result.attention_kernels.items())
        )
    if limit is not None:
        lines.append(
            f"fits: reserved within {format_size(limit)} (the budget less the headroom)"
            + (f" and nvidia-smi within {result.gpu}'s memory" if result.gpu else "")
        )
    return "\n".join(lines)


@command
def models(as_json: bool) -> int:
    """List the built-in models (use them as --model builtin:NAME)."""
    from autotune.models.presets import PRESETS

    if as_json:
        print(json.dumps({name: {"task": p.task, "summary": p.summary} for name, p in PRESETS.items()}))
        return 0
    for name, preset in PRESETS.items():
        print(f"builtin:{name:<16} {preset.task:<10} {preset.summary}")
    return 0


@app.command(hidden=True)
def worker() -> int:
    """A helper of ``autotune tune --workers N``: tunes the study its parent sends on stdin (JSON), with
    its own progress lines; started by :func:`autotune.search.workers.start_helpers`, never by hand."""
    from autotune.output.render import ConsoleProgress
    from autotune.search.tuner import tune
    from autotune.search.workers import cpu_turn
    from autotune.trial.lifeline import die_with_parent, expected_parent

    die_with_parent(expected_parent())
    with cpu_turn("cpu"):  # seconds of imports: not while another worker's trial is timed on these cores
        import torch  # noqa: F401
        import transformers  # noqa: F401
    spec = json.loads(sys.stdin.read())
    number = spec.pop("worker")
    confirm = spec.pop("confirm", False)  # a SLURM worker 1 confirms; a local helper never does
    spec["workload"] = Workload.from_dict(spec["workload"])
    preempted = _on_preemption(spec.pop("slurm_signal", None))
    try:
        if spec.pop("find", False):  # the find study's name depends on the device here
            from autotune.search.space import load_space
            from autotune.search.tuner import find_name

            spec["space"] = load_space(spec["space"])
            spec["study"], spec["memory_budget_bytes"] = find_name(
                workload=spec["workload"],
                space=spec["space"],
                memory_budget_bytes=spec["memory_budget_bytes"],
                headroom=spec["headroom"],
                command=spec["command"],
            )
        with ConsoleProgress(prefix=f"[worker {number}] ") as progress:
            tune(**spec, workers=1, confirm=confirm, progress=progress, worker_number=number)
    except KeyboardInterrupt:
        if preempted:
            from autotune.search.slurm import requeue_self

            requeued = requeue_self()
            import signal

            print(
                f"autotune: worker {number}: {signal.Signals(preempted[0]).name} from SLURM before the job ends: "
                f"its trial is recorded as interrupted; {'the job is requeued' if requeued else 'requeue failed'}",
                file=sys.stderr,
            )
            return 0
        return _INTERRUPTED
    except AutotuneError as exc:
        print(f"autotune: worker {number}: error: {exc}", file=sys.stderr)
        return 2
    return 0


_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def _on_preemption(name: str | None) -> list[int]:
    """In a SLURM job, turn the pre-termination signal its --signal asked for into an interrupt (the
    running trial is recorded as interrupted, not as an error); the list it returns gets the signal's
    number once it came."""
    import os
    import signal

    came: list[int] = []
    if not name or not os.environ.get("SLURM_JOB_ID"):
        return came
    number = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    if number is None and name.isdigit():
        number = int(name)
    if number is None:
        return came

    def interrupt(signum: int, frame: Any) -> None:
        from autotune.search.tuner import interrupt_safely

        came.append(signum)
        interrupt_safely()

    signal.signal(number, interrupt)
    return came


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m autotune``."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="autotune", standalone_mode=False)
    except AutotuneError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except typer.TyperException as exc:  # Click's usage errors: unknown flag, bad value, ...
        ctx = getattr(exc, "ctx", None)
        where = f"autotune {ctx.info_name}" if ctx is not None and ctx.info_name != "autotune" else "autotune"
        message = " ".join(exc.format_message().split())
        print(f"{where}: error: {message}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    if code == _INTERRUPTED:  # Typer turns Ctrl-C into this exit status, silently
        print(
            "autotune: interrupted (a study carries on where it stopped: run the same command again)", file=sys.stderr
        )
    return code if isinstance(code, int) else 0


def run() -> None:
    sys.exit(main())
