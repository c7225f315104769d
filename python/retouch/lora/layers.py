"""LoRA on the denoiser's linear layers, per row of a continuous batch, base weights unmerged.

A targeted nn.Linear keeps its module, weights and state_dict keys; its instance `forward` becomes
`F.linear` plus, inside `LoraLayers.bind(...)`, each row's adapters:

    y[rows of entry e] += scale * (x A^T) B^T      for each adapter (A, B, scale) of batch entry e

(`scale` = the request's scale x the module's PEFT scaling.) A batch entry is a denoiser row (a request,
or one guidance copy of it). Rows are request-contiguous in every layout the denoiser's linears see:
`[E, n, in]` (the stock forward, a text stream, every token of a Y-cache block) or packed `[T, in]`
(masked tokens, query tokens, a mixed-resolution image matrix: `MaskAwareAdapter.row_layouts`), so each
call is a list of row segments, one per run of entries sharing an adapter: Punica's SGMV
(`retouch.ops.segmented_lora`). Entries without a LoRA are in no segment and cost nothing; when every row
of a call uses one adapter, two matmuls do it (the single-LoRA fast path).

A packed layout is told apart by its row count. Two layouts of one forward with the same count but
different segments (rare: e.g. as many masked tokens in all at two UNet levels, split differently) make
`bind` raise `AmbiguousRows` before the forward runs; the step loop then runs that batch in two halves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from retouch import ops
from retouch.lora.files import LoraWeights

# One entry's adapters: (adapter, request scale) pairs, in the order the request gave them; () for none.
EntryAdapters = tuple[tuple[LoraWeights, float], ...]


class AmbiguousRows(Exception):
    """Two row layouts of one forward have the same row count but different adapter segments."""


class LoraLayers:
    """The denoiser's LoRA-capable linear layers; `bind(batch(entries, layouts))` applies per-row adapters to
    the forwards inside it. Layers are patched when an adapter that targets them is first bound, so a model that
    never sees a LoRA runs unchanged."""

    def __init__(self, denoiser: torch.nn.Module):
        self.denoiser = denoiser
        self.linears = {name: module for name, module in denoiser.named_modules()
                        if isinstance(module, torch.nn.Linear)}
        self.patched: set[str] = set()
        self._bound: BoundBatch | None = None
        # (layer, adapters and scales of its groups) -> the segmented kernel's stacked operands (CUDA only).
        self._stacks: dict[tuple, tuple] = {}

    def patch(self, names) -> None:
        for name in names:
            if name in self.patched:
                continue
            linear = self.linears.get(name)
            if type(linear) is not torch.nn.Linear or "forward" in linear.__dict__:
                raise RuntimeError(f"LoRA target {name!r} is not a plain nn.Linear of the denoiser")
            # A plain callable on the instance: nn.Module.__call__ and block_math.linear both call it.
            linear.forward = functools.partial(_lora_linear_forward, self, name, linear)
            self.patched.add(name)

    def batch(self, entries: Sequence[EntryAdapters], layouts: Sequence[Sequence[int]] = ()) -> BoundBatch | None:
        """A forward's binding: `entries[e]` apply to the rows of batch entry e; `layouts` are the per-entry row
        counts of every packed `[T, in]` matrix its linears see (beyond one row per entry). None when no entry
        has an adapter; `AmbiguousRows` when two layouts cannot be told apart."""
        if not any(entries):
            return None
        return BoundBatch(self, entries, layouts)

    @contextmanager
    def bind(self, batch: BoundBatch | None) -> Iterator[None]:
        """Forwards inside apply `batch` (`batch`); None: no LoRA."""
        if batch is None:
            yield
            return
        if self._bound is not None:
            raise RuntimeError("a LoRA batch is already bound")
        self.patch({name for adapters in batch.entries for lora, _ in adapters for name in lora.modules})
        self._bound = batch
        try:
            yield
        finally:
            self._bound = None

    def stacked(self, name: str, key: tuple, adapters: Sequence[LoraWeights],
                groups: Sequence[ops.LoraGroup]) -> tuple:
        """The stacked operands of `groups` at layer `name`, built once per batch composition (`key`: the ids
        and scales of `adapters`, which the entry keeps alive so that no id is reused while it exists)."""
        entry = self._stacks.get((name, key))
        if entry is None:
            if len(self._stacks) > 4096:  # compositions come and go: keep memory bounded
                self._stacks.clear()
            entry = self._stacks[(name, key)] = (tuple(adapters), ops.stack_lora_groups(groups))
        return entry[1]

    def forget(self, lora: LoraWeights) -> None:
        """Drop what was built from `lora` (before its weights are freed, as ids may then be reused)."""
        self._stacks = {key: value for key, value in self._stacks.items()
                        if all(adapter != id(lora) for adapter, _ in key[1])}

    @contextmanager
    def subset(self, entries: Sequence[int]) -> Iterator[None]:
        """Inside, the bound batch is its entries `entries` (a forward over some of its requests)."""
        bound = self._bound
        if bound is None:
            yield
            return
        self._bound = BoundBatch(self, [bound.entries[e] for e in entries], ())
        try:
            yield
        finally:
            self._bound = bound


def _lora_linear_forward(layers: LoraLayers, name: str, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    params = linear._parameters
    y = torch.nn.functional.linear(x, params["weight"], params["bias"])
    bound = layers._bound
    if bound is not None:
        bound.apply(name, x, y)
    return y


class BoundBatch:
    """One forward's entries and row layouts: where each call's rows start and stop, per adapter."""

    def __init__(self, layers: LoraLayers, entries: Sequence[EntryAdapters], layouts: Sequence[Sequence[int]]):
        self.layers = layers
        self.entries = tuple(entries)
        self.passes = max(len(adapters) for adapters in self.entries)
        num_entries = len(self.entries)
        self.by_rows: dict[int, tuple[int, ...]] = {num_entries: (1,) * num_entries}
        for counts in layouts:
            counts = tuple(int(c) for c in counts)
            if len(counts) != num_entries:
                raise ValueError(f"a row layout has {len(counts)} entries for a batch of {num_entries}")
            rows = sum(counts)
            known = self.by_rows.get(rows)
            if known is not None and known != counts and self._runs(known) != self._runs(counts):
                raise AmbiguousRows(f"two row layouts of {rows} rows split the batch's adapters differently")
            self.by_rows.setdefault(rows, counts)

    def _runs(self, counts: tuple[int, ...]) -> list[tuple[int, EntryAdapters]]:
        """The layout's rows as runs of one entry-adapter choice (what every segment list derives from)."""
        runs: list[list] = []
        for count, adapters in zip(counts, self.entries):
            key = tuple((id(lora), scale) for lora, scale in adapters)
            if count == 0:
                continue
            if runs and runs[-1][1] == key:
                runs[-1][0] += count
            else:
                runs.append([count, key])
        return [tuple(run) for run in runs]

    def counts(self, x: torch.Tensor) -> tuple[int, ...]:
        """Rows per entry of a linear's input: `[E, n..., in]` batch-major, or a packed `[T, in]` layout."""
        num_entries = len(self.entries)
        if x.dim() >= 3 and x.shape[0] == num_entries:
            return (math.prod(x.shape[1:-1]),) * num_entries
        if x.dim() == 2 and x.shape[0] in self.by_rows:
            return self.by_rows[x.shape[0]]
        raise RuntimeError(f"LoRA: no row layout of a batch of {num_entries} has an input of shape {tuple(x.shape)}")

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        counts = self.counts(x)
        rows_x, rows_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for k in range(self.passes):
            groups: list[ops.LoraGroup] = []
            adapters_of_groups: list[LoraWeights] = []
            group_of: dict[tuple[int, float], int] = {}
            segments: list[tuple[int, int, int]] = []
            start = 0
            for count, adapters in zip(counts, self.entries):
                stop = start + count
                if k < len(adapters) and count:
                    lora, scale = adapters[k]
                    module = lora.modules.get(name)
                    if module is not None:
                        key = (id(lora), scale)
                        if key not in group_of:
                            group_of[key] = len(groups)
                            groups.append((module.A, module.B, scale * module.scaling))
                            adapters_of_groups.append(lora)
                        group = group_of[key]
                        if segments and segments[-1][2] == group and segments[-1][1] == start:
                            segments[-1] = (segments[-1][0], stop, group)
                        else:
                            segments.append((start, stop, group))
                start = stop
            if not segments:
                continue
            stacked = None
            if x.is_cuda and len(segments) > 1:
                stacked = self.layers.stacked(name, tuple(group_of), adapters_of_groups, groups)
            ops.segmented_lora_(rows_x, rows_y, groups, segments, stacked=stacked)
