"""Any diffusers scheduler the pipeline takes, chosen with `--scheduler`, serves mask-aware edits through
the step loop: a request's latents equal the stock pipeline's (the editor's pipeline-driven edit) bit
for bit, requests that join mid-way equal themselves run alone, and what the helpers prepare crosses
the wire whole (noise-drawing samplers resume their generator where the pipeline left it)."""

import numpy as np
import pytest
import torch
from editor_inputs import max_diff, square_mask, template_image
from loop_runs import run_loop

from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine.schedulers import StockBatch
from retouch.engine.worker import EngineConfig, Worker
from retouch.errors import ModelError
from retouch.models import load_pipeline
from retouch.models.samplers import ALIASES, parse_scheduler



def batch_bound(latents: torch.Tensor) -> float:
    """A request's rows in a bigger batch differ only in summation order: 32 fp32 ulps at the latents'
    scale (Karras and ancestral schedules start at sigma ~15, so the latents are larger than Flux's)."""
    return 32 * torch.finfo(torch.float32).eps * max(1.0, latents.abs().max().item())


# (model, --scheduler): multistep, second order (two denoiser calls a step), noise-drawing, flow matching.
CASES = [
    ("tiny-sdxl-inpaint", "dpm++2m-karras"),
    ("tiny-sdxl-inpaint", "euler-a"),
    ("tiny-sdxl-inpaint", "heun"),
    ("tiny-sdxl-inpaint", "lcm"),  # LCM-LoRA's sampler: not on diffusers' compatible list, allowed for UNets
    ("tiny-sd2-inpaint", "ddim"),
    ("tiny-sd2-inpaint", "dpm++2m-sde"),
    ("tiny-sd2-inpaint", "unipc"),
    ("tiny-sd3-inpaint", "flow-heun"),
    ("tiny-sd3-inpaint", "flow-heun:shift=2.0"),
]
_editors: dict = {}


def editor_for(model: str, scheduler: str) -> MaskAwareEditor:
    if (model, scheduler) not in _editors:
        _editors[(model, scheduler)] = MaskAwareEditor(load_pipeline(model, scheduler=scheduler))
    return _editors[(model, scheduler)]


def run(editor, requests, inject=None):
    jobs = [Worker.new_job(r) for r in requests]
    return run_loop(editor, EngineConfig(mode="naive"), jobs, inject), jobs


@pytest.mark.parametrize("model,scheduler", CASES)
def test_the_loop_equals_the_stock_pipeline_and_a_late_joiner_itself_alone(model, scheduler):
    editor = editor_for(model, scheduler)
    assert type(editor.pipe.scheduler).__name__ == parse_scheduler(scheduler)[0]
    long_id = editor.register_template(template_image(), prompt="a scene", steps=4, seed=3)
    short_id = editor.register_template(template_image((200, 90, 30)), prompt="a room", steps=3, seed=4)
    first = EditRequest(long_id, square_mask(), "a red hat", seed=5)
    joiner = EditRequest(short_id, square_mask((16, 48, 79, 95)), "a blue door", seed=7)
    expected = editor.edit_many([first], output_type="latent")[0]
    worker, (alone,) = run(editor, [first])
    assert isinstance(worker.scheduler, StockBatch)
    assert torch.equal(alone.row.latents[0], expected)
    assert alone.metrics.steps == alone.row.schedule.num_steps == len(alone.row.schedule.own.timesteps)
    late = Worker.new_job(joiner)

    def inject(worker, steps_run):
        if steps_run == 2:
            worker.inbox.put(("edit", late))

    _, (together,) = run(editor, [first], inject)
    _, (joiner_alone,) = run(editor, [joiner])
    assert max_diff(together.row.latents[0], expected) <= batch_bound(expected)
    assert max_diff(late.row.latents[0], joiner_alone.row.latents[0]) <= batch_bound(joiner_alone.row.latents[0])
    assert late.metrics.admitted_step == 2


def test_progress_counts_a_second_order_samplers_denoiser_calls_once_each():
    from retouch.engine.worker import StepWatch

    editor = editor_for("tiny-sdxl-inpaint", "heun")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    told = []
    job = Worker.new_job(EditRequest(template_id, square_mask(), "a hat", seed=1),
                         watch=StepWatch(lambda k, n: told.append((k, n))))
    run_loop(editor, EngineConfig(mode="naive"), [job])
    assert told == [(k, 5) for k in range(1, 6)]  # Heun: 2 x 3 - 1 denoiser calls


def test_slack_ordering_predicts_a_second_order_samplers_calls():
    """A waiting edit's predicted time counts the denoiser calls it will make (Heun: 5 for 3 steps)."""
    editor = editor_for("tiny-sdxl-inpaint", "heun")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    worker = Worker(editor, EngineConfig(mode="naive"))
    assert worker._steps_of(Worker.new_job(EditRequest(template_id, square_mask(), "a hat"))) == 5
    worker.loras.close()


def test_a_noise_drawing_sampler_resumes_its_generator_across_the_wire():
    """What a helper prepares for an ancestral sampler carries the generator's state; stepping the
    received request gives the latents of the request prepared in place."""
    from retouch.engine import processing, wire

    editor = editor_for("tiny-sdxl-inpaint", "euler-a")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
    template = editor.templates[template_id]
    ready = processing.preprocess(editor, request, template)
    assert ready.prepared.schedule.calls.generator_state is not None
    header, tensors, blobs = wire.decode(processing.ready_message(3, ready))
    back = processing.ready_from_message(header, tensors, blobs, template)
    assert back.prepared.schedule.calls.header() == ready.prepared.schedule.calls.header()
    assert torch.equal(back.prepared.schedule.calls.generator_state, ready.prepared.schedule.calls.generator_state)
    _, (job,) = run(editor, [request])
    expected = editor.edit_many([request], output_type="latent")[0]
    assert torch.equal(job.row.latents[0], expected)
    # The draws matter: another generator state moves the result.
    job = Worker.new_job(request)
    job.ready = back
    back.prepared.schedule.calls.generator_state = torch.Generator().manual_seed(99).get_state()
    worker = run_loop(editor, EngineConfig(mode="naive"), [job])
    assert worker.metrics.completed == 1
    assert max_diff(job.row.latents[0], expected) > 1e-3


def test_a_name_means_its_sampler_whatever_the_pipeline_was_saved_with():
    """A folder saved with DPM++ 2M SDE Karras asked for "dpm++2m" runs DPM++ 2M; a class name keeps the
    saved settings (diffusers' from_config)."""
    from diffusers import DPMSolverMultistepScheduler

    from retouch.models import published
    from retouch.models.samplers import choose_scheduler

    saved = DPMSolverMultistepScheduler.from_config({**published.SDXL_SCHEDULER, "use_karras_sigmas": True,
                                                     "algorithm_type": "sde-dpmsolver++"})
    named = choose_scheduler(saved, "dpm++2m", "sdxl", "StableDiffusionXLInpaintPipeline")
    assert (named.config.algorithm_type, named.config.use_karras_sigmas) == ("dpmsolver++", False)
    kept = choose_scheduler(saved, "DPMSolverMultistepScheduler", "sdxl", "StableDiffusionXLInpaintPipeline")
    assert (kept.config.algorithm_type, kept.config.use_karras_sigmas) == ("sde-dpmsolver++", True)


def test_a_saved_scheduler_that_draws_noise_without_a_generator_is_refused_unless_replaced(tmp_path):
    """A folder saved with stochastic flow matching on SD3 would not repeat an edit from its seed."""
    import json

    from retouch.models import export_pipeline

    folder = tmp_path / "sd3"
    export_pipeline("tiny-sd3-inpaint", folder)
    config_path = folder / "scheduler" / "scheduler_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "stochastic_sampling": True}))
    with pytest.raises(ModelError, match=r"draws noise as it steps.*--scheduler \(flow-euler, flow-heun\)"):
        load_pipeline(folder)
    from retouch.models.samplers import draws_noise

    for advised in ("flow-euler", "flow-heun"):  # the advice can be followed: a name does not inherit stochastic
        assert not draws_noise(load_pipeline(folder, scheduler=advised).pipe.scheduler)


def test_a_request_whose_schedule_this_worker_cannot_make_fails_alone():
    from retouch.engine import processing

    editor = editor_for("tiny-sdxl-inpaint", "dpm++2m-karras")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    good, bad = (Worker.new_job(EditRequest(template_id, square_mask(), "a hat", seed=s)) for s in (1, 2))
    bad.ready = processing.preprocess(editor, bad.request, editor.templates[template_id])
    bad.ready.prepared.schedule.calls.set_timesteps["num_inference_steps"] = 4  # as a helper on other settings
    worker = run_loop(editor, EngineConfig(mode="naive"), [good, bad])
    assert good.future.result().image.size == (128, 128)
    with pytest.raises(RuntimeError, match="another schedule"):
        bad.future.result()
    assert worker.metrics.completed == 1


def test_helpers_run_a_scheduler_swapped_in_after_load():
    """The diffusers way of changing sampler (`pipe.scheduler = X.from_config(...)`) reaches the helpers."""
    from diffusers import DPMSolverMultistepScheduler

    from retouch.engine.api import Engine

    editor = MaskAwareEditor(load_pipeline("tiny-sd2-inpaint"))
    editor.pipe.scheduler = DPMSolverMultistepScheduler.from_config(editor.pipe.scheduler.config,
                                                                    use_karras_sigmas=True)
    with Engine(editor, EngineConfig(mode="disagg", max_batch=2)) as engine:
        template_id = engine.register_template(template_image(), prompt="a scene", steps=3, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        result = engine.submit(request).result(timeout=300)
    inline = editor.edit(template_id, request.mask, request.prompt, request.seed)
    assert np.abs(np.asarray(result.image, dtype=int) - np.asarray(inline, dtype=int)).max() <= 2


@pytest.mark.parametrize("model,scheduler,line", [("tiny-sdxl-inpaint", "heun", (2, -1)),
                                                  ("tiny-sdxl-inpaint", "dpm++2m-karras", (1, 0)),
                                                  ("tiny-sd2-inpaint", None, (1, 1)),  # PLMS: one more call
                                                  ("tiny-flux-fill", None, (1, 0))])  # dynamic shifting's mu
def test_the_calls_line_counts_the_denoiser_calls_of_any_step_count(model, scheduler, line):
    from retouch.engine.schedulers import BatchScheduler
    from retouch.models.samplers import calls_line

    pipe = load_pipeline(model, scheduler=scheduler).pipe
    assert calls_line(pipe.scheduler) == line
    batch = BatchScheduler.for_scheduler(pipe.scheduler)
    mu = {"mu": 1.0} if pipe.scheduler.config.get("use_dynamic_shifting") else {}
    for steps in (2, 3, 28):  # (PLMS makes one call of one step: the line is exact from two)
        assert batch.schedule(steps, **mu).num_steps == line[0] * steps + line[1]


def test_more_steps_than_the_sampler_makes_is_the_requests_fault():
    """LCM makes at most its original_inference_steps (50): the engine says so as an InputError (422 from a
    worker), not as the ValueError the pipeline would raise from a helper (500)."""
    from retouch.errors import InputError

    editor = editor_for("tiny-sdxl-inpaint", "lcm")
    with pytest.raises(InputError, match="LCMScheduler cannot make 60 steps"):
        editor.new_template(template_image(), prompt="a scene", steps=60)
    with pytest.raises(InputError, match="cannot make 51 steps"):
        editor.one_off_template(template_image(), square_mask(), "a hat", steps=51)
    assert editor.new_template(template_image(), prompt="a scene", steps=50).steps == 50


def test_the_fingerprint_tells_schedules_apart():
    """A recording is never adopted by the same weights on another schedule."""
    plain = editor_for("tiny-sdxl-inpaint", "euler")
    assert plain.model_fingerprint() != editor_for("tiny-sdxl-inpaint", "dpm++2m-karras").model_fingerprint()
    assert plain.model_fingerprint() != editor_for("tiny-sdxl-inpaint", "dpm++2m").model_fingerprint()
    assert plain.model_fingerprint() == MaskAwareEditor(load_pipeline("tiny-sdxl-inpaint",
                                                                      scheduler="euler")).model_fingerprint()


@pytest.mark.parametrize("spec,message", [
    ("no-such-sampler", "neither a diffusers scheduler class nor one of"),
    ("AutoencoderKL", "neither a diffusers scheduler class"),
    ("dpm++2m:use_karras=true", "has no setting 'use_karras'"),
    ("dpm++2m:karras", "KEY=VALUE"),
    ("ddim:timestep_spacing=sideways", "sideways"),
    ("flow-euler", "cannot drive this StableDiffusionXLInpaintPipeline"),
])
def test_a_scheduler_that_cannot_drive_the_pipeline_is_refused_at_load(spec, message):
    with pytest.raises(ModelError, match=message):
        load_pipeline("tiny-sdxl-inpaint", scheduler=spec)


def test_flux_refuses_a_scheduler_without_the_custom_sigmas_its_pipelines_give():
    with pytest.raises(ModelError, match="sigmas"):
        load_pipeline("tiny-flux-fill", scheduler="flow-heun")


@pytest.mark.parametrize("model,spec", [("tiny-flux-fill", "FlowMatchLCMScheduler"),
                                        ("tiny-sd3-inpaint", "flow-euler:stochastic_sampling=true")])
def test_a_noise_drawing_sampler_is_refused_where_the_pipeline_gives_it_no_generator(model, spec):
    """Flux and SD3 pipelines step without a generator: such a sampler would not repeat an edit from its seed."""
    with pytest.raises(ModelError, match="no generator"):
        load_pipeline(model, scheduler=spec)


def test_draws_noise_tells_ancestral_from_deterministic_samplers():
    from diffusers import DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler, LCMScheduler

    from retouch.models import published
    from retouch.models.samplers import draws_noise

    state = torch.random.get_rng_state()
    assert draws_noise(EulerAncestralDiscreteScheduler.from_config(published.SDXL_SCHEDULER))
    assert draws_noise(LCMScheduler.from_config(published.SDXL_SCHEDULER))
    assert not draws_noise(DPMSolverMultistepScheduler.from_config(published.SDXL_SCHEDULER))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_settings_parse_as_their_defaults_type_and_aliases_name_real_classes():
    assert parse_scheduler("DDIMScheduler:timestep_spacing=trailing, rescale_betas_zero_snr=true") == (
        "DDIMScheduler", {"timestep_spacing": "trailing", "rescale_betas_zero_snr": True})
    name, settings = parse_scheduler("DPM++2M-Karras:solver_order=3")
    assert name == "DPMSolverMultistepScheduler"
    assert settings.items() >= {"use_karras_sigmas": True, "solver_order": 3, "algorithm_type": "dpmsolver++"}.items()
    assert parse_scheduler("ddim:trained_betas=[0.1,0.2],beta_end=0.02")[1] == {"trained_betas": [0.1, 0.2],
                                                                                "beta_end": 0.02}
    # "False" is false, not a truthy string; numbers and None as their defaults are.
    assert parse_scheduler("ddim:set_alpha_to_one=False,beta_end=0.02,trained_betas=none") == (
        "DDIMScheduler", {"set_alpha_to_one": False, "beta_end": 0.02, "trained_betas": None})
    assert parse_scheduler("euler:use_karras_sigmas=FALSE,sigma_min=1")[1].items() >= {"use_karras_sigmas": False,
                                                                                       "sigma_min": 1}.items()
    assert parse_scheduler("ddim:beta_start=1")[1] == {"beta_start": 1.0}
    for spec, says in (("dpm++2m:solver_order=abc", "solver_order is an integer, got 'abc'"),
                       ("dpm++2m:solver_order=2.5", "solver_order is an integer"),
                       ("ddim:set_alpha_to_one=maybe", "set_alpha_to_one is true or false"),
                       ("ddim:beta_end=high", "beta_end is a number"),
                       ("flow-euler:shift=1,shift=2", "shift is set twice")):  # was the last, silently
        with pytest.raises(ModelError, match=says):
            parse_scheduler(spec)
    for alias in ALIASES:
        try:
            parse_scheduler(alias)  # refuses a class diffusers lacks
        except ModelError as error:  # or one whose package is missing: LMS needs scipy
            assert "requires the" in str(error) and "pip install" in str(error)


def test_helpers_prepare_on_the_workers_scheduler():
    """The disaggregated engine's helper processes load the model with the worker's --scheduler, and a
    noise-drawing sampler's edit through them is the inline edit."""
    from retouch.engine.api import Engine

    with Engine.load("tiny-sdxl-inpaint", EngineConfig(mode="disagg", max_batch=2), scheduler="euler-a") as engine:
        for process in engine.helpers.processes:
            assert process.args[process.args.index("--scheduler") + 1] == "euler-a"
        template_id = engine.register_template(template_image(), prompt="a scene", steps=3, seed=3)
        request = EditRequest(template_id, square_mask(), "a hat", seed=1)
        result = engine.submit(request).result(timeout=300)
        inline = engine.editor.edit(template_id, request.mask, request.prompt, request.seed)
    # The helper's single-threaded encoders sum in another order: 8-bit rounding may differ.
    difference = np.abs(np.asarray(result.image, dtype=int) - np.asarray(inline, dtype=int))
    assert difference.max() <= 2


def test_a_preparation_that_cannot_be_read_fails_its_edit_not_the_receiver():
    """A prepared message naming a generator whose state did not come with it (a malformed message) is
    that edit's failure; the helpers' receiver thread goes on."""
    from retouch.engine import processing, wire
    from retouch.engine.api import Engine, HelperError

    editor = editor_for("tiny-sdxl-inpaint", "euler-a")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=3, seed=3)
    request = EditRequest(template_id, square_mask(), "a hat", seed=1)
    engine = Engine(editor, EngineConfig(mode="naive"))
    job = Worker.new_job(request)
    engine._jobs[job.id] = job
    ready = processing.preprocess(editor, request, editor.templates[template_id])
    header, tensors, blobs = wire.decode(processing.ready_message(job.id, ready))
    del tensors["prepared.schedule.generator_state"]
    engine._on_helper_message(header, tensors, blobs)
    with pytest.raises(HelperError, match="generator"):
        job.future.result(timeout=0)
    assert job.id not in engine._jobs and engine.worker.inbox.empty()
    engine.worker.loras.close()
