"""What one mask-aware forward of a denoiser needs to know, passed explicitly to the patched model.

A `MaskAwareContext` describes one call of the denoiser over a batch of requests: which image tokens
each request computes (its masked tokens, as a `RaggedBatch` whose prefix is the always-computed text
tokens), which recorded template and denoising step each request reuses, where the recorded
activations live, and how each block uses them (`CacheMode`, `block_plan`).

The index tensors the blocks need (`TokenLayout`) are derived once per call here, not once per block.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from retouch.cache import ActivationCache
from retouch.kernels.host_tables import to_device_async
from retouch.ragged import RaggedBatch


class CacheMode(enum.Enum):
    """How the cached blocks of one forward use the activation cache."""

    RECORD = "record"  # compute every token; keep each block's output, K and V for every token
    Y_CACHE = "y_cache"  # paper Fig. 5: unmasked rows of each block output come from the cache
    KV_CACHE = "kv_cache"  # paper Fig. 7: unmasked keys/values come from the cache


# Names of the recorded activations in the cache (see retouch.cache for the key layout).
OUT = "out"  # a block's output for the image tokens: [L, hidden]
KEY = "k"  # a block's image-token keys after projection, qk-norm and RoPE: [L, heads, head_dim]
VALUE = "v"  # the matching values: [L, heads, head_dim]
DUAL_KEY = "k2"  # SD3.5 dual attention: the second (image-only) attention's keys: [L, heads, head_dim]
DUAL_VALUE = "v2"  # its values: [L, heads, head_dim]


@dataclass(frozen=True)
class TokenLayout:
    """Index tensors derived from a `RaggedBatch` with `prefix` text tokens and L_b image tokens in request b.

    "Query" tokens are the computed ones: all text tokens, then the masked image tokens, per request,
    packed request after request (the order of `RaggedBatch.query_idx`; T_q of them in all).

    The image tokens of a batch are rows of one image matrix: `[B, L, hidden]` viewed as `[B * L, hidden]`
    when every request has L of them, `[sum L_b, hidden]` packed (request b's rows from `image_offsets[b]`)
    when sizes differ (`packed`: a mixed-resolution batch). A position table (Flux's RoPE rows) covers
    `[text; image]` of one request when every request has the same image, `[text; every request's image
    rows]` when packed.

    query_positions:      [T_q] row of each query token in the position table
    query_request:        [T_q] request of each query token
    image_query_rows:     [T_img] rows of the masked image tokens in the image matrix
    image_query_request:  [T_img] request of each masked image token
    image_query_positions:[T_img] their rows in the position table
    text_query_slots:     [B * P] where each text token (rows of [B * P, hidden]) sits among the T_q queries
    image_query_slots:    [T_img] where each masked image token sits among the T_q queries
    image_counts:         masked image tokens per request
    image_lens:           image tokens per request
    image_offsets:        where each request's rows start in the image matrix
    """

    num_text_tokens: int
    image_lens: tuple[int, ...]
    image_offsets: tuple[int, ...]
    query_positions: torch.Tensor
    query_request: torch.Tensor
    image_query_rows: torch.Tensor
    image_query_request: torch.Tensor
    image_query_positions: torch.Tensor
    text_query_slots: torch.Tensor
    image_query_slots: torch.Tensor
    image_counts: tuple[int, ...]

    @property
    def packed(self) -> bool:
        """Whether requests have different numbers of image tokens (a mixed-resolution batch)."""
        return len(set(self.image_lens)) > 1

    @property
    def num_image_tokens(self) -> int:
        """Image tokens of every request (a batch of one size)."""
        if self.packed:
            raise ValueError(f"a mixed-resolution batch has {sorted(set(self.image_lens))} image tokens per request")
        return self.image_lens[0] if self.image_lens else 0

    @classmethod
    def from_batch(cls, batch: RaggedBatch) -> TokenLayout:
        num_text = batch.prefix
        image_lens = tuple(seq_len - num_text for seq_len in batch.seq_lens)
        packed = len(set(image_lens)) > 1
        device = batch.query_rows.device
        positions, requests, image_rows, image_requests, text_slots, image_slots = [], [], [], [], [], []
        image_positions, image_counts, image_offsets = [], [], []
        slot = offset = 0
        for b, idx in enumerate(batch.query_idx):
            image_pos = idx[num_text:] - num_text
            count = len(idx)
            # Packed, request b's image rows of the position table start after the text and the images before it.
            table_offset = offset if packed else 0
            positions.append(torch.cat([idx[:num_text], image_pos + num_text + table_offset]))
            requests.append(torch.full((count,), b, dtype=torch.long, device=device))
            image_rows.append(offset + image_pos)
            image_requests.append(torch.full((len(image_pos),), b, dtype=torch.long, device=device))
            image_positions.append(image_pos + num_text + table_offset)
            text_slots.append(torch.arange(slot, slot + num_text, device=device))
            image_slots.append(torch.arange(slot + num_text, slot + count, device=device))
            image_counts.append(len(image_pos))
            image_offsets.append(offset)
            slot += count
            offset += image_lens[b]
        empty = torch.empty(0, dtype=torch.long, device=device)
        return cls(
            num_text_tokens=num_text,
            image_lens=image_lens,
            image_offsets=tuple(image_offsets),
            query_positions=torch.cat([empty] + positions),
            query_request=torch.cat([empty] + requests),
            image_query_rows=torch.cat([empty] + image_rows),
            image_query_request=torch.cat([empty] + image_requests),
            image_query_positions=torch.cat([empty] + image_positions),
            text_query_slots=torch.cat([empty] + text_slots),
            image_query_slots=torch.cat([empty] + image_slots),
            image_counts=tuple(image_counts),
        )

    @cached_property
    def image_request(self) -> torch.Tensor:
        """[sum L_b] the request of each row of the packed image matrix."""
        device = self.image_query_rows.device  # host lengths and the output size: no sync on a GPU
        return torch.repeat_interleave(torch.arange(len(self.image_lens), device=device),
                                       to_device_async(torch.tensor(self.image_lens), device),
                                       output_size=sum(self.image_lens))

    def joint_rows(self, text_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(text rows [B * P], image rows [sum L_b]) of a packed joint matrix `[sum (P + L_b), hidden]` whose
        request b holds its text then its image tokens (`text_first`; False: image then text, SD3's key
        order); the text-first order is the `RaggedBatch`'s (its `query_rows` index it)."""
        device = self.image_query_rows.device
        num_text, text, image = self.num_text_tokens, [], []
        start = 0
        for length in self.image_lens:
            text_start, image_start = (start, start + num_text) if text_first else (start + length, start)
            text.append(torch.arange(text_start, text_start + num_text, device=device))
            image.append(torch.arange(image_start, image_start + length, device=device))
            start += num_text + length
        empty = torch.empty(0, dtype=torch.long, device=device)
        return torch.cat([empty] + text), torch.cat([empty] + image)


@dataclass(frozen=True)
class MaskAwareContext:
    """One mask-aware forward over a batch of B requests.

    batch:        image tokens to compute per request, text tokens as the prefix (`RaggedBatch`)
    template_ids: [B] the recorded template each request reads (Y/KV) or writes (RECORD)
    steps:        [B] the denoising step index of each request (requests of one batch may be at
                  different steps: continuous batching)
    cache:        where recorded activations are read and written
    block_plan:   per block in the adapter's execution order (Flux: double-stream, then single-stream): True = use the
                  cache, False = compute all tokens with the unmodified block (no cache traffic; recording
                  requests keep its output only). None = every block uses the cache (RECORD: the masked
                  path, which keeps outputs, keys and values).
    records:      [B] whether request b is a recording (every token computed; its activations written to
                  `record_to` under its template id and step) beside the edits of a Y/KV forward: a
                  template records as a member of the running batch. All True in RECORD mode.
    record_to:    where recording requests write (RECORD mode: `cache`)
    """

    mode: CacheMode
    batch: RaggedBatch
    template_ids: tuple[str, ...]
    steps: tuple[int, ...]
    cache: ActivationCache
    block_plan: tuple[bool, ...] | None = None
    records: tuple[bool, ...] | None = None
    record_to: ActivationCache | None = None
    image_counts: tuple[int, ...] = field(init=False, repr=False)  # masked image tokens per request
    image_lens: tuple[int, ...] = field(init=False, repr=False)  # image tokens per request

    def __post_init__(self):
        num_requests = self.batch.batch_size
        if len(self.template_ids) != num_requests or len(self.steps) != num_requests:
            raise ValueError(f"{num_requests} requests but {len(self.template_ids)} template ids and "
                             f"{len(self.steps)} steps")
        object.__setattr__(self, "template_ids", tuple(self.template_ids))
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))
        if self.block_plan is not None:
            object.__setattr__(self, "block_plan", tuple(bool(p) for p in self.block_plan))
        object.__setattr__(self, "image_lens", tuple(seq_len - self.batch.prefix for seq_len in self.batch.seq_lens))
        object.__setattr__(self, "image_counts", tuple(c - self.batch.prefix for c in self.batch.query_counts()))
        all_masked = [c == length for c, length in zip(self.image_counts, self.image_lens)]
        if self.mode is CacheMode.RECORD and not all(all_masked):
            raise ValueError("a RECORD context computes every image token; build it with `MaskAwareContext.record`")
        set_recording(self, all_masked)

    @property
    def mixed(self) -> bool:
        """Whether requests have different numbers of image tokens (a mixed-resolution batch: its blocks
        see the image tokens packed, `[sum L_b, hidden]`, see `TokenLayout`)."""
        return len(set(self.image_lens)) > 1

    @property
    def num_image_tokens(self) -> int:
        """Image tokens of every request; a mixed-resolution batch has `image_lens` instead."""
        if self.mixed:
            raise ValueError(f"a mixed-resolution batch has {sorted(set(self.image_lens))} image tokens per request")
        return self.image_lens[0] if self.image_lens else 0

    @cached_property
    def image_offsets(self) -> tuple[int, ...]:
        """Where each request's rows start in the packed image matrix."""
        return tuple(itertools.accumulate(self.image_lens[:-1], initial=0)) if self.image_lens else ()

    def request_image_rows(self, tensor: torch.Tensor, request: int) -> torch.Tensor:
        """Request `request`'s `[L_b, ...]` rows of a block's image-token tensor: `[B, L, ...]`, or packed
        `[sum L_b, ...]` in a mixed-resolution batch."""
        if self.mixed:
            return tensor.narrow(0, self.image_offsets[request], self.image_lens[request])
        return tensor[request]

    @cached_property
    def layout(self) -> TokenLayout:
        """The index tensors of the masked blocks, derived on first use: a forward whose blocks all
        run unmodified (recordings, full masks) never builds them."""
        return TokenLayout.from_batch(self.batch)

    @classmethod
    def record(cls, template_ids: Sequence[str], steps: Sequence[int], num_text_tokens: int,
               num_image_tokens: int, cache: ActivationCache, device: torch.device | str = "cpu",
               block_plan: Sequence[bool] | None = None) -> MaskAwareContext:
        """Full compute of every token, keeping every block's activations for `template_ids`; blocks
        whose `block_plan` entry is False run unmodified and keep their output only (all Y-cache
        edits read)."""
        all_tokens = [torch.arange(num_image_tokens)] * len(template_ids)
        batch = RaggedBatch.from_masked_indices(all_tokens, num_image_tokens, prefix=num_text_tokens, device=device)
        return cls(CacheMode.RECORD, batch, tuple(template_ids), tuple(steps), cache,
                   None if block_plan is None else tuple(block_plan))

    @classmethod
    def edit(cls, mode: CacheMode, masked_idx: Sequence[torch.Tensor], template_ids: Sequence[str],
             steps: Sequence[int], num_text_tokens: int, num_image_tokens: int | Sequence[int], cache: ActivationCache,
             block_plan: Sequence[bool] | None = None, device: torch.device | str = "cpu",
             records: Sequence[bool] | None = None, record_to: ActivationCache | None = None) -> MaskAwareContext:
        """An edit of recorded templates: request b computes the image tokens `masked_idx[b]` (row-major) of
        its `num_image_tokens` (one count for all, or one per request: a mixed-resolution batch); requests
        marked in `records` (every token masked) record into `record_to` meanwhile."""
        if mode is CacheMode.RECORD:
            raise ValueError("use MaskAwareContext.record for recording")
        batch = RaggedBatch.from_masked_indices(masked_idx, num_image_tokens, prefix=num_text_tokens, device=device)
        return cls(mode, batch, tuple(template_ids), tuple(steps), cache,
                   None if block_plan is None else tuple(block_plan),
                   None if records is None else tuple(records), record_to)

    @property
    def recording_requests(self) -> tuple[int, ...]:
        """The requests whose activations this forward records."""
        return tuple(b for b, records in enumerate(self.records) if records)

    def check_shapes(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> None:
        """The block's `[B, L, H]` image (packed `[sum L_b, H]` in a mixed-resolution batch) and `[B, P, J]`
        text inputs match the context's batch and layout."""
        batch, num_text = encoder_hidden_states.shape[:2]
        expected = (self.batch.batch_size, self.batch.prefix)
        if self.mixed:
            if hidden_states.dim() != 2 or hidden_states.shape[0] != sum(self.image_lens) or (batch, num_text) != expected:
                raise ValueError(f"context is for {self.batch.batch_size} requests of {self.batch.prefix} text tokens and "
                                 f"{sum(self.image_lens)} packed image tokens, the model got {batch} x {num_text} text "
                                 f"and image {tuple(hidden_states.shape)}")
            return
        if hidden_states.dim() != 3 or (batch, num_text, hidden_states.shape[1]) != (*expected, self.num_image_tokens):
            raise ValueError(f"context is for {self.batch.batch_size} requests of {self.batch.prefix} text + "
                             f"{self.num_image_tokens} image tokens, the model got {batch} x {num_text} text and "
                             f"image {tuple(hidden_states.shape)}")

    def uses_cache(self, block: int) -> bool:
        """Whether `block` runs mask-aware (reads the cache, or in RECORD mode keeps keys and values)
        rather than unmodified."""
        return self.block_plan is None or self.block_plan[block]

    def request_reuses_tokens(self, request: int) -> bool:
        """Whether any image token of `request` is unmasked (and so comes from the cache)."""
        return self.image_counts[request] < self.image_lens[request]


def set_recording(context, all_masked: Sequence[bool]) -> None:
    """Fill and check a context's `records` / `record_to` (MaskAwareContext and UNetMaskAwareContext):
    a recording request computes every token; blocks that run unmodified keep its output only, so a
    KV-cache recording runs every block mask-aware."""
    num_requests = len(all_masked)
    if context.mode is CacheMode.RECORD:
        object.__setattr__(context, "records", (True,) * num_requests)
        object.__setattr__(context, "record_to", context.cache)
        return
    records = (False,) * num_requests if context.records is None else tuple(bool(r) for r in context.records)
    object.__setattr__(context, "records", records)
    if len(records) != num_requests:
        raise ValueError(f"{num_requests} requests but {len(records)} records flags")
    if not any(records):
        return
    if context.record_to is None:
        raise ValueError("a context with recording requests needs record_to (where they write)")
    if any(r and not masked for r, masked in zip(records, all_masked)):
        raise ValueError("a recording request computes every token: mask all of them")
    if context.mode is CacheMode.KV_CACHE and context.block_plan is not None and not all(context.block_plan):
        raise ValueError("a KV-cache recording needs every block's keys and values: no block plan with full "
                         "blocks (they keep outputs only)")
