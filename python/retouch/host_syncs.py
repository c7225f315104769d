"""Counting the calls that read tensor values on the host: on a GPU each one waits for every kernel
queued before it (a sync), so the host cannot run ahead of the device. A planned forward makes none:
everything host-side (ragged descriptors, block maps, validation) is decided before its first block."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Tensor methods that return host values (or, for nonzero, a shape that depends on them).
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def counting_host_syncs() -> Iterator[Counter]:
    """Within the block, every call of a SYNC_METHODS method (and of torch.nonzero) is counted by name
    in the yielded Counter. For tests and benchmarks: it patches torch.Tensor, for every thread."""
    calls: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    original_nonzero = torch.nonzero

    def counted(name, method):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)
        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    torch.nonzero = counted("nonzero", original_nonzero)
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
        torch.nonzero = original_nonzero
