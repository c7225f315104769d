"""LoRA adapter files of --lora-dir: where a name's file is, and what it holds for the denoiser and the
text encoders.

`read_lora` reads a file the way diffusers' `pipe.load_lora_weights(path)` does (diffusers 0.42.1,
loaders/lora_pipeline.py, then `load_lora_adapter` in loaders/peft.py): the pipeline class's own
`lora_state_dict` and its converters read kohya, xlabs and other non-diffusers layouts, and the per-module
rank and alpha come from the LoraConfig diffusers would hand PEFT. Instead of injecting PEFT layers it
returns each targeted linear's factors and scaling, checked against the denoiser, so that the engine can
apply them unmerged, per row (`W x + scale * scaling * B (A x)`). `read_text_encoder_lora` reads the
text-encoder part of the same file the way diffusers' `_load_lora_into_text_encoder` does, for the process
that encodes prompts (`retouch.lora.text_encoders`).

diffusers, peft and retouch.models are imported inside the functions that use them: the HTTP front end
and the CLI check names with `lora_path` and load no model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from retouch.lora.raw_file import NotSafetensors, read_file, read_some, tensor_views
from retouch.lora.spec import NAME, LoraError

FOLDER_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")  # formats a LoRA also comes in, which retouch never unpickles
DENOISER_COMPONENT = {"flux-fill": "transformer", "flux-inpaint": "transformer", "sd3": "transformer",
                      "sdxl": "unet", "sd2": "unet"}
FLUX_FAMILIES = ("flux-fill", "flux-inpaint")
MESSAGE_CHARS = 400  # a library's error quoted in a LoraError: one line, a few of its items
LISTED_ITEMS = 3
_FACTOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<factor>[AB])\.weight")
# What every layout diffusers reads names a text encoder's entry with (PEFT's "text_encoder.text_model...",
# kohya's "lora_te1_text_model_...", ComfyUI's "text_encoders.clip_l.transformer.text_model..."): a file
# whose tensor names have none has no text-encoder part, known from its header alone. `read_lora` refuses
# a file whose text-encoder entries came from other names, so none is ever dropped unseen.
TEXT_ENCODER_NAMES = re.compile(r"text_model|text_encoder|lora_te", re.IGNORECASE)
logger = logging.getLogger("retouch.lora")


@dataclass(frozen=True, eq=False)
class LoraModule:
    """One adapted linear: its output gains `scale * scaling * B @ A @ x` (PEFT's lora.Linear)."""

    A: torch.Tensor  # [r, in]   PEFT's lora_A.weight
    B: torch.Tensor  # [out, r]  PEFT's lora_B.weight
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rslora: PEFT's `scaling[adapter]`

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """One adapter file, read for one denoiser. Identity equality: two reads are two adapters."""

    name: str
    modules: dict[str, LoraModule]  # keyed by module path, as denoiser.named_modules() names it
    digest: str = ""  # of the file's factors (`factors_digest`): the same on every host that has the same file

    @property
    def nbytes(self) -> int:
        """Bytes of its factors (what a device copy holds)."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in (m.A, m.B))

    @functools.cached_property
    def host_bytes(self) -> int:
        """Bytes of the memory its factors live in: the whole read of its file where factors are views of it
        (header and entries not applied included), and the block of those converted. What keeping it costs
        the host, and what the host cache counts against its budget."""
        storages = {}
        for module in self.modules.values():
            for factor in (module.A, module.B):
                storage = factor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    def to(self, device=None, dtype=None, non_blocking: bool = False) -> LoraWeights:
        return self._map(lambda t: t.to(device=device, dtype=dtype, non_blocking=non_blocking))

    def _map(self, convert) -> LoraWeights:
        return LoraWeights(self.name, {path: LoraModule(convert(m.A), convert(m.B), m.scaling)
                                       for path, m in self.modules.items()}, self.digest)


TextEncoderParts = dict[str, LoraWeights]  # a file's text-encoder part: pipeline component -> its adapter


def lora_path(lora_dir: str | Path, name: str) -> Path:
    """<lora_dir>/<name>.safetensors, or <lora_dir>/<name>/pytorch_lora_weights.safetensors (the folder
    diffusers' save_lora_weights writes); the file wins if both exist. Names are spec.NAME, so no request
    can reach outside the folder (links the operator put inside it are followed). Its errors reach HTTP
    clients (a worker answers 422 with them): they name the adapter and never the folder's path."""
    folder = Path(lora_dir)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise LoraError(f"lora name {name!r} must be 1-128 letters, digits, '.', '_' or '-' "
                        "(a file of the LoRA folder without its suffix)")
    if not folder.is_dir():
        raise LoraError("the LoRA folder (--lora-dir) does not exist")
    for path in _candidates(folder, name):
        if path.is_file():
            return path
    hint = f"; name it without {SUFFIX}" if name.endswith(SUFFIX) else ""
    pickled = next((f"{name}{suffix}" for suffix in PICKLE_SUFFIXES if (folder / f"{name}{suffix}").is_file()), None)
    if pickled is not None:  # unpickling runs the file's code: never read, but say why it is not found
        hint = f"; the folder has {pickled}, a pickle file, which retouch does not read: convert it to safetensors"
    raise LoraError(f"no LoRA {name!r} in the LoRA folder: expected {name}{SUFFIX} or {name}/{FOLDER_WEIGHT_NAME}"
                    f"{hint}")


def file_identity(lora_dir: str | Path, name: str) -> tuple:
    """What changes when the operator replaces `name`'s file, by `cp` over it (mtime, size; ctime, which
    `cp -p` cannot set back) or by an atomic `mv` (inode): (path, device, inode, mtime_ns, ctime_ns, size) of
    the file `lora_path` finds; () without one. One stat for a NAME.safetensors file, two for the folder
    layout: cheap enough for every lookup."""
    for path in _candidates(Path(lora_dir), name):
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(info.st_mode):
            return (str(path), info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size)
    return ()


def _candidates(folder: Path, name: str) -> tuple[Path, Path]:
    """Where `name`'s file may be, the one that wins first."""
    return folder / f"{name}{SUFFIX}", folder / name / FOLDER_WEIGHT_NAME


def list_loras(lora_dir: str | Path) -> list[str]:
    """The names `lora_path` finds in the folder, sorted."""
    folder = Path(lora_dir)
    if not folder.is_dir():
        raise LoraError("the LoRA folder (--lora-dir) does not exist")
    names = set()
    for entry in folder.iterdir():
        if entry.is_file() and entry.name.endswith(SUFFIX):
            names.add(entry.name[: -len(SUFFIX)])
        elif entry.is_dir() and (entry / FOLDER_WEIGHT_NAME).is_file():
            names.add(entry.name)
    return sorted(name for name in names if NAME.fullmatch(name))


def read_lora(path: str | Path, name: str, pipe, dtype: torch.dtype | None = None, pin: bool = False,
              allocate: Callable[[int], torch.Tensor] | None = None) -> LoraWeights:
    """The denoiser part of the LoRA file at `path`, for `pipe` (a diffusers pipeline retouch serves, or
    a LoadedModel), on the CPU in `dtype` (default: the denoiser's), in memory of its own: the file is read
    (not mapped: a mapping outlives neither a file overwritten in place nor its page cache) into
    `allocate(nbytes)` (uint8 CPU tensors; default fresh memory, page-locked with `pin` for asynchronous
    uploads), and factors already in `dtype` stay where they were read. `LoraError` for a file diffusers
    could not load into this denoiser, and for what retouch does not apply: non-linear targets, DoRA, LoRA
    biases, T5 LoRA. Its text-encoder part, if any, is `read_text_encoder_lora`'s, in the process that
    encodes prompts.

    Returns modules in the denoiser's named_modules() order: A: [r, in], B: [out, r], scaling."""
    from retouch.models import family_of_pipeline

    pipe = getattr(pipe, "pipe", pipe)
    path = Path(path)
    family = family_of_pipeline(pipe)
    component = DENOISER_COMPONENT[family]
    denoiser = getattr(pipe, component)
    where = f"lora {name!r}"  # no path: the message reaches HTTP clients, who must not learn the server's folders
    if allocate is None:
        def allocate(nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    raw, tensors, file_metadata = _read_raw_file(path, allocate, where)
    _check_nothing_dropped(tensors, where)
    state_dict, network_alphas, metadata = _pipeline_state_dict(pipe, family, tensors, file_metadata, where)
    encoders = text_encoder_components(pipe)
    encoder_keys = [key for key in state_dict if key.partition(".")[0] in encoders]
    if encoder_keys and not any(TEXT_ENCODER_NAMES.search(key) for key in tensors):
        raise LoraError(f"{where} has text-encoder weights ({encoder_keys[0]}) under names retouch does not "
                        "recognise as such; save them as diffusers' save_lora_weights does")
    state_dict = {key: value for key, value in state_dict.items() if key.partition(".")[0] not in encoders}
    factors, network_alphas, metadata = _denoiser_entries(state_dict, network_alphas, metadata, component, where,
                                                          denoiser)
    factors = _fit_to_linears(denoiser, factors, family, where)
    config = _lora_config(factors, network_alphas, metadata, name, where)
    return _weights(name, factors, config, raw, dtype or denoiser.dtype, allocate, where)


def text_encoder_components(pipe) -> tuple[str, ...]:
    """The pipeline's text encoders diffusers' `load_lora_weights` applies LoRA to (CLIP; never T5)."""
    pipe = getattr(pipe, "pipe", pipe)
    return tuple(component for component in getattr(type(pipe), "_lora_loadable_modules", ())
                 if component.startswith("text_encoder") and getattr(pipe, component, None) is not None)


class _NoTextEncoderPart(Exception):
    """Raised from a header check: the file names no text-encoder tensor."""


def read_text_encoder_lora(path: str | Path, name: str, pipe, dtype: torch.dtype | None = None) -> TextEncoderParts:
    """The text-encoder part of the LoRA file at `path`, for `pipe`: per text encoder it adapts, its modules
    (as `read_lora` returns the denoiser's), on the CPU in `dtype` (default: each encoder's); {} for a file
    without one, known from its header. diffusers' `_load_lora_into_text_encoder`: the pipeline's
    converters, then each encoder's entries under its prefix in PEFT naming, ranks and alphas as PEFT gets
    them. `LoraError` as `read_lora`'s.

    It runs before a request's first step, so it reads little: the data of the tensors named as a text
    encoder's (TEXT_ENCODER_NAMES), of scalars (kohya's alphas) and of what the converters drop; the
    denoiser's factors reach the converters as meta tensors (names, shapes, dtypes). Should that part of a
    conversion need their values, or a text-encoder entry come from one of them, the whole file is read:
    diffusers' and PEFT's layouts and kohya's SD/SDXL one read little; kohya's Flux converter looks at the
    values of the single blocks' linear1 (and of missing alphas), so such files are read whole. The
    factors are copied out of what was read, so that a part kept holds its own bytes only."""
    pipe = getattr(pipe, "pipe", pipe)
    path, where = Path(path), f"lora {name!r}"
    encoders = text_encoder_components(pipe)

    def check_names(names: list[str]) -> None:
        if not encoders or not any(TEXT_ENCODER_NAMES.search(key) for key in names):
            raise _NoTextEncoderPart
    if not path.is_file():
        raise LoraError(f"{where} does not exist")
    try:
        tensors, file_metadata = read_some(path, _read_for_text_encoders, _name_check(where, check_names))
    except _NoTextEncoderPart:
        return {}
    except (OSError, NotSafetensors) as error:
        raise LoraError(f"{where} is not a readable safetensors file: {_one_line(error, path)}") from None
    try:
        return _text_encoder_parts(pipe, encoders, tensors, file_metadata, name, dtype, where)
    except (LoraError, _NeedsWholeFile):
        _, tensors, file_metadata = _read_raw_file(path, _fresh, where)
        return _text_encoder_parts(pipe, encoders, tensors, file_metadata, name, dtype, where)


def _fresh(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _read_for_text_encoders(name: str) -> bool:
    return bool(TEXT_ENCODER_NAMES.search(name)) or name.endswith(".alpha") or any(
        pattern in name for pattern, _ in DROPPED_BY_CONVERTERS + ((".diff", ""),))


class _NeedsWholeFile(Exception):
    """A text-encoder entry came from a tensor that was not read (`read_text_encoder_lora`)."""


def _text_encoder_parts(pipe, encoders: tuple[str, ...], tensors: dict, file_metadata: dict, name: str,
                        dtype: torch.dtype | None, where: str) -> TextEncoderParts:
    from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    from retouch.models import family_of_pipeline

    _check_nothing_dropped(tensors, where)
    state_dict, network_alphas, metadata = _pipeline_state_dict(pipe, family_of_pipeline(pipe), tensors,
                                                                file_metadata, where)
    if any(value.is_meta for key, value in state_dict.items() if key.partition(".")[0] in encoders):
        raise _NeedsWholeFile
    parts = {}
    for component in encoders:
        prefix = f"{component}."
        entries = {key.removeprefix(prefix): value for key, value in state_dict.items() if key.startswith(prefix)}
        if not entries:
            continue
        encoder = getattr(pipe, component)
        entries = convert_state_dict_to_peft(convert_state_dict_to_diffusers(entries))
        if not hasattr(encoder, "text_model"):  # transformers' flattened CLIPTextModel, as diffusers strips it
            entries = {key.removeprefix("text_model."): value for key, value in entries.items()}
        alphas = {key.removeprefix(prefix): value for key, value in (network_alphas or {}).items()
                  if key.split(".")[0] == component} or None
        encoder_metadata = None if metadata is None else {
            key.removeprefix(prefix): value for key, value in metadata.items() if key.startswith(prefix)}
        factors = _fit_to_linears(encoder, _pair_factors(entries, where), None, where)
        config = _lora_config(factors, alphas, encoder_metadata, name, where, is_unet=False)
        # raw None: the factors are copied out of what was read (see read_text_encoder_lora)
        parts[component] = _weights(name, factors, config, None, dtype or encoder.dtype, _fresh, where)
    return parts


def _weights(name: str, factors: dict, config, raw: torch.Tensor | None, dtype: torch.dtype, allocate,
             where: str) -> LoraWeights:
    """The adapter of one model component: each module's factors in memory it owns, its scaling, the digest."""
    scalings = {}
    digest = hashlib.blake2b(digest_size=8)
    for module_path, (A, B) in factors.items():
        scalings[module_path] = _scaling(config, module_path, A.shape[0], where)
        _digest_module(digest, module_path, A, B, scalings[module_path])
    owned = _owned_factors(factors, raw, dtype, allocate, where)
    modules = {module_path: LoraModule(A, B, scalings[module_path]) for module_path, (A, B) in owned.items()}
    return LoraWeights(name, modules, digest.hexdigest())


DIGEST_VALUES = 256  # of each factor: two trainings (or two files) differ in them, and a digest reads little


def _digest_module(digest, module_path: str, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
    """Add a module to an adapter's digest (`LoraWeights.digest`), as read from its file, before the cast to
    the serving dtype, so that workers of other dtypes agree: its path, scaling, and each factor's shape,
    dtype and first DIGEST_VALUES values. Workers whose files of one name differ report other digests
    (`engine.router` warns)."""
    digest.update(f"{module_path}\0{scaling!r}\0".encode())
    for factor in (A, B):
        digest.update(f"{list(factor.shape)}{factor.dtype}\0".encode())
        digest.update(factor.reshape(-1)[:DIGEST_VALUES].contiguous().view(torch.uint8).numpy().tobytes())


def _read_raw_file(path: Path, allocate, where: str) -> tuple[torch.Tensor, dict, dict]:
    """(the file's bytes, its tensors as views of them, its `__metadata__`) of a readable safetensors file
    without DoRA entries (diffusers drops kohya's dora_scale with a warning and would apply the rest as a
    plain LoRA: a different adapter than the one trained)."""
    if not path.is_file():
        raise LoraError(f"{where} does not exist")
    try:
        raw = read_file(path, allocate, _name_check(where))
        tensors, file_metadata = tensor_views(raw)
    except (OSError, NotSafetensors) as error:
        raise LoraError(f"{where} is not a readable safetensors file: {_one_line(error, path)}") from None
    return raw, tensors, file_metadata


def _name_check(where: str, more: Callable[[list[str]], None] | None = None) -> Callable[[list[str]], None]:
    """What a file's tensor names must pass before its data is read: a refused file costs its header only."""
    def check_names(names: list[str]) -> None:
        dora = next((key for key in names if "dora_scale" in key or "lora_magnitude_vector" in key), None)
        if dora is not None:
            raise LoraError(f"{where} is a DoRA adapter ({dora}); retouch applies plain LoRA only")
        if names and not any("lora" in key.lower() for key in names):  # every format diffusers reads names them so
            raise LoraError(f"{where} holds no LoRA factors ({len(names)} tensors, none named *lora*): a model "
                            "checkpoint in the LoRA folder?")
        if more is not None:
            more(names)
    return check_names


# Entries diffusers' kohya converters drop, logging it at INFO only (lora_conversion_utils: "currently do not
# support"), and apply the rest of the file: each pattern, and what it adapts.
DROPPED_BY_CONVERTERS = (("text_encoders.t5xxl", "the T5 text encoder"), ("lora_te3_", "the T5 text encoder"),
                         (".diff_b", "biases"), ("position_embedding", "a text encoder's position embedding"))


def _check_nothing_dropped(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a file with non-zero entries the converters would drop: diffusers applies such a file in
    part, without a word to the user; retouch refuses T5 LoRA and biases in every other format too.
    All-zero ones change nothing (trainers write them), and pass, as diffusers drops them quietly."""
    for key, tensor in tensors.items():
        for pattern, what in DROPPED_BY_CONVERTERS + (((".diff", "norm weights"),) if ".norm" in key else ()):
            if pattern in key and bool(tensor.ne(0).any()):
                raise LoraError(f"{where} adapts {what} ({key}), which diffusers' converter drops, applying the rest; "
                                "retouch applies an adapter whole or not at all: save it without them")


def _pipeline_state_dict(pipe, family: str, tensors: dict, file_metadata: dict,
                         where: str) -> tuple[dict, dict | None, dict | None]:
    """(state dict, network alphas, adapter metadata) as each pipeline's load_lora_weights obtains them from
    the file whose entries and `__metadata__` these are: SDXL passes its UNet config (kohya's SGM block
    numbering), SD3 has no alphas, Flux pops `*.alpha` entries into alphas. Given a dict, diffusers'
    `_fetch_state_dict` finds no file to take the adapter metadata from; it is read here as diffusers'
    `_load_sft_state_dict_metadata` reads it."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    loader = type(pipe)
    options = {"return_lora_metadata": True}
    try:
        raw_metadata = file_metadata.get(LORA_ADAPTER_METADATA_KEY)
        file_adapter_metadata = json.loads(raw_metadata) if raw_metadata else None
        if family in FLUX_FAMILIES:
            state_dict, network_alphas, metadata = loader.lora_state_dict(tensors, return_alphas=True, **options)
        elif family == "sd3":
            (state_dict, metadata), network_alphas = loader.lora_state_dict(tensors, **options), None
        elif family == "sdxl":
            state_dict, network_alphas, metadata = loader.lora_state_dict(tensors, unet_config=pipe.unet.config,
                                                                          **options)
        else:
            state_dict, network_alphas, metadata = loader.lora_state_dict(tensors, **options)
    except Exception as error:  # a converter failing on a user's file: say which file and why, in one line
        why = _one_line(error) if str(error).strip() else (
            f"its converter stopped on an {type(error).__name__} (layer shapes of another model, or of another size "
            "of this one?)")
        raise LoraError(f"{where} is not a LoRA diffusers can read for {family}: {why}") from None
    return state_dict, network_alphas, file_adapter_metadata if metadata is None else metadata


def _denoiser_entries(state_dict: dict, network_alphas: dict | None, metadata: dict | None, component: str,
                      where: str, denoiser: nn.Module
                      ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict | None, dict | None]:
    """The denoiser's entries without their component prefix, in PEFT naming, as (A, B) per module path;
    and the alphas and metadata of the denoiser (load_lora_adapter's prefix handling)."""
    prefix = f"{component}."
    stray = next((key for key in state_dict if not key.startswith(prefix)), None)
    if stray is not None:
        module = _FACTOR_KEY.fullmatch(stray)
        if module is not None and module["module"] in dict(denoiser.named_modules()):
            # Flux's kohya converter names img_in, txt_in, time_in, vector_in, guidance_in and final_layer so;
            # diffusers' loader then skips them and applies the rest.
            raise LoraError(f"{where} has {stray}, a layer of this {component} that diffusers' converter leaves "
                            f"without its {prefix!r} prefix, and diffusers would skip it, applying the rest; retouch "
                            "applies an adapter whole or not at all: save it without that layer")
        if stray.startswith("diffusion_model."):
            raise LoraError(f"{where} has {stray}: Black Forest Labs' own layout with PEFT's factor names, which "
                            "diffusers' converters do not read (diffusers cannot load this file either)")
        raise LoraError(f"{where} has {stray}, which is not a weight of this model's {component} "
                        "(an adapter for another model?)")
    if not state_dict:
        raise LoraError(f"{where} has no LoRA weights for the {component} (keys starting with {prefix!r})")
    if network_alphas and metadata:
        raise LoraError(f"{where} has both kohya alphas and diffusers adapter metadata; diffusers refuses it too")
    entries = {key.removeprefix(prefix): value for key, value in state_dict.items()}
    if network_alphas:
        network_alphas = {k.removeprefix(prefix): v for k, v in network_alphas.items() if k.startswith(prefix)}
    if metadata is not None:
        metadata = {k.removeprefix(prefix): v for k, v in metadata.items() if k.startswith(prefix)}
    unsupported = next((key for key in entries if ".lokr_" in key or key == "lora_controlnet"), None)
    if unsupported is not None:
        raise LoraError(f"{where} is a LoKr or control LoRA ({unsupported}); retouch applies plain LoRA only")
    if "lora_A" not in next(iter(entries)):  # diffusers decides the naming by the first key, as here
        from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

        entries = convert_unet_state_dict_to_peft(entries)
    return _pair_factors(entries, where), network_alphas, metadata


def _pair_factors(entries: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in entries.items():
        match = _FACTOR_KEY.fullmatch(key)
        if match is None:
            if "lora_magnitude_vector" in key:
                raise LoraError(f"{where} is a DoRA adapter ({key}); retouch applies plain LoRA only")
            if key.endswith(".bias"):
                raise LoraError(f"{where} has a LoRA bias ({key}); retouch applies LoRA without biases only")
            raise LoraError(f"{where} has an entry that is not a LoRA A or B weight: {key}")
        found.setdefault(match["module"], {})[match["factor"]] = value
    for module, pair in found.items():
        if len(pair) != 2:
            have, lacking = ("A", "B") if "A" in pair else ("B", "A")
            raise LoraError(f"{where} has lora_{have} but no lora_{lacking} for {module}")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _fit_to_linears(denoiser: nn.Module, factors: dict, family: str, where: str) -> dict:
    """The factors, in the denoiser's named_modules() order, each checked to fit the linear it adapts.

    Flux pipelines zero-pad A when the linear is wider than the adapter (a FLUX.1-dev LoRA on FLUX.1-Fill's
    wider x_embedder: FluxLoraLoaderMixin._maybe_expand_lora_state_dict); so does this."""
    modules = dict(denoiser.named_modules())
    for module_path in factors:
        if module_path not in modules:
            fitting = sum(1 for path in factors if path in modules)
            if fitting:  # e.g. SDXL's kohya add_embedding_linear_1, which the converter names add.embedding.linear
                raise LoraError(f"{where} adapts {module_path}, which this {type(denoiser).__name__} does not have, "
                                f"though its other {fitting} layers fit (a name diffusers' converter made: diffusers "
                                "would skip it, applying the rest); retouch applies an adapter whole or not at all")
            raise LoraError(f"{where} adapts {module_path}, which this {type(denoiser).__name__} does not have "
                            "(an adapter for another model?)")
        if not isinstance(modules[module_path], nn.Linear):
            raise LoraError(f"{where} adapts {module_path}, a {type(modules[module_path]).__name__}; retouch "
                            "applies LoRA to linear layers only")
    fitted = {}
    for module_path, linear in modules.items():
        if module_path not in factors:
            continue
        A, B = factors[module_path]
        integral = next((factor for factor in (A, B) if not factor.is_floating_point()), None)
        if integral is not None:  # a cast would apply rounded garbage, not the trained adapter
            raise LoraError(f"{where}: {module_path} has a factor of dtype {str(integral.dtype).removeprefix('torch.')}"
                            "; LoRA factors are floating point")
        if A.ndim != 2 or B.ndim != 2:
            raise LoraError(f"{where}: {module_path} has lora_A of shape {list(A.shape)} and lora_B of shape "
                            f"{list(B.shape)}; a linear's LoRA factors are matrices")
        if A.shape[0] == 0 or B.shape[1] == 0:
            raise LoraError(f"{where}: {module_path} has rank 0 (lora_A {list(A.shape)}, lora_B {list(B.shape)})")
        if A.shape[0] != B.shape[1]:
            raise LoraError(f"{where}: {module_path} has lora_A of rank {A.shape[0]} but lora_B of rank "
                            f"{B.shape[1]}")
        if family in FLUX_FAMILIES and A.shape[1] < linear.in_features:
            A = torch.cat([A, A.new_zeros(A.shape[0], linear.in_features - A.shape[1])], dim=1)
        if A.shape[1] != linear.in_features or B.shape[0] != linear.out_features:
            raise LoraError(f"{where}: {module_path} maps {A.shape[1]} to {B.shape[0]} features but the layer "
                            f"maps {linear.in_features} to {linear.out_features} (an adapter for another model?)")
        fitted[module_path] = (A, B)
    return fitted


def _lora_config(factors: dict, network_alphas: dict | None, metadata: dict | None, name: str, where: str,
                 is_unet: bool = True):
    """The LoraConfig load_lora_adapter builds (`is_unet` False: _load_lora_into_text_encoder's): the file's
    adapter metadata when it has some, else ranks from the B shapes and alphas from kohya's `.alpha` entries
    (default alpha = rank: scaling 1)."""
    from diffusers.utils.peft_utils import _create_lora_config
    from peft.tuners.tuners_utils import check_target_module_exists

    state_dict = {f"{path}.lora_{factor}.weight": tensor for path, (A, B) in factors.items()
                  for factor, tensor in (("A", A), ("B", B))}
    ranks = {f"^{key}": tensor.shape[1] for key, tensor in state_dict.items() if "lora_B" in key}
    try:  # metadata is the file's word: any field may be missing, null or malformed
        config = _create_lora_config(state_dict, network_alphas, metadata, ranks, is_unet=is_unet, adapter_name=name)
        config.rank_pattern, config.alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
        for pattern_key in (*config.rank_pattern, *config.alpha_pattern):
            re.compile(pattern_key)
        untargeted = next((path for path in factors if not check_target_module_exists(config, path)), None)
    except (TypeError, ValueError, re.error) as error:
        fields = ", ".join(sorted(metadata)) if isinstance(metadata, dict) else type(metadata).__name__
        raise LoraError(f"{where} has adapter metadata PEFT cannot use (its fields: {fields or 'none'}; PEFT's "
                        f"LoraConfig as diffusers' save_lora_weights writes it is expected): "
                        f"{_one_line(error)}") from None
    if untargeted is not None:
        raise LoraError(f"{where} has weights for {untargeted} but its adapter metadata does not target it")
    if config.use_dora:
        raise LoraError(f"{where} is a DoRA adapter (its metadata says use_dora); retouch applies plain LoRA only")
    if getattr(config, "lora_bias", False):
        raise LoraError(f"{where} has LoRA biases (its metadata says lora_bias); retouch applies LoRA without "
                        "biases only")
    # diffusers names kohya's per-module alphas after the old attention processors
    # ("attn1.processor.to_k_lora.down.weight"); they match no module, so PEFT ignores them (with a warning)
    # and every module gets the most common alpha. Do as diffusers does, so that images match, but say so.
    ignored = sorted(key for key in config.alpha_pattern if not any(_pattern_matches(key, path) for path in factors))
    if ignored:
        logger.warning("%s: diffusers ignores the per-module alphas of %d modules (%s, ...) and gives them the "
                       "common alpha %s; retouch does the same", where, len(ignored), ignored[0], config.lora_alpha)
    return config


def _pattern_matches(pattern_key: str, path: str) -> bool:
    """PEFT's rank_pattern / alpha_pattern match (peft.utils.other.get_pattern_key)."""
    return re.match(rf"(.*\.)?({pattern_key})$", path) is not None


def _scaling(config, path: str, rank: int, where: str) -> float:
    """PEFT's per-module scaling (LoraModel._create_and_replace, then LoraLayer.update_layer)."""
    from peft.utils.other import get_pattern_key

    r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), path), config.r)
    alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), path), config.lora_alpha)
    if r != rank:
        raise LoraError(f"{where}: {path} has rank {rank} but the file's adapter metadata says {r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"{where}: {path} has lora_alpha {alpha!r} in the file's adapter metadata; it must be a number")
    return float(alpha / math.sqrt(r) if config.use_rslora else alpha / r)


def _owned_factors(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], raw: torch.Tensor | None,
                   dtype: torch.dtype, allocate, where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each factor in `dtype`, checked finite, in memory the adapter owns: a factor the file holds in `dtype`
    stays where it was read (a view of `raw`, the file's bytes; None: nothing stays), the others (converted
    by dtype or by diffusers) are copied into one block of `allocate`'s, each into its own aligned range."""
    def in_place(tensor: torch.Tensor) -> bool:
        return (raw is not None and tensor.dtype == dtype and tensor.is_contiguous()
                and tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr())

    def what(path: str, factor: int) -> str:
        return f"{where}: {path}.lora_{'AB'[factor]}"

    copied = [(path, i) for path, pair in factors.items() for i, t in enumerate(pair) if not in_place(t)]
    spans, total = {}, 0
    for path, i in copied:
        nbytes = factors[path][i].numel() * dtype.itemsize
        spans[path, i] = (total, nbytes)
        total += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
    block = allocate(total) if copied else None
    owned = {}
    for path, pair in factors.items():
        out = []
        for i, tensor in enumerate(pair):
            if (path, i) not in spans:
                if not all_finite(tensor):
                    raise LoraError(f"{what(path, i)} has NaN or infinite values")
                out.append(tensor)
                continue
            start, nbytes = spans[path, i]
            out.append(_copy_finite(tensor, block[start:start + nbytes].view(dtype).view(tensor.shape),
                                    what(path, i)))
        owned[path] = tuple(out)
    return owned


_ALIGNMENT = 64  # bytes between factors copied into one block: a cache line, and any dtype's alignment


def _copy_finite(tensor: torch.Tensor, out: torch.Tensor, what: str) -> torch.Tensor:
    """`tensor` converted into `out`, checked finite in the same pass."""
    source = tensor.detach()
    if source.dtype != out.dtype:
        source = source.to(device="cpu", dtype=out.dtype)  # a conversion: torch's, on the CPU
    if not copy_all_finite(source.contiguous(), out):  # the second pass only to explain
        if not all_finite(tensor.detach().cpu().contiguous()):
            raise LoraError(f"{what} has NaN or infinite values")
        raise LoraError(f"{what} has values too large for {out.dtype}")
    return out


_CHUNK = 1 << 20  # values per numpy call: a bounded temporary, and the GIL released for each
_EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80)}  # numpy has no bfloat16: all-ones exponent = inf/NaN
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def copy_all_finite(source: torch.Tensor, out: torch.Tensor) -> bool:
    """Copy contiguous `source` into `out` (same shape and dtype, CPU) and say whether no value is NaN or
    infinite; one core, in bounded chunks, each checked while it is in cache.

    The loader thread runs this while the step loop computes: torch's copy_ and isfinite(t).all() would each
    start an OpenMP team as wide as the forward's (two teams on the same cores stall each other at every
    barrier), and isfinite writes a bool per value; numpy over 1M-value slices is single-threaded and much
    cheaper here (the check alone: 15 ms against 220 ms for 280 MiB of fp32)."""
    views = _numpy_views(source)
    if views is None:  # float8 and other types numpy lacks: rare in adapter files
        out.copy_(source)
        return all_finite(out)
    src, finite = views
    dst = _numpy_views(out)[0]
    ok = True
    for start in range(0, src.size, _CHUNK):
        chunk = dst[start:start + _CHUNK]
        np.copyto(chunk, src[start:start + _CHUNK])
        ok = ok and finite(chunk)
    return ok


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in a contiguous CPU tensor; one core, in bounded chunks (as `copy_all_finite`)."""
    views = _numpy_views(tensor)
    if views is None:
        return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())
    values, finite = views
    return all(finite(values[start:start + _CHUNK]) for start in range(0, values.size, _CHUNK))


def _numpy_views(tensor: torch.Tensor):
    """(the flat values as numpy, chunk -> all finite) for the float types adapter files hold; None else."""
    if tensor.dtype in _EXPONENT_BITS:
        as_int, exponent = _EXPONENT_BITS[tensor.dtype]
        return tensor.reshape(-1).view(as_int).numpy(), lambda chunk: not ((chunk & exponent) == exponent).any()
    if tensor.dtype in _NUMPY_FLOATS:
        return tensor.reshape(-1).numpy(), lambda chunk: bool(np.isfinite(chunk).all())
    return None


def _one_line(error: BaseException, path: Path | None = None) -> str:
    """`error`'s message on one line of at most MESSAGE_CHARS: a long list keeps its first LISTED_ITEMS
    (diffusers names every incompatible key of a file, hundreds, after a line break: cutting at the first
    line kept none); `path` and its folders, which clients must not learn, become words."""
    text = " ".join(str(error).split()) or type(error).__name__
    if path is not None:  # the file first, then its folder(s): NAME.safetensors, or NAME/FOLDER_WEIGHT_NAME
        folders = (path.parent, path.parent.parent) if path.name == FOLDER_WEIGHT_NAME else (path.parent,)
        for where, words in ((path, "the adapter's file"), *((folder, "the LoRA folder") for folder in folders)):
            if len(where.parts) > 1:  # never "/"
                text = text.replace(str(where), words)
    if len(text) <= MESSAGE_CHARS:
        return text
    head, colon, listed = text.partition(": ")
    items = listed.split(", ")
    if colon and len(items) > LISTED_ITEMS:
        text = f"{head}: {', '.join(items[:LISTED_ITEMS])}, ... ({len(items) - LISTED_ITEMS} more)"
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."
