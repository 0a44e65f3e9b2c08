"""``--pp`` and ``--pp-schedule``: the decoder layers split in order over ``--pp`` ranks, each a stage of
``torch.distributed.pipelining``, whose micro batches are the accumulation steps. Schedules: GPipe (every micro
batch's forward, then every backward), 1F1B (one forward, one backward: at most ``pp`` micro batches'
activations in flight) and interleaved 1F1B (two stages per rank, a smaller bubble for more communication).
Applied to the built model in place of the other splits (``autotune.prepare.pipeline``).

The model's splits together (tensor and pipeline parallel, the last levers checked) are refused here where no
framework runs them with the rest of the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever, ModelFacts, divisors, is_count
from autotune.levers.fsdp import fsdp_flag
from autotune.levers.offload import offload_flag
from autotune.levers.tensor_parallel import sequence_parallel_flag
from autotune.levers.zero import zero_flag

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["PipelineFields", "PipelineLever", "PP_SCHEDULES", "stages_per_rank"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
_PIPELINE_TASKS = ("causal-lm",)
# The export formats that carry pipeline stages: json and yaml (through autotune.prepare), and launch (it starts
# the ranks whatever they run).
_PIPELINE_FORMATS = ("json", "yaml", "launch", "torchtitan")
# torchtitan's names of the schedules (torch.distributed.pipelining's classes, looked up without case).
_TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


@dataclass(frozen=True, kw_only=True)
class PipelineFields:
    pp: int = field(
        default=1,
        metadata={
            "help": "Pipeline stages: the decoder layers split in order over this many ranks "
            "(torch.distributed.pipelining); the accumulation steps are the pipeline's micro batches."
        },
    )
    pp_schedule: str = field(
        default="1f1b",
        metadata={
            "help": "With --pp: gpipe (all forwards, then all backwards), 1f1b (at most --pp micro batches in "
            "flight) or interleaved-1f1b (two stages per rank: a smaller bubble, more transfers)."
        },
    )


def stages_per_rank(config: TrialConfig) -> int:
    """Stages each rank holds: two under interleaved 1F1B, one otherwise."""
    return 2 if config.pp_schedule == "interleaved-1f1b" else 1


class PipelineLever(Lever):
    name = "pipeline"
    fields = ("pp", "pp_schedule")
    flags = (Flag("pp", ("--pp",), int, 1), Flag("pp_schedule", ("--pp-schedule",), str, "1f1b"))

    def check(self, config: TrialConfig) -> None:
        """Its values, then the splits (tensor and pipeline) against the levers checked before them."""
        if not is_count(config.pp):
            raise ConfigError(f"--pp {config.pp!r} must be a whole number of at least 1 (1: off)")
        if config.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(
                f"--pp-schedule {config.pp_schedule!r} is not known; use one of {', '.join(PP_SCHEDULES)}"
            )
        if config.pp_schedule != "1f1b" and config.pp == 1:
            raise ConfigError(f"--pp-schedule {config.pp_schedule} schedules pipeline stages; add --pp 2 or more")
        if config.model_parallel > 1:
            _check_splits(config)

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return _stages_refusal(config, workload) if config.pp > 1 else None

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.pp > 1

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        """Why the model cannot run as ``--pp`` pipeline stages (None: it can), from its config."""
        if facts.is_factory:
            return (
                f"--pp {config.pp}: the model from --model {facts.model} is a factory's, whose layers autotune "
                "cannot cut into stages; --pp applies to Hugging Face causal LMs with a base_model_pp_plan (Llama, "
                "Qwen2, Mistral...)"
            )
        if facts.task not in _PIPELINE_TASKS:
            return (
                f"--pp {config.pp}: pipeline stages are built for causal LMs; --task {facts.task} is not one; "
                "use --pp 1"
            )
        hf = facts.hf_config
        if not getattr(hf, "base_model_pp_plan", None):
            return (
                f"--pp {config.pp}: {type(hf).__name__} (--model {facts.model}) has no pipeline plan "
                "(Transformers' base_model_pp_plan); use --pp 1, or shard with --fsdp or --zero-stage"
            )
        if getattr(hf, "tie_word_embeddings", False):
            return (
                f"--pp {config.pp}: {facts.model} ties its LM head to its embedding, one weight the first and the "
                "last stage would each hold a copy of, trained apart (their gradients are not summed yet); use "
                "--pp 1, or a config with tie_word_embeddings false"
            )
        stages = config.pp * stages_per_rank(config)
        layers = getattr(hf, "num_hidden_layers", None) or 0
        if layers < stages:
            per = " (two per rank under interleaved-1f1b)" if stages > config.pp else ""
            fix = (
                "use --pp-schedule 1f1b or gpipe (one stage per rank)"
                if layers >= config.pp
                else f"use a --pp of at most {layers}"
            )
            return (
                f"--pp {config.pp}{' --pp-schedule ' + config.pp_schedule if per else ''}: {facts.model} has "
                f"{layers} decoder layers, fewer than the {stages} stages{per}; {fix}"
            )
        return None

    def model_ranks(self, config: TrialConfig) -> int:
        return config.pp

    def layout_word(self, config: TrialConfig) -> str | None:
        return f"pp{config.pp}:{config.pp_schedule}" if config.pp > 1 else None

    def layout_fields(self, word: str) -> dict[str, Any] | None:
        match = re.fullmatch(r"pp(\d+)(?::([a-z0-9-]+))?", word)
        if match is None or int(match.group(1)) < 2 or match.group(2) not in (None, *PP_SCHEDULES):
            return None
        return {"pp": int(match.group(1)), "pp_schedule": match.group(2) or "1f1b"}

    def layout_words(self, nproc: int) -> list[str]:
        return [f"pp{n}:{schedule}" for n in divisors(nproc) if n > 1 for schedule in PP_SCHEDULES]

    def layout_flag(self, config: TrialConfig) -> str | None:
        return f"--pp {config.pp}" if config.pp > 1 else None

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        if config.pp == 1 or format_name in _PIPELINE_FORMATS:
            return None
        return (
            f"--format {format_name}: this config runs --pp {config.pp} pipeline stages, which autotune cannot "
            f"express in {format_name}'s config; export --format json and run autotune.prepare(model, "
            "'autotune.json') under torchrun (it returns the pipeline: pipeline.step(input_ids=..., labels=...) "
            "each optimizer step), or pick a config without --pp"
        )

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.pp == 1:
            return {}
        # torchtitan splits each rank's local batch into micro batches of pipeline_parallel_microbatch_size: the
        # trials' micro batches are the accumulation's, one optimizer step a local batch. Interleaved 1F1B holds
        # two stages per rank by default there, as here.
        micro_batches = config.grad_accum_steps(workload)
        keys = {
            "pipeline_parallel_degree": config.pp,
            "pipeline_parallel_schedule": _TORCHTITAN_SCHEDULES[config.pp_schedule],
            "pipeline_parallel_microbatch_size": config.micro_batch,
        }
        return {"parallelism": keys, "training": {"local_batch_size": config.micro_batch * micro_batches}}

    def in_code(self, config: TrialConfig) -> list[str]:
        if config.pp == 1:
            return []
        return [
            f"pipeline parallel: {config.pp} stages, {config.pp_schedule}: `pipeline = autotune.prepare(model, "
            "'autotune.json')` under torchrun holds this rank's stages; each optimizer step, "
            "`pipeline.step(input_ids=batch, labels=batch)` on the step's whole batch (its micro batches are the "
            "accumulation steps), then the optimizer over pipeline.parameters()"
        ]


def _check_splits(config: TrialConfig) -> None:
    """The combinations of a split model (tensor or pipeline parallel) that no framework runs."""
    layout = config.split_flags()
    zero = zero_flag(config)
    if zero is not None:
        raise ConfigError(
            f"{layout} with {zero}: DeepSpeed partitions its own flat buffers, not "
            "PyTorch's tensor-parallel and pipeline modules; shard the data-parallel ranks with --fsdp full "
            "(FSDP x TP, as torchtitan builds it), or use --zero-stage off"
        )
    if config.uses_lora or config.quantizes_base:
        raise ConfigError(
            f"{layout} with LoRA: PEFT's adapters on split layers are not measured yet; "
            "use --lora-rank off, or --tp 1 --pp 1"
        )
    with_what = sequence_parallel_flag(config) or fsdp_flag(config)
    if config.pp > 1 and with_what is not None:
        raise ConfigError(
            f"--pp {config.pp} with {with_what}: pipeline stages that are also sharded so are not measured yet; "
            "use --pp with --tp alone, or --pp 1"
        )
    offload = offload_flag(config)
    if offload is not None:
        raise ConfigError(f"{layout} with {offload}: not measured yet; use --offload none")
    if config.pp == 1:
        return
    from autotune.levers import CHECK_ORDER  # the registry imports this module

    for lever in CHECK_ORDER:
        why = lever.stage_refusal(config)
        if why is not None:
            raise ConfigError(f"--pp {config.pp}: {why}")


def _stages_refusal(config: TrialConfig, workload: Workload) -> str | None:
    """The stages against the workload's ranks (``--tp``'s refusal has checked that the splits divide them)."""
    data = config.data_parallel(workload)
    if data > 1:
        return (
            f"--pp {config.pp} on --nproc {workload.nproc} leaves {data} data-parallel copies of each stage, "
            f"which autotune does not measure yet; use --pp {workload.nproc}"
        )
    accum = config.grad_accum_steps(workload)
    if accum < config.pp and config.pp_schedule != "gpipe":
        return (
            f"--pp {config.pp} --pp-schedule {config.pp_schedule} with {accum} accumulation step(s): the "
            "pipeline's micro batches are the accumulation steps and 1F1B needs at least one per stage; use a "
            f"micro batch of at most {workload.global_batch // data // config.pp}, or --pp-schedule gpipe"
        )
    return None
