"""Recorded activations of templates: the interface the adapters use, the tiered store, the copy engine.

    base.py      ActivationCache (put/get/read_rows) and InMemoryActivationCache
    keys.py      template ids, guidance-variant names
    layout.py    byte layout of a recorded step ([blocks, L, H] per step), fp8 encoding
    disk.py      the disk tier: checksummed files, LRU under a byte budget
    store.py     CacheStore: pinned host arena (budget, LRU), write-back to disk, prefetch, metrics
    staging.py   CopyEngine: unmasked rows of cached blocks to the device, ahead of compute
"""

from retouch.cache.base import ActivationCache, InMemoryActivationCache, RowKey
from retouch.cache.keys import UNCOND_PREFIX, UNCOND_SUFFIX, check_template_id, uncond_row_id
from retouch.cache.store import CacheFull, CacheMiss, CacheStore, StoreConfig, TemplateHandle

__all__ = ["ActivationCache", "CacheFull", "CacheMiss", "CacheStore", "InMemoryActivationCache", "RowKey",
           "StoreConfig", "TemplateHandle", "UNCOND_PREFIX", "UNCOND_SUFFIX", "check_template_id",
           "uncond_row_id"]
