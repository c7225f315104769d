"""Per-request LoRA through the step loop: from step 0 it equals diffusers' own `load_lora_weights` (every
family, small random PEFT LoRAs saved in the real file format); a batch mixing adapter A, adapter B and none
gives each request what it gets alone; a LoRA still loading lets its request run its first steps without it
and applies from the first step after the load, waiting at the latest step; a broken file fails its request
only; the host cache keeps the most recently used adapters within its budget. The loop runs on the test's
thread, as in test_engine.py; loads are gated by events, never by sleeps."""

import gc
import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from editor_inputs import max_diff, square_mask, template_image
from lora_files import save_random_lora
from loop_runs import run_loop

from retouch.cache.staging import CopyEngine
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.worker import EngineConfig, Worker
from retouch.lora import LoraError, LoraUse
from retouch.lora.files import LoraModule, LoraWeights
from retouch.lora.host_cache import LoraHostCache
from retouch.models import load_pipeline

TINY_MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
BATCH_ATOL = 1e-5  # fp32: a request's rows in a bigger batch differ only in summation order


def bound(reference: torch.Tensor, ulps: int = 32) -> float:
    """fp32 summation-order differences at the values' scale (as test_mixed_sizes.py)."""
    return max(BATCH_ATOL, ulps * torch.finfo(torch.float32).eps * reference.abs().max().item())


def edit_job(template_id, lora=(), box=(32, 32, 63, 63), seed=5):
    return Worker.new_job(EditRequest(template_id, square_mask(box), "a red hat", seed=seed), lora=lora)


def latents(job):
    assert job.future.exception() is None, job.future.exception()
    return job.row.latents[0]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loras")


@pytest.mark.parametrize("model", TINY_MODELS)
def test_a_lora_from_step_0_equals_diffusers_load_lora_weights(model, lora_dir):
    """With text-encoder parts too (every CLIP encoder the pipeline has), as --train_text_encoder writes them."""
    editor = MaskAwareEditor(load_pipeline(model))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    save_random_lora(editor.model, lora_dir / model, rank=4, alpha=8, seed=1, text_encoders=True)
    save_random_lora(editor.model, lora_dir / f"{model}-denoiser", rank=4, alpha=8, seed=1)  # the same, without
    config = EngineConfig(mode="naive", lora_dir=str(lora_dir), lora_latest_step=0.0)
    job = edit_job(template_id, lora=(LoraUse(model, 0.7),))
    worker = run_loop(editor, config, [job])
    assert job.metrics.lora_applied_step == 0 and worker.loras.metrics()["loads"] == 1
    assert worker.text_encoder_loras.reads == 1

    # diffusers' own loading into a second copy of the pipeline, whose template is recorded before it.
    reference = MaskAwareEditor(load_pipeline(model))
    assert reference.register_template(template_image(), prompt="a scene", steps=3, seed=3) == template_id
    base = reference.edit_many([job.request], output_type="latent")[0]
    expected = {}
    for name in (model, f"{model}-denoiser"):
        reference.pipe.load_lora_weights(str(lora_dir / name), adapter_name="x")
        reference.pipe.set_adapters(["x"], [0.7])
        expected[name] = reference.edit_many([job.request], output_type="latent")[0]
        reference.pipe.unload_lora_weights()
    assert max_diff(latents(job), expected[model]) < bound(expected[model], 256)
    assert max_diff(expected[model], base) > 100 * bound(expected[model], 256)  # the LoRA changes the edit
    # and so does its text-encoder part alone
    assert max_diff(expected[model], expected[f"{model}-denoiser"]) > 100 * bound(expected[model], 256)


@pytest.fixture(scope="module")
def flux(lora_dir):
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"))
    ids = [editor.register_template(template_image(color), prompt="a scene", steps=4, seed=i)
           for i, color in enumerate(((40, 120, 200), (200, 90, 30), (10, 200, 90)))]
    save_random_lora(editor.model, lora_dir / "A", rank=4, alpha=8, seed=11)
    save_random_lora(editor.model, lora_dir / "B", rank=16, alpha=16, seed=12, targets=["to_k", "to_out.0",
                                                                                         "proj_mlp"])
    return editor, ids


def config_of(lora_dir, latest=0.0, **options):
    return EngineConfig(mode="naive", lora_dir=str(lora_dir), lora_latest_step=latest, **options)


def test_a_batch_mixing_lora_a_lora_b_and_none_equals_each_alone(flux, lora_dir):
    editor, ids = flux
    choices = [(LoraUse("A", 1.0),), (LoraUse("B", 0.6),), (), (LoraUse("A", 0.5), LoraUse("B", 1.0))]
    boxes = [(32, 32, 63, 63), (0, 40, 95, 79), (8, 8, 40, 30), (64, 64, 127, 127)]
    jobs = [edit_job(ids[i % 3], lora, box, seed=i) for i, (lora, box) in enumerate(zip(choices, boxes))]
    worker = run_loop(editor, config_of(lora_dir), jobs)
    assert max(worker.metrics.batch_sizes) == 4  # one forward per step held all four
    for i, (lora, box) in enumerate(zip(choices, boxes)):
        alone = edit_job(ids[i % 3], lora, box, seed=i)
        run_loop(editor, config_of(lora_dir), [alone])
        assert max_diff(latents(jobs[i]), latents(alone)) < bound(latents(alone))
    assert max_diff(latents(jobs[0]), latents(jobs[2])) > 1e-3


def test_an_ambiguous_batch_runs_in_halves_with_the_same_results(flux, lora_dir, monkeypatch):
    editor, ids = flux
    # Copies two cached blocks ahead: the later blocks' copies wait on compute reaching a gate, so a batch
    # refused before its forward must end them, or they hold the copy thread and the halves never run.
    monkeypatch.setattr(editor, "copy_engine", CopyEngine("cpu", lookahead=2))
    choices = [(LoraUse("A", 1.0),), (), (LoraUse("B", 1.0),), ()]
    jobs = [edit_job(ids[i % 3], lora, seed=i) for i, lora in enumerate(choices)]
    calls = []
    row_layouts = type(editor.adapter).row_layouts

    def colliding(self, context):  # a layout of 4 rows split unlike one row per request
        layouts = row_layouts(self, context)
        calls.append(context.batch.batch_size)
        return layouts + [(4,) + (0,) * (context.batch.batch_size - 1)] if context.batch.batch_size == 4 else layouts

    monkeypatch.setattr(type(editor.adapter), "row_layouts", colliding)
    loop = threading.Thread(target=run_loop, args=(editor, config_of(lora_dir), jobs), daemon=True)
    loop.start()
    loop.join(timeout=120)  # a guard against a hang, not a wait for state: the loop ends on its own
    assert not loop.is_alive(), "the step loop hung after refusing an ambiguous batch"
    assert editor.copy_engine.stats.blocks > 0  # the gated engine staged the edits' rows
    monkeypatch.undo()
    assert 4 in calls and 2 in calls  # refused at four, run as two halves
    for i, lora in enumerate(choices):
        alone = edit_job(ids[i % 3], lora, seed=i)
        run_loop(editor, config_of(lora_dir), [alone])
        assert max_diff(latents(jobs[i]), latents(alone)) < bound(latents(alone))


class GatedLoads:
    """Holds every adapter read until `open()`: the test decides at which step a load completes."""

    def __init__(self, monkeypatch):
        from retouch.lora import manager
        self.gate = threading.Event()
        read = manager.read_lora

        def gated(*args, **kwargs):
            self.gate.wait(timeout=60)
            return read(*args, **kwargs)

        monkeypatch.setattr(manager, "read_lora", gated)

    def open(self):
        self.gate.set()


def test_a_lora_still_loading_applies_from_the_first_step_after_its_load(flux, lora_dir, monkeypatch):
    editor, ids = flux
    gate = GatedLoads(monkeypatch)
    job = edit_job(ids[0], (LoraUse("A", 1.0),))
    plain = edit_job(ids[0])
    run_loop(editor, config_of(lora_dir), [plain])
    loaded = threading.Event()

    def inject(worker, steps_run):
        if steps_run == 2:  # after two steps without it, the load completes
            gate.open()
            worker.loras.wait(job.lora_loads, timeout_s=60)
            loaded.set()

    run_loop(editor, config_of(lora_dir, latest=1.0), [job], inject)
    assert loaded.is_set() and job.metrics.lora_applied_step == 2
    from_start = edit_job(ids[0], (LoraUse("A", 1.0),))
    run_loop(editor, config_of(lora_dir), [from_start])
    assert from_start.metrics.lora_applied_step == 0
    late, early, none = latents(job), latents(from_start), latents(plain)
    assert max_diff(late, early) > 1e-4 and max_diff(late, none) > 1e-4  # two steps without, two with


def test_a_request_waits_at_its_latest_step_while_others_go_on(flux, lora_dir, monkeypatch):
    editor, ids = flux
    gate = GatedLoads(monkeypatch)
    job = edit_job(ids[0], (LoraUse("B", 1.0),))
    other = edit_job(ids[1])
    seen = []

    def inject(worker, steps_run):
        seen.append((job.metrics.steps, other.metrics.steps))
        if other.row.schedule.done:
            gate.open()

    # latest 0.5 of 4 steps: it runs steps 0 and 1 without its LoRA, then waits at step 2.
    run_loop(editor, config_of(lora_dir, latest=0.5), [job, other], inject)
    assert seen[:4] == [(1, 1), (2, 2), (2, 3), (2, 4)]
    assert job.metrics.lora_applied_step == 2 and job.metrics.steps == 4
    assert job.future.result().metrics.to_json()["lora_applied_step"] == 2


def test_a_broken_adapter_fails_its_request_only(flux, lora_dir):
    """A file that is no safetensors fails as its prompt is encoded (its header is read for a text-encoder
    part); one whose factors are NaN fails in the loader, while its request denoises."""
    editor, ids = flux
    (lora_dir / "broken.safetensors").write_bytes(b"not a safetensors file")
    tensors = load_file(lora_dir / "A" / "pytorch_lora_weights.safetensors")
    name = next(key for key in tensors if "lora_A" in key)
    save_file({**tensors, name: tensors[name].clone().fill_(float("nan"))}, lora_dir / "nan.safetensors")
    broken, nan, good = (edit_job(ids[i], (LoraUse(name),)) for i, name in enumerate(("broken", "nan", "A")))
    worker = run_loop(editor, config_of(lora_dir, latest=0.5), [broken, nan, good])
    assert "not a readable safetensors file" in str(broken.future.exception())
    assert isinstance(nan.future.exception(), LoraError) and "NaN" in str(nan.future.exception())
    assert good.future.exception() is None and good.metrics.lora_applied_step is not None
    assert worker.loras.metrics()["load_failures"] == 1
    (lora_dir / "nan.safetensors").unlink()


def test_a_forgotten_adapter_is_freed_while_the_loader_waits(flux, lora_dir):
    """Once the caches let an adapter go, nothing holds its memory: not the loader thread idling between loads
    (its last load once stayed referenced from the loop's locals; on a GPU, an evicted adapter's memory)."""
    editor, _ = flux
    manager = Worker(editor, config_of(lora_dir)).loras
    try:
        (future,) = manager.acquire((LoraUse("A"),))
        loaded = weakref.ref(future.result().weights)
        del future
        manager._queue.join()  # the loader is back waiting for the next name
        manager.clear()
        gc.collect()
        assert manager._thread.is_alive()
        assert loaded() is None
    finally:
        manager.close()


def test_a_failed_read_keeps_none_of_the_file(flux, lora_dir):
    """A file refused after it was read (NaN factors) gives its memory back at once: the failure kept for its
    next lookup is a message, not an exception whose traceback holds the read's frames (once, every broken
    file stayed in memory for the worker's life)."""
    editor, _ = flux
    tensors = load_file(lora_dir / "A" / "pytorch_lora_weights.safetensors")
    name = next(key for key in tensors if "lora_A" in key)
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, lora_dir / "poisoned.safetensors")
    manager = Worker(editor, config_of(lora_dir)).loras
    try:
        (first,) = manager.acquire((LoraUse("poisoned"),))
        assert "NaN" in str(first.exception(timeout=60))
        manager._queue.join()
        gc.collect()
        assert manager.memory.used == 0
        (again,) = manager.acquire((LoraUse("poisoned"),))
        assert "NaN" in str(again.exception(timeout=0)) and manager.metrics()["loads"] == 0
    finally:
        manager.close()
        (lora_dir / "poisoned.safetensors").unlink()


def test_a_checkpoint_in_the_lora_folder_is_refused_from_its_header(flux, lora_dir, monkeypatch):
    """A file without LoRA factors (a model checkpoint put in the folder by mistake: 23 GB for Flux) is
    refused before any of its data is read or memory of its size is taken."""
    editor, _ = flux
    save_file({"transformer.x_embedder.weight": torch.zeros(64, 16)}, lora_dir / "checkpoint.safetensors")
    asked = []
    manager = Worker(editor, config_of(lora_dir)).loras
    monkeypatch.setattr(manager.memory, "block", lambda nbytes, pinned: asked.append(nbytes))
    try:
        (future,) = manager.acquire((LoraUse("checkpoint"),))
        assert "holds no LoRA factors" in str(future.exception(timeout=60)) and asked == []
    finally:
        manager.close()
        (lora_dir / "checkpoint.safetensors").unlink()


def test_resident_names_the_adapters_that_need_no_file_read(flux, lora_dir):
    """What the heartbeat tells the router (LoRA affinity): loaded adapters, until the caches forget them."""
    editor, _ = flux
    manager = Worker(editor, config_of(lora_dir)).loras
    try:
        assert manager.resident() == []
        for future in manager.acquire((LoraUse("B"), LoraUse("A"))):
            future.result(timeout=60)
        assert manager.resident() == ["A", "B"]
        # with their files' digests, which the router compares across workers
        digests = manager.digests()
        assert sorted(digests) == ["A", "B"] and digests["A"] != digests["B"]
        assert digests["A"] == manager.acquire((LoraUse("A"),))[0].result(timeout=60).weights.digest
        assert (manager.metrics()["hits"], manager.metrics()["misses"]) == (0, 2)
        manager.prefetch((LoraUse("A"),))  # a request's lookup (at submission): on the device, a hit, no read
        manager.acquire((LoraUse("A"),))[0].result(timeout=60)  # its admission: not counted again
        assert (manager.metrics()["hits"], manager.metrics()["misses"], manager.metrics()["loads"]) == (1, 2, 2)
        manager.clear()
        assert manager.resident() == [] and manager.digests() == {}
    finally:
        manager.close()


def test_a_broken_file_is_read_once_until_it_changes(flux, lora_dir):
    """Submission and admission both ask for a request's adapters: a broken file fails both from one read,
    and a fixed file (the operator replaced it) loads."""
    editor, _ = flux
    path = lora_dir / "fixable.safetensors"
    path.write_bytes(b"not a safetensors file")
    manager = Worker(editor, config_of(lora_dir)).loras
    try:
        first = manager.acquire((LoraUse("fixable"),))[0]
        assert isinstance(first.exception(timeout=60), LoraError)
        again = manager.acquire((LoraUse("fixable"),))[0]
        assert str(again.exception(timeout=0)) == str(first.exception())  # at once, from the one read
        assert manager.metrics()["load_failures"] == 1 and manager.metrics()["misses"] == 1
        path.write_bytes((lora_dir / "A" / "pytorch_lora_weights.safetensors").read_bytes())  # the flux fixture's
        fixed = manager.acquire((LoraUse("fixable"),))[0]
        assert fixed.result(timeout=60).weights.name == "fixable"
        assert manager.metrics()["load_failures"] == 1
    finally:
        manager.close()
        path.unlink()


def test_unknown_names_and_no_folder_are_refused_at_submission(flux, lora_dir):
    editor, _ = flux
    with pytest.raises(LoraError, match="nope") as unknown:
        Worker(editor, config_of(lora_dir)).loras.check((LoraUse("nope"),))
    assert str(lora_dir) not in str(unknown.value)  # a worker answers 422 with it: clients see no folders
    with pytest.raises(LoraError, match="--lora-dir"):
        Worker(editor, EngineConfig(mode="naive")).loras.check((LoraUse("A"),))


def weights(name, nbytes):
    A = torch.zeros(nbytes // 8, 1)
    return LoraWeights(name, {"m": LoraModule(A.T.contiguous(), A.clone(), 1.0)})


def test_the_host_cache_keeps_the_most_recently_used_within_its_budget():
    cache = LoraHostCache(1000)
    for name in "abc":
        assert cache.put(name, weights(name, 400))  # 400 bytes each: two fit
    assert "a" not in cache and "b" in cache and "c" in cache and cache.nbytes == 800
    assert cache.get("b") is not None  # b is now the most recent
    cache.put("d", weights("d", 400))
    assert "c" not in cache and "b" in cache and "d" in cache
    assert not cache.put("huge", weights("huge", 4000)) and "huge" not in cache
    assert (cache.hits, cache.misses, cache.evictions) == (1, 0, 2)
    assert cache.get("a") is None and cache.misses == 1

