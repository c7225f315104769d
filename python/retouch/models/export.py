"""Write built-in models to disk as ordinary diffusers pipeline folders, and cache them.

A built-in model is served the way a downloaded one is: saved with `save_pretrained`, then loaded
with `from_pretrained`, so the loading path under test is the real one. The cache holds one folder
per model and build version; folders appear atomically, so concurrent processes never see a partial
export.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import diffusers
import tokenizers
import torch
import transformers

from ..errors import ModelError
from . import builders
from . import spec as spec_module
from . import tokenizers as retouch_tokenizers
from .quiet import quiet_libraries
from .registry import get_spec
from .spec import ModelSpec

MANIFEST_NAME = "retouch.json"  # {"name", "family", "call_defaults"} beside model_index.json
CACHE_DIR_VARIABLE = "RETOUCH_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/retouch/models")


def export_pipeline(name: str, directory: str | os.PathLike) -> Path:
    """Build the built-in model `name` and write it to `directory` (new or empty); returns the folder.

    The folder is a diffusers pipeline (model_index.json, one subfolder per component, safetensors
    weights in the spec's export_dtype) plus retouch.json with the name, family and call defaults. It is
    written beside `directory` and renamed into place: an interrupted export (minutes, tens of GB for the
    full-size specs) leaves nothing, where it had left a folder without model_index.json that also
    refused the export's rerun.
    """
    spec = get_spec(name)
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ModelError(f"cannot export {name} to {directory}: it exists and is not an empty folder; pick a new one")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        pipe = builders.build_pipeline(name, dtype=spec.export_dtype)
        with quiet_libraries():
            pipe.save_pretrained(staging, safe_serialization=True)
        manifest = {"name": spec.name, "family": spec.family, "call_defaults": spec.call_defaults}
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # as a folder made by hand, not mkdtemp's 0700
        os.rename(staging, directory)  # replaces an empty folder; atomic
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already, unless the export failed
    return directory


def cache_root() -> Path:
    """$RETOUCH_CACHE_DIR, else ~/.cache/retouch/models."""
    return Path(os.environ.get(CACHE_DIR_VARIABLE) or DEFAULT_CACHE_DIR).expanduser()


def cached_export(name: str) -> Path:
    """The cache folder holding the export of `name`, exporting it first if no process has yet."""
    spec = get_spec(name)
    root = cache_root()
    folder = root / f"{spec.name}-{build_version(spec)}"
    if (folder / "model_index.json").is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    except OSError as error:
        raise ModelError(
            f"cannot write the model cache {root} ({error.strerror}); set {CACHE_DIR_VARIABLE} to a writable folder"
        ) from None
    try:
        export_pipeline(spec.name, staging)
        try:
            # rename(2) of a directory is atomic, and fails if the target exists and is non-empty.
            os.rename(staging, folder)
        except OSError:
            if not (folder / "model_index.json").is_file():
                raise ModelError(f"cache folder {folder} is incomplete or unwritable; delete it and retry") from None
            # Another process finished the same export first; its weights are identical to ours.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def build_version(spec: ModelSpec) -> str:
    """A digest of everything the exported files depend on: 12 hex digits.

    That is the spec, the code that turns a spec into weights and tokenizers, and the versions of the
    libraries whose init order and file formats decide the bytes. Any change gives a new cache folder
    instead of silently serving an export built by other code.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str).encode())
    for module in (builders, retouch_tokenizers, spec_module):
        digest.update(Path(module.__file__).read_bytes())
    for library in (torch, diffusers, transformers, tokenizers):
        digest.update(f"{library.__name__}={library.__version__};".encode())
    return digest.hexdigest()[:12]
