"""retouch: a serving engine for generative image editing with diffusion models."""

# retouch._C links against torch's shared libraries (libc10, libtorch); importing torch first loads
# them into the process, so `import retouch._C` works on its own.
import torch  # noqa: F401

__version__ = "0.1.0"


def load(model: str, **options):
    """A mask-aware editor (`retouch.editor.MaskAwareEditor`) on a built-in model or a pipeline folder."""
    from retouch.editor import load as load_editor  # diffusers is imported only when used

    return load_editor(model, **options)
