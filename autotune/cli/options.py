"""The options shared by commands, each declared once (its help from the dataclass field it sets where
there is one), and :func:`command`, which registers a command with the options its parameters name.

A command's ``workload``, ``config`` and ``executor`` parameters take a whole group of options (the
workload's, the knobs', where the workers run), built into one object; any other parameter named in
:data:`OPTIONS` takes that option; a parameter annotated with its own ``typer.Option`` is an option of
that command alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Annotated, Any, Callable, Optional

import typer

from autotune.cli import parse
from autotune.cli.app import app
from autotune.config.knobs import TrialConfig
from autotune.config.workload import DEFAULT_MODEL, Workload
from autotune.levers import LEVER_FLAGS

__all__ = [
    "Option",
    "WORKLOAD_OPTIONS",
    "KNOB_OPTIONS",
    "EXECUTOR_OPTIONS",
    "OPTIONS",
    "OUTPUT_HELP",
    "Script",
    "command",
]


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
    # Each lever's options (autotune/levers/: its Flag), in its fields' order.
    **{
        flag.field: Option(flag.type, flag.default, flag.names, flag.help_prefix + _help(TrialConfig, flag.field))
        for flag in LEVER_FLAGS
    },
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
    "warmup_steps": Option(
        int,
        1,
        ("--warmup-steps",),
        "Untimed optimizer steps before measuring, each after one micro batch (DeepSpeed's and pipeline trials': "
        "whole steps).",
    ),
    "steps": Option(
        int,
        3,
        ("--steps",),
        "Timed optimizer steps. In find and tune, a trial stops after two once they took 2.5 s and agree.",
    ),
    "as_json": Option(bool, False, ("--json",), "Print one JSON object instead of a table."),
    "gpu": Option(Optional[str], None, ("--gpu",), _help(Workload, "gpu") + " --memory-budget defaults to its memory."),
    "gpus_per_node": Option(
        Optional[int],
        None,
        ("--gpus-per-node",),
        "GPUs each node holds. With --gpu (estimate, find --plan): --nproc fills as many such nodes as it takes "
        "(default: the card's reference node, 8 for a DGX H100). With --executor slurm: what each worker job "
        "asks for per node.",
    ),
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
        "quantized base), launch (a bash script that starts your training script with the trials' ranks and "
        "nodes), or torchtitan (torchtitan 0.2's TOML job config; a GPU study's config).",
    ),
}
# -- where the workers run: --executor and the SLURM job's options (a command's ``executor`` parameter) ------
EXECUTOR_OPTIONS = {
    "executor": Option(
        str,
        "local",
        ("--executor",),
        "local: the --workers are processes on this machine; slurm: each worker is a SLURM job holding "
        "one trial's nodes, GPUs and ranks (needs a journal or PostgreSQL --storage).",
    ),
    "nodes": Option(
        int,
        1,
        ("--nodes",),
        "Nodes one trial spans (--executor slurm; find --plan: the nodes of --gpu); --nproc counts its ranks in all.",
    ),
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
}
# -o/--output of a command that writes an export: what a directory gets.
OUTPUT_HELP = (
    "a directory (existing, or ending in /) gets the format's usual file name inside it; --format peft "
    "writes DIR/adapter_config.json unless the name ends in .json."
)

# A user's own training command, after --: script mode (trial, find, tune).
Script = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="[-- COMMAND...]",
        show_default=False,
        help="Your own training command, after --, run unchanged for each trial: its optimizer steps are timed, the "
        "config is in AUTOTUNE_CONFIG (autotune.current_config()), the workload options say what one step trains.",
    ),
]

# A command's parameter by one of these names takes the whole group, built into one object.
_GROUPS: dict[str, tuple[dict[str, Option], Callable[..., Any]]] = {
    "workload": (WORKLOAD_OPTIONS, Workload),
    "config": (KNOB_OPTIONS, parse.knobs),
    "executor": (EXECUTOR_OPTIONS, parse.executor),
}


def command(fn: Callable[..., int]) -> Callable[..., int]:
    """Register ``fn`` as a command. Its parameters say which options it takes: ``workload``, ``config``
    and ``executor`` take the workload, knob and executor options (built into a Workload, a TrialConfig
    and an Executor), a name in :data:`OPTIONS` takes that option; a parameter annotated with its own
    ``typer.Option`` is an option of this command alone."""
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
            if group in wanted:  # the group's values out, its object in (executor: one name for both)
                values[group] = build(**{name: values.pop(name) for name in options})
        return fn(**values)

    wanted = inspect.signature(fn).parameters
    parsed.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what Typer reads
    parsed.__annotations__ = {p.name: p.annotation for p in parameters}
    return app.command(name=fn.__name__.rstrip("_"))(parsed)  # run_: the command run


def _own_option(parameter: inspect.Parameter) -> bool:
    return any(isinstance(meta, typer.models.OptionInfo) for meta in getattr(parameter.annotation, "__metadata__", ()))
