"""Benchmark built-in models: published denoiser and VAE sizes with random weights.

The denoiser is what retouch accelerates, so its config is the published one (or, for flux-small and
flux-demo, a cut-down FLUX.1 that a CPU can run). Text encoders are small stand-ins with the real
output widths: they run once per request, outside the denoising loop. Benchmarks and the demo build
them in memory (`loading.load_for_bench`) rather than from an exported folder.
"""

import torch

from . import published
from .spec import ModelSpec
from .text_encoders import small_clip, small_t5
from .tiny import TINY_FLUX_VAE

_BENCH = {"kind": "bench", "export_dtype": torch.bfloat16}
_SMALL_TEXT = "small text encoders with the real output widths"

# CLIP-L (Flux pooled input, SDXL first encoder), CLIP-G (SDXL), OpenCLIP-H (SD 2), T5-XXL widths.
_CLIP_L_WIDTH = 768
_CLIP_G_WIDTH = 1280
_OPENCLIP_H_WIDTH = 1024
_T5_XXL_WIDTH = 4096


# FLUX.1-Fill-dev cut to a size a CPU runs a step of in about a second (flux-small, flux-demo).
_FLUX_SMALL_TRANSFORMER = {
    **published.FLUX_FILL_DEV_TRANSFORMER,
    "num_layers": 2,
    "num_single_layers": 4,
    "num_attention_heads": 8,
}
_FLUX_SMALL_RESOLUTION = 512


def _flux_text_encoders() -> tuple:
    return (
        small_clip("text_encoder", "tokenizer", hidden_size=_CLIP_L_WIDTH),
        small_t5("text_encoder_2", "tokenizer_2", d_model=_T5_XXL_WIDTH),
    )


BENCH_SPECS = (
    ModelSpec(
        name="flux-small",
        family="flux-fill",
        pipeline_class="FluxFillPipeline",
        description=(
            "FLUX.1-Fill blocks cut to 8x128 heads, 2 double + 4 single (150 M), Flux VAE; "
            f"512x512 = 1024 image + 64 text tokens; {_SMALL_TEXT}; the CPU speed model"
        ),
        resolution=_FLUX_SMALL_RESOLUTION,
        call_defaults={"max_sequence_length": 64},
        denoiser_class="FluxTransformer2DModel",
        denoiser_config=_FLUX_SMALL_TRANSFORMER,
        vae_config=published.FLUX_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.FLUX_SCHEDULER,
        text_encoders=_flux_text_encoders(),
        **_BENCH,
    ),
    # flux-small's full-size VAE takes ~20 s of a 512 px edit on a 2-core CPU, against ~10 s for 8 full
    # denoising steps, so a whole edit is barely faster mask-aware there; at full size on a GPU the VAE
    # is ~5% of an edit. The tiny models' VAE (same 16 latent channels, 8x downscale and four levels,
    # 16-32 channels wide: ~0.3 s at 512 px) gives the denoiser its real share back.
    ModelSpec(
        name="flux-demo",
        family="flux-fill",
        pipeline_class="FluxFillPipeline",
        description=(
            "flux-small's transformer (150 M) and text encoders with the tiny models' narrow Flux VAE, so that "
            "on a CPU the denoiser takes the share of an edit it takes at full size on a GPU; the `make demo` "
            "model (1-3 minutes on a 2-core CPU)"
        ),
        resolution=_FLUX_SMALL_RESOLUTION,
        call_defaults={"max_sequence_length": 64},
        denoiser_class="FluxTransformer2DModel",
        denoiser_config=_FLUX_SMALL_TRANSFORMER,
        vae_config={**TINY_FLUX_VAE, "sample_size": _FLUX_SMALL_RESOLUTION},
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.FLUX_SCHEDULER,
        text_encoders=_flux_text_encoders(),
        **_BENCH,
    ),
    ModelSpec(
        name="flux-size",
        family="flux-fill",
        pipeline_class="FluxFillPipeline",
        description=f"FLUX.1-Fill-dev transformer (11.9 B) and VAE, random weights, 1024x1024; {_SMALL_TEXT}",
        resolution=1024,
        call_defaults={"max_sequence_length": 512},
        denoiser_class="FluxTransformer2DModel",
        denoiser_config=published.FLUX_FILL_DEV_TRANSFORMER,
        vae_config=published.FLUX_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.FLUX_SCHEDULER,
        text_encoders=_flux_text_encoders(),
        **_BENCH,
    ),
    ModelSpec(
        name="sd3-size",
        family="sd3",
        pipeline_class="StableDiffusion3InpaintPipeline",
        description=f"SD3-medium transformer (2 B) and VAE, random weights, 1024x1024; {_SMALL_TEXT}",
        resolution=1024,
        call_defaults={"max_sequence_length": 256},
        denoiser_class="SD3Transformer2DModel",
        denoiser_config=published.SD3_MEDIUM_TRANSFORMER,
        vae_config=published.SD3_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.SD3_SCHEDULER,
        text_encoders=(
            small_clip("text_encoder", "tokenizer", hidden_size=_CLIP_L_WIDTH, projection_dim=_CLIP_L_WIDTH),
            small_clip("text_encoder_2", "tokenizer_2", hidden_size=_CLIP_G_WIDTH, projection_dim=_CLIP_G_WIDTH),
            small_t5("text_encoder_3", "tokenizer_3", d_model=_T5_XXL_WIDTH),
        ),
        **_BENCH,
    ),
    ModelSpec(
        name="sdxl-size",
        family="sdxl",
        pipeline_class="StableDiffusionXLInpaintPipeline",
        description=f"SDXL-inpainting-0.1 UNet (2.57 B) and VAE, random weights, 1024x1024; {_SMALL_TEXT}",
        resolution=1024,
        call_defaults={},
        denoiser_class="UNet2DConditionModel",
        denoiser_config=published.SDXL_INPAINT_UNET,
        vae_config=published.SDXL_VAE,
        scheduler_class="EulerDiscreteScheduler",
        scheduler_config=published.SDXL_SCHEDULER,
        text_encoders=(
            small_clip("text_encoder", "tokenizer", hidden_size=_CLIP_L_WIDTH),
            small_clip("text_encoder_2", "tokenizer_2", hidden_size=_CLIP_G_WIDTH, projection_dim=_CLIP_G_WIDTH),
        ),
        pipeline_config={"requires_aesthetics_score": False, "force_zeros_for_empty_prompt": True},
        **_BENCH,
    ),
    ModelSpec(
        name="sd2-size",
        family="sd2",
        pipeline_class="StableDiffusionInpaintPipeline",
        description=f"SD-2-inpainting UNet (866 M) and VAE, random weights, 512x512; {_SMALL_TEXT}",
        resolution=512,
        call_defaults={},
        denoiser_class="UNet2DConditionModel",
        denoiser_config=published.SD2_INPAINT_UNET,
        vae_config=published.SD2_VAE,
        scheduler_class="PNDMScheduler",
        scheduler_config=published.SD2_SCHEDULER,
        text_encoders=(small_clip("text_encoder", "tokenizer", hidden_size=_OPENCLIP_H_WIDTH),),
        pipeline_config={"requires_safety_checker": False},
        **_BENCH,
    ),
)
