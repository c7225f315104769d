"""The step loop: continuous batching gives each request the result it gets alone, requests join within
one step, static batching never admits into a running batch, and every batching mode answers every
request. The loop runs on the test's thread (`Worker.run` returns once stopped and drained), so the
order of events is deterministic; the disaggregated mode runs its real helper process."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from editor_inputs import max_diff, square_mask, template_image
from loop_runs import run_loop

from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine import recipes
from retouch.engine.api import Engine
from retouch.engine.worker import EngineConfig, MissingTemplate, Worker
from retouch.errors import InputError
from retouch.models import load_pipeline

TINY_MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
BATCH_ATOL = 1e-5  # fp32: a request's rows in a bigger batch differ only in summation order


@pytest.fixture(scope="module")
def flux_editor():
    return MaskAwareEditor(load_pipeline("tiny-flux-fill"))


def run(editor, config: EngineConfig, requests, inject=None, send_to_postprocess=None):
    """The loop over `requests` (`loop_runs.run_loop`) -> (worker, their jobs)."""
    jobs = [Worker.new_job(r) for r in requests]
    return run_loop(editor, config, jobs, inject, send_to_postprocess), jobs


def final_latents(job) -> torch.Tensor:
    return job.row.latents[0]


@pytest.mark.parametrize("model", TINY_MODELS)
def test_one_request_through_the_loop_equals_the_pipeline_driven_edit(model):
    """The recipe repeats the stock pipeline's loop body: same latents, bit for bit, same image."""
    editor = MaskAwareEditor(load_pipeline(model))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
    expected = editor.edit_many([request], output_type="latent")[0]
    expected_image = editor.edit(template_id, square_mask(), "a red hat", seed=5)
    worker, (job,) = run(editor, EngineConfig(mode="naive"), [request])
    assert torch.equal(final_latents(job), expected)
    assert job.future.result().image.tobytes() == expected_image.tobytes()
    # One loop step per denoiser call of the pipeline (PNDM without PRK makes one more than `steps`).
    assert job.metrics.steps == job.row.schedule.num_steps == (4 if model == "tiny-sd2-inpaint" else 3)
    assert worker.metrics.completed == 1


def test_a_request_joining_mid_way_equals_it_run_alone_and_joins_within_one_step(flux_editor):
    long_id = flux_editor.register_template(template_image(), prompt="a scene", steps=6, seed=1)
    short_id = flux_editor.register_template(template_image((200, 90, 30)), prompt="a room", steps=4, seed=2)
    joiner = EditRequest(short_id, square_mask((16, 48, 79, 95)), "a blue door", seed=7)
    _, (alone,) = run(flux_editor, EngineConfig(mode="naive"), [joiner])
    late = Worker.new_job(joiner)
    arrived_after = []

    def inject(worker, steps_run):
        if steps_run == 2:
            worker.inbox.put(("edit", late))
            arrived_after.append(steps_run)

    worker, (first,) = run(flux_editor, EngineConfig(mode="naive"),
                           [EditRequest(long_id, square_mask(), "a red hat", seed=5)], inject)
    assert late.metrics.admitted_step == arrived_after[0]  # the very next step
    assert max_diff(final_latents(late), final_latents(alone)) <= BATCH_ATOL
    assert list(worker.metrics.batch_sizes)[:3] == [1, 1, 2]
    assert first.metrics.steps == 6 and late.metrics.steps == 4


def test_requests_with_different_steps_and_masks_finish_correctly_together(flux_editor):
    ids = [flux_editor.register_template(template_image(color), prompt="a scene", steps=steps, seed=seed)
           for color, steps, seed in (((40, 120, 200), 3, 0), ((10, 200, 90), 5, 1), ((90, 20, 160), 2, 4))]
    requests = [EditRequest(ids[0], square_mask((0, 0, 47, 31)), "a hat", seed=1),
                EditRequest(ids[1], square_mask((64, 64, 127, 127)), "a cat", seed=2),
                EditRequest(ids[2], square_mask((16, 80, 111, 111)), "a dog", seed=3),
                EditRequest(ids[1], square_mask((0, 64, 31, 127)), "a lamp", seed=4)]
    worker, jobs = run(flux_editor, EngineConfig(mode="naive", max_batch=8), requests)
    assert list(worker.metrics.batch_sizes) == [4, 4, 3, 2, 2]
    for request, job in zip(requests, jobs):
        expected = flux_editor.edit_many([request], output_type="latent")[0]
        assert max_diff(final_latents(job), expected) <= BATCH_ATOL
        assert job.metrics.steps == flux_editor.templates[request.template_id].steps


def test_static_batching_never_admits_into_a_running_batch(flux_editor):
    long_id = flux_editor.register_template(template_image(), prompt="a scene", steps=4, seed=1)
    short_id = flux_editor.register_template(template_image((200, 90, 30)), prompt="a room", steps=2, seed=2)
    late = [Worker.new_job(EditRequest(short_id, square_mask(), "a late cat", seed=s)) for s in range(2)]

    def inject(worker, steps_run):
        if steps_run == 1:
            for job in late:
                worker.inbox.put(("edit", job))

    requests = [EditRequest(long_id, square_mask(), "a hat", seed=1), EditRequest(short_id, square_mask(), "a cup")]
    worker, first = run(flux_editor, EngineConfig(mode="static", max_batch=4), requests, inject)
    # The first batch shrinks as requests finish (2 steps, then 4) and only then do the late ones join.
    assert list(worker.metrics.batch_sizes) == [2, 2, 1, 1, 2, 2]
    assert all(job.metrics.admitted_step == 4 for job in late)
    assert worker.metrics.interruptions == 1  # the short request's inline post-processing held up the long one
    # The same arrivals in continuous batching join at once.
    late[:] = [Worker.new_job(job.request) for job in late]
    worker, _ = run(flux_editor, EngineConfig(mode="naive", max_batch=4), requests, inject)
    assert all(job.metrics.admitted_step == 1 for job in late)
    # Inline work while others wait mid-denoising: the late ones' pre-processing (2), and the post-processing
    # of the short request and of both late ones, each finishing before the long request (3).
    assert worker.metrics.interruptions == 5


def test_max_batch_bounds_every_step(flux_editor):
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=2, seed=1)
    requests = [EditRequest(template_id, square_mask(), f"thing {i}", seed=i) for i in range(5)]
    worker, jobs = run(flux_editor, EngineConfig(mode="naive", max_batch=2), requests)
    assert max(worker.metrics.batch_sizes) == 2 and all(job.future.result().image for job in jobs)


def test_a_failing_request_is_answered_with_its_error_and_the_others_complete(flux_editor):
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=2, seed=1)
    doomed = flux_editor.register_template(template_image((1, 2, 3)), prompt="a scene", steps=2, seed=1)
    requests = [EditRequest(template_id, square_mask(), "a hat"), EditRequest(doomed, square_mask(), "a hat")]
    flux_editor.drop_template(doomed)  # between submission and pre-processing
    worker, (ok, failed) = run(flux_editor, EngineConfig(mode="naive"), requests)
    assert ok.future.result().image.size == (128, 128)
    # what the router answers 404 template_deleted (or runs again where it is registered anew), as the
    # disaggregated mode's helpers say it
    with pytest.raises(MissingTemplate, match="dropped before the edit ran"):
        failed.future.result()
    assert worker.metrics.failed == 1 and worker.metrics.completed == 1


def test_prepared_edits_survive_the_wire():
    editor = MaskAwareEditor(load_pipeline("tiny-sd3-inpaint"))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=2, seed=3, guidance=4.5)
    from retouch.engine import processing, wire

    request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
    template = editor.templates[template_id]
    ready = processing.preprocess(editor, request, template)
    header, tensors, blobs = wire.decode(processing.ready_message(3, ready))
    back = processing.ready_from_message(header, tensors, blobs, template)
    assert back.prepared.guidance == 4.5 and back.prepared.copies == 2
    original, received = ready.prepared.tensors(), back.prepared.tensors()
    assert original.keys() == received.keys()
    assert all(torch.equal(original[k], received[k]) for k in original)
    assert torch.equal(back.inputs.masked_idx, ready.inputs.masked_idx)
    assert back.inputs.mask.tobytes() == ready.inputs.mask.tobytes()


def test_the_disaggregated_engine_gives_the_inline_result_with_no_interruptions():
    """End to end through a real helper process: pre-processing, the loop, post-processing; closing
    the engine answers every request it accepted, including those still in the helper. The template's
    colour profile goes to the helper and back with its pixels: every answer carries it."""
    from test_images import rgb_profile

    tagged, profile = template_image(), rgb_profile()
    tagged.info["icc_profile"] = profile
    with Engine.load("tiny-flux-fill", EngineConfig(mode="disagg", max_batch=4)) as engine:
        template_id = engine.register_template(tagged, prompt="a scene", steps=3, seed=3)
        requests = [EditRequest(template_id, square_mask((16 * i, 16, 16 * i + 31, 47)), "a hat", seed=i)
                    for i in range(7)]
        results = [engine.submit(r).result(timeout=300) for r in requests[:5]]
        with pytest.raises(InputError, match="unknown template"):
            engine.submit(EditRequest("0" * 16, square_mask(), "a hat"))
        with pytest.raises(InputError, match="prompt is empty"):
            engine.submit(EditRequest(template_id, square_mask(), "  "))
        with pytest.raises(InputError, match="recorded with 3 steps"):
            engine.submit(EditRequest(template_id, square_mask(), "a hat", steps=5))
        with pytest.raises(InputError, match="mask is 64x64 but image is 128x128"):
            engine.submit(EditRequest(template_id, square_mask().resize((64, 64)), "a hat"))
        in_flight = [engine.submit(r) for r in requests[5:]]  # still being pre-processed at close
    assert all(future.done() for future in in_flight)
    results += [future.result() for future in in_flight]
    metrics = engine.metrics()
    assert metrics["interruptions"] == 0 and metrics["completed"] == 7
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit(requests[0])
    for request, result in zip(requests, results):
        image = engine.editor.edit(request.template_id, request.mask, request.prompt, request.seed)
        # Batched rows and the helper's single-threaded encoders sum in another order: 8-bit rounding may differ.
        difference = np.abs(np.asarray(result.image, dtype=int) - np.asarray(image, dtype=int))
        assert difference.max() <= 2
        assert result.metrics.e2e_s >= result.metrics.inference_s > 0
        assert result.image.info.get("icc_profile") == image.info["icc_profile"] == profile


def test_batch_rows_follow_the_pipeline_order_for_guidance():
    """[uncond of every request; cond of every request]: the order the pipelines and the cache use."""
    editor = MaskAwareEditor(load_pipeline("tiny-sd3-inpaint"))
    ids = [editor.register_template(template_image(c), prompt="a scene", steps=2, seed=3, guidance=g)
           for c, g in (((40, 120, 200), 3.0), ((200, 10, 10), 6.0))]
    requests = [EditRequest(ids[0], square_mask(), "a hat", seed=1), EditRequest(ids[1], square_mask(), "a cat")]
    worker, jobs = run(editor, EngineConfig(mode="naive"), requests)
    for request, job in zip(requests, jobs):
        assert max_diff(final_latents(job), editor.edit_many([request], output_type="latent")[0]) <= BATCH_ATOL
    prepared = [job.ready.prepared for job in jobs]
    rows = recipes._rows(prepared, "encoder_hidden_states")
    assert torch.equal(rows[0], prepared[0].inputs["encoder_hidden_states"][0])
    assert torch.equal(rows[1], prepared[1].inputs["encoder_hidden_states"][0])
    assert torch.equal(rows[2], prepared[0].inputs["encoder_hidden_states"][1])


def test_helpers_build_the_model_in_memory_when_the_parent_did():
    from retouch.models.loading import build_loaded

    editor = MaskAwareEditor(build_loaded("tiny-flux-fill"))
    assert editor.model.built_in_memory
    with Engine(editor, EngineConfig(mode="disagg", max_batch=2)) as engine:
        assert all("--build-in-memory" in process.args for process in engine.helpers.processes)
        template_id = engine.register_template(template_image(), prompt="a scene", steps=2, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        result = engine.submit(request).result(timeout=300)
    inline = editor.edit(template_id, request.mask, request.prompt, request.seed)
    assert np.abs(np.asarray(result.image, dtype=int) - np.asarray(inline, dtype=int)).max() <= 2


def test_leaving_the_engine_on_an_error_cancels_its_requests_within_a_step(flux_editor):
    from retouch.engine.worker import StepWatch

    steps_done, first_step = [], threading.Event()

    def on_step(k, n):
        steps_done.append(k)
        first_step.set()

    with pytest.raises(KeyboardInterrupt):
        with Engine(flux_editor, EngineConfig(mode="naive", max_batch=2)) as engine:
            future = engine.submit_image(template_image(), square_mask(), "a hat", seed=1, steps=500,
                                         watch=StepWatch(on_step))
            assert first_step.wait(120)
            raise KeyboardInterrupt  # what Ctrl-C raises in the caller's thread
    assert future.cancelled() and len(steps_done) < 500


def test_a_template_on_disk_is_read_while_the_batch_steps_and_its_edit_is_the_same(tmp_path, monkeypatch):
    """An edit of a template evicted to disk: the read starts when the edit is submitted and runs in
    the background; the loop admits it once the read is done, stepping the running batch meanwhile
    (a read held until the batch's second step ends: it joins after it, not before its first)."""
    from retouch.cache import CacheStore, StoreConfig
    from retouch.cache.disk import DiskTier

    store = CacheStore(StoreConfig(host_bytes=64 << 20, disk_dir=tmp_path, disk_bytes=256 << 20))
    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=store)
    running_id = editor.register_template(template_image(), prompt="a scene", steps=6, seed=1)
    evicted_id = editor.register_template(template_image((200, 90, 30)), prompt="a room", steps=4, seed=2)
    joiner = EditRequest(evicted_id, square_mask((16, 48, 79, 95)), "a blue door", seed=7)
    _, (alone,) = run(editor, EngineConfig(mode="naive"), [joiner])
    assert store.evict(evicted_id)

    released, read = threading.Event(), DiskTier.read
    monkeypatch.setattr(DiskTier, "read", lambda self, *args: released.wait(60) and read(self, *args))
    first, late = Worker.new_job(EditRequest(running_id, square_mask(), "a red hat", seed=5)), Worker.new_job(joiner)
    late.template_load = editor.prefetch(editor.templates[evicted_id])

    def inject(worker, steps_run):
        if steps_run == 2:
            released.set()

    run_loop(editor, EngineConfig(mode="naive"), [first, late], inject)
    assert late.metrics.admitted_step >= 2 and first.metrics.admitted_step == 0
    assert max_diff(final_latents(late), final_latents(alone)) <= BATCH_ATOL
    metrics = store.metrics()
    assert (metrics["prefetches"], metrics["disk_hits"], metrics["misses"]) == (1, 1, 0)

    assert store.evict(evicted_id)  # Engine.submit starts that read itself
    monkeypatch.setattr(DiskTier, "read", read)
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        result = engine.submit(joiner).result(120)
    assert store.metrics()["prefetches"] == 2 and result.image.size == template_image().size


def test_an_edit_whose_values_overflow_fails_instead_of_answering_a_black_region(flux_editor, tmp_path):
    """A LoRA whose weights overflow fp32 turns its rows' latents to NaN, which would decode to black:
    its request fails with a LoraError naming the adapter, and the request beside it is unharmed."""
    from lora_files import save_random_lora

    from retouch.lora import LoraError, LoraUse

    save_random_lora(flux_editor.pipe, tmp_path, std=1e30, weight_name="huge.safetensors")
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=3, seed=1)
    request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
    _, (alone,) = run(flux_editor, EngineConfig(mode="naive"), [request])
    huge, plain = Worker.new_job(request, lora=(LoraUse("huge", 2.0),)), Worker.new_job(request)
    run_loop(flux_editor, EngineConfig(mode="naive", lora_dir=str(tmp_path)), [huge, plain])
    assert isinstance(huge.future.exception(), LoraError) and "huge:2" in str(huge.future.exception())
    assert not torch.isfinite(huge.row.latents).all()
    assert max_diff(final_latents(plain), final_latents(alone)) <= BATCH_ATOL


def test_an_edit_waiting_for_its_template_stays_queued_when_another_does_not_fit(flux_editor):
    """Admission sets aside an edit whose template is still being read from disk; one behind it that
    finds the host cache full (the running batch holds it) goes back to wait, and so does the first:
    neither is dropped."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from retouch.cache import CacheFull

    worker = Worker(flux_editor, EngineConfig(mode="naive"))
    template_id = flux_editor.register_template(template_image(), prompt="a scene", steps=2, seed=1)
    loading, full = (Worker.new_job(EditRequest(template_id, square_mask(), "a hat", seed=s)) for s in (1, 2))
    loading.template_load = Future()  # its read from disk, not done
    for job in (loading, full):  # pre-processed (what admission reads of it: its template and schedule)
        job.ready = SimpleNamespace(inputs=SimpleNamespace(template=flux_editor.templates[template_id]),
                                    prepared=SimpleNamespace(schedule=SimpleNamespace(calls=None)))
    worker.running = [object()]  # a batch runs: the loading edit is set aside, not waited for
    worker.waiting.extend([loading, full])

    def host_full(templates):
        raise CacheFull("the running batch holds the host cache")

    worker.editor = type("Editor", (), {"acquire": staticmethod(host_full), "lost": staticmethod(lambda t: False),
                                        "templates": flux_editor.templates, "recomputes": 0, "device": "cpu"})()
    worker.admit()
    assert list(worker.waiting) == [loading, full] and not loading.future.done() and not full.future.done()
    worker.loras.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
                max_size=40), st.integers(1, 10), st.integers(0, 45))
def test_worker_metrics_keep_exact_totals_in_bounded_memory(steps, history, mark):
    """A worker runs for weeks: its summary is over every step, from totals, while it keeps only the last
    `history` steps' samples (it kept every one, and averaged them all at every heartbeat)."""
    from retouch.engine.metrics import WorkerMetrics

    metrics = WorkerMetrics(history=history)
    for batch, step_s, forward_s, inline_s in steps:
        metrics.record_step(batch, step_s, forward_s, inline_s)
    summary = metrics.summary()
    batches = [batch for batch, *_ in steps]
    overheads = [max(0.0, s - f - i) for _, s, f, i in steps]
    assert summary["steps"] == len(steps) and len(metrics.batch_sizes) == min(history, len(steps))
    assert summary["batch_rows"] == sum(batches) and summary["max_batch_size"] == max(batches, default=0)
    assert summary["mean_batch_size"] == pytest.approx(sum(batches) / len(steps) if steps else 0.0)
    assert summary["mean_overhead_s"] == pytest.approx(sum(overheads) / len(steps) if steps else 0.0)
    assert summary["step_seconds"] == pytest.approx(sum(s for _, s, _, _ in steps))
    assert metrics.batch_sizes_since(mark) == batches[mark:][len(batches[mark:]) - min(history, len(batches[mark:])):]


@pytest.mark.parametrize("fields, says", [({"helpers": -1}, "helpers must be a whole number >= 1"),
                                          ({"max_batch": 1.5}, "max_batch must be a whole number >= 1"),
                                          ({"helper_threads": -2}, "helper_threads must be a whole number >= 0"),
                                          ({"lora_cache_mb": float("inf")}, "lora_cache_mb must be a finite"),
                                          ({"lora_device_mb": float("nan")}, "lora_device_mb must be a finite"),
                                          ({"lora_cache_mb": 1e-7}, "lora_cache_mb must be a finite number of at"),
                                          ({"helper_silence_s": 0.0}, "helper_silence_s must be a finite")])
def test_an_engine_config_refuses_what_would_fail_later(fields, says):
    """Each was accepted: helpers=-1 and max_batch=1.5 failed in the loop, lora_cache_mb=inf as an
    OverflowError when the first adapter was cached."""
    with pytest.raises(ValueError, match=says):
        EngineConfig(**fields)


def test_the_api_names_what_it_was_given_in_the_wrong_place(flux_editor):
    """A config as a dict, a request or template id of None, a prompt of None and a budget that is not a
    number each failed deep inside (AttributeError, TypeError, the text encoder's ValueError)."""
    with pytest.raises(TypeError, match="config must be an EngineConfig"):
        Engine(flux_editor, {"mode": "naive"})
    for call, says in ((lambda: flux_editor.register_template(template_image(), prompt=None), "prompt must be"),
                       (lambda: flux_editor.edit_many([None]), "edit_many takes EditRequests"),
                       (lambda: flux_editor.drop_template(None), "a template id is a string"),
                       (lambda: flux_editor.edit(None, square_mask(), "a hat"), "a template id is a string")):
        with pytest.raises(InputError, match=says):
            call()
    template_id = flux_editor.register_template(template_image(), steps=2)
    with Engine(flux_editor, EngineConfig(mode="naive")) as engine:
        with pytest.raises(InputError, match="submit takes an EditRequest"):
            engine.submit(None)
        with pytest.raises(InputError, match="budget_s must be a finite number"):
            engine.submit(EditRequest(template_id, square_mask(), "a hat"), budget_s="x")


def copy_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("retouch-copy")]


def test_closing_an_engine_ends_its_copy_thread_and_a_restart_serves_again():
    """The CPU copy engine's thread outlived `Engine.close` until the editor was collected: one idle thread
    per engine a program opened. A closed engine started again (`with engine:` twice) stages its copies on a
    new one; its loop used to return at once, the last close's stop still set, and its edits waited forever."""
    from retouch.cache import CacheStore, StoreConfig

    editor = MaskAwareEditor(load_pipeline("tiny-flux-fill"), cache=CacheStore(StoreConfig(host_bytes=64 << 20)))
    template_id = editor.register_template(template_image(), prompt="a scene", steps=2, seed=1)
    request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
    before = copy_threads()
    engine = Engine(editor, EngineConfig(mode="naive"))
    results = []
    for _ in range(2):
        with engine:
            results.append(engine.submit(request).result(120))
            assert len(copy_threads()) == len(before) + 1
        assert copy_threads() == before
    assert editor.copy_engine.stats.blocks > 0
    assert np.array_equal(np.asarray(results[0].image), np.asarray(results[1].image))
