"""Model sources: where a workload's model comes from, and how a trial builds it.

``--model`` takes one of:

* ``builtin:NAME``: a preset from :mod:`autotune.presets` (random weights);
* a path to a config file (``config.json`` or any other name: that file is read) or to a
  model directory holding a ``config.json``;
* a Hugging Face Hub id, whose config is read from the local cache;
* ``module:function``: a factory, called as ``function(task=..., seq_len=...)`` (it may
  declare only the arguments it wants) and returning a ``torch.nn.Module`` (see README).

Only configs are read: weights change neither speed nor memory, so models are randomly
initialised, directly on the trial's device.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import WorkloadError
from autotune.presets import PRESETS

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from autotune.workload import Workload

__all__ = ["ModelSource", "parse_model_source", "load_hf_config", "infer_task", "resolve_task", "build_model",
           "LoraTargets", "lora_targets", "lora_targets_note", "missing_checkpointing"]

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    kind: str   # builtin | config | hub | factory
    ref: str    # preset name, path, hub id or module:function


def parse_model_source(spec: str) -> ModelSource:
    """Classify ``--model``; raise WorkloadError with the accepted forms when it fits none."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in PRESETS:
            raise WorkloadError(f"--model {spec}: no such built-in model; use one of "
                                + ", ".join(f"builtin:{n}" for n in PRESETS))
        return ModelSource("builtin", name)
    if os.path.exists(spec):
        return ModelSource("config", spec)
    if _FACTORY.match(spec):
        return ModelSource("factory", spec)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")) and "/" in spec:
        return ModelSource("hub", spec)
    raise WorkloadError(
        f"--model {spec!r} is neither builtin:NAME, an existing config.json or model directory, "
        "a Hub id like org/name, nor module:function")


def load_hf_config(source: ModelSource, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The Hugging Face config of a builtin, path or Hub source (not of a factory)."""
    from transformers import AutoConfig

    if source.kind == "builtin":
        preset = PRESETS[source.ref]
        return AutoConfig.for_model(preset.model_type, **preset.config)
    if source.kind == "config":
        path = Path(source.ref)
        if path.is_file():  # this very file, whatever its name: never a config.json beside it
            _check_json(path, source.ref)
        elif not (path / "config.json").is_file():
            raise WorkloadError(f"--model {source.ref}: no config.json there; point at a model's config file "
                                "or a directory that holds a config.json")
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (ValueError, OSError) as exc:
            _refuse_custom_code(source.ref, exc)
            raise WorkloadError(f"--model {source.ref}: cannot read its config: {_one_line(exc)}") from exc
    if source.kind == "hub":
        return _hub_config(source.ref, trust_remote_code=trust_remote_code)
    raise WorkloadError(f"--model {source.ref}: a factory has no Hugging Face config")


def _check_json(path: Path, ref: str) -> None:
    """Refuse a file that is not a JSON object in one line, before transformers says it its own way."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise WorkloadError(f"--model {ref} is not JSON (not even text); point --model at a model's config "
                            "file (JSON, like config.json) or the directory holding it") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--model {ref} is not JSON (line {exc.lineno}: {exc.msg}); point --model at a "
                            "model's config file (JSON, like config.json) or the directory holding it") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"--model {ref} is JSON but not a model config (an object with a model_type key); "
                            "point --model at a model's config.json or the directory holding it")


def _refuse_custom_code(ref: str, exc: Exception) -> None:
    if "custom code" in str(exc):
        raise WorkloadError(f"--model {ref}: its config needs Python code shipped with the model; read it, "
                            "then pass --trust-remote-code to run it") from exc


def _hub_config(hub_id: str, *, trust_remote_code: bool) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(hub_id, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:  # e.g. custom code without --trust-remote-code
        _refuse_custom_code(hub_id, exc)
        raise WorkloadError(f"--model {hub_id}: {_one_line(exc)}") from exc
    except OSError:
        pass  # not cached: try the Hub itself unless the user said we are offline
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes"):
        try:
            return AutoConfig.from_pretrained(hub_id, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            pass
    raise WorkloadError(
        f"--model {hub_id}: its config is not in the local Hugging Face cache and the Hub cannot be "
        f"reached; on a connected machine run `hf download {hub_id} config.json`, or pass the path "
        "of a config.json")


def infer_task(config: PretrainedConfig) -> str:
    """seq-cls for classifier architectures and encoder-only models; causal-lm otherwise."""
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "seq-cls"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "causal-lm"
    if getattr(config, "is_encoder_decoder", False):
        raise WorkloadError(f"model type {config.model_type!r} is encoder-decoder; autotune trains "
                            "causal-lm and seq-cls models")
    encoder_only = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                    "xlm-roberta", "modernbert"}
    return "seq-cls" if config.model_type in encoder_only else "causal-lm"


def resolve_task(workload: Workload) -> str:
    """Check the workload against its model (before any trial starts) and return its task:
    given, or from the preset / config; factories default to causal-lm."""
    source = parse_model_source(workload.model)
    if source.kind == "factory":  # its module is imported only inside the trial process
        return workload.task or "causal-lm"
    config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    _check_seq_len(config, workload.seq_len)
    if workload.task is not None:
        return workload.task
    if source.kind == "builtin":
        return PRESETS[source.ref].task
    return infer_task(config)


def build_model(workload: Workload, *, task: str, device: torch.device) -> torch.nn.Module:
    """Build the workload's model with random weights directly on ``device``."""
    import torch

    source = parse_model_source(workload.model)
    if source.kind == "factory":
        model = _call_factory(source.ref, task=task, seq_len=workload.seq_len)
        return model.to(device)
    config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    _check_seq_len(config, workload.seq_len)
    if task == "seq-cls" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # HF classifiers need one to find the last token of each row
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    with torch.device(device):
        try:
            return auto.from_config(config, trust_remote_code=workload.trust_remote_code)
        except ValueError as exc:
            raise WorkloadError(f"--model {workload.model} cannot be built for --task {task}: "
                                f"{_one_line(exc)}") from exc


def _check_seq_len(config: Any, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise WorkloadError(f"--seq-len {seq_len} is longer than the model's {limit} positions; "
                            f"use --seq-len {limit} or less")


def _call_factory(ref: str, *, task: str, seq_len: int) -> torch.nn.Module:
    import torch

    module_name, function_name = ref.split(":")
    module = importlib.import_module(module_name)  # an ImportError here is the user's module's own
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise WorkloadError(f"--model {ref}: {module_name} has no callable {function_name!r}")
    offered = {"task": task, "seq_len": seq_len}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    model = factory(**{k: v for k, v in offered.items() if takes_any or k in params})
    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(f"--model {ref} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__



# -- facts found before any trial: LoRA targets, activation checkpointing ---------------------------
# A head is a direct child by one of these names (PEFT's classifier names, causal LMs' lm_head,
# common names in factories), or the output embeddings; heads are never adapted.
_HEAD_NAMES = ("classifier", "score", "lm_head", "head", "output")


@dataclass(frozen=True)
class LoraTargets:
    """What ``LoraConfig`` gets for a workload and config, and the same said in words.

    Trials and the peft export both use it, so the user's job adapts what was measured.
    """

    target_modules: str | tuple[str, ...]       # "all-linear" (PEFT's keyword) or module names
    modules_to_save: tuple[str, ...] | None     # heads trained in full (a classifier's), as PEFT saves them
    task_type: str | None                       # PEFT's TaskType value; None for a factory's plain module
    note: str                                   # e.g. "q_proj, v_proj (PEFT's default targets for llama)"

    def peft_kwargs(self) -> dict[str, Any]:
        """``LoraConfig`` keyword arguments: what a trial applies and the peft export writes."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        # PEFT's SEQ_CLS adds classifier and score to modules_to_save itself: name only other heads.
        own = ("classifier", "score") if self.task_type == "SEQ_CLS" else ()
        extra = [name for name in self.modules_to_save or () if name not in own]
        return {"target_modules": targets, "modules_to_save": extra or None, "task_type": self.task_type}


def lora_targets(workload: Workload, targets: tuple[str, ...] | None, *, task: str,
                 model: torch.nn.Module | None = None) -> LoraTargets:
    """Resolve ``--lora-targets`` (None: the default) for the workload's model.

    The default is PEFT's own targets for the architecture where PEFT has them, else every linear
    layer but the task head, and a classifier's head then trains in full (as PEFT's SEQ_CLS does).
    ``model``: the built model, if there is one; else the fallback builds one on the meta device
    (a factory's in a separate process: its code may hang or crash).
    """
    source = parse_model_source(workload.model)
    task_type = None if source.kind == "factory" else ("CAUSAL_LM" if task == "causal-lm" else "SEQ_CLS")
    note = lora_targets_note(workload, targets, task=task)
    if targets == ("all-linear",):
        return LoraTargets("all-linear", None, task_type, note)
    if targets is not None:
        return LoraTargets(tuple(targets), None, task_type, note)
    defaults = _peft_default_targets(_model_type(workload))
    if defaults is not None:  # named here: PEFT's own lookup fails on some (Mixtral under transformers 5)
        return LoraTargets(defaults, None, task_type, note)
    if model is not None:
        found, heads = _linear_layers_but_heads(model, task=task)
    elif source.kind == "factory":
        facts = _factory_facts(workload, task)
        if facts is None:
            raise WorkloadError(f"--model {workload.model}: building it on the meta device failed, so its linear "
                                "layers are unknown; name the modules to adapt with --lora-targets")
        found, heads = tuple(facts["lora_targets"]), tuple(facts["heads"])
    else:
        found, heads = _linear_layers_but_heads(_meta_model(workload, task), task=task)
    if not found:
        raise WorkloadError(f"--lora-rank: the model from --model {workload.model} has no linear layer besides "
                            "its task head to adapt; name the modules with --lora-targets")
    return LoraTargets(found, heads if task == "seq-cls" and heads else None, task_type, note)


def lora_targets_note(workload: Workload, targets: tuple[str, ...] | None, *, task: str) -> str:
    """Which layers LoRA adapts, in words, without building the model."""
    if targets == ("all-linear",):
        return "every linear layer but the output layer or classifier (PEFT's all-linear)"
    if targets is not None:
        return ", ".join(targets)
    model_type = _model_type(workload)
    defaults = _peft_default_targets(model_type)
    if defaults is not None:
        return f"{', '.join(defaults)} (PEFT's default targets for {model_type})"
    return f"every linear layer but the task head (PEFT has no default targets for {model_type or 'a custom model'})"


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
            facts = _factory_facts(workload, task)
            missing = None if facts is None else facts["missing_checkpointing"]
        else:
            model_class = _hf_model_class(workload, task)
            if model_class is None:
                missing = _checkpointing_gap(_meta_model(workload, task), workload.model)
            elif not getattr(model_class, "supports_gradient_checkpointing", False):
                missing = f"{model_class.__name__} (--model {workload.model}) does not support gradient checkpointing"
            else:
                missing = None
        _MISSING_CHECKPOINTING[key] = missing
    return _MISSING_CHECKPOINTING[key]


_MISSING_CHECKPOINTING: dict[tuple[Any, ...], str | None] = {}


def _checkpointing_gap(model: Any, ref: str) -> str | None:
    if not callable(getattr(model, "gradient_checkpointing_enable", None)):
        return f"the model from --model {ref} has no gradient_checkpointing_enable()"
    if getattr(model, "supports_gradient_checkpointing", True) is False:  # HF models have the method anyway
        return f"{type(model).__name__} (--model {ref}) does not support gradient checkpointing"
    return None


def _hf_model_class(workload: Workload, task: str) -> type | None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = load_hf_config(parse_model_source(workload.model), trust_remote_code=workload.trust_remote_code)
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    try:
        from transformers.models.auto.auto_factory import _get_model_class  # private: a fallback follows

        return _get_model_class(config, auto._model_mapping)
    except (ImportError, KeyError, ValueError, AttributeError):
        return None  # remote code, or a transformers without it: build on the meta device instead


def _meta_model(workload: Workload, task: str) -> torch.nn.Module:
    """The model with no memory behind its tensors: its structure, in a second or so."""
    import torch

    source = parse_model_source(workload.model)
    if source.kind == "factory":
        with torch.device("meta"):
            return _call_factory(source.ref, task=task, seq_len=workload.seq_len)
    return build_model(workload, task=task, device=torch.device("meta"))


_FACTORY_FACTS: dict[tuple[str, str, int], dict[str, Any] | None] = {}
_PROBE_TIMEOUT_S = 120


def _factory_facts(workload: Workload, task: str) -> dict[str, Any] | None:
    """A factory's model, built on the meta device in a child process: None if that fails or hangs."""
    import signal
    import subprocess
    import sys

    key = (workload.model, task, workload.seq_len)
    if key in _FACTORY_FACTS:
        return _FACTORY_FACTS[key]
    code = "import sys; from autotune.models import _probe_main; _probe_main(*sys.argv[1:])"
    facts = None
    with subprocess.Popen([sys.executable, "-c", code, workload.model, task, str(workload.seq_len)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          start_new_session=True) as probe:
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
    from autotune.workload import Workload

    model = _meta_model(Workload(model=ref, task=task, seq_len=int(seq_len)), task)
    targets, heads = _linear_layers_but_heads(model, task=task)
    print("\n" + json.dumps({"missing_checkpointing": _checkpointing_gap(model, ref),
                             "lora_targets": targets, "heads": heads}), flush=True)


def _model_type(workload: Workload) -> str | None:
    source = parse_model_source(workload.model)
    if source.kind == "factory":
        return None
    if source.kind == "builtin":
        return PRESETS[source.ref].model_type
    return load_hf_config(source, trust_remote_code=workload.trust_remote_code).model_type


def _peft_default_targets(model_type: str | None) -> tuple[str, ...] | None:
    if model_type is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return tuple(targets) if targets else None


def _linear_layers_but_heads(model: torch.nn.Module, *, task: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Last names (as PEFT matches them) of the linear layers outside the task head, and of the heads."""
    import torch

    linear: tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        linear += (Conv1D,)
    except ImportError:
        pass
    head_names = _head_names(model, task=task)
    leaves = {head.rpartition(".")[2] for head in head_names}
    # A classifier trains in full: PEFT wraps every module whose name *ends with* a modules_to_save
    # name (its SEQ_CLS adds classifier and score), DistilBERT's pre_classifier included.
    saved = leaves | {"classifier", "score"} if task == "seq-cls" else set()
    targets = set()
    for name, module in model.named_modules():
        in_head = any(name == head or name.startswith(head + ".") for head in head_names)
        if isinstance(module, linear) and not in_head and not any(name.endswith(s) for s in saved):
            targets.add(name.rpartition(".")[2])
    return tuple(sorted(targets - leaves)), tuple(sorted(leaves))


def _head_names(model: torch.nn.Module, *, task: str) -> list[str]:
    """The task head: the output embeddings (an LM's vocabulary projection) or a classifier."""
    heads = [module for name, module in model.named_children() if name in _HEAD_NAMES]
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None:
        heads.append(output)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(model, "vocab_size", None)
    if task == "causal-lm" and isinstance(vocab, int):  # a factory's projection onto the vocabulary
        heads += [m for m in model.modules() if getattr(m, "out_features", None) == vocab]
    ids = {id(m) for m in heads}
    return [name for name, module in model.named_modules() if id(module) in ids and name]
