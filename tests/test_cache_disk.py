"""Step layout, fp8 encoding and the disk tier's file format: round trips, corruption, budget."""

import shutil

import numpy as np
import pytest
import torch

from retouch.cache.disk import CorruptCacheFile, DiskTier, read_template, template_header, write_template
from retouch.cache.keys import check_template_id, stored_key
from retouch.cache.layout import StepLayout, decode, encode
from retouch.errors import InputError

SHAPES = {(0, "out"): (6, 8), (0, "k"): (6, 2, 4), (1, "out"): (6, 8), (1, "uncond.out"): (6, 8)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_layout_is_aligned_disjoint_and_round_trips(dtype):
    layout = StepLayout.for_tensors(SHAPES, dtype, alignment=64)
    spans = []
    for entry in layout.entries:
        assert entry.offset % 64 == 0
        spans.append((entry.offset, entry.offset + entry.rows * layout.row_bytes(entry)))
        if dtype == torch.float8_e4m3fn:
            assert entry.scale_offset % 64 == 0
            spans.append((entry.scale_offset, entry.scale_offset + 4 * entry.row_elems))
        else:
            assert entry.scale_offset is None
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.nbytes
    assert StepLayout.from_dict(layout.to_dict()) == layout
    assert layout.entry(1, "uncond.out").shape == (6, 8)


def test_layout_from_disk_is_checked():
    data = StepLayout.for_tensors(SHAPES, torch.float32, 64).to_dict()
    data["entries"][1][3] = data["entries"][0][3] + 4  # overlaps its neighbour
    with pytest.raises(ValueError, match="overlapping"):
        StepLayout.from_dict(data)


def test_fp8_encoding_keeps_outlier_channels_and_small_ones():
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(64, 16, generator=generator)
    tensor[:, 3] *= 1000  # an outlier channel, as DiT activations have
    stored, scale = encode(tensor, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn and scale.shape == (16,)
    restored = decode(stored, scale, torch.float32)
    relative = ((restored - tensor).abs() / tensor.abs().amax(dim=0)).max()
    assert relative < 2 ** -4  # e4m3 keeps 3 mantissa bits; per channel, every channel keeps them
    assert torch.equal(decode(*encode(tensor, torch.float32), torch.float32), tensor)


def test_template_ids_are_plain_tokens():
    assert check_template_id("abc-123_X") == "abc-123_X"
    for bad in ["", "../etc", "a/b", "a.b", "-lead", "x" * 129, ".hidden", "a\x00b"]:
        with pytest.raises(InputError):
            check_template_id(bad)
    assert stored_key("abc/uncond", "out") == ("abc", "uncond.out")
    with pytest.raises(InputError):
        stored_key("../x/uncond", "out")


def random_steps(layout: StepLayout, count: int, seed: int) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.integers(0, 256, layout.nbytes, dtype=np.uint8) for _ in range(count)]


def read_back(path, template_id):
    def allocate(num_steps, layout):
        return [np.zeros(layout.nbytes, dtype=np.uint8) for _ in range(num_steps)]

    return read_template(path, template_id, allocate)


def test_file_round_trip_is_bit_exact(tmp_path):
    layout = StepLayout.for_tensors(SHAPES, torch.bfloat16, 64)
    steps = random_steps(layout, 3, seed=1)
    path = tmp_path / "t.rtc"
    write_template(path, template_header("t", layout, steps, {"source_dtype": "bfloat16"}), steps)
    read_layout, read_steps, meta = read_back(path, "t")
    assert read_layout == layout and meta == {"source_dtype": "bfloat16"}
    assert all(np.array_equal(a, b) for a, b in zip(steps, read_steps))


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "magic", "empty", "other_id"])
def test_damaged_files_are_refused(tmp_path, damage):
    layout = StepLayout.for_tensors(SHAPES, torch.float32, 64)
    steps = random_steps(layout, 2, seed=2)
    path = tmp_path / "t.rtc"
    write_template(path, template_header("t" if damage != "other_id" else "u", layout, steps), steps)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "flip_payload":
        raw[-5] ^= 0x40
    elif damage == "flip_header":
        raw[20] ^= 0x01
    elif damage == "magic":
        raw[:8] = b"NOTCACHE"
    elif damage == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCacheFile):
        read_back(path, "t")


def test_disk_tier_keeps_its_budget_and_evicts_least_recently_used(tmp_path):
    layout = StepLayout.for_tensors({(0, "out"): (64, 64)}, torch.float32, 64)  # 16 KiB a step
    steps = random_steps(layout, 1, seed=3)
    file_bytes = layout.nbytes + 1024  # a step and its header
    folder = tmp_path / "tier"
    tier = DiskTier(folder, budget=3 * file_bytes)
    for name in ["a", "b", "c"]:
        assert tier.write(name, layout, steps)
    # a tenant's image, in effect: its folder and files are the serving user's alone
    assert folder.stat().st_mode & 0o077 == 0 and tier.path("a").stat().st_mode & 0o077 == 0
    tier.touch("a")
    assert tier.write("d", layout, steps)
    assert not tier.contains("b") and all(tier.contains(n) for n in "acd")
    assert tier.used <= tier.budget and tier.evictions == 1
    assert sum(p.stat().st_size for p in folder.iterdir()) == tier.used
    assert not tier.write("huge", layout, random_steps(layout, 4, seed=4))  # alone over budget
    assert not tier.path("huge").exists()
    # A new tier over the same folder (the first gave it back) adopts the files; a smaller budget evicts
    # the oldest. While the first holds it, another process's tier is refused.
    with pytest.raises(InputError, match="keeps its disk tier in"):
        DiskTier(folder, budget=2 * file_bytes)
    tier.close()
    again = DiskTier(folder, budget=2 * file_bytes)
    assert again.used <= again.budget and again.contains("d")


def test_a_file_evicted_while_it_is_written_does_not_stay_on_disk(tmp_path, monkeypatch):
    """Files are written outside the tier's lock: another write can evict one still being written. Its
    file then lands after the eviction's unlink, and must not stay on disk uncounted, over the budget."""
    import retouch.cache.disk as disk

    layout = StepLayout.for_tensors({(0, "out"): (64, 64)}, torch.float32, 64)
    steps = random_steps(layout, 1, seed=3)
    tier = DiskTier(tmp_path, budget=(layout.nbytes + 1024) * 3 // 2)  # one file at a time
    real = disk.write_template

    def write_while_another_evicts(path, header, data):
        if path.name.startswith("a"):
            assert tier.write("b", layout, steps)  # evicts "a", reserved but not written yet
        real(path, header, data)

    monkeypatch.setattr(disk, "write_template", write_while_another_evicts)
    assert tier.write("a", layout, steps)  # written, then gone as an evicted file goes
    assert not tier.contains("a") and tier.contains("b") and not tier.path("a").exists()
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == tier.used <= tier.budget


def test_copies_the_host_also_holds_are_evicted_first(tmp_path):
    """With write-through every recording is on disk too; a new file pushes out a copy whose template is
    in host memory before the only copy of another."""
    layout = StepLayout.for_tensors({(0, "out"): (64, 64)}, torch.float32, 64)
    steps = random_steps(layout, 1, seed=3)
    in_host = {"b"}
    tier = DiskTier(tmp_path, budget=3 * (layout.nbytes + 1024), redundant=lambda name: name in in_host)
    for name in ["a", "b", "c", "d"]:
        assert tier.write(name, layout, steps)
    assert not tier.contains("b") and all(tier.contains(n) for n in "acd")  # a was older, but only on disk
    in_host.clear()
    assert tier.write("e", layout, steps) and not tier.contains("a")  # then least recently used


def test_a_folder_removed_while_serving_is_made_again_at_the_next_write(tmp_path):
    """Every write failed (ENOENT) until the worker restarted."""
    layout = StepLayout.for_tensors({(0, "out"): (64, 64)}, torch.float32, 64)
    tier = DiskTier(tmp_path / "disk", budget=1 << 30)
    shutil.rmtree(tmp_path / "disk")
    assert tier.write("a", layout, random_steps(layout, 2, seed=1))
    assert tier.path("a").exists()
    tier.close()
