"""Pipeline parallel: a causal LM's decoder layers split in order over ranks, run by PyTorch's schedules.

Each rank keeps only its stage: the embedding on the first, a run of decoder layers, the final norm and
the head on the last (the model's Transformers ``base_model_pp_plan`` names them). The batch of one
optimizer step is cut into the accumulation steps' micro batches, which ``torch.distributed.pipelining``
moves through the stages: GPipe runs every forward then every backward; 1F1B alternates once the
pipeline is full (at most ``pp`` micro batches' activations held); interleaved 1F1B gives each rank two
stages (rank r holds stages r and r + pp), which shrinks the idle bubble for more transfers.

:class:`Pipeline` is what ``autotune.prepare(model, config)`` returns with ``pp`` > 1: a module that holds
this rank's stages (its ``parameters()`` go to the optimizer) and runs one optimizer step's forwards and
backwards with :meth:`Pipeline.step`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autotune.levers.pipeline import stages_per_rank

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["Pipeline", "stage_layers"]


def stage_layers(layers: int, stages: int, index: int) -> range:
    """The decoder layers of stage ``index`` of ``stages``: in order, as even as the count allows."""
    return range(index * layers // stages, (index + 1) * layers // stages)


class _Stage(torch.nn.Module):
    """One pipeline stage of a Llama-family causal LM: [embedding], decoder layers, [norm and head].

    Every stage makes the rotary position embeddings itself (they are small and computed, not sent).
    Attention runs without a mask: SDPA's causal kernel, as the whole model runs it without padding.
    """

    def __init__(self, model: torch.nn.Module, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        base = _base_model(model)
        self.hidden_size: int = getattr(model, "config").hidden_size  # noqa: B009 - Module's getattr types it
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(base.layers[i] for i in layers)
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.get_output_embeddings() if last else None  # type: ignore[operator]  # a PreTrainedModel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:  # the first stage receives token ids
            hidden = self.embed_tokens(hidden)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.norm is not None and self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _base_model(model: torch.nn.Module) -> Any:
    """The decoder inside a ``...ForCausalLM`` (Transformers' ``base_model_prefix``: ``model``)."""
    return getattr(model, str(model.base_model_prefix))


def _static_shapes(
    stage: Any, shapes: tuple[int, int] | None, config: TrialConfig, device: torch.device
) -> dict[str, Any]:
    """``PipelineStage``'s ``input_args`` and ``output_args`` for one micro batch (none without ``shapes``):
    token ids into the first stage, hidden states (the weights' dtype: the residual stream keeps it under
    autocast) between stages, logits (autocast's dtype where it computes the head) out of the last."""
    if shapes is None:
        return {}
    micro, seq = shapes
    weights = next(stage.parameters()).dtype
    if stage.embed_tokens is not None:
        inputs = torch.zeros(micro, seq, dtype=torch.long, device=device)
    else:
        inputs = torch.zeros(micro, seq, stage.hidden_size, dtype=weights, device=device, requires_grad=True)
    if stage.lm_head is not None:
        logits = getattr(torch, config.autocast_type) if config.autocast_type else weights
        vocab = stage.lm_head.out_features
        outputs = torch.zeros(micro, seq, vocab, dtype=logits, device=device, requires_grad=True)
    else:
        outputs = torch.zeros(micro, seq, stage.hidden_size, dtype=weights, device=device, requires_grad=True)
    return {"input_args": (inputs,), "output_args": (outputs,)}


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one micro batch, in fp32 (as Transformers' causal-LM loss upcasts)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
    )


class Pipeline(torch.nn.Module):
    """This rank's stages of ``model`` and the schedule that runs them; ``step`` runs one optimizer step's
    forwards and backwards (the optimizer's step is the caller's, over ``parameters()``).

    ``shapes``: (micro batch, sequence) of every micro batch, to give the stages their inputs' and outputs'
    shapes instead of learning them from a first exchange between the ranks (which votes with values: the
    estimator's fake tensors have none)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrialConfig,
        *,
        micro_batches: int,
        device: torch.device,
        group: Any = None,
        shapes: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        from autotune.errors import ConfigError

        if not dist.is_initialized():
            raise ConfigError(
                f"--pp {config.pp} runs stages on the ranks of a process group: run the job under torchrun "
                "and call torch.distributed.init_process_group() before autotune.prepare"
            )
        tensor_mesh = None
        if config.tp > 1 and group is None:  # stages split over tensor-parallel ranks: a (pp, tp) mesh
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (config.pp, config.tp), mesh_dim_names=("pp", "tp"))
            group, tensor_mesh = mesh["pp"].get_group(), mesh["tp"]
        ranks = dist.get_world_size(group)
        if ranks != config.pp:
            raise ConfigError(f"--pp {config.pp} needs a process group of {config.pp} ranks; it has {ranks}")
        self.config = config
        self.rank = dist.get_rank(group)
        # The whole model's parameters (all stages'), counted before this rank keeps only its own.
        self.whole_parameters = sum(p.numel() for p in model.parameters())
        self.whole_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        per_rank = stages_per_rank(config)
        count = config.pp * per_rank
        layers = len(_base_model(model).layers)
        indices = [self.rank + k * config.pp for k in range(per_rank)]  # interleaved: r, r + pp
        self.stages = torch.nn.ModuleList(
            _Stage(model, stage_layers(layers, count, i), first=i == 0, last=i == count - 1) for i in indices
        )
        if tensor_mesh is not None:  # each stage's layers by the model's plan (the stage keeps their names)
            from autotune.prepare.tensor_parallel import tensor_parallel

            plan = getattr(model, "config").base_model_tp_plan  # noqa: B009 - Module's getattr types it
            for stage in self.stages:
                tensor_parallel(stage, config, tensor_mesh, plan=plan)
        self.first = 0 in indices
        self.last = count - 1 in indices
        from autotune.prepare.sharding import materialise

        materialise(self, device)  # a trial builds the whole model on the meta device: only this rank's stages
        stages: list[Any] = [
            PipelineStage(stage, i, count, device, group=group, **_static_shapes(stage, shapes, config, device))
            for stage, i in zip(self.stages, indices, strict=True)
        ]
        self.schedule: Any
        if config.pp_schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches, loss_fn=_causal_lm_loss)
        else:
            schedule = ScheduleGPipe if config.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = schedule(stages[0], n_microbatches=micro_batches, loss_fn=_causal_lm_loss)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> torch.Tensor | None:
        """Forwards and backwards of one optimizer step's batch (cut into the micro batches); the mean loss
        on the rank that holds the last stage, None on the others. Gradients are the batch's mean."""
        losses: list[torch.Tensor] = []
        inputs = (input_ids,) if self.first else ()
        target = labels if self.last else None
        self.schedule.step(*inputs, target=target, losses=losses)
        return torch.stack(losses).mean() if losses else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a Pipeline runs whole optimizer steps: call pipeline.step(input_ids, labels)")
