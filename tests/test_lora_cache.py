"""The LoRA manager's caches (retouch.lora.manager, lora.host_cache), driven as the engine drives them: a
request's lookup at submission (`prefetch`), its admission (`acquire`), its futures dropped when it is gone.
A file replaced on disk is read again at its next lookup, host and device copies dropped; a budget smaller
than one adapter still reads each file once per lookup, and keeps what a queued or running request needs;
the counters count lookups as their help says. Small real PEFT files of the tiny Flux model; loads are
awaited through their futures or the loader's queue, never by sleeping."""

import gc
import os
import shutil
import threading

import pytest
import torch
from editor_inputs import square_mask, template_image
from lora_files import save_random_lora

from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.api import Engine
from retouch.engine.worker import EngineConfig
from retouch.errors import InputError
from retouch.lora import LoraError, LoraUse
from retouch.lora.files import read_lora
from retouch.lora.manager import LoraManager
from retouch.lora.raw_file import DIRECT_ALIGNMENT
from retouch.models import load_pipeline

ROOMY = 1 << 30  # a budget every adapter of these tests fits in many times


@pytest.fixture(scope="module")
def editor():
    return MaskAwareEditor(load_pipeline("tiny-flux-fill"))


@pytest.fixture(scope="module")
def sources(editor, tmp_path_factory):
    """Two different adapter files of the same size (seeds 1 and 2), outside any LoRA folder."""
    folder = tmp_path_factory.mktemp("sources")
    return [save_random_lora(editor.model, folder, seed=seed, weight_name=f"seed{seed}.safetensors")
            for seed in (1, 2)]


@pytest.fixture
def lora_dir(tmp_path, sources):
    """A LoRA folder with "A" (seed 1) and "B" (seed 2)."""
    for name, source in zip("AB", sources):
        shutil.copyfile(source, tmp_path / f"{name}.safetensors")
    return tmp_path


@pytest.fixture
def make_manager(editor):
    managers = []

    def make(lora_dir, cache_bytes=ROOMY, device_bytes=None) -> LoraManager:
        managers.append(LoraManager(lora_dir, cache_bytes, editor, device_bytes=device_bytes))
        return managers[-1]

    yield make
    for manager in managers:
        manager.close()


def adapter_bytes(editor, path) -> int:
    return read_lora(path, "size", editor.pipe).nbytes


def same_weights(weights, path, editor) -> bool:
    expected = read_lora(path, weights.name, editor.pipe)
    return weights.modules.keys() == expected.modules.keys() and all(
        torch.equal(module.A, expected.modules[key].A) and torch.equal(module.B, expected.modules[key].B)
        for key, module in weights.modules.items())


def request(manager, *names):
    """A request's two calls with the same `LoraUse`s, as the engine makes them: its lookup at submission
    (waited for, so that the admission finds it loaded), then its admission. Returns its uses and futures."""
    uses = tuple(LoraUse(name) for name in names)
    manager.prefetch(uses)
    manager._queue.join()
    futures = manager.acquire(uses)
    for future in futures:
        future.exception(timeout=60)
    return uses, futures


def counts(manager) -> tuple[int, int, int, int]:
    metrics = manager.metrics()
    return metrics["hits"], metrics["misses"], metrics["load_failures"], metrics["loads"]


# ---- a file replaced on disk ----

@pytest.mark.parametrize("replace", ["cp over it", "mv over it"])
def test_a_replaced_file_is_read_again_at_its_next_lookup(editor, sources, lora_dir, make_manager, replace):
    path = lora_dir / "A.safetensors"
    manager = make_manager(lora_dir)
    _, (first,) = request(manager, "A")
    _, (again,) = request(manager, "A")
    assert again.result() is first.result() and counts(manager) == (1, 1, 0, 1)  # on the device: a hit

    if replace == "cp over it":  # the same inode, rewritten (and its mtime kept, as cp -p does)
        stat = path.stat()
        shutil.copyfile(sources[1], path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    else:  # an atomic rename of a new file over it
        shutil.copyfile(sources[1], lora_dir / "A.new")
        os.replace(lora_dir / "A.new", path)
    _, (replaced,) = request(manager, "A")
    assert replaced.result() is not first.result() and same_weights(replaced.result().weights, sources[1], editor)
    assert counts(manager) == (1, 2, 0, 2)  # the lookup read the new file
    assert manager._device["A"] is replaced.result()  # the stale device copy is gone
    assert same_weights(first.result().weights, sources[0], editor)  # a request holding the old one keeps it


def test_a_replaced_file_is_not_answered_from_the_host_cache(editor, sources, lora_dir, make_manager):
    """The device copy was evicted, the host cache still holds the old read: the next lookup reads the file."""
    manager = make_manager(lora_dir, device_bytes=1)  # device copies leave once their request has gone
    request(manager, "A")
    request(manager, "B")  # A's request has gone: B's lookup evicts A's device copy
    gc.collect()
    manager.prefetch((LoraUse("B"),))
    assert "A" not in manager._device and "A" in manager.host.names()
    shutil.copyfile(lora_dir / "B.safetensors", lora_dir / "A.new")
    os.replace(lora_dir / "A.new", lora_dir / "A.safetensors")
    _, (replaced,) = request(manager, "A")
    assert same_weights(replaced.result().weights, sources[1], editor)
    assert manager.metrics()["loads"] == 3


# ---- budgets ----

def test_a_budget_smaller_than_one_adapter_reads_each_file_once_per_lookup(editor, lora_dir, make_manager):
    """--lora-cache-mb 0.05 with ~100 KB adapters: the lookup at submission loads the adapter and its
    admission uses that load (it once read the file again: twice the loads, one more miss than lookups)."""
    size = adapter_bytes(editor, lora_dir / "A.safetensors")
    manager = make_manager(lora_dir, cache_bytes=size // 2)
    for _ in range(3):
        request(manager, "A")
        gc.collect()  # the request has gone
    request(manager, "B")
    assert counts(manager) == (2, 2, 0, 2)  # A: a read, then two hits; B: a read
    assert manager.host.names() == []  # nothing fits the host cache
    assert list(manager._device) == ["B"]  # A, no longer needed, left for B


def test_reads_in_a_full_cache_take_the_memory_of_those_evicted(editor, lora_dir, make_manager):
    """Requests one after another naming five adapters, with room for three: each read evicts before it
    reads and lands in the memory it freed (the cache once counted factors only, not the files as read,
    and evicted after the read: a full cache read every file into fresh memory)."""
    names = [f"C{i}" for i in range(5)]
    for name in names:
        shutil.copyfile(lora_dir / "A.safetensors", lora_dir / f"{name}.safetensors")
    file_bytes = os.path.getsize(lora_dir / "A.safetensors")
    manager = make_manager(lora_dir, cache_bytes=3 * file_bytes + 3 * DIRECT_ALIGNMENT)  # the arena's alignment
    for name in names * 2:
        request(manager, name)
        gc.collect()  # the request has gone
    metrics = manager.metrics()
    assert metrics["loads"] == 10 and metrics["read_fallbacks"] == 0
    assert metrics["cached_adapters"] == 3 and metrics["cached_bytes"] <= manager.host.budget_bytes
    assert manager.memory.used <= manager.host.budget_bytes


def test_a_load_whose_requests_have_all_gone_is_not_made(editor, lora_dir, make_manager, monkeypatch):
    """Requests cancelled while their adapters wait for the loader: it once read every file all the same."""
    manager = make_manager(lora_dir)
    reading, release = threading.Event(), threading.Event()
    read = manager._read

    def held_read(name, file):
        reading.set()
        release.wait(60)
        return read(name, file)
    monkeypatch.setattr(manager, "_read", held_read)
    kept = (LoraUse("A"),)
    manager.prefetch(kept)
    assert reading.wait(60)  # the loader holds A's read; B waits behind it
    manager.prefetch((LoraUse("B"),))  # a request cancelled at once: its LoraUse is gone
    gc.collect()
    release.set()
    manager._queue.join()
    metrics = manager.metrics()
    assert (metrics["loads"], metrics["loads_skipped"]) == (1, 1)
    assert "B" not in manager.resident() and "A" in manager.resident()
    assert manager.acquire(kept)[0].result(timeout=60).weights.name == "A"


def test_an_adapter_stays_on_the_device_while_a_request_needs_it(editor, lora_dir, make_manager):
    """Queued (looked up, not admitted) or running (admitted, its futures alive): pinned beyond the budget;
    gone from the device once its request is gone, at the next lookup."""
    manager = make_manager(lora_dir, device_bytes=1)
    running, futures = request(manager, "A")
    queued = (LoraUse("B"),)
    manager.prefetch(queued)
    manager._queue.join()
    assert sorted(manager._device) == ["A", "B"] and manager.metrics()["device_pinned"] == 2
    del futures
    gc.collect()
    (admitted,) = manager.acquire(queued)  # the queued request's admission: B is still on the device
    assert list(manager._device) == ["B"] and manager.metrics()["device_evictions"] == 1
    assert counts(manager) == (0, 2, 0, 2)

    cancelled = (LoraUse("A"),)  # a request looked up, then dropped before its admission
    manager.prefetch(cancelled)
    manager._queue.join()
    del cancelled
    gc.collect()
    manager.prefetch((LoraUse("B"),))  # the next lookup lets A go; B is still running
    assert list(manager._device) == ["B"] and admitted.result().weights.name == "B"


def test_the_device_budget_is_its_own(editor, lora_dir, make_manager):
    """The host cache keeps what --lora-cache-mb allows; device copies have a budget of their own (by
    default the same number of bytes)."""
    size = adapter_bytes(editor, lora_dir / "A.safetensors")
    assert make_manager(lora_dir, cache_bytes=3 * size).metrics()["device_budget_bytes"] == 3 * size
    manager = make_manager(lora_dir, cache_bytes=3 * size, device_bytes=size)
    for name in "AB":
        request(manager, name)
        gc.collect()
    manager.prefetch((LoraUse("B"),))
    assert sorted(manager.host.names()) == ["A", "B"] and list(manager._device) == ["B"]
    _, (again,) = request(manager, "A")  # from the host cache: no read
    assert counts(manager)[3] == 2 and manager.metrics()["device_budget_bytes"] == size
    with pytest.raises(ValueError, match="device budget"):
        LoraManager(lora_dir, ROOMY, editor, device_bytes=0)


def test_an_engine_with_a_budget_below_one_adapter_reads_it_once_per_edit(editor, lora_dir):
    """Through `Engine.submit` (lookup at submission, admission in the loop, with the request's own LoraUse
    objects): each edit reads the adapter once (its lookup and its admission share the read), and its copy,
    larger than the budget, goes when the edit ends, not at a later lookup (an idle worker kept it); a
    request refused (an unknown template, checked before its LoRA is looked up) and a finished one leave no
    reservation behind."""
    size = adapter_bytes(editor, lora_dir / "A.safetensors")
    config = EngineConfig(mode="naive", lora_dir=str(lora_dir), lora_latest_step=0.0,
                          lora_cache_mb=size / 2 / 2**20)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=2, seed=3)
    with Engine(editor, config) as engine:
        for seed in range(3):
            result = engine.submit(EditRequest(template_id, square_mask(), "a red hat", seed=seed), lora="A:0.5")
            assert result.result(timeout=120).metrics.lora_applied_step == 0
        with pytest.raises(InputError, match="unknown template"):
            engine.submit(EditRequest("tpl-nope", square_mask(), "a red hat"), lora="A")
        manager = engine.worker.loras
        assert counts(manager) == (0, 3, 0, 3)  # the refused request was refused before any lookup
        assert manager.metrics()["device_adapters"] == 0
    gc.collect()
    with manager._lock:
        assert manager._live_reservations("A") == []


# ---- what the counters count ----

def test_every_lookup_that_fails_counts_as_a_load_failure(lora_dir, make_manager):
    """load_failures: the lookups answered 422. A name without a file (refused at submission), a broken file
    (read once), and the same broken file again (not read again) each count once."""
    (lora_dir / "broken.safetensors").write_bytes(b"not a safetensors file")
    manager = make_manager(lora_dir)
    with pytest.raises(LoraError) as missing:
        manager.check((LoraUse("A"), LoraUse("nope")))
    assert "nope" in str(missing.value) and str(lora_dir) not in str(missing.value)
    assert counts(manager) == (0, 0, 1, 0)
    for expected in ((0, 1, 2, 0), (0, 1, 3, 0)):
        _, (future,) = request(manager, "broken")
        assert isinstance(future.exception(), LoraError) and str(lora_dir) not in str(future.exception())
        assert counts(manager) == expected


def test_a_file_removed_after_submission_fails_without_naming_the_folder(lora_dir, make_manager):
    manager = make_manager(lora_dir)
    uses = (LoraUse("A"),)
    manager.check(uses)
    (lora_dir / "A.safetensors").unlink()
    manager.prefetch(uses)
    (future,) = manager.acquire(uses)
    error = future.exception(timeout=60)
    assert isinstance(error, LoraError) and "'A'" in str(error) and str(lora_dir) not in str(error)
    assert counts(manager) == (0, 1, 1, 0)


def test_the_host_cache_drops_an_entry_read_from_another_file(editor, lora_dir):
    from retouch.lora.host_cache import LoraHostCache

    weights = read_lora(lora_dir / "A.safetensors", "A", editor.pipe)
    cache = LoraHostCache(ROOMY)
    assert cache.put("A", weights, ("A.safetensors", 1))
    assert cache.get("A", ("A.safetensors", 1)) is weights and cache.get("A") is weights
    assert cache.get("A", ("A.safetensors", 2)) is None and "A" not in cache and cache.nbytes == 0
    assert cache.evictions == 0
