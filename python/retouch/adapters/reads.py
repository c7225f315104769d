"""What one mask-aware forward reads from the cache, in the terms the copy engine stages it: per batch
row its template, step and guidance variant; per token resolution the unmasked tokens of each row;
per cached block the activations the adapter will read (mirroring `cache_rows.block_output`, the
adapters' KV-cache reads and `needs_all_output_rows`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from retouch.adapters.base import MaskAwareAdapter
from retouch.adapters.context import OUT, CacheMode, MaskAwareContext
from retouch.adapters.unet import UNetMaskAwareContext
from retouch.cache.base import ActivationCache
from retouch.cache.keys import stored_key
from retouch.cache.staging import CopyEngine, LevelRows, RowSource, StagedActivations
from retouch.cache.store import TemplateHandle

Context = MaskAwareContext | UNetMaskAwareContext


@dataclass(frozen=True)
class ForwardReads:
    """rows:         per batch row, (template id, step, name prefix of its guidance variant)
    levels:       per token resolution, the unmasked tokens of every row
    block_levels: the resolution of each block
    blocks:       per cached block in execution order, (block, names it reads)"""

    rows: tuple[tuple[str, int, str], ...]
    levels: tuple[LevelRows, ...]
    block_levels: tuple[int, ...]
    blocks: tuple[tuple[int, tuple[str, ...]], ...]


def forward_reads(adapter: MaskAwareAdapter, context: Context,
                  recorded_names: Callable[[int], Sequence[str]]) -> ForwardReads:
    """`recorded_names(block)`: the plain names recorded for a block (KV-cache mode reads all but "out")."""
    if context.mode is CacheMode.RECORD:
        raise ValueError("a RECORD forward reads nothing")
    if isinstance(context, UNetMaskAwareContext):
        rows = tuple(context.cache_key(row, "") for row in range(context.num_rows))
        levels = tuple(LevelRows(batch.seq_lens[0], tuple(_unmasked(idx, batch.seq_lens[0])
                                                          for idx in batch.host_query_idx()))
                       for batch in context.levels)
        block_levels = tuple(adapter.block_levels)
    else:
        rows = tuple(_row(template_id, step) for template_id, step in zip(context.template_ids, context.steps))
        num_text, lens = context.batch.prefix, context.image_lens
        reused = tuple(_unmasked(idx[num_text:] - num_text, length)
                       for idx, length in zip(context.batch.host_query_idx(), lens))
        levels = (LevelRows(lens if context.mixed else context.num_image_tokens, reused),)
        block_levels = (0,) * adapter.num_blocks
    blocks = []
    for block in range(adapter.num_blocks):
        if not context.uses_cache(block):
            continue
        if context.mode is CacheMode.Y_CACHE:
            names = (OUT,)
        else:
            names = tuple(n for n in recorded_names(block) if n != OUT)
            if adapter.needs_all_output_rows(context, block):
                names += (OUT,)
        blocks.append((block, names))
    return ForwardReads(rows, levels, block_levels, tuple(blocks))


def row_tokens(context: Context, kinds: Sequence[str], cross_keys: int = 77) -> list[dict]:
    """Per batch row, what each block kind computes (`retouch.costs.RequestTokens`, the cost model's
    input). Flux/SD3 kinds all see the row's text + image tokens; a UNet kind "level<l>" sees level l's
    tokens, and `cross_keys` text tokens as cross-attention keys (77: CLIP's padded prompt, as `retouch
    profile` times them)."""
    from retouch.costs import RequestTokens

    if isinstance(context, UNetMaskAwareContext):
        per_level = [[RequestTokens(text=0, image=batch.seq_lens[0], masked=count, cross_keys=cross_keys)
                      for count in batch.query_counts()] for batch in context.levels]
        return [{kind: per_level[int(kind.removeprefix("level"))][row] for kind in kinds}
                for row in range(context.num_rows)]
    return [{kind: RequestTokens(text=context.batch.prefix, image=length, masked=count) for kind in kinds}
            for count, length in zip(context.image_counts, context.image_lens)]


def staged_context(build: Callable[[ActivationCache], Context], engine: CopyEngine, adapter: MaskAwareAdapter,
                   handles: Mapping[str, TemplateHandle], dtype: torch.dtype, sync: bool = False) -> Context:
    """`build(cache)`'s context for one forward, its cache a `StagedActivations` whose copies of what
    the forward reads (from the templates `handles` hold; rows of other templates read nothing) have
    started. Enter the staged cache around the forward (the editor does), so its copies finish with it."""
    staged = StagedActivations(engine)
    context = build(staged)
    if not handles:  # no row reuses a recording (recordings, all-white masks): nothing to stage
        staged.start([], [], [], [], adapter.num_blocks, dtype, sync)
        return context
    reads = forward_reads(adapter, context, next(iter(handles.values())).layout.plain_names)
    # A row without a handle (a recording in the batch) must reuse nothing: `start` checks it.
    rows = [RowSource(handles[template_id], step, prefix) if template_id in handles else None
            for template_id, step, prefix in reads.rows]
    staged.start(rows, reads.levels, reads.block_levels, reads.blocks, adapter.num_blocks, dtype, sync)
    return context


def _row(row_template_id: str, step: int) -> tuple[str, int, str]:
    """(template id, step, name prefix) of a Flux/SD3 row ("<id>/uncond" -> ("<id>", step, "uncond."))."""
    template_id, prefix = stored_key(row_template_id, "")
    return template_id, step, prefix


def _unmasked(query_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The token indices (host, sorted) of [0, num_tokens) not in `query_idx` (host)."""
    keep = torch.ones(num_tokens, dtype=torch.bool)
    keep[query_idx] = False
    return keep.nonzero().flatten()
