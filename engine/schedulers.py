"""Vectorised diffusion schedulers: one step for a batch of requests, each at its own point of its own
schedule (continuous batching, paper §4.3).

A diffusers scheduler keeps one `_step_index` (and PNDM one history), so one instance cannot serve
requests that joined at different steps. Here a request's schedule is a `RequestSchedule` (computed by
a fresh diffusers scheduler of the model's class and config, so the timesteps and sigmas are exactly
diffusers'), and `step` advances a batch of them with batched tensor arithmetic that repeats diffusers'
own operations in the same order and dtypes, so each request's trajectory equals stepping its own
diffusers scheduler.

    FlowMatchEulerDiscreteScheduler   Flux, SD3
    EulerDiscreteScheduler            SDXL
    PNDMScheduler (skip_prk_steps)    SD2
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class RequestSchedule:
    """One request's schedule and its position in it.

    timesteps:  the timestep the denoiser is given at each step (diffusers' `scheduler.timesteps`; PNDM
                without PRK steps makes one more denoiser call than `num_inference_steps`)
    sigmas:     [len(timesteps) + 1] noise levels (flow matching and Euler schedulers); None for PNDM
    index:      steps taken so far
    """

    timesteps: torch.Tensor
    sigmas: torch.Tensor | None
    num_inference_steps: int
    init_noise_sigma: float = 1.0
    index: int = 0
    # PNDM's multistep history: previous model outputs, steps taken, the sample of its first step.
    ets: list[torch.Tensor] = field(default_factory=list)
    counter: int = 0
    cur_sample: torch.Tensor | None = None

    @classmethod
    def of(cls, scheduler) -> RequestSchedule:
        """The schedule a diffusers scheduler holds after `set_timesteps` (as a pipeline set it up)."""
        begin = getattr(scheduler, "begin_index", None) or 0
        sigmas = getattr(scheduler, "sigmas", None)
        if begin:
            raise NotImplementedError("schedules that start part-way (strength < 1) are not batched")
        return cls(timesteps=scheduler.timesteps.clone(), sigmas=None if sigmas is None else sigmas.clone(),
                   num_inference_steps=scheduler.num_inference_steps,
                   init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)))

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.index >= self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]


class BatchScheduler(ABC):
    """Steps a batch of requests; built from the pipeline's own scheduler (`for_scheduler`)."""

    def __init__(self, scheduler):
        self.template = copy.deepcopy(scheduler)

    @classmethod
    def for_scheduler(cls, scheduler) -> BatchScheduler:
        kinds = {"FlowMatchEulerDiscreteScheduler": FlowMatchEulerBatch, "EulerDiscreteScheduler": EulerBatch,
                 "PNDMScheduler": PNDMBatch}
        kind = kinds.get(type(scheduler).__name__)
        if kind is None:
            raise NotImplementedError(f"no batched {type(scheduler).__name__}; supported: {', '.join(kinds)}")
        return kind(scheduler)

    def schedule(self, num_inference_steps: int, device: torch.device | str = "cpu", **set_timesteps) -> RequestSchedule:
        """A request's schedule, as `set_timesteps(num_inference_steps, **set_timesteps)` makes it."""
        scheduler = copy.deepcopy(self.template)
        scheduler.set_timesteps(num_inference_steps, device=device, **set_timesteps)
        return RequestSchedule.of(scheduler)

    def timesteps(self, schedules: Sequence[RequestSchedule]) -> torch.Tensor:
        """[B] each request's current timestep."""
        return torch.stack([s.timestep for s in schedules])

    def scale_model_input(self, samples: torch.Tensor, schedules: Sequence[RequestSchedule]) -> torch.Tensor:
        return samples

    @abstractmethod
    def step(self, model_output: torch.Tensor, samples: torch.Tensor,
             schedules: Sequence[RequestSchedule]) -> torch.Tensor:
        """`samples: [B, ...]` one step on; advances every schedule by one."""


def _per_row(values: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[B] scalars as [B, 1, ..., 1] broadcasting over `like: [B, ...]`."""
    return torch.stack(list(values)).to(like.device).view(-1, *[1] * (like.dim() - 1))


class FlowMatchEulerBatch(BatchScheduler):
    """diffusers' FlowMatchEulerDiscreteScheduler.step (deterministic): x + (sigma_next - sigma) * v."""

    def step(self, model_output, samples, schedules):
        sigma = _per_row([s.sigmas[s.index] for s in schedules], samples)
        sigma_next = _per_row([s.sigmas[s.index + 1] for s in schedules], samples)
        dt = sigma_next - sigma
        # diffusers multiplies by a 0-d float32 tensor, which computes in model_output's dtype.
        prev = samples.to(torch.float32) + dt.to(model_output.dtype) * model_output
        for s in schedules:
            s.index += 1
        return prev.to(model_output.dtype)

    def scale_noise(self, samples: torch.Tensor, noise: torch.Tensor, schedules: Sequence[RequestSchedule],
                    ahead: int = 0) -> torch.Tensor:
        """sigma * noise + (1 - sigma) * sample at each request's step index + `ahead` (inpaint blending)."""
        sigma = _per_row([s.sigmas[s.index + ahead] for s in schedules], samples).to(samples.dtype)
        return sigma * noise + (1.0 - sigma) * samples


class EulerBatch(BatchScheduler):
    """diffusers' EulerDiscreteScheduler (s_churn = 0, epsilon or v prediction)."""

    def scale_model_input(self, samples, schedules):
        sigma = _per_row([s.sigmas[s.index] for s in schedules], samples)
        return samples / ((sigma ** 2 + 1) ** 0.5)

    def step(self, model_output, samples, schedules):
        prediction = self.template.config.prediction_type
        sigma = _per_row([s.sigmas[s.index] for s in schedules], samples)
        sigma_next = _per_row([s.sigmas[s.index + 1] for s in schedules], samples)
        samples = samples.to(torch.float32)
        sigma_hat = sigma * (0.0 + 1)  # gamma = 0 without churn
        if prediction == "epsilon":
            pred_original = samples - sigma_hat.to(model_output.dtype) * model_output
        elif prediction == "v_prediction":
            pred_original = (model_output * (-sigma / (sigma ** 2 + 1) ** 0.5).to(model_output.dtype)
                             + (samples / (sigma ** 2 + 1)))
        else:
            raise NotImplementedError(f"EulerDiscreteScheduler prediction_type {prediction!r}")
        derivative = (samples - pred_original) / sigma_hat
        prev = samples + derivative * (sigma_next - sigma_hat)
        for s in schedules:
            s.index += 1
        return prev.to(model_output.dtype)


class PNDMBatch(BatchScheduler):
    """diffusers' PNDMScheduler with skip_prk_steps (pseudo linear multistep, as SD 2 runs it)."""

    def __init__(self, scheduler):
        if not scheduler.config.skip_prk_steps:
            raise NotImplementedError("batched PNDM runs the PLMS steps only (skip_prk_steps=True)")
        super().__init__(scheduler)

    def step(self, model_output, samples, schedules):
        config, template = self.template.config, self.template
        outputs, inputs, coefficients = [], [], []
        for row, schedule in enumerate(schedules):
            output, sample = model_output[row], samples[row]
            stride = config.num_train_timesteps // schedule.num_inference_steps
            timestep = int(schedule.timestep)
            prev_timestep = timestep - stride
            if schedule.counter != 1:
                schedule.ets = schedule.ets[-3:] + [output]
            else:
                prev_timestep, timestep = timestep, timestep + stride
            ets = schedule.ets
            if len(ets) == 1 and schedule.counter == 0:
                schedule.cur_sample = sample
            elif len(ets) == 1 and schedule.counter == 1:
                output = (output + ets[-1]) / 2
                sample, schedule.cur_sample = schedule.cur_sample, None
            elif len(ets) == 2:
                output = (3 * ets[-1] - ets[-2]) / 2
            elif len(ets) == 3:
                output = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
            else:
                output = (1 / 24) * (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4])
            alpha_t = template.alphas_cumprod[timestep]
            alpha_prev = template.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else template.final_alpha_cumprod
            if config.prediction_type == "v_prediction":
                output = (alpha_t ** 0.5) * output + ((1 - alpha_t) ** 0.5) * sample
            denominator = alpha_t * (1 - alpha_prev) ** 0.5 + (alpha_t * (1 - alpha_t) * alpha_prev) ** 0.5
            coefficients.append(((alpha_prev / alpha_t) ** 0.5, alpha_prev - alpha_t, denominator))
            outputs.append(output)
            inputs.append(sample)
            schedule.counter += 1
            schedule.index += 1
        output, sample = torch.stack(outputs), torch.stack(inputs)
        sample_coeff, difference, denominator = (_per_row([c[k] for c in coefficients], sample) for k in range(3))
        return sample_coeff * sample - difference * output / denominator
