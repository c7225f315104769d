"""Built-in models and pipeline loading.

Built-in models are real diffusers pipeline classes with random weights: "tiny" ones that run an
edit on a CPU in well under a second (tests), and "bench" ones with the published denoiser sizes
(benchmarks). They are built here, saved with save_pretrained and served through from_pretrained,
exactly as a downloaded model folder would be.

    spec.py          ModelSpec: what a built-in model is
    published.py     configs as published in the model repositories
    tiny.py          the tiny specs          bench.py    the bench specs
    text_encoders.py small CLIP/T5 configs   tokenizers.py  locally built CLIP/T5 tokenizers
    registry.py      built-in models by name
    builders.py      seeded in-memory construction
    export.py        save_pretrained + the export cache
    loading.py       load_pipeline for built-ins and folders
    quiet.py         silences known diffusers/transformers noise (wrap pipeline calls in it too)
"""

from .builders import build_denoiser, build_pipeline, unpatched_twin
from .export import export_pipeline
from .loading import LoadedModel, family_of_pipeline, load_pipeline
from .quiet import quiet_libraries
from .registry import get_spec, list_models
from .spec import FAMILIES, ModelSpec

__all__ = [
    "FAMILIES",
    "LoadedModel",
    "ModelSpec",
    "build_denoiser",
    "build_pipeline",
    "export_pipeline",
    "family_of_pipeline",
    "get_spec",
    "list_models",
    "load_pipeline",
    "quiet_libraries",
    "unpatched_twin",
]
