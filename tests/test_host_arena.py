"""retouch.ops.HostArena: alignment, accounting, coalescing, reference counts, shared tensors, threads."""

import gc
import itertools
import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch import ops
from retouch.errors import InputError

ALIGNMENT = 256


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def free_gaps(live: dict[int, int], capacity: int) -> list[int]:
    """Sizes of the ranges between live allocations (offset -> size): what the free list must hold."""
    gaps, cursor = [], 0
    for offset, size in sorted(live.items()):
        gaps.append(offset - cursor)
        cursor = offset + size
    return [gap for gap in gaps + [capacity - cursor] if gap > 0]


def test_properties_and_capacity_rounding():
    arena = ops.HostArena(10_000, alignment=ALIGNMENT, pinned=False)
    assert (arena.capacity, arena.alignment, arena.pinned) == (10_240, ALIGNMENT, False)
    assert (arena.used, arena.largest_free, arena.num_allocations) == (0, 10_240, 0)
    assert ops.HostArena(1, alignment=16).capacity == 16


def test_pinned_only_with_a_gpu():
    arena = ops.HostArena(4096)
    if not torch.cuda.is_available():
        assert not arena.pinned  # page-aligned pageable memory stands in
    assert arena.tensor().data_ptr() % 4096 == 0


@pytest.mark.parametrize("capacity, alignment", [(0, 256), (-5, 256), (1024, 8), (1024, 24), (1024, 0)])
def test_bad_construction(capacity, alignment):
    with pytest.raises(ValueError, match="capacity|alignment"):
        ops.HostArena(capacity, alignment=alignment)


@pytest.mark.parametrize("gib", [1e9, 1e30])
def test_more_memory_than_any_machine_is_an_input_error_naming_the_option(gib):
    """1e30 GiB overflowed the extension's size_t: a TypeError, reported as an internal error."""
    with pytest.raises(InputError, match="for --cache-host-gib: ask for less"):
        ops.allocate_host_arena(int(gib * 2**30), ALIGNMENT, False, "--cache-host-gib")


def test_offsets_aligned_and_accounted():
    arena = ops.HostArena(64 * 1024, alignment=ALIGNMENT)
    sizes = [1, 255, 256, 257, 1000, 4096, 17]
    offsets = [arena.allocate(n) for n in sizes]
    assert all(offset >= 0 and offset % ALIGNMENT == 0 for offset in offsets)
    assert [arena.size(offset) for offset in offsets] == [align_up(n) for n in sizes]
    assert arena.used == sum(align_up(n) for n in sizes)
    assert arena.num_allocations == len(sizes)
    assert arena.largest_free == arena.capacity - arena.used  # nothing freed yet: one range at the end
    base = arena.tensor().data_ptr()
    assert all((base + offset) % ALIGNMENT == 0 for offset in offsets)


def test_large_alignment_is_met_in_memory_too():
    arena = ops.HostArena(1 << 16, alignment=1 << 14)
    assert arena.tensor().data_ptr() % (1 << 14) == 0
    assert arena.allocate(1) == 0 and arena.allocate(1) == 1 << 14


def test_exhaustion_returns_minus_one():
    arena = ops.HostArena(4 * ALIGNMENT)
    assert arena.allocate(4 * ALIGNMENT + 1) == -1
    offsets = [arena.allocate(ALIGNMENT) for _ in range(4)]
    assert sorted(offsets) == [0, 256, 512, 768]
    assert arena.allocate(1) == -1
    assert (arena.used, arena.largest_free) == (arena.capacity, 0)
    with pytest.raises(ValueError, match="nbytes"):
        arena.allocate(0)


def test_release_coalesces_neighbours():
    arena = ops.HostArena(4 * 1024, alignment=ALIGNMENT)
    quarters = [arena.allocate(1024) for _ in range(4)]
    arena.release(quarters[0])
    arena.release(quarters[2])
    assert arena.largest_free == 1024 and arena.allocate(2048) == -1  # two holes, not adjacent
    arena.release(quarters[1])  # joins both holes
    assert arena.largest_free == 3 * 1024
    arena.release(quarters[3])
    assert (arena.used, arena.largest_free, arena.num_allocations) == (0, arena.capacity, 0)
    assert arena.allocate(arena.capacity) == 0


def test_best_fit_keeps_the_large_range_whole():
    arena = ops.HostArena(8 * 1024, alignment=ALIGNMENT)
    small, keep, large, tail = (arena.allocate(n) for n in (1024, 256, 4096, 256))
    arena.release(small)
    arena.release(large)
    assert arena.allocate(512) == small  # the 1 KiB hole fits; the 4 KiB one stays whole
    assert arena.allocate(4096) == large


def test_refcounts():
    arena = ops.HostArena(4096)
    offset = arena.allocate(100)
    assert arena.refcount(offset) == 1
    arena.retain(offset)
    arena.retain(offset)
    assert arena.refcount(offset) == 3
    assert arena.release(offset) is False and arena.release(offset) is False
    assert arena.used == ALIGNMENT
    assert arena.release(offset) is True
    assert arena.refcount(offset) == 0 and arena.used == 0
    with pytest.raises(RuntimeError, match=f"offset {offset} is not a live allocation"):
        arena.release(offset)  # double release
    with pytest.raises(RuntimeError, match="offset 12 is not a live allocation"):
        arena.retain(12)
    with pytest.raises(RuntimeError, match="offset 512 is not a live allocation"):
        arena.size(512)


def test_tensor_shares_memory_and_outlives_the_arena():
    arena = ops.HostArena(8192)
    offset = arena.allocate(300)
    view = arena.tensor()
    assert view.dtype == torch.uint8 and view.shape == (arena.capacity,) and view.device.type == "cpu"
    view[offset : offset + 300] = 7
    again = arena.tensor()
    assert again.data_ptr() == view.data_ptr() and bool((again[offset : offset + 300] == 7).all())
    rows = view[offset : offset + 256].view(torch.bfloat16)  # a view keeps the buffer alive too
    del arena, again, view
    gc.collect()
    assert bool((rows.view(torch.uint8) == 7).all())
    rows.fill_(1.5)
    assert bool((rows == 1.5).all())


def test_threads_never_share_bytes():
    # Threads allocate, stamp each allocation with a unique id over all its bytes, and verify the stamp
    # before releasing: an overlap between two live allocations would overwrite one of the stamps. The
    # arena's methods release the GIL, so the threads really contend on its mutex.
    arena = ops.HostArena(256 * 1024, alignment=ALIGNMENT)
    memory = arena.tensor()
    ids = itertools.count(1)
    failures = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(400):
                if live and (rng.random() < 0.4 or len(live) > 12):
                    offset, size, stamp = live.pop(rng.randrange(len(live)))
                    assert bool((memory[offset : offset + size].view(torch.int32) == stamp).all()), offset
                    if rng.random() < 0.3:  # a second holder that lets go first
                        arena.retain(offset)
                        assert arena.release(offset) is False
                    assert arena.release(offset) is True
                    continue
                offset = arena.allocate(rng.randint(1, 8192))
                if offset < 0:
                    continue
                size, stamp = arena.size(offset), next(ids)
                memory[offset : offset + size].view(torch.int32).fill_(stamp)
                live.append((offset, size, stamp))
            for offset, size, stamp in live:
                assert bool((memory[offset : offset + size].view(torch.int32) == stamp).all()), offset
                arena.release(offset)
        except Exception as exc:  # re-raised in the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert (arena.used, arena.num_allocations, arena.largest_free) == (0, 0, arena.capacity)


OPERATIONS = st.lists(
    st.one_of(st.tuples(st.just("allocate"), st.integers(1, 3000)),
              st.tuples(st.sampled_from(["release", "retain"]), st.integers(0, 63))),
    max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations=OPERATIONS)
def test_random_sequences_keep_allocations_disjoint(operations):
    arena = ops.HostArena(8 * 1024, alignment=ALIGNMENT)
    live: dict[int, int] = {}  # offset -> aligned size
    refs: dict[int, int] = {}
    for operation, value in operations:
        if operation == "allocate":
            offset = arena.allocate(value)
            if offset < 0:
                assert max(free_gaps(live, arena.capacity), default=0) < align_up(value)
                continue
            live[offset], refs[offset] = align_up(value), 1
        elif live:
            offset = sorted(live)[value % len(live)]
            if operation == "retain":
                arena.retain(offset)
                refs[offset] += 1
            else:
                refs[offset] -= 1
                assert arena.release(offset) is (refs[offset] == 0)
                if refs[offset] == 0:
                    del live[offset], refs[offset]

        spans = sorted(live.items())
        assert all(offset % ALIGNMENT == 0 and offset + size <= arena.capacity for offset, size in spans)
        assert all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))
        assert arena.used == sum(live.values())
        assert arena.num_allocations == len(live)
        assert arena.largest_free == max(free_gaps(live, arena.capacity), default=0)
        assert all(arena.size(offset) == size and arena.refcount(offset) == refs[offset] for offset, size in spans)
