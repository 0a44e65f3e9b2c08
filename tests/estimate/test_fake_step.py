"""The trace's optimizer update on sharded parameters: stepped on their local shards where each op of the step
is elementwise (fake_step._on_local_shards), it makes the values and the state DTensor's own dispatch makes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autotune.estimate.fake_step import _on_local_shards
from autotune.estimate.patches import fake_process_group

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.01),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=0.1, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _sharded(mesh, values, placement):
    return DTensor.from_local(values.clone(), mesh, [placement], run_check=False)


def _model(mesh, weights, gradients, grad_placement, make):
    params = [torch.nn.Parameter(_sharded(mesh, w, Shard(0))) for w in weights]
    for p, g in zip(params, gradients, strict=True):
        p.grad = _sharded(mesh, g, grad_placement)
    return params, make(params)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_steps_on_the_shards_are_dtensors_two_steps(name):
    torch.manual_seed(0)
    weights, gradients = [torch.randn(4, 3), torch.randn(5)], [torch.randn(4, 3), torch.randn(5)]
    with fake_process_group(2, "cpu", gloo=False) as mesh:
        on_shards, on_shards_optimizer = _model(mesh, weights, gradients, Shard(0), OPTIMIZERS[name])
        dispatched, dispatched_optimizer = _model(mesh, weights, gradients, Shard(0), OPTIMIZERS[name])
        for _ in range(2):
            with _on_local_shards(on_shards_optimizer):
                on_shards_optimizer.step()
            dispatched_optimizer.step()
            assert all(p.grad.placements == (Shard(0),) for p in on_shards)  # gradients left as they were
        for mine, theirs in zip(on_shards, dispatched, strict=True):
            assert torch.equal(mine._local_tensor, theirs._local_tensor)
            # The state is keyed by the parameter, as DTensors laid out as it is, as the step made it.
            state, expected = on_shards_optimizer.state[mine], dispatched_optimizer.state[theirs]
            assert state.keys() == expected.keys() and state
            for key, value in state.items():
                assert type(value) is type(expected[key])
                if isinstance(value, DTensor):
                    assert value.placements == expected[key].placements and value.shape == expected[key].shape
                    assert torch.equal(value._local_tensor, expected[key]._local_tensor)
        assert on_shards_optimizer.param_groups[0]["params"] == on_shards  # the groups hold the parameters again
        assert all(p._local_tensor.grad is None for p in on_shards)


def test_a_gradient_laid_out_unlike_its_parameter_is_stepped_by_dtensor_after_a_step_on_the_shards():
    # Tensor parallel's replicated weights get partial gradients: DTensor reduces them as it steps. The state
    # the first step made on the shards is DTensors again for it.
    torch.manual_seed(0)
    with fake_process_group(2, "cpu", gloo=False) as mesh:
        param = torch.nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Replicate()], run_check=False))
        optimizer = torch.optim.AdamW([param], lr=0.1)
        param.grad = DTensor.from_local(torch.zeros(4), mesh, [Replicate()], run_check=False)
        with _on_local_shards(optimizer):
            optimizer.step()
        param.grad = DTensor.from_local(torch.randn(4), mesh, [Partial()], run_check=False)
        with _on_local_shards(optimizer):
            optimizer.step()
        assert isinstance(optimizer.state[param]["exp_avg"], DTensor)
        assert optimizer.state[param]["exp_avg"].placements == (Replicate(),)


def test_an_optimizer_that_is_not_elementwise_is_left_to_dtensor():
    class NotElementwise(torch.optim.SGD):  # a subclass may do anything in its step
        pass

    with fake_process_group(2, "cpu", gloo=False) as mesh:
        param = torch.nn.Parameter(_sharded(mesh, torch.randn(4), Shard(0)))
        param.grad = _sharded(mesh, torch.randn(4), Shard(0))
        optimizer = NotElementwise([param], lr=0.1, momentum=0.9)
        seen = []
        with _on_local_shards(optimizer):
            seen.extend(optimizer.param_groups[0]["params"])
        assert seen == [param] and isinstance(seen[0], DTensor)
