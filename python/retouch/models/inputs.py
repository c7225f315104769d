"""Random denoiser inputs of the right shapes, for tests and benchmarks that call a denoiser directly
(FLOPs and latency do not depend on the values)."""

from __future__ import annotations

import torch


def random_flux_inputs(transformer, batch: int, grid: tuple[int, int], num_text: int, seed: int,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Inputs of a FluxTransformer2DModel forward for `batch` requests on a `grid` of image tokens:
    latents `[B, h*w, C]`, text `[B, P, J]`, pooled text, timesteps, position ids, guidance."""
    config = transformer.config
    generator = torch.Generator().manual_seed(seed)
    height, width = grid
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros(height * width), rows.flatten().float(), cols.flatten().float()], dim=1)
    inputs = dict(
        hidden_states=torch.randn(batch, height * width, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, num_text, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=img_ids,
        txt_ids=torch.zeros(num_text, 3),
        guidance=torch.full((batch,), 3.5) if config.guidance_embeds else None,
    )
    # Floating inputs in the model's dtype; position ids stay fp32 as the Flux pipelines pass them.
    moved = {name: None if value is None else
             value.to(device, dtype if name not in ("img_ids", "txt_ids") else torch.float32)
             for name, value in inputs.items()}
    return {**moved, "return_dict": False}


def random_sd3_inputs(transformer, batch: int, grid: tuple[int, int], num_text: int, seed: int,
                      device: torch.device | str = "cpu") -> dict:
    """Inputs of an SD3Transformer2DModel forward on a `grid` of image tokens: latents
    `[B, C, h*p, w*p]`, text `[B, P, J]`, pooled text, timesteps in the scheduler's range; drawn on the
    CPU (the same values on every device), then moved to `device`."""
    config = transformer.config
    patch = config.patch_size
    generator = torch.Generator().manual_seed(seed)
    drawn = dict(
        hidden_states=torch.randn(batch, config.in_channels, grid[0] * patch, grid[1] * patch, generator=generator),
        encoder_hidden_states=torch.randn(batch, num_text, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=generator),
        timestep=1000 * torch.rand(batch, generator=generator),
    )
    return {**{name: value.to(device) for name, value in drawn.items()}, "return_dict": False}


def random_unet_inputs(unet, batch: int, image_size: tuple[int, int], num_text: int, seed: int,
                       device: torch.device | str = "cpu") -> dict:
    """Inputs of a UNet2DConditionModel forward for `image_size` pixels: latents (9 channels for
    inpainting UNets), timesteps, text states and, for SDXL, the pooled-text and size/crop conditioning;
    drawn on the CPU (the same values on every device), then moved to `device`."""
    config = unet.config
    generator = torch.Generator().manual_seed(seed)
    height, width = image_size[0] // 8, image_size[1] // 8
    inputs = {
        "sample": torch.randn(batch, config.in_channels, height, width, generator=generator),
        "timestep": torch.randint(0, 1000, (batch,), generator=generator),
        "encoder_hidden_states": torch.randn(batch, num_text, config.cross_attention_dim, generator=generator),
    }
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        inputs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, pooled, generator=generator),
                                       "time_ids": torch.randn(batch, 6, generator=generator)}
    if torch.device(device).type == "cpu":
        return inputs
    moved = {name: value.to(device) for name, value in inputs.items() if name != "added_cond_kwargs"}
    if "added_cond_kwargs" in inputs:
        moved["added_cond_kwargs"] = {name: value.to(device) for name, value in inputs["added_cond_kwargs"].items()}
    return moved
