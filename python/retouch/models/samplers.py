"""Choosing the scheduler (sampler) a pipeline runs: `--scheduler NAME[:KEY=VALUE,...]`.

NAME is a diffusers scheduler class (`DPMSolverMultistepScheduler`) or one of the names below, which
follow the A1111/k-diffusion names diffusers' scheduler documentation maps to its classes; KEY=VALUE
pairs are the class's own settings (`use_karras_sigmas=true`, `timestep_spacing=trailing`), read as
JSON where they parse as JSON and as text otherwise. The new scheduler takes the pipeline's own
scheduler settings first (`from_config`: its beta schedule, prediction type, ...), as diffusers'
documentation swaps schedulers, and must be one the pipeline's scheduler lists as compatible.

The choice is per model, not per request: a template's recorded activations are those of one
schedule, so every edit of it runs that schedule.
"""

from __future__ import annotations

import inspect
import json

import diffusers
import torch

from retouch.errors import ModelError

# name -> (diffusers class, settings over the pipeline's)
ALIASES: dict[str, tuple[str, dict]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "dpm2": ("KDPM2DiscreteScheduler", {}),
    "dpm2-a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpm++2m": ("DPMSolverMultistepScheduler", {}),
    "dpm++2m-karras": ("DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    "dpm++2m-sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpm++2m-sde-karras": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++",
                                                           "use_karras_sigmas": True}),
    "ddim": ("DDIMScheduler", {}),
    "plms": ("PNDMScheduler", {"skip_prk_steps": True}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "lcm": ("LCMScheduler", {}),
    "flow-euler": ("FlowMatchEulerDiscreteScheduler", {}),
    "flow-heun": ("FlowMatchHeunDiscreteScheduler", {}),
}


def parse_scheduler(spec: str) -> tuple[str, dict]:
    """`NAME[:KEY=VALUE,...]` -> (diffusers class name, settings). Raises ModelError naming what is wrong."""
    name, _, settings_text = spec.strip().partition(":")
    name = name.strip()
    if name in ALIASES:
        class_name, settings = ALIASES[name][0], dict(ALIASES[name][1])
    else:
        class_name, settings = name, {}
    scheduler_class = getattr(diffusers, class_name, None)
    if type(scheduler_class).__name__ == "DummyObject":  # diffusers' stand-in for a class whose package is missing
        try:
            scheduler_class()
        except ImportError as error:
            raise ModelError(f"--scheduler {name}: {' '.join(str(error).split())}") from None
    if not (isinstance(scheduler_class, type) and issubclass(scheduler_class, diffusers.SchedulerMixin)):
        raise ModelError(f"--scheduler {name!r} is neither a diffusers scheduler class nor one of "
                         f"{', '.join(ALIASES)}")
    accepted = inspect.signature(scheduler_class.__init__).parameters
    for pair in filter(None, (pair.strip() for pair in settings_text.split(","))):
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ModelError(f"--scheduler settings are KEY=VALUE pairs separated by commas; got {pair!r}")
        if key not in accepted or key == "self":
            raise ModelError(f"--scheduler: {class_name} has no setting {key!r}; it has "
                             f"{', '.join(k for k in accepted if k not in ('self', 'kwargs'))}")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value.strip()
    return class_name, settings


def with_scheduler(pipe, spec: str, family: str) -> None:
    """Give `pipe` (of `family`) the scheduler `spec` names, built on its current scheduler's settings."""
    pipe.scheduler = choose_scheduler(pipe.scheduler, spec, family, type(pipe).__name__)


def choose_scheduler(current, spec: str, family: str, pipeline_class: str):
    """The scheduler `spec` names, built on `current`'s settings, for a `pipeline_class` of `family`.
    Raises ModelError when it cannot drive that pipeline reproducibly."""
    class_name, settings = parse_scheduler(spec)
    compatible = {type(current).__name__} | {c.__name__ for c in getattr(current, "compatibles", ())}
    if type(current).__name__.startswith("FlowMatch"):  # diffusers lists none for its flow-matching schedulers
        compatible |= {name for name in dir(diffusers) if name.startswith("FlowMatch") and name.endswith("Scheduler")}
    compatible = sorted(compatible)
    if class_name not in compatible:
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}; its scheduler "
                         f"({type(current).__name__}) is compatible with {', '.join(compatible)}")
    takes = inspect.signature(getattr(diffusers, class_name).set_timesteps).parameters
    if family.startswith("flux") and "sigmas" not in takes:
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}: Flux pipelines give "
                         "their scheduler custom sigmas, which its set_timesteps does not take")
    try:
        scheduler = getattr(diffusers, class_name).from_config(current.config, **settings)
        # A setting a scheduler refuses only once it makes a schedule (a bad spacing) is found here, at
        # load, rather than in the first edit.
        noisy = draws_noise(scheduler)
    except (ValueError, TypeError, KeyError, NotImplementedError, ImportError) as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelError(f"--scheduler {spec}: {detail}") from None
    if noisy and family in GENERATORLESS:
        raise ModelError(f"--scheduler {spec} draws noise as it steps, and the {pipeline_class} gives its "
                         "scheduler no generator: an edit would not repeat from its seed. Pick one that does not "
                         "(flow-euler, flow-heun)")
    return scheduler


# Families whose diffusers pipelines call `scheduler.step` without a generator (the UNet pipelines pass
# theirs through `prepare_extra_step_kwargs`): a noise-drawing sampler there draws from torch's global
# generator.
GENERATORLESS = ("flux-fill", "flux-inpaint", "sd3")


def draws_noise(scheduler) -> bool:
    """Whether `scheduler`'s first step of four draws random numbers: stepped twice from the same sample
    under two global seeds, on a copy, leaving torch's global generator as it was."""
    results = []
    for seed in (0, 1):
        trial = type(scheduler).from_config(scheduler.config)
        # Flux's dynamic shifting wants the `mu` its pipelines give.
        trial.set_timesteps(4, **({"mu": 1.0} if scheduler.config.get("use_dynamic_shifting") else {}))
        sample = torch.ones(1, 4, 2, 2)
        model_input = trial.scale_model_input(sample, trial.timesteps[0]) if hasattr(trial, "scale_model_input") \
            else sample
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            results.append(trial.step(model_input * 0.5, trial.timesteps[0], sample, return_dict=False)[0])
    return not torch.equal(*results)


def describe(scheduler) -> str:
    """The scheduler's class and the settings that make its schedule, as one line of JSON (what a
    recording was made under: part of the model's fingerprint)."""
    config = {key: value for key, value in dict(scheduler.config).items() if not key.startswith("_")}
    return json.dumps({"class": type(scheduler).__name__, "config": config}, sort_keys=True, default=str)
