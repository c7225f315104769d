"""The Python API of mask-aware editing: register a template once, then edit it many times.

    editor = retouch.load("tiny-flux-fill")
    template_id = editor.register_template(image, prompt="a living room", steps=28, seed=0)
    edited = editor.edit(template_id, mask, prompt="a red sofa", seed=1)
    edited_many = editor.edit_many([EditRequest(template_id, mask_a, "a cat"), EditRequest(...)])

Registration runs the unmodified computation once and records every block's activations per
denoising step (adapters, RECORD mode). An edit computes only the masked tokens and takes the rest
from the recording (Y-cache or KV-cache mode). The stock diffusers pipeline drives the denoising loop:
its `latents` argument carries the initial noise (the template's at unmasked tokens, the edit seed's
at masked ones) and forward hooks on the transformer switch the per-step context. With
classifier-free guidance (SD3) the pipeline doubles the batch as [unconditional; conditional]; the
unconditional rows are recorded and read under their own template id (`<id>/uncond`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import operator
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from PIL import Image, ImageChops

from retouch.adapters import CacheMode, MaskAwareContext, UNetMaskAwareContext, patch_flux, patch_sd3, patch_unet
from retouch.adapters.reads import row_tokens, staged_context
from retouch.cache import ActivationCache, CacheFull, CacheMiss, CacheStore, StoreConfig, TemplateHandle, uncond_row_id
from retouch.cache.staging import CopyEngine, StagedActivations
from retouch.canvas import Canvas, paste_unmasked
from retouch.costs import CostModel
from retouch.errors import InputError, ModelError, RetouchError
from retouch.images import as_image, as_mask, colour_profile
from retouch.limits import GUIDED_FAMILIES
from retouch.masks import FLUX_STRIDE, masked_token_indices, token_mask
from retouch.models import LoadedModel, load_pipeline, quiet_libraries
from retouch.models.samplers import describe as describe_scheduler
from retouch.models.samplers import MAX_STEPS, calls_line, steps_error
from retouch.noise import initial_noise, latent_shape, latents_argument, pack_flux_latents  # noqa: F401 - API
from retouch.noise import seeded_noise
from retouch.ops import ATTENTION_BACKENDS
from retouch.strength import StartLatents, check_strength, noised_start, start_step

logger = logging.getLogger("retouch.editor")
PATCH_STRIDE = FLUX_STRIDE  # Flux and SD3 both patchify 2x2 latent pixels (VAE /8): 16 px per token
UNET_FAMILIES = ("sdxl", "sd2")
DEFAULT_STEPS = 28
CACHE_MODES = {"y": CacheMode.Y_CACHE, "kv": CacheMode.KV_CACHE}
PLANNERS = ("optimal", "algorithm1")  # retouch.planner.optimal_plan, and the paper's Algorithm 1
# The families whose denoiser has a mask-aware adapter and whose pipeline the editor drives.
SUPPORTED_FAMILIES = ("flux-fill", "flux-inpaint", "sd3", "sdxl", "sd2")
# What registration keeps per mode: Y-cache reads block outputs only; KV-cache reads keys and values,
# and block outputs where a block hands over all rows (before a full block, and the last block).
RECORDED_NAMES = {CacheMode.Y_CACHE: ("out",), CacheMode.KV_CACHE: None}


@dataclass(frozen=True)
class Template:
    """A registered template: what an edit must reproduce at its unmasked tokens."""

    template_id: str
    source: Image.Image  # RGB at the user's size: the pixels every edit keeps outside its mask
    canvas: Canvas  # where the pipeline runs (`retouch.canvas`)
    prompt: str
    steps: int
    seed: int
    guidance: float | None
    latent_shape: tuple[int, int, int]  # (C, h, w) of the canvas's latents
    num_text_tokens: int
    recorded_mask: Image.Image  # what the recorded run repainted (`Canvas.mask`; nothing by default)
    recorded_mode: str  # the cache mode it was recorded for: "kv" recordings serve Y-cache edits too
    one_off: bool = False  # a one-off image's, recorded by its first edit (`one_off_template`)
    negative_prompt: str | None = None  # the recorded run's (`MaskAwareEditor.check_negative_prompt`)

    @cached_property
    def image(self) -> Image.Image:
        """The template on its canvas: what the pipeline is given."""
        return self.canvas.image(self.source)

    @cached_property
    def noise(self) -> torch.Tensor:
        """`[C, h, w]` initial latents (`retouch.noise`), drawn where first needed: on the step loop or
        in a helper process, never on a request's thread, where a parallel torch kernel would start an
        OpenMP team that slows the loop (`retouch.masks.token_mask`)."""
        return seeded_noise(self.latent_shape, self.seed)

    @property
    def original_size(self) -> tuple[int, int]:
        return self.source.size


@dataclass(frozen=True)
class EditInputs:
    """An edit made ready for the denoiser (`MaskAwareEditor.prepare_edit`), or a recording of its
    template (`prepare_recording`: every token computed, the activations written to the cache)."""

    template: Template
    mask: Image.Image  # what the pipeline is given (its conditioning): `Canvas.mask` of the request's
    compute_mask: Image.Image  # canvas pixels whose tokens are recomputed: the mask and the recording's repainted region
    masked_idx: torch.Tensor  # row-major indices of the tokens recomputed (transformer tokens, or a UNet's level 0)
    latents: torch.Tensor  # [C, h, w] initial latents
    records: bool = False  # a recording of `template`


@dataclass(frozen=True)
class EditRequest:
    template_id: str
    mask: Image.Image  # white = repaint, the template's size; any form `retouch.images.as_mask` reads
    prompt: str
    seed: int = 0
    steps: int | None = None  # None: the template's; another count is refused (the recording has its steps)
    strength: float = 1.0  # how much of the masked region is re-noised (`retouch.strength`): below 1, its last steps
    negative_prompt: str | None = None  # what to steer the masked region away from (guidance > 1; not Flux)
    guidance: float | None = None  # None: the template's; another > 1 where it is > 1 (`check_edit_guidance`)


def warm_up_inputs(size: tuple[int, int]) -> tuple[Image.Image, Image.Image]:
    """A grey template of `size` and a mask of its 32x32 top-left corner: what warm-ups edit."""
    corner = Image.new("L", size, 0)
    corner.paste(255, (0, 0, 32, 32))
    return Image.new("RGB", size, (127, 127, 127)), corner


def one_at_a_time(method):
    """An editor method that runs the denoiser: callers on other threads wait their turn. The adapter holds
    one active context and the pipeline's hooks are the editor's own, so two forwards at once would each
    run in the other's context (the engine batches concurrent edits instead: `retouch.engine`)."""
    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self._lock:
            if self._closed:
                raise RetouchError("this editor is closed; load another (retouch.load)")
            return method(self, *args, **kwargs)
    return serialized


class MaskAwareEditor:
    """Edits of registered templates that compute only the masked tokens."""

    def __init__(self, model: LoadedModel, cache: ActivationCache | None = None, cache_mode: str = "y",
                 dilation: int = 0, block_plan: Sequence[bool] | None = None, attention_backend: str = "auto",
                 copy_engine: CopyEngine | None = None, cost_model: CostModel | None = None,
                 planner: str = "optimal", compile: bool = False, cuda_graphs: bool = False):  # noqa: A002
        """`cache`: where templates are recorded; by default a `CacheStore` (pinned host arena) whose
        rows reach each edit through `copy_engine` (one per device). Any other `ActivationCache` (e.g.
        an `InMemoryActivationCache` on the GPU: the no-transfer ideal) is read directly.

        Which blocks read the cache: `block_plan` if given; else, with a `cost_model` (`retouch
        profile`), the `planner`'s plan for each batch ("optimal" or the paper's "algorithm1"); else all.

        `compile`: the blocks run through torch.compile (`MaskAwareAdapter.compile`: the first forwards of
        a batch of one and of more compile, later masks and batches reuse the graphs). `cuda_graphs`
        (CUDA only; implies `compile`): computed tokens are padded to buckets and each step replays a
        captured CUDA graph."""
        if model.family not in SUPPORTED_FAMILIES:
            raise ModelError(f"mask-aware editing supports {', '.join(SUPPORTED_FAMILIES)} so far; "
                             f"{model.name} is {model.family} (use the baseline edit)")
        if cache_mode not in CACHE_MODES:
            raise InputError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}")
        if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 0:
            raise InputError(f"dilation must be a whole number of tokens >= 0, got {dilation!r}")
        if planner not in PLANNERS:
            raise InputError(f"planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise InputError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                             f"{attention_backend!r}")
        if cuda_graphs and model.pipe.device.type != "cuda":
            raise InputError(f"cuda_graphs needs a CUDA device; the model is on {model.pipe.device.type}")
        if cache is not None and not isinstance(cache, ActivationCache):
            raise InputError(f"cache must be an ActivationCache (CacheStore(StoreConfig(...))), got {cache!r}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise InputError(f"cost_model must be a CostModel (CostModel.from_json(path)), got {cost_model!r}")
        self.model = model
        self.pipe = model.pipe
        # Read once, not per step: diffusers' pipe.device and model.dtype walk every module (~2 ms a call),
        # and the pipeline's signature is parsed anew on every inspect.
        self.device = model.pipe.device
        self.default_guidance = default_guidance(self.pipe)
        self.cache = cache if cache is not None else CacheStore(StoreConfig())
        self._owns_cache = cache is None  # closed with the editor (see close)
        self._closed = False
        self.mode = CACHE_MODES[cache_mode]
        self.mode_name = cache_mode
        self.cost_model = cost_model
        self.planner = planner
        self.last_plan = None
        self.start_latents = StartLatents()  # templates' VAE latents, for edits below strength 1
        self.dilation = dilation
        self.block_plan = None if block_plan is None else tuple(block_plan)
        self.is_unet = model.family in UNET_FAMILIES
        if self.is_unet:
            self.denoiser = self.pipe.unet
            self.adapter = patch_unet(self.denoiser, attention_backend=attention_backend)
        else:
            self.denoiser = self.pipe.transformer
            patch = patch_sd3 if model.family == "sd3" else patch_flux
            self.adapter = patch(self.denoiser, attention_backend=attention_backend)
        if self.block_plan is not None and len(self.block_plan) != self.adapter.num_blocks:
            self.adapter.unpatch()
            raise InputError(f"block_plan has {len(self.block_plan)} entries; {model.name} has "
                             f"{self.adapter.num_blocks} blocks (one True or False each: cache or compute)")
        if cost_model is not None and tuple(cost_model.block_kinds) != self.adapter.block_kinds():
            self.adapter.unpatch()
            raise InputError(f"the cost model was profiled on {cost_model.model}, whose blocks are not "
                             f"{model.name}'s; profile this one (`retouch profile --model {model.name}`)")
        self.compiled = compile or cuda_graphs
        if self.compiled:
            self.adapter.compile(cuda_graphs=cuda_graphs)
        self.dtype = self.denoiser.dtype
        self.copy_engine = None
        if isinstance(self.cache, CacheStore):
            self.copy_engine = copy_engine if copy_engine is not None else CopyEngine(self.pipe.device)
        self.templates: dict[str, Template] = {}
        self.recomputes = 0  # templates recorded again because no cache tier held them any more
        self._recording_bytes: dict[tuple, int] = {}  # `_bytes_key` -> the last such recording's bytes
        self._fingerprint: str | None = None
        self._schedulable: set[tuple[int, int]] = set()  # (scheduler, step count) seen to make a schedule
        self._lock = threading.RLock()  # see one_at_a_time

    @property
    def token_stride(self) -> int:
        """Pixels per side of the tokens `EditInputs.masked_idx` counts: a transformer's patch tokens,
        a UNet's first-level tokens (latent pixels)."""
        return self.pipe.vae_scale_factor if self.is_unet else PATCH_STRIDE

    def num_tokens(self, template: Template) -> int:
        """Tokens of the template's canvas, in `token_stride` units."""
        width, height = template.canvas.padded
        return (width // self.token_stride) * (height // self.token_stride)

    def close(self) -> None:
        """Give the model back unpatched (another editor may take it) and end the copy thread, and the
        cache's background work where the editor made the cache. Waits for a running edit; later calls refuse."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.adapter.unpatch()
            if self.copy_engine is not None:
                self.copy_engine.close()
            if self._owns_cache and isinstance(self.cache, CacheStore):
                self.cache.close()

    def __enter__(self) -> MaskAwareEditor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (f"MaskAwareEditor({self.model.name!r}, family={self.model.family!r}, cache_mode={self.mode_name!r}, "
                f"device={str(self.device)!r}, templates={len(self.templates)}{state})")

    # ---- templates ----

    @one_at_a_time
    def register_template(self, image: Image.Image, prompt: str = "", steps: int = DEFAULT_STEPS, seed: int = 0,
                          guidance: float | None = None, mask: Image.Image | None = None,
                          negative_prompt: str | None = None) -> str:
        """Run the full computation once on `image` and record its activations; returns the template id.

        `mask` is what the recorded run repaints (inpainting models take it as an input): by default
        nothing, so every edit's unmasked tokens see the template's own conditioning. The id is a
        digest of the image and the settings, so registering the same template twice returns the
        same id without recomputing, unless the recording lacks what the current cache mode reads
        (recorded for "y", now editing in "kv"): then it is recorded again. `negative_prompt` is the
        recorded run's, which later edits' unmasked tokens keep (`check_negative_prompt`).
        """
        template = self.new_template(image, prompt, steps, seed, guidance, mask, negative_prompt=negative_prompt)
        if not (self.is_recorded(template.template_id) or self.adopt(template)):
            self.drop_template(template.template_id)
            self._record(template)
            self.templates[template.template_id] = template
        return template.template_id

    def new_template(self, image: Image.Image, prompt: str = "", steps: int = DEFAULT_STEPS, seed: int = 0,
                     guidance: float | None = None, mask: Image.Image | None = None, scope: str = "",
                     negative_prompt: str | None = None) -> Template:
        """A template to register, checked and placed on its canvas; nothing is computed yet. Templates of
        other `scope`s never share a recording, even of the same image and run (a server's tenants: one's
        registration would be ready at once for another who sent it too, and one's deletion drop it)."""
        steps, seed = self._check_steps(steps), check_seed(seed)
        check_guidance(guidance)
        if not isinstance(prompt, str):  # None reached the text encoder, whose error named no argument
            raise InputError(f"prompt must be a string ('' for none), got {type(prompt).__name__}")
        negative_prompt = self.check_negative_prompt(negative_prompt, guidance)
        image = as_image(image)
        recorded = None if mask is None else as_mask(mask, image.size, what="recorded mask")
        template_id = self._template_id(image, prompt, steps, seed, guidance, recorded, scope, negative_prompt)
        return self._template_on_canvas(template_id, image, prompt, steps, seed, guidance, recorded, negative_prompt)

    def one_off_template(self, image: Image.Image, mask: Image.Image, prompt: str, seed: int = 0,
                         steps: int = DEFAULT_STEPS, guidance: float | None = None, scope: str = "",
                         negative_prompt: str | None = None) -> Template:
        """The template a one-off edit records as it runs: its id is `one_off_id` (the image, its
        schedule and `scope`, whatever the request's prompt, seed or mask), and it is recorded with the edit's
        prompt (and negative prompt), seed and mask, so that the recording run is the edit itself, the stock pipeline's
        result. Its `recorded_mask` is the region that run repainted: later edits recompute it, since
        the activations cached there are the first edit's, not the template's (`prepare_edit`)."""
        steps, seed = self._check_steps(steps), check_seed(seed)
        check_guidance(guidance)
        negative_prompt = self.check_negative_prompt(negative_prompt, guidance)
        image = as_image(image)
        mask = as_mask(mask, image.size)
        return replace(self._template_on_canvas(self.one_off_id(image, steps, guidance, scope), image, prompt, steps,
                                                seed, guidance, mask, negative_prompt), one_off=True)

    def _check_steps(self, steps) -> int:
        """`check_steps`, and that the scheduler makes that many (LCM makes at most 50)."""
        steps = check_steps(steps)
        if (id(self.pipe.scheduler), steps) not in self._schedulable:
            problem = steps_error(self.pipe.scheduler, steps)
            if problem is not None:
                raise InputError(f"steps: {type(self.pipe.scheduler).__name__} cannot make {steps} steps: {problem}")
            self._schedulable.add((id(self.pipe.scheduler), steps))
        return steps

    def one_off_id(self, image: Image.Image, steps: int, guidance: float | None, scope: str = "") -> str:
        """The id of one-off edits' recording of `image` (RGB, as `as_image` returns it). Edits of other
        `scope`s never share a recording (a server's tenants: one's recording would tell another that the
        image was sent before, and give its edits the other's prompt outside their masks' new content)."""
        digest = hashlib.sha256(f"one-off|{self.model.name}|{image.size}|{steps}|{guidance}|".encode())
        if scope:
            digest.update(f"scope|{scope}|".encode())
        digest.update(image.tobytes())
        _digest_profile(digest, image)
        return digest.hexdigest()[:16]

    def is_recorded(self, template_id: str) -> bool:
        """Whether edits of the template can run now in the current cache mode (else it must be recorded)."""
        template = self.templates.get(template_id)
        return template is not None and self.cache.contains(template_id) and self._covers(template)

    def _template_on_canvas(self, template_id: str, image: Image.Image, prompt: str, steps: int, seed: int,
                            guidance: float | None, recorded: Image.Image | None,
                            negative_prompt: str | None = None) -> Template:
        canvas = Canvas.for_pipeline(image.size, self.pipe)
        return Template(
            template_id=template_id, source=image, canvas=canvas, prompt=prompt, steps=steps, seed=seed,
            guidance=guidance, latent_shape=latent_shape(self.pipe, canvas.padded),
            num_text_tokens=self._num_text_tokens(),
            recorded_mask=canvas.empty_mask() if recorded is None else canvas.mask(recorded),
            recorded_mode=self.mode_name, negative_prompt=negative_prompt)

    @one_at_a_time
    def edit_image(self, image: Image.Image, mask: Image.Image, prompt: str, seed: int = 0,
                   steps: int = DEFAULT_STEPS, guidance: float | None = None, strength: float = 1.0,
                   negative_prompt: str | None = None) -> Image.Image:
        """A one-off edit of `image`: the first edit of an image runs in full (the stock pipeline's
        result) and records its activations as it goes; later edits of the same image, whatever their
        prompt, seed or mask, are mask-aware. One generation per edit. Below `strength` 1 an image not
        yet recorded is edited in full and not recorded: the edit runs only the schedule's last steps."""
        template = self.one_off_template(image, mask, prompt, seed, steps, guidance, negative_prompt=negative_prompt)
        request = self.check_request(EditRequest(template.template_id, mask, prompt, seed, strength=strength,
                                                 negative_prompt=negative_prompt), template)
        if self.is_recorded(template.template_id):
            return self.edit_many([request])[0]
        if request.strength < 1.0:
            image = self._run([template], [template.recorded_mask], [prompt], template.noise[None], None,
                              strength=request.strength, negative_prompts=[template.negative_prompt])[0]
            return finish(template, image, request.mask)
        self.drop_template(template.template_id)
        try:
            image = self._record(template, output_type="pil")[0]
        except CacheFull:  # the recording is the edit's by-product: it answers all the same, unrecorded
            image = self._run([template], [template.recorded_mask], [prompt], template.noise[None], None,
                              negative_prompts=[template.negative_prompt])[0]
            return finish(template, image, request.mask)
        self.templates[template.template_id] = template
        return finish(template, image, request.mask)

    def _record(self, template: Template, output_type: str = "latent"):
        """Run the full computation on the template, keeping every block's activations at every step;
        returns the pipeline's output (the recorded run's result)."""
        template_id, guidance = template.template_id, template.guidance
        width, height = template.canvas.padded
        # Y-cache edits read block outputs only: the blocks run unmodified (the stock computation) and
        # hand them over; KV-cache edits also read keys and values, which the masked path keeps.
        plan = (False,) * self.adapter.num_blocks if template.recorded_mode == "y" else None
        if self.is_unet:
            copies = 2 if self._uses_guidance(guidance) else 1

            def context_at(step: int) -> UNetMaskAwareContext:
                return UNetMaskAwareContext.record([template_id], [step], (height, width), self.adapter.num_levels,
                                                   self.cache, guidance_copies=copies, device=self.device,
                                                   block_plan=plan)
        else:
            row_ids = self._row_template_ids([template_id], guidance)
            num_image_tokens = (width // PATCH_STRIDE) * (height // PATCH_STRIDE)

            def context_at(step: int) -> MaskAwareContext:
                return MaskAwareContext.record(row_ids, [step] * len(row_ids), template.num_text_tokens,
                                               num_image_tokens, self.cache, device=self.device, block_plan=plan)

        self.begin_recording(template)
        try:
            output = self._run([template], [template.recorded_mask], [template.prompt], template.noise[None],
                               context_at, output_type=output_type, negative_prompts=[template.negative_prompt])
        except BaseException:
            self.abort_recording(template_id)
            raise
        self.commit_recording(template)
        return output

    def begin_recording(self, template: Template) -> None:
        """Before the first recorded step: what the recording keeps (its cache mode's names), and what
        it was recorded by (`adopt` reads that back)."""
        if isinstance(self.cache, CacheStore):
            line = calls_line(self.pipe.scheduler)  # its denoiser calls: the steps the recording writes
            self.cache.begin(template.template_id, RECORDED_NAMES[CACHE_MODES[template.recorded_mode]],
                             {"recorded_by": self.model_fingerprint(), "recorded_mode": template.recorded_mode,
                              "one_off": template.one_off, "shape": self._recording_shape(template)},
                             steps=None if line is None or template.steps < 2 else line[0] * template.steps + line[1])

    def adopt(self, template: Template) -> bool:
        """Whether a recording of `template` that this editor did not make serves it: one that the disk
        tier kept from an earlier process (a restarted worker, or server), recorded by the same model
        weights. If so, it is this editor's from now on, at the cost of reading its file's header. A
        one-off image's recording is not adopted: its recorded region is the first edit's mask."""
        if template.template_id in self.templates or not isinstance(self.cache, CacheStore):
            return False
        meta = self.cache.meta(template.template_id)
        if meta is not None and meta.get("recorded_by") != self.model_fingerprint():
            logger.info("template %s: its recording in the disk tier was made by other weights, dtype or scheduler; "
                        "recording it again", template.template_id)
            return False
        if (meta is None or meta.get("one_off", True)
                or meta.get("recorded_mode") not in CACHE_MODES
                or meta.get("shape") != self._recording_shape(template)):
            return False
        adopted = replace(template, recorded_mode=meta["recorded_mode"])
        if not self._covers(adopted):
            return False
        self.templates[template.template_id] = adopted
        self.cache.count_adoption()
        logger.info("template %s: adopted its recording (%s cache) from the disk tier instead of recording it",
                    template.template_id, meta["recorded_mode"])
        return True

    def _recording_shape(self, template: Template) -> dict:
        """What a recording's layout follows besides the weights: the file format, the latents' and
        text's token counts, and the cache's storage dtype (an fp8 file is not what `auto` promises)."""
        return {"format": 1, "latent_shape": list(template.latent_shape), "text_tokens": template.num_text_tokens,
                "storage": self.cache.config.dtype if isinstance(self.cache, CacheStore) else None}

    def model_fingerprint(self) -> str:
        """A digest of the pipeline: its name, dtype, scheduler and a sample of every weight of every
        component (denoiser, VAE, text encoders: the first 64 values of each tensor), so that a recording
        is never read by other weights, latents, embeddings or schedules under the same name."""
        if self._fingerprint is None:
            digest = hashlib.sha256(f"{self.model.name}|{self.model.family}|{self.dtype}|".encode())
            digest.update(describe_scheduler(self.pipe.scheduler).encode())
            modules = {name: component for name, component in sorted(self.pipe.components.items())
                       if isinstance(component, torch.nn.Module)}
            for component, module in modules.items():
                for name, tensor in module.state_dict().items():
                    sample = tensor.detach().flatten()[:64].to("cpu", torch.float32)
                    digest.update(f"{component}.{name}|{tuple(tensor.shape)}|".encode())
                    digest.update(sample.numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:24]
        return self._fingerprint

    def commit_recording(self, template: Template) -> None:
        """After the last recorded step: edits can read the template from now on."""
        if isinstance(self.cache, CacheStore):
            self.cache.commit(template.template_id)
            nbytes = self.cache.nbytes(template.template_id)
            if nbytes:
                self._recording_bytes[self._bytes_key(template)] = nbytes // self._recording_rows(template)

    def recording_bytes(self, template: Template) -> int | None:
        """The bytes a recording of `template` takes in the cache, as the last one of its shape took (its
        latents, text, schedule and cache mode, per denoiser row); before one was recorded, the largest recording
        the caches hold (an earlier process's files: recording first what they do not hold pushed out one of
        them, adopted later, at a generation's cost); None when they hold none."""
        per_row = self._recording_bytes.get(self._bytes_key(template))
        if per_row is not None:
            return per_row * self._recording_rows(template)
        return (self.cache.largest_recording() or None) if isinstance(self.cache, CacheStore) else None

    def _bytes_key(self, template: Template) -> tuple:
        return tuple(template.latent_shape), template.num_text_tokens, template.steps, template.recorded_mode

    def _recording_rows(self, template: Template) -> int:
        """The denoiser rows a recording of `template` writes: classifier-free guidance doubles SD3's and the
        UNets' (Flux's guidance is an input of its one row)."""
        doubles = self.is_unet or self.model.family == "sd3"
        return 2 if doubles and self._uses_guidance(template.guidance) else 1

    def defer_recording(self, template: Template) -> None:
        """Know `template` without recording it: its first edit records it (`lost`), as one evicted from
        every tier would be."""
        self.templates[template.template_id] = replace(template, recorded_mode=self.mode_name)

    def abort_recording(self, template_id: str) -> None:
        """Forget a recording that did not finish, and the memory its steps took (the store keeps a
        committed recording of the template; other caches cannot tell them apart and drop both)."""
        if isinstance(self.cache, CacheStore):
            self.cache.abandon(template_id)
        else:
            self.cache.drop(template_id)
            self.cache.drop(uncond_row_id(template_id))

    def switch_cache_mode(self, cache_mode: str) -> None:
        """Edit in `cache_mode` from now on. A template recorded in KV-cache mode holds every block's
        output, keys and values, so it also serves Y-cache edits; one recorded in Y-cache mode holds
        only outputs, so a KV-cache edit (or registration) of it records it again first."""
        if cache_mode not in CACHE_MODES:
            raise InputError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}")
        self.mode = CACHE_MODES[cache_mode]
        self.mode_name = cache_mode

    def warm_up(self) -> None:
        """Compile now what the first edits would compile (an editor built with `compile`): a small
        template recorded, edited alone and in a batch of two (the graphs of a batch of one and of more),
        then dropped. Token counts are dynamic in the graphs, so other sizes and masks reuse them."""
        image, corner = warm_up_inputs((64, 64))
        template_id = self.register_template(image, prompt="warm-up", steps=1)
        try:
            self.edit_many([EditRequest(template_id, corner, "warm-up")], output_type="latent")
            self.edit_many([EditRequest(template_id, corner, "warm-up"),
                            EditRequest(template_id, Image.new("L", image.size, 255), "warm-up", seed=1)],
                           output_type="latent")
        finally:
            self.drop_template(template_id)

    def drop_template(self, template_id: str) -> None:
        check_template_id(template_id)
        self.templates.pop(template_id, None)
        self.cache.drop(template_id)
        self.cache.drop(uncond_row_id(template_id))
        self.start_latents.drop(template_id)

    # ---- edits ----

    def edit(self, template_id: str, mask: Image.Image, prompt: str, seed: int = 0, steps: int | None = None,
             strength: float = 1.0, *, negative_prompt: str | None = None, guidance: float | None = None,
             full_compute: bool = False, output_type: str = "pil", paste_back: bool = True):
        """Repaint the white region of `mask` in the registered template; the template's size. Below
        `strength` 1 the masked region keeps the template's structure (`retouch.strength`). `negative_prompt`
        and `guidance` are `EditRequest`'s; the other keywords are `edit_many`'s."""
        return self.edit_many([EditRequest(template_id, mask, prompt, seed, steps, strength, negative_prompt,
                                           guidance)],
                              full_compute=full_compute, output_type=output_type, paste_back=paste_back)[0]

    @one_at_a_time
    def edit_many(self, requests: Sequence[EditRequest], *, full_compute: bool = False, output_type: str = "pil",
                  paste_back: bool = True):
        """Several edits as one ragged batch (different templates and masks; the same step count).

        `full_compute` runs the same edits (same initial noise) with the unmodified model: the
        reference a mask-aware edit approximates. `output_type="latent"` returns the final latents
        `[C, h, w]` (as the pipeline leaves them) instead of images. Images have the template's size;
        with `paste_back` (the default) every pixel the mask leaves at 0 is the template's own, and
        the rest blends the edit in by the mask's value (`retouch.canvas.paste_unmasked`).
        """
        if output_type not in ("pil", "latent"):
            raise InputError(f"output_type must be 'pil' or 'latent', got {output_type!r}")
        if isinstance(requests, EditRequest):
            raise InputError("edit_many takes a list of EditRequests: [request], or edit(...) for one")
        try:
            requests = list(requests)  # a generator is read once
        except TypeError:
            raise InputError(f"edit_many takes a list of EditRequests, got {type(requests).__name__}") from None
        if not requests:
            return []
        if not all(isinstance(request, EditRequest) for request in requests):
            raise InputError("edit_many takes EditRequests (EditRequest(template_id, mask, prompt, ...))")
        templates = [self._template(request.template_id) for request in requests]
        requests = [self.check_request(request, template) for request, template in zip(requests, templates)]
        if len({(t.steps, t.guidance, t.num_text_tokens, t.latent_shape) for t in templates}) > 1:
            raise InputError("edit_many batches templates registered with the same steps, guidance and size")
        if len({request.strength for request in requests}) > 1:
            raise InputError("edit_many batches edits of one strength (the engine batches any)")
        if len({self.edit_guidance(r, t) for r, t in zip(requests, templates)}) > 1:
            raise InputError("edit_many batches edits of one guidance scale (the engine batches any)")
        if len({request.negative_prompt is None for request in requests}) > 1:
            # One pipeline call: with no negative prompt at all, SDXL's is zeros, not an encoded ""
            raise InputError("edit_many batches edits that all give a negative_prompt or none do (the engine "
                             "batches any)")
        inputs = [self.prepare_edit(request, template) for request, template in zip(requests, templates)]
        handles = {} if full_compute else self.acquire(templates)
        try:
            context_at = None if full_compute else self._edit_contexts(inputs, handles)
            images = self._run(templates, [i.mask for i in inputs], [r.prompt for r in requests],
                               torch.stack([i.latents for i in inputs]), context_at, output_type=output_type,
                               strength=requests[0].strength, negative_prompts=[r.negative_prompt for r in requests],
                               guidance=requests[0].guidance)
        finally:
            self.release(handles.values())
        if output_type == "latent":
            return list(images)
        return [finish(template, image, request.mask) if paste_back else template.canvas.crop(image)
                for image, request, template in zip(images, requests, templates)]

    def check_request(self, request: EditRequest, template: Template | None = None) -> EditRequest:
        """`request` with its mask read once (`retouch.images.as_mask`, at the template's size), or
        the InputError that names what is wrong with it. Every entry point checks a request here
        before any work starts."""
        template = template if template is not None else self._template(request.template_id)
        if not isinstance(request.prompt, str):
            raise InputError(f"prompt must be a string, got {type(request.prompt).__name__}")
        if not request.prompt.strip():
            raise InputError("prompt is empty; say what to paint into the masked region")
        seed = check_seed(request.seed)
        if request.steps is not None and request.steps != template.steps:
            raise InputError(f"template {template.template_id!r} was recorded with {template.steps} steps; its edits "
                             f"run the same schedule (omit steps or pass {template.steps})")
        strength = check_strength(request.strength, template.steps)
        guidance = self.check_edit_guidance(request.guidance, template)
        negative_prompt = self.check_negative_prompt(request.negative_prompt,
                                                     template.guidance if guidance is None else guidance)
        return replace(request, mask=as_mask(request.mask, template.original_size), strength=strength, seed=seed,
                       negative_prompt=negative_prompt, guidance=guidance)

    def check_edit_guidance(self, guidance, template: Template) -> float | None:
        """An edit's guidance scale: None for the template's (also when it is the same number), or the
        InputError naming it. Classifier-free guidance (SD3, SDXL, SD2) mixes the denoiser's unconditional
        and conditional predictions after the blocks, so an edit may take another scale than its template's
        recording, as long as both run it (> 1): the recording's rows are what the edit's rows read. Flux
        takes guidance as an input of every block (its modulation): edits run the template's."""
        if guidance is None:
            return None
        check_guidance(guidance)
        recorded = self.default_guidance if template.guidance is None else template.guidance
        if guidance == recorded:
            return None
        if self.model.family not in GUIDED_FAMILIES:
            raise InputError(f"guidance: Flux models take guidance as an input of every block, so the edits of "
                             f"template {template.template_id!r} run its recording's ({recorded:g}); got {guidance:g}")
        if not recorded > 1:
            raise InputError(f"guidance: template {template.template_id!r} was recorded without classifier-free "
                             f"guidance (guidance {recorded:g}), so its edits run without it; got {guidance:g}")
        if not guidance > 1:
            raise InputError(f"guidance: the edits of template {template.template_id!r} run classifier-free guidance, "
                             f"as its recording (guidance {recorded:g}): send a guidance > 1, got {guidance:g}")
        return float(guidance)

    def edit_guidance(self, request: EditRequest, template: Template) -> float | None:
        """The guidance scale an edit (checked) runs at: its own, else its template's (None: the pipeline's)."""
        return template.guidance if request.guidance is None else request.guidance

    def check_negative_prompt(self, negative_prompt, guidance: float | None) -> str | None:
        """`check_negative_prompt` at `guidance` (None: the pipeline's default). An edit's negative prompt
        conditions the tokens it computes; the rest keep the template's recording, made with the template's."""
        return check_negative_prompt(negative_prompt, self.model.family,
                                     self.default_guidance if guidance is None else guidance)

    def prepare_edit(self, request: EditRequest, template: Template | None = None) -> EditInputs:
        """What an edit feeds the denoiser: its mask on the canvas, the tokens it recomputes (its mask's,
        and the region the template's recording repainted, whose cached activations are not the
        template's), and its initial latents (the template's noise, the edit seed's at its masked
        tokens). `request` as `check_request` returned it."""
        template = template if template is not None else self._template(request.template_id)
        mask = template.canvas.mask(request.mask)
        compute_mask = ImageChops.lighter(mask, template.recorded_mask)
        stride = self.token_stride
        tokens = token_mask(compute_mask, stride, self.dilation)
        # The edit's seed draws the noise of its own masked tokens' latent pixels (2x2 per transformer
        # token, 1 per token of a UNet's first level); the rest keeps the template's.
        noise_tokens = token_mask(mask, stride, self.dilation)
        latent_mask = noise_tokens if self.is_unet else noise_tokens.repeat_interleave(2, 0).repeat_interleave(2, 1)
        width, height = template.canvas.padded
        noise = torch.where(latent_mask, self._noise(request.seed, height, width), template.noise)
        return EditInputs(template, mask, compute_mask, masked_token_indices(tokens), noise)

    def prepare_recording(self, template: Template, records: bool = True) -> EditInputs:
        """The template's recorded run as a member of a batch: its own conditioning mask, prompt and
        noise, every token computed; with `records`, its activations written to the cache (without,
        the same full computation only answers: a one-off edit while its image is being recorded)."""
        everything = Image.new("L", template.canvas.padded, 255)
        return EditInputs(template, template.recorded_mask, everything, torch.arange(self.num_tokens(template)),
                          template.noise, records=records)

    def edit_context(self, inputs: Sequence[EditInputs], steps: Sequence[int], cache: ActivationCache,
                     block_plan: Sequence[bool] | None = None, record_to: ActivationCache | None = None):
        """The adapter context of one forward over edits (and recordings), request b at its step
        `steps[b]` (each at its own point of its own schedule under continuous batching). Recordings
        write into `record_to` (default: the editor's cache)."""
        templates = [i.template for i in inputs]
        template_ids = [t.template_id for t in templates]
        records = [i.records for i in inputs]
        record_to = (record_to or self.cache) if any(records) else None
        if self.is_unet:
            copies = 2 if self._uses_guidance(templates[0].guidance) else 1
            return UNetMaskAwareContext.edit(self.mode, [i.compute_mask for i in inputs], template_ids, steps,
                                             self.adapter.num_levels, cache, dilation=self.dilation,
                                             block_plan=block_plan, guidance_copies=copies, device=self.device,
                                             records=records, record_to=record_to)
        row_ids = self._row_template_ids(template_ids, templates[0].guidance)
        copies = len(row_ids) // len(templates)
        num_image = [t.latent_shape[1] * t.latent_shape[2] // 4 for t in templates]
        if len({t.num_text_tokens for t in templates}) > 1:
            raise ValueError("requests of one forward must have the same number of text tokens")
        # One count for a batch of one size; one per denoiser row for a mixed-resolution batch.
        num_image = num_image[0] if len(set(num_image)) == 1 else num_image * copies
        return MaskAwareContext.edit(self.mode, [i.masked_idx for i in inputs] * copies, row_ids,
                                     list(steps) * copies, templates[0].num_text_tokens, num_image, cache,
                                     block_plan=block_plan, device=self.device, records=records * copies,
                                     record_to=record_to)

    def staged_edit_context(self, inputs: Sequence[EditInputs], steps: Sequence[int],
                            handles: dict[str, TemplateHandle], block_plan: Sequence[bool] | None = None,
                            record_to: ActivationCache | None = None):
        """`edit_context`, its cache rows staged ahead of compute by the copy engine when the cache is
        the store (enter its `StagedActivations` around the forward); the planner's block plan for this
        batch when the editor has a cost model and no fixed plan. A batch that reuses nothing (only
        recordings and full masks) runs the stock blocks; one with a KV-cache recording runs every
        block mask-aware (it keeps keys and values)."""
        records_kv = self.mode is CacheMode.KV_CACHE and any(i.records for i in inputs)
        if records_kv:
            block_plan = None  # a KV-cache recording keeps every block's keys and values: the masked path
        elif all(len(i.masked_idx) == self.num_tokens(i.template) for i in inputs):
            block_plan = (False,) * self.adapter.num_blocks  # nothing to reuse: the stock blocks
        else:
            if block_plan is None:
                block_plan = self.block_plan
            if block_plan is None and self.cost_model is not None:
                block_plan = self.plan_blocks(self.edit_context(inputs, steps, self.cache))

        def build(cache: ActivationCache):
            return self.edit_context(inputs, steps, cache, block_plan, record_to)

        if self.copy_engine is None:
            return build(self.cache)
        return staged_context(build, self.copy_engine, self.adapter, handles, self.dtype)

    def _edit_contexts(self, inputs: Sequence[EditInputs], handles: dict[str, TemplateHandle]):
        """context_at(step) of an edit batch whose requests are all at the same step: one block plan
        for the whole run."""
        plan = self.block_plan
        if plan is None and self.cost_model is not None:
            plan = self.plan_blocks(self.edit_context(inputs, [0] * len(inputs), self.cache))
        return lambda step: self.staged_edit_context(inputs, [step] * len(inputs), handles, plan)

    def plan_blocks(self, context) -> tuple[bool, ...]:
        """The planner's choice, per block, of cache or full compute for this batch (Algorithm 1 or the
        exact optimum), from the cost model's predictions; also kept as `last_plan`."""
        from retouch import planner

        costs = self.cost_model.block_costs(row_tokens(context, self.cost_model.block_kinds), self.mode_name)
        self.last_plan = (planner.optimal_plan if self.planner == "optimal" else planner.algorithm1)(costs)
        return self.last_plan.use_cache

    def prefetch(self, template: Template) -> Future | None:
        """Start reading the template's recording from disk into host memory, in the background, if
        it is there and not in host memory (the store's `prefetch`: a done future when there is nothing
        to read); None when the cache is not the store. `acquire` then finds it loaded, or waits for
        the read under way."""
        return self.cache.prefetch(template.template_id) if isinstance(self.cache, CacheStore) else None

    def acquire(self, templates: Sequence[Template]) -> dict[str, TemplateHandle]:
        """Handles on the templates' recordings in host memory (none when the cache is not the store).
        A template no tier holds any more (evicted without a disk tier, or its file was corrupt), or
        whose recording lacks what the current cache mode reads, is recorded again: a recompute,
        never a wrong image."""
        handles: dict[str, TemplateHandle] = {}
        try:
            for template in templates:
                template_id = template.template_id
                if template_id in handles:
                    continue
                if not isinstance(self.cache, CacheStore):
                    if not self.cache.contains(template_id):
                        self._recompute(template)
                    continue
                if not self._covers(self.templates.get(template_id, template)):
                    self._recompute(template)
                try:
                    handles[template_id] = self.cache.acquire(template_id)
                except CacheMiss:
                    self._recompute(template)
                    handles[template_id] = self.cache.acquire(template_id)
        except BaseException:
            for handle in handles.values():
                handle.release()
            raise
        return handles

    def release(self, handles: Iterable[TemplateHandle]) -> None:
        """Release `acquire`'s handles once their forwards are done on the host: on a GPU the copy engine's
        copies from them may still run, so their memory is kept until those have (`CopyEngine.fence`)."""
        fence = self.copy_engine.fence() if self.copy_engine is not None else None
        for handle in handles:
            handle.release(fence)

    def _recompute(self, template: Template) -> None:
        template = self.to_record_again(template)
        self._record(template)
        if template.template_id in self.templates:
            self.templates[template.template_id] = template

    def lost(self, template: Template) -> bool:
        """Whether `acquire` would record the template again: the store holds it in no tier any more
        (evicted without a disk tier), or its recording lacks what the current cache mode reads. A one-off
        image's recording is made again as its first edit made it (its prompt, seed and `recorded_mask` are
        that edit's), so its later edits read what they read before it was lost."""
        if not isinstance(self.cache, CacheStore):
            return False
        template = self.templates.get(template.template_id, template)
        return not self._covers(template) or not self.cache.contains(template.template_id)

    def to_record_again(self, template: Template, missed: bool = False) -> Template:
        """The template as it is recorded again (`lost`), in the current cache mode; counted in `recomputes`.
        `missed`: found lost by `lost`, not by `acquire`, which counts the store's misses: counted here."""
        self.recomputes += 1
        if missed and isinstance(self.cache, CacheStore) and not self.cache.contains(template.template_id):
            self.cache.count_miss()
        return replace(self.templates.get(template.template_id, template), recorded_mode=self.mode_name)

    def _covers(self, template: Template) -> bool:
        """Whether the template's recording holds what an edit in the current mode reads."""
        if not isinstance(self.cache, CacheStore) or self.mode is CacheMode.Y_CACHE:
            return True  # other caches keep everything a recording writes; every recording holds outputs
        return template.recorded_mode == "kv"

    # ---- the pipeline run ----

    def _run(self, templates: Sequence[Template], masks: Sequence[Image.Image], prompts: Sequence[str],
             latents: torch.Tensor, context_at, output_type: str = "pil", strength: float = 1.0,
             negative_prompts: Sequence[str | None] | None = None, guidance: float | None = None):
        """One pipeline call over the batch; the denoiser's forward at step i of the template's schedule
        runs under context_at(i) (the unmodified model where context_at is None). Below `strength` 1 the
        first forward is a later step's (`retouch.strength`)."""
        step = None
        with ExitStack() as active:

            def enter(module, args, kwargs):
                nonlocal step
                if step is None:
                    step = start_step(self.pipe)
                context = context_at(step)
                staged = context.cache if isinstance(context.cache, StagedActivations) else None
                if staged is not None:
                    active.callback(staged.abandon)  # its copies have started: end them if the forward never runs
                active.enter_context(self.adapter.run(context))
                if staged is not None:
                    active.enter_context(staged)  # finishes its copies after the forward, or on an error

            def leave(module, args, kwargs, output):
                nonlocal step
                active.close()
                step += 1

            hooks = [] if context_at is None else [
                self.denoiser.register_forward_pre_hook(enter, with_kwargs=True),
                self.denoiser.register_forward_hook(leave, with_kwargs=True)]
            try:
                kwargs = self.pipeline_kwargs(templates, masks, prompts, latents, output_type, strength,
                                              negative_prompts, guidance)
                # Full compute encodes the template for the start every time, as the stock pipeline does.
                start = noised_start(self.pipe, strength, latents, None if context_at is None else self.start_latents,
                                     tuple((t.template_id, t.seed) for t in templates))
                with torch.inference_mode(), quiet_libraries(), start:
                    return self.pipe(**kwargs).images
            finally:
                for hook in hooks:
                    hook.remove()

    def pipeline_kwargs(self, templates: Sequence[Template], masks: Sequence[Image.Image], prompts: Sequence[str],
                        latents: torch.Tensor, output_type: str = "pil", strength: float = 1.0,
                        negative_prompts: Sequence[str | None] | None = None, guidance: float | None = None) -> dict:
        """The stock pipeline's arguments for a batch of edits (or a recording) starting from `latents` (the
        noise; below `strength` 1, enter `retouch.strength.noised_start` around the call). `negative_prompts`:
        all None or all given (`check_negative_prompt`); `guidance`: the edits' own (`check_edit_guidance`;
        None: the template's)."""
        template = templates[0]
        width, height = template.canvas.padded
        kwargs = dict(self.model.call_defaults)
        kwargs.update(
            prompt=list(prompts), image=[t.image for t in templates], mask_image=list(masks),
            height=height, width=width, num_inference_steps=template.steps,
            latents=self._latents_argument(latents),
            # Per-template generators: the VAE posterior sample of a template is the same at
            # registration and at every edit.
            generator=[torch.Generator("cpu").manual_seed(t.seed) for t in templates],
            output_type=output_type)
        if guidance is not None or template.guidance is not None:
            kwargs["guidance_scale"] = template.guidance if guidance is None else guidance
        if negative_prompts is not None and any(negative is not None for negative in negative_prompts):
            kwargs["negative_prompt"] = list(negative_prompts)
        kwargs["strength"] = strength  # the SDXL pipeline's default is 0.9999, which skips a step
        return kwargs

    # ---- helpers ----

    def _template(self, template_id: str) -> Template:
        check_template_id(template_id)
        template = self.templates.get(template_id)
        if template is None:
            raise InputError(f"unknown template {template_id!r}; register it first")
        return template

    def _latents_argument(self, latents: torch.Tensor) -> torch.Tensor:
        return latents_argument(latents, self.model.family, self.device, self.dtype)

    def _noise(self, seed: int, height: int, width: int) -> torch.Tensor:
        return initial_noise(self.pipe, seed, (width, height))

    def _num_text_tokens(self) -> int:
        # Flux pads T5 prompts to max_sequence_length; SD3 puts the padded CLIP tokens before them.
        # UNets read text only as cross-attention keys, which are never cached: nothing to count.
        if self.is_unet:
            return 0
        default = inspect.signature(self.pipe.__call__).parameters["max_sequence_length"].default
        max_sequence_length = int(self.model.call_defaults.get("max_sequence_length", default))
        if self.model.family == "sd3":
            return self.pipe.tokenizer_max_length + max_sequence_length
        return max_sequence_length

    def _row_template_ids(self, template_ids: Sequence[str], guidance: float | None) -> list[str]:
        """The template id each row of the denoiser's batch reads or writes: with classifier-free
        guidance the pipeline runs [unconditional; conditional] rows, recorded apart."""
        if self.model.family != "sd3" or not self._uses_guidance(guidance):
            return list(template_ids)
        return [uncond_row_id(template_id) for template_id in template_ids] + list(template_ids)

    def _uses_guidance(self, guidance: float | None) -> bool:
        return (self.default_guidance if guidance is None else guidance) > 1

    def _template_id(self, image: Image.Image, prompt: str, steps: int, seed: int, guidance: float | None,
                     mask: Image.Image | None, scope: str = "", negative_prompt: str | None = None) -> str:
        digest = hashlib.sha256()
        digest.update(f"{self.model.name}|{image.size}|{prompt}|{steps}|{seed}|{guidance}|".encode())
        if negative_prompt is not None:  # ids of templates without one are as before (disk tiers adopt them)
            digest.update(f"negative|{len(negative_prompt)}|{negative_prompt}|".encode())
        digest.update(image.tobytes())
        if mask is not None:
            digest.update(b"mask|" + mask.tobytes())
        if scope:
            digest.update(f"scope|{scope}|".encode())
        _digest_profile(digest, image)
        return digest.hexdigest()[:16]


def _digest_profile(digest, image: Image.Image) -> None:
    """A template's answers carry its colour profile (`paste_unmasked`): the same pixels under another
    profile are another template, or its edits would answer in the first one's colours."""
    profile = colour_profile(image)
    if profile is not None:
        digest.update(b"icc|" + profile)


def check_template_id(template_id) -> None:
    """None, or a request in a template id's place, failed as an AttributeError deep inside."""
    if not isinstance(template_id, str):
        raise InputError(f"a template id is a string (what register_template answers), got "
                         f"{type(template_id).__name__}")


def check_steps(steps) -> int:
    """`steps` as an int (numpy's integers too), or the InputError."""
    value = _integer(steps)
    if value is None or not 1 <= value <= MAX_STEPS:
        raise InputError(f"steps must be an integer in [1, {MAX_STEPS}], got {steps!r}")
    return value


def check_seed(seed) -> int:
    """A seed torch's generators take: an integer in [0, 2**64) (numpy's integers too), as an int."""
    value = _integer(seed)
    if value is None or not 0 <= value < 2**64:
        raise InputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return value


def _integer(value) -> int | None:
    """`value` as an int where it is an integer of any kind (`operator.index`: numpy's too), not a bool."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def default_guidance(pipe) -> float:
    """The guidance scale `pipe` runs at when it is given none."""
    return inspect.signature(pipe.__call__).parameters["guidance_scale"].default


def check_negative_prompt(negative_prompt, family: str, guidance: float,
                          names: tuple[str, str] = ("negative_prompt", "guidance")) -> str | None:
    """`negative_prompt` as the pipeline is given it, or the InputError naming it. Blank is none (None: the
    pipeline's default, an encoded "" or, where the model says so (SDXL), zeros). It steers the
    unconditional rows of classifier-free guidance, so it is refused where there are none: Flux
    (guidance-distilled; FluxFillPipeline would not even take it) and `guidance` <= 1. `names`: of the two
    fields in the caller's words (the CLI's flags)."""
    field, guidance_field = names
    if negative_prompt is None:
        return None
    if not isinstance(negative_prompt, str):
        raise InputError(f"{field} must be a string, got {type(negative_prompt).__name__}")
    if not negative_prompt.strip():
        return None
    if family not in GUIDED_FAMILIES:
        raise InputError(f"{field}: Flux models are guidance-distilled: they run no unconditional branch for "
                         "a negative prompt to steer")
    if not guidance > 1:
        raise InputError(f"{field} needs classifier-free guidance ({guidance_field} > 1); the guidance here is "
                         f"{guidance:g}")
    return negative_prompt


def check_guidance(guidance) -> None:
    if guidance is not None and (isinstance(guidance, bool) or not isinstance(guidance, (int, float))
                                 or not math.isfinite(guidance) or guidance < 0):
        raise InputError(f"guidance must be a number >= 0 (or None: the pipeline's), got {guidance!r}")


def finish(template: Template, image: Image.Image, mask: Image.Image) -> Image.Image:
    """A decoded edit on the template's canvas -> the answer: cropped to the template's size, the
    template's own pixels wherever `mask` (as `check_request` left it) is 0."""
    return paste_unmasked(template.source, template.canvas.crop(image), mask)


def load(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32, scheduler: str | None = None,
         **editor_options) -> MaskAwareEditor:
    """A mask-aware editor on a built-in model name or a local diffusers pipeline folder; `scheduler`
    (`"dpm++2m-karras"`, `"DDIMScheduler:timestep_spacing=trailing"`: `retouch.models.samplers`)
    replaces the pipeline's own."""
    return MaskAwareEditor(load_pipeline(model, device=device, dtype=dtype, scheduler=scheduler), **editor_options)
