"""An instance attribute over an object's method for a while (a pipeline's, its scheduler's): set on
entry; on exit, what was there before (another such shadow, or none) is back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_NONE = object()


@contextmanager
def shadowing(owner, name: str, value) -> Iterator[None]:
    before = owner.__dict__.get(name, _NONE)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is _NONE:
            delattr(owner, name)
        else:
            setattr(owner, name, before)
