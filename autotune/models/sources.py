"""Model sources: where a workload's model comes from, and how a trial builds it.

``--model`` takes one of:

* ``builtin:NAME``: a preset from :mod:`autotune.models.presets` (random weights);
* a path to a config file (``config.json`` or any other name: that file is read) or to a
  model directory holding a ``config.json``;
* a Hugging Face Hub id, whose config is read from the local cache;
* ``module:function``: a factory, called as ``function(task=..., seq_len=...)`` (it may
  declare only the arguments it wants) and returning a ``torch.nn.Module``, or
  ``(model, make_batch)`` where ``make_batch(micro_batch, device)`` returns the keyword
  arguments of the model's forward: any input, not only token ids (see docs/guides/models.md).

Only configs are read: weights change neither speed nor memory, so models are randomly
initialised, directly on the trial's device.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import WorkloadError
from autotune.models.presets import PRESETS

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from autotune.config.workload import Workload
    from autotune.models.batches import MakeBatch

__all__ = [
    "ModelSource",
    "parse_model_source",
    "load_hf_config",
    "infer_task",
    "auto_class",
    "import_model_module",
    "resolve_task",
    "build_model",
    "build_model_and_batch",
    "image_size",
    "meta_model",
    "model_type",
    "call_factory",
]

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # builtin | config | hub | factory
    ref: str  # preset name, path, hub id or module:function


def parse_model_source(spec: str) -> ModelSource:
    """Classify ``--model``; raise WorkloadError with the accepted forms when it fits none."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(f'builtin:{n}' for n in close)}? " if close else ""
            raise WorkloadError(f"--model {spec}: no such built-in model; {hint}`autotune models` lists them all")
        return ModelSource("builtin", name)
    if os.path.exists(spec):
        return ModelSource("config", spec)
    if _FACTORY.match(spec):
        return ModelSource("factory", spec)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")) and "/" in spec:
        return ModelSource("hub", spec)
    raise WorkloadError(
        f"--model {spec!r} is neither builtin:NAME, an existing config.json or model directory, "
        "a Hub id like org/name, nor module:function"
    )


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
            raise WorkloadError(
                f"--model {source.ref}: no config.json there; point at a model's config file "
                "or a directory that holds a config.json"
            )
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
        raise WorkloadError(
            f"--model {ref} is not JSON (not even text); point --model at a model's config "
            "file (JSON, like config.json) or the directory holding it"
        ) from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"--model {ref} is not JSON (line {exc.lineno}: {exc.msg}); point --model at a "
            "model's config file (JSON, like config.json) or the directory holding it"
        ) from None
    if not isinstance(data, dict):
        raise WorkloadError(
            f"--model {ref} is JSON but not a model config (an object with a model_type key); "
            "point --model at a model's config.json or the directory holding it"
        )


def _refuse_custom_code(ref: str, exc: Exception) -> None:
    if "custom code" in str(exc):
        raise WorkloadError(
            f"--model {ref}: its config needs Python code shipped with the model; read it, "
            "then pass --trust-remote-code to run it"
        ) from exc


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
        "of a config.json"
    )


def infer_task(config: PretrainedConfig) -> str:
    """seq-cls for classifier architectures and encoder-only models; causal-lm otherwise."""
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith("ForImageClassification") for a in architectures) or _takes_images(config):
        return "image-cls"
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "seq-cls"
    if any(a.endswith("ForMaskedLM") for a in architectures):
        return "masked-lm"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "causal-lm"
    if getattr(config, "is_encoder_decoder", False):  # T5, mT5, BART...: ForConditionalGeneration
        return "seq2seq-lm"
    encoder_only = {
        "bert",
        "roberta",
        "distilbert",
        "albert",
        "electra",
        "deberta",
        "deberta-v2",
        "xlm-roberta",
        "modernbert",
    }
    return "seq-cls" if config.model_type in encoder_only else "causal-lm"


def _takes_images(config: PretrainedConfig) -> bool:
    """A vision model's config: channels of pixels in, no token vocabulary (ViT, ResNet, ConvNeXt...)."""
    return getattr(config, "num_channels", None) is not None and getattr(config, "vocab_size", None) is None


def check_factory_module(workload: Workload) -> None:
    """Refuse a factory ``module:function`` whose module is nowhere a trial would import it from: the current
    directory or PYTHONPATH (or an installed package). Only its top-level package is looked up, never imported:
    the user's code runs in a trial's or an estimate's own process. Asked where the user's command starts (its
    working directory is the trials'), before anything is probed or written."""
    source = parse_model_source(workload.model)
    if source.kind != "factory":
        return
    import importlib.machinery
    import importlib.util
    import sys

    top = source.ref.split(":")[0].split(".")[0]
    where = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    here = importlib.machinery.PathFinder.find_spec(top, where) is not None
    if not here and top not in sys.modules and importlib.util.find_spec(top) is None:
        raise WorkloadError(
            f"--model {workload.model}: no module {top!r} in the current directory, on PYTHONPATH or "
            "installed; run from the directory that holds it, or add that directory to PYTHONPATH"
        )


def resolve_task(workload: Workload) -> str:
    """Check the workload against its model (before any trial starts) and return its task:
    given, or from the preset / config; factories default to causal-lm."""
    source = parse_model_source(workload.model)
    if source.kind == "factory":  # its module is imported only inside the trial process
        return workload.task or "causal-lm"
    config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    _check_seq_len(config, workload.seq_len)
    if workload.task is not None:
        task = workload.task
    elif source.kind == "builtin":
        task = PRESETS[source.ref].task
    else:
        task = infer_task(config)
    _check_task_fits(config, task, workload)
    return task


def _check_task_fits(config: PretrainedConfig, task: str, workload: Workload) -> None:
    if (task == "image-cls") != _takes_images(config):
        if task == "image-cls":
            raise WorkloadError(
                f"--task image-cls: model type {config.model_type!r} (--model {workload.model}) "
                "takes token ids, not images; leave --task out or use a vision model"
            )
        raise WorkloadError(
            f"--task {task}: model type {config.model_type!r} (--model {workload.model}) takes "
            "images; use --task image-cls"
        )
    if workload.image_size is not None and task != "image-cls":
        raise WorkloadError(
            f"--image-size is the input of an image-cls task, and --model {workload.model} trains {task}; leave it out"
        )
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if task == "seq2seq-lm" and not encoder_decoder:
        raise WorkloadError(
            f"--task seq2seq-lm: model type {config.model_type!r} (--model {workload.model}) has "
            "no decoder of its own; use --task causal-lm for a decoder-only model"
        )
    if task != "seq2seq-lm" and encoder_decoder and task != "seq-cls":
        raise WorkloadError(
            f"--task {task}: model type {config.model_type!r} (--model {workload.model}) is an "
            "encoder-decoder; use --task seq2seq-lm"
        )
    if workload.target_len is not None and task != "seq2seq-lm":
        raise WorkloadError(
            f"--target-len is the decoder's length of a seq2seq-lm task, and --model "
            f"{workload.model} trains {task}; leave it out"
        )
    if task == "seq2seq-lm":
        _check_seq_len(config, workload.decoder_len, flag="--target-len")


def build_model(
    workload: Workload, *, task: str, device: torch.device, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """Build the workload's model with random weights directly on ``device``; a Transformers model
    with its weights in ``dtype`` when given, as ``from_pretrained(dtype=...)`` loads them (a
    factory's model comes as its factory builds it: the caller casts it)."""
    return build_model_and_batch(workload, task=task, device=device, dtype=dtype)[0]


def build_model_and_batch(
    workload: Workload, *, task: str, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.nn.Module, MakeBatch | None]:
    """:func:`build_model`, and the factory's ``make_batch`` when it gave one (else None: the
    task's synthetic batch feeds the model)."""
    import torch

    source = parse_model_source(workload.model)
    if source.kind == "factory":
        model, make_batch = call_factory(source.ref, task=task, seq_len=workload.seq_len)
        return model.to(device), make_batch
    config = load_hf_config(source, trust_remote_code=workload.trust_remote_code)
    _check_seq_len(config, workload.seq_len)
    if task == "seq-cls" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # HF classifiers need one to find the last token of each row
    if task == "image-cls" and workload.image_size is not None and hasattr(config, "image_size"):
        config.image_size = workload.image_size  # ViT's position embeddings: one per patch of this size
    auto = auto_class(task)
    with torch.device(device):
        try:
            return auto.from_config(
                config, trust_remote_code=workload.trust_remote_code, **({} if dtype is None else {"dtype": dtype})
            ), None
        except ValueError as exc:
            raise WorkloadError(
                f"--model {workload.model} cannot be built for --task {task}: {_one_line(exc)}"
            ) from exc


def image_size(workload: Workload, model: torch.nn.Module) -> int:
    """Pixels per side an image-cls trial feeds: --image-size, else the config's, else 224."""
    from autotune.config.workload import DEFAULT_IMAGE_SIZE

    configured = getattr(getattr(model, "config", None), "image_size", None)
    if isinstance(configured, (list, tuple)):  # some configs give (height, width)
        configured = configured[0]
    return workload.image_size or (configured if isinstance(configured, int) else DEFAULT_IMAGE_SIZE)


def auto_class(task: str) -> Any:
    """The Transformers Auto class that builds a model for ``task``."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageClassification,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    return {
        "causal-lm": AutoModelForCausalLM,
        "masked-lm": AutoModelForMaskedLM,
        "seq2seq-lm": AutoModelForSeq2SeqLM,
        "image-cls": AutoModelForImageClassification,
    }.get(task, AutoModelForSequenceClassification)


def import_model_module(model: str, *, trust_remote_code: bool = False) -> None:
    """Import the Transformers module of ``model``'s architecture (``builtin:``/config/hub spec), and with it
    ``transformers.modeling_utils``: what a server that forks trials or estimates imports once, where each
    fork would import it again (1.5 s on a 2-core CPU, most of a tiny model's estimate).

    Only for configs Transformers ships code for: a factory or remote code could do anything at import
    time (touch CUDA, for one), so those are imported by the trial itself. Quiet on any failure: the
    trial or estimate reports what is wrong with the model.
    """
    from autotune.config.workload import TASKS

    try:
        source = parse_model_source(model)
        if source.kind == "factory" or trust_remote_code:
            return
        config = load_hf_config(source)
        for auto in {auto_class(task) for task in TASKS}:
            if type(config) in auto._model_mapping:
                auto._model_mapping[type(config)]  # noqa: B018 - the lookup imports the module
    except Exception:  # noqa: BLE001 - the trial itself will report what is wrong with the model
        return


def _check_seq_len(config: Any, seq_len: int, flag: str = "--seq-len") -> None:
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise WorkloadError(
            f"{flag} {seq_len} is longer than the model's {limit} positions; use {flag} {limit} or less"
        )


def call_factory(ref: str, *, task: str, seq_len: int) -> tuple[torch.nn.Module, MakeBatch | None]:
    """The factory's model, and its ``make_batch`` when it returned ``(model, make_batch)``."""
    import torch

    module_name, function_name = ref.split(":")
    module = importlib.import_module(module_name)  # an ImportError here is the user's module's own
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise WorkloadError(f"--model {ref}: {module_name} has no callable {function_name!r}")
    offered = {"task": task, "seq_len": seq_len}
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    built = factory(**{k: v for k, v in offered.items() if takes_any or k in params})
    if isinstance(built, torch.nn.Module):
        return built, None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module) and callable(built[1]):
        return built
    raise WorkloadError(f"--model {ref} returned {type(built).__name__}, not a torch.nn.Module or (model, make_batch)")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def meta_model(workload: Workload, task: str) -> torch.nn.Module:
    """The model with no memory behind its tensors: its structure, in a second or so."""
    import torch

    source = parse_model_source(workload.model)
    if source.kind == "factory":
        with torch.device("meta"):
            return call_factory(source.ref, task=task, seq_len=workload.seq_len)[0]
    return build_model(workload, task=task, device=torch.device("meta"))


def model_type(workload: Workload) -> str | None:
    source = parse_model_source(workload.model)
    if source.kind == "factory":
        return None
    if source.kind == "builtin":
        return PRESETS[source.ref].model_type
    return load_hf_config(source, trust_remote_code=workload.trust_remote_code).model_type
