"""``--tp`` and ``--sequence-parallel``: each decoder layer's attention and MLP weights split over ``--tp`` ranks
(the model's Transformers ``tp_plan``, applied with PyTorch's ``parallelize_module``), and the LM head by
vocabulary rows with its logits gathered whole, which all see the same micro batch; with sequence parallel, the
norms' activations (and the residual stream between layers) split along the sequence too. Applied to the built
model first of the splits (``autotune.prepare.tensor_parallel``), as torchtitan's ``parallelize`` applies TP before
checkpointing, compile and FSDP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers.base import Flag, Lever, ModelFacts, divisors, is_count
from autotune.levers.fsdp import fsdp_flag
from autotune.levers.grad_reduction import asks_fsdp_reduction

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["TensorParallelFields", "TensorParallelLever", "sequence_parallel_flag", "TP_STYLES"]

# The export formats that carry a tensor-parallel layout: json and yaml (through autotune.prepare), Lightning's
# ModelParallelStrategy, and launch (it starts the ranks whatever they run).
_TENSOR_PARALLEL_FORMATS = ("json", "yaml", "launch", "lightning", "torchtitan")
# The plan's styles PyTorch's ColwiseParallel and RowwiseParallel implement as Transformers means them.
TP_STYLES = ("colwise", "rowwise")


@dataclass(frozen=True, kw_only=True)
class TensorParallelFields:
    tp: int = field(
        default=1,
        metadata={
            "help": "Tensor-parallel ranks: each decoder layer's attention and MLP weights split over this many "
            "ranks (the model's Transformers tp_plan, applied with PyTorch's parallelize_module), and the LM head "
            "by vocabulary rows, its logits gathered whole; they all see the same micro batch. The other "
            "--nproc / (tp x pp) ranks are data parallel."
        },
    )
    sequence_parallel: bool = field(
        default=False,
        metadata={
            "help": "With --tp: the norms' activations (and the residual stream between layers) split over the "
            "tensor-parallel ranks along the sequence, instead of held whole on each."
        },
    )


def sequence_parallel_flag(config: TrialConfig) -> str | None:
    """``--sequence-parallel on`` where the config has it, for messages (None: off)."""
    return "--sequence-parallel on" if config.sequence_parallel else None


class TensorParallelLever(Lever):
    name = "tensor_parallel"
    fields = ("tp", "sequence_parallel")
    flags = (
        Flag("tp", ("--tp",), int, 1),
        Flag.on_off("sequence_parallel", "--sequence-parallel"),
    )

    def check(self, config: TrialConfig) -> None:
        if not is_count(config.tp):
            raise ConfigError(f"--tp {config.tp!r} must be a whole number of at least 1 (1: off)")
        if not isinstance(config.sequence_parallel, bool):
            raise ConfigError(f"--sequence-parallel {config.sequence_parallel!r} must be on or off")
        if config.sequence_parallel and config.tp == 1:
            raise ConfigError(
                "--sequence-parallel on splits activations over tensor-parallel ranks; add --tp 2 or more"
            )

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        """The splits' ranks (tensor and pipeline parallel) against the workload's, then what runs the rest of
        a tensor-parallel layout (its refusal is asked before the pipeline's)."""
        if config.model_parallel == 1:
            return None
        if workload.nproc % config.model_parallel:
            splits = config.split_flags(" x ")
            fits = [d for d in divisors(workload.nproc) if d > 1] or "none (add ranks)"
            what = "product" if " x " in splits else "value"
            return (
                f"{splits} does not divide --nproc {workload.nproc}: the ranks split as data x tensor x pipeline "
                f"parallel; use a {what} from {fits}"
            )
        data = config.data_parallel(workload)
        fsdp = fsdp_flag(config)
        # FSDP over one data-parallel rank shards nothing; it runs where asked for its reduction alone, as
        # KempnerForge wraps its tensor-parallel models (its distributed/setup.py keeps a dp_shard mesh of 1).
        if config.tp > 1 and data == 1 and fsdp is not None and not asks_fsdp_reduction(config):
            return (
                f"{fsdp} with --tp {config.tp} on --nproc {workload.nproc}: FSDP shards over the "
                "data-parallel ranks, and there is one; use --fsdp off, or more ranks (--nproc a multiple of --tp), "
                "or --grad-sync last / --reduce-dtype fp32 for its reduction alone"
            )
        if config.tp > 1 and data > 1 and fsdp is None:
            return (
                f"--tp {config.tp} on --nproc {workload.nproc} leaves {data} data-parallel copies, which DDP "
                "cannot hold (its buckets are not tensor-parallel); shard them with --fsdp full or grad-op "
                f"(FSDP x TP), or use --tp {workload.nproc}"
            )
        return None

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.tp > 1

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        """Why the model cannot be split ``--tp`` ways (None: it can), from its config alone."""
        if facts.is_factory:
            return (
                f"--tp {config.tp}: the model from --model {facts.model} is a factory's, which has no tensor-parallel "
                "plan; --tp applies to Hugging Face models whose config has a base_model_tp_plan (Llama, Qwen2, "
                "Mistral...)"
            )
        hf = facts.hf_config
        plan = getattr(hf, "base_model_tp_plan", None)
        if not plan:
            return (
                f"--tp {config.tp}: {type(hf).__name__} (--model {facts.model}) has no tensor-parallel plan "
                "(Transformers' base_model_tp_plan); use --tp 1, or shard with --fsdp or --zero-stage"
            )
        unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
        if unknown:
            return (
                f"--tp {config.tp}: {type(hf).__name__}'s plan uses {', '.join(unknown)}, which autotune does not "
                "apply yet (it applies colwise and rowwise); use --tp 1"
            )
        for name, count in (
            ("attention heads", getattr(hf, "num_attention_heads", None)),
            ("key/value heads", getattr(hf, "num_key_value_heads", None)),
            ("MLP width", getattr(hf, "intermediate_size", None)),
        ):
            if count is not None and count % config.tp:
                return (
                    f"--tp {config.tp}: {facts.model} has {count} {name}, which {config.tp} ranks cannot split "
                    f"evenly; use a --tp that divides {count}"
                )
        return None

    def model_ranks(self, config: TrialConfig) -> int:
        return config.tp

    def layout_word(self, config: TrialConfig) -> str | None:
        return f"tp{config.tp}" + ("+sp" if config.sequence_parallel else "") if config.tp > 1 else None

    def layout_fields(self, word: str) -> dict[str, Any] | None:
        match = re.fullmatch(r"tp(\d+)(\+sp)?", word)
        if match is None or int(match.group(1)) < 2:
            return None
        return {"tp": int(match.group(1)), "sequence_parallel": match.group(2) is not None}

    def layout_words(self, nproc: int) -> list[str]:
        return [word for n in divisors(nproc) if n > 1 for word in (f"tp{n}", f"tp{n}+sp")]

    def layout_flag(self, config: TrialConfig) -> str | None:
        return f"--tp {config.tp}" if config.tp > 1 else None

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        if config.tp == 1 or format_name in _TENSOR_PARALLEL_FORMATS:
            return None
        # Accelerate's ParallelismConfig (and the Trainer's, through it) loads the model with Transformers' own
        # tp_plan="auto": a layout no trial here can run, as it refuses a multi-CPU job.
        why = (
            "Accelerate's ParallelismConfig (the Trainer's too) splits the model by Transformers' own plan, which "
            "no trial measured (it runs on GPUs only)"
            if format_name in ("hf", "accelerate")
            else f"{format_name}'s config has no tensor-parallel layout"
        )
        return (
            f"--format {format_name}: this config splits layers with --tp {config.tp}, and {why}; export --format "
            "json and apply it with autotune.prepare(model, 'autotune.json') under torchrun, or --format lightning "
            "(ModelParallelStrategy), or pick a config without --tp"
        )

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.tp == 1:
            return {}
        if not config.sequence_parallel:
            raise ConfigError(
                f"--format torchtitan: this config splits layers with --tp {config.tp} without --sp, and "
                "torchtitan's tensor parallel always shards the norms' activations over the sequence; pick a "
                "config with --sp, or export --format json"
            )
        # The trials gather the head's logits whole (no loss parallel), which torchtitan does with its switch off.
        return {"parallelism": {"tensor_parallel_degree": config.tp, "disable_loss_parallel": True}}

    def in_code(self, config: TrialConfig) -> list[str]:
        if config.tp == 1:
            return []
        sp = " and sequence parallel" if config.sequence_parallel else ""
        return [
            f"tensor parallel: {config.tp} ranks split each layer (the model's tp_plan{sp}): "
            "`model = autotune.prepare(model, 'autotune.json')` under torchrun after init_process_group (with "
            "Lightning: in configure_model, `autotune.prepare(self.model, 'autotune.json', mesh=self.device_mesh)`); "
            "give the optimizer `autotune.prepare.optimizer.parameter_groups(list(model.parameters()))`, which "
            "keeps the split and the whole weights apart (a foreach or fused AdamW cannot mix them)"
        ]
