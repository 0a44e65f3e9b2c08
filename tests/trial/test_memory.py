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


def _tied_head_backward_peak(tracker: LiveBytesTracker) -> tuple[int, int]:
    """(peak above the forward's live bytes, the weight's bytes) of the backward of a weight used as an
    embedding and as an LM head run in four slices: the engine sums the weight's five gradients."""
    weight = torch.nn.Parameter(torch.randn(4096, 256))  # 4 MiB: the 0.5 MiB of logits are small beside it
    tokens = torch.randint(0, 4096, (4, 8))
    with tracker:
        hidden = torch.nn.functional.embedding(tokens, weight)
        loss = sum((chunk @ weight.t()).logsumexp(-1).sum() for chunk in hidden.chunk(4, 0))
        tracker.peak_bytes = before = tracker.live_bytes
        loss.backward()
    return tracker.peak_bytes - before, weight.numel() * weight.element_size()


def test_the_engines_gradient_sums_count_as_in_place_as_without_a_dispatch_mode():
    # Without a dispatch mode the engine adds each slice's weight gradient into the sum it holds, in place:
    # two weight-sized gradients at most (the sum and the next slice's). Under any mode it sums out of place
    # (a third); the tracker counts what the job, which runs under none, holds.
    peak, weight_bytes = _tied_head_backward_peak(LiveBytesTracker())
    assert 1.8 * weight_bytes <= peak < 2.5 * weight_bytes


def test_the_estimates_fake_step_counts_the_engines_sums_as_in_place_too():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.estimate.peak_parts import PeakPartsTracker

    with FakeTensorMode():
        peak, weight_bytes = _tied_head_backward_peak(PeakPartsTracker())
    assert 1.8 * weight_bytes <= peak < 2.5 * weight_bytes


def test_python_code_summing_out_of_place_is_still_counted_so():
    # Only the engine's own sums are held back: an add in Python code, whose term is let go right after, held
    # both terms and the sum at once.
    with LiveBytesTracker() as tracker, torch.no_grad():
        a, b = torch.empty(1024), torch.empty(1024)
        a = a + b
        assert tracker.peak_bytes == 3 * 4096
        del a, b


def test_the_cuda_memory_history_is_inert_without_its_variable_and_on_a_cpu(monkeypatch, tmp_path):
    from autotune.trial.memory import MEMORY_HISTORY_ENV, cuda_memory_history

    def never(*args, **kwargs):
        raise AssertionError("the allocator's history was asked for")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", never)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", never)
    record: dict = {}
    monkeypatch.delenv(MEMORY_HISTORY_ENV, raising=False)
    with cuda_memory_history(torch.device("cuda", 0), record):
        pass
    assert record == {}
    # Asked for on a CPU trial: nothing recorded, nothing written, and the record says why.
    monkeypatch.setenv(MEMORY_HISTORY_ENV, str(tmp_path / "history.pickle"))
    with cuda_memory_history(torch.device("cpu"), record):
        pass
    assert record["memory_history"].startswith("not recorded: ")
    assert not list(tmp_path.iterdir())


def test_the_cuda_memory_history_is_recorded_and_written_however_the_trial_ends(monkeypatch, tmp_path):
    from autotune.trial.memory import MEMORY_HISTORY_ENTRIES, MEMORY_HISTORY_ENV, cuda_memory_history

    calls: list = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    path = str(tmp_path / "history.pickle")
    monkeypatch.setenv(MEMORY_HISTORY_ENV, path)
    monkeypatch.delenv("RANK", raising=False)
    record: dict = {}
    with pytest.raises(torch.OutOfMemoryError):  # an OOM's history is the one most worth reading
        with cuda_memory_history(torch.device("cuda", 0), record):
            raise torch.OutOfMemoryError("CUDA out of memory")
    started = {"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": MEMORY_HISTORY_ENTRIES}
    assert calls == [("record", (), started), ("dump", path), ("record", (), {"enabled": None})]
    assert record["memory_history"] == path
    # Another rank writes beside rank 0's.
    calls.clear()
    monkeypatch.setenv("RANK", "1")
    with cuda_memory_history(torch.device("cuda", 1), record):
        pass
    assert calls[1] == ("dump", f"{path}.rank1")
