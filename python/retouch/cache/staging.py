"""The copy engine: unmasked rows of the cached blocks move from the host arena to the compute device
ahead of compute, block by block (paper §4.2, Fig. 9 bottom).

Per denoiser forward, `CopyEngine.stage(...)` returns a `StagedActivations`: the activation cache the
adapters read during that forward. For each block the plan marks cached, in execution order, it
gathers every batch row's unmasked token rows of the activations that block reads (Y-cache: "out";
KV-cache: its keys and values, plus "out" where the block must hand over all rows) into a fresh
`[R, L, ...]` staging tensor, on its own stream:

- CUDA: a copy stream; one event per staged block, which the compute stream waits on before the block
  reads it (`read_rows`). Copies run at most `lookahead` cached blocks ahead: the n-th copy waits on
  an event recorded when block c_{n-lookahead} + 2 starts (a staged output is read by its block and
  the next), so staging memory stays bounded however many blocks are cached.
- CPU: one worker thread runs the copies in order with the same gates (threading events); `read_rows`
  waits for the block's copy. The same API, so the engine and tests run here.

`sync=True` gives the naive load-then-compute schedule (paper Fig. 4, left): every copy is issued at
once and the first block waits for all of them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from retouch import ops
from retouch.cache.base import ActivationCache, RowKey
from retouch.cache.layout import decode
from retouch.cache.store import TemplateHandle
from retouch.kernels.fp8_decode import decode_fp8_rows

OUT = "out"


@dataclass(frozen=True)
class RowSource:
    """Where one batch row's recorded activations are: a template at a step; `prefix` selects the
    guidance variant ("" or "uncond.")."""

    handle: TemplateHandle
    step: int
    prefix: str = ""


@dataclass(frozen=True)
class LevelRows:
    """The unmasked tokens each batch row reads at one token resolution (UNets have one per level).

    num_tokens: L, tokens per row, or one count per row (a mixed-resolution batch: staged packed);
    reused: per row, the unmasked token indices (int64, sorted)
    """

    num_tokens: int | tuple[int, ...]
    reused: tuple[torch.Tensor, ...]
    reused_cat: torch.Tensor = field(init=False, repr=False)  # [n] every row's indices, row after row
    row_of: torch.Tensor = field(init=False, repr=False)  # [n] the row of each
    dst_rows: torch.Tensor = field(init=False, repr=False)  # [n] rows of the [sum L_r, ...] staging matrix

    def __post_init__(self):
        empty = torch.empty(0, dtype=torch.long)
        reused = [idx.to("cpu", torch.long) for idx in self.reused]
        rows = [torch.full((len(idx),), r, dtype=torch.long) for r, idx in enumerate(reused)]
        object.__setattr__(self, "reused_cat", torch.cat([empty] + reused))
        object.__setattr__(self, "row_of", torch.cat([empty] + rows))
        starts = torch.tensor([0, *itertools.accumulate(self.row_tokens[:-1])], dtype=torch.long)
        object.__setattr__(self, "dst_rows", starts[self.row_of] + self.reused_cat if len(rows) else empty)
        object.__setattr__(self, "_reused_np", self.reused_cat.numpy())
        object.__setattr__(self, "_row_of_np", self.row_of.numpy())

    def src_offsets(self, bases: Sequence[int], row_bytes: int) -> torch.Tensor:
        """[n] arena byte offsets of the reused rows, row r's token t at `bases[r] + t * row_bytes`. In numpy:
        this runs for every staged activation of every forward on the thread that launches the compute, where
        each torch op costs a dispatch."""
        offsets = self._reused_np * row_bytes
        offsets += np.asarray(bases, dtype=np.int64)[self._row_of_np]
        return torch.from_numpy(offsets)

    @property
    def packed(self) -> bool:
        return not isinstance(self.num_tokens, int)

    @property
    def row_tokens(self) -> tuple[int, ...]:
        """Tokens of each row."""
        return tuple(self.num_tokens) if self.packed else (self.num_tokens,) * len(self.reused)


@dataclass
class CopyStats:
    """What the copy engine moved, and how long compute waited for it (CPU path)."""

    blocks: int = 0
    bytes: int = 0
    rows: int = 0
    wait_seconds: float = 0.0


def gather_blocks_beside_compute(device: torch.device) -> int:
    """How many thread blocks the host-gather kernel may take while compute runs beside it: a quarter of
    the SMs (33 on an H200: 33 x 16 KiB of loads in flight, ~5x what 55 GB/s of PCIe 5 needs at ~2 us
    latency), 0 (no bound) off CUDA. Unbounded, one block per row filled every SM, and the blocks it
    overlapped waited for it (stop 52: an H200 step took about compute + copy time)."""
    if device.type != "cuda":
        return 0
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count // 4)


class CopyEngine:
    """Stages cached activations on `device` for each forward; one per worker (it owns the copy stream)."""

    def __init__(self, device: torch.device | str = "cpu", lookahead: int = 4, method: str = "auto",
                 gather_blocks: int | None = None):
        if lookahead < 2:
            # The n-th copy waits for block c_{n-lookahead} + 2 to start; with 1 that can be block c_n + 1.
            raise ValueError(f"lookahead must be >= 2 cached blocks, got {lookahead}")
        self.device = torch.device(device)
        self.lookahead = lookahead
        self.method = method
        if gather_blocks is None:
            gather_blocks = gather_blocks_beside_compute(self.device)
        if gather_blocks < 0:
            raise ValueError(f"gather_blocks must be >= 0 (0: no bound), got {gather_blocks}")
        self.gather_blocks = gather_blocks
        self.stats = CopyStats()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker: ThreadPoolExecutor | None = None  # the CPU's copy thread, from the first copy to `close`

    def fence(self) -> torch.cuda.Event | None:
        """An event after every copy issued so far, for releasing the host memory they read
        (`TemplateHandle.release(fence)`); None on the CPU, where a forward's copies are done once it
        has finished."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def copy_thread(self) -> ThreadPoolExecutor:
        """The CPU's copy thread, started again after `close`."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="retouch-copy")
        return self._worker

    def close(self) -> None:
        """End the CPU's copy thread once its copies are done (a later forward starts another)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)


class StagedActivations(ActivationCache):
    """The rows one forward reads, staged by a `CopyEngine`; read-only (see the module docstring).

    Made empty (so a context can hold it), then `start`ed with what the forward reads; used as a
    context manager around the forward, whose exit lets outstanding copies finish (also on errors:
    a copy waiting on a gate must never outlive its forward)."""

    def __init__(self, engine: CopyEngine):
        self.engine = engine
        self.rows: list[RowSource | None] = []
        self.reads: list[tuple[int, Sequence[str]]] = []
        self.num_blocks = 0
        self._results: dict[int, Future | dict[str, torch.Tensor]] = {}
        self._ready_events: dict[int, torch.cuda.Event] = {}
        self._started_events: dict[int, object] = {}
        self._pending: list[tuple[int, int, Sequence[str]]] = []  # (gate block, block, names), CUDA
        self._gate_blocks: set[int] = set()  # blocks whose start a pending copy waits for, CUDA
        self._row_of_token: dict[int, torch.Tensor] = {}  # per packed level, each token's batch row, on the device
        self._gates: dict[int, threading.Event] = {}  # CPU
        self._last_started = -1
        self._finished = False
        self._abandoned = False

    def start(self, rows: Sequence[RowSource | None], levels: Sequence[LevelRows], block_levels: Sequence[int],
              reads: Sequence[tuple[int, Sequence[str]]], num_blocks: int, dtype: torch.dtype,
              sync: bool = False) -> None:
        """Stage for one forward: `reads` lists, per cached block in execution order, the plain names it
        reads; row r reads `rows[r]` (None: nothing) at the unmasked tokens `levels[block_levels[b]]`
        gives it. Ungated copies start now, the others as compute reaches their gate block."""
        for level in levels:
            if len(level.reused) != len(rows):
                raise ValueError(f"{len(rows)} batch rows but a level lists unmasked tokens of {len(level.reused)}")
            if any(row is None and len(idx) for row, idx in zip(rows, level.reused)):
                raise ValueError("a batch row without a recorded template cannot reuse tokens")
        self.rows = list(rows)
        self.levels = list(levels)
        self.block_levels = list(block_levels)
        self.reads = list(reads)
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.sync = sync
        self._start()

    def __enter__(self) -> StagedActivations:
        return self

    def __exit__(self, *exc) -> None:
        self.finish(raise_errors=exc[0] is None)

    # ---- what the adapters call ----

    def read_rows(self, block: int, name: str, keys: Sequence[RowKey | None], like: torch.Tensor,
                  num_tokens: int | Sequence[int]) -> torch.Tensor:
        packed = not isinstance(num_tokens, int)
        shape = (sum(num_tokens),) if packed else (len(keys), num_tokens)
        if all(key is None for key in keys):  # every row computes every token (recordings, full masks)
            return like.new_empty((*shape, *like.shape[1:]))
        if block not in self._results:
            raise KeyError(f"block {block} was not staged (its plan entry is not cached?)")
        staged = self._wait(block)
        if name not in staged:
            raise KeyError(f"block {block}: {name!r} was not staged, only {sorted(staged)}")
        tensor = staged[name]
        if tuple(tensor.shape[:len(shape)]) != shape:
            raise ValueError(f"block {block} {name!r}: staged {tuple(tensor.shape)} for {len(keys)} rows of "
                             f"{num_tokens} tokens")
        return tensor if tensor.dtype == like.dtype else tensor.to(like.dtype)

    def block_started(self, block: int) -> None:
        """Compute has reached `block` (every earlier block is enqueued or done): release its gate."""
        self._last_started = block
        if self.engine._stream is not None:
            if block in self._gate_blocks:  # an event only where a copy waits for one (a few per forward)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.engine.device))
                self._started_events[block] = event
            self._issue_ready_cuda()
        else:
            for gate in [g for g in self._gates if g <= block]:
                self._gates.pop(gate).set()

    def finish(self, raise_errors: bool = True) -> None:
        """The forward is done: release every gate and let outstanding copies complete."""
        if self._finished:
            return
        self._finished = True
        if self._abandoned:
            self._pending.clear()
        self.block_started(self.num_blocks)
        for result in self._results.values():
            if isinstance(result, Future):
                if raise_errors:
                    result.result()
                else:
                    result.exception()

    def abandon(self) -> None:
        """The forward will not run after all (it failed before its first block, or its batch is split):
        release every gate and skip the copies not yet begun. Without it, on the CPU a gated copy would hold
        the copy thread, and so every later forward, forever. Nothing happens once `finish` has run."""
        if not self._finished:
            self._abandoned = True
            self.finish(raise_errors=False)

    # ---- the ActivationCache interface: staged activations are read-only ----

    def put(self, template_id, step, block, name, tensor):
        raise TypeError("staged activations are read-only; record through the cache store")

    def get(self, template_id, step, block, name):
        raise TypeError("staged activations are read per batch with read_rows")

    def contains(self, template_id):
        return any(row is not None and row.handle.template_id == template_id for row in self.rows)

    def drop(self, template_id):
        raise TypeError("staged activations are read-only")

    def nbytes(self, template_id=None):
        return sum(t.numel() * t.element_size() for r in self._results.values() if isinstance(r, dict)
                   for t in r.values())

    # ---- scheduling ----

    def _gate(self, n: int) -> int:
        """Block whose start lets the n-th staged block's copy begin (-1: at once)."""
        if self.sync or n < self.engine.lookahead:
            return -1
        return min(self.reads[n - self.engine.lookahead][0] + 2, self.num_blocks)

    def _start(self) -> None:
        for n, (block, names) in enumerate(self.reads):
            gate = self._gate(n)
            if self.engine._stream is not None:
                self._pending.append((gate, block, names))
            else:
                event = None
                if gate >= 0:
                    event = self._gates.setdefault(gate, threading.Event())
                self._results[block] = self.engine.copy_thread().submit(self._copy_after, event, block, names)
        if self.engine._stream is not None:
            for gate, block, _ in self._pending:
                self._results[block] = {}
                if gate >= 0:
                    self._gate_blocks.add(gate)
            self._issue_ready_cuda()

    def _copy_after(self, gate: threading.Event | None, block: int, names) -> dict[str, torch.Tensor]:
        if gate is not None:
            gate.wait()
        if self._abandoned:
            return {}
        return self._copy_block(block, names)

    def _issue_ready_cuda(self) -> None:
        stream = self.engine._stream
        while self._pending and self._pending[0][0] <= self._last_started:
            gate, block, names = self._pending.pop(0)
            with torch.cuda.stream(stream):
                if gate >= 0:
                    stream.wait_event(self._started_events[gate])
                self._results[block] = self._copy_block(block, names)
                ready = torch.cuda.Event()
                ready.record(stream)
                self._ready_events[block] = ready

    def _wait(self, block: int) -> dict[str, torch.Tensor]:
        result = self._results[block]
        if self.engine._stream is not None:
            if self.sync:  # load-then-compute: everything before the first block
                for event in self._ready_events.values():
                    torch.cuda.current_stream(self.engine.device).wait_event(event)
            torch.cuda.current_stream(self.engine.device).wait_event(self._ready_events[block])
            for tensor in result.values():
                tensor.record_stream(torch.cuda.current_stream(self.engine.device))
            return result
        if isinstance(result, Future):
            started = time.perf_counter()
            if self.sync:
                for other in self._results.values():
                    if isinstance(other, Future):
                        other.result()
            value = result.result()
            self.engine.stats.wait_seconds += time.perf_counter() - started
            self._results[block] = value
            return value
        return result

    # ---- the copies ----

    def _copy_block(self, block: int, names: Sequence[str]) -> dict[str, torch.Tensor]:
        level_index = self.block_levels[block]
        staged = {}
        for name in names:
            staged[name] = self._copy_activation(block, name, level_index)
        self.engine.stats.blocks += 1
        return staged

    def _copy_activation(self, block: int, name: str, level_index: int) -> torch.Tensor:
        """`[R, L, *row_shape]` (packed `[sum L_r, *row_shape]`) in the compute dtype: every row's unmasked
        rows of `name`. On a GPU this runs on the thread that launches the compute, once per staged activation
        of every forward (57 blocks x 1-3 names a Flux step): few torch ops, no per-call host tables."""
        level = self.levels[level_index]
        bases, entry, layout, scales = [], None, None, []
        for row, num_tokens in zip(self.rows, level.row_tokens):
            if row is None:
                bases.append(0)
                scales.append(None)
                continue
            offset, entry = row.handle.entry_offset(row.step, block, row.prefix + name)
            if entry.rows != num_tokens:
                raise ValueError(f"block {block} {name!r}: recorded {entry.rows} tokens, the batch row has {num_tokens}")
            layout = row.handle.layout
            bases.append(offset)
            scales.append(row.handle.scale(row.step, block, row.prefix + name))
        if entry is None:
            raise ValueError(f"block {block}: no batch row reads {name!r}")
        row_bytes = layout.row_bytes(entry)
        num_rows = len(self.rows)
        device = self.engine.device
        stored = torch.empty((sum(level.row_tokens), entry.row_elems), dtype=layout.dtype, device=device)
        src_offsets = level.src_offsets(bases, row_bytes)
        dst_rows = level.dst_rows
        arena = self.rows[next(r for r, row in enumerate(self.rows) if row is not None)].handle.arena_bytes
        ops.gather_host_rows_(stored.view(torch.uint8) if layout.quantized else stored, arena, src_offsets,
                              dst_rows, method=self.engine.method, max_blocks=self.engine.gather_blocks)
        self.engine.stats.bytes += int(src_offsets.numel()) * row_bytes
        self.engine.stats.rows += int(src_offsets.numel())
        shape = (num_rows, level.num_tokens, *entry.shape[1:]) if not level.packed else (-1, *entry.shape[1:])
        if not layout.quantized:
            stored = stored.view(shape)
            return stored if stored.dtype == self.dtype else stored.to(self.dtype)
        if len(scales) == 1:  # one batch row: its scale straight from the (pinned) arena
            scale = ops.to_device_async(scales[0], device).unsqueeze(0)
        else:
            ones = torch.ones(entry.row_elems, dtype=torch.float32)
            scale = ops.to_device_async(torch.stack([ones if s is None else s for s in scales]), device)
        if stored.is_cuda:  # one pass and one launch (`decode` takes three of each)
            rows = ({"row_of_token": self._row_of_token_on_device(level_index)} if level.packed
                    else {"tokens_per_row": level.num_tokens})
            return decode_fp8_rows(stored, scale, self.dtype, **rows).view(shape)
        stored = stored.view(shape)
        if level.packed:  # one scale per token row: its batch row's
            scale = scale[self._row_of_token_on_device(level_index)]
            return decode(stored.unsqueeze(1), scale, self.dtype).squeeze(1)
        return decode(stored, scale, self.dtype)

    def _row_of_token_on_device(self, level_index: int) -> torch.Tensor:
        """[sum L_r] the batch row of each token of a packed level, on the device: once per forward."""
        if level_index not in self._row_of_token:
            level = self.levels[level_index]
            row_of_token = torch.repeat_interleave(torch.arange(len(level.row_tokens)), torch.tensor(level.row_tokens))
            self._row_of_token[level_index] = ops.to_device_async(row_of_token, self.engine.device)
        return self._row_of_token[level_index]
