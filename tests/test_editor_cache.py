"""The editor on the cache engine: templates recorded into the host arena, evicted to disk, loaded back
and staged by the copy engine; lost or damaged files cost a recompute, never a wrong edit."""

import pytest
import torch
from PIL import Image, ImageDraw

from retouch import load
from retouch.cache import CacheStore, StoreConfig

STEPS = 2
LATENT_ATOL = 1e-5  # as tests/test_editor.py: fp32, summation order only


def template_image(color=(40, 120, 200)) -> Image.Image:
    image = Image.new("RGB", (128, 128), color)
    ImageDraw.Draw(image).ellipse((20, 30, 90, 100), fill=(230, 200, 60))
    return image


def square_mask(box=(16, 40, 79, 95)) -> Image.Image:
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", params=[("tiny-flux-fill", "y"), ("tiny-flux-fill", "kv"), ("tiny-sd3-inpaint", "kv"),
                                        ("tiny-sdxl-inpaint", "y")], ids=lambda p: "-".join(p))
def disk_editor(request, tmp_path_factory):
    model, mode = request.param
    store = CacheStore(StoreConfig(host_bytes=64 << 20, disk_dir=tmp_path_factory.mktemp("disk"), disk_bytes=256 << 20))
    return load(model, cache=store, cache_mode=mode)


def register_replay_template(editor) -> str:
    return editor.register_template(template_image(), prompt="a red hat", steps=STEPS, seed=4, mask=square_mask())


def test_replay_identity_through_host_arena_and_disk(disk_editor):
    template_id = register_replay_template(disk_editor)
    store = disk_editor.cache
    assert store.evict(template_id) and store.disk.contains(template_id)
    disk_hits = store.metrics()["disk_hits"]
    mask_aware = disk_editor.edit(template_id, square_mask(), "a red hat", seed=4, output_type="latent")
    assert store.metrics()["disk_hits"] == disk_hits + 1  # the edit read it back from disk
    full = disk_editor.edit(template_id, square_mask(), "a red hat", seed=4, output_type="latent",
                            full_compute=True)
    assert max_diff(mask_aware, full) <= LATENT_ATOL
    assert disk_editor.copy_engine.stats.bytes > 0  # the rows came through the copy engine


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "missing"])
def test_a_damaged_cache_file_costs_a_recompute_and_the_edit_is_still_right(disk_editor, damage):
    template_id = disk_editor.register_template(template_image((90, 30, 160)), prompt="a scene", steps=STEPS, seed=1)
    mask = square_mask((40, 40, 90, 90))
    expected = disk_editor.edit(template_id, mask, "a blue hat", seed=2, output_type="latent")
    store = disk_editor.cache
    assert store.evict(template_id)
    path = store.disk.path(template_id)
    raw = bytearray(path.read_bytes())
    if damage == "corrupt":
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(bytes(raw[: len(raw) - 4096]))
    else:
        path.unlink()
    recomputes = disk_editor.recomputes
    edited = disk_editor.edit(template_id, mask, "a blue hat", seed=2, output_type="latent")
    assert disk_editor.recomputes == recomputes + 1
    assert max_diff(edited, expected) <= LATENT_ATOL  # the recorded activations are recomputed exactly
    corrupt = store.metrics()["corrupt_files"]
    assert corrupt >= (0 if damage == "missing" else 1)
