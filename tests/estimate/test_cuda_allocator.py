"""The caching-allocator model against peaks worked out by hand from CUDACachingAllocator.cpp's rules.

Rules used in the comments (c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp):
round: < 512 B -> 512, else up to a multiple of 512. Pool: <= 1 MiB small, else large.
New segment: small 2 MiB; large < 10 MiB -> 20 MiB; else up to a multiple of 2 MiB.
Split: small pool when the rest >= 512; large pool when the rest > 1 MiB (and the request is
below max_split_size); with expandable segments whenever the rest >= 512.
"""

from __future__ import annotations

import random
import time

import pytest

from autotune.estimate.cuda_allocator import (
    AllocatorSettings,
    CachingAllocatorModel,
    ReplayResult,
    replay,
)

K = 1024
M = 1024 * 1024
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def test_tiny_sizes_round_up_to_512_and_zero_allocates_nothing() -> None:
    model = CachingAllocatorModel()
    model.malloc("zero", 0)  # allocate(0) skips malloc: a null pointer, no segment
    assert (model.allocated_bytes, model.reserved_bytes) == (0, 0)
    model.malloc("a", 1)  # 512; first small segment: 2 MiB
    model.malloc("b", 512)  # 512
    model.malloc("c", 513)  # 1024
    assert model.allocated_bytes == 512 + 512 + 1024
    assert model.reserved_bytes == 2 * M
    model.free("zero")  # free(nullptr): nothing happens
    assert model.result() == ReplayResult(
        peak_allocated_bytes=2048, peak_reserved_bytes=2 * M, segments=1, largest_segment_bytes=2 * M
    )


def test_small_pool_packs_one_2mib_segment_before_opening_another() -> None:
    model = CachingAllocatorModel()
    for key in "abcd":
        # 2 MiB segment: 512K + 1.5M free, then 512K + 1M, 512K + 512K, and the last 512K whole
        model.malloc(key, 512 * K)
    assert (model.allocated_bytes, model.reserved_bytes) == (2 * M, 2 * M)
    model.malloc("e", 1)  # no free block left: a second 2 MiB segment
    assert (model.allocated_bytes, model.reserved_bytes) == (2 * M + 512, 4 * M)
    assert model.result().segments == 2


def test_one_mib_is_small_and_one_byte_more_is_large() -> None:
    model = CachingAllocatorModel()
    model.malloc("small", 1 * M)  # <= kSmallSize: 2 MiB small segment, 1 MiB + 1 MiB free
    model.malloc("large", 1 * M + 1)  # rounds to 1 MiB + 512: large pool, 20 MiB segment, split
    assert model.allocated_bytes == 1 * M + (1 * M + 512)
    assert model.reserved_bytes == 2 * M + 20 * M


def test_a_5mib_request_takes_a_20mib_segment_and_the_next_splits_its_rest() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 5 * M)  # 20 MiB segment: 5 MiB + 15 MiB free (15 > 1 MiB: split)
    assert (model.allocated_bytes, model.reserved_bytes) == (5 * M, 20 * M)
    model.malloc("b", 5 * M)  # best fit is the 15 MiB rest: 5 + 10 free, no new segment
    assert (model.allocated_bytes, model.reserved_bytes) == (10 * M, 20 * M)
    model.malloc("c", 12 * M)  # 10 MiB free is too small; >= 10 MiB: a 12 MiB segment
    assert model.result() == ReplayResult(
        peak_allocated_bytes=22 * M, peak_reserved_bytes=32 * M, segments=2, largest_segment_bytes=20 * M
    )


def test_a_large_request_gets_a_segment_rounded_to_2mib() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 30 * M + 1)  # 30 MiB + 512; segment 32 MiB; rest 2 MiB - 512 > 1 MiB: split
    assert (model.allocated_bytes, model.reserved_bytes) == (30 * M + 512, 32 * M)
    model.malloc("b", 1536 * K)  # fits the 2 MiB - 512 rest; its rest 512K - 512 <= 1 MiB: no split,
    assert model.allocated_bytes == 32 * M  # so b counts the whole 2 MiB - 512
    assert model.reserved_bytes == 32 * M


def test_no_split_when_the_rest_is_at_most_1mib_so_the_whole_block_counts() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 19 * M)  # segment 20 MiB; rest exactly 1 MiB is not > kSmallSize
    assert (model.allocated_bytes, model.reserved_bytes) == (20 * M, 20 * M)
    model.free("a")
    model.malloc("b", 10 * M)  # reuses the 20 MiB block; rest 10 MiB: split
    assert (model.allocated_bytes, model.reserved_bytes) == (10 * M, 20 * M)


def test_best_fit_takes_the_smaller_of_two_free_blocks() -> None:
    model = CachingAllocatorModel()
    model.malloc("x", 30 * M)  # its own 30 MiB segment
    model.malloc("y", 40 * M)  # its own 40 MiB segment
    model.free("x")
    model.free("y")
    model.malloc("p", 28 * M)  # best fit 30 MiB (not 40): 28 + 2 free
    model.malloc("q", 39 * M)  # the 40 MiB block, rest 1 MiB: unsplit, counts 40 MiB
    # had p taken the 40 MiB block, q would have needed a third segment
    assert model.result() == ReplayResult(
        peak_allocated_bytes=70 * M, peak_reserved_bytes=70 * M, segments=2, largest_segment_bytes=40 * M
    )
    assert model.allocated_bytes == 28 * M + 40 * M


def test_freed_neighbours_merge_so_a_bigger_request_reuses_the_segment() -> None:
    model = CachingAllocatorModel()
    for key in "abc":
        model.malloc(key, 5 * M)  # one 20 MiB segment: a | b | c | 5 MiB free
    model.free("a")
    model.free("b")  # merges with a: 10 MiB free at the start
    model.malloc("d", 10 * M)  # best fit is the merged 10 MiB block, exactly: no new segment
    assert model.result() == ReplayResult(
        peak_allocated_bytes=15 * M, peak_reserved_bytes=20 * M, segments=1, largest_segment_bytes=20 * M
    )


def test_fragmented_free_blocks_cannot_serve_a_larger_request_so_reserved_grows() -> None:
    model = CachingAllocatorModel()
    for key in "abcd":
        model.malloc(key, 5 * M)  # a | b | c | d fill one 20 MiB segment (d takes the last 5 MiB whole)
    model.free("a")
    model.free("c")  # 10 MiB free, but as two 5 MiB blocks with b between
    model.malloc("e", 8 * M)  # no block >= 8 MiB: a second 20 MiB segment
    assert model.allocated_bytes == 5 * M + 5 * M + 8 * M
    assert model.result() == ReplayResult(
        peak_allocated_bytes=20 * M, peak_reserved_bytes=40 * M, segments=2, largest_segment_bytes=20 * M
    )


def test_max_split_size_keeps_oversize_blocks_whole_and_for_near_sizes() -> None:
    model = CachingAllocatorModel(settings=AllocatorSettings.from_conf("max_split_size_mb:20"))
    model.malloc("a", 40 * M)  # 40 MiB segment
    model.free("a")  # a 40 MiB oversize free block (>= 20 MiB)
    model.malloc("b", 5 * M)  # below max_split: may not take an oversize block -> new 20 MiB
    assert model.reserved_bytes == 60 * M  # segment, split 5 + 15 (5 MiB < max_split)
    model.malloc("c", 30 * M)  # >= max_split: the 40 MiB block (40 < 30 + 20), never split
    assert model.allocated_bytes == 5 * M + 40 * M
    model.malloc("d", 15 * M)  # the 15 MiB rest, exactly
    assert (model.allocated_bytes, model.reserved_bytes) == (60 * M, 60 * M)

    model = CachingAllocatorModel(settings=AllocatorSettings.from_conf("max_split_size_mb:20"))
    model.malloc("a", 60 * M)
    model.free("a")
    model.malloc("b", 30 * M)  # 60 >= 30 + 20 (max_non_split_rounding): refused, new 30 MiB
    assert (model.allocated_bytes, model.reserved_bytes) == (30 * M, 90 * M)


def test_expandable_segment_grows_at_its_end_reusing_the_free_tail() -> None:
    model = CachingAllocatorModel(settings=EXPANDABLE)
    model.malloc("a", 30 * M)  # large pages are 20 MiB: map 40 MiB; 30 + 10 free at the end
    assert (model.allocated_bytes, model.reserved_bytes) == (30 * M, 40 * M)
    model.malloc("b", 25 * M)  # the 10 MiB free tail + one more 20 MiB page = 30: 25 + 5 free
    assert model.result() == ReplayResult(
        peak_allocated_bytes=55 * M, peak_reserved_bytes=60 * M, segments=1, largest_segment_bytes=60 * M
    )
    model.free("a")  # 30 MiB free at the start (b follows it)
    model.malloc("c", 29 * M + 512 * K)  # takes a's 30 MiB; rest 512 KiB >= 512: split (would not be
    assert model.allocated_bytes == 25 * M + 29 * M + 512 * K  # without expandable segments)
    assert model.reserved_bytes == 60 * M

    # the same requests without expandable segments: 30 MiB, then 25 -> a 26 MiB segment, unsplit
    assert replay([("a", 30 * M), ("b", 25 * M)]) == ReplayResult(
        peak_allocated_bytes=56 * M, peak_reserved_bytes=56 * M, segments=2, largest_segment_bytes=30 * M
    )


def test_expandable_best_fit_prefers_a_bigger_block_to_the_growable_tail() -> None:
    model = CachingAllocatorModel(settings=EXPANDABLE)
    model.malloc("a", 30 * M)  # map 40 MiB: a 30 | 10 free tail
    model.malloc("c", 4 * M)  # from the tail: a 30 | c 4 | 6 free tail
    model.free("a")  # 30 free | c 4 | 6 free tail
    model.malloc("d", 6 * M)  # the 6 MiB tail could grow, so it counts as huge: d takes a's
    #                                30 MiB block instead (d 6 | 24 free | c 4 | 6 free tail)
    model.malloc("e", 26 * M)  # no free block >= 26: the 6 MiB tail + one 20 MiB page, exactly
    # had d taken the tail, e would have split the 30 MiB block and reserved would stay 40 MiB
    assert model.result() == ReplayResult(
        peak_allocated_bytes=36 * M, peak_reserved_bytes=60 * M, segments=1, largest_segment_bytes=60 * M
    )


def test_expandable_small_pool_maps_2mib_pages_and_pools_have_their_own_segment() -> None:
    model = CachingAllocatorModel(settings=EXPANDABLE)
    model.malloc("a", 1 * M)  # map one 2 MiB page: 1 + 1 free tail
    model.malloc("b", 1 * M)  # the tail, exactly
    model.malloc("c", 1 * M)  # tail in use: map one more page after it: 1 + 1 free
    assert (model.allocated_bytes, model.reserved_bytes) == (3 * M, 4 * M)
    model.malloc("d", 5 * M)  # large pool: its own segment, one 20 MiB page
    assert model.result() == ReplayResult(
        peak_allocated_bytes=8 * M, peak_reserved_bytes=24 * M, segments=2, largest_segment_bytes=20 * M
    )


def test_resize_to_zero_frees_and_a_regrow_allocates_before_freeing() -> None:
    model = CachingAllocatorModel()
    model.malloc("w", 4 * M)  # 20 MiB segment: 4 + 16 free
    model.resize("w", 0)  # FSDP frees with resize_(0): 20 MiB free again, key kept
    assert (model.allocated_bytes, "w" in model) == (0, True)
    model.resize("w", 4 * M)  # regrow: 4 + 16 free
    model.resize("w", 6 * M)  # resize_bytes_cuda allocates 6 (from the 16) before freeing 4
    assert model.peak_allocated_bytes == 10 * M
    assert (model.allocated_bytes, model.reserved_bytes) == (6 * M, 20 * M)
    model.free("w")
    assert (model.allocated_bytes, "w" in model) == (0, False)

    # replay: a known key with 0 frees it, and a later size allocates it again
    fsdp = [("p", 8 * M), ("p", 0), ("p", 8 * M), ("p", 0)]
    assert replay(fsdp) == ReplayResult(
        peak_allocated_bytes=8 * M, peak_reserved_bytes=20 * M, segments=1, largest_segment_bytes=20 * M
    )
    assert replay([("a", 4 * M), ("a", 6 * M)]).peak_allocated_bytes == 10 * M
    assert replay([("z", 0), ("z", 0)]) == ReplayResult(
        peak_allocated_bytes=0, peak_reserved_bytes=0, segments=0, largest_segment_bytes=0
    )


def test_roundup_power2_divisions_round_to_the_next_division() -> None:
    settings = AllocatorSettings.from_conf("roundup_power2_divisions:4")
    model = CachingAllocatorModel(settings=settings)
    model.malloc("a", 5 * M + 1)  # between 4 and 8 MiB in 4 steps of 1 MiB: 6 MiB
    model.malloc("b", 8 * M)  # a power of two stays
    model.malloc("c", 1000)  # not above 512 * 4: plain rounding to 1024
    assert model.allocated_bytes == 6 * M + 8 * M + 1024


def test_misuse_is_refused() -> None:
    model = CachingAllocatorModel()
    model.malloc("a", 10)
    with pytest.raises(ValueError, match="already allocated"):
        model.malloc("a", 10)
    with pytest.raises(ValueError, match="not allocated"):
        model.free("b")
    with pytest.raises(ValueError, match="not allocated"):
        model.resize("b", 10)
    with pytest.raises(ValueError, match="nbytes"):
        model.malloc("c", -1)


def test_from_conf_reads_the_options_that_place_blocks() -> None:
    assert AllocatorSettings.from_conf(None) == AllocatorSettings()
    assert AllocatorSettings.from_conf("") == AllocatorSettings()
    assert AllocatorSettings.from_conf("expandable_segments:True,max_split_size_mb:128") == AllocatorSettings(
        expandable_segments=True, max_split_size_bytes=128 * M
    )
    # blanks are dropped, keys that do not place blocks are skipped, lists included
    assert (
        AllocatorSettings.from_conf(" garbage_collection_threshold:0.6, foo:[1,2], expandable_segments : False,")
        == AllocatorSettings()
    )
    # large_segment_size_mb is read first, whatever its place, and bounds max_split_size_mb
    assert AllocatorSettings.from_conf("max_split_size_mb:64,large_segment_size_mb:64") == AllocatorSettings(
        large_segment_size_bytes=64 * M, max_split_size_bytes=64 * M
    )
    # [MiB:divisions,...]: the first boundary (256 MiB, interval 8) also covers those below it,
    # and '>' the ones after the last boundary
    assert AllocatorSettings.from_conf("roundup_power2_divisions:[256:4,>:1]").roundup_power2_divisions == (
        (4,) * 9 + (1,) * 7
    )


@pytest.mark.parametrize(
    ("conf", "key"),
    [
        ("max_split_size_mb:10", "max_split_size_mb"),  # PyTorch: must be >= 20
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("large_segment_size_mb:10", "large_segment_size_mb"),  # must be > 10
        ("large_segment_size_mb:64,max_split_size_mb:32", "max_split_size_mb"),
        ("expandable_segments:true", "expandable_segments"),  # only True or False
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:8,96:2]", "roundup_power2_divisions"),
        ("backend:cudaMallocAsync", "backend"),
    ],
)
def test_from_conf_names_the_key_of_a_bad_value(conf: str, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        AllocatorSettings.from_conf(conf)


@pytest.mark.parametrize(
    "settings", [AllocatorSettings(), EXPANDABLE, AllocatorSettings.from_conf("max_split_size_mb:64")]
)
def test_a_long_replay_is_fast_and_frees_back_to_one_block_per_segment(settings: AllocatorSettings) -> None:
    rng = random.Random(0)
    sizes = [1, 700, 64 * K, 1 * M, 3 * M, 17 * M, 70 * M]
    events: list[tuple[int, int]] = []
    live: list[int] = []
    for key in range(100_000):
        events.append((key, rng.choice(sizes) + rng.randrange(4096)))
        live.append(key)
        if len(live) > 200 or rng.random() < 0.4:
            events.append((live.pop(rng.randrange(len(live))), 0))
    events += [(key, 0) for key in live]
    assert len(events) >= 200_000

    start = time.perf_counter()
    model = CachingAllocatorModel(settings=settings)
    for key, nbytes in events:
        if nbytes:
            model.malloc(key, nbytes)
        else:
            model.free(key)
    assert time.perf_counter() - start < 5.0
    # everything freed: every segment has merged back into one free block of its size
    pools = model._pools.values()  # noqa: SLF001 - the invariant lives in the pools
    assert model.allocated_bytes == 0
    assert sum(len(pool.order) for pool in pools) == model.result().segments
    assert sum(size for pool in pools for size, _ in pool.order) == model.reserved_bytes
    assert replay(events, settings=settings) == model.result()


def test_a_block_freed_on_a_side_stream_is_cached_for_that_stream_alone() -> None:
    # get_free_block: the pool's blocks are ordered by stream first; a block of another stream is never taken.
    model = CachingAllocatorModel()
    model.malloc("gather", 40 * M, stream=1)  # FSDP2's all-gather output on its copy-in stream: 40 MiB segment
    model.free("gather")  # cached for stream 1
    model.malloc("activation", 40 * M)  # the compute stream cannot reuse it: a segment of its own
    assert model.reserved_bytes == 80 * M
    model.malloc("next gather", 40 * M, stream=1)  # stream 1 reuses its own cached block
    assert model.reserved_bytes == 80 * M


def test_a_free_goes_back_to_the_stream_the_block_was_made_on() -> None:
    # A reduce-scatter output made on its stream and freed from the compute stream (zero_grad) stays in
    # the reduce-scatter stream's pool; so does the rest of its split segment.
    events = [("grad", 30 * M, 2), ("grad", 0), ("act", 30 * M), ("act", 0), ("grad2", 30 * M, 2)]
    assert replay(events).peak_reserved_bytes == 60 * M  # grad2 takes grad's block; act needed its own
    assert replay([event[:2] for event in events]).peak_reserved_bytes == 30 * M  # one stream: reused


def test_each_stream_maps_its_own_expandable_segment() -> None:
    model = CachingAllocatorModel(settings=EXPANDABLE)
    model.malloc("a", 30 * M)  # large pages of 20 MiB: 40 MiB mapped
    model.malloc("b", 5 * M, stream=1)  # another stream: its own segment, 20 MiB
    assert model.reserved_bytes == 60 * M and model.result().segments == 2
    model.free("a")
    model.malloc("c", 30 * M, stream=1)  # stream 1 grows its own segment: 5 + 30 -> 40 MiB mapped there
    assert model.reserved_bytes == 80 * M


def test_near_the_capacity_a_new_segment_first_releases_every_streams_cached_segments() -> None:
    # A side stream's cached 40 MiB segment is kept for it; with 100 MiB to reserve, the compute stream's 80 MiB
    # request does not fit beside it, so (as after a failed cudaMalloc) the cached segment is released first.
    events = [("gather", 40 * M, 1), ("gather", 0), ("activation", 80 * M)]
    assert replay(events).peak_reserved_bytes == 120 * M  # no bound: the cache stays
    bounded = replay(events, capacity_bytes=100 * M)
    assert bounded.peak_reserved_bytes == 80 * M and bounded.peak_allocated_bytes == 80 * M
    # A block still in use is never released: what is live past the capacity goes over it (the job runs out).
    live = [("gather", 40 * M, 1), ("activation", 80 * M)]
    assert replay(live, capacity_bytes=100 * M).peak_reserved_bytes == 120 * M


def test_near_the_capacity_an_expandable_segment_unmaps_its_free_end_pages() -> None:
    settings = AllocatorSettings(expandable_segments=True)
    events = [("gather", 40 * M, 1), ("gather", 0), ("activation", 80 * M)]
    assert replay(events, settings=settings).peak_reserved_bytes == 120 * M
    assert replay(events, settings=settings, capacity_bytes=100 * M).peak_reserved_bytes == 80 * M
    # The side stream maps its pages again when it next gathers, at its segment's end.
    again = [*events, ("activation", 0), ("gather 2", 40 * M, 1)]
    assert replay(again, settings=settings, capacity_bytes=100 * M).peak_reserved_bytes == 80 * M
