"""Denoising strength: how much of the masked region is re-noised before it is repainted.

At strength 1 (the default) an edit starts from noise and runs every step of the template's schedule.
At strength s < 1 it keeps the structure of what the mask covers (recolour a sofa, restyle a shirt):
the diffusers inpaint pipelines noise the template's latents to a later point of the same schedule
and run only its last steps, as `StableDiffusionXLInpaintPipeline(strength=s)` does. The steps an edit
runs are a suffix of the schedule its template was recorded with, so a mask-aware edit reads the
recording's steps from where it starts, and costs about s of a full edit.

Which steps: the pipeline decides, and the families round differently. The UNet inpaint pipelines
run int(steps x s) steps (SD2, SDXL); the flow-matching ones run steps - int(steps - steps x s) (Flux,
SD3): `steps_run` is both, checked against the pipelines in the tests. Retouch refuses a strength of
less than one step's worth (steps x s < 1) on every family alike, although the flow-matching pipelines
would round it up to one step: the same request is then valid or not whatever model serves it.

The noise: an edit's initial noise is the template's at unmasked tokens and the edit seed's at masked
ones (`MaskAwareEditor.prepare_edit`). The pipelines take a given `latents` as the start itself and
noise no image at strength < 1, so `noised_start` has the pipeline noise the template's latents with
that noise, as it would with noise it drew itself.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from retouch.errors import InputError
from retouch.shadows import shadowing

if TYPE_CHECKING:
    import torch

# Families whose pipeline runs int(steps x strength) steps; the others run steps - int(steps - steps x strength).
ROUNDS_DOWN = ("sdxl", "sd2")


def steps_run(family: str, steps: int, strength: float) -> int:
    """Denoising steps an edit of `steps` at `strength` runs, as the family's pipeline counts them."""
    if strength >= 1.0:
        return steps
    if family in ROUNDS_DOWN:
        return min(int(steps * strength), steps)
    return steps - int(max(steps - min(steps * strength, steps), 0))


def check_strength(strength: object, steps: int, what: str = "strength") -> float:
    """`strength` as a float in (0, 1] under which at least one of `steps` steps runs; InputError naming
    `what` otherwise."""
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) or not math.isfinite(strength):
        raise InputError(f"{what} must be a number in (0, 1], got {strength!r}")
    if not 0.0 < strength <= 1.0:
        raise InputError(f"{what} must be in (0, 1], got {strength}")
    if steps * strength < 1.0:
        raise InputError(f"{what} {strength} of {steps} steps is less than one step's worth: it must be at least "
                         f"1/{steps}")
    return float(strength)


def start_step(pipe) -> int:
    """The step of the full schedule at which a pipeline's loop starts (call inside its loop): 0 at
    strength 1. Read from the schedule it set and the loop it runs, so it holds for every scheduler
    (PNDM has no begin index; a second-order one counts two calls a step)."""
    return len(pipe.scheduler.timesteps) - pipe._num_timesteps


class StartLatents:
    """The templates' VAE latents the start of an edit below strength 1 noises, kept per template (`key`:
    its templates' (id, seed), whose generator draws the sample) so that its later edits do not encode the
    template again. The stock pipeline encodes the image a second time at strength < 1 (Flux Fill, SD2,
    SDXL: once for the start, once for the masked image); the sample is the template's own (its generator,
    as the pipeline first uses it), so it is the same every edit. Bounded: the least recently used go first."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.encoded = 0  # encodings made (the rest were kept ones)
        self._kept: OrderedDict[tuple[tuple[str, int], ...], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def drop(self, template_id: str) -> None:
        with self._lock:
            for key in [key for key in self._kept if any(kept_id == template_id for kept_id, _ in key)]:
                del self._kept[key]

    @contextmanager
    def encoding(self, pipe, key: tuple[tuple[str, int], ...]) -> Iterator[None]:
        """Within it, `pipe._encode_vae_image` answers `key`'s templates' latents, encoded once."""
        encode = pipe._encode_vae_image

        def kept(image, generator):
            with self._lock:
                latents = self._kept.get(key)
                if latents is not None:
                    self._kept.move_to_end(key)
            if latents is None or latents.device != image.device or latents.shape[0] != image.shape[0]:
                latents = encode(image=image, generator=generator)
                with self._lock:
                    self.encoded += 1
                    self._kept[key] = latents
                    while len(self._kept) > self.capacity:
                        self._kept.popitem(last=False)
            return latents

        with shadowing(pipe, "_encode_vae_image", kept):
            yield


@contextmanager
def noised_start(pipe, strength: float, noise: torch.Tensor, start_latents: StartLatents | None = None,
                 key: tuple[tuple[str, int], ...] = ()) -> Iterator[None]:
    """Within it, a `pipe(strength=strength, latents=noise, ...)` call starts from the template's latents
    noised with `noise` ([B, C, h, w], unpacked) at its first step, as the pipeline starts when it draws
    `noise` itself. Nothing changes at strength 1 (the pipeline starts from `noise`).

    `prepare_latents` runs as given first, so everything else it returns (the noise the inpaint pipelines
    re-noise with, the template's latents) and what it draws from the generator are as at strength 1: the
    VAE samples of the masked image are the template recording's. It runs a second time with `latents=None`
    on a copy of the generator as the first call found it (so it draws the template's latents the first
    call drew), the scheduler's noising given `noise`, for the start; with `start_latents`, the template's
    latents are those kept for `key` (its templates' ids and seeds), encoded once."""
    if strength >= 1.0:
        yield
        return
    original = pipe.prepare_latents
    parameters = inspect.signature(original)

    @functools.wraps(original)
    def prepare_latents(*args, **kwargs):
        bound = parameters.bind(*args, **kwargs)
        generator = _copied(bound.arguments.get("generator"))
        outputs = original(*args, **kwargs)
        bound.arguments["latents"], bound.arguments["generator"] = None, generator
        with ExitStack() as replaced:
            replaced.enter_context(_noising_with(pipe.scheduler, noise))
            if start_latents is not None and key and hasattr(pipe, "_encode_vae_image"):
                replaced.enter_context(start_latents.encoding(pipe, key))
            started = original(*bound.args, **bound.kwargs)
        if isinstance(outputs, tuple):
            return (started[0], *outputs[1:])
        return started

    with shadowing(pipe, "prepare_latents", prepare_latents):
        yield


@contextmanager
def _noising_with(scheduler, noise: torch.Tensor) -> Iterator[None]:
    """The scheduler's noising of an image (`add_noise` of the UNet schedulers, `scale_noise` of the
    flow-matching ones) given `noise` instead of the noise its caller drew."""
    with ExitStack() as replaced:
        for name in ("add_noise", "scale_noise"):
            if hasattr(scheduler, name):
                replaced.enter_context(shadowing(scheduler, name, _given_noise(getattr(scheduler, name), noise)))
        yield


def _given_noise(method, noise: torch.Tensor):
    """`method` (a scheduler's noising) called with `noise` in place of its `noise` argument."""
    parameters = inspect.signature(method)

    @functools.wraps(method)
    def replaced(*args, **kwargs):
        bound = parameters.bind(*args, **kwargs)
        drawn = bound.arguments["noise"]
        if tuple(drawn.shape) != tuple(noise.shape):
            raise ValueError(f"the pipeline drew noise of shape {tuple(drawn.shape)}, not {tuple(noise.shape)}")
        bound.arguments["noise"] = noise.to(drawn.device, drawn.dtype)
        return method(*bound.args, **bound.kwargs)

    return replaced


def _copied(generator):
    """A generator in the same state (a list of them for a list), so that drawing from it leaves the
    pipeline's own as it was."""
    import torch

    if generator is None:
        return None
    if isinstance(generator, list):
        return [_copied(one) for one in generator]
    copy = torch.Generator(generator.device)
    copy.set_state(generator.get_state())
    return copy
