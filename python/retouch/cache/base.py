"""Where recorded block activations of templates live.

Keys are (template_id, step, block, name): `block` is the block's index in the denoiser's execution
order and `name` what was kept ("out" for a block's output in Y-cache mode, "k"/"v" in KV-cache
mode). Values are tensors of one request (no batch dimension), e.g. `out: [L, H]`.

This interface is what the mask-aware adapters read and write; the cache engine issue adds the pinned
host arena, the disk tier and eviction behind it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import torch

CacheKey = tuple[str, int, int, str]


class ActivationCache(ABC):
    @abstractmethod
    def put(self, template_id: str, step: int, block: int, name: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` (copied; the caller may reuse its buffer)."""

    @abstractmethod
    def get(self, template_id: str, step: int, block: int, name: str) -> torch.Tensor:
        """The tensor stored under the key; KeyError if there is none."""

    @abstractmethod
    def contains(self, template_id: str) -> bool:
        """Whether anything is stored for the template."""

    @abstractmethod
    def drop(self, template_id: str) -> None:
        """Forget the template (no error if unknown)."""

    @abstractmethod
    def nbytes(self, template_id: str | None = None) -> int:
        """Bytes held for one template, or for all."""


class InMemoryActivationCache(ActivationCache):
    """A dict of tensors on one device (host memory by default). Thread-safe."""

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.dtype = dtype  # None keeps the recorded dtype
        self._tensors: dict[CacheKey, torch.Tensor] = {}
        self._lock = threading.Lock()

    def put(self, template_id, step, block, name, tensor):
        stored = tensor.detach().to(self.device, self.dtype or tensor.dtype, copy=True)
        with self._lock:
            self._tensors[(template_id, step, block, name)] = stored

    def get(self, template_id, step, block, name):
        with self._lock:
            try:
                return self._tensors[(template_id, step, block, name)]
            except KeyError:
                raise KeyError(f"no cached {name!r} for template {template_id!r}, step {step}, block {block}") from None

    def contains(self, template_id):
        with self._lock:
            return any(key[0] == template_id for key in self._tensors)

    def drop(self, template_id):
        with self._lock:
            for key in [key for key in self._tensors if key[0] == template_id]:
                del self._tensors[key]

    def nbytes(self, template_id=None):
        with self._lock:
            return sum(t.numel() * t.element_size() for key, t in self._tensors.items()
                       if template_id is None or key[0] == template_id)
