"""The command line declares each option once (autotune/cli/options.py, or beside the one command that
takes it), and every command still takes it."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import typer

import autotune.cli as cli
from autotune.cli import options

_MODULES = sorted(Path(cli.__file__).parent.glob("*.py"))

# Options of one command alone that reuse a flag with another meaning there (the file -o writes,
# what --space and --json mean to estimate): declared beside the command, once per meaning.
_PER_COMMAND = {"-o", "--output", "--space", "--json"}


def _declared_flags() -> collections.Counter[str]:
    """Every flag string in an ``Option(...)`` or ``typer.Option(...)`` call in the package autotune/cli/."""
    flags: collections.Counter[str] = collections.Counter()
    for node in (node for module in _MODULES for node in ast.walk(ast.parse(module.read_text()))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "Option":
            for arg in ast.walk(node):
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith("-")
                    and " " not in arg.value
                ):
                    flags.update(arg.value.split("/"))
    return flags


def test_each_shared_option_is_declared_once() -> None:
    flags = _declared_flags()
    assert {"--model", "--micro-batch", "--memory-budget", "--storage", "--study"} <= set(flags)
    repeated = {flag: n for flag, n in flags.items() if n > 1 and flag not in _PER_COMMAND}
    assert not repeated, f"declared more than once in autotune/cli/: {repeated}"


def _options(command: str) -> set[str]:
    click_command = typer.main.get_command(cli.app).commands[command]  # type: ignore[attr-defined]
    return {flag for param in click_command.params for flag in param.opts}


def test_the_workload_and_knob_options_reach_every_command_that_takes_them() -> None:
    workload = {"--model", "--task", "--seq-len", "--global-batch", "--nproc", "--device", "--trust-remote-code"}
    knobs = {
        "--micro-batch",
        "--precision",
        "--checkpointing",
        "--lora-rank",
        "--lora-alpha",
        "--lora-targets",
        "--zero-stage",
        "--offload",
    }
    for command in ("trial", "estimate", "find", "tune", "grid"):
        assert workload <= _options(command), command
    for command in ("trial", "estimate"):
        assert knobs <= _options(command), command
    for command in ("find", "tune", "grid"):
        assert not knobs & _options(command), command  # the search picks the knobs there
    assert {"--study", "--format", "-o", "--storage"} <= _options("export")


def test_no_command_lists_the_workload_or_knob_options_itself() -> None:
    """Commands take ``workload``/``config``/``executor`` (one shared declaration), not the options one by one."""
    fields = set(options.WORKLOAD_OPTIONS) | set(options.KNOB_OPTIONS) | set(options.EXECUTOR_OPTIONS)
    fields -= {"executor"}  # the group's parameter, named as its first option (--executor)
    for node in (node for module in _MODULES for node in ast.parse(module.read_text()).body):
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "command" for d in node.decorator_list):
            listed = {arg.arg for arg in node.args.args + node.args.kwonlyargs} & fields
            assert not listed, f"autotune {node.name} lists {sorted(listed)}; take workload/config/executor instead"


def test_find_and_tune_take_the_executor_options_from_one_declaration() -> None:
    slurm = {"--executor", "--nodes", "--partition", "--account", "--time", "--qos"}
    slurm |= {"--constraint", "--signal", "--slurm-option"}
    assert {flag for option in options.EXECUTOR_OPTIONS.values() for flag in option.flags} == slurm
    for command in ("find", "tune"):
        assert slurm | {"--gpus-per-node"} <= _options(command), command
    for command in ("trial", "estimate", "grid", "show"):
        assert not slurm & _options(command), command
    # --gpus-per-node is a node's GPUs: what a SLURM job asks for per node, and the nodes a plan for a card fills
    assert "--gpus-per-node" in _options("estimate") and "--gpus-per-node" not in _options("trial")
