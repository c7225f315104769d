"""Loaded LoRAs in host memory (pinned where a GPU copies from it), least recently used first out, within
a byte budget: thousands of adapters with long-tailed popularity (SwiftDiffusion §2) mostly hit here, and a
miss costs a read of the file."""

from __future__ import annotations

import threading
from collections import OrderedDict

from retouch.lora.files import LoraWeights


class LoraHostCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"the LoRA cache budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, LoraWeights] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, name: str) -> LoraWeights | None:
        with self._lock:
            weights = self._entries.get(name)
            if weights is None:
                self.misses += 1
                return None
            self._entries.move_to_end(name)
            self.hits += 1
            return weights

    def put(self, name: str, weights: LoraWeights) -> bool:
        """Keep `weights`, evicting the least recently used beyond the budget; False (kept nowhere) for an
        adapter larger than the whole budget."""
        if weights.nbytes > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._entries[name] = weights
            self.nbytes += weights.nbytes
            while self.nbytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self.evictions += 1
            return True

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
