"""Batched schedulers equal diffusers' own scheduler stepping for every request of a batch whose requests
joined at different steps with different step counts (continuous batching): the vectorised ones, and
every other scheduler through `StockBatch`, the noise-drawing ones included."""

import copy
import inspect
import json

import numpy as np
import pytest
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler,
                       HeunDiscreteScheduler, KDPM2AncestralDiscreteScheduler, LCMScheduler, PNDMScheduler,
                       UniPCMultistepScheduler)

from retouch.engine.schedulers import (BatchScheduler, EulerBatch, FlowMatchEulerBatch, PipelineCalls, PNDMBatch,
                                       RequestSchedule, StockBatch, decode_arguments, encode_arguments)
from retouch.models import published

SCHEDULERS = {
    "flux": (FlowMatchEulerDiscreteScheduler, published.FLUX_SCHEDULER, {"mu": 0.8}),
    "sd3": (FlowMatchEulerDiscreteScheduler, published.SD3_SCHEDULER, {}),
    "sdxl": (EulerDiscreteScheduler, published.SDXL_SCHEDULER, {}),
    "sd2": (PNDMScheduler, published.SD2_SCHEDULER, {}),
    "sdxl-v": (EulerDiscreteScheduler, {**published.SDXL_SCHEDULER, "prediction_type": "v_prediction"}, {}),
    # Through StockBatch: multistep, second-order (two denoiser calls a step), and noise-drawing samplers.
    "dpm++2m-karras": (DPMSolverMultistepScheduler, {**published.SDXL_SCHEDULER, "use_karras_sigmas": True}, {}),
    "dpm++2m-sde": (DPMSolverMultistepScheduler, {**published.SDXL_SCHEDULER, "algorithm_type": "sde-dpmsolver++"},
                    {}),
    "unipc": (UniPCMultistepScheduler, published.SD2_SCHEDULER, {}),
    "ddim": (DDIMScheduler, published.SD2_SCHEDULER, {}),
    "heun": (HeunDiscreteScheduler, published.SDXL_SCHEDULER, {}),
    "euler-a": (EulerAncestralDiscreteScheduler, published.SDXL_SCHEDULER, {}),
    "kdpm2-a": (KDPM2AncestralDiscreteScheduler, published.SDXL_SCHEDULER, {}),
    "lcm": (LCMScheduler, published.SDXL_SCHEDULER, {}),
    "pndm-prk": (PNDMScheduler, {**published.SD2_SCHEDULER, "skip_prk_steps": False}, {}),
    "flow-heun": (FlowMatchHeunDiscreteScheduler, published.SD3_SCHEDULER, {}),
    "flow-stochastic": (FlowMatchEulerDiscreteScheduler, {**published.SD3_SCHEDULER, "stochastic_sampling": True},
                        {}),
}
VECTORISED = {"flux": FlowMatchEulerBatch, "sd3": FlowMatchEulerBatch, "sdxl": EulerBatch, "sdxl-v": EulerBatch,
              "sd2": PNDMBatch}
SHAPE = (1, 4, 6, 6)


def fake_model(sample: torch.Tensor, timestep: torch.Tensor, request: int) -> torch.Tensor:
    """A deterministic stand-in for the denoiser: depends on the sample, the timestep and the request."""
    return torch.tanh(sample * 0.7 + float(timestep) / 1000.0 + request * 0.1)


def step_noise(request: int) -> torch.Generator:
    """The generator request `request`'s steps draw from (the noise-drawing schedulers)."""
    return torch.Generator().manual_seed(1000 + request)


def reference_trajectory(scheduler_class, config, set_timesteps, steps: int, start: torch.Tensor, request: int):
    """Diffusers stepping one request alone, as a pipeline's loop does ([1, ...] latents, its generator)."""
    scheduler = scheduler_class.from_config(config)
    scheduler.set_timesteps(steps, **set_timesteps)
    sample = start * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching starts at the noise
    generator = step_noise(request)
    trajectory = []
    for t in scheduler.timesteps:
        scale = getattr(scheduler, "scale_model_input", None)  # flow matching has none
        model_input = sample if scale is None else scale(sample, t)
        accepts_generator = "generator" in inspect.signature(scheduler.step).parameters
        sample = scheduler.step(fake_model(model_input, t, request), t, sample, return_dict=False,
                                **({"generator": [generator]} if accepts_generator else {}))[0]
        trajectory.append(sample)
    return trajectory


def test_vectorised_where_diffusers_arithmetic_is_repeated_and_stock_elsewhere():
    for name, (scheduler_class, config, _) in SCHEDULERS.items():
        batch = BatchScheduler.for_scheduler(scheduler_class.from_config(config))
        assert type(batch) is VECTORISED.get(name, StockBatch), name


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_batched_steps_equal_diffusers_per_request(name):
    scheduler_class, config, set_timesteps = SCHEDULERS[name]
    batch = BatchScheduler.for_scheduler(scheduler_class.from_config(config))
    generator = torch.Generator().manual_seed(0)
    # Request r joins at loop iteration joins[r] with its own step count: the batch is ragged in time.
    step_counts, joins = [5, 4, 7, 6], [0, 1, 1, 4]  # PNDM with PRK steps needs 4 at least
    starts = [torch.randn(SHAPE, generator=generator) for _ in step_counts]
    expected = [reference_trajectory(scheduler_class, config, set_timesteps, n, start, r)
                for r, (n, start) in enumerate(zip(step_counts, starts))]
    running: dict[int, tuple] = {}
    got = {r: [] for r in range(len(step_counts))}
    iteration = 0
    while len(got) > sum(1 for r in got if len(got[r]) == len(expected[r])) or iteration == 0:
        for r, join in enumerate(joins):
            if join == iteration:
                schedule = batch.schedule(step_counts[r], generator=step_noise(r), **set_timesteps)
                running[r] = (schedule, starts[r] * schedule.init_noise_sigma)
        rows = sorted(running)
        if rows:
            schedules = [running[r][0] for r in rows]
            samples = torch.cat([running[r][1] for r in rows])
            timesteps = batch.timesteps(schedules)
            model_input = batch.scale_model_input(samples, schedules)
            output = torch.cat([fake_model(model_input[i:i + 1], timesteps[i], r) for i, r in enumerate(rows)])
            samples = batch.step(output, samples, schedules)
            for i, r in enumerate(rows):
                got[r].append(samples[i:i + 1])
                running[r] = (running[r][0], samples[i:i + 1])
                if running[r][0].done:
                    del running[r]
        iteration += 1
        assert iteration < 50
    for r in got:
        assert len(got[r]) == len(expected[r])
        for step, (a, b) in enumerate(zip(got[r], expected[r])):
            assert torch.equal(a, b), f"request {r}, step {step}: max diff {(a - b).abs().max()}"


def test_flow_match_scale_noise_equals_diffusers():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(published.SD3_SCHEDULER)
    batch = FlowMatchEulerBatch(scheduler)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(6)
    schedule = batch.schedule(6)
    schedule.index = 2
    sample, noise = torch.randn(SHAPE), torch.randn(SHAPE)
    expected = reference.scale_noise(sample, reference.timesteps[3:4], noise)
    assert torch.equal(batch.scale_noise(sample, noise, [schedule], ahead=1), expected)


@pytest.mark.parametrize("scheduler_class", [FlowMatchHeunDiscreteScheduler, FlowMatchEulerDiscreteScheduler])
def test_stock_re_noise_equals_the_pipelines_call_after_each_step(scheduler_class):
    """The SD3 and Flux inpaint pipelines re-noise the template's latents after each step with
    `scale_noise(latents, [next timestep], noise)` on their stepped scheduler."""
    config = {**published.SD3_SCHEDULER, "stochastic_sampling": True} if scheduler_class is \
        FlowMatchEulerDiscreteScheduler else published.SD3_SCHEDULER
    reference = scheduler_class.from_config(config)
    reference.set_timesteps(5)
    reference.set_begin_index(0)  # as the inpaint pipelines' get_timesteps do
    batch = StockBatch(scheduler_class.from_config(config))
    schedule = RequestSchedule.of(reference, PipelineCalls({"num_inference_steps": 5}, begin_index=0))
    sample, noise, image = torch.randn(SHAPE), torch.randn(SHAPE), torch.randn(SHAPE)
    for t in reference.timesteps[:-1]:
        output = fake_model(sample, t, 0)
        expected = reference.step(output, t, sample, generator=step_noise(0), return_dict=False)[0]
        got = batch.step(output, sample, [schedule])
        sample = expected
        index = schedule.index
        assert torch.equal(batch.scale_noise(image, noise, [schedule]),
                           reference.scale_noise(image, torch.tensor([reference.timesteps[index]]), noise))
        if "stochastic" not in str(config):
            assert torch.equal(got, expected)


def test_the_calls_that_set_a_schedule_survive_json_and_make_the_same_scheduler():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config({**published.FLUX_SCHEDULER, "stochastic_sampling": True})
    sigmas = np.linspace(1.0, 1 / 7, 7)  # what the Flux pipelines give, with their mu
    encoded = encode_arguments(scheduler.set_timesteps, (), {"sigmas": sigmas, "mu": np.float64(0.7), "device": "cpu"})
    assert "device" not in encoded
    assert json.loads(json.dumps(encoded)) == encoded
    decoded = decode_arguments(json.loads(json.dumps(encoded)))
    assert isinstance(decoded["sigmas"], np.ndarray) and np.array_equal(decoded["sigmas"], sigmas)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(sigmas=sigmas, mu=0.7)
    calls = PipelineCalls(encoded, generator_state=step_noise(3).get_state())
    schedule = RequestSchedule.of(reference, PipelineCalls.from_header(json.loads(json.dumps(calls.header())),
                                                                       calls.generator_state))
    own = StockBatch(scheduler).own(schedule, "cpu")
    assert torch.equal(own.sigmas, reference.sigmas) and torch.equal(own.timesteps, reference.timesteps)
    assert torch.equal(torch.randn(3, generator=schedule.generator), torch.randn(3, generator=step_noise(3)))
    with pytest.raises(NotImplementedError, match="object"):
        encode_arguments(scheduler.set_timesteps, (4,), {"mu": object()})


def test_a_vectorised_stepper_refuses_a_request_prepared_on_other_sigmas():
    """Euler with Karras sigmas and without share their class and timestep count: the sigmas tell them apart."""
    prepared_by = EulerDiscreteScheduler.from_config({**published.SDXL_SCHEDULER, "use_karras_sigmas": True})
    prepared_by.set_timesteps(6)
    schedule = RequestSchedule.of(prepared_by, PipelineCalls({"num_inference_steps": 6}))
    BatchScheduler.for_scheduler(copy.deepcopy(prepared_by)).admit(schedule, "cpu")
    with pytest.raises(RuntimeError, match="another schedule"):
        BatchScheduler.for_scheduler(EulerDiscreteScheduler.from_config(published.SDXL_SCHEDULER)).admit(schedule,
                                                                                                          "cpu")


def test_calls_that_name_a_generator_without_its_state_are_refused():
    calls = PipelineCalls({"num_inference_steps": 3}, generator_state=step_noise(0).get_state())
    with pytest.raises(ValueError, match="generator"):
        PipelineCalls.from_header(calls.header(), None)


def test_a_schedulers_description_is_the_same_before_and_after_it_makes_a_schedule():
    """DPMSolverSinglestep settles lower_order_final in set_timesteps: a fingerprint taken before the first
    edit must equal one taken after it."""
    from diffusers import DPMSolverSinglestepScheduler

    from retouch.models.samplers import describe, from_description

    scheduler = DPMSolverSinglestepScheduler.from_config({**published.SDXL_SCHEDULER, "lower_order_final": False,
                                                          "final_sigmas_type": "zero"})
    before = describe(scheduler)
    scheduler.set_timesteps(5)
    assert describe(scheduler) == before
    rebuilt = from_description(before)
    assert type(rebuilt) is DPMSolverSinglestepScheduler and describe(rebuilt) == before


def test_a_scheduler_set_up_otherwise_than_the_pipeline_that_prepared_the_request_is_refused():
    """A helper on other scheduler settings than its worker (another --scheduler): refused at the first
    step, not stepped on another schedule."""
    prepared_by = DPMSolverMultistepScheduler.from_config({**published.SDXL_SCHEDULER, "use_karras_sigmas": True})
    prepared_by.set_timesteps(6)
    schedule = RequestSchedule.of(prepared_by, PipelineCalls({"num_inference_steps": 6}))
    batch = StockBatch(DPMSolverMultistepScheduler.from_config(published.SDXL_SCHEDULER))
    with pytest.raises(RuntimeError, match="another schedule"):
        batch.step(torch.zeros(SHAPE), torch.zeros(SHAPE), [schedule])


def test_trials_never_touch_the_live_scheduler_a_preparation_has_shadowed():
    """While a pipeline runs, `recipes.prepare` shadows its scheduler's set_timesteps with a wrapper bound
    to it; a trial made meanwhile (a step check, the calls line, the fingerprint) must not call it."""
    from retouch.models.samplers import calls_line, describe, steps_error

    live = DPMSolverMultistepScheduler.from_config(published.SDXL_SCHEDULER)
    live.set_timesteps(28)
    calls = []
    original = live.set_timesteps

    def shadow(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    live.set_timesteps = shadow
    assert steps_error(live, 7) is None and calls_line(live) == (1, 0) and describe(live)
    assert calls == [] and len(live.timesteps) == 28


def test_calls_line_of_a_sampler_that_makes_too_few_steps_is_none():
    from retouch.models.samplers import calls_line

    assert calls_line(LCMScheduler.from_config({**published.SDXL_SCHEDULER, "original_inference_steps": 16})) == (1, 0)
    assert calls_line(LCMScheduler.from_config({**published.SDXL_SCHEDULER, "original_inference_steps": 1})) is None


def test_a_description_with_numpy_settings_rebuilds_the_same_scheduler():
    from retouch.models.samplers import describe, from_description

    betas = np.linspace(0.0001, 0.02, 1000)
    scheduler = DDIMScheduler.from_config({**published.SD2_SCHEDULER, "trained_betas": betas})
    rebuilt = from_description(describe(scheduler))
    scheduler.set_timesteps(5)
    rebuilt.set_timesteps(5)
    assert torch.equal(rebuilt.alphas_cumprod, scheduler.alphas_cumprod)
    assert describe(rebuilt) == describe(scheduler)
