"""Loaded LoRAs in host memory (pinned where a GPU copies from it), least recently used first out, within
a byte budget: thousands of adapters with long-tailed popularity (SwiftDiffusion §2) mostly hit here, and a
miss costs a read of the file. Each entry remembers the identity of the file it was read from
(`files.file_identity`), so that a replaced file is never answered from the cache."""

from __future__ import annotations

import threading
from collections import OrderedDict

from retouch.lora.files import LoraWeights


class LoraHostCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"the LoRA cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, tuple[tuple, LoraWeights]] = OrderedDict()  # name -> (identity, weights)
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, name: str, identity: tuple | None = None) -> LoraWeights | None:
        """`name`'s weights; None if not held, or (dropped) if read from another file than `identity`."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and identity is not None and entry[0] != identity:
                self._pop(name)
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(name)
            self.hits += 1
            return entry[1]

    def put(self, name: str, weights: LoraWeights, identity: tuple = ()) -> bool:
        """Keep `weights` (read from the file of `identity`), evicting the least recently used beyond the
        budget; False (kept nowhere) for an adapter larger than the whole budget."""
        with self._lock:
            self._pop(name)
            if weights.host_bytes > self.budget_bytes:
                return False
            self._entries[name] = (identity, weights)
            self.nbytes += weights.host_bytes
            while self.nbytes > self.budget_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.nbytes -= evicted.host_bytes
                self.evictions += 1
            return True

    def make_room(self, nbytes: int) -> list[str]:
        """Evict the least recently used until `nbytes` more fit the budget (or none is left): before a read
        of that many bytes, so that it takes the memory of those evicted, not fresh memory. The names
        evicted."""
        evicted = []
        with self._lock:
            while self._entries and self.nbytes + nbytes > self.budget_bytes:
                name, (_, weights) = self._entries.popitem(last=False)
                self.nbytes -= weights.host_bytes
                self.evictions += 1
                evicted.append(name)
        return evicted

    def discard(self, name: str) -> None:
        """Forget `name` (its file was replaced): not an eviction."""
        with self._lock:
            self._pop(name)

    def _pop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.nbytes -= entry[1].host_bytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
