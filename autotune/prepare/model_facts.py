"""Facts about a model found before any trial: its linear layers, its task head, whether it can
checkpoint activations. A factory's model is built on the meta device in a process of its own
(its code may hang or crash); a Hugging Face model on the meta device here.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable

from autotune.config.workload import CLASSIFIER_TASKS
from autotune.levers.checkpointing import CHECKPOINTING_METHODS, NO_CHECKPOINTING_METHOD
from autotune.models.sources import (
    auto_class,
    load_hf_config,
    meta_model,
    parse_model_source,
    resolve_task,
)

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = [
    "missing_checkpointing",
    "factory_facts",
    "checkpointing_gap",
    "linear_layers_but_heads",
    "head_names",
    "is_under",
    "hf_model_class",
    "layer_classes",
]

# A head is a direct child by one of these names (PEFT's classifier names, causal LMs' lm_head,
# common names in factories), or the output embeddings; heads are never adapted.
_HEAD_NAMES = ("classifier", "score", "lm_head", "head", "output")


def checkpointing_gap(model: Any, ref: str) -> str | None:
    if not any(callable(getattr(model, name, None)) for name, _ in CHECKPOINTING_METHODS):
        return f"the model from --model {ref} {NO_CHECKPOINTING_METHOD}"
    if getattr(model, "supports_gradient_checkpointing", True) is False:  # HF models have the method anyway
        return f"{type(model).__name__} (--model {ref}) does not support gradient checkpointing"
    return None


_FACTORY_FACTS: dict[tuple[str, str, int], dict[str, Any] | None] = {}
_PROBE_TIMEOUT_S = 120


def factory_facts(workload: Workload, task: str) -> dict[str, Any] | None:
    """A factory's model, built on the meta device in a child process: None if that fails or hangs."""
    import signal
    import subprocess
    import sys

    key = (workload.model, task, workload.seq_len)
    if key in _FACTORY_FACTS:
        return _FACTORY_FACTS[key]
    code = "import sys; from autotune.prepare.model_facts import _probe_main; _probe_main(*sys.argv[1:])"
    facts = None
    with subprocess.Popen(
        [sys.executable, "-c", code, workload.model, task, str(workload.seq_len)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    ) as probe:
        try:
            out, _ = probe.communicate(timeout=_PROBE_TIMEOUT_S)
            lines = out.strip().splitlines()
            if probe.returncode == 0 and lines:
                facts = json.loads(lines[-1])  # the last line: the factory may print too
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            pass
        finally:
            try:
                os.killpg(probe.pid, signal.SIGKILL)  # with whatever the factory started
            except ProcessLookupError:
                pass
    _FACTORY_FACTS[key] = facts
    return facts


def _probe_main(ref: str, task: str, seq_len: str) -> None:
    from autotune.config.workload import Workload

    model = meta_model(Workload(model=ref, task=task, seq_len=int(seq_len)), task)
    targets, heads = linear_layers_but_heads(model, task=task)
    print(
        "\n"
        + json.dumps({"missing_checkpointing": checkpointing_gap(model, ref), "lora_targets": targets, "heads": heads}),
        flush=True,
    )


def linear_layers_but_heads(model: torch.nn.Module, *, task: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Last names (as PEFT matches them) of the linear layers outside the task head, and of the heads."""
    import torch

    linear: tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        linear += (Conv1D,)
    except ImportError:
        pass
    heads = head_names(model, task=task)
    leaves = {head.rpartition(".")[2] for head in heads}
    # A classifier trains in full: PEFT wraps every module whose name *ends with* a modules_to_save
    # name (its SEQ_CLS adds classifier and score), DistilBERT's pre_classifier included.
    saved = leaves | {"classifier", "score"} if task in CLASSIFIER_TASKS else set()
    targets = set()
    for name, module in model.named_modules():
        in_head = is_under(name, heads)
        if isinstance(module, linear) and not in_head and not any(name.endswith(s) for s in saved):
            targets.add(name.rpartition(".")[2])
    return tuple(sorted(targets - leaves)), tuple(sorted(leaves))


def is_under(name: str, modules: Iterable[str]) -> bool:
    """Whether the module called ``name`` is one of ``modules`` (full names) or inside one."""
    return any(name == module or name.startswith(module + ".") for module in modules)


def head_names(model: torch.nn.Module, *, task: str) -> list[str]:
    """The task head: the output embeddings (an LM's vocabulary projection) or a classifier."""
    heads = [module for name, module in model.named_children() if name in _HEAD_NAMES]
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None:
        heads.append(output)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(model, "vocab_size", None)
    # A factory's projection onto the vocabulary, which only its size tells (a model that names its output
    # embeddings has said which it is: a layer as wide as the vocabulary, e.g. where hidden = vocab, is no head).
    if output is None and task == "causal-lm" and isinstance(vocab, int):
        heads += [m for m in model.modules() if getattr(m, "out_features", None) == vocab]
    ids = {id(m) for m in heads}
    return [name for name, module in model.named_modules() if id(module) in ids and name]


def hf_model_class(workload: Workload, task: str) -> type | None:
    """The Transformers class a Hugging Face workload builds, found from its config alone; None when
    that cannot be told without building (remote code): build on the meta device instead."""
    config = load_hf_config(parse_model_source(workload.model), trust_remote_code=workload.trust_remote_code)
    auto = auto_class(task)
    try:
        from transformers.models.auto.auto_factory import (
            _get_model_class,  # private: a fallback follows
        )

        return _get_model_class(config, auto._model_mapping)
    except (ImportError, KeyError, ValueError, AttributeError):
        return None


def layer_classes(workload: Workload) -> list[str]:
    """The class names of the layers FSDP wraps one unit each (the model's ``_no_split_modules``, what
    the auto-wrap of Transformers and Accelerate reads); empty for a factory's model."""
    from autotune.models.sources import resolve_task

    if parse_model_source(workload.model).kind == "factory":
        return []
    return sorted(getattr(meta_model(workload, resolve_task(workload)), "_no_split_modules", None) or [])


def missing_checkpointing(workload: Workload) -> str | None:
    """Why the workload's model cannot checkpoint activations, or None when it can (or when that is
    unknown before a trial: a factory that fails to build fails its trials anyway).

    Hugging Face models: the model class's ``supports_gradient_checkpointing``, no model built.
    A factory: built once on the meta device in a separate process (its code may hang or crash).
    """
    source = parse_model_source(workload.model)
    task = resolve_task(workload)
    key = (workload.model, task, workload.seq_len, workload.trust_remote_code)
    if key not in _MISSING_CHECKPOINTING:  # the search space asks for every list of choices
        if source.kind == "factory":
            facts = factory_facts(workload, task)
            missing = None if facts is None else facts["missing_checkpointing"]
        else:
            model_class = hf_model_class(workload, task)
            if model_class is None:
                missing = checkpointing_gap(meta_model(workload, task), workload.model)
            elif not getattr(model_class, "supports_gradient_checkpointing", False):
                missing = f"{model_class.__name__} (--model {workload.model}) does not support gradient checkpointing"
            else:
                missing = None
        _MISSING_CHECKPOINTING[key] = missing
    return _MISSING_CHECKPOINTING[key]


_MISSING_CHECKPOINTING: dict[tuple[Any, ...], str | None] = {}
