"""Choosing the scheduler (sampler) a pipeline runs: `--scheduler NAME[:KEY=VALUE,...]`.

NAME is a diffusers scheduler class (`DPMSolverMultistepScheduler`) or one of the names below, which
follow the A1111/k-diffusion names diffusers' scheduler documentation maps to its classes; KEY=VALUE
pairs are the class's own settings (`use_karras_sigmas=true`, `timestep_spacing=trailing`), read as
the type of the setting's default (true/false, numbers, text; none for None). The new scheduler takes
the pipeline's own scheduler settings first (`from_config`: its beta schedule, prediction type, ...),
as diffusers' documentation swaps schedulers, and must be one the pipeline's scheduler lists as
compatible (or, for UNets, LCM and TCD, which diffusers leaves off that list).

The choice is per model, not per request: a template's recorded activations are those of one
schedule, so every edit of it runs that schedule.
"""

from __future__ import annotations

import copy
import inspect
import json

import diffusers
import torch

from ..errors import ModelError
from .quiet import quiet_libraries

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
    if name.lower() in ALIASES:
        class_name, settings = ALIASES[name.lower()][0], dict(ALIASES[name.lower()][1])
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
    accepted = {key: parameter for key, parameter in inspect.signature(scheduler_class.__init__).parameters.items()
                if key not in ("self", "kwargs")}
    for pair in filter(None, (pair.strip() for pair in settings_text.split(","))):
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ModelError(f"--scheduler settings are KEY=VALUE pairs separated by commas; got {pair!r}")
        if key not in accepted:
            raise ModelError(f"--scheduler: {class_name} has no setting {key!r}; it has {', '.join(accepted)}")
        settings[key] = _setting(class_name, key, value.strip(), accepted[key].default)
    return class_name, settings


def _setting(class_name: str, key: str, text: str, default):
    """A setting's text as the type of its default: a bool as true/false, a number as a number, text as
    text; none for None; JSON where the default is None or a list."""
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if isinstance(default, bool):
        if lowered in ("true", "false"):
            return lowered == "true"
    elif isinstance(default, (int, float)):
        try:
            number = json.loads(text)
        except json.JSONDecodeError:
            number = None
        if isinstance(number, int) and not isinstance(number, bool):
            return number if isinstance(default, int) else float(number)
        if isinstance(number, float) and isinstance(default, float):
            return number
    elif isinstance(default, str):
        return text
    else:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    kind = "true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int) else "a number"
    raise ModelError(f"--scheduler: {class_name}'s {key} is {kind}, got {text!r}")


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
    else:  # nor the consistency samplers of LCM- and TCD-distilled UNets (LCM-LoRA)
        compatible |= {"LCMScheduler", "TCDScheduler"}
    compatible = sorted(compatible)
    if class_name not in compatible:
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}; its scheduler "
                         f"({type(current).__name__}) is compatible with {', '.join(compatible)}")
    takes = inspect.signature(getattr(diffusers, class_name).set_timesteps).parameters
    if family.startswith("flux") and "sigmas" not in takes:
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}: Flux pipelines give "
                         "their scheduler custom sigmas, which its set_timesteps does not take")
    try:
        with quiet_libraries():  # diffusers warns of every setting of the old scheduler the new one lacks
            scheduler = getattr(diffusers, class_name).from_config(current.config, **settings)
        check_reproducible(scheduler, family, pipeline_class)
    except (ValueError, TypeError, KeyError, NotImplementedError, ImportError) as error:
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelError(f"--scheduler {spec}: {detail}") from None
    return scheduler


# Families whose diffusers pipelines call `scheduler.step` without a generator (the UNet pipelines pass
# theirs through `prepare_extra_step_kwargs`): a noise-drawing sampler there draws from torch's global
# generator.
GENERATORLESS = ("flux-fill", "flux-inpaint", "sd3")


def check_reproducible(scheduler, family: str, pipeline_class: str) -> None:
    """ModelError if `scheduler` draws noise as it steps from anything but the generator the pipeline gives
    it (none, in the Flux and SD3 pipelines): an edit would then not repeat from its seed, and an edit's
    unmasked tokens would leave the trajectory of the recording they read. Makes a trial schedule first,
    so that a setting refused only then (a bad spacing) is refused here, at load."""
    _trial(scheduler)
    takes_generator = "generator" in inspect.signature(scheduler.step).parameters
    if (family in GENERATORLESS or not takes_generator) and draws_noise(scheduler):
        instead = {"sd3": "flow-euler, flow-heun"}.get(family, "flow-euler" if family.startswith("flux") else
                                                       "dpm++2m-sde, euler-a")
        raise ModelError(f"the scheduler {type(scheduler).__name__} draws noise as it steps, and the {pipeline_class} "
                         "gives it no generator: an edit would not repeat from its seed. Choose one with --scheduler "
                         f"({instead})")


def _trial(scheduler):
    """A copy of `scheduler` that has made a four-step schedule (Flux's dynamic shifting wants the `mu`
    its pipelines give)."""
    trial = copy.deepcopy(scheduler)
    trial.set_timesteps(4, **({"mu": 1.0} if trial.config.get("use_dynamic_shifting") else {}))
    return trial


def draws_noise(scheduler) -> bool:
    """Whether `scheduler`'s first step of four draws random numbers: stepped twice from the same sample
    under two global seeds, on copies, leaving torch's global generator as it was."""
    results = []
    for seed in (0, 1):
        trial = _trial(scheduler)
        sample = torch.ones(1, 4, 2, 2)
        model_input = trial.scale_model_input(sample, trial.timesteps[0]) if hasattr(trial, "scale_model_input") \
            else sample
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            results.append(trial.step(model_input * 0.5, trial.timesteps[0], sample, return_dict=False)[0])
    return not torch.equal(*results)


def describe(scheduler) -> str:
    """The scheduler's class and the settings that make its schedule, as one line of JSON: what a
    recording was made under (part of the model's fingerprint) and what the helpers rebuild it from
    (`from_description`). Taken once it has made a schedule, since some schedulers settle a setting
    then (DPMSolverSinglestep's lower_order_final): the same before and after the first edit."""
    config = {key: value for key, value in dict(_trial(scheduler).config).items() if not key.startswith("_")}
    return json.dumps({"class": type(scheduler).__name__, "config": config}, sort_keys=True, default=str)


def from_description(description: str):
    """The scheduler `describe` described."""
    described = json.loads(description)
    with quiet_libraries():
        return getattr(diffusers, described["class"]).from_config(described["config"])
