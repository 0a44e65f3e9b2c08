"""A lever's fields are read in its own module (``autotune/levers/<lever>.py``) and in the few places that must
know them, nowhere else: a change to a lever is a change to one module.

A read is ``<a config>.<field>`` in the package's source, found with ``ast``: the attribute's owner is named
``config`` or ``cfg``, ends in ``_config`` or ``.config`` (``result.config.precision``), or is ``self`` inside
``config/knobs.py`` (TrialConfig's own methods). Other names (``engine.optimizer``, ``torch.compile``) are not
configs. ``getattr(config, name)`` over ``dataclasses.fields`` (serialisation, the CLI's flags) is not a read of
a lever's field by name, and is what every consumer should do.

Two lists say where else a field is read:
* ``MUST_KNOW``: places that must know a lever's fields by design, each with its reason;
* ``NOT_YET``: reads still to move into their lever (the exporters' keys, the estimator's cases, the rules of the
  levers that are not modules yet). It only shrinks: a read that is gone must leave it, and nothing may join it.
The fields of the knob families that are not levers yet are ``NOT_YET_LEVERS``; that list only shrinks too.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import autotune
from autotune.config.knobs import TrialConfig
from autotune.levers import (
    AXIS_ORDER,
    CHECK_ORDER,
    DROPPED_ORDER,
    FORMAT_ORDER,
    HEADER_ORDER,
    IN_CODE_AFTER_LAYOUT,
    IN_CODE_BEFORE_LAYOUT,
    LABEL_ORDER,
    LEVER_FLAGS,
    LEVERS,
    MODEL_REFUSAL_ORDER,
    REFUSAL_ORDER,
    TRAINER_ORDER,
)

PACKAGE = Path(autotune.__file__).parent
ROOT = PACKAGE.parent

# Fields of knob families that are not yet a lever of their own. Shrinks to nothing: every family is a module of
# autotune/levers/ now, so a new field must be a lever's.
NOT_YET_LEVERS: set[str] = set()
CORE = {"micro_batch"}  # not a lever: every config has a micro batch, and the accumulation derives from it

# file -> the migrated fields it may read, and why.
MUST_KNOW: dict[str, tuple[set[str], str]] = {
    "autotune/trial/engine.py": (
        {"precision", "optimizer", "activation_offload", "compile", "pp", "zero_stage"},
        "the engine applies what wraps the step, in its order: TF32 matmuls, autocast and fp16's loss scaler, the "
        "optimizer over the prepared parameters, activation offload's hooks around the step, compile; and picks "
        "the engine the layout needs: a pipeline's schedule fed the whole step, ZeRO-3's model built partitioned",
    ),
    "autotune/prepare/apply.py": (
        {"pp", "tp"},
        "autotune.prepare applies the model's splits in torchtitan's order: pipeline stages, or tensor parallel "
        "then FSDP over the other ranks",
    ),
    "autotune/trial/child.py": (
        {"compile"},
        "the trial's child compiles after the first steps and times the compile as a phase of its own",
    ),
}

# file -> migrated fields still read there by name (to move into their levers). Only shrinks.
NOT_YET: dict[str, set[str]] = {
    # the layout levers' applying: ZeRO's DeepSpeed JSON, FSDP's wrapping and offload policy, tensor and pipeline
    # parallel's plans, and the Trainer's keys for them
    "autotune/config/deepspeed_config.py": {"offload", "precision", "zero_stage"},
    "autotune/prepare/pipeline.py": {"pp", "pp_schedule", "tp"},
    "autotune/prepare/sharding.py": {"fsdp", "offload", "shard_group"},
    "autotune/prepare/tensor_parallel.py": {"sequence_parallel", "tp"},
    "autotune/prepare/training_args.py": {"fsdp", "offload", "tp", "zero_stage"},
    # the estimator's cases (its arithmetic stays in estimate/ for now)
    "autotune/estimate/client.py": {"pp"},
    "autotune/estimate/fake_step.py": {"optimizer"},
    "autotune/estimate/step_time.py": {
        "compile",
        "fsdp",
        "fused_optimizer",
        "offload",
        "pp",
        "pp_schedule",
        "precision",
        "zero_stage",
    },
    "autotune/estimate/trace.py": {
        "activation_offload",
        "compile",
        "fsdp",
        "offload",
        "pp",
        "pp_schedule",
        "quantize_base",
        "tp",
    },
    "autotune/estimate/worker.py": {"pp"},
    "autotune/estimate/zero_states.py": {"offload", "precision", "zero_stage"},
    # the export keys
    "autotune/output/exporters.py": {"fsdp", "offload", "zero_stage"},
    "autotune/output/render.py": {"checkpointing"},
    # a framework script's own ZeRO, which the trial leaves alone
    "autotune/scripts/measure.py": {"zero_stage"},
    # the quantized base's applying, and the adapter facts a study stores and shows:
    # the lever's module holds its fields, checks, refusals, labels, targets and adapters
    "autotune/prepare/quantize.py": {"quantize_base"},
    "autotune/study/stored_facts.py": {"lora_rank", "lora_targets"},
    # the proposer's and the plan's moves, the summary's notes
    "autotune/search/plan.py": {"precision"},
    "autotune/search/step_prior.py": {"precision"},
    "autotune/study/summary.py": {"lora_rank", "lora_targets", "precision"},
}


def _owner_is_a_config(node: ast.expr, path: str) -> bool:
    text = ast.unparse(node)
    last = text.rpartition(".")[2]
    if last in ("config", "cfg") or last.endswith("_config"):
        return True
    return text == "self" and path == "autotune/config/knobs.py"


def field_reads(source: str, path: str, fields: set[str]) -> set[str]:
    """The fields of ``fields`` that ``source`` (the file at ``path``, relative to the repository) reads."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in fields
        and isinstance(node.ctx, ast.Load)
        and _owner_is_a_config(node.value, path)
    }


def _lever_fields() -> dict[str, str]:
    """Each migrated field and the module of the lever that owns it."""
    return {name: type(lever).__module__ for lever in LEVERS for name in lever.fields}


def _reads_outside_their_levers() -> dict[str, set[str]]:
    owners = _lever_fields()
    found: dict[str, set[str]] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        path = file.relative_to(ROOT).as_posix()
        module = path.removesuffix(".py").replace("/", ".")
        reads = {f for f in field_reads(file.read_text(), path, set(owners)) if owners[f] != module}
        reads -= MUST_KNOW.get(path, (set(), ""))[0]
        if reads:
            found[path] = reads
    return found


def test_every_field_belongs_to_one_lever_or_is_listed_as_not_yet() -> None:
    owned = [name for lever in LEVERS for name in lever.fields]
    assert len(owned) == len(set(owned)), "a field belongs to two levers"
    assert not set(owned) & NOT_YET_LEVERS, (
        f"{sorted(set(owned) & NOT_YET_LEVERS)} belong to a lever now: take them out of NOT_YET_LEVERS"
    )
    names = {f.name for f in dataclasses.fields(TrialConfig)}
    assert names == set(owned) | NOT_YET_LEVERS | CORE, (
        f"fields that are neither a lever's nor listed: {sorted(names - set(owned) - NOT_YET_LEVERS - CORE)}; "
        "a new knob is a new module of autotune/levers/ (docs/design.md, how to add a lever)"
    )
    in_code = IN_CODE_BEFORE_LAYOUT + IN_CODE_AFTER_LAYOUT
    orders = (LABEL_ORDER, CHECK_ORDER, REFUSAL_ORDER, MODEL_REFUSAL_ORDER, AXIS_ORDER, DROPPED_ORDER)
    orders += (TRAINER_ORDER, HEADER_ORDER, FORMAT_ORDER)
    for order in (*orders, in_code):
        assert sorted(map(id, order)) == sorted(map(id, LEVERS)), "each order of autotune.levers names every lever once"


def test_each_levers_fields_are_its_mixins() -> None:
    """A lever's ``fields`` are the fields its module's mixin gives TrialConfig, in TrialConfig's order; its flags
    name its own fields, and every lever's flags come in that order too (the order --help lists them in)."""
    order = [f.name for f in dataclasses.fields(TrialConfig)]
    for lever in LEVERS:
        positions = [order.index(name) for name in lever.fields]
        assert positions == sorted(positions), f"{lever}: fields out of TrialConfig's order"
        assert {flag.field for flag in lever.flags} <= set(lever.fields), f"{lever}: a flag for another's field"
    positions = [order.index(flag.field) for flag in LEVER_FLAGS]
    assert positions == sorted(positions), "LEVER_FLAGS out of TrialConfig's order"
    set_by_another_flag = {"checkpoint_every", "checkpoint_selective"}  # --checkpointing every-N, selective
    assert {flag.field for flag in LEVER_FLAGS} == set(order) - NOT_YET_LEVERS - CORE - set_by_another_flag


def test_no_lever_field_is_read_outside_its_lever_and_the_places_that_must_know_it() -> None:
    found = _reads_outside_their_levers()
    new = {path: sorted(reads - NOT_YET.get(path, set())) for path, reads in found.items()}
    new = {path: reads for path, reads in new.items() if reads}
    assert not new, (
        "a lever's fields read outside its module (autotune/levers/); ask the lever instead (its refusal, apply, "
        f"labels, ...), or give the lever what you need: {new}"
    )


def test_the_not_yet_list_only_shrinks() -> None:
    found = _reads_outside_their_levers()
    stale = {path: sorted(fields - found.get(path, set())) for path, fields in NOT_YET.items()}
    stale = {path: fields for path, fields in stale.items() if fields}
    assert not stale, f"these reads are gone: take them out of NOT_YET in {Path(__file__).name}: {stale}"


def test_the_check_finds_a_read_and_leaves_what_is_not_a_config() -> None:
    source = (
        "def f(config, engine, result):\n"
        "    a = config.precision\n"
        "    b = result.config.loss\n"
        "    c = trial_config.compile\n"
        "    engine.optimizer.step()\n"
        "    torch.compile(model)\n"
        "    config.compile = True\n"
    )
    fields = {"precision", "loss", "compile", "optimizer"}
    assert field_reads(source, "autotune/x.py", fields) == {"precision", "loss", "compile"}
    assert field_reads("self.precision", "autotune/config/knobs.py", fields) == {"precision"}
    assert field_reads("self.precision", "autotune/search/space.py", fields) == set()
