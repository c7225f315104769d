"""Component configs as published in the model repositories retouch mirrors.

Copied from each repository's `<component>/config.json` / `scheduler_config.json`, keeping the keys
that differ from the diffusers defaults (diffusers 0.42). Bench specs use the denoisers and VAEs as
they are; tiny specs reuse the schedulers, which cost nothing.
"""

# black-forest-labs/FLUX.1-Fill-dev transformer/config.json. in_channels 384 = 64 packed noisy
# latents + 64 packed masked-image latents + 256 packed mask (8x8 pixels per latent cell, 2x2 cells per
# token); out_channels 64 = the packed latent only.
FLUX_FILL_DEV_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 384,
    "out_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}

# black-forest-labs/FLUX.1-dev vae/config.json (FLUX.1-Fill-dev ships the same autoencoder).
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "latent_channels": 16,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
    "force_upcast": True,
}

# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json: the shift grows with the token count.
FLUX_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json: the MMDiT (2 B), 24 joint
# blocks of 24 x 64 heads; the inpaint pipeline feeds it 16 latent channels (it blends the rest).
SD3_MEDIUM_TRANSFORMER = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192,
}

# stabilityai/stable-diffusion-3-medium-diffusers vae/config.json.
SD3_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "latent_channels": 16,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
}

# stabilityai/stable-diffusion-3-medium-diffusers scheduler/scheduler_config.json.
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}

# diffusers/stable-diffusion-xl-1.0-inpainting-0.1 unet/config.json: the SDXL base UNet with
# in_channels 9 = 4 noisy latents + 1 mask + 4 masked-image latents.
SDXL_INPAINT_UNET = {
    "sample_size": 128,
    "in_channels": 9,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],  # diffusers' name for the head count per level
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 6 size/crop ids x 256 + 1280 pooled CLIP-G
}

# stabilityai/stable-diffusion-xl-base-1.0 vae/config.json (the inpainting repo ships the same).
SDXL_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "latent_channels": 4,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "force_upcast": True,
}

# diffusers/stable-diffusion-xl-1.0-inpainting-0.1 scheduler/scheduler_config.json.
SDXL_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "interpolation_type": "linear",
    "timestep_spacing": "leading",
    "steps_offset": 1,
    "use_karras_sigmas": False,
}

# stabilityai/stable-diffusion-2-inpainting unet/config.json: SD 2 with in_channels 9.
SD2_INPAINT_UNET = {
    "sample_size": 64,
    "in_channels": 9,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,
    "use_linear_projection": True,
}

# stabilityai/stable-diffusion-2-inpainting vae/config.json.
SD2_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "latent_channels": 4,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}

# stabilityai/stable-diffusion-2-inpainting scheduler/scheduler_config.json.
SD2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
}
