"""Per model family, what one denoising step of a continuous batch does, around the denoiser call.

The stock diffusers pipeline prepares an edit (text encoding, VAE encoding of the masked image, the
mask latents, the schedule) and then runs its own loop, one request batch from start to end. The
engine keeps the preparation and owns the loop: `prepare` runs the pipeline up to its first
denoiser call and keeps what that call and the pipeline's `prepare_latents`/`prepare_mask_latents`
were given (`Prepared`); `denoise_step` then repeats the pipeline's loop body for a batch whose
requests are each at their own step:

    flux-fill      hidden = [latents | masked-image latents] (packed channels), timestep / 1000
    flux-inpaint   hidden = latents; after the step, unmasked latents are re-noised template latents
    sd3            [uncond; cond] rows (classifier-free guidance), re-noise blend as flux-inpaint
    sdxl, sd2      [uncond; cond] rows, scale_model_input, then [latents | mask | masked latents]

Guidance is per request: with classifier-free guidance a batch of B requests is 2B denoiser rows,
[uncond_1..uncond_B; cond_1..cond_B], the order the pipelines use and the editor records.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from retouch.editor import EditInputs, MaskAwareEditor
from retouch.engine.schedulers import BatchScheduler, PipelineCalls, RequestSchedule, encode_arguments
from retouch.lora.text_encoders import TextEncoderUses
from retouch.lora.text_encoders import applied as text_encoder_lora_applied
from retouch.models import quiet_libraries
from retouch.shadows import shadowing
from retouch.strength import noised_start, start_step

# The denoiser keyword arguments that carry one row per request (per guidance copy).
BATCHED_INPUTS = {
    "flux-fill": ("pooled_projections", "encoder_hidden_states", "guidance"),
    "flux-inpaint": ("pooled_projections", "encoder_hidden_states", "guidance"),
    "sd3": ("pooled_projections", "encoder_hidden_states"),
    "sdxl": ("encoder_hidden_states", "added_cond_kwargs.text_embeds", "added_cond_kwargs.time_ids"),
    "sd2": ("encoder_hidden_states",),
}
# Arguments identical for every request of one image size (positional ids of the tokens).
SHARED_INPUTS = {"flux-fill": ("txt_ids", "img_ids"), "flux-inpaint": ("txt_ids", "img_ids")}
CONCAT_DIM = {"flux-fill": 2, "sdxl": 1, "sd2": 1}  # where the conditioning joins the latents
BLENDED = ("flux-inpaint", "sd3")  # re-noise the template's latents outside the mask after each step
PACKED = ("flux-fill", "flux-inpaint", "sd3")  # families whose requests of different sizes share one forward


@dataclass
class Prepared:
    """One request's denoiser inputs that do not change from step to step.

    latents:  [1, ...] the initial latents, as the pipeline's loop starts from them
    inputs:   batched denoiser inputs, [copies, ...] each (copies = 2 with classifier-free guidance);
              "cond" is what joins the latents along CONCAT_DIM
    shared:   inputs equal for every request of the same size
    blend:    image_latents, noise, mask ([1, ...] each) of the families in BLENDED
    schedule: the request's timesteps and sigmas, as the pipeline set them
    """

    latents: torch.Tensor
    inputs: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    blend: dict[str, torch.Tensor]
    schedule: RequestSchedule
    guidance: float | None  # the classifier-free guidance scale; None without it

    @property
    def copies(self) -> int:
        return 1 if self.guidance is None else 2

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, by a flat name (what crosses a process boundary)."""
        named = {"latents": self.latents, "schedule.timesteps": self.schedule.timesteps}
        if self.schedule.sigmas is not None:
            named["schedule.sigmas"] = self.schedule.sigmas
        if self.schedule.calls is not None and self.schedule.calls.generator_state is not None:
            named["schedule.generator_state"] = self.schedule.calls.generator_state
        for group in ("inputs", "shared", "blend"):
            named.update({f"{group}.{name}": tensor for name, tensor in getattr(self, group).items()})
        return named

    def header(self) -> dict:
        calls = self.schedule.calls
        return {"guidance": self.guidance, "num_inference_steps": self.schedule.num_inference_steps,
                "init_noise_sigma": self.schedule.init_noise_sigma, "calls": None if calls is None else calls.header(),
                "start": self.schedule.start}

    @classmethod
    def from_tensors(cls, header: dict, named: dict[str, torch.Tensor]) -> Prepared:
        groups: dict[str, dict[str, torch.Tensor]] = {"inputs": {}, "shared": {}, "blend": {}}
        for name, tensor in named.items():
            group, _, key = name.partition(".")
            if group in groups:
                groups[group][key] = tensor
        calls, start = header.get("calls"), int(header.get("start", 0))
        schedule = RequestSchedule(named["schedule.timesteps"], named.get("schedule.sigmas"),
                                   header["num_inference_steps"], header["init_noise_sigma"], index=start, start=start,
                                   calls=None if calls is None else
                                   PipelineCalls.from_header(calls, named.get("schedule.generator_state")))
        return cls(named["latents"], groups["inputs"], groups["shared"], groups["blend"], schedule, header["guidance"])


@dataclass
class Running:
    """A request in the running batch: its latents move one step per loop iteration."""

    prepared: Prepared
    latents: torch.Tensor  # [1, ...]

    @property
    def schedule(self) -> RequestSchedule:
        return self.prepared.schedule


class _FirstStep(Exception):
    """Raised in the denoiser's pre-hook: preparation is done once the loop's first call is reached."""


def prepare(editor: MaskAwareEditor, inputs: EditInputs, prompt: str, strength: float = 1.0,
            negative_prompt: str | None = None, guidance: float | None = None,
            text_encoder_lora: TextEncoderUses = ()) -> Prepared:
    """Run the stock pipeline on one edit up to its first denoiser call; keep what the loop needs. Below
    `strength` 1 the loop starts part-way (`retouch.strength`). `negative_prompt` and `guidance` (the
    edit's own scale; None: the template's) as `MaskAwareEditor.check_request` returned them. Its prompts
    are encoded with the text-encoder parts of its LoRA adapters (`retouch.lora.text_encoders`)."""
    pipe, family, template = editor.pipe, editor.model.family, inputs.template
    seen: dict[str, object] = {}

    def remember(name: str, method: Callable) -> Callable:
        @functools.wraps(method)  # the pipelines read the signature of set_timesteps and step
        def wrapper(*args, **kwargs):
            seen[name] = method(*args, **kwargs)
            seen[f"{name}.call"] = (args, kwargs)
            return seen[name]
        return wrapper

    def stop(module, args, kwargs):
        seen["args"], seen["kwargs"], seen["start"] = args, kwargs, start_step(pipe)
        raise _FirstStep

    kwargs = editor.pipeline_kwargs([template], [inputs.mask], [prompt], inputs.latents[None], "latent", strength,
                                    [negative_prompt], guidance)
    # Instance attributes shadow the pipeline's (and its scheduler's) methods for this call only.
    shadowed = [(pipe, "prepare_latents", "latents"), (pipe, "prepare_mask_latents", "mask"),
                (pipe, "prepare_extra_step_kwargs", "step_kwargs"), (pipe.scheduler, "set_timesteps", "set_timesteps"),
                (pipe.scheduler, "set_begin_index", "begin_index"), (pipe.scheduler, "scale_model_input", "scaled")]
    shadowed = [(owner, method, name) for owner, method, name in shadowed if hasattr(owner, method)]
    with ExitStack() as undo:
        undo.enter_context(noised_start(pipe, strength, inputs.latents[None], editor.start_latents,
                                        ((template.template_id, template.seed),)))
        for owner, method, name in shadowed:
            undo.enter_context(shadowing(owner, method, remember(name, getattr(owner, method))))
        undo.callback(editor.denoiser.register_forward_pre_hook(stop, with_kwargs=True).remove)
        undo.enter_context(text_encoder_lora_applied(pipe, text_encoder_lora))
        try:
            with torch.inference_mode(), quiet_libraries():
                pipe(**kwargs)
            raise RuntimeError(f"{type(pipe).__name__} finished without calling its denoiser")
        except _FirstStep:
            pass

    call = dict(seen["kwargs"])
    if editor.is_unet:
        call["sample"], call["timestep"] = seen["args"][:2]
    latent_outputs = seen["latents"]
    latents = latent_outputs[0]
    named: dict[str, torch.Tensor] = {}
    for name in BATCHED_INPUTS[family]:
        group, _, key = name.partition(".")
        value = call[group][key] if key else call[group]
        if value is not None:
            named[name] = value
    if family in CONCAT_DIM:
        hidden = call["sample" if editor.is_unet else "hidden_states"]
        named["cond"] = hidden.narrow(CONCAT_DIM[family], latents.shape[CONCAT_DIM[family]],
                                      hidden.shape[CONCAT_DIM[family]] - latents.shape[CONCAT_DIM[family]])
    blend = {}
    if family in BLENDED:
        noise, image_latents = latent_outputs[1], latent_outputs[2]
        blend = {"image_latents": image_latents, "noise": noise, "mask": seen["mask"][0][:1]}
    shared = {name: call[name] for name in SHARED_INPUTS.get(family, ())}
    guidance = pipe.guidance_scale  # what the call ran: the edit's own scale, else its template's, else the default
    copies = 2 if editor.is_unet or family == "sd3" else 1
    copies = copies if getattr(pipe, "do_classifier_free_guidance", False) else 1
    schedule = RequestSchedule.of(pipe.scheduler, _pipeline_calls(pipe.scheduler, seen), start=seen["start"])
    return Prepared(latents=latents.clone(), inputs={k: v.clone() for k, v in named.items()},
                    shared={k: v.clone() for k, v in shared.items()}, blend={k: v.clone() for k, v in blend.items()},
                    schedule=schedule, guidance=float(guidance) if copies == 2 else None)


def _pipeline_calls(scheduler, seen: dict) -> PipelineCalls:
    """What the pipeline asked of its scheduler before the first step (`prepare`'s record)."""
    args, kwargs = seen["set_timesteps.call"]
    step_kwargs = {name: value.item() if isinstance(value, np.generic) else value  # JSON, as the header is
                   for name, value in seen.get("step_kwargs", {}).items()}
    generators = step_kwargs.pop("generator", None)
    if isinstance(generators, list):  # one request: the editor gives its pipeline one generator per image
        (generators,) = generators
    begin = seen.get("begin_index.call")
    if begin is not None:
        begin = encode_arguments(scheduler.set_begin_index, *begin)["begin_index"]
    return PipelineCalls(encode_arguments(scheduler.set_timesteps, args, kwargs), begin_index=begin,
                         step_kwargs=step_kwargs, scales_input="scaled" in seen,
                         generator_state=None if generators is None else generators.get_state())


def denoise_step(family: str, scheduler: BatchScheduler, rows: Sequence[Running],
                 denoiser: Callable[..., torch.Tensor]) -> None:
    """One denoising step of `rows` (each at its own step; one image size; all with or all without
    guidance): call `denoiser(**kwargs)` once on the batch, then advance every request."""
    kwargs = _batched_kwargs(family, rows)
    kwargs.update(rows[0].prepared.shared)
    kwargs.update(_latent_kwargs(family, scheduler, rows, _model_input(family, scheduler, rows)))
    _advance(family, scheduler, rows, denoiser(**kwargs))


def denoise_mixed_step(family: str, scheduler: BatchScheduler, rows: Sequence[Running],
                       packed_denoiser: Callable[..., list[torch.Tensor]]) -> None:
    """One denoising step of `rows` of different image sizes (Flux, SD3; all with or all without
    guidance) in ONE forward: `packed_denoiser(**kwargs)` is the adapter's `forward_packed`, which takes
    per denoiser row its latents (and Flux's image ids) and returns its prediction. Inputs are built and
    requests advanced per size exactly as `denoise_step` does, so each request steps as it would alone."""
    if family not in PACKED:
        raise ValueError(f"{family} runs one forward per image size (no mixed-resolution forward)")
    sizes: dict[tuple, list[Running]] = {}
    for row in rows:
        sizes.setdefault(tuple(row.latents.shape), []).append(row)
    groups = list(sizes.values())
    copies = rows[0].prepared.copies
    # Each size's denoiser rows, [copy 0 of its requests; copy 1 ...], as denoise_step builds them.
    where = {}  # request -> (its size's model input, its place in that size's batch, that batch's size)
    for group in groups:
        model_input = _model_input(family, scheduler, group)
        where.update({id(row): (model_input, i, len(group)) for i, row in enumerate(group)})
    # The batch's denoiser rows: every request's copy 0, then copy 1 (the context's row order).
    latents = [model_input[copy * size + i] for copy in range(copies) for row in rows
               for model_input, i, size in [where[id(row)]]]
    kwargs = _batched_kwargs(family, rows)
    kwargs.update(_latent_kwargs(family, scheduler, rows, latents))
    if family.startswith("flux"):
        kwargs.update(img_ids=[row.prepared.shared["img_ids"] for _ in range(copies) for row in rows],
                      txt_ids=rows[0].prepared.shared["txt_ids"])
    predictions = packed_denoiser(**kwargs)
    at = {id(row): b for b, row in enumerate(rows)}
    for group in groups:
        noise_pred = torch.stack([predictions[copy * len(rows) + at[id(row)]] for copy in range(copies)
                                  for row in group])
        _advance(family, scheduler, group, noise_pred)


def _model_input(family: str, scheduler: BatchScheduler, rows: Sequence[Running]) -> torch.Tensor:
    """The denoiser's latent input of a one-size batch, `[copies * B, ...]`: scaled, with the conditioning
    joined."""
    prepared = [row.prepared for row in rows]
    copies = prepared[0].copies
    latents = torch.cat([row.latents for row in rows])
    model_input = torch.cat([latents] * copies) if copies > 1 else latents
    model_input = scheduler.scale_model_input(model_input, [row.schedule for row in rows] * copies)
    if family in CONCAT_DIM:
        model_input = torch.cat([model_input, _rows(prepared, "cond")], dim=CONCAT_DIM[family])
    return model_input


def _batched_kwargs(family: str, rows: Sequence[Running]) -> dict:
    """The denoiser's per-row keyword arguments (text embeddings, guidance, ...) of the batch."""
    prepared = [row.prepared for row in rows]
    return _nest({name: _rows(prepared, name) for name in BATCHED_INPUTS[family] if name in prepared[0].inputs})


def _latent_kwargs(family: str, scheduler: BatchScheduler, rows: Sequence[Running], model_input) -> dict:
    """The latent input under the family's argument name, and the rows' timesteps as its model takes them."""
    timesteps = scheduler.timesteps([row.schedule for row in rows]).repeat(rows[0].prepared.copies)
    if family.startswith("flux"):
        return {"hidden_states": model_input, "timestep": timesteps.to(rows[0].latents.dtype) / 1000}
    if family == "sd3":
        return {"hidden_states": model_input, "timestep": timesteps}
    return {"sample": model_input, "timestep": timesteps}


def _advance(family: str, scheduler: BatchScheduler, rows: Sequence[Running], noise_pred: torch.Tensor) -> None:
    """Guidance, the scheduler step and the re-noise blend of a one-size batch: every request one step on."""
    prepared = [row.prepared for row in rows]
    schedules = [row.schedule for row in rows]
    latents = torch.cat([row.latents for row in rows])
    if prepared[0].copies == 2:
        uncond, cond = noise_pred.chunk(2)
        # One request at a time, as the pipeline computes it with its Python float guidance scale.
        noise_pred = torch.cat([u[None] + p.guidance * (c[None] - u[None])
                                for u, c, p in zip(uncond, cond, prepared)])
    latents = scheduler.step(noise_pred, latents, schedules)
    if family in BLENDED:
        latents = _blend(scheduler, latents, prepared)
    for row, row_latents in zip(rows, latents):
        row.latents = row_latents[None]


def _blend(scheduler, latents: torch.Tensor, prepared: Sequence[Prepared]) -> torch.Tensor:
    """Outside the mask, the template's latents re-noised to each request's next step (the last step
    keeps them clean), as the inpaint pipelines do after every scheduler step."""
    mask = torch.cat([p.blend["mask"] for p in prepared])
    renoised = torch.cat([p.blend["image_latents"] if p.schedule.done
                          else scheduler.scale_noise(p.blend["image_latents"], p.blend["noise"], [p.schedule])
                          for p in prepared])
    return (1 - mask) * renoised + mask * latents


def _rows(prepared: Sequence[Prepared], name: str) -> torch.Tensor:
    """The batch's rows of one input: every request's copy 0, then every request's copy 1."""
    copies = prepared[0].copies
    return torch.cat([p.inputs[name][copy:copy + 1] for copy in range(copies) for p in prepared])


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    nested: dict = {}
    for name, value in flat.items():
        group, _, key = name.partition(".")
        if key:
            nested.setdefault(group, {})[key] = value
        else:
            nested[group] = value
    return nested


def vae_latents(pipe, family: str, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The denoiser's latents `[B, ...]` of one canvas size (width, height) -> what the VAE decodes,
    `[B, C, h, w]`: unpacked (Flux) and un-normalised as the pipelines do before decoding (diffusers'
    SD3 inpaint pipeline does not add the VAE's shift factor back; neither does this)."""
    vae = pipe.vae
    width, height = size
    if family.startswith("flux"):
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return latents / vae.config.scaling_factor + vae.config.shift_factor
    if getattr(vae.config, "latents_mean", None) is not None and getattr(vae.config, "latents_std", None):
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        return latents * std / vae.config.scaling_factor + mean
    return latents / vae.config.scaling_factor


def decode(editor: MaskAwareEditor, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
    """Final latents `[B, ...]` of one image size (width, height) -> images, as the pipelines decode."""
    pipe = editor.pipe
    with torch.inference_mode():
        latents = vae_latents(pipe, editor.model.family, latents, size)
        images = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        if getattr(pipe, "watermark", None) is not None:
            images = pipe.watermark.apply_watermark(images)
        return pipe.image_processor.postprocess(images, output_type="pil")
