"""``autotune estimate``: peak memory per rank predicted without training, and the step time."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from autotune.cli.options import command
from autotune.cli.parse import size
from autotune.config.gpus import on_card_nodes
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload


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
    gpus_per_node: Optional[int] = None,
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
    from autotune.cli.servers import start_estimate_server
    from autotune.output.estimate_table import estimate_footer, estimate_header, estimate_json, estimate_line
    from autotune.search.estimates import estimate_configs

    start_estimate_server()  # before the checks, which need torch and Transformers too
    if gpu is not None:
        workload = workload.replace(gpu=gpu)  # checks the name, and that the device is CUDA
    workload = on_card_nodes(workload, gpus_per_node)
    estimates = estimate_configs(
        workload=workload, config=config, space=space, memory_budget_bytes=size(memory_budget), headroom=headroom
    )
    last = None
    for index, last in enumerate(estimates.rows()):
        if as_json:
            print(estimate_json(last, estimates), flush=True)
            continue
        if index == 0:  # the header once the first row exists: a refusal prints nothing
            print(estimate_header(last, estimates))
        print(estimate_line(last), flush=True)
    if last is not None and not as_json:
        print(estimate_footer(last, estimates))
    return 0
