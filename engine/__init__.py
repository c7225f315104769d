"""retouch.engine: the worker loop (continuous batching at denoising-step granularity, CUDA streams)
and the ZeroMQ router. Imported as `retouch.engine`; the folder is mapped into the package by setup.py.
"""

from retouch import submodule


def __getattr__(name: str):
    return submodule(__name__, name)
