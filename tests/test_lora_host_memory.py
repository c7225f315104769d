"""Adapter reads land in recycled host memory (retouch.lora.host_memory): a factor the file holds in the serving
dtype is used where it was read (no second copy), a range returns to the arena when the last view of it is
gone and the next read reuses it, and a read that finds no free range still works, in fresh memory, counted.
Small real PEFT files of the tiny Flux model."""

import gc
import shutil

import pytest
import torch
from lora_files import save_random_lora

from retouch.editor import MaskAwareEditor
from retouch.lora import LoraUse
from retouch.lora.files import read_lora
from retouch.lora.host_memory import AdapterMemory
from retouch.lora.manager import LoraManager
from retouch.lora.raw_file import DIRECT_ALIGNMENT
from retouch.models import load_pipeline

ALIGNMENT = DIRECT_ALIGNMENT  # the arena's: O_DIRECT reads land in its ranges


@pytest.fixture(scope="module")
def editor():
    return MaskAwareEditor(load_pipeline("tiny-flux-fill"))


@pytest.fixture(scope="module")
def adapter(editor, tmp_path_factory):
    return save_random_lora(editor.model, tmp_path_factory.mktemp("adapter"), rank=8, seed=3)


def in_arena(memory: AdapterMemory, tensor: torch.Tensor) -> bool:
    whole = memory._arena.tensor()
    start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return whole.data_ptr() <= start and stop <= whole.data_ptr() + whole.numel()


def factors(weights):
    return [t for module in weights.modules.values() for t in (module.A, module.B)]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def test_a_range_returns_when_its_last_view_is_gone_and_is_reused():
    memory = AdapterMemory(1 << 20)
    block = memory.block(1000, pinned=False)
    address = block.data_ptr()
    view = block[10:20].view(torch.int16)
    assert memory.used == aligned(1000)
    del block
    gc.collect()
    assert memory.used == aligned(1000)  # the view holds it
    del view
    assert memory.used == 0
    again = memory.block(1000, pinned=False)
    assert again.data_ptr() == address and memory.fallbacks == 0


def test_prefault_writes_the_whole_arena():
    memory = AdapterMemory(1 << 20)
    block = memory.block(8192, pinned=False)
    block.fill_(7)
    del block
    memory.prefault(pinned=False)
    whole = memory.block(1 << 20, pinned=False)
    assert memory.fallbacks == 0 and not whole.any()
    whole.fill_(7)
    with pytest.raises(RuntimeError, match="would overwrite 1048576 bytes"):  # an adapter's bytes, live
        memory.prefault(pinned=False)
    assert bool((whole == 7).all())


def test_a_block_the_arena_cannot_hold_is_fresh_memory_counted():
    memory = AdapterMemory(4096)
    held = memory.block(4096, pinned=False)
    spare = memory.block(100, pinned=False)
    assert spare.numel() == 100 and not in_arena(memory, spare) and memory.fallbacks == 1
    spare.fill_(7)  # usable memory of its own
    assert memory.used == 4096 and held.numel() == 4096
    assert memory.block(0, pinned=False).numel() == 0 and memory.fallbacks == 1  # nothing to hold: no fallback


def test_factors_in_the_serving_dtype_stay_where_the_file_was_read(editor, adapter):
    memory = AdapterMemory(1 << 26)
    weights = read_lora(adapter, "A", editor.pipe, allocate=lambda n: memory.block(n, pinned=False))
    expected = read_lora(adapter, "A", editor.pipe)
    assert all(in_arena(memory, t) for t in factors(weights))
    assert memory.used == aligned(adapter.stat().st_size)  # the file's bytes, and nothing copied beside them
    assert all(torch.equal(a, b) for a, b in zip(factors(weights), factors(expected)))
    del weights
    assert memory.used == 0


def test_factors_converted_to_another_dtype_are_copied_and_the_file_bytes_return(editor, adapter):
    memory = AdapterMemory(1 << 26)
    weights = read_lora(adapter, "A", editor.pipe, dtype=torch.bfloat16,
                        allocate=lambda n: memory.block(n, pinned=False))
    expected = read_lora(adapter, "A", editor.pipe, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and in_arena(memory, t) for t in factors(weights))
    copied = sum(-(-t.numel() * 2 // 64) * 64 for t in factors(weights))  # each factor 64-byte aligned
    assert memory.used == aligned(copied)  # the file's bytes went back at the end of the read
    assert all(torch.equal(a, b) for a, b in zip(factors(weights), factors(expected)))


def test_the_manager_reads_again_into_the_memory_it_freed(editor, adapter, tmp_path):
    shutil.copyfile(adapter, tmp_path / "A.safetensors")
    manager = LoraManager(tmp_path, 1 << 30, editor)
    try:
        for _ in range(3):
            (future,) = manager.acquire((LoraUse("A"),))
            weights = future.result(timeout=60).weights
            address = sorted(t.data_ptr() for t in factors(weights))
            del future, weights
            manager.clear()
            assert manager.memory.used == 0
        assert manager.metrics()["loads"] == 3 and manager.metrics()["read_fallbacks"] == 0
        (future,) = manager.acquire((LoraUse("A"),))
        assert sorted(t.data_ptr() for t in factors(future.result(timeout=60).weights)) == address
    finally:
        manager.close()


def test_a_read_while_a_request_holds_the_only_range_falls_back_and_is_correct(editor, adapter, tmp_path):
    for name in "AB":
        shutil.copyfile(adapter, tmp_path / f"{name}.safetensors")
    manager = LoraManager(tmp_path, aligned(adapter.stat().st_size), editor)
    try:
        (held,) = manager.acquire((LoraUse("A"),))  # a running request's lease: A stays in memory
        held.result(timeout=60)
        (other,) = manager.acquire((LoraUse("B"),))
        weights = other.result(timeout=60).weights
        assert manager.metrics()["read_fallbacks"] == 1 and not any(in_arena(manager.memory, t)
                                                                     for t in factors(weights))
        expected = read_lora(adapter, "B", editor.pipe)
        assert all(torch.equal(a, b) for a, b in zip(factors(weights), factors(expected)))
    finally:
        manager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a pinned arena needs a GPU")
def test_a_gpu_server_page_locks_its_read_memory_before_it_serves(tmp_path):
    """Page-locking is slow and CUDA orders it against the device's work: it happens when the manager is made,
    not at the first request's read."""
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill", device="cuda"))
    manager = LoraManager(tmp_path, 1 << 24, editor)
    try:
        assert manager.memory._arena is not None and manager.memory._arena.pinned
        assert manager.memory.block(4096, pinned=True).is_pinned()
    finally:
        manager.close()
