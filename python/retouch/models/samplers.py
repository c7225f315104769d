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

import hashlib
import inspect
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import diffusers
import torch

from ..errors import ModelError
from ..limits import MAX_STEPS
from .quiet import DropMessage, quiet_libraries

# name -> (diffusers class, settings over the pipeline's)
# A name means one sampler, whatever the pipeline was saved with: these settings, which tell one
# sampler of a class from another, start from the class's defaults under a name (a folder saved with
# DPM++ 2M SDE Karras asked for "dpm++2m" gets DPM++ 2M). A class name keeps them as saved.
SAMPLER_SETTINGS = ("algorithm_type", "solver_order", "solver_type", "use_karras_sigmas", "use_exponential_sigmas",
                    "use_beta_sigmas", "use_lu_lambdas", "stochastic_sampling")
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
    class_name, settings = ALIASES.get(name.lower(), (name, {}))
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
    if name.lower() in ALIASES:
        settings = {**{key: accepted[key].default for key in SAMPLER_SETTINGS if key in accepted}, **settings}
    # Pairs split at a comma that starts the next KEY=, so that a list value keeps its commas.
    given = set()
    for pair in filter(None, (pair.strip() for pair in re.split(r",(?=\s*\w+\s*=)", settings_text))):
        key, equals, value = pair.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ModelError(f"--scheduler settings are KEY=VALUE pairs separated by commas; got {pair!r}")
        if key in given:  # which of them was meant is not ours to guess
            raise ModelError(f"--scheduler: {key} is set twice; set it once")
        given.add(key)
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
        try:  # "trailing" quoted as JSON is trailing
            quoted = json.loads(text)
        except json.JSONDecodeError:
            return text
        return quoted if isinstance(quoted, str) else text
    else:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    kind = "true or false" if isinstance(default, bool) else "an integer" if isinstance(default, int) else "a number"
    raise ModelError(f"--scheduler: {class_name}'s {key} is {kind}, got {text!r}")


def checked_scheduler(current, spec: str | None, family: str, pipeline_class: str):
    """The scheduler a `pipeline_class` of `family` saved with `current` runs under `--scheduler spec`:
    `choose_scheduler`'s, or with no spec `current` itself, checked to make a schedule and repeat an
    edit from its seed. ModelError otherwise."""
    if spec is not None:
        return choose_scheduler(current, spec, family, pipeline_class)
    try:
        check_reproducible(current, family, pipeline_class)
    except SCHEDULE_ERRORS as error:
        raise ModelError(f"the pipeline's scheduler {type(current).__name__} makes no schedule: "
                         f"{_first_line(error)}") from None
    return current


def choose_scheduler(current, spec: str, family: str, pipeline_class: str):
    """The scheduler `spec` names, built on `current`'s settings, for a `pipeline_class` of `family`.
    Raises ModelError when it cannot drive that pipeline reproducibly."""
    class_name, settings = parse_scheduler(spec)
    compatible = {type(current).__name__} | {c.__name__ for c in getattr(current, "compatibles", ())}
    if type(current).__name__.startswith("FlowMatch"):  # diffusers lists none for its flow-matching schedulers
        compatible |= {name for name in dir(diffusers) if name.startswith("FlowMatch") and name.endswith("Scheduler")}
    elif family in ("sdxl", "sd2"):  # nor the consistency samplers of LCM- and TCD-distilled UNets (LCM-LoRA)
        compatible |= {"LCMScheduler", "TCDScheduler"}
    if class_name not in compatible:
        usable = [name for name in sorted(compatible) if _usable(current, name, family, pipeline_class)]
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}; it takes "
                         f"{', '.join(usable)}")
    takes = inspect.signature(getattr(diffusers, class_name).set_timesteps).parameters
    if family.startswith("flux") and "sigmas" not in takes:
        raise ModelError(f"--scheduler {class_name} cannot drive this {pipeline_class}: Flux pipelines give "
                         "their scheduler custom sigmas, which its set_timesteps does not take")
    try:
        with _quiet_swap():
            scheduler = getattr(diffusers, class_name).from_config(current.config, **settings)
            check_reproducible(scheduler, family, pipeline_class)
            _set_steps(scheduler, 4)  # settles what a scheduler settles in its first schedule, once
            _trial_run(scheduler)
    except SCHEDULE_ERRORS as error:
        raise ModelError(f"--scheduler {spec}: {_first_line(error)}") from None
    return scheduler


def _first_line(error: BaseException) -> str:
    """A library error's first line (they run to several; a ModelError is one)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# What a scheduler raises for settings it cannot make a schedule with (a negative step count is a
# RuntimeError of torch's, a missing attribute an AttributeError, num_train_timesteps=0 an IndexError,
# original_inference_steps=0 a ZeroDivisionError).
SCHEDULE_ERRORS = (ValueError, TypeError, KeyError, NotImplementedError, ImportError, RuntimeError, AttributeError,
                   IndexError, ArithmeticError)


def _usable(current, class_name: str, family: str, pipeline_class: str) -> bool:
    """Whether `class_name`, with its saved settings, would be accepted (for the refusal's list)."""
    try:
        choose_scheduler(current, class_name, family, pipeline_class)
    except ModelError:
        return False
    return True


@contextmanager
def _quiet_swap() -> Iterator[None]:
    """diffusers warns of every setting of the old scheduler the new one lacks, expected in a swap, and
    DPMSolverSinglestep of the setting it settles in its first schedule (with a broken format string)."""
    filters = [(logging.getLogger("diffusers.configuration_utils"), DropMessage("but are not expected and will be "
                                                                                "ignored")),
               (logging.getLogger("diffusers.schedulers.scheduling_dpmsolver_singlestep"),
                DropMessage("is not supported for `lower_order_final=False`"))]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with quiet_libraries():
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


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


def fresh(scheduler):
    """A new scheduler of `scheduler`'s class and settings. Not a deepcopy: while a pipeline runs,
    `recipes.prepare` shadows the live scheduler's set_timesteps with a wrapper bound to it, which a
    deepcopy would keep (and call, re-scheduling the live one)."""
    with _quiet_swap():
        return type(scheduler).from_config(scheduler.config)


def steps_error(scheduler, steps: int) -> str | None:
    """Why `scheduler` cannot make a schedule of `steps` steps (LCM makes at most its
    original_inference_steps), or None when it can."""
    if steps > MAX_STEPS:
        return f"at most {MAX_STEPS} steps are run"
    try:
        _trial(scheduler, steps)
    except SCHEDULE_ERRORS as error:
        return " ".join(str(error).split()) or type(error).__name__
    return None


def calls_line(scheduler) -> tuple[int, int] | None:
    """(per step, more): an edit of n >= 2 steps makes per_step * n + more denoiser calls on `scheduler`
    (1, 0 for most; 1, 1 for PLMS; 2, -1 for Heun's second-order samplers), from schedules of 2 and 3
    steps; None if it makes neither."""
    try:
        two, three = (len(_trial(scheduler, steps).timesteps) for steps in (2, 3))
    except SCHEDULE_ERRORS:
        return None
    return three - two, 3 * two - 2 * three


def most_steps(scheduler, up_to: int) -> int:
    """The most steps, up to `up_to`, that `scheduler` makes a schedule of (0: none): a scheduler
    that cannot make n steps cannot make more."""
    if steps_error(scheduler, up_to) is None:
        return up_to
    low, high = 0, up_to  # low can (or is 0), high cannot
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if steps_error(scheduler, middle) is None else (low, middle)
    return low


def _trial(scheduler, steps: int = 4):
    """A copy of `scheduler` (`fresh`) that has made a schedule of `steps` steps."""
    trial = fresh(scheduler)
    with _quiet_swap():
        _set_steps(trial, steps)
    return trial


def _trial_run(scheduler, steps: int = 4) -> None:
    """Step a copy through a schedule of `steps` on a tiny latent: settings that make a schedule but no
    step (solver_order=0, an unknown prediction_type) fail here, when the sampler is chosen, rather than
    in every edit of a server that started. Torch's global generator is left as it was."""
    trial = _trial(scheduler, steps)
    sample = torch.zeros(1, 4, 2, 2)
    with torch.random.fork_rng(devices=[]), _quiet_swap():
        for timestep in trial.timesteps:
            model_input = trial.scale_model_input(sample, timestep) if hasattr(trial, "scale_model_input") \
                else sample
            sample = trial.step(model_input * 0.5, timestep, sample, return_dict=False)[0]


def _set_steps(scheduler, steps: int) -> None:
    """`set_timesteps(steps)` as a pipeline calls it (Flux's dynamic shifting wants the `mu` its
    pipelines give)."""
    scheduler.set_timesteps(steps, **({"mu": 1.0} if scheduler.config.get("use_dynamic_shifting") else {}))


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


def label(scheduler) -> str:
    """A short name of the sampler: its class and those of its SAMPLER_SETTINGS that differ from the
    class's defaults (`DPMSolverMultistepScheduler(use_karras_sigmas=true)`), for logs and metrics."""
    defaults = inspect.signature(type(scheduler).__init__).parameters
    changed = [f"{key}={json.dumps(scheduler.config[key])}" for key in SAMPLER_SETTINGS
               if key in defaults and key in scheduler.config and scheduler.config[key] != defaults[key].default]
    return type(scheduler).__name__ + (f"({','.join(changed)})" if changed else "")


def describe(scheduler) -> str:
    """The scheduler's class and the settings that make its schedule, as one line of JSON: what a
    recording was made under (part of the model's fingerprint) and what the helpers rebuild it from
    (`from_description`). Taken once it has made a schedule, since some schedulers settle a setting
    then (DPMSolverSinglestep's lower_order_final): the same before and after the first edit."""
    # diffusers' own JSON of a config (numpy arrays as lists), without its version and class keys
    config = {key: value for key, value in json.loads(_trial(scheduler).to_json_string()).items()
              if not key.startswith("_")}
    return json.dumps({"class": type(scheduler).__name__, "config": config}, sort_keys=True)


def identity(scheduler) -> str:
    """A short digest of `describe`: two workers whose schedulers make other schedules differ in it."""
    return hashlib.sha256(describe(scheduler).encode()).hexdigest()[:12]


def from_description(description: str):
    """The scheduler `describe` described."""
    described = json.loads(description)
    with quiet_libraries():
        return getattr(diffusers, described["class"]).from_config(described["config"])
