"""The cache store: host budget and LRU, write-back to disk and bit-exact reload, corrupt files,
prefetch, concurrent readers with an evicting writer, and budgets under random churn."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retouch.cache import CacheFull, CacheMiss, CacheStore, StoreConfig

BLOCKS, STEPS, TOKENS, HIDDEN = 3, 2, 16, 32
STEP_BYTES = BLOCKS * TOKENS * HIDDEN * 4  # fp32 "out" of every block: 6 KiB, a multiple of the alignment
TEMPLATE_BYTES = STEPS * STEP_BYTES


def activations(template_id: str, step: int, block: int, dtype=torch.float32) -> torch.Tensor:
    """Deterministic per key, so any reader can check what it got."""
    seed = hash((template_id, step, block)) % (2 ** 31)
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def record(store: CacheStore, template_id: str, steps: int = STEPS, dtype=torch.float32) -> None:
    store.begin(template_id)
    for step in range(steps):
        for block in range(BLOCKS):
            store.put(template_id, step, block, "out", activations(template_id, step, block, dtype))
    store.commit(template_id)


def assert_intact(store: CacheStore, template_id: str, steps: int = STEPS) -> None:
    with store.acquire(template_id) as handle:
        for step in range(steps):
            for block in range(BLOCKS):
                assert torch.equal(handle.read(step, block, "out"), activations(template_id, step, block))


def make_store(tmp_path=None, templates_in_host=2, disk_templates=None, **options) -> CacheStore:
    disk = {} if tmp_path is None else {"disk_dir": tmp_path / "disk",
                                        "disk_bytes": (disk_templates or 100) * (TEMPLATE_BYTES + 4096)}
    return CacheStore(StoreConfig(host_bytes=int(templates_in_host * TEMPLATE_BYTES), **disk, **options))


def test_record_then_read_back_every_activation():
    store = make_store()
    record(store, "a")
    assert_intact(store, "a")
    assert store.get("a", 1, 2, "out").shape == (TOKENS, HIDDEN)
    assert store.nbytes("a") == TEMPLATE_BYTES and store.contains("a")
    with pytest.raises(KeyError):
        store.get("a", STEPS, 0, "out")
    with pytest.raises(CacheMiss):
        store.acquire("never")


@pytest.mark.parametrize("options, says", [({"host_bytes": "1G"}, "host_bytes must be a whole number of bytes"),
                                           ({"disk_bytes": 2.5}, "disk_bytes must be a whole number"),
                                           ({"host_bytes": -1}, "host budget must be >= 1"),
                                           ({"dtype": "int4"}, "cache dtype must be auto or one of")])
def test_bad_budgets_are_named(options, says):
    from retouch.errors import InputError

    with pytest.raises(InputError, match=says):
        StoreConfig(**options)
    assert StoreConfig(host_bytes=1.5e9).host_bytes == 1_500_000_000  # a whole number, written as a float


def test_uncommitted_recording_is_invisible_and_drop_frees_it():
    store = make_store()
    store.begin("a")
    store.put("a", 0, 0, "out", activations("a", 0, 0))
    store.put("a", 1, 0, "out", activations("a", 1, 0))  # step 0 is written to the arena now
    assert not store.contains("a") and store.arena.used == STEP_BYTES // BLOCKS  # one block was put
    store.drop("a")
    assert store.arena.used == 0


def test_guidance_rows_are_kept_with_their_template():
    store = make_store()
    store.begin("a")
    store.put("a", 0, 0, "out", activations("a", 0, 0))
    store.put("a/uncond", 0, 0, "out", activations("u", 0, 0))
    store.commit("a")
    assert store.contains("a/uncond")
    assert torch.equal(store.get("a/uncond", 0, 0, "out"), activations("u", 0, 0))
    store.drop("a")
    assert not store.contains("a/uncond")


def test_kept_names_filter_what_is_recorded():
    store = make_store()
    store.begin("a", names={"out"})
    for name in ("out", "k", "v", "uncond.k"):
        store.put("a", 0, 0, name, torch.ones(TOKENS, HIDDEN))
    store.commit("a")
    with store.acquire("a") as handle:
        assert [e.name for e in handle.layout.entries] == ["out"]


def test_steps_must_come_in_order():
    store = make_store()
    store.put("a", 0, 0, "out", activations("a", 0, 0))
    with pytest.raises(ValueError, match="in order"):
        store.put("a", 2, 0, "out", activations("a", 2, 0))


def test_least_recently_used_template_is_evicted_first():
    store = make_store(templates_in_host=2)
    record(store, "a")
    record(store, "b")
    store.acquire("a").release()  # a is now more recent than b
    record(store, "c")
    assert store.contains("a") and store.contains("c") and not store.contains("b")
    assert store.metrics()["evictions"] == 1
    assert store.arena.used <= store.arena.capacity


def test_in_host_lists_the_templates_in_host_memory_most_recently_used_first():
    """What a worker's heartbeat tells the router (template affinity): committed templates only, the most
    recently used first, at most `most`; an evicted one is gone from it."""
    store = make_store(templates_in_host=2)
    record(store, "a")
    record(store, "b")
    store.begin("c")  # being recorded: not readable yet
    assert store.in_host() == ["b", "a"]
    store.acquire("a").release()
    assert store.in_host() == ["a", "b"] and store.in_host(most=1) == ["a"]
    store.abandon("c")
    record(store, "d")  # evicts b, the least recently used
    assert store.in_host() == ["d", "a"]


def test_templates_in_use_are_not_evicted_and_a_full_budget_says_so():
    store = make_store(templates_in_host=2)
    record(store, "a")
    record(store, "b")
    with store.acquire("a"), store.acquire("b"):
        with pytest.raises(CacheFull, match="host cache budget"):
            record(store, "c")
    assert_intact(store, "a")
    assert_intact(store, "b")
    record(store, "c")  # now a reader-free victim exists
    assert store.contains("c")


def test_a_recording_that_cannot_fit_whole_is_refused_at_its_first_step():
    """Told how many steps it will write, the store refuses a recording larger than its whole budget when
    the first step's size is known, naming what it needs, instead of after filling the budget."""
    store = make_store(templates_in_host=2)
    store.begin("a", steps=5)  # 5 steps of STEP_BYTES: more than 2 templates' worth (4 steps)
    for block in range(BLOCKS):
        store.put("a", 0, block, "out", activations("a", 0, block))
    with pytest.raises(CacheFull, match=r"needs .* GiB of host cache \(5 steps of .*\(--cache-host-gib\)"):
        store.put("a", 1, 0, "out", activations("a", 1, 0))  # step 0 is written now
    assert store.arena.used == 0 and not store.contains("a")
    store.begin("b", steps=4)  # exactly the budget
    record(store, "b", steps=4)
    assert store.contains("b") and store.arena.used == store.arena.capacity


def test_dropping_a_template_while_it_is_read_keeps_the_readers_memory():
    store = make_store(templates_in_host=2)
    record(store, "a")
    handle = store.acquire("a")
    store.drop("a")
    assert not store.contains("a") and store.arena.used == TEMPLATE_BYTES  # the reader's
    record(store, "b")  # allocations never overlap the memory the reader holds
    assert torch.equal(handle.read(1, 2, "out"), activations("a", 1, 2))
    handle.release()
    assert store.arena.used == TEMPLATE_BYTES  # only b's


class Fence:
    """A CUDA event's interface (`query`, `synchronize`) over a flag the test sets: the device's copies
    from released memory are done once it is."""

    def __init__(self):
        self.passed = False
        self.waits = 0

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waits += 1
        self.passed = True


def test_memory_released_behind_a_fence_is_reused_only_once_the_fence_has_passed():
    store = make_store(templates_in_host=2)
    record(store, "a")
    record(store, "b")
    fence = Fence()
    store.acquire("a").release(fence)  # the host is done; the device may still be copying from a
    assert store.evict("a")  # no reader: evictable at once, its memory still held for the copies
    assert not store.contains("a") and store.arena.used == 2 * TEMPLATE_BYTES
    record(store, "c")  # needs a's memory: waits for the fence rather than evicting b
    assert fence.waits == 1 and store.contains("b") and store.metrics()["evictions"] == 1
    assert_intact(store, "b")
    assert_intact(store, "c")

    passed = Fence()
    passed.passed = True
    store.acquire("b").release(passed)
    store.drop("b")
    assert store.arena.used == TEMPLATE_BYTES and passed.waits == 0  # freed at once: nothing to wait for
    unseen = Fence()
    store.acquire("c").release(unseen)
    store.drop("c")
    assert store.arena.used == TEMPLATE_BYTES
    unseen.passed = True  # the device got there on its own: the next allocation frees it without waiting
    record(store, "d")
    assert unseen.waits == 0 and store.arena.used == TEMPLATE_BYTES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eviction_writes_back_and_reload_is_bit_exact(tmp_path, dtype):
    store = make_store(tmp_path, templates_in_host=torch.finfo(dtype).bits / 32)  # room for one
    record(store, "a", dtype=dtype)
    before = {(s, b): store.get("a", s, b, "out") for s in range(STEPS) for b in range(BLOCKS)}
    record(store, "b", dtype=dtype)  # evicts a to disk
    metrics = store.metrics()
    assert metrics["evictions"] == 1 and metrics["disk_writes"] == 1 and store.contains("a")
    for key, tensor in before.items():
        reloaded = store.get("a", key[0], key[1], "out")  # a comes back, b goes to disk
        assert reloaded.dtype == dtype and torch.equal(reloaded.view(torch.uint8), tensor.view(torch.uint8))
    assert store.metrics()["disk_hits"] == 1


def test_fp8_storage_quarters_bytes_and_stays_close():
    store = make_store(dtype="float8_e4m3fn")
    record(store, "a")
    # 1 byte per value instead of 4, plus a float32 scale per channel (one aligned 256-byte slot here)
    assert store.nbytes("a") == STEPS * BLOCKS * (TOKENS * HIDDEN + 256)
    original = activations("a", 1, 1)
    restored = store.get("a", 1, 1, "out")
    assert restored.dtype == torch.float32
    assert ((restored - original).abs() / original.abs().amax(dim=0)).max() < 2 ** -4


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_an_unusable_file_is_a_miss_and_is_removed(tmp_path, damage, caplog):
    store = make_store(tmp_path, templates_in_host=1)
    record(store, "a")
    record(store, "b")  # a -> disk
    path = store.disk.path("a")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-7])
    elif damage == "corrupt":
        raw = bytearray(path.read_bytes())
        raw[-1000] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:
        path.unlink()
    with caplog.at_level("WARNING", logger="retouch.cache"), pytest.raises(CacheMiss):
        store.acquire("a")
    assert not path.exists() and not store.contains("a")
    assert store.metrics()["corrupt_files"] == (0 if damage == "delete" else 1)
    # the operator is told which file, and why (a disk going bad shows as these)
    assert [str(path) in r.getMessage() for r in caplog.records if r.name == "retouch.cache"] == [True]
    assert_intact(store, "b")  # the failed load left the resident template alone
    record(store, "a")  # a recompute (re-registration) serves again
    assert_intact(store, "a")


def test_a_file_that_cannot_be_read_is_a_miss_and_is_forgotten(tmp_path):
    """Not corrupt but unreadable (here a folder where the file was; EIO or EACCES alike): a miss, and
    the template is recorded again, rather than an error on every edit of it."""
    store = make_store(tmp_path, templates_in_host=1)
    record(store, "a")
    record(store, "b")  # a -> disk
    path = store.disk.path("a")
    path.unlink()
    path.mkdir()
    with pytest.raises(CacheMiss):
        store.acquire("a")
    assert not store.contains("a") and store.metrics()["misses"] == 1
    record(store, "a")  # its write-back, when b's next use evicts it, fails on the folder: see below
    assert_intact(store, "a")


def test_a_failed_write_back_still_frees_the_host_budget(tmp_path, monkeypatch):
    """A disk that is full (or gone) when a template is evicted: the template leaves host memory all
    the same, counted, and later templates are recorded and read as if there were no disk tier."""
    store = make_store(tmp_path, templates_in_host=1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("retouch.cache.disk.write_template", disk_full)
    record(store, "a")  # its write-through fails
    record(store, "b")  # a is evicted; its write-back is tried again and fails
    record(store, "c")  # and b's: neither holds the budget
    assert_intact(store, "c")
    store.flush()
    metrics = store.metrics()
    assert metrics["disk_write_failures"] == 3 + 2 and metrics["evictions"] == 2 and metrics["disk_writes"] == 0
    assert not store.contains("a") and not store.contains("b")
    with pytest.raises(CacheMiss):
        store.acquire("a")


def test_hits_count_host_lookups_and_disk_loads_count_once(tmp_path):
    store = make_store(tmp_path, templates_in_host=1)
    record(store, "a")
    record(store, "b")  # a -> disk
    assert_intact(store, "b")
    assert_intact(store, "a")  # loaded from disk: a disk hit, not also a host hit
    metrics = store.metrics()
    assert (metrics["hits"], metrics["disk_hits"], metrics["misses"]) == (1, 1, 0)
    with store.acquire("a"):  # a is read: b, on disk, cannot be loaded now; that is not a miss
        with pytest.raises(CacheFull):
            store.acquire("b")
    assert store.metrics()["misses"] == 0 and store.contains("b")


def test_committed_templates_are_written_through_and_outlive_the_store(tmp_path):
    """With a disk tier every committed template is written in the background: a store opened later on
    the same folder (a restarted worker) reads it back bit for bit, with its meta, and evicting it
    writes nothing more."""
    store = make_store(tmp_path, templates_in_host=2)
    store.begin("a", meta={"recorded_by": "model-1"})
    for step in range(STEPS):
        for block in range(BLOCKS):
            store.put("a", step, block, "out", activations("a", step, block))
    store.commit("a")
    store.flush()
    assert store.disk.contains("a") and store.metrics()["disk_writes"] == 1
    assert store.evict("a") and store.metrics()["disk_writes"] == 1  # nothing more to write
    store.close()
    later = make_store(tmp_path, templates_in_host=2)
    assert later.contains("a") and later.meta("a") == {"recorded_by": "model-1", "source_dtype": "float32"}
    assert_intact(later, "a")
    later.drop("a")
    assert not later.disk.path("a").exists() and later.meta("a") is None


def test_a_template_recorded_again_while_its_first_write_waited_keeps_the_second_on_disk(tmp_path):
    """Two commits of one id while the writer is busy (a drop and a new recording): the file on disk is
    the second recording's, never the first's standing in for it."""
    store = make_store(tmp_path, templates_in_host=4)
    busy = threading.Event()
    store._writer = ThreadPoolExecutor(1)
    store._writer.submit(busy.wait)  # an earlier template's write
    for mode in ("first", "second"):
        store.begin("a", meta={"recording": mode})
        for step in range(STEPS):
            for block in range(BLOCKS):
                store.put("a", step, block, "out", activations("a", step, block))
        store.commit("a")
    busy.set()
    store.flush()
    assert store.disk.read_meta("a")["recording"] == "second" and store.metrics()["disk_writes"] == 1
    assert store.evict("a")
    assert store.meta("a")["recording"] == "second"
    assert_intact(store, "a")


def test_a_template_larger_than_the_disk_tier_is_counted_and_said_once(tmp_path, caplog):
    """Not written (it alone exceeds the budget), and said: once a silent miss after every restart."""
    store = make_store(tmp_path, templates_in_host=1, disk_templates=0.5)
    record(store, "a")
    store.flush()
    record(store, "b")  # a is evicted: its write-back is not tried again
    store.flush()
    assert not store.disk.contains("a") and store.metrics()["disk_too_large"] == 2  # a, then b's write-through
    assert store.metrics()["disk_writes"] == 0
    assert sum("larger than the whole disk tier" in r.getMessage() for r in caplog.records) == 2
    store.close()


def test_prefetch_loads_from_disk_in_the_background(tmp_path):
    store = make_store(tmp_path, templates_in_host=1)
    record(store, "a")
    record(store, "b")
    assert store.prefetch("a").result(timeout=30) is True
    assert store.prefetch("never").result(timeout=30) is False
    metrics = store.metrics()
    assert metrics["prefetches"] == 1 and metrics["prefetch_bytes"] == TEMPLATE_BYTES
    assert metrics["prefetch_seconds"] > 0
    hits = metrics["hits"]
    assert_intact(store, "a")
    assert store.metrics()["hits"] == hits + 1  # resident: no disk read on acquire
    store.close()


def test_concurrent_readers_and_an_evicting_writer(tmp_path):
    store = make_store(tmp_path, templates_in_host=3)
    names = [f"t{i}" for i in range(6)]
    for name in names[:3]:
        record(store, name)
    errors = []

    def reader(seed: int):
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(40):
                name = names[int(torch.randint(0, 3, (1,), generator=generator))]
                try:
                    assert_intact(store, name)
                except (CacheMiss, CacheFull):
                    pass  # evicted everywhere, or every slot held by readers: both legal outcomes
        except Exception as exc:  # noqa: BLE001 - collected for the main thread's assertion
            errors.append(exc)

    def writer():
        try:
            for round_ in range(6):
                for name in names[3:]:
                    # Until it lands: readers may hold every slot for a while, but they finish.
                    while True:
                        try:
                            record(store, name)
                            break
                        except CacheFull:
                            continue
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(3)] + [threading.Thread(target=writer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert store.arena.used <= store.arena.capacity
    assert store.metrics()["evictions"] > 0
    for name in names:
        if store.contains(name):
            assert_intact(store, name)


OPERATIONS = st.lists(st.tuples(st.sampled_from(["record", "acquire", "release", "drop", "prefetch"]),
                                st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_budgets_hold_and_data_stays_intact_under_random_churn(tmp_path_factory, operations):
    tmp_path = tmp_path_factory.mktemp("churn")
    store = make_store(tmp_path, templates_in_host=3, disk_templates=2)
    held = []
    for operation, index, steps in operations:
        name = f"t{index}"
        if operation == "record":
            try:
                record(store, name, steps=steps)
            except CacheFull:
                assert len(held) > 0  # only readers can make a fitting template not fit
        elif operation == "acquire":
            try:
                held.append(store.acquire(name))
            except (CacheMiss, CacheFull):
                pass
        elif operation == "release" and held:
            held.pop(index % len(held)).release()
        elif operation == "drop":
            store.drop(name)
        elif operation == "prefetch":
            store.prefetch(name).result(timeout=30)
        store.flush()  # the write-through of what was recorded: its files may come and go until then
        assert store.arena.used <= store.arena.capacity
        assert store.disk.used <= store.disk.budget
        assert sum(p.stat().st_size for p in store.disk.directory.glob("*.rtc")) <= store.disk.budget
    for handle in held:  # what readers hold was never overwritten
        for step in range(handle.num_steps):
            for block in range(BLOCKS):
                assert torch.equal(handle.read(step, block, "out"), activations(handle.template_id, step, block))
        handle.release()
    store.close()
    assert store.arena.used == sum(t.nbytes for t in store._host.values())


def test_a_recording_that_does_not_fit_frees_what_it_had_written():
    store = make_store(templates_in_host=2)
    record(store, "a")
    with store.acquire("a"):
        with pytest.raises(CacheFull):
            record(store, "b", steps=3)  # 2 steps fit beside a, the third does not
        assert not store.contains("b")
        assert store.arena.used == TEMPLATE_BYTES  # only a's: b's two written steps were freed


def test_a_host_budget_the_machine_cannot_give_is_refused_naming_the_flag():
    """1e7 GiB failed inside the arena's constructor: a C++ message, exit 1 from the CLI."""
    from retouch.errors import InputError

    with pytest.raises(InputError, match="--cache-host-gib"):
        CacheStore(StoreConfig(host_bytes=int(1e7 * 2**30)))
