"""Tensor parallel: each decoder layer's attention and MLP split over the ranks of a mesh.

The split is the model's own Transformers ``base_model_tp_plan`` (q/k/v and the MLP's up projections
split by output columns, o_proj and down_proj by input rows: one all-reduce after attention and one
after the MLP, Megatron's layout), applied with PyTorch's ``parallelize_module``. The LM head is split by
vocabulary rows with its logits gathered whole, as Transformers' own ``_tp_plan`` for a causal LM
(``colwise_gather_output``), torchtitan's Llama plan (``ColwiseParallel`` with ``Replicate`` logits without
loss parallel) and KempnerForge's apply it: each rank keeps 1/tp of the head's weight, gradient and optimizer
states, and the loss sees every logit. A head tied to the embedding, or whose vocabulary the ranks cannot split
evenly, stays whole. The embedding and the norms stay whole on every rank. With sequence parallel, the norms
and the residual stream between layers are split along the sequence instead (torchtitan's Llama plan): the two
all-reduces become an all-gather before and a reduce-scatter after each block, and each rank holds 1/tp of
those activations.

Data parallel over the other ranks is FSDP2's, on the mesh's other dimension (2-D, as torchtitan
builds it): see :func:`autotune.prepare.sharding.shard_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.levers.tensor_parallel import TP_STYLES

if TYPE_CHECKING:
    import torch

    from autotune.config.knobs import TrialConfig

__all__ = ["layout_mesh", "tensor_parallel", "tensor_parallel_plan"]

# Where sequence parallel reshards the activations, in a Llama-family layer's names.
_SP_NORMS = ("input_layernorm", "post_attention_layernorm")
_SP_BLOCKS = ("self_attn", "mlp")


def tensor_parallel_plan(
    model: torch.nn.Module, ranks: int, *, sequence_parallel: bool = False, plan: dict[str, str] | None = None
) -> dict[str, Any]:
    """The model's plan over ``ranks`` as PyTorch styles, keyed by module paths in ``model`` (``*`` for every
    layer). ``plan``: Transformers' plan for a module that is not the model but holds its layers under the same
    names (a pipeline stage's ``layers``, and its head on the last stage)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from autotune.errors import ConfigError

    base = "" if plan is not None else _base_prefix(model)
    plan = plan if plan is not None else getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(f"--tp: {type(model).__name__} has no tensor-parallel plan (base_model_tp_plan)")
    styles: dict[str, Any] = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError(f"--tp: {type(model).__name__}'s plan uses {style} for {pattern}; use --tp 1")
        # Rowwise outputs are all-reduced whole, or (sequence parallel) reduce-scattered along the sequence.
        if style == "colwise":
            styles[base + pattern] = ColwiseParallel()
        else:
            styles[base + pattern] = RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    head = _head_name(model)
    split_head = head is not None and _splits(model, head, ranks)
    if split_head:  # the logits come back whole on every rank; with sequence parallel it gathers its input first
        styles[str(head)] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Replicate()
        )
    if not sequence_parallel:
        return styles
    names = {name for name, _ in model.named_modules()}
    layer = next((p.split(".*.")[0] for p in plan if ".*." in p), "layers")
    needed = [f"{base}{layer}.0.{part}" for part in (*_SP_NORMS, *_SP_BLOCKS)] + [f"{base}norm"]
    missing = [name for name in needed if name not in names]
    if missing:
        raise ConfigError(
            f"--sequence-parallel on: {type(model).__name__} has no {missing[0]} (autotune knows Llama-family "
            "layers' names for it); use --sequence-parallel off"
        )
    # The residual stream between layers is split along the sequence: the first layer cuts the whole
    # embedding (no communication; the model reads positions from the whole one), each norm works on its
    # slice, each block gathers the sequence back and reduce-scatters its output.
    styles[f"{base}{layer}.0"] = _hidden_states_to("split")
    for norm in _SP_NORMS:
        styles[f"{base}{layer}.*.{norm}"] = SequenceParallel()
    for block in _SP_BLOCKS:
        styles[f"{base}{layer}.*.{block}"] = _hidden_states_to("whole")
    styles[f"{base}norm"] = SequenceParallel(use_local_output=True)
    if head is not None and not split_head:  # a whole head reads the whole sequence
        styles[head] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return styles


def tensor_parallel(
    model: torch.nn.Module, config: TrialConfig, mesh: Any, *, plan: dict[str, str] | None = None
) -> torch.nn.Module:
    """Split ``model``'s layers over ``mesh`` (1-D, the tensor-parallel ranks), in place; returns it.
    ``plan``: see :func:`tensor_parallel_plan`."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = tensor_parallel_plan(model, config.tp, sequence_parallel=config.sequence_parallel, plan=plan)
    parallelize_module(model, mesh, styles)
    return model


def layout_mesh(config: TrialConfig, device_type: str) -> Any:
    """The ranks of the process group as a (data, tensor) mesh, named ``dp`` and ``tp``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.errors import ConfigError

    if not dist.is_initialized():
        raise ConfigError(
            f"--tp {config.tp} splits layers over the ranks of a process group: run the job under torchrun "
            "and call torch.distributed.init_process_group() before autotune.prepare"
        )
    world = dist.get_world_size()
    if world % config.tp:
        raise ConfigError(f"--tp {config.tp} does not divide the {world} ranks of the process group")
    return init_device_mesh(device_type, (world // config.tp, config.tp), mesh_dim_names=("dp", "tp"))


def _hidden_states_to(placement: str) -> Any:
    """A style that hands a module its hidden states whole (``"whole"``: all-gathered along the sequence) or
    cut to this rank's slice of the sequence (``"split"``: no communication), however its caller passes
    them (Llama's layer hands attention ``hidden_states=`` and the MLP a positional one)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class HiddenStates(ParallelStyle):
        def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            def convert(hidden: Any) -> Any:
                was, wanted = (Shard(1), Replicate()) if placement == "whole" else (Replicate(), Shard(1))
                tensor = hidden if isinstance(hidden, DTensor) else DTensor.from_local(hidden, device_mesh, [was])
                return tensor.redistribute(device_mesh, [wanted]).to_local()

            def hook(_: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if args:
                    return (convert(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return HiddenStates()


def _base_prefix(model: torch.nn.Module) -> str:
    """Where the plan's names start in ``model``: ``model.`` in a ``...ForCausalLM``, nothing in the base."""
    import torch

    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module) else ""


def _head_name(model: torch.nn.Module) -> str | None:
    """The LM head's path in ``model``: a Transformers model's output embeddings, a pipeline stage's ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    embeddings = getter() if callable(getter) else getattr(model, "lm_head", None)
    if embeddings is None:
        return None
    return next((name for name, module in model.named_modules() if module is embeddings), None)


def _splits(model: torch.nn.Module, head: str, ranks: int) -> bool:
    """Whether the head at ``head`` is split by vocabulary rows: a Linear of its own weight (a tied one is the
    embedding's, which stays whole), whose rows ``ranks`` divide evenly."""
    import torch

    module = model.get_submodule(head)
    if not isinstance(module, torch.nn.Linear) or module.out_features % ranks:
        return False
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    return embedding is None or getattr(embedding, "weight", None) is not module.weight
