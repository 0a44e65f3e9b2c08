"""Activation offload's saved-tensor hooks on a real model: the same step, and what moves to the host.

The hooks run here with the CPU standing in for the offloaded device (host copies of CPU tensors): the
maths and the choice of what moves are the device's; what the device saves is the GPU test's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autotune.levers.activation_offload import ActivationOffload
from autotune.levers.checkpointing import enable_checkpointing


class _Counting(ActivationOffload):
    """Counts what the forward saves and what of it goes to the host."""

    def __init__(self) -> None:
        super().__init__(device_type="cpu", pin_memory=False)
        self.saved: list[torch.Tensor] = []
        self.moved = 0

    def pack(self, tensor: torch.Tensor) -> object:
        packed = super().pack(tensor)
        self.saved.append(tensor)
        self.moved += isinstance(packed, tuple)
        return packed


def _model(checkpointing: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
    )
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_checkpointing(model, 1, source="the test's Llama")
    return model.train()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_the_offloaded_step_is_the_same_step_and_keeps_weights_where_they_are(checkpointing):
    ids = torch.randint(0, 512, (2, 32))
    plain = _model(checkpointing)
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    offloaded = _model(checkpointing)
    hooks = _Counting()
    with hooks.hooks():
        moved_loss = offloaded(input_ids=ids, labels=ids).loss
    moved_loss.backward()
    assert moved_loss.item() == loss.item()
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert 0 < hooks.moved < len(hooks.saved)
    weights = {p.untyped_storage().data_ptr() for p in offloaded.parameters()}
    for tensor in hooks.saved:  # a weight (or its transpose, which a matmul saves) is never copied
        if tensor.untyped_storage().data_ptr() in weights:
            assert hooks.stays(tensor)


def test_with_checkpointing_only_the_checkpoints_inputs_move():
    ids = torch.randint(0, 512, (2, 32))
    hooks = {}
    for checkpointing in (False, True):
        hooks[checkpointing] = _Counting()
        with hooks[checkpointing].hooks():
            _model(checkpointing)(input_ids=ids, labels=ids).loss.backward()
    # The plain step saves every matmul's and norm's inputs; a checkpointed layer saves its inputs once.
    assert hooks[True].moved < hooks[False].moved / 3, (hooks[True].moved, hooks[False].moved)
    layer_inputs = [t for t in hooks[True].saved if t.shape == (2, 32, 64) and not hooks[True].stays(t)]
    assert len(layer_inputs) >= 3  # each of the 3 layers' hidden states goes to the host


def test_small_tensors_and_tensors_off_the_device_stay():
    hooks = ActivationOffload(device_type="cuda", min_bytes=1024)
    assert hooks.stays(torch.ones(4096))  # a CPU tensor when CUDA's are offloaded
    cpu = ActivationOffload(device_type="cpu", pin_memory=False)
    assert cpu.stays(torch.ones(8)) and not cpu.stays(torch.ones(4096))
    weight = torch.nn.Parameter(torch.ones(64, 64))
    assert cpu.stays(weight) and cpu.stays(weight.t())
    packed = cpu.pack(torch.arange(1024.0))
    back = cpu.unpack(packed)
    assert torch.equal(back, torch.arange(1024.0)) and back.data_ptr() != packed[1].data_ptr()
