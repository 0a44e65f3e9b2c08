"""Activation checkpointing through the names Transformers has today, and through the older name where a model
has only that one (older Transformers releases, factories' models written for them)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from autotune.errors import ConfigError
from autotune.levers import checkpointing
from autotune.levers.checkpointing import checkpointing_call, enable_checkpointing


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("every", [1, 2])
def test_a_transformers_model_checkpoints_without_a_deprecation_warning(every: int) -> None:
    model = _tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        enable_checkpointing(model, every)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [i % every == 0 for i in range(4)]
    assert model.config.use_cache is False


class _OldStyle(torch.nn.Module):
    """A model with only the name Transformers used before activation_checkpointing_enable."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None, **kwargs: Any) -> None:
        self.calls.append((gradient_checkpointing_kwargs, kwargs))


def test_a_model_with_only_the_older_name_checkpoints_through_it() -> None:
    model = _OldStyle()
    enable_checkpointing(model)
    enable_checkpointing(model, 3)
    assert model.calls == [({"use_reentrant": False}, {}), ({"use_reentrant": False}, {"every_n_layers": 3})]


def test_a_model_without_either_name_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"has no activation_checkpointing_enable\(\) or gradient_checkpointing"):
        enable_checkpointing(torch.nn.Linear(2, 2), source="the model from --model factories:tiny")


def test_the_exported_call_names_what_the_installed_transformers_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpointing, "transformers_release", lambda: (5, 24))
    assert checkpointing_call(2) == (
        'model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, '
        "every_n_layers=2)"
    )
    monkeypatch.setattr(checkpointing, "transformers_release", lambda: (4, 45))  # the oldest pyproject.toml allows
    assert (
        checkpointing_call()
        == 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
    )


# -- per-operator selective checkpointing ---------------------------------------------------------------------------
class _Attention(torch.nn.Module):
    """Four projections (four matmuls) around the fused attention: what a decoder layer's attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = lambda t: t.view(2, 8, 2, 8).transpose(1, 2)  # noqa: E731
        attended = torch.nn.functional.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        )
        return self.o(attended.transpose(1, 2).reshape(2, 8, 16).relu())


class _BackwardOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts each operator the backward dispatches (a recompute's operators among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step(layer: _Attention, x: torch.Tensor, **options: Any) -> tuple[dict[str, int], list[torch.Tensor]]:
    """One forward and backward of ``layer`` (checkpointed with ``options``, or not with none): the operators its
    backward ran, and the gradients."""
    from torch.utils.checkpoint import checkpoint

    layer.zero_grad()
    out = checkpoint(layer, x, use_reentrant=False, **options) if options else layer(x)
    with _BackwardOps() as ops:
        out.square().sum().backward()
    return ops.counts, [p.grad.clone() for p in layer.parameters()]


def test_selective_checkpointing_reruns_every_other_matmul_and_keeps_the_attention() -> None:
    torch.manual_seed(0)
    layer, x = _Attention(), torch.randn(2, 8, 16)
    plain, plain_grads = _step(layer, x)
    full, _ = _step(layer, x, context_fn=torch.utils.checkpoint.noop_context_fn)
    selective, selective_grads = _step(layer, x, context_fn=checkpointing.selective_context)
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    # The backward's own matmuls (each weight's gradient, and o's input gradient), then the rerun, which stops at
    # the last output the backward needs (not o's): q, k and v in full; selectively k alone (q and v were kept).
    assert (plain["mm"], full["mm"], selective["mm"]) == (5, 8, 6)
    assert full.get(sdpa) == 1 and sdpa not in selective and sdpa not in plain  # the attention's output was kept
    assert full.get("relu") == 1 and selective.get("relu") == 1  # a cheap operator is recomputed
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, selective_grads, strict=True))  # the same step, less kept


def test_selective_checkpointing_is_a_value_of_the_checkpointing_flag() -> None:
    from autotune.config.knobs import TrialConfig
    from autotune.levers import CHECKPOINTING

    fields = checkpointing.checkpointing_flag("selective")
    config = TrialConfig(micro_batch=2, **fields)
    assert config.describe() == "mb=2 fp32 ckpt-sel" and CHECKPOINTING.flag_value(config) == "selective"
    assert CHECKPOINTING.forward_rerun_share(config) is None  # only its own trace says what it reruns
    with pytest.raises(ConfigError, match="selective checkpoints every layer"):
        TrialConfig(checkpointing=True, checkpoint_every=2, checkpoint_selective=True)
    with pytest.raises(ConfigError, match="selective checkpoints every layer"):
        TrialConfig(checkpoint_selective=True)
    with pytest.raises(ConfigError, match=r"must be on, off, every-N \(e.g. every-2\) or selective"):
        checkpointing.checkpointing_flag("partial")
    # Every layer in full recomputes more than selectively, which recomputes more than none; every N-th layer is
    # neither more nor less.
    off, every_2, on = (
        TrialConfig(),
        TrialConfig(checkpointing=True, checkpoint_every=2),
        TrialConfig(checkpointing=True),
    )
    selective = config.replace(micro_batch=1)
    assert CHECKPOINTING.recomputes_more(on, selective) and not CHECKPOINTING.recomputes_more(selective, on)
    assert CHECKPOINTING.recomputes_more(selective, off) and not CHECKPOINTING.recomputes_more(off, selective)
    assert not CHECKPOINTING.recomputes_more(selective, every_2)
    assert not CHECKPOINTING.recomputes_more(every_2, selective)


def test_a_job_applies_selective_checkpointing_itself_as_the_exports_line_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformers' TrainingArguments are JSON, which cannot carry the policy: the hf export leaves the Trainer's
    checkpointing off, and its line names the call that gives every layer the policy."""
    from autotune.config.knobs import TrialConfig
    from autotune.levers import CHECKPOINTING

    monkeypatch.setattr(checkpointing, "transformers_release", lambda: (5, 24))
    config = TrialConfig(checkpointing=True, checkpoint_selective=True)
    assert CHECKPOINTING.trainer_arguments(config) == {"activation_checkpointing": False}
    (line,) = CHECKPOINTING.in_code(config)
    assert '"context_fn": selective_context' in line and "autotune.levers.checkpointing" in line
    model = _tiny_llama()
    enable_checkpointing(model, selective=True)  # what the line's call does
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert model.model.layers[0]._gradient_checkpointing_func.keywords["context_fn"] is checkpointing.selective_context
