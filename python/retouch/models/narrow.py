"""A denoiser's depth and block structure at a tiny width: what `retouch bench overhead` runs on a CPU.

Host overhead (Python, op dispatch, syncs) grows with the number of blocks and the ops each runs,
not with the width; a narrow copy of a published denoiser therefore measures the host time of the
real one at a cost where compute is negligible. Every block and position table keeps its structure:
Flux keeps its three RoPE axes (on a 16-wide head), a UNet its levels, its transformer depth per
level and its group-norm divisibility.
"""

from __future__ import annotations

NARROW_TEXT_WIDTH = 64


def narrow_denoiser_config(family: str, config: dict) -> dict:
    """`config` with its widths cut: one attention head per block, 64-wide text; depths unchanged."""
    config = dict(config)
    if family in ("flux-fill", "flux-inpaint"):
        # One 16-wide head; the RoPE axes shrink with it (each still rotates pairs of its own axis).
        config.update(num_attention_heads=1, attention_head_dim=16, axes_dims_rope=[4, 6, 6],
                      joint_attention_dim=NARROW_TEXT_WIDTH, pooled_projection_dim=NARROW_TEXT_WIDTH)
    elif family == "sd3":
        config.update(num_attention_heads=1, attention_head_dim=64, joint_attention_dim=NARROW_TEXT_WIDTH,
                      caption_projection_dim=64, pooled_projection_dim=NARROW_TEXT_WIDTH)
    elif family in ("sdxl", "sd2"):
        levels = len(config["block_out_channels"])
        config.update(block_out_channels=[32 * (level + 1) for level in range(levels)],
                      attention_head_dim=[1] * levels, cross_attention_dim=NARROW_TEXT_WIDTH)
        if config.get("addition_embed_type") == "text_time":
            # The pooled text joins the size/crop ids: keep their sum consistent with the narrow text.
            config.update(projection_class_embeddings_input_dim=6 * config["addition_time_embed_dim"]
                          + NARROW_TEXT_WIDTH)
    else:
        raise ValueError(f"no narrow layout for family {family!r}")
    return config
