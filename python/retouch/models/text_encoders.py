"""Small CLIP and T5 text-encoder configs, at whatever output width the denoiser reads.

A text encoder runs once per request, outside the denoising loop retouch accelerates, so even the
bench specs use these: two layers, a narrow MLP, and only the output width taken from the real model
(the width is what the denoiser's context and pooled projections consume).
"""

from .spec import TextEncoderSpec
from .tokenizers import CLIP_MAX_LENGTH

# The MLP is most of a real encoder layer's weights and none of its output width; capping it keeps a
# 4096-wide T5 at ~10 M parameters instead of 4.7 B.
_MAX_MLP_WIDTH = 256


def small_clip(
    component: str,
    tokenizer_component: str,
    hidden_size: int,
    projection_dim: int | None = None,
    num_heads: int = 2,
) -> TextEncoderSpec:
    """A 2-layer CLIP text encoder; with `projection_dim` a CLIPTextModelWithProjection.

    Two layers rather than one because SDXL reads the penultimate hidden state.
    """
    config = {
        "hidden_size": hidden_size,
        "intermediate_size": min(4 * hidden_size, _MAX_MLP_WIDTH),
        "num_hidden_layers": 2,
        "num_attention_heads": num_heads,
        "max_position_embeddings": CLIP_MAX_LENGTH,
        "hidden_act": "quick_gelu",
    }
    model_class = "CLIPTextModel"
    if projection_dim is not None:
        config["projection_dim"] = projection_dim
        model_class = "CLIPTextModelWithProjection"
    return TextEncoderSpec(component, tokenizer_component, model_class, config)


def small_t5(component: str, tokenizer_component: str, d_model: int, num_heads: int = 2) -> TextEncoderSpec:
    """A 2-layer T5 v1.1-style encoder (gated GELU) whose hidden width is `d_model`."""
    config = {
        "d_model": d_model,
        "d_kv": min(d_model // num_heads, 64),
        "d_ff": min(4 * d_model, _MAX_MLP_WIDTH),
        "num_layers": 2,
        "num_heads": num_heads,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
    }
    return TextEncoderSpec(component, tokenizer_component, "T5EncoderModel", config)
