"""Vectorised diffusion schedulers: one step for a batch of requests, each at its own point of its own
schedule (continuous batching, paper §4.3).

A diffusers scheduler keeps one `_step_index` (and PNDM one history), so one instance cannot serve
requests that joined at different steps. Here a request's schedule is a `RequestSchedule` (computed by
a fresh diffusers scheduler of the model's class and config, so the timesteps and sigmas are exactly
diffusers'), and `step` advances a batch of them with batched tensor arithmetic that repeats diffusers'
own operations in the same order and dtypes, so each request's trajectory equals stepping its own
diffusers scheduler. Vectorised:

    FlowMatchEulerDiscreteScheduler   Flux, SD3 (deterministic)
    EulerDiscreteScheduler            SDXL (epsilon or v prediction)
    PNDMScheduler (skip_prk_steps)    SD2

Every other diffusers scheduler (DPM-Solver++, UniPC, DDIM, Heun, LCM, the ancestral and SDE samplers,
...) runs through `StockBatch`: each request steps its own copy of the pipeline's scheduler, set up by
the same calls the pipeline made (`PipelineCalls`) and given the generator the pipeline would give it,
so its trajectory is the stock pipeline's by construction, at the price of one small call per request
per step.
"""

from __future__ import annotations

import copy
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class PipelineCalls:
    """What a pipeline asked of its scheduler for one request before its first step: enough to make the
    request's own copy of the scheduler elsewhere (`StockBatch`), in the state the pipeline's loop sees.

    set_timesteps:    the keyword arguments of its `set_timesteps` call (JSON: `encode_arguments`), device left out
    begin_index:      what it gave `set_begin_index`, if it called it
    step_kwargs:      the extra keyword arguments its loop gives `step` (eta), generator left out
    generator_state:  the state of the generator its loop gives `step`, as it stands at the first step (CPU
                      generators: a uint8 tensor); None when it gives none
    scales_input:     whether its loop calls `scale_model_input` (the UNet pipelines do, Flux and SD3 do not)
    """

    set_timesteps: dict
    begin_index: int | None = None
    step_kwargs: dict = field(default_factory=dict)
    generator_state: torch.Tensor | None = None
    scales_input: bool = False

    def header(self) -> dict:
        return {"set_timesteps": self.set_timesteps, "begin_index": self.begin_index,
                "step_kwargs": self.step_kwargs, "generator": self.generator_state is not None,
                "scales_input": self.scales_input}

    @classmethod
    def from_header(cls, header: dict, generator_state: torch.Tensor | None) -> PipelineCalls:
        if header["generator"] and generator_state is None:
            raise ValueError("the request's calls name a generator whose state did not come with them")
        return cls(header["set_timesteps"], header["begin_index"], header["step_kwargs"],
                   generator_state if header["generator"] else None, header["scales_input"])

    def scheduler(self, template, device: torch.device | str):
        """A copy of `template` set up by these calls, as the pipeline's was before its first step."""
        own = copy.deepcopy(template)
        own.set_timesteps(**decode_arguments(self.set_timesteps), device=device)
        if self.begin_index is not None:
            own.set_begin_index(self.begin_index)
        return own


def encode_arguments(function, args: tuple, kwargs: dict) -> dict:
    """A scheduler call's arguments by name, as JSON (`decode_arguments` gives them back): numbers, None,
    strings, lists, and numpy arrays or tensors of numbers; `device` is left out (the stepping process
    gives its own). Anything else is refused, naming it."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    encoded = {}
    for name, value in bound.arguments.items():
        if name == "device":
            continue
        if isinstance(value, (np.ndarray, torch.Tensor)):
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            encoded[name] = {"array": array.tolist(), "dtype": str(array.dtype),
                             "tensor": isinstance(value, torch.Tensor)}
        elif isinstance(value, np.generic):
            encoded[name] = value.item()
        elif value is None or isinstance(value, (bool, int, float, str)):
            encoded[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, np.number)) for v in value):
            encoded[name] = [v.item() if isinstance(v, np.generic) else v for v in value]
        else:
            raise NotImplementedError(f"{getattr(function, '__qualname__', function)} was given {name} of type "
                                      f"{type(value).__name__}, which the engine cannot pass between processes")
    return encoded


def decode_arguments(encoded: dict) -> dict:
    decoded: dict[str, Any] = {}
    for name, value in encoded.items():
        if isinstance(value, dict):
            array = np.array(value["array"], dtype=value["dtype"])
            decoded[name] = torch.from_numpy(array) if value["tensor"] else array
        else:
            decoded[name] = value
    return decoded


@dataclass(eq=False)
class RequestSchedule:
    """One request's schedule and its position in it.

    timesteps:  the timestep the denoiser is given at each step (diffusers' `scheduler.timesteps`; PNDM
                without PRK steps makes one more denoiser call than `num_inference_steps`)
    sigmas:     [len(timesteps) + 1] noise levels (flow matching and Euler schedulers); None for PNDM
    index:      the step it is at, of the whole schedule (the recording's step it reads)
    start:      the step it started at: 0, or later below strength 1 (`retouch.strength`)
    """

    timesteps: torch.Tensor
    sigmas: torch.Tensor | None
    num_inference_steps: int
    init_noise_sigma: float = 1.0
    index: int = 0
    start: int = 0
    # PNDM's multistep history: previous model outputs, steps taken, the sample of its first step.
    ets: list[torch.Tensor] = field(default_factory=list)
    counter: int = 0
    cur_sample: torch.Tensor | None = None
    # StockBatch: how the pipeline set its scheduler up, and (made as the request joins, in the process
    # that steps it) the request's own copy of that scheduler and of the generator its steps draw from.
    calls: PipelineCalls | None = None
    own: Any = None
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, scheduler, calls: PipelineCalls | None = None, start: int = 0) -> RequestSchedule:
        """The schedule a diffusers scheduler holds after `set_timesteps` (as a pipeline set it up), the
        calls that set it up, and the step its pipeline's loop starts at."""
        begin = getattr(scheduler, "begin_index", None)
        if begin is not None and begin != start:
            raise ValueError(f"the pipeline's loop starts at step {start}, its scheduler at {begin}")
        sigmas = getattr(scheduler, "sigmas", None)
        return cls(timesteps=scheduler.timesteps.clone(),
                   sigmas=sigmas.clone() if isinstance(sigmas, torch.Tensor) else None,
                   num_inference_steps=scheduler.num_inference_steps,
                   init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)), calls=calls,
                   index=start, start=start)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def calls_made(self) -> int:
        """Denoiser calls taken so far: its progress (k of `calls_in_all`)."""
        return self.index - self.start

    @property
    def calls_in_all(self) -> int:
        return self.num_steps - self.start

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
        self._made: dict[str, object] = {}  # a request's calls (JSON) -> the schedule they make here, on the CPU

    @classmethod
    def for_scheduler(cls, scheduler) -> BatchScheduler:
        """The vectorised stepper of `scheduler`'s class and settings, else `StockBatch`."""
        config, name = scheduler.config, type(scheduler).__name__
        if name == "FlowMatchEulerDiscreteScheduler" and not config.get("stochastic_sampling", False):
            return FlowMatchEulerBatch(scheduler)
        if name == "EulerDiscreteScheduler" and config.prediction_type in ("epsilon", "v_prediction"):
            return EulerBatch(scheduler)
        if name == "PNDMScheduler" and config.skip_prk_steps:
            return PNDMBatch(scheduler)
        return StockBatch(scheduler)

    def schedule(self, num_inference_steps: int, device: torch.device | str = "cpu",
                 generator: torch.Generator | None = None, **set_timesteps) -> RequestSchedule:
        """A request's schedule, as `set_timesteps(num_inference_steps, **set_timesteps)` makes it, its
        steps drawing from `generator` (a CPU generator) if its `step` takes one, as the UNet pipelines'
        `prepare_extra_step_kwargs` decide."""
        scheduler = copy.deepcopy(self.template)
        scheduler.set_timesteps(num_inference_steps, device=device, **set_timesteps)
        takes_generator = "generator" in inspect.signature(scheduler.step).parameters
        calls = PipelineCalls(
            encode_arguments(scheduler.set_timesteps, (num_inference_steps,), set_timesteps),
            generator_state=generator.get_state() if generator is not None and takes_generator else None,
            scales_input=hasattr(scheduler, "scale_model_input"))
        return RequestSchedule.of(scheduler, calls)

    def admit(self, schedule: RequestSchedule, device: torch.device | str) -> None:
        """Check, as a request joins, that this process's scheduler makes the schedule the pipeline
        that prepared it made (a helper on other settings would otherwise step it on its own
        schedule); raises for that request alone."""
        if schedule.calls is None:
            return
        key = json.dumps([schedule.calls.set_timesteps, schedule.calls.begin_index], sort_keys=True)
        if key not in self._made:  # requests of one step count and size share it
            if len(self._made) >= 256:  # sizes (Flux's mu) times step counts: keep the newest
                del self._made[next(iter(self._made))]
            self._made[key] = schedule.calls.scheduler(self.template, "cpu")
        self._check(self._made[key], schedule)

    @staticmethod
    def _check(made, schedule: RequestSchedule) -> None:
        """`made`, a scheduler set up by the request's calls here, makes the schedule it came with."""
        sigmas = getattr(made, "sigmas", None)
        if not torch.equal(made.timesteps.cpu(), schedule.timesteps.cpu()) or (
                schedule.sigmas is not None and isinstance(sigmas, torch.Tensor)
                and not torch.equal(sigmas.cpu(), schedule.sigmas.cpu())):
            raise RuntimeError(f"{type(made).__name__} here makes another schedule than the pipeline that prepared "
                               "the request: are both processes on the same scheduler settings?")

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


class StockBatch(BatchScheduler):
    """Any diffusers scheduler: each request steps its own copy of the pipeline's scheduler, made by the
    calls its pipeline made (`RequestSchedule.calls`), with the same arguments the pipeline's loop gives
    it, one request at a time. Exactly the stock pipeline's arithmetic (and draws, for the schedulers that
    add noise: each request has its own generator, in the state the pipeline's loop would find it)."""

    def admit(self, schedule: RequestSchedule, device: torch.device | str) -> None:
        self.own(schedule, device)

    def own(self, schedule: RequestSchedule, device: torch.device | str):
        """The request's scheduler, made as it joins (`admit`) in the process that steps it."""
        if schedule.own is None:
            calls = schedule.calls
            if calls is None:
                raise ValueError(f"a {type(self.template).__name__} request needs the calls that set up its schedule")
            own = calls.scheduler(self.template, device)
            self._check(own, schedule)
            if calls.generator_state is not None:
                schedule.generator = torch.Generator("cpu")
                schedule.generator.set_state(calls.generator_state.cpu())
            schedule.own = own
        return schedule.own

    def scale_model_input(self, samples, schedules):
        if not schedules or schedules[0].calls is None or not schedules[0].calls.scales_input:
            return samples
        return torch.cat([self.own(s, samples.device).scale_model_input(samples[i:i + 1], s.timestep)
                          for i, s in enumerate(schedules)])

    def step(self, model_output, samples, schedules):
        stepped = []
        for i, schedule in enumerate(schedules):
            own = self.own(schedule, samples.device)
            kwargs = dict(schedule.calls.step_kwargs)
            if schedule.generator is not None:
                kwargs["generator"] = [schedule.generator]  # as the pipeline gives its one request's generators
            stepped.append(own.step(model_output[i:i + 1], schedule.timestep, samples[i:i + 1], **kwargs,
                                    return_dict=False)[0])
            schedule.index += 1
        return torch.cat(stepped)

    def scale_noise(self, samples: torch.Tensor, noise: torch.Tensor, schedules: Sequence[RequestSchedule],
                    ahead: int = 0) -> torch.Tensor:
        """The inpaint pipelines' re-noise of the template's latents at each request's step index + `ahead`,
        through the request's own scheduler (which has stepped as far as the pipeline's has then)."""
        return torch.cat([self.own(s, samples.device).scale_noise(samples[i:i + 1], s.timesteps[s.index + ahead:][:1],
                                                                   noise[i:i + 1])
                          for i, s in enumerate(schedules)])
