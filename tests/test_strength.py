"""Denoising strength below 1 (`retouch.strength`): an edit that keeps the structure under its mask.

Against diffusers' own strength path: with every token masked, the editor's edit equals the stock
pipeline called with `strength` and drawing the edit's noise itself. Mask-aware edits read the
recording from the step they start at, the step loop equals the editor (alone, joining mid-way, beside
edits of other strengths, over the wire to the helpers), and progress counts the steps that run.
"""

import sys

import numpy as np
import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from editor_inputs import max_diff, square_mask, template_image
from hypothesis import given, settings
from hypothesis import strategies as st
from loop_runs import run_loop
from PIL import Image

from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.worker import EngineConfig, StepWatch, Worker
from retouch.errors import InputError
from retouch.models import load_pipeline
from retouch.strength import StartLatents, check_strength, steps_run

MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
_editors: dict = {}


def editor_for(model: str, scheduler: str | None = None) -> MaskAwareEditor:
    if (model, scheduler) not in _editors:
        _editors[(model, scheduler)] = MaskAwareEditor(load_pipeline(model, scheduler=scheduler))
    return _editors[(model, scheduler)]


def batch_bound(latents: torch.Tensor) -> float:
    return 32 * torch.finfo(torch.float32).eps * max(1.0, latents.abs().max().item())


@pytest.fixture
def vae_means(monkeypatch):
    """VAE posteriors read at their mean: the stock path draws its image latents from the generator before
    the noise, retouch's from a copy of it, and only the draws differ."""
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mean)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strength", [0.3, 0.75])
def test_every_token_masked_equals_the_stock_pipeline_at_that_strength(model, strength, vae_means, monkeypatch):
    assert_stock_at_strength(model, strength, monkeypatch)


@pytest.mark.parametrize("model", ["tiny-flux-inpaint", "tiny-sd3-inpaint"])
def test_where_the_pipeline_draws_the_templates_latents_first_they_are_its_draws(model, monkeypatch):
    """The inpaint pipelines that re-noise the template draw its VAE sample before the noise, at strength 1
    too: the start is noised from that same sample, as the stock pipeline's (no VAE mean needed)."""
    assert_stock_at_strength(model, 0.5, monkeypatch)


def assert_stock_at_strength(model: str, strength: float, monkeypatch) -> None:
    editor = editor_for(model)
    monkeypatch.setattr(editor, "start_latents", StartLatents())  # none kept from VAE samples of other tests
    template_id = editor.register_template(template_image(), prompt="a scene", steps=6, seed=0)
    everything = Image.new("L", (128, 128), 255)
    request = editor.check_request(EditRequest(template_id, everything, "a red sofa", seed=5, strength=strength))
    template = editor.templates[template_id]
    inputs = editor.prepare_edit(request, template)
    edited = editor.edit_many([request], output_type="latent")[0]

    noise = inputs.latents[None]
    drawn = []

    def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None):
        assert tuple(shape) == tuple(noise.shape)
        drawn.append(shape)
        return noise.to(device, dtype)

    monkeypatch.setattr(sys.modules[type(editor.pipe).__module__], "randn_tensor", randn_tensor)
    kwargs = editor.pipeline_kwargs([template], [inputs.mask], [request.prompt], noise, "latent", strength)
    kwargs["latents"] = None  # the pipeline draws its noise (the edit's) and noises the template with it
    with torch.inference_mode():
        stock = editor.pipe(**kwargs).images[0]
    assert drawn
    assert torch.equal(edited, stock)
    full = editor.edit_many([request], output_type="latent")[0]
    assert max_diff(full, editor.edit_many([request], output_type="latent", full_compute=True)[0]) <= 1e-5


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"])
def test_a_mask_aware_edit_reads_the_recording_from_the_step_it_starts_at(model, monkeypatch):
    editor = editor_for(model)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=6, seed=0)
    read = []
    staged = editor.staged_edit_context

    def spy(inputs, steps, *args, **kwargs):
        read.append(list(steps))
        return staged(inputs, steps, *args, **kwargs)

    monkeypatch.setattr(editor, "staged_edit_context", spy)
    editor.edit(template_id, square_mask(), "a red sofa", seed=3, strength=0.5)
    run_loop(editor, EngineConfig(mode="naive"),
             [Worker.new_job(EditRequest(template_id, square_mask(), "a red sofa", seed=3, strength=0.5))])
    calls = len(editor.pipe.scheduler.timesteps)  # the full schedule's denoiser calls
    first = 6 - steps_run(editor.model.family, 6, 0.5)
    assert first > 0
    assert read[:calls - first] == [[step] for step in range(first, calls)]  # the editor's pipeline run
    assert read[calls - first:] == [[step] for step in range(first, calls)]  # the step loop


@pytest.mark.parametrize("model,scheduler", [("tiny-flux-fill", None), ("tiny-sd3-inpaint", None),
                                             ("tiny-flux-inpaint", None), ("tiny-sdxl-inpaint", None),
                                             ("tiny-sd2-inpaint", None), ("tiny-sdxl-inpaint", "dpm++2m-karras"),
                                             ("tiny-sdxl-inpaint", "heun"), ("tiny-sd2-inpaint", "euler-a")])
def test_the_loop_equals_the_editor_and_batches_strengths_with_late_joiners(model, scheduler):
    editor = editor_for(model, scheduler)
    long_id = editor.register_template(template_image(), prompt="a scene", steps=6, seed=3)
    partial = EditRequest(long_id, square_mask(), "a red hat", seed=5, strength=0.6)
    whole = EditRequest(long_id, square_mask((16, 48, 79, 95)), "a blue door", seed=7)
    expected = editor.edit_many([partial], output_type="latent")[0]
    told = []
    job = Worker.new_job(partial, watch=StepWatch(lambda k, n: told.append((k, n))))
    run_loop(editor, EngineConfig(mode="naive"), [job])
    assert torch.equal(job.row.latents[0], expected)
    calls = job.row.schedule.calls_in_all
    assert told == [(k, calls) for k in range(1, calls + 1)]
    assert job.metrics.steps == calls < job.row.schedule.num_steps

    late = Worker.new_job(partial)
    first = Worker.new_job(whole)

    def inject(worker, steps_run):
        if steps_run == 2:
            worker.inbox.put(("edit", late))

    run_loop(editor, EngineConfig(mode="naive"), [first], inject)
    alone = Worker.new_job(whole)
    run_loop(editor, EngineConfig(mode="naive"), [alone])
    assert max_diff(late.row.latents[0], expected) <= batch_bound(expected)
    assert max_diff(first.row.latents[0], alone.row.latents[0]) <= batch_bound(alone.row.latents[0])


def test_helpers_prepare_the_start_and_the_worker_predicts_the_calls_that_run():
    from retouch.engine import processing, wire

    editor = editor_for("tiny-sdxl-inpaint")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=6, seed=3)
    request = editor.check_request(EditRequest(template_id, square_mask(), "a red hat", seed=5, strength=0.5))
    template = editor.templates[template_id]
    header, tensors, blobs = wire.decode(processing.handle(editor, processing.prepare_message(1, request, template)))
    back = processing.ready_from_message(header, tensors, blobs, template)
    assert back.prepared.schedule.start == back.prepared.schedule.index == 3
    job = Worker.new_job(request)
    job.ready = back
    run_loop(editor, EngineConfig(mode="naive"), [job])
    assert torch.equal(job.row.latents[0], editor.edit_many([request], output_type="latent")[0])
    worker = Worker(editor, EngineConfig(mode="naive"))
    assert worker._steps_of(Worker.new_job(request)) == 3
    worker.loras.close()


def test_a_one_off_edit_below_full_strength_answers_without_recording():
    from retouch.engine.api import Engine

    editor = editor_for("tiny-sd2-inpaint")
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        result = engine.submit_image(template_image((10, 200, 90)), square_mask(), "a hat", seed=2, steps=4,
                                     strength=0.5).result(timeout=300)
        assert result.recorded is None
        again = engine.submit_image(template_image((10, 200, 90)), square_mask(), "a hat", seed=2,
                                    steps=4).result(timeout=300)
        assert again.recorded is not None  # the first full-strength edit of it records it
        assert result.metrics.steps == again.metrics.steps - 2


@given(steps=st.integers(1, 60), strength=st.floats(0.0, 1.0, exclude_min=True))
@settings(max_examples=200, deadline=None)
def test_steps_run_is_at_least_one_when_allowed_and_never_more_than_the_schedule(steps, strength):
    for family in ("flux-fill", "sd3", "sdxl", "sd2"):
        run = steps_run(family, steps, strength)
        assert 0 <= run <= steps
        if steps * strength >= 1:
            assert check_strength(strength, steps) == strength and run >= 1
        else:
            with pytest.raises(InputError, match="less than one step"):
                check_strength(strength, steps)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("steps,strength", [(6, 0.5), (7, 0.3), (10, 0.3), (5, 0.99), (28, 0.37)])
def test_steps_run_counts_the_pipelines_own_steps(model, steps, strength):
    from retouch.engine import recipes

    editor = editor_for(model)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=steps, seed=0)
    request = editor.check_request(EditRequest(template_id, square_mask(), "a hat", strength=strength))
    prepared = recipes.prepare(editor, editor.prepare_edit(request), request.prompt, strength)
    extra = prepared.schedule.num_steps - steps  # PNDM's warm-up call
    assert prepared.schedule.calls_in_all - extra == steps_run(editor.model.family, steps, strength)


@pytest.mark.parametrize("model,scheduler", [("tiny-sd2-inpaint", None), ("tiny-sdxl-inpaint", "heun"),
                                             ("tiny-flux-fill", None)])
@pytest.mark.parametrize("steps,strength", [(8, 0.125), (6, 0.2), (2, 0.5), (6, 0.5), (2, 1.0), (1, 1.0)])
def test_the_predicted_denoiser_calls_are_the_calls_that_run(model, scheduler, steps, strength):
    """What the head and the worker predict from the sampler's calls line (progress totals, costs) is
    what the schedule makes, one-step tails included (PLMS makes two calls there, one for a whole
    schedule of one step)."""
    from retouch.engine import recipes
    from retouch.engine.policies import denoiser_calls
    from retouch.models.samplers import calls_line

    editor = editor_for(model, scheduler)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=steps, seed=0)
    request = editor.check_request(EditRequest(template_id, square_mask(), "a hat", strength=strength))
    prepared = recipes.prepare(editor, editor.prepare_edit(request), request.prompt, strength)
    run = steps_run(editor.model.family, steps, strength)
    assert denoiser_calls(calls_line(editor.pipe.scheduler), run, steps) == prepared.schedule.calls_in_all


def test_a_head_counts_as_its_workers_will_before_any_joins():
    from retouch.config import ServeOptions
    from retouch.server import router_config, served_model

    for model, family, calls in (("tiny-sd2-inpaint", "sd2", (1, 1)), ("tiny-flux-fill", "flux-fill", (1, 0))):
        config = served_model(router_config(ServeOptions(model=model)), ServeOptions(model=model))
        assert (config.family, config.calls) == (family, calls)
    opts = ServeOptions(model="tiny-sdxl-inpaint", scheduler="heun")
    assert served_model(router_config(opts), opts).calls == (2, -1)


def test_a_numpy_strength_is_a_number():
    assert check_strength(np.float32(0.5), 28) == 0.5


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan"), float("inf"), "0.5", True, None])
def test_a_strength_outside_0_1_is_refused_naming_it(value):
    with pytest.raises(InputError, match="strength"):
        check_strength(value, 28)
    editor = editor_for("tiny-sd2-inpaint")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=4, seed=0)
    with pytest.raises(InputError, match="strength"):
        editor.edit(template_id, square_mask(), "a hat", strength=value)


def test_the_editors_one_off_edit_below_full_strength_is_the_engines_and_records_nothing():
    from retouch.engine.api import Engine

    editor = editor_for("tiny-sd3-inpaint")
    image = template_image((30, 60, 220))
    inline = editor.edit_image(image, square_mask(), "a hat", seed=2, steps=4, strength=0.5)
    assert not any(t.one_off for t in editor.templates.values() if t.source.tobytes() == image.tobytes())
    with Engine(editor, EngineConfig(mode="naive")) as engine:
        looped = engine.submit_image(image, square_mask(), "a hat", seed=2, steps=4, strength=0.5).result(timeout=300)
    assert np.abs(np.asarray(inline, dtype=int) - np.asarray(looped.image, dtype=int)).max() <= 1


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sdxl-inpaint"])
def test_the_baseline_edit_below_full_strength_is_the_editors_one_off_edit(model):
    from retouch.baseline import run_baseline_edit

    editor = editor_for(model)
    image = template_image((200, 30, 90))
    baseline = run_baseline_edit(editor.pipe, image, square_mask(), "a hat", steps=4, seed=6, strength=0.5,
                                 call_defaults=editor.model.call_defaults)
    one_off = editor.edit_image(image, square_mask(), "a hat", seed=6, steps=4, strength=0.5)
    assert np.abs(np.asarray(baseline, dtype=int) - np.asarray(one_off, dtype=int)).max() <= 1


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sd3-inpaint", "tiny-sd2-inpaint"])
def test_a_templates_start_latents_are_encoded_once_and_are_what_an_encoding_gives(model):
    from retouch.engine import recipes

    editor = editor_for(model)
    template_id = editor.register_template(template_image((90, 90, 30)), prompt="a scene", steps=4, seed=8)
    request = EditRequest(template_id, square_mask(), "a hat", seed=1, strength=0.5)
    before = editor.start_latents.encoded
    first = editor.edit_many([request], output_type="latent")[0]
    assert editor.start_latents.encoded == before + 1
    prepared = recipes.prepare(editor, editor.prepare_edit(editor.check_request(request)), "a hat", 0.5)
    assert editor.start_latents.encoded == before + 1  # the engine's preparation found it too
    editor.start_latents.drop(template_id)
    again = editor.edit_many([request], output_type="latent")[0]  # encoded afresh
    assert editor.start_latents.encoded == before + 2 and torch.equal(first, again)
    assert torch.equal(editor.edit_many([request], output_type="latent")[0], first)  # from the kept latents
    job = Worker.new_job(request)
    run_loop(editor, EngineConfig(mode="naive"), [job])
    assert torch.equal(job.row.latents[0], first) and prepared.schedule.start == job.row.schedule.start
    editor.drop_template(template_id)
    assert not any(key[0][0] == template_id for key in editor.start_latents._kept)
