"""Build a built-in model's components in memory, with seeded random weights.

Every weight-bearing component draws from its own seed, derived from the model name and the
component name, so a denoiser built alone is identical to the one inside the full pipeline, and a
given (name, device type, dtype) gives the same weights in every process.
"""

import dataclasses
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import diffusers
import torch
import transformers
from diffusers import AutoencoderKL, DiffusionPipeline

from .narrow import narrow_denoiser_config
from .quiet import quiet_libraries
from .registry import get_spec
from .spec import ModelSpec, TextEncoderSpec
from .tokenizers import build_clip_tokenizer, build_t5_tokenizer


def build_denoiser(
    name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, narrow: bool = False
) -> torch.nn.Module:
    """The model's transformer or UNet with random weights, created directly on `device` in `dtype`.

    device="meta" allocates nothing (FLUX.1-size is 11.9 B parameters): use it to inspect shapes and
    count parameters. On a GPU the random init runs there, seconds even for the largest spec.
    `narrow`: its depth and block structure at a tiny width (`retouch.models.narrow`).
    """
    spec = get_spec(name)
    if narrow:
        spec = dataclasses.replace(spec, denoiser_config=narrow_denoiser_config(spec.family, spec.denoiser_config))
    with quiet_libraries():
        return _build_denoiser(spec, torch.device(device), dtype)


def unpatched_twin(denoiser: torch.nn.Module) -> torch.nn.Module:
    """A second instance of `denoiser`'s class that shares its parameters and buffers (no memory of its own)
    but none of its instance state: the stock model next to a patched one (`patch_flux` and the others
    replace block `forward`s and add hooks on the instance), for a baseline compiled or run eagerly
    beside the patched model without a second copy of a 24 GB transformer. Its weights never train."""
    with quiet_libraries(), torch.device("meta"):
        twin = type(denoiser).from_config(denoiser.config)
    twin.load_state_dict(denoiser.state_dict(), strict=True, assign=True)
    # Non-persistent buffers (rotary tables, position ids) are not in a state dict.
    originals = dict(denoiser.named_buffers())
    for name, buffer in list(twin.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            twin.get_submodule(owner).register_buffer(leaf, originals[name], persistent=False)
    return twin.train(denoiser.training).requires_grad_(False)  # an inference baseline


def build_pipeline(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DiffusionPipeline:
    """The full diffusers pipeline: seeded random weights, local tokenizers, real scheduler.

    Every module is created on `device` (the seeded draws differ between devices, so weights built on
    a GPU differ from the exported, CPU-built ones; their shapes and FLOPs do not)."""
    spec = get_spec(name)
    device = torch.device(device)
    with quiet_libraries():
        pipeline_class = getattr(diffusers, spec.pipeline_class)
        components = {
            spec.denoiser_component: _build_denoiser(spec, device, dtype),
            "scheduler": getattr(diffusers, spec.scheduler_class).from_config(spec.scheduler_config),
        }
        with _seeded_construction(_component_seed(spec, "vae"), device, dtype):
            components["vae"] = AutoencoderKL.from_config(spec.vae_config)
        for encoder in spec.text_encoders:
            tokenizer = build_t5_tokenizer() if encoder.tokenizer_kind == "t5" else build_clip_tokenizer()
            components[encoder.tokenizer_component] = tokenizer
            with _seeded_construction(_component_seed(spec, encoder.component), device, dtype):
                components[encoder.component] = _build_text_encoder(encoder, tokenizer)
        # Image encoders (IP-Adapter) and safety checkers are optional and retouch uses neither.
        for optional in pipeline_class._optional_components:
            components.setdefault(optional, None)
        pipe = pipeline_class(**components, **spec.pipeline_config).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _build_denoiser(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    denoiser_class = getattr(diffusers, spec.denoiser_class)
    with _seeded_construction(_component_seed(spec, spec.denoiser_component), device, dtype):
        denoiser = denoiser_class.from_config(spec.denoiser_config)
    # Buffers computed from numpy in __init__ (SD3's sin-cos position table) ignore the default
    # device and dtype; this moves them to match the parameters.
    return denoiser.to(device=device, dtype=dtype).eval()


def _build_text_encoder(encoder: TextEncoderSpec, tokenizer) -> torch.nn.Module:
    """The encoder with its embedding table sized to the tokenizer and its special ids taken from it."""
    is_t5 = encoder.tokenizer_kind == "t5"
    config_class = transformers.T5Config if is_t5 else transformers.CLIPTextConfig
    special_ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    if is_t5:
        # T5 has no start token; the decoder would start from pad (not built for an encoder).
        special_ids["decoder_start_token_id"] = tokenizer.pad_token_id
    else:
        special_ids["bos_token_id"] = tokenizer.bos_token_id
    config = config_class(vocab_size=len(tokenizer), **special_ids, **encoder.config)
    return getattr(transformers, encoder.model_class)(config).eval()


def _component_seed(spec: ModelSpec, component: str) -> int:
    # crc32 rather than hash(): Python salts str hashes per process.
    return zlib.crc32(f"{spec.name}/{component}".encode())


@contextmanager
def _seeded_construction(seed: int, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Modules created in the block get their parameters on `device`, in `dtype`, from `seed`.

    Creating them in place (instead of on the CPU in fp32, then moving and casting) is what lets an
    11.9 B transformer be built on a GPU in bf16 at all. The caller's RNG state and default dtype are
    restored afterwards.
    """
    # manual_seed reseeds every GPU, so every GPU's state is saved and restored, not just `device`'s.
    rng_devices = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    previous_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with device:
                yield
        finally:
            torch.set_default_dtype(previous_dtype)
