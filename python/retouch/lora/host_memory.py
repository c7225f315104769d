"""Host memory that adapter files are read into, recycled: one `HostArena` as large as the LoRA host cache's
budget, made at the first read (pinned where a GPU uploads from it; a GPU server makes it before it serves),
whose ranges return to it when the adapter read into them is gone.

Why not fresh memory per read: on this project's VMs, first touches of fresh pages cost ~0.15 s of CPU per
280 MiB adapter, five times the read itself, and on a CPU-only server that is taken from the forward the
load should hide behind; pinning fresh memory per read costs more still. In a serving steady state the
host cache is full and every read takes the range of an adapter evicted before: pages touched (or pinned)
once. A read that finds no free range (evicted adapters that running requests still hold) gets fresh
memory instead, counted in `fallbacks`.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from retouch import ops
from retouch.lora.raw_file import DIRECT_ALIGNMENT

logger = logging.getLogger("retouch.lora")


class AdapterMemory:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._arena: ops.HostArena | None = None
        self._bytes = None  # numpy uint8 view of the whole arena: its slices own the ranges handed out
        self._unavailable = False
        self._lock = threading.Lock()
        self.fallbacks = 0  # blocks of fresh memory: the arena had no free range of the size

    def block(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 CPU tensor of `nbytes` (page-locked with `pinned`, where CUDA is), whose memory returns to
        the arena once it and every view of it are gone. Before the memory is written again, whoever uploaded
        from it must have waited for the upload (the loader syncs its stream before each read)."""
        arena = self._arena_for(pinned)
        if arena is not None and nbytes > 0:
            offset = arena.allocate(nbytes)
            if offset >= 0:
                owner = self._bytes[offset:offset + nbytes]  # an object of its own: the tensor holds it alone
                weakref.finalize(owner, arena.release, offset).atexit = False
                return torch.from_numpy(owner)
            self.fallbacks += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())

    def reserve(self, pinned: bool) -> None:
        """Make the arena now (a server, before it serves): page-locking it takes a while, and CUDA orders a
        page-locked allocation against work in flight on the device."""
        self._arena_for(pinned)

    def prefault(self, pinned: bool) -> None:
        """Write every page of the arena once (making it first), as a serving steady state has: what a benchmark
        that times reads into recycled memory needs from its first read (a buffered read into pages never
        touched costs a fault per page; an O_DIRECT one faults them in bulk). Before any block is handed out:
        it overwrites the whole arena."""
        self._arena_for(pinned)
        if self.used:
            raise RuntimeError(f"prefault would overwrite {self.used} bytes of adapters read into the arena")
        if self._bytes is not None:
            self._bytes.fill(0)

    @property
    def used(self) -> int:
        """Bytes of the arena held by blocks alive."""
        return 0 if self._arena is None else self._arena.used

    def _arena_for(self, pinned: bool) -> ops.HostArena | None:
        with self._lock:
            if self._arena is None and not self._unavailable:
                try:
                    # Ranges aligned for O_DIRECT reads (`raw_file.DIRECT_ALIGNMENT`).
                    self._arena = ops.allocate_host_arena(self.capacity, DIRECT_ALIGNMENT, pinned, "--lora-cache-mb")
                except Exception as error:  # noqa: BLE001 - reads still work, in fresh memory
                    logger.warning("LoRA reads use fresh memory each: no arena of %d bytes (%s)", self.capacity,
                                   error)
                    self._unavailable = True
                    return None
                self._bytes = self._arena.tensor().numpy()
            return self._arena
