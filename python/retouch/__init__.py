"""retouch: a serving engine for generative image editing with diffusion models."""

# retouch._C links against torch's shared libraries (libc10, libtorch); importing torch first loads
# them into the process, so `import retouch._C` works on its own.
import torch  # noqa: F401

__version__ = "0.1.0"


def load(model: str, **options) -> "retouch.editor.MaskAwareEditor":  # noqa: F821 - imported on use
    """A mask-aware editor (`retouch.editor.MaskAwareEditor`) on a built-in model or a pipeline folder.

    Options (keywords; `retouch.editor.load` and `MaskAwareEditor` say more): `device` ("cpu", "cuda"),
    `dtype` (a torch dtype, float32 by default), `scheduler` (a sampler name: `retouch.models.samplers`),
    `cache_mode` ("y" or "kv"), `cache` (an `ActivationCache`, e.g. `CacheStore(StoreConfig(...))`),
    `cost_model` and `planner` (per-block cache or compute), `attention_backend`, `dilation`, `block_plan`,
    `compile` and `cuda_graphs`. Close the editor (or use it in a `with` block) to give the model back."""
    from retouch.editor import load as load_editor  # diffusers is imported only when used

    return load_editor(model, **options)


def submodule(package: str, name: str):
    """`package.name` imported on first use: a package's `__getattr__`, so that `retouch.editor` or
    `retouch.engine.api` work after a plain `import retouch`, which stays light (no diffusers)."""
    import importlib

    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.{name}":
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def __getattr__(name: str):
    return submodule(__name__, name)
