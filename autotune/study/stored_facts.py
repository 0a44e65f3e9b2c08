"""What the tuner worked out about a study's model, kept in the study so that reading it needs no torch.

Saying which layers LoRA adapts, PEFT's adapter_config.json and DeepSpeed's bucket sizes (from
the hidden size) need the model's config, PEFT's tables, for some models the model built on the
meta device: transformers, PEFT and torch, seconds to import. The tuner works them out once per
study, with the same functions the trials apply (:func:`autotune.levers.lora.lora_targets`),
and keeps them as the study user attribute ``model_facts``. Reading a study hands them to
:func:`remember`; ``what_is_trained`` and the exporters then take them from here, and work them
out as before for a workload no study read in this process recorded (older studies included).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import optuna

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["FACTS_KEY", "record", "collect", "remember", "lora_where", "hidden_size", "adapter_config"]

FACTS_KEY = "model_facts"  # study user attribute: {"hidden_size": int|None, "lora": {setting: {...}}}
_KNOWN: dict[Workload, dict[str, Any]] = {}


def record(study: optuna.Study, workload: Workload, lora_choices: Iterable[str], *, script: bool = False) -> None:
    """Store the facts for ``workload`` and the space's LoRA choices (``off``, ``16``, ``16:all-linear``,
    as :meth:`autotune.search.space.SearchSpace.choices` names them), once per study. ``script``: the
    trials run the user's command, whose model is its own: nothing is known of it (the workload's
    model is not the one trained), and readers say no more than the config."""
    if FACTS_KEY in study.user_attrs:
        return
    if script:
        study.set_user_attr(FACTS_KEY, {"hidden_size": None, "lora": {}, "script": True})
    else:
        targets = {
            None if not rest else tuple(rest.split(","))
            for rank, _, rest in (choice.partition(":") for choice in lora_choices)
            if rank != "off"
        }
        study.set_user_attr(FACTS_KEY, collect(workload, sorted(targets, key=_setting)))


def collect(workload: Workload, lora_targets: Iterable[tuple[str, ...] | None]) -> dict[str, Any]:
    """The facts, worked out here: imports transformers, and PEFT where LoRA is searched."""
    from autotune.errors import AutotuneError

    lora: dict[str, Any] = {}
    for targets in lora_targets:
        where = _lora_where(targets, workload)
        if where is None:
            continue  # unreachable model: readers try again, and say less if they fail too
        entry: dict[str, Any] = {"note": where[0], "head": where[1]}
        try:
            entry["adapter_config"] = _adapter_config(targets, workload, rank=1, alpha=1)
        except (AutotuneError, ValueError):  # e.g. no linear layer to adapt: the trials and the export say so
            pass
        lora[_setting(targets)] = entry
    return {"hidden_size": _hidden_size(workload), "lora": lora}


def remember(workload: Workload, facts: Any) -> None:
    """Facts a study stored for ``workload`` (None or malformed: nothing to remember)."""
    if isinstance(facts, dict) and isinstance(facts.get("lora", {}), dict):
        _KNOWN[workload] = facts


def lora_where(config: TrialConfig, workload: Workload) -> tuple[str, bool] | None:
    """Which layers LoRA adapts, in words, and whether a classifier head trains in full; None if the
    model cannot be reached."""
    if _of_a_script(workload):
        return None  # the script's model: its layers are not known here
    stored = _stored_lora(config, workload)
    if stored is not None and isinstance(stored.get("note"), str):
        return stored["note"], bool(stored.get("head"))
    return _lora_where(config.lora_targets, workload)


def hidden_size(workload: Workload) -> int | None:
    """The model's hidden size, for DeepSpeed's bucket sizes; None for a factory model."""
    facts = _KNOWN.get(workload)
    if facts is not None and "hidden_size" in facts:
        return facts["hidden_size"]
    return _hidden_size(workload)


def adapter_config(config: TrialConfig, workload: Workload) -> dict[str, Any]:
    """adapter_config.json's content, as ``LoraConfig.save_pretrained`` writes it for ``config``."""
    assert config.lora_rank is not None and config.effective_lora_alpha is not None, "a LoRA config only"
    if _of_a_script(workload):  # PEFT picks its default targets for the script's model when it applies them
        return _adapter_config_without_model(
            config.lora_targets, rank=config.lora_rank, alpha=config.effective_lora_alpha
        )
    stored = _stored_lora(config, workload)
    template = stored.get("adapter_config") if stored is not None else None
    if isinstance(template, dict):  # r and lora_alpha are the only fields that follow the rank and alpha
        return {**template, "r": config.lora_rank, "lora_alpha": config.effective_lora_alpha}
    return _adapter_config(config.lora_targets, workload, rank=config.lora_rank, alpha=config.effective_lora_alpha)


# -- worked out: what a study stores, and what readers of older studies get --------------------------
def _setting(targets: tuple[str, ...] | None) -> str:
    return "default" if targets is None else ",".join(targets)


def _of_a_script(workload: Workload) -> bool:
    return bool(_KNOWN.get(workload, {}).get("script"))


def _stored_lora(config: TrialConfig, workload: Workload) -> dict[str, Any] | None:
    entry = _KNOWN.get(workload, {}).get("lora", {}).get(_setting(config.lora_targets))
    return entry if isinstance(entry, dict) else None


def _lora_where(targets: tuple[str, ...] | None, workload: Workload) -> tuple[str, bool] | None:
    from autotune.errors import AutotuneError
    from autotune.levers.lora import lora_targets_note
    from autotune.prepare.workload_facts import WorkloadFacts

    try:
        facts = WorkloadFacts(workload)
        # A classifier's head trains in full (PEFT's SEQ_CLS, or modules_to_save for images); a
        # factory's plain module only on the default targets.
        head = facts.new_head and (targets is None or not facts.is_factory)
        return lora_targets_note(facts, targets), head
    except AutotuneError:  # e.g. a Hub model no longer cached here: say less rather than fail
        return None


def _hidden_size(workload: Workload) -> int | None:
    from autotune.models.sources import load_hf_config, parse_model_source

    source = parse_model_source(workload.model)
    if source.kind == "factory":  # building the model to find out would run the user's code
        return None
    hf_config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    return getattr(hf_config, "hidden_size", None)


def _adapter_config_without_model(targets: tuple[str, ...] | None, *, rank: int, alpha: int) -> dict[str, Any]:
    from peft import LoraConfig

    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets) if targets else None)
    data = {key: sorted(value) if isinstance(value, set) else value for key, value in lora.to_dict().items()}
    return json.loads(json.dumps(data, default=str))


def _adapter_config(targets: tuple[str, ...] | None, workload: Workload, *, rank: int, alpha: int) -> dict[str, Any]:
    from peft import LoraConfig

    from autotune.prepare.workload_facts import lora_targets_for

    # The same LoraConfig the trials applied: PEFT's default targets named, or the fallback's layers.
    plan = lora_targets_for(workload, targets)
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, **plan.peft_kwargs())
    data = {key: sorted(value) if isinstance(value, set) else value for key, value in lora.to_dict().items()}
    return json.loads(json.dumps(data, default=str))  # as JSON holds it: a stored one reads back the same
