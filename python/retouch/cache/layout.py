"""Byte layout of one recorded denoising step of a template in the host arena (and on disk).

A step holds every recorded activation of every block: entries ordered by (block, name), each a
`[rows, *row_shape]` tensor in the storage dtype at an aligned byte offset from the step's start. A
template is `steps` such regions with one layout, so a block's activations are `[steps, blocks, L, H]`
addressed by (step, block, name, row) -> step base + entry offset + row * row_bytes: the byte offsets
the copy engine hands to the host-gather op.

fp8 (e4m3) storage keeps a per-channel float32 scale beside each entry (activations of DiT blocks have
a few outlier channels; one scale per tensor would flush the rest to zero).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from retouch.cache.keys import UNCOND_PREFIX

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Entry:
    """One recorded activation inside a step: `[rows, *row_shape]` at `offset` bytes from the step start."""

    block: int
    name: str
    shape: tuple[int, ...]
    offset: int
    scale_offset: int | None = None  # fp8: float32 [row_elems] per-channel scale

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class StepLayout:
    """Where each (block, name) of one step lives; the same for every step of a template."""

    dtype: torch.dtype
    entries: tuple[Entry, ...]
    nbytes: int
    _index: dict[tuple[int, str], Entry] = field(init=False, repr=False, compare=False)
    _plain_names: dict[int, tuple[str, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", {(e.block, e.name): e for e in self.entries})
        plain: dict[int, list[str]] = {}
        for e in self.entries:
            if not e.name.startswith(UNCOND_PREFIX):
                plain.setdefault(e.block, []).append(e.name)
        object.__setattr__(self, "_plain_names", {block: tuple(names) for block, names in plain.items()})

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def entry(self, block: int, name: str) -> Entry:
        try:
            return self._index[(block, name)]
        except KeyError:
            raise KeyError(f"no recorded {name!r} for block {block}") from None

    def plain_names(self, block: int) -> tuple[str, ...]:
        """Names recorded for `block`, without the guidance-variant copies ("out", "k", "v", ...)."""
        return self._plain_names.get(block, ())

    def has(self, block: int, name: str) -> bool:
        return (block, name) in self._index

    def row_bytes(self, entry: Entry) -> int:
        return entry.row_elems * self.element_size

    @classmethod
    def for_tensors(cls, shapes: Mapping[tuple[int, str], tuple[int, ...]], dtype: torch.dtype,
                    alignment: int) -> StepLayout:
        """The layout of activations with these `(block, name) -> shape`, stored as `dtype`."""
        if dtype not in STORAGE_DTYPES.values():
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype}")
        element = torch.empty((), dtype=dtype).element_size()
        entries, offset = [], 0
        for (block, name) in sorted(shapes):
            shape = tuple(int(s) for s in shapes[(block, name)])
            if len(shape) < 2:
                raise ValueError(f"block {block} {name!r}: an activation is [rows, ...], got shape {shape}")
            elems = math.prod(shape)
            data_offset, offset = offset, _align(offset + elems * element, alignment)
            scale_offset = None
            if dtype == torch.float8_e4m3fn:
                scale_offset, offset = offset, _align(offset + (elems // shape[0]) * 4, alignment)
            entries.append(Entry(block, name, shape, data_offset, scale_offset))
        return cls(dtype, tuple(entries), offset)

    def to_dict(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "nbytes": self.nbytes,
                "entries": [[e.block, e.name, list(e.shape), e.offset, e.scale_offset] for e in self.entries]}

    @classmethod
    def from_dict(cls, data: Mapping) -> StepLayout:
        dtype = STORAGE_DTYPES[data["dtype"]]
        entries = tuple(Entry(int(b), str(n), tuple(int(s) for s in shape), int(o), None if so is None else int(so))
                        for b, n, shape, o, so in data["entries"])
        layout = cls(dtype, entries, int(data["nbytes"]))
        layout.check()
        return layout

    def check(self) -> None:
        """Entries lie inside the step and do not overlap (a layout read from disk is not trusted)."""
        element = self.element_size
        spans = []
        for e in self.entries:
            spans.append((e.offset, e.offset + e.rows * e.row_elems * element))
            if e.scale_offset is not None:
                spans.append((e.scale_offset, e.scale_offset + e.row_elems * 4))
        spans.sort()
        for (start, end), (next_start, _) in zip(spans, spans[1:] + [(self.nbytes, 0)]):
            if start < 0 or end > next_start:
                raise ValueError("step layout has overlapping or out-of-range entries")


def encode(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`tensor: [rows, ...]` in the storage dtype, and for fp8 its per-channel scale `[row_elems]` (float32)."""
    if dtype != torch.float8_e4m3fn:
        return tensor.to(dtype), None
    flat = tensor.detach().reshape(tensor.shape[0], -1).float()
    scale = (flat.abs().amax(dim=0) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (flat / scale).to(dtype).view(tensor.shape), scale


def decode(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `encode`, in `dtype`. `stored: [*lead, rows, *row_shape]`; fp8 scale `[*lead, row_elems]`."""
    if scale is None:
        return stored.to(dtype)
    lead = scale.shape[:-1]
    row_shape = stored.shape[len(lead) + 1:]
    return (stored.to(torch.float32) * scale.view(*lead, 1, *row_shape)).to(dtype)


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment
