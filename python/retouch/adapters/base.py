"""What every mask-aware adapter shares: the patched blocks in execution order, one active context at
a time, and restoring the blocks. Model adapters (flux.py, sd3.py, unet.py) subclass it."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from retouch import ops
from retouch.cache.staging import StagedActivations


class MaskAwareAdapter:
    """Handle of a patched denoiser; `run(context)` makes the forwards inside it mask-aware.

    `blocks` are in execution order: a block's index is the `block` of its cache keys and its entry in
    a context's `block_plan`. One context at a time: an adapter serves one forward at a time, as the
    model itself does.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], attention_backend: str = "auto"):
        if attention_backend not in ops.ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ops.ATTENTION_BACKENDS}, got {attention_backend!r}")
        self.blocks = list(blocks)
        self.attention_backend = attention_backend
        self._context = None
        # The copy engine gates its copies on compute reaching blocks (staged memory stays bounded).
        self._start_hooks = [block.register_forward_pre_hook(functools.partial(self._block_starts, index))
                             for index, block in enumerate(self.blocks)]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def active_context(self):
        return self._context

    @contextmanager
    def run(self, context) -> Iterator:
        """Denoiser forwards inside this `with` statement follow `context`."""
        if self._context is not None:
            raise RuntimeError("a mask-aware context is already active on this adapter")
        if context.block_plan is not None and len(context.block_plan) != self.num_blocks:
            raise ValueError(f"block_plan has {len(context.block_plan)} entries for {self.num_blocks} blocks")
        self.check_context(context)
        self._context = context
        self.enter(context)
        try:
            yield context
        finally:
            self._context = None
            self.exit()

    def check_context(self, context) -> None:
        """Model-specific checks of a context before it becomes active."""

    def enter(self, context) -> None:
        """Per-context state derived once for all blocks (e.g. index layouts)."""

    def exit(self) -> None:
        """Forget what `enter` derived."""

    def _block_starts(self, index: int, module, args) -> None:
        context = self._context
        if context is not None and isinstance(context.cache, StagedActivations):
            context.cache.block_started(index)

    def needs_all_output_rows(self, context, block: int) -> bool:
        """Whether a KV-cache block must fill its unmasked output rows: the next block computes every
        token (so reads them), or it is the last block (its output is the final hidden state)."""
        return block == self.num_blocks - 1 or not context.uses_cache(block + 1)

    def unpatch(self) -> None:
        """Restore the blocks' class forwards."""
        for hook in self._start_hooks:
            hook.remove()
        for block in self.blocks:
            block.__dict__.pop("forward", None)
