"""A model of PyTorch's CUDA caching allocator: replay allocations and frees, read the peaks.

Given the ordered allocations and frees of one process, each on the stream it was made on, it reports what
``torch.cuda.max_memory_allocated`` (block bytes, after rounding and unsplit blocks) and
``torch.cuda.max_memory_reserved`` (segment bytes from ``cudaMalloc``, or mapped pages with
expandable segments) would read. It follows ``c10/cuda/CUDACachingAllocator.cpp`` of PyTorch
2.13 / main of 2026: ``round_size``, ``get_pool``, ``get_allocation_size``, ``get_free_block``,
``should_split``, ``alloc_found_block``, ``free_block``, ``try_allocate_expandable_block``.
The constants and the ``PYTORCH_CUDA_ALLOC_CONF`` rules are those of
``c10/core/AllocatorConfig.{h,cpp}`` as the 2.13 wheel ships them. Equal-size free blocks go
oldest segment first, then lowest address (main's ``BlockComparatorSizeCounterAddress``;
earlier releases broke such ties by ``cudaMalloc``'s addresses or by block age).

Left out, because the question is the reserved peak on a card with room: nothing is ever given
back (no OOM retry, ``empty_cache``, ``garbage_collection_threshold`` or
``per_process_memory_fraction``, so no ``cudaFree`` and no unmapping), and an expandable
segment's address reserve (9/8 of the card) never runs out. Also left out: ``record_stream`` and
its events (a block freed while another stream still uses it waits in ``insert_events`` until that
stream is done; FSDP2 itself never calls it, and the references it keeps in ``AllGatherState`` and
``ReduceScatterState`` are in the trace), CUDA graph and ``use_mem_pool`` private pools,
``mallocWithAddress``, and the ``cudaMallocAsync`` backend (``from_conf`` refuses it).

Streams: a block is cached for the stream it was allocated on and serves no other. In
``CUDACachingAllocator.cpp`` ``BlockComparatorSize`` orders a pool's blocks by stream first and
``get_free_block`` gives up when the block found is on another stream; a segment belongs to the stream of
the allocation that made it (``Block::stream``), merges only within itself, and with expandable segments
each stream maps its own (``get_expandable_segment`` matches ``segment->stream()``). So here each (stream,
small or large) pair is a pool of its own. A stream is any hashable label; events without one are on the
default (compute) stream.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["AllocatorSettings", "CachingAllocatorModel", "Event", "ReplayResult", "replay"]

_MiB = 1024 * 1024
# c10/core/AllocatorConfig.h (2.13)
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded to a multiple of this
K_SMALL_SIZE = 1 * _MiB  # kSmallSize: largest request served by the small pool
K_SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: small-pool segment (and expandable page)
K_MIN_LARGE_ALLOC = 10 * _MiB  # kMinLargeAlloc: below this a large request gets a whole large segment
K_ROUND_LARGE = 2 * _MiB  # kRoundLarge: bigger requests get a segment rounded to this
K_LARGE_BUFFER = 20 * _MiB  # large_segment_size_ default (was kLargeBuffer)
_DIVISION_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: [1 MiB, 64 GiB) in powers of two
_GAP = K_SMALL_BUFFER  # room between fake segment addresses, so none touch

# One allocator call: (storage key, its new size in bytes; 0: freed), with the stream it runs on where that is
# not the default stream.
Event = tuple[Hashable, int] | tuple[Hashable, int, Hashable]


@dataclass(frozen=True, kw_only=True)
class AllocatorSettings:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options that change where blocks go (defaults = unset)."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: unlimited, every block may split
    large_segment_size_bytes: int = K_LARGE_BUFFER  # segment for 1-10 MiB requests; large page
    max_non_split_rounding_bytes: int | None = None  # None: large_segment_size_bytes, as torch sets it
    roundup_power2_divisions: tuple[int, ...] = ()  # 16 intervals from 1 MiB; () = off

    def __post_init__(self) -> None:
        if self.large_segment_size_bytes <= K_MIN_LARGE_ALLOC:
            raise ValueError(
                f"large_segment_size_bytes must be above {K_MIN_LARGE_ALLOC} (10 MiB), "
                f"as PyTorch requires; got {self.large_segment_size_bytes}"
            )
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            value = getattr(self, name)
            if value is not None and value < self.large_segment_size_bytes:
                raise ValueError(
                    f"{name} must be at least large_segment_size_bytes "
                    f"({self.large_segment_size_bytes}), as PyTorch requires; got {value}"
                )
        divisions = self.roundup_power2_divisions
        if divisions and (len(divisions) != _DIVISION_INTERVALS or any(d < 0 or d & (d - 1) for d in divisions)):
            raise ValueError(
                "roundup_power2_divisions must be empty or 16 powers of two (or 0), "
                f"one per interval from 1 MiB; got {divisions!r}"
            )

    @classmethod
    def from_conf(cls, conf: str | None) -> AllocatorSettings:
        """Read ``PYTORCH_CUDA_ALLOC_CONF`` text, e.g. ``expandable_segments:True,max_split_size_mb:128``.

        Keys that do not change block placement are ignored; a bad value raises ValueError
        naming its key, with PyTorch's own limits.
        """
        entries = _parse_conf(conf or "")
        # torch reads large_segment_size_mb first: the other sizes are checked against it
        large_mb = K_LARGE_BUFFER // _MiB
        if "large_segment_size_mb" in entries:
            large_mb = _conf_int(entries, "large_segment_size_mb")
            if large_mb <= K_MIN_LARGE_ALLOC // _MiB:
                raise ValueError(
                    f"PYTORCH_CUDA_ALLOC_CONF large_segment_size_mb:{large_mb} must be "
                    f"above {K_MIN_LARGE_ALLOC // _MiB}"
                )
        fields: dict[str, Any] = {"large_segment_size_bytes": large_mb * _MiB}
        for key, bytes_field in (
            ("max_split_size_mb", "max_split_size_bytes"),
            ("max_non_split_rounding_mb", "max_non_split_rounding_bytes"),
        ):
            if key in entries:
                value = _conf_int(entries, key)
                if value < large_mb:
                    raise ValueError(
                        f"PYTORCH_CUDA_ALLOC_CONF {key}:{value} is too small: PyTorch "
                        f"requires at least {large_mb} (the large segment size in MiB)"
                    )
                fields[bytes_field] = value * _MiB
        if "expandable_segments" in entries:
            flag = entries["expandable_segments"]
            if flag not in ("True", "False"):  # ConfigTokenizer::toBool takes only these two
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF expandable_segments:{_show(flag)} must be True or False")
            fields["expandable_segments"] = flag == "True"
        if "roundup_power2_divisions" in entries:
            fields["roundup_power2_divisions"] = _conf_divisions(entries["roundup_power2_divisions"])
        if entries.get("backend", "native") != "native":
            raise ValueError(
                f"PYTORCH_CUDA_ALLOC_CONF backend:{_show(entries['backend'])} is not the "
                "caching allocator this models; only backend:native is"
            )
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """The peaks a replay reached, as ``torch.cuda.max_memory_allocated``/``_reserved`` count them."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    segments: int  # cudaMallocs; with expandable segments, the pools' segments
    largest_segment_bytes: int  # with expandable segments, the most mapped in one segment


class _Segment:
    __slots__ = ("small", "stream", "base", "size", "expandable", "tail")

    def __init__(self, *, small: bool, stream: Hashable, base: int, size: int, expandable: bool) -> None:
        self.small = small
        self.stream = stream  # the stream whose pool its free blocks go back to
        self.base = base
        self.size = size  # bytes from cudaMalloc, or mapped so far when expandable
        self.expandable = expandable
        self.tail: _Block | None = None  # the last block; an expandable segment grows after it


class _Block:
    __slots__ = ("addr", "size", "segment", "prev", "next", "free")

    def __init__(self, addr: int, size: int, segment: _Segment) -> None:
        self.addr = addr
        self.size = size
        self.segment = segment
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.free = False


class _Pool:
    """BlockPool: its free blocks of one stream, best fit first."""

    __slots__ = ("small", "stream", "order", "by_addr", "expandable")

    def __init__(self, *, small: bool, stream: Hashable = None) -> None:
        self.small = small
        self.stream = stream
        # BlockComparatorSizeCounterAddress orders by (size, segment's creation counter, address);
        # segments get rising fake addresses here, so (size, address) is the same order
        self.order: list[tuple[int, int]] = []
        self.by_addr: dict[int, _Block] = {}
        self.expandable: _Segment | None = None

    def insert(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.order, (block.size, block.addr))
        self.by_addr[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self.order[bisect.bisect_left(self.order, (block.size, block.addr))]
        del self.by_addr[block.addr]
        block.free = False


class CachingAllocatorModel:
    """The allocator's state under a sequence of malloc/free/resize calls, with its running peaks."""

    def __init__(self, *, settings: AllocatorSettings | None = None, capacity_bytes: int | None = None) -> None:
        self._settings = settings or AllocatorSettings()
        # What the allocator may reserve (the card's memory less what is outside it); None: no bound. Past it a
        # new segment first releases every cached free segment, of every stream, as a failed cudaMalloc does.
        self._capacity = capacity_bytes
        self._max_split = self._settings.max_split_size_bytes or float("inf")
        self._max_rounding = self._settings.max_non_split_rounding_bytes or self._settings.large_segment_size_bytes
        self._pools: dict[tuple[Hashable, bool], _Pool] = {}  # (stream, small) -> its pool
        self._live: dict[Hashable, _Block | None] = {}  # None: a zero-byte storage (null pointer)
        self._next_base = _GAP
        self._allocated = self._reserved = 0
        self._peak_allocated = self._peak_reserved = 0
        self._segments = self._largest_segment = 0

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def malloc(self, key: Hashable, nbytes: int, stream: Hashable = None) -> None:
        """Allocate ``nbytes`` for the storage ``key`` on ``stream`` (None: the default stream; zero bytes: a
        null pointer, nothing allocated)."""
        if key in self._live:
            raise ValueError(f"malloc: key {key!r} is already allocated; free or resize it first")
        self._live[key] = self._allocate(_check_nbytes(nbytes), stream)

    def free(self, key: Hashable) -> None:
        """Return the storage ``key``'s block to its pool, merged with free neighbours."""
        if key not in self._live:
            raise ValueError(f"free: key {key!r} is not allocated")
        self._release(self._live.pop(key))

    def resize(self, key: Hashable, nbytes: int, stream: Hashable = None) -> None:
        """Resize the storage ``key`` in place, as ``UntypedStorage.resize_`` does (FSDP's free/regrow), the new
        block on ``stream`` (the current stream when ``resize_`` runs)."""
        if key not in self._live:
            raise ValueError(f"resize: key {key!r} is not allocated; malloc it first")
        # resize_bytes_cuda: to 0 drops the data; otherwise the new block is allocated, the data
        # copied, and only then the old block freed, so both count at that moment
        new = self._allocate(_check_nbytes(nbytes), stream)
        old, self._live[key] = self._live[key], new
        self._release(old)

    def result(self) -> ReplayResult:
        return ReplayResult(
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
            segments=self._segments,
            largest_segment_bytes=self._largest_segment,
        )

    # DeviceCachingAllocator::malloc, from round_size to alloc_found_block
    def _allocate(self, nbytes: int, stream: Hashable) -> _Block | None:
        if nbytes == 0:  # NativeCachingAllocator::allocate skips malloc for size 0: a null DataPtr
            return None
        size = _round_size(nbytes, self._settings.roundup_power2_divisions)
        pool = self._pool(stream, size <= K_SMALL_SIZE)  # get_pool, then only this stream's blocks
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
        if self._should_split(pool, block, size):
            block = self._split(pool, block, size)
        self._allocated += block.size  # allocated_bytes counts the whole block, split or not
        self._peak_allocated = max(self._peak_allocated, self._allocated)
        return block

    def _pool(self, stream: Hashable, small: bool) -> _Pool:
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[stream, small] = _Pool(small=small, stream=stream)
        return pool

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        order = pool.order
        i = bisect.bisect_left(order, (size, -1))  # the smallest free block >= size
        if i == len(order):
            return None
        if self._settings.expandable_segments:
            # the block before the unmapped rest of a segment counts as the size it can grow to,
            # so a bigger block elsewhere is taken first
            while i + 1 < len(order) and self._growable(pool, order[i + 1]) < self._growable(pool, order[i]):
                i += 1
        found = order[i][0]
        if size < self._max_split and found >= self._max_split:
            return None  # no oversize block for a request that could split a smaller one
        if size >= self._max_split and found >= size + self._max_rounding:
            return None  # an oversize block serves only requests within max_non_split_rounding
        block = pool.by_addr[order[i][1]]
        pool.remove(block)
        return block

    @staticmethod
    def _growable(pool: _Pool, entry: tuple[int, int]) -> float:
        block = pool.by_addr[entry[1]]
        return float("inf") if block.segment.expandable and block.next is None else float(entry[0])

    def _should_split(self, pool: _Pool, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if pool.small or self._settings.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _split(self, pool: _Pool, block: _Block, size: int) -> _Block:
        # alloc_found_block: the request takes the front, the rest stays free as `block`
        taken = _Block(block.addr, size, block.segment)
        taken.prev, taken.next = block.prev, block
        if taken.prev is not None:
            taken.prev.next = taken
        block.prev = taken
        block.addr += size
        block.size -= size
        pool.insert(block)
        return taken

    def _alloc_block(self, pool: _Pool, size: int) -> _Block:
        if self._settings.expandable_segments:
            return self._expand(pool, size)
        alloc_size = self._allocation_size(size)  # one cudaMalloc of this size
        self._make_room(alloc_size)
        segment = self._new_segment(pool, alloc_size, expandable=False)
        block = _Block(segment.base, alloc_size, segment)
        segment.tail = block
        self._grow_reserved(segment, alloc_size)
        return block

    def _allocation_size(self, size: int) -> int:
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return self._settings.large_segment_size_bytes
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    def _expand(self, pool: _Pool, size: int) -> _Block:
        # try_allocate_expandable_block: use a free block at the end of the mapped range, map only
        # the missing pages after it (2 MiB small pool, large_segment_size large pool)
        segment = pool.expandable
        if segment is None:
            segment = pool.expandable = self._new_segment(pool, 0, expandable=True)
        page = K_SMALL_BUFFER if pool.small else self._settings.large_segment_size_bytes
        tail = segment.tail
        block = None
        if tail is not None and tail.free:
            pool.remove(tail)
            block = tail
        missing = size - (block.size if block is not None else 0)
        if missing > 0:
            mapped = -(-missing // page) * page
            self._make_room(mapped)
            tail = segment.tail  # releasing may have unmapped a free tail of this segment (not ``block``: taken)
            new = _Block(segment.base + segment.size, mapped, segment)
            new.prev = tail
            if tail is not None:
                tail.next = new
            segment.tail = new
            self._grow_reserved(segment, mapped)
            if block is None:
                block = new
            else:  # map_block merges the new pages into the free block before them
                block.size += mapped
                block.next = None
                segment.tail = block
        assert block is not None  # size > 0 (_allocate returns early for 0): a free tail, new pages, or both
        return block

    def _make_room(self, nbytes: int) -> None:
        """Before a new segment (or new pages) that would take reserved past the capacity: release the cached
        free memory of every pool, as DeviceCachingAllocator::malloc does when cudaMalloc fails
        (release_cached_blocks: each free block that is a whole segment is cudaFree'd; an expandable
        segment's free pages at its end are unmapped), then allocate. Still past it: the real job runs out
        of memory, and the replay's reserved peak says so by going over the capacity."""
        if self._capacity is None or self._reserved + nbytes <= self._capacity:
            return
        for pool in self._pools.values():
            for _, addr in list(pool.order):
                block = pool.by_addr[addr]
                segment = block.segment
                whole = block.prev is None and block.next is None and not segment.expandable
                end_pages = segment.expandable and block.next is None
                if whole or end_pages:
                    pool.remove(block)
                    segment.size -= block.size
                    self._reserved -= block.size
                    if end_pages:
                        segment.tail = block.prev
                        if block.prev is not None:
                            block.prev.next = None

    def _new_segment(self, pool: _Pool, size: int, *, expandable: bool) -> _Segment:
        segment = _Segment(small=pool.small, stream=pool.stream, base=self._next_base, size=0, expandable=expandable)
        # an expandable segment reserves address space for the whole card: leave it a wide span
        self._next_base += (1 << 50) if expandable else size + _GAP
        self._segments += 1
        return segment

    def _grow_reserved(self, segment: _Segment, nbytes: int) -> None:
        segment.size += nbytes
        self._largest_segment = max(self._largest_segment, segment.size)
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def _release(self, block: _Block | None) -> None:
        if block is None:  # free(nullptr) does nothing
            return
        self._allocated -= block.size
        # free_block: merge with a free previous and next block of the same segment
        pool = self._pools[block.segment.stream, block.segment.small]
        before, after = block.prev, block.next
        if before is not None and before.free:
            pool.remove(before)
            block.addr, block.size = before.addr, block.size + before.size
            block.prev = before.prev
            if block.prev is not None:
                block.prev.next = block
        if after is not None and after.free:
            pool.remove(after)
            block.size += after.size
            block.next = after.next
            if block.next is not None:
                block.next.prev = block
            else:
                block.segment.tail = block
        pool.insert(block)


def replay(
    events: Iterable[Event], *, settings: AllocatorSettings | None = None, capacity_bytes: int | None = None
) -> ReplayResult:
    """Replay ``(key, new size in bytes)`` or ``(key, new size, stream)`` events in order and return the peaks.

    A key not seen before (or freed since) is an allocation, a live key with 0 is a free, and
    a live key with another size is a resize (new block first, then the old one freed); the
    allocation is made on the event's stream (the default stream without one), and a free goes back
    to the pool of the stream its block was made on, whatever the event says. ``capacity_bytes``: what the
    allocator may reserve on the card (see :meth:`CachingAllocatorModel._make_room`).
    """
    model = CachingAllocatorModel(settings=settings, capacity_bytes=capacity_bytes)
    for event in events:
        key, nbytes = event[0], event[1]
        stream = event[2] if len(event) > 2 else None
        if key not in model:
            model.malloc(key, nbytes, stream)
        elif nbytes == 0:
            model.free(key)
        else:
            model.resize(key, nbytes, stream)
    return model.result()


def _check_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a whole number of bytes, 0 or more; got {nbytes!r}")
    return nbytes


def _round_size(size: int, divisions_by_interval: tuple[int, ...]) -> int:
    """DeviceCachingAllocator::round_size."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = 0
    if divisions_by_interval:
        # AcceleratorAllocatorConfig::roundup_power2_divisions(size): interval i is [2^(20+i), 2^(21+i))
        divisions = divisions_by_interval[min(max(size.bit_length() - 1 - 20, 0), _DIVISION_INTERVALS - 1)]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def _parse_conf(conf: str) -> dict[str, str | list[str]]:
    """Split ``key:value,key:[a:b,c:d]`` the way c10's ConfigTokenizer does (blanks dropped)."""
    tokens: list[str] = []
    word = ""
    for ch in conf:
        if ch in ",:[]":
            if word:
                tokens.append(word)
                word = ""
            tokens.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        tokens.append(word)
    entries: dict[str, str | list[str]] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]" or i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {conf!r}: expected key:value at {key!r}")
        i += 2
        if tokens[i] == "[":
            try:
                end = tokens.index("]", i)
            except ValueError:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}: the list has no closing ']'") from None
            entries[key] = tokens[i + 1 : end]
            i = end + 1
        elif tokens[i] in ",:]":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}: missing value")
        else:
            entries[key] = tokens[i]
            i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}: expected ',' after its value, got {tokens[i]!r}")
            i += 1
    return entries


def _show(value: str | list[str]) -> str:
    return value if isinstance(value, str) else "[" + "".join(value) + "]"


def _conf_int(entries: dict[str, str | list[str]], key: str) -> int:
    value = entries[key]
    if not isinstance(value, str) or not value.isdigit():
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{_show(value)} must be a whole number")
    return int(value)


def _conf_divisions(value: str | list[str]) -> tuple[int, ...]:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: ``4`` or ``[MiB:divisions,...,>:divisions]``."""

    def number(text: str, what: str) -> int:
        if not text.isdigit():
            raise ValueError(
                f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{_show(value)}: "
                f"{what} {text!r} must be a whole number"
            )
        return int(text)

    def power_of_two(n: int, what: str, *, zero_ok: bool) -> int:
        if (n == 0 and not zero_ok) or n & (n - 1):
            raise ValueError(
                f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{_show(value)}: "
                f"{what} {n} must be a power of two{' or 0' if zero_ok else ''}"
            )
        return n

    if isinstance(value, str):
        return (power_of_two(number(value, "divisions"), "divisions", zero_ok=False),) * _DIVISION_INTERVALS
    divisions = [0] * _DIVISION_INTERVALS
    pairs = [item for item in value if item != ","]
    if len(pairs) % 3 or any(pairs[j + 1] != ":" for j in range(0, len(pairs), 3)):
        raise ValueError(
            f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{_show(value)}: write [MiB:divisions,...,>:divisions]"
        )
    last = 0
    first = True
    for j in range(0, len(pairs), 3):
        boundary = pairs[j]
        count = power_of_two(number(pairs[j + 2], "divisions"), "divisions", zero_ok=True)
        if boundary == ">":  # everything above the last boundary named
            divisions[last + 1 :] = [count] * (_DIVISION_INTERVALS - last - 1)
            continue
        mib = power_of_two(number(boundary, "boundary"), "boundary (MiB)", zero_ok=False)
        index = min(mib.bit_length() - 1, _DIVISION_INTERVALS - 1)
        if first:  # the first boundary also covers every interval below it
            divisions[:index] = [count] * index
            first = False
        divisions[index] = count
        last = index
    return tuple(divisions)
