"""Batched schedulers equal diffusers' own scheduler stepping for every request of a batch whose requests
joined at different steps with different step counts (continuous batching)."""

import copy

import pytest
import torch
from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, PNDMScheduler

from retouch.engine.schedulers import BatchScheduler, FlowMatchEulerBatch
from retouch.models import published

SCHEDULERS = {
    "flux": (FlowMatchEulerDiscreteScheduler, published.FLUX_SCHEDULER, {"mu": 0.8}),
    "sd3": (FlowMatchEulerDiscreteScheduler, published.SD3_SCHEDULER, {}),
    "sdxl": (EulerDiscreteScheduler, published.SDXL_SCHEDULER, {}),
    "sd2": (PNDMScheduler, published.SD2_SCHEDULER, {}),
    "sdxl-v": (EulerDiscreteScheduler, {**published.SDXL_SCHEDULER, "prediction_type": "v_prediction"}, {}),
}
SHAPE = (4, 6, 6)


def fake_model(sample: torch.Tensor, timestep: torch.Tensor, request: int) -> torch.Tensor:
    """A deterministic stand-in for the denoiser: depends on the sample, the timestep and the request."""
    return torch.tanh(sample * 0.7 + float(timestep) / 1000.0 + request * 0.1)


def reference_trajectory(scheduler_class, config, set_timesteps, steps: int, start: torch.Tensor, request: int):
    scheduler = scheduler_class.from_config(config)
    scheduler.set_timesteps(steps, **set_timesteps)
    sample = start * getattr(scheduler, "init_noise_sigma", 1.0)  # flow matching starts at the noise
    trajectory = []
    for t in scheduler.timesteps:
        scale = getattr(scheduler, "scale_model_input", None)  # flow matching has none
        model_input = sample if scale is None else scale(sample, t)
        sample = scheduler.step(fake_model(model_input, t, request), t, sample, return_dict=False)[0]
        trajectory.append(sample)
    return trajectory


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_batched_steps_equal_diffusers_per_request(name):
    scheduler_class, config, set_timesteps = SCHEDULERS[name]
    batch = BatchScheduler.for_scheduler(scheduler_class.from_config(config))
    generator = torch.Generator().manual_seed(0)
    # Request r joins at loop iteration joins[r] with its own step count: the batch is ragged in time.
    step_counts, joins = [5, 3, 7, 4], [0, 1, 1, 4]
    starts = [torch.randn(SHAPE, generator=generator) for _ in step_counts]
    expected = [reference_trajectory(scheduler_class, config, set_timesteps, n, start, r)
                for r, (n, start) in enumerate(zip(step_counts, starts))]
    running: dict[int, tuple] = {}
    got = {r: [] for r in range(len(step_counts))}
    iteration = 0
    while len(got) > sum(1 for r in got if len(got[r]) == len(expected[r])) or iteration == 0:
        for r, join in enumerate(joins):
            if join == iteration:
                schedule = batch.schedule(step_counts[r], **set_timesteps)
                running[r] = (schedule, starts[r] * schedule.init_noise_sigma)
        rows = sorted(running)
        if rows:
            schedules = [running[r][0] for r in rows]
            samples = torch.stack([running[r][1] for r in rows])
            timesteps = batch.timesteps(schedules)
            model_input = batch.scale_model_input(samples, schedules)
            output = torch.stack([fake_model(model_input[i], timesteps[i], r) for i, r in enumerate(rows)])
            samples = batch.step(output, samples, schedules)
            for i, r in enumerate(rows):
                got[r].append(samples[i])
                running[r] = (running[r][0], samples[i])
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
    sample, noise = torch.randn(1, *SHAPE), torch.randn(1, *SHAPE)
    expected = reference.scale_noise(sample, reference.timesteps[3:4], noise)
    assert torch.equal(batch.scale_noise(sample, noise, [schedule], ahead=1), expected)


def test_unsupported_scheduler_is_named():
    from diffusers import DDIMScheduler

    with pytest.raises(NotImplementedError, match="DDIMScheduler"):
        BatchScheduler.for_scheduler(DDIMScheduler())
