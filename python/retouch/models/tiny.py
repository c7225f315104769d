"""Tiny built-in models: real pipeline classes and geometry, 16-64 channels wide.

Each runs a 4-step 128x128 inpaint edit on a laptop CPU in a fraction of a second, so tests exercise
the same code paths as the published models: the VAEs keep four resolution levels (vae_scale_factor
8, a 128x128 edit is a 16x16 latent and 64 packed Flux tokens), the Flux/SD3 latents keep 16
channels, and the UNets keep their published sequence of down/up block types.
"""

from . import published
from .spec import ModelSpec
from .text_encoders import small_clip, small_t5

TINY_RESOLUTION = 128
# T5 runs to max_sequence_length tokens whatever the prompt; 32 keeps it negligible on a CPU.
TINY_TEXT_TOKENS = 32


def _tiny_vae(latent_channels: int, scaling_factor: float, shift_factor: float | None, quant_conv: bool) -> dict:
    """An AutoencoderKL with the published four-level layout (8x downsampling) and 16-32 channels."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [16, 16, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "latent_channels": latent_channels,
        "sample_size": TINY_RESOLUTION,
        "scaling_factor": scaling_factor,
        "shift_factor": shift_factor,
        "use_quant_conv": quant_conv,
        "use_post_quant_conv": quant_conv,
        # Tiny models run in fp32; with force_upcast the SDXL pipeline recasts the VAE on every call.
        "force_upcast": False,
    }


# Flux: 16 latent channels, packed 2x2 into 64-wide tokens; latent scaling as in FLUX.1. Also the VAE
# of flux-demo (bench.py), which pairs it with flux-small's transformer.
TINY_FLUX_VAE = _tiny_vae(16, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False)
_SD3_VAE = _tiny_vae(16, scaling_factor=1.5305, shift_factor=0.0609, quant_conv=False)
_SDXL_VAE = _tiny_vae(4, scaling_factor=0.13025, shift_factor=None, quant_conv=True)
_SD2_VAE = _tiny_vae(4, scaling_factor=0.18215, shift_factor=None, quant_conv=True)

_TINY_WIDTH = 32  # text-encoder and transformer width used throughout


def _tiny_flux_transformer(in_channels: int, out_channels: int) -> dict:
    return {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "num_layers": 1,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "joint_attention_dim": _TINY_WIDTH,  # = T5 d_model
        "pooled_projection_dim": _TINY_WIDTH,  # = CLIP hidden size (Flux pools CLIP-L)
        "guidance_embeds": True,  # FLUX.1-dev and -Fill-dev are guidance-distilled
        "axes_dims_rope": [4, 6, 6],  # sums to attention_head_dim, like [16, 56, 56] for 128
    }


def _flux_text_encoders() -> tuple:
    return (
        small_clip("text_encoder", "tokenizer", hidden_size=_TINY_WIDTH),
        small_t5("text_encoder_2", "tokenizer_2", d_model=_TINY_WIDTH),
    )


TINY_SPECS = (
    ModelSpec(
        name="tiny-flux-fill",
        kind="tiny",
        family="flux-fill",
        pipeline_class="FluxFillPipeline",
        description="FLUX.1-Fill layout (384-channel packed input), random weights, 0.1 M-param transformer; for tests",
        resolution=TINY_RESOLUTION,
        call_defaults={"max_sequence_length": TINY_TEXT_TOKENS},
        denoiser_class="FluxTransformer2DModel",
        # 384 = 16*4 packed latents + 16*4 packed masked-image latents + 64*4 packed 8x8 mask pixels,
        # exactly the published Fill layout: it depends only on latent channels and vae_scale_factor.
        denoiser_config=_tiny_flux_transformer(in_channels=384, out_channels=64),
        vae_config=TINY_FLUX_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.FLUX_SCHEDULER,
        text_encoders=_flux_text_encoders(),
    ),
    ModelSpec(
        name="tiny-flux-inpaint",
        kind="tiny",
        family="flux-inpaint",
        pipeline_class="FluxInpaintPipeline",
        description="FLUX.1-dev layout, repaint-style inpainting, random weights, 0.1 M-param transformer; for tests",
        resolution=TINY_RESOLUTION,
        call_defaults={"max_sequence_length": TINY_TEXT_TOKENS},
        denoiser_class="FluxTransformer2DModel",
        denoiser_config=_tiny_flux_transformer(in_channels=64, out_channels=64),
        vae_config=TINY_FLUX_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.FLUX_SCHEDULER,
        text_encoders=_flux_text_encoders(),
    ),
    ModelSpec(
        name="tiny-sd3-inpaint",
        kind="tiny",
        family="sd3",
        pipeline_class="StableDiffusion3InpaintPipeline",
        description="SD3 layout (MMDiT; CLIP-L + CLIP-G + T5), random weights, 0.08 M-param transformer; for tests",
        resolution=TINY_RESOLUTION,
        call_defaults={"max_sequence_length": TINY_TEXT_TOKENS},
        denoiser_class="SD3Transformer2DModel",
        denoiser_config={
            "sample_size": TINY_RESOLUTION // 8,
            "patch_size": 2,
            "in_channels": 16,  # the SD3 inpaint pipeline accepts 16 (repaint) or 33 (mask-conditioned)
            "out_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 2 * _TINY_WIDTH,  # = T5 d_model; CLIP-L ++ CLIP-G is zero-padded to it
            "caption_projection_dim": _TINY_WIDTH,
            "pooled_projection_dim": 2 * _TINY_WIDTH,  # = CLIP-L projection ++ CLIP-G projection
            "pos_embed_max_size": 64,  # patches per side: edits up to 1024 px (published: 192)
        },
        vae_config=_SD3_VAE,
        scheduler_class="FlowMatchEulerDiscreteScheduler",
        scheduler_config=published.SD3_SCHEDULER,
        text_encoders=(
            small_clip("text_encoder", "tokenizer", hidden_size=_TINY_WIDTH, projection_dim=_TINY_WIDTH),
            small_clip("text_encoder_2", "tokenizer_2", hidden_size=_TINY_WIDTH, projection_dim=_TINY_WIDTH),
            small_t5("text_encoder_3", "tokenizer_3", d_model=2 * _TINY_WIDTH),
        ),
    ),
    ModelSpec(
        name="tiny-sdxl-inpaint",
        kind="tiny",
        family="sdxl",
        pipeline_class="StableDiffusionXLInpaintPipeline",
        description="SDXL-inpainting layout (9-channel UNet, two CLIPs), random weights, 1.4 M-param UNet; for tests",
        resolution=TINY_RESOLUTION,
        call_defaults={},
        denoiser_class="UNet2DConditionModel",
        denoiser_config={
            "sample_size": TINY_RESOLUTION // 8,
            "in_channels": 9,
            "out_channels": 4,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "block_out_channels": [16, 32, 64],
            "layers_per_block": 1,
            "transformer_layers_per_block": [1, 1, 2],
            "attention_head_dim": [1, 2, 4],  # head count per level: 16-wide heads like the published 64
            "norm_num_groups": 8,
            "cross_attention_dim": 2 * _TINY_WIDTH,  # CLIP-L ++ CLIP-G penultimate hidden states
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 6 * 8 + _TINY_WIDTH,  # 6 size/crop ids + pooled CLIP-G
        },
        vae_config=_SDXL_VAE,
        scheduler_class="EulerDiscreteScheduler",
        scheduler_config=published.SDXL_SCHEDULER,
        text_encoders=(
            small_clip("text_encoder", "tokenizer", hidden_size=_TINY_WIDTH),
            small_clip("text_encoder_2", "tokenizer_2", hidden_size=_TINY_WIDTH, projection_dim=_TINY_WIDTH),
        ),
        pipeline_config={"requires_aesthetics_score": False, "force_zeros_for_empty_prompt": True},
    ),
    ModelSpec(
        name="tiny-sd2-inpaint",
        kind="tiny",
        family="sd2",
        pipeline_class="StableDiffusionInpaintPipeline",
        description="SD2-inpainting layout (9-channel UNet, one CLIP), random weights, 1.0 M-param UNet; for tests",
        resolution=TINY_RESOLUTION,
        call_defaults={},
        denoiser_class="UNet2DConditionModel",
        denoiser_config={
            "sample_size": TINY_RESOLUTION // 8,
            "in_channels": 9,
            "out_channels": 4,
            "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
            "block_out_channels": [16, 32, 32, 64],
            "layers_per_block": 1,
            "attention_head_dim": [1, 2, 2, 4],
            "norm_num_groups": 8,
            "cross_attention_dim": _TINY_WIDTH,
            "use_linear_projection": True,
        },
        vae_config=_SD2_VAE,
        scheduler_class="PNDMScheduler",
        scheduler_config=published.SD2_SCHEDULER,
        text_encoders=(small_clip("text_encoder", "tokenizer", hidden_size=_TINY_WIDTH),),
        # No safety checker: there is nothing to check in random-weight output, and the flag keeps
        # diffusers from warning about its absence on every load.
        pipeline_config={"requires_safety_checker": False},
    ),
)
