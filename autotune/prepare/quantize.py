"""QLoRA's frozen base: the linear layers of the base model quantized with bitsandbytes, as
Transformers' ``BitsAndBytesConfig`` loads them.

* ``nf4``: 4-bit NormalFloat with double quantization (a scale per 64 weights, the scales
  themselves in 8 bits with one fp32 scale per 256 of them): ``Linear4bit``, which dequantizes
  each weight to the compute type in forward and again in backward.
* ``int8``: LLM.int8() (``Linear8bitLt``): int8 weights with an fp32 scale per output row.

Every linear layer outside the task head is quantized (Transformers keeps the output embeddings
and the last module in full precision: the LM head, a classifier); LoRA then adapts the quantized
layers (PEFT has its own bitsandbytes LoRA layers). The compute type is the precision's 16-bit type
(fp32 for fp32), and the weights are quantized from it, as a recipe's ``torch_dtype`` loads them.

bitsandbytes has run on a CPU since 0.48 (PyTorch kernels), so the same layers train in CPU trials.
A model already quantized (``from_pretrained(quantization_config=...)``) is left as it is.

Lightning's ``BitsandbytesPrecision`` (LitGPT's ``--quantize bnb.nf4``) quantizes differently, and a
published LitGPT measurement is rebuilt that way (:func:`as_lightning_quantizes`).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterator

from autotune.errors import ConfigError
from autotune.levers.lora import quantize_library_refusal
from autotune.prepare.model_facts import is_under

if TYPE_CHECKING:
    import torch

    from autotune.config.knobs import TrialConfig

__all__ = [
    "bitsandbytes_config",
    "quantization_lines",
    "quantize_base",
    "quantization_constants",
    "parameter_numel",
    "quantization_line",
    "as_lightning_quantizes",
]

NF4_BLOCK = 64  # weights per absmax scale (bitsandbytes' and Transformers' default)
INT8_THRESHOLD = 6.0  # BitsAndBytesConfig's llm_int8_threshold default: outlier columns stay 16-bit on CUDA

_LIGHTNING_MODE: ContextVar[str | None] = ContextVar("lightning_bnb_mode", default=None)


@contextlib.contextmanager
def as_lightning_quantizes(mode: str) -> Iterator[None]:
    """Bases quantized here are quantized as Lightning's ``BitsandbytesPrecision(mode)`` quantizes them
    (``lightning/fabric/plugins/precision/bitsandbytes.py``), for ``mode`` "nf4" or "nf4-dq":

    * every ``torch.nn.Linear`` becomes a 4-bit layer, the LM head too: its ``init_context`` patches the
      class itself (``_ClassReplacementContextManager({"torch.nn.Linear": ...})``) and LitGPT passes no
      ``ignore_modules``;
    * "nf4" keeps an fp32 scale per 64 weights (``_NF4Linear``: ``compress_statistics=False``), "nf4-dq"
      quantizes the scales (``_NF4DQLinear``);
    * each weight is cast to float16 before it is quantized (``_Linear4bit._quantize_weight``).
    """
    if mode not in ("nf4", "nf4-dq"):
        raise ValueError(f"as_lightning_quantizes: mode {mode!r} (nf4 or nf4-dq)")
    token = _LIGHTNING_MODE.set(mode)
    try:
        yield
    finally:
        _LIGHTNING_MODE.reset(token)


def quantization_line(config: TrialConfig) -> str:
    """What holds ``config``'s frozen base, as the trial result names it ("" when it is not quantized)."""
    if config.quantize_base == "off":
        return ""
    from importlib.metadata import version

    layer = "Linear4bit nf4, double-quantized scales" if config.quantize_base == "nf4" else "Linear8bitLt"
    return f"bitsandbytes {version('bitsandbytes')} {layer}, computing in {config.sixteen_bit or 'float32'}"


def bitsandbytes_config(config: TrialConfig) -> dict[str, Any]:
    """Keyword arguments of Transformers' ``BitsAndBytesConfig`` that load the base as the trials held it
    (its default modules left unquantized: the output embeddings and the last module, the task head)."""
    if config.quantize_base == "int8":
        return {"load_in_8bit": True, "llm_int8_threshold": INT8_THRESHOLD}
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": config.sixteen_bit or "float32",
        "bnb_4bit_quant_storage": "uint8",
    }


def quantization_lines(config: TrialConfig) -> list[str]:
    """How a user's job holds the base as the trials did: a line for a YAML export's header."""
    if config.quantize_base == "off":
        return []
    arguments = ", ".join(f"{k}={v!r}" for k, v in bitsandbytes_config(config).items())
    lightning = "nf4-dq" if config.quantize_base == "nf4" else "int8-training"
    return [
        f"quantized base ({config.quantize_base}): from_pretrained(..., quantization_config=BitsAndBytesConfig"
        f"({arguments})) (autotune export --format bnb writes it), or `model = autotune.prepare(model, config)` "
        "on a built model; Lightning: plugins=BitsandbytesPrecision(mode="
        f"{lightning!r}, dtype=torch.{config.sixteen_bit or 'float32'}); LitGPT: --quantize bnb.{lightning}",
        "quantized base: the trials held the unquantized weights (embeddings, norms, head) as the precision "
        "holds them; peft's prepare_model_for_kbit_training makes fp32 copies of them, memory the trials did "
        "not count",
    ]


def quantize_base(
    model: torch.nn.Module, config: TrialConfig, *, heads: tuple[str, ...], device: torch.device | None = None
) -> int:
    """Replace each linear layer of ``model`` outside ``heads`` (module names, with what is under
    them) by its bitsandbytes layer, quantized where its weight is. Returns how many were replaced (none
    when the model was loaded quantized).

    A model built with its parameters on the meta device (a trial's build: ``from_pretrained`` with a
    quantization config never holds the whole base unquantized either) is made on ``device`` a layer at a
    time, each linear layer quantized as soon as it is made, then the rest of its parameters: random
    weights, the task head in its own type and the rest of the frozen base in the compute type."""
    import torch

    refusal = quantize_library_refusal()
    if refusal is not None:
        raise ConfigError(refusal)
    import bitsandbytes as bnb

    compute = getattr(torch, config.sixteen_bit) if config.sixteen_bit else torch.float32
    lightning = _LIGHTNING_MODE.get() if config.quantize_base == "nf4" else None
    double_quant = lightning != "nf4"
    source = torch.float16 if lightning else compute  # the type each weight is quantized from
    if lightning:
        heads = ()  # Lightning's class patch reaches the LM head too

    # A LoRA layer's adapters, when LoRA came first: PEFT's layers wrap the layer they adapt as base_layer.
    adapters = [
        f"{name}.{child_name}" if name else child_name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "base_layer", None), torch.nn.Module)
        for child_name, child in module.named_children()
        if child is not module.base_layer
    ]
    replaced = held = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if is_under(full, heads) or is_under(full, adapters):
                continue
            if isinstance(child, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
                held += 1  # quantized already: loaded with a BitsAndBytesConfig
                continue
            weight = _linear_weight(child)
            if weight is None:
                continue
            with torch.no_grad():
                weight = _made(weight, source, device) if weight.is_meta else weight.detach().to(source)
                layer = _quantized_layer(bnb, config.quantize_base, weight, child.bias, compute, double_quant)
            setattr(parent, name, layer)
            replaced += 1
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:  # the rest of a base built on the meta device
                dtype = param.dtype if is_under(module_name, heads) else compute
                made = _made(param, dtype, device)
                module._parameters[name] = torch.nn.Parameter(made, requires_grad=param.requires_grad)
    if not replaced + held:
        raise ConfigError(
            f"--quantize-base {config.quantize_base}: the model has no linear layer outside its task head to "
            "quantize; use --quantize-base off"
        )
    return replaced


def _made(meta: torch.Tensor, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """A parameter built on the meta device, made on ``device`` with random values."""
    import torch

    from autotune.prepare.sharding import INIT_STD

    if device is None:
        raise ConfigError("prepare(): the model's parameters are on the meta device; pass device= to make them on")
    return torch.empty(meta.shape, dtype=dtype, device=device).normal_(0.0, INIT_STD)


def _linear_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The (out, in) weight of a linear layer (GPT-2's Conv1D holds it transposed); None for other modules."""
    import torch

    if type(module) is torch.nn.Linear:
        return module.weight
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):  # transformers' GPT-2 layer
        return weight.t()
    return None


def _quantized_layer(
    bnb: Any, kind: str, weight: torch.Tensor, bias: Any, compute: torch.dtype, double_quant: bool = True
) -> torch.nn.Module:
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    out_features, in_features = weight.shape
    from autotune.prepare.sharding import torch_fake_mode_active

    fake = torch_fake_mode_active()
    # Made empty on the meta device with no mode active: under fake tensors its meta weight would be
    # a fake one, which bitsandbytes' parameter classes cannot wrap (see _fake_nf4).
    with _disable_current_modes():
        if kind == "nf4":
            layer = bnb.nn.Linear4bit(
                in_features,
                out_features,
                bias=False,
                compute_dtype=compute,
                compress_statistics=double_quant,
                quant_type="nf4",
                quant_storage=torch.uint8,
                device="meta",
            )
        else:
            layer = bnb.nn.Linear8bitLt(
                in_features, out_features, bias=False, has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta"
            )
    if fake:
        layer.weight = _fake_nf4(bnb, weight, double_quant) if kind == "nf4" else _fake_int8(weight)
    elif kind == "nf4":
        held = bnb.nn.Params4bit(
            weight, requires_grad=False, compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.uint8
        )
        layer.weight = held.to(weight.device)  # Params4bit quantizes as it moves to a device
    else:
        held = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        layer.weight = held.to(weight.device)  # Int8Params quantizes as it moves to a device
    layer.bias = bias  # kept as it was (frozen under LoRA); the layer casts it to the input's type
    return layer


# bitsandbytes' parameter classes (Params4bit, Int8Params) are tensor subclasses made with
# _make_subclass, which a fake tensor cannot become. The estimator's trace holds the same bytes,
# quantized by the same bitsandbytes functions, in a plain parameter carrying the same attributes
# the layers' forward reads.
def _fake_nf4(bnb: Any, weight: torch.Tensor, double_quant: bool = True) -> torch.nn.Parameter:
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    functional = bnb.functional
    if "dynamic" not in functional.name2qmap:
        with _disable_current_modes():  # the 8-bit code the scales are quantized with, made from real values
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()
    packed, state = functional.quantize_4bit(
        weight, blocksize=NF4_BLOCK, compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.uint8
    )
    held = torch.nn.Parameter(packed, requires_grad=False)
    held.quant_state = state  # type: ignore[attr-defined]  # what Params4bit carries
    return held


def _fake_int8(weight: torch.Tensor) -> torch.nn.Parameter:
    import torch

    codes, scales, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(weight.to(torch.float16), 0.0)
    held = torch.nn.Parameter(codes, requires_grad=False)
    held.CB, held.SCB = codes, scales  # type: ignore[attr-defined]  # what Int8Params carries
    return held


def quantization_constants(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized base holds beside its parameters: NF4's scales (and their own scale
    and code), int8's row scales. Model states, like the weights they scale."""
    import torch

    found: list[torch.Tensor] = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        while state is not None:
            found += [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
            state = state.state2
        row_scales = getattr(getattr(module, "state", None), "SCB", None)
        if row_scales is None:
            row_scales = getattr(weight, "SCB", None)
        if isinstance(row_scales, torch.Tensor):
            found.append(row_scales)
    return found


def parameter_numel(param: torch.Tensor) -> int:
    """The weights a parameter stands for: NF4 packs two in a byte (its tensor has half as many)."""
    state = getattr(param, "quant_state", None)
    return int(state.shape.numel()) if state is not None else param.numel()
