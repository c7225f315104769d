"""What a built-in model is: the pipeline it runs as and the configs its components are built from."""

from dataclasses import dataclass, field

import torch

# The diffusers pipelines retouch serves, and the family each one belongs to. A family fixes how the
# engine drives the denoiser (packed Flux tokens, SD3 patches, or a UNet over the latent grid).
FAMILY_BY_PIPELINE = {
    "FluxFillPipeline": "flux-fill",
    "FluxInpaintPipeline": "flux-inpaint",
    "StableDiffusion3InpaintPipeline": "sd3",
    "StableDiffusionXLInpaintPipeline": "sdxl",
    "StableDiffusionInpaintPipeline": "sd2",
}
FAMILIES = tuple(FAMILY_BY_PIPELINE.values())
KINDS = ("tiny", "bench")

DENOISER_COMPONENT_BY_CLASS = {
    "FluxTransformer2DModel": "transformer",
    "SD3Transformer2DModel": "transformer",
    "UNet2DConditionModel": "unet",
}
TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")


@dataclass(frozen=True, slots=True)
class TextEncoderSpec:
    """One text encoder and the tokenizer that feeds it.

    `config` holds the transformers config kwargs except the vocabulary size and special-token ids,
    which the builder takes from the tokenizer so that the embedding table always covers it.
    """

    component: str  # pipeline attribute: "text_encoder", "text_encoder_2", "text_encoder_3"
    tokenizer_component: str  # "tokenizer", "tokenizer_2", "tokenizer_3"
    model_class: str  # one of TEXT_ENCODER_CLASSES
    config: dict

    def __post_init__(self) -> None:
        if self.model_class not in TEXT_ENCODER_CLASSES:
            raise ValueError(f"text encoder class {self.model_class!r} is not one of {TEXT_ENCODER_CLASSES}")

    @property
    def tokenizer_kind(self) -> str:
        """"t5" for the T5 encoder (Unigram tokenizer), "clip" for CLIP encoders (byte-level BPE)."""
        return "t5" if self.model_class == "T5EncoderModel" else "clip"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A built-in model: random weights on top of a real diffusers pipeline class and real configs."""

    name: str  # "tiny-flux-fill"
    kind: str  # "tiny" (runs on a CPU in tests) | "bench" (real or CPU-sized denoisers, for benchmarks and the demo)
    family: str  # one of FAMILIES
    pipeline_class: str  # a key of FAMILY_BY_PIPELINE, e.g. "FluxFillPipeline"
    description: str  # one line for `retouch models`
    resolution: int  # default edit size in pixels (square)
    call_defaults: dict  # extra kwargs for the pipeline __call__, e.g. {"max_sequence_length": 32}
    denoiser_class: str  # a key of DENOISER_COMPONENT_BY_CLASS
    denoiser_config: dict
    vae_config: dict  # AutoencoderKL kwargs
    scheduler_class: str  # a diffusers scheduler class name
    scheduler_config: dict
    text_encoders: tuple[TextEncoderSpec, ...]
    pipeline_config: dict = field(default_factory=dict)  # extra pipeline __init__ kwargs it registers
    # Dtype the weights are written in by export_pipeline: fp32 for tiny models (exact round trips in
    # tests), bf16 for bench models, as their published checkpoints are (FLUX.1 in fp32 is 48 GB).
    export_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if FAMILY_BY_PIPELINE.get(self.pipeline_class) != self.family:
            raise ValueError(f"{self.name}: pipeline {self.pipeline_class!r} does not belong to family {self.family!r}")
        if self.denoiser_class not in DENOISER_COMPONENT_BY_CLASS:
            raise ValueError(f"{self.name}: denoiser class {self.denoiser_class!r} is not supported")

    @property
    def denoiser_component(self) -> str:
        """The pipeline attribute that holds the denoiser: "transformer" or "unet"."""
        return DENOISER_COMPONENT_BY_CLASS[self.denoiser_class]
