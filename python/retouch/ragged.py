"""The ragged-batch descriptor shared by every mask-aware op.

A batch holds B requests; request b has L_b tokens (`prefix` always-computed tokens, e.g. the text
tokens of a joint-attention model, then its image tokens) of which it computes only some: its
"query" tokens, the prefix plus its masked image tokens. Hidden states of the whole batch live as
rows of one `[sum L_b, H]` matrix (request b's rows start at `row_offsets[b]`); the query tokens of all
requests are packed, request after request, into `[T, H]` with `cu_seqlens_q` (no padding).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

import torch

from retouch.kernels.host_tables import to_device_async


@dataclass(frozen=True)
class RaggedBatch:
    """Per-request token selections of a batch, in the forms the ops need.

    seq_lens:       [B] tokens per request (prefix + image), python ints
    query_idx:      B tensors, request b's computed token positions in [0, L_b), sorted (`padded`: with
                    repeats at the end of one request)
    query_rows:     [T] int64, their rows in the [sum L_b, H] matrix (for gather/scatter)
    reused_rows:    [sum L_b - T] int64, the other rows (taken from the cache)
    cu_seqlens_q:   [B+1] int32, prefix sums of the query counts
    cu_seqlens_k:   [B+1] int32, prefix sums of seq_lens (every token is a key)
    query_idx_host: B tensors, query_idx as built, on the host (what planning reads without a sync;
                    `padded` keeps it unpadded)

    Built on the host and copied to the device without a host sync (`to_device_async`): a planned step
    never waits for the step before it.
    """

    seq_lens: tuple[int, ...]
    prefix: int
    query_idx: tuple[torch.Tensor, ...]
    query_rows: torch.Tensor
    reused_rows: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    query_idx_host: tuple[torch.Tensor, ...] = ()  # query_idx on the host, as built (unpadded)

    @classmethod
    def from_masked_indices(
        cls,
        masked_idx: Sequence[torch.Tensor],
        num_image_tokens: int | Sequence[int],
        prefix: int = 0,
        device: torch.device | str = "cpu",
    ) -> RaggedBatch:
        """Build from each request's masked image-token indices (in [0, num_image_tokens)).

        The `prefix` tokens (text tokens of Flux/SD3 joint attention) come first in every request's
        sequence and are always computed.
        """
        batch = len(masked_idx)
        image_lens = [num_image_tokens] * batch if isinstance(num_image_tokens, int) else list(num_image_tokens)
        if len(image_lens) != batch:
            raise ValueError(f"{batch} requests but {len(image_lens)} image-token counts")
        seq_lens, query_idx = [], []
        for b, (idx, image_len) in enumerate(zip(masked_idx, image_lens)):
            idx = torch.as_tensor(idx, dtype=torch.long).flatten().cpu()
            if idx.numel() and (idx.min() < 0 or idx.max() >= image_len):
                raise ValueError(f"request {b}: masked index out of range for {image_len} image tokens")
            idx = idx.unique(sorted=True)
            query_idx.append(torch.cat([torch.arange(prefix), prefix + idx]))
            seq_lens.append(prefix + image_len)

        row_offsets = [0]
        for seq_len in seq_lens:
            row_offsets.append(row_offsets[-1] + seq_len)
        query_rows = torch.cat([torch.empty(0, dtype=torch.long)]
                               + [row_offsets[b] + idx for b, idx in enumerate(query_idx)])
        is_query = torch.zeros(row_offsets[-1], dtype=torch.bool)
        is_query[query_rows] = True
        counts = [len(idx) for idx in query_idx]
        return cls(
            seq_lens=tuple(seq_lens),
            prefix=prefix,
            query_idx=tuple(to_device_async(idx, device) for idx in query_idx),
            query_rows=to_device_async(query_rows, device),
            reused_rows=to_device_async((~is_query).nonzero().flatten(), device),
            query_idx_host=tuple(query_idx),
            cu_seqlens_q=_prefix_sums(counts, device),
            cu_seqlens_k=_prefix_sums(seq_lens, device),
            max_seqlen_q=max(counts, default=0),
            max_seqlen_k=max(seq_lens, default=0),
        )

    def padded(self, num_queries: int) -> RaggedBatch:
        """This batch computing `num_queries` tokens (>= its own): the last request that computes an
        image token computes its last one again for each padding row. A repeated row computes the value
        of its original (same input, same keys) and writes it to the same place, so padding changes no
        result; it gives a captured graph one shape per bucket of token counts. A batch without image
        queries is returned as it is (there is nothing to repeat)."""
        extra = num_queries - self.num_query_tokens
        if extra < 0:
            raise ValueError(f"cannot pad {self.num_query_tokens} query tokens down to {num_queries}")
        padded_request = next((b for b in reversed(range(self.batch_size))
                               if len(self.query_idx[b]) > self.prefix), None)
        if extra == 0 or padded_request is None:
            return self
        query_idx = list(self.query_idx)
        query_idx[padded_request] = torch.cat([query_idx[padded_request], query_idx[padded_request][-1:].expand(extra)])
        # The request's rows end where the next request's begin: repeats go there (no value is read back).
        end = sum(len(idx) for idx in self.query_idx[:padded_request + 1])
        rows = self.query_rows
        query_rows = torch.cat([rows[:end], rows[end - 1:end].expand(extra), rows[end:]])
        counts = [len(idx) for idx in query_idx]
        device = rows.device
        return dataclasses.replace(self, query_idx=tuple(query_idx), query_rows=query_rows,
                                   cu_seqlens_q=_prefix_sums(counts, device), max_seqlen_q=max(counts))

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_query_tokens(self) -> int:
        return int(self.query_rows.numel())

    def host_query_idx(self) -> tuple[torch.Tensor, ...]:
        """query_idx on the host: as built, or copied back (a sync on a GPU) where the batch was made
        without it."""
        return self.query_idx_host or tuple(idx.cpu() for idx in self.query_idx)

    def query_counts(self) -> list[int]:
        return [len(idx) for idx in self.query_idx]


def token_bucket(count: int, granularity: int = 64) -> int:
    """The padded size of `count` query tokens for captured graphs (`RaggedBatch.padded`): multiples of
    `granularity` up to 16 of them, then eighths of a power of two. At most one granule or an eighth
    is padding: 33 buckets (graphs) cover up to a 4096-token image with a 512-token prompt."""
    if count <= 16 * granularity:
        return max(granularity, -(-count // granularity) * granularity)
    step = 1 << (count.bit_length() - 4)  # an eighth of the power of two at or below count
    return -(-count // step) * step


def _prefix_sums(counts: Sequence[int], device) -> torch.Tensor:
    sums = torch.zeros(len(counts) + 1, dtype=torch.int32)
    if counts:
        sums[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return to_device_async(sums, device)
