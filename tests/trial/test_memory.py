import pytest
import torch

from autotune.trial.memory import LiveBytesTracker


def test_counts_live_storages_and_releases_them():
    with LiveBytesTracker() as tracker:
        a = torch.empty(1024, dtype=torch.float32)
        view = a[:10]  # a view shares its base's storage: not counted again
        assert tracker.live_bytes == 4096
        b = torch.empty(2048, dtype=torch.float16)
        assert tracker.live_bytes == 4096 + 4096
        del a, view
        assert tracker.live_bytes == 4096
        del b
    assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 8192


def test_budget_raises_the_same_oom_as_a_device():
    with pytest.raises(torch.OutOfMemoryError, match="--memory-budget"):
        with LiveBytesTracker(budget_bytes=10_000):
            keep = [torch.empty(1000) for _ in range(10)]  # noqa: F841 - 40 kB live


def test_checkpointed_backward_runs_under_the_tracker_and_lowers_the_peak():
    from torch.utils.checkpoint import checkpoint

    layers = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            for _ in range(4)
        ]
    )

    def peak(checkpointed: bool) -> int:
        x = torch.randn(64, 256, requires_grad=True)
        with LiveBytesTracker() as tracker:
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False) if checkpointed else layer(h)
            h.sum().backward()
        return tracker.peak_bytes

    assert peak(True) < peak(False)


def _tracker_oom(*, in_backward: bool) -> torch.OutOfMemoryError:
    """The exception the tracker raises, in a forward or from inside autograd's backward."""
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    try:
        with LiveBytesTracker(budget_bytes=40_000 if in_backward else 1_000) as tracker:
            loss = layer(x).sum()
            if in_backward:
                assert tracker.live_bytes < 40_000  # the forward fits: the backward's gradients do not
                loss.backward()
    except torch.OutOfMemoryError as exc:
        return exc
    raise AssertionError("the tracker raised no OOM")


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_batch_size_finders_of_lightning_and_accelerate_recognise_the_budget_oom(in_backward):
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    exc = _tracker_oom(in_backward=in_backward)
    assert str(exc).startswith("DefaultCPUAllocator: can't allocate memory: you tried to allocate ")
    assert "--memory-budget" in str(exc)
    assert is_oom_error(exc)
    assert should_reduce_batch_size(exc)


def test_the_budget_holds_after_an_oom_was_caught_in_the_same_process():
    # A batch-size finder catches the OOM and tries a smaller size under the same tracker: the
    # budget, not the first attempt's overshoot (40 kB here), is what the retry must stay under.
    with LiveBytesTracker(budget_bytes=10_000) as tracker:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(10_000)  # 40 kB in one allocation
        assert tracker.live_bytes == 0 and tracker.peak_bytes == 40_000
        with pytest.raises(torch.OutOfMemoryError):
            keep = [torch.empty(1000) for _ in range(3)]  # noqa: F841 - 12 kB live


def test_a_failed_request_is_not_live_while_its_exception_is_handled():
    # A real allocator never hands out the bytes of a failed request; Lightning's finder allocates
    # a small tensor inside its `except` block, while the traceback still holds the oversized one.
    with LiveBytesTracker(budget_bytes=10_000) as tracker:
        try:
            torch.empty(10_000)  # 40 kB asked for
        except torch.OutOfMemoryError:
            small = torch.empty(10)
            assert tracker.live_bytes == small.untyped_storage().nbytes()
    assert tracker.peak_bytes == 40_000  # the peak says how much was asked for
