"""What the mask-aware adapters read and write: recorded block activations of templates.

Keys are (template_id, step, block, name): `block` is the block's index in the denoiser's execution
order and `name` what was kept ("out" for a block's output, "k"/"v" for its keys and values; a UNet's
unconditional guidance rows prefix "uncond."). Values are tensors of one batch row (no batch
dimension), e.g. `out: [L, H]`.

Two implementations: `InMemoryActivationCache` (a dict of tensors on one device: tests, and the
"cache already in GPU memory" ideal of the benchmarks) and `retouch.cache.store.CacheStore` (pinned
host arena, disk tier, budgets). During an edit the adapters read through `read_rows`, which a
`retouch.cache.staging.StagedActivations` serves from rows the copy engine has already moved.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

CacheKey = tuple[str, int, int, str]
RowKey = tuple[str, int, str]  # (template_id, step, name) of one batch row's recorded activation


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

    def read_rows(self, block: int, name: str, keys: Sequence[RowKey | None], like: torch.Tensor,
                  num_tokens: int | Sequence[int]) -> torch.Tensor:
        """`[R, num_tokens, *like.shape[1:]]` on like's device and dtype: row r holds the recorded
        activation `keys[r]` of `block` (whose plain name is `name`); rows whose key is None read
        nothing (the caller overwrites every token of them). Only unmasked tokens need be valid.
        With a token count per row (a mixed-resolution batch), the rows are packed: `[sum num_tokens, ...]`."""
        counts = [num_tokens] * len(keys) if isinstance(num_tokens, int) else list(num_tokens)
        rows = [like.new_empty((count, *like.shape[1:])) if key is None
                else _on(self.get(key[0], key[1], block, key[2]), like)
                for key, count in zip(keys, counts)]
        if not isinstance(num_tokens, int):
            return torch.cat(rows) if rows else like.new_empty((0, *like.shape[1:]))
        return torch.stack(rows) if rows else like.new_empty((0, num_tokens, *like.shape[1:]))


def _on(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` on like's device and dtype (`.to` only when it must: a no-op `.to` is still an op per read)."""
    return tensor if tensor.dtype == like.dtype and tensor.device == like.device else tensor.to(like.device, like.dtype)


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
