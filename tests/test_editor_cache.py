"""The editor on the cache engine: templates recorded into the host arena, evicted to disk, loaded back
and staged by the copy engine; lost or damaged files cost a recompute, never a wrong edit."""

import threading

import pytest
import torch
from editor_inputs import LATENT_ATOL, max_diff, square_mask, template_image

from retouch import load
from retouch.cache import CacheStore, StoreConfig
from retouch.cache.staging import CopyEngine

STEPS = 2
REPLAY_MASK = (16, 40, 79, 95)


@pytest.fixture(scope="module", params=[("tiny-flux-fill", "y"), ("tiny-flux-fill", "kv"), ("tiny-sd3-inpaint", "kv"),
                                        ("tiny-sdxl-inpaint", "y")], ids=lambda p: "-".join(p))
def disk_editor(request, tmp_path_factory):
    model, mode = request.param
    store = CacheStore(StoreConfig(host_bytes=64 << 20, disk_dir=tmp_path_factory.mktemp("disk"), disk_bytes=256 << 20))
    return load(model, cache=store, cache_mode=mode)


def register_replay_template(editor) -> str:
    return editor.register_template(template_image(), prompt="a red hat", steps=STEPS, seed=4,
                                    mask=square_mask(REPLAY_MASK))


def test_replay_identity_through_host_arena_and_disk(disk_editor):
    template_id = register_replay_template(disk_editor)
    store = disk_editor.cache
    assert store.evict(template_id) and store.disk.contains(template_id)
    disk_hits = store.metrics()["disk_hits"]
    mask_aware = disk_editor.edit(template_id, square_mask(REPLAY_MASK), "a red hat", seed=4, output_type="latent")
    assert store.metrics()["disk_hits"] == disk_hits + 1  # the edit read it back from disk
    full = disk_editor.edit(template_id, square_mask(REPLAY_MASK), "a red hat", seed=4, output_type="latent",
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


def synthetic_cost_model(editor, load_seconds_per_byte: float):
    """Every block costs 1 ms in full and 0.3 ms cached; loads cost `load_seconds_per_byte`."""
    from retouch.costs import FEATURES, CostModel, LinearModel

    kinds = tuple(f"k{i}" for i in range(editor.adapter.num_blocks)) if not editor.is_unet else \
        tuple(f"level{level}" for level in editor.adapter.block_levels)
    full = LinearModel(FEATURES, (0.0,) * 4, 1e-3, 1.0, 10)
    cached = LinearModel(FEATURES, (0.0,) * 4, 3e-4, 1.0, 10)
    return CostModel(model=editor.model.name, device="cpu", dtype="float32", block_kinds=kinds,
                     compute={k: {"full": full, "y": cached, "kv": cached} for k in set(kinds)},
                     row_bytes={k: {"out": 64, "k": 64, "v": 64} for k in set(kinds)},
                     load=LinearModel(("bytes",), (load_seconds_per_byte,), 0.0, 1.0, 4))


def test_the_planner_chooses_per_block_and_the_edit_follows_the_plan(disk_editor):
    template_id = register_replay_template(disk_editor)
    mask = square_mask((0, 0, 63, 63))
    reference = disk_editor.edit(template_id, mask, "a cat", seed=3, output_type="latent", full_compute=True)
    try:
        disk_editor.cost_model = synthetic_cost_model(disk_editor, load_seconds_per_byte=1.0)  # loads hopeless
        copied = disk_editor.copy_engine.stats.bytes
        planned = disk_editor.edit(template_id, mask, "a cat", seed=3, output_type="latent")
        assert disk_editor.last_plan.use_cache == (False,) * disk_editor.adapter.num_blocks
        assert disk_editor.copy_engine.stats.bytes == copied  # an all-full plan loads nothing
        assert max_diff(planned, reference) == 0.0  # and is the unmodified computation
        disk_editor.cost_model = synthetic_cost_model(disk_editor, load_seconds_per_byte=0.0)  # loads free
        disk_editor.edit(template_id, mask, "a cat", seed=3, output_type="latent")
        assert all(disk_editor.last_plan.use_cache)
        assert disk_editor.copy_engine.stats.bytes > copied
    finally:
        disk_editor.cost_model = None


def test_a_restarted_editor_adopts_the_recordings_its_disk_tier_kept(tmp_path):
    """A worker that restarts on the same disk folder finds its templates there: registering one again
    reads its file's header instead of recording it, and its edits are the earlier process's, bit for
    bit. Other weights under the same model name, or a recording that lacks what the cache mode reads,
    are recorded again."""
    stores = []

    def editor(mode: str = "y", storage: str = "auto"):
        """A worker process on the folder: the one before it has stopped (a disk tier is one process's)."""
        for earlier in stores:
            earlier.close()
        store = CacheStore(StoreConfig(host_bytes=64 << 20, disk_dir=tmp_path / "disk", disk_bytes=256 << 20,
                                       dtype=storage))
        stores.append(store)
        return load("tiny-flux-fill", cache=store, cache_mode=mode)

    mask = square_mask((40, 40, 90, 90))
    first = editor()
    template_id = register_replay_template(first)
    expected = first.edit(template_id, mask, "a blue hat", seed=2, output_type="latent")
    assert first.cache.evict(template_id)
    first.cache.close()

    restarted = editor()
    assert register_replay_template(restarted) == template_id
    assert restarted.cache.metrics()["registrations"] == 0  # adopted, not recorded
    assert restarted.cache.metrics()["adoptions"] == 1 and first.cache.metrics()["adoptions"] == 0
    assert max_diff(restarted.edit(template_id, mask, "a blue hat", seed=2, output_type="latent"), expected) == 0.0
    assert restarted.cache.metrics()["disk_hits"] == 1 and restarted.recomputes == 0
    restarted.cache.evict(template_id)

    kv = editor("kv")  # a Y-cache recording holds no keys and values
    register_replay_template(kv)
    assert kv.cache.metrics()["registrations"] == 1 and kv.cache.metrics()["adoptions"] == 0
    assert kv.cache.evict(template_id)  # its file now holds a KV-cache recording
    kv.cache.close()

    assert editor("kv").adopt(kv.templates[template_id])  # the same weights would adopt it
    assert not editor("kv", storage="float16").adopt(kv.templates[template_id])  # auto is lossless, fp16 not
    retrained = editor("kv")
    with torch.no_grad():
        next(retrained.denoiser.parameters()).add_(1e-3)
    assert not retrained.adopt(kv.templates[template_id])
    other_vae = editor("kv")
    with torch.no_grad():
        next(other_vae.pipe.vae.parameters()).add_(1e-3)  # other latents under the same name
    assert not other_vae.adopt(kv.templates[template_id])
    register_replay_template(other_vae)
    assert other_vae.cache.metrics()["registrations"] == 1
    stores[-1].close()


def test_a_forward_refused_before_its_first_block_ends_its_staged_copies(monkeypatch):
    """The copy engine starts a forward's copies before the forward; copies two blocks ahead wait on
    compute reaching a gate. A forward refused at its start must end them: on the CPU a gated copy would
    hold the copy thread, and every later edit of the editor would wait for it forever."""
    editor = load("tiny-flux-fill", cache=CacheStore(StoreConfig(host_bytes=64 << 20)),
                  copy_engine=CopyEngine("cpu", lookahead=2))
    template_id = register_replay_template(editor)
    check_context = type(editor.adapter).check_context

    def refuse_once(adapter, context):
        monkeypatch.setattr(type(editor.adapter), "check_context", check_context)
        raise RuntimeError("refused at the start of the forward")

    monkeypatch.setattr(type(editor.adapter), "check_context", refuse_once)
    with pytest.raises(RuntimeError, match="refused at the start"):
        editor.edit(template_id, square_mask(REPLAY_MASK), "a red hat", seed=4)
    staged_blocks = editor.copy_engine.stats.blocks
    done = []
    edit = threading.Thread(target=lambda: done.append(editor.edit(template_id, square_mask(REPLAY_MASK), "a red hat",
                                                                   seed=4, output_type="latent")), daemon=True)
    edit.start()
    edit.join(timeout=120)  # a guard against a hang, not a wait for state: the edit ends on its own
    assert not edit.is_alive(), "the next edit hung behind the refused forward's copies"
    assert done and editor.copy_engine.stats.blocks > staged_blocks  # it ran, on staged rows
    full = editor.edit(template_id, square_mask(REPLAY_MASK), "a red hat", seed=4, output_type="latent",
                       full_compute=True)
    assert max_diff(done[0], full) < LATENT_ATOL  # the replay identity holds after the refusal
