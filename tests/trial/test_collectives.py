"""A CPU trial's gloo collectives: gloo's results, the reduce-scatter's copy of its input and an all-gather's hold on
its input let go of before the call returns."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Two gloo ranks: each reduce-scatter, summed and averaged, as gloo's own; the copy freed on return in every
# call (the tracker's live bytes back to where they were), where gloo's worker thread sometimes keeps it.
_RANKS = textwrap.dedent("""
    from autotune.trial.collectives import fsdp_reduce_scatter_name, reduce_scatter_frees_its_copy

    rank = dist.get_rank()
    name = fsdp_reduce_scatter_name()
    same, freed = True, True
    for step in range(20):
        data = torch.randn(1 << 20, generator=torch.Generator().manual_seed(step + rank))
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            theirs = torch.empty(1 << 19)
            getattr(dist, name)(theirs, data, op=op)
            with LiveBytesTracker() as tracker, reduce_scatter_frees_its_copy():
                ours = torch.empty(1 << 19)
                getattr(dist, name)(ours, data, op=op)
                freed &= tracker.live_bytes == ours.nbytes and tracker.peak_bytes == ours.nbytes + data.nbytes
            same &= torch.equal(theirs, ours)
    print(f"REDUCE-SCATTER {rank} {same} {freed}", flush=True)  # one write: the two ranks share stdout
""")


def test_the_reduce_scatter_patched_is_the_one_fsdp2_calls_in_this_release():
    # torch 2.13's FSDP2 calls reduce_scatter_single, 2.11's reduce_scatter_tensor: a patch of the other one would
    # leave gloo's copy to its race (trials) and the estimate's gloo copy uncounted.
    import inspect

    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fsdp_collectives

    from autotune.trial.collectives import fsdp_reduce_scatter_name

    assert f"dist.{fsdp_reduce_scatter_name()}(" in inspect.getsource(fsdp_collectives)


@pytest.mark.slow
def test_the_reduce_scatter_is_gloo_s_and_frees_its_copy_before_it_returns(on_two_gloo_ranks):
    assert "REDUCE-SCATTER 0 True True" in on_two_gloo_ranks and "REDUCE-SCATTER 1 True True" in on_two_gloo_ranks


# Two gloo ranks: each functional all-gather (DTensor's) as gloo's own, and its input freed as soon as the caller
# drops it (the tracker's live bytes down to the gathered tensor), where gloo's worker thread sometimes holds it.
_GATHERS = textwrap.dedent("""
    from torch.distributed import _functional_collectives as funcol
    from autotune.trial.collectives import all_gather_frees_its_input

    def waited(tensor):
        return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor

    rank, group = dist.get_rank(), dist.group.WORLD
    same, freed = True, True
    for step in range(40):
        data = torch.randn(1 << 18, generator=torch.Generator().manual_seed(step + rank))
        theirs = waited(funcol.all_gather_single(data, 0, group))
        with LiveBytesTracker() as tracker, all_gather_frees_its_input():
            shard = data.clone()
            ours = waited(funcol.all_gather_single(shard, 0, group))
            del shard
            freed &= tracker.live_bytes == ours.nbytes
        same &= torch.equal(theirs, ours)
    print(f"ALL-GATHER {rank} {same} {freed}", flush=True)
""")


@pytest.mark.slow
def test_a_functional_all_gather_is_gloo_s_and_lets_go_of_its_input_before_it_returns(on_two_gloo_ranks):
    assert "ALL-GATHER 0 True True" in on_two_gloo_ranks and "ALL-GATHER 1 True True" in on_two_gloo_ranks


@pytest.fixture(scope="module")
def on_two_gloo_ranks(tmp_path_factory) -> str:
    """What two torchrun ranks printed (two new interpreters: 6-10 s, paid once for both tests): each rank's
    reduce-scatters, then its all-gathers, each loop saying whether its results were gloo's and its memory freed."""
    folder = tmp_path_factory.mktemp("gloo")
    (folder / "ranks.py").write_text(
        "import torch, torch.distributed as dist\nfrom autotune.trial.memory import LiveBytesTracker\n\n"
        'dist.init_process_group("gloo")\n' + _RANKS + _GATHERS + "dist.destroy_process_group()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "ranks.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
