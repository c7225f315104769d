"""LoRA adapter files for tests and benchmarks, made the way real ones are (imported by test modules;
pytest puts tests/ on sys.path).

`save_random_lora` trains nothing but otherwise follows diffusers' LoRA training scripts: PEFT injects a
LoraConfig into the denoiser (`add_adapter`), `get_peft_model_state_dict` takes the adapter's weights, and the
pipeline class's `save_lora_weights` writes them, with the config as adapter metadata when alpha != rank.
`save_kohya_lora` writes what kohya-ss' sd-scripts write for a UNet, which diffusers converts on load.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from diffusers import ModelMixin
from torch import nn

from retouch.lora.files import DENOISER_COMPONENT, FLUX_FAMILIES, FOLDER_WEIGHT_NAME
from retouch.models import family_of_pipeline

# What diffusers' training scripts adapt (examples/dreambooth/train_dreambooth_lora_{flux,sd3,sdxl}.py and
# examples/text_to_image/train_text_to_image_lora.py), as module-name suffixes. Flux also adapts the
# single blocks' MLP in and out projections (SINGLE_BLOCK_TARGETS).
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
JOINT_TARGETS = ATTENTION_TARGETS + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.0.proj",
                                     "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
TARGETS_BY_FAMILY = {"flux-fill": JOINT_TARGETS, "flux-inpaint": JOINT_TARGETS, "sd3": JOINT_TARGETS,
                     "sdxl": ATTENTION_TARGETS, "sd2": ATTENTION_TARGETS}
SINGLE_BLOCK_TARGETS = re.compile(r"single_transformer_blocks\.\d+\.(proj_mlp|proj_out)")
# Relative size of a random LoRA's output: for inputs of unit RMS, B @ A @ x has about this RMS before
# scaling. 0.3 changes the tiny models' outputs by far more than their fp32 noise, yet keeps them sane.
DEFAULT_STD = 0.3
ADAPTER_NAME = "random"
# What diffusers' training scripts adapt in a CLIP text encoder (train_dreambooth_lora_sdxl.py's text_lora_config).
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def pipeline_of(model_or_pipe):
    """The diffusers pipeline of a LoadedModel, or the pipeline itself."""
    return getattr(model_or_pipe, "pipe", model_or_pipe)


def denoiser_of(model_or_pipe) -> nn.Module:
    pipe = pipeline_of(model_or_pipe)
    return getattr(pipe, DENOISER_COMPONENT[family_of_pipeline(pipe)])


def default_targets(model_or_pipe) -> list[str]:
    """Module paths of the linears diffusers' training scripts adapt in this pipeline's denoiser."""
    pipe = pipeline_of(model_or_pipe)
    family = family_of_pipeline(pipe)
    suffixes = TARGETS_BY_FAMILY[family]
    return [path for path, module in denoiser_of(pipe).named_modules() if isinstance(module, nn.Linear) and (
        any(path == suffix or path.endswith(f".{suffix}") for suffix in suffixes)
        or (family in FLUX_FAMILIES and SINGLE_BLOCK_TARGETS.fullmatch(path)))]


def save_random_lora(model_or_pipe, folder: Path, rank: int = 4, alpha: float | None = None,
                     targets: list[str] | None = None, seed: int = 0, std: float = DEFAULT_STD,
                     weight_name: str = FOLDER_WEIGHT_NAME, text_encoders: bool = False) -> Path:
    """A random LoRA for this pipeline's denoiser, saved as folder/weight_name; returns that path.

    targets: PEFT target_modules (module paths or suffixes; default `default_targets`). alpha: lora_alpha
    (default rank, i.e. scaling 1; written as adapter metadata otherwise). A ~ N(0, 1/in), B ~ N(0, std^2/r).
    `text_encoders`: also adapt every CLIP text encoder diffusers loads LoRA into (TEXT_ENCODER_TARGETS), as
    the training scripts do with --train_text_encoder. Works on any denoiser and rank (benchmarks use
    rank=512 on the bench models): PEFT injects into a copy of the module tree that shares the model's
    weights, so the model itself is left as it was."""
    from retouch.lora.files import text_encoder_components

    pipe = pipeline_of(model_or_pipe)
    alpha = rank if alpha is None else alpha
    parts = {DENOISER_COMPONENT[family_of_pipeline(pipe)]: targets or default_targets(pipe)}
    if text_encoders:
        parts.update((component, TEXT_ENCODER_TARGETS) for component in text_encoder_components(pipe))
    layers = {}
    for offset, (component, component_targets) in enumerate(parts.items()):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=component_targets, init_lora_weights=False)
        state_dict, saved_config = _random_adapter(getattr(pipe, component), config, seed + 1000 * offset, std)
        layers[f"{component}_lora_layers"] = state_dict
        if alpha != rank:  # what the training scripts' _collate_lora_metadata passes
            layers[f"{component}_lora_adapter_metadata"] = saved_config
    type(pipe).save_lora_weights(folder, weight_name=weight_name, **layers)
    return Path(folder) / weight_name


def _random_adapter(module: nn.Module, config: LoraConfig, seed: int, std: float) -> tuple[dict, dict]:
    """(the PEFT state dict of a random adapter of `config` on `module`, in diffusers naming; its config)."""
    from diffusers.utils import convert_state_dict_to_diffusers

    adapted = _shared_weight_copy(module)
    trainable = {parameter: parameter.requires_grad for parameter in module.parameters()}
    try:
        adapted.add_adapter(config, adapter_name=ADAPTER_NAME)
    finally:  # PEFT freezes the base weights, which the copy shares with the model
        for parameter, requires_grad in trainable.items():
            parameter.requires_grad_(requires_grad)
    generator_by_device = {}
    with torch.no_grad():
        for layer in (m for m in adapted.modules() if isinstance(m, LoraLayer)):
            A = layer.lora_A[ADAPTER_NAME].weight
            B = layer.lora_B[ADAPTER_NAME].weight
            generator = generator_by_device.setdefault(A.device, torch.Generator(A.device).manual_seed(seed))
            A.normal_(0.0, A[0].numel() ** -0.5, generator=generator)
            B.normal_(0.0, std * config.r ** -0.5, generator=generator)
    state_dict = {key: value.detach().cpu().contiguous()
                  for key, value in get_peft_model_state_dict(adapted, adapter_name=ADAPTER_NAME).items()}
    if not isinstance(module, ModelMixin):  # a transformers text encoder: the scripts convert its keys
        state_dict = convert_state_dict_to_diffusers(state_dict)
    return state_dict, adapted.peft_config[ADAPTER_NAME].to_dict()


def save_kohya_lora(model_or_pipe, folder: Path, rank: int = 4, alpha: float | None = None,
                    targets: list[str] | None = None, seed: int = 0, std: float = DEFAULT_STD,
                    weight_name: str = "kohya_lora.safetensors") -> tuple[Path, dict[str, torch.Tensor]]:
    """A random UNet LoRA (SDXL or SD 2) in kohya-ss' layout: `lora_unet_<path with _>.lora_down.weight`
    [r, in], `.lora_up.weight` [out, r] and `.alpha` (a 0-d tensor). targets: module paths (default
    `default_targets`). Returns the file and, per module path, the delta weight alpha/r * up @ down that
    applying it at scale 1 adds (fp32)."""
    pipe = pipeline_of(model_or_pipe)
    if DENOISER_COMPONENT[family_of_pipeline(pipe)] != "unet":
        raise ValueError("kohya files are written here for UNet pipelines (sdxl, sd2) only")
    modules = dict(denoiser_of(pipe).named_modules())
    alpha = float(rank if alpha is None else alpha)
    generator = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for path in targets or default_targets(pipe):
        linear = modules[path]
        down = torch.randn(rank, linear.in_features, generator=generator) * linear.in_features ** -0.5
        up = torch.randn(linear.out_features, rank, generator=generator) * (std * rank ** -0.5)
        kohya_name = "lora_unet_" + path.replace(".", "_")
        tensors |= {f"{kohya_name}.lora_down.weight": down, f"{kohya_name}.lora_up.weight": up,
                    f"{kohya_name}.alpha": torch.tensor(alpha)}
        deltas[path] = alpha / rank * (up @ down)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / weight_name)
    return folder / weight_name, deltas


def _shared_weight_copy(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original's tensors: PEFT can swap
    layers in it (without touching the weights) at no memory cost, even for a 12 B parameter denoiser."""
    memo = {id(tensor): tensor for tensor in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)
