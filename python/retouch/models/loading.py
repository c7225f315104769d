"""Load a pipeline for serving: a built-in model by name, or any supported diffusers folder."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import is_accelerate_available

from ..errors import ModelError
from .export import MANIFEST_NAME, cached_export
from .quiet import quiet_libraries
from .builders import build_pipeline
from .registry import get_spec, is_builtin, list_models
from .samplers import checked_scheduler
from .spec import FAMILIES, FAMILY_BY_PIPELINE


@dataclass(slots=True)
class LoadedModel:
    """A pipeline ready to call, and what the engine needs to know to drive it."""

    pipe: DiffusionPipeline
    name: str  # the built-in name, or retouch.json's name, or the folder's name
    family: str  # one of FAMILIES
    call_defaults: dict  # extra kwargs for pipe(...), e.g. {"max_sequence_length": 32}
    source: Path  # the folder it was loaded from
    built_in_memory: bool = False  # built by build_loaded: a process that wants the same weights builds it too
    scheduler: str | None = None  # the --scheduler it was given (`samplers`); None: the pipeline's own


def checked_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, if this machine has it: torch's own errors for "gpu" or a missing CUDA
    came from inside diffusers (an AssertionError, for one)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"device must be cpu, cuda or cuda:N, got {str(device)!r}")
    if device.type == "cuda" and (not torch.cuda.is_available()
                                  or (device.index or 0) >= torch.cuda.device_count()):
        raise ModelError(f"device {str(device)!r}: no such CUDA device here")
    return device


def checked_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`dtype` as a floating torch.dtype; its name ("bfloat16") too (a name was passed on, and ignored)."""
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ModelError(f"dtype must be a floating torch dtype (torch.bfloat16, or its name), got {dtype!r}")
    return named


def load_pipeline(
    name_or_dir: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    scheduler: str | None = None,
    denoiser: bool = True,
) -> LoadedModel:
    """Load a built-in model (exported once into the cache) or a saved pipeline folder, with the
    scheduler `scheduler` names (`samplers.checked_scheduler`; None: the one it was saved with).
    `denoiser=False` (a helper process, which stops every run at its first denoiser call): the denoiser
    goes to the meta device before the pipeline moves to `device`, so its weights never take GPU memory.

    Only local files are read (local_files_only): nothing is ever downloaded. The family comes from
    the folder's retouch.json when it has one, else from its pipeline class. Raises ModelError when
    the folder is missing, is not a diffusers pipeline, or holds a pipeline retouch does not serve,
    or when the scheduler cannot drive it.
    """
    if not isinstance(name_or_dir, str | os.PathLike):
        raise ModelError(f"model must be a built-in name or a pipeline folder, got {name_or_dir!r}")
    if scheduler is not None and not isinstance(scheduler, str):
        raise ModelError(f"scheduler must be a name like 'dpm++2m-karras' (or None), got {scheduler!r}")
    device, dtype = checked_device(device), checked_dtype(dtype)
    if isinstance(name_or_dir, str) and is_builtin(name_or_dir):
        folder = cached_export(name_or_dir)
    else:
        folder = Path(name_or_dir)
    pipeline_class = _pipeline_class_in(folder, requested=name_or_dir)
    manifest = _read_manifest(folder)
    family = manifest.get("family", FAMILY_BY_PIPELINE[pipeline_class])
    if family not in FAMILIES:
        raise ModelError(f"{folder / MANIFEST_NAME} names family {family!r}; it must be one of {', '.join(FAMILIES)}")
    if family != FAMILY_BY_PIPELINE[pipeline_class]:  # the adapters follow the family, the weights the class
        raise ModelError(f"{folder / MANIFEST_NAME} names family {family!r}, but the folder holds a {pipeline_class} "
                         f"({FAMILY_BY_PIPELINE[pipeline_class]!r}); fix or remove the manifest's family")
    with quiet_libraries():
        try:
            pipe = DiffusionPipeline.from_pretrained(
                folder,
                local_files_only=True,
                dtype=dtype,
                # With accelerate, weights load into empty modules instead of overwriting a random
                # init (minutes for FLUX.1 size); without it, asking for that only prints advice.
                low_cpu_mem_usage=is_accelerate_available(),
            )
        except (OSError, ValueError, KeyError) as error:
            # Library errors run to several lines; a ModelError is one.
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ModelError(f"cannot load the pipeline in {folder}: {detail}") from error
        if denoiser:
            pipe.to(device)
        else:
            left_out = (pipe.transformer if hasattr(pipe, "transformer") else pipe.unet).to("meta")
            for module in pipe.components.values():
                if isinstance(module, torch.nn.Module) and module is not left_out:
                    module.to(device)
    pipe.scheduler = checked_scheduler(pipe.scheduler, scheduler, family, type(pipe).__name__)
    pipe.set_progress_bar_config(disable=True)
    return LoadedModel(
        pipe=pipe,
        name=manifest.get("name", folder.name),
        family=family,
        call_defaults=dict(manifest.get("call_defaults", {})),
        source=folder,
        scheduler=scheduler,
    )


def build_loaded(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 scheduler: str | None = None) -> LoadedModel:
    """A built-in model built in memory on `device`, without the save/load round trip of `load_pipeline`.

    For speed measurements of the full-size specs: on a GPU the 11.9 B Flux transformer is built in
    seconds, where exporting it writes 24 GB first. The weights are random either way but not the
    exported ones (see `build_pipeline`), so never compare images across the two."""
    spec = get_spec(name)
    pipe = build_pipeline(name, dtype=dtype, device=device)
    pipe.scheduler = checked_scheduler(pipe.scheduler, scheduler, spec.family, type(pipe).__name__)
    return LoadedModel(pipe=pipe, name=spec.name, family=spec.family, call_defaults=dict(spec.call_defaults),
                       source=Path(f"<built in memory: {spec.name}>"), built_in_memory=True, scheduler=scheduler)


def load_for_bench(name_or_dir: str | os.PathLike, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32, scheduler: str | None = None) -> LoadedModel:
    """What a benchmark times: the full-size "bench" specs built in memory (`build_loaded`), tiny
    models and folders through `load_pipeline`."""
    if isinstance(name_or_dir, str) and is_builtin(name_or_dir) and get_spec(name_or_dir).kind == "bench":
        return build_loaded(name_or_dir, device, dtype, scheduler)
    return load_pipeline(name_or_dir, device, dtype, scheduler)


def scheduler_for(name_or_dir: str | os.PathLike, scheduler: str | None):
    """The scheduler the model runs with `--scheduler scheduler` (None: its saved one), judged from its
    saved scheduler without loading its weights (ModelError when it cannot drive the model): a server
    says so once, before any worker starts loading, and learns how many steps it makes."""
    family, pipeline_class = _family_and_class(name_or_dir)
    if isinstance(name_or_dir, str) and is_builtin(name_or_dir):
        spec = get_spec(name_or_dir)
        saved = getattr(diffusers, spec.scheduler_class).from_config(spec.scheduler_config)
    else:
        config_path = Path(name_or_dir) / "scheduler" / "scheduler_config.json"
        try:
            config = json.loads(config_path.read_text())
            saved = getattr(diffusers, config["_class_name"]).from_config(config)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as error:
            raise ModelError(f"cannot read the scheduler in {config_path}: {' '.join(str(error).split())}") from None
    return checked_scheduler(saved, scheduler, family, pipeline_class)


def model_family(name_or_dir: str | os.PathLike) -> str:
    """The family of a built-in model or a pipeline folder, without loading its weights."""
    return _family_and_class(name_or_dir)[0]


def _family_and_class(name_or_dir: str | os.PathLike) -> tuple[str, str]:
    if isinstance(name_or_dir, str) and is_builtin(name_or_dir):
        spec = get_spec(name_or_dir)
        return spec.family, spec.pipeline_class
    folder = Path(name_or_dir)
    pipeline_class = _pipeline_class_in(folder, requested=name_or_dir)
    return _read_manifest(folder).get("family", FAMILY_BY_PIPELINE[pipeline_class]), pipeline_class


def family_of_pipeline(pipe: DiffusionPipeline) -> str:
    """The family of a pipeline object by its class; ModelError for a class retouch does not serve."""
    pipeline_class = type(pipe).__name__
    family = FAMILY_BY_PIPELINE.get(pipeline_class)
    if family is None:
        raise ModelError(f"retouch does not serve {pipeline_class}; supported: {', '.join(FAMILY_BY_PIPELINE)}")
    return family


def _pipeline_class_in(folder: Path, requested: str | os.PathLike) -> str:
    """The pipeline class named by folder/model_index.json, checked to be one retouch serves and to
    have a subfolder for every component it lists."""
    if not folder.is_dir():
        builtin_names = ", ".join(spec.name for spec in list_models())
        raise ModelError(f"{str(requested)!r} is neither a built-in model ({builtin_names}) nor an existing folder")
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ModelError(f"{folder} has no model_index.json; pass a diffusers pipeline folder (save_pretrained output)")
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        index = None
    pipeline_class = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(pipeline_class, str):
        raise ModelError(f"{index_path} is not a diffusers pipeline index (no _class_name)")
    if pipeline_class not in FAMILY_BY_PIPELINE:
        raise ModelError(f"{folder} holds a {pipeline_class}; retouch serves {', '.join(FAMILY_BY_PIPELINE)}")
    # transformers 5 builds an empty two-token tokenizer, without a word of warning, when a tokenizer
    # folder is missing; catch that here rather than as garbage prompts later.
    listed = [name for name, entry in index.items() if not name.startswith("_") and _names_a_class(entry)]
    missing = [name for name in listed if not (folder / name).is_dir()]
    if missing:
        raise ModelError(f"{folder} lists components with no folder: {', '.join(missing)}; re-export or re-download it")
    return pipeline_class


def _names_a_class(entry) -> bool:
    """model_index.json lists components as [library, class]; [null, null] marks an absent optional one."""
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(part, str) for part in entry)


def _read_manifest(folder: Path) -> dict:
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return {}
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{manifest_path} is not valid JSON; fix or delete it") from None
    if not isinstance(manifest, dict):
        raise ModelError(f"{manifest_path} must hold a JSON object with name, family and call_defaults")
    return manifest
