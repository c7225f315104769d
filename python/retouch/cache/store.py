"""The activation cache store: templates in a pinned host arena under a byte budget, LRU-evicted to a
disk tier, loaded back (or prefetched while a request queues), recomputed when neither holds them.

Tiers (paper §4.2, "hierarchical storage"; DESIGN.md "Cache store"):
- host: one `HostArena` (C++, pinned when CUDA is present) whose capacity is the budget, so it cannot
  be exceeded. Each recorded step of a template is one aligned allocation laid out by `StepLayout`.
- disk (optional): `DiskTier`, written in the background when a template is committed (write-through:
  it outlives the process, and its eviction costs no write), or at its eviction if that write had
  failed, and read back into the arena on the next use. A missing or corrupt file is a miss: the
  caller re-registers.

Lifetimes: the store's index holds one arena reference per step allocation; every `TemplateHandle`
(from `acquire`) holds one more. Eviction and `drop` release only the index's reference, so memory
that readers still use is freed when the last of them releases it. Victims are templates nobody
reads; a template being recorded is invisible until `commit` and never evicted. A handle released with a
`fence` (a CUDA event after the copies that read it: `CopyEngine.fence`) stops counting as a reader at
once, but keeps its memory until the fence has passed: the device may still be copying from it when the
host is done, and memory reused meanwhile (a disk load into it) would reach an edit in flight. Likewise a
recording's steps are copied from a GPU into the arena on a stream of the store's, without a host sync
while the forwards go on; `commit` waits for those copies, and a step's memory stays held until they land.

Thread-safe: one lock guards the indexes; disk reads and writes happen outside it, so readers of
host-resident templates never wait for disk I/O.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from retouch import ops
from retouch.cache.base import ActivationCache
from retouch.cache.disk import CorruptCacheFile, DiskTier
from retouch.cache.keys import base_name, check_template_id, stored_key
from retouch.cache.layout import STORAGE_DTYPES, Entry, StepLayout, decode, dtype_name, encode
from retouch.errors import InputError, RetouchError

GiB = 1 << 30
logger = logging.getLogger("retouch.cache")


class CacheMiss(KeyError):
    """The template is in no tier (never recorded, evicted from every tier, or its file was corrupt)."""


class CacheFull(RetouchError):
    """A template does not fit the host budget even after evicting every template nobody reads.

    held: True where templates in use (being read or recorded) hold the memory it needed, so that it may
          fit once they are released; False where it needs more than the whole budget."""

    def __init__(self, message: str, held: bool = True):
        super().__init__(message)
        self.held = held


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Budgets and storage format of a `CacheStore`."""

    host_bytes: int = 4 * GiB  # pinned host arena: the host tier's budget
    disk_dir: Path | None = None  # None: no disk tier (evicted templates are recomputed)
    disk_bytes: int = 64 * GiB
    dtype: str = "auto"  # storage dtype; auto keeps the recorded dtype (lossless)
    alignment: int = 256
    pinned: bool = True

    def __post_init__(self):
        for name in ("host_bytes", "disk_bytes", "alignment"):  # 8192.0 or 1.5e9 are whole numbers too
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
                raise InputError(f"StoreConfig {name} must be a whole number of bytes, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.host_bytes < 1 or self.disk_bytes < 0:
            raise InputError(f"host budget must be >= 1 and disk budget >= 0 bytes, got {self.host_bytes}, "
                             f"{self.disk_bytes}")
        if self.dtype != "auto" and self.dtype not in STORAGE_DTYPES:
            raise InputError(f"cache dtype must be auto or one of {', '.join(STORAGE_DTYPES)}, got {self.dtype!r}")


@dataclass(eq=False)
class _Template:
    """A template resident in the host arena (or being recorded into it)."""

    template_id: str
    layout: StepLayout | None
    step_offsets: list[int]
    meta: dict
    readers: int = 0
    linked: bool = False  # in the index: holds one arena reference per step
    evicting: bool = False
    written: Future | None = None  # its write-through to the disk tier
    too_large_for_disk: bool = False  # alone over the disk tier's budget: never written, said once

    @property
    def nbytes(self) -> int:
        return 0 if self.layout is None else self.layout.nbytes * len(self.step_offsets)


@dataclass(eq=False)
class _Recording:
    """Activations of a template being registered: the current step's tensors until the step is complete."""

    template: _Template
    names: frozenset[str] | None
    step: int = 0
    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    discarded: bool = False
    copies: list = field(default_factory=list)  # CUDA events: its steps' copies from the device have landed
    total_steps: int | None = None  # how many steps it will write, where the recorder knows (`step`: the current)


class TemplateHandle:
    """Read access to a host-resident template; its memory stays valid until `release` (or `with`)."""

    def __init__(self, store: CacheStore, template: _Template):
        self._store = store
        self._template = template
        self._released = False

    @property
    def template_id(self) -> str:
        return self._template.template_id

    @property
    def layout(self) -> StepLayout:
        return self._template.layout

    @property
    def num_steps(self) -> int:
        return len(self._template.step_offsets)

    @property
    def source_dtype(self) -> torch.dtype:
        return STORAGE_DTYPES[self._template.meta["source_dtype"]]

    @property
    def arena_bytes(self) -> torch.Tensor:
        """uint8 [capacity]: the whole host arena, which `entry_offset` addresses."""
        return self._store.arena_bytes

    def entry_offset(self, step: int, block: int, name: str) -> tuple[int, Entry]:
        """Arena byte offset of activation `name` of `block` at `step`, and its entry."""
        if not 0 <= step < self.num_steps:
            raise KeyError(f"template {self.template_id!r} has no step {step} ({self.num_steps} recorded)")
        entry = self.layout.entry(block, name)
        return self._template.step_offsets[step] + entry.offset, entry

    def view(self, step: int, block: int, name: str) -> torch.Tensor:
        """The stored `[rows, ...]` tensor (storage dtype), a view of the arena."""
        offset, entry = self.entry_offset(step, block, name)
        nbytes = entry.rows * self.layout.row_bytes(entry)
        return self.arena_bytes[offset:offset + nbytes].view(self.layout.dtype).view(entry.shape)

    def scale(self, step: int, block: int, name: str) -> torch.Tensor | None:
        """fp8 storage: the entry's per-channel float32 scale `[row_elems]` (a view); else None."""
        _, entry = self.entry_offset(step, block, name)
        if entry.scale_offset is None:
            return None
        start = self._template.step_offsets[step] + entry.scale_offset
        return self.arena_bytes[start:start + entry.row_elems * 4].view(torch.float32)

    def read(self, step: int, block: int, name: str) -> torch.Tensor:
        """A decoded copy in the recorded dtype."""
        return decode(self.view(step, block, name), self.scale(step, block, name), self.source_dtype).clone()

    def release(self, fence=None) -> None:
        """Done reading on the host; `fence` (with `query()` and `synchronize()`, a CUDA event): the device's
        reads of it are done once it has passed (the store's docstring)."""
        if not self._released:
            self._released = True
            self._store._release(self._template, fence)

    def __enter__(self) -> TemplateHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CacheStore(ActivationCache):
    """Host arena + disk tier behind the `ActivationCache` interface (see the module docstring).

    Recording: `begin(template_id, names)`, then the adapters `put` every activation of step 0, 1, ...
    (a step is written into the arena when the next step starts), then `commit` publishes the template
    (or `drop` discards it). Reading: `acquire` a `TemplateHandle` (loading from disk if needed),
    `prefetch` to load from disk in the background, `get` for one activation.
    """

    def __init__(self, config: StoreConfig = StoreConfig()):
        self.config = config
        self.arena = ops.allocate_host_arena(config.host_bytes, config.alignment, config.pinned,
                                             "the template cache (--cache-host-gib)")
        self.arena_bytes = self.arena.tensor()
        self._lock = threading.RLock()
        self._host: OrderedDict[str, _Template] = OrderedDict()  # least recently used first
        # A file whose template is in host memory is a redundant copy: the disk tier evicts those first.
        # (A lock-free read of the index: the tier calls it holding its own lock.)
        self.disk = (DiskTier(config.disk_dir, config.disk_bytes, redundant=lambda name: name in self._host)
                     if config.disk_dir is not None else None)
        self._recordings: dict[str, _Recording] = {}
        self._loading: dict[str, Future] = {}
        self._prefetcher: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future] = []
        self._fenced: list[tuple[object, list[int]]] = []  # (fence, arena offsets) freed once it has passed
        self._write_streams: dict[torch.device, torch.cuda.Stream] = {}  # recordings' copies from each GPU
        self._closed = False
        self.counters: Counter[str] = Counter()

    # ---- recording ----

    def begin(self, template_id: str, names: Iterable[str] | None = None, meta: dict | None = None,
              steps: int | None = None) -> None:
        """Start recording `template_id`, keeping only activations whose base name is in `names`
        (None: all). An earlier recording of it in progress is discarded. `meta` (JSON) is kept with
        the recording, in its file too: `meta(template_id)` reads it back, in a later process too.
        `steps`: how many steps it will write, if known: one that cannot fit the budget whole is refused
        when its first step is written (CacheFull), not after filling the budget."""
        check_template_id(template_id)
        with self._lock:
            self._discard_recording(template_id)
            self._recordings[template_id] = _Recording(_Template(template_id, None, [], dict(meta or {})),
                                                       None if names is None else frozenset(names),
                                                       total_steps=steps)

    def put(self, template_id, step, block, name, tensor):
        template_id, name = stored_key(template_id, name)
        with self._lock:
            recording = self._recordings.get(template_id)
            if recording is None:
                self.begin(template_id)
                recording = self._recordings[template_id]
        if recording.names is not None and base_name(name) not in recording.names:
            return
        if step != recording.step:
            if step != recording.step + 1 or not recording.tensors:
                raise ValueError(f"template {template_id!r}: steps are recorded in order; got step {step} "
                                 f"after step {recording.step}")
            self._write_step(recording)
            recording.step = step
        tensor = tensor.detach()
        if tensor.is_cuda or tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            # One row of a batch: do not keep the whole batch alive until the step is written. On a GPU it may
            # be a CUDA graph's output, which the next forward overwrites before this step is written.
            tensor = tensor.clone()
        recording.tensors[(block, name)] = tensor

    def commit(self, template_id: str) -> None:
        """Publish a recorded template: from now on it can be read, and evicted."""
        with self._lock:
            recording = self._recordings.get(template_id)
            if recording is None or (not recording.tensors and not recording.template.step_offsets):
                raise ValueError(f"nothing was recorded for template {template_id!r}")
        if recording.tensors:
            self._write_step(recording)
        for copied in recording.copies:
            copied.synchronize()  # its steps' rows are in the arena: readers may take them from now
        with self._lock:
            if self._recordings.get(template_id) is not recording:
                return  # dropped meanwhile
            del self._recordings[template_id]
            self._unlink_host(template_id)
            if self.disk is not None:
                self.disk.remove(template_id)  # a stale file of an earlier recording
            template = recording.template
            template.linked = True
            self._host[template_id] = template
            self.counters["registrations"] += 1
            if self.disk is not None and not self._closed:
                template.readers += 1  # the writer reads it: it is not evicted before its file is whole
                for offset in template.step_offsets:
                    self.arena.retain(offset)
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(1, thread_name_prefix="retouch-write-through")
                self._writes = [write for write in self._writes if not write.done()]
                template.written = self._writer.submit(self._write_through, template)
                self._writes.append(template.written)

    def _write_through(self, template: _Template) -> None:
        """Write a newly committed template to the disk tier in the background, so that it outlives this
        process (a restarted worker adopts it) and its eviction costs no write."""
        try:
            with self._lock:
                current = self._host.get(template.template_id) is template
            if current:  # not dropped, nor recorded again, while its write waited
                self._write_back(template)
        except OSError as exc:
            logger.warning("template %s: writing it to the disk tier failed (%s)", template.template_id, exc)
            with self._lock:
                self.counters["disk_write_failures"] += 1
        finally:
            self._release(template)
        with self._lock:
            replaced = self._host.get(template.template_id) is not template
        if replaced:  # dropped or recorded again while it was written: its file must not stand for either
            self.disk.remove(template.template_id)

    def flush(self) -> None:
        """Wait for the disk writes of committed templates under way (they stay listed until done:
        `_allocate` waits for them too)."""
        while True:
            with self._lock:
                self._writes = [write for write in self._writes if not write.done()]
                pending = list(self._writes)
            if not pending:
                return
            wait(pending)

    def _write_step(self, recording: _Recording) -> None:
        """Encode the step's tensors into one new arena allocation. A step that cannot be written (the
        budget is full of templates being read) ends the recording: its steps so far are freed."""
        try:
            self._encode_step(recording)
        except BaseException:
            with self._lock:
                if self._recordings.get(recording.template.template_id) is recording:
                    self._discard_recording(recording.template.template_id)
            raise

    def _encode_step(self, recording: _Recording) -> None:
        template = recording.template
        source_dtype = next(iter(recording.tensors.values())).dtype
        dtype = source_dtype if self.config.dtype == "auto" else STORAGE_DTYPES[self.config.dtype]
        layout = StepLayout.for_tensors({key: tuple(t.shape) for key, t in recording.tensors.items()}, dtype,
                                        self.config.alignment)
        if template.layout is None:
            total = recording.total_steps
            if total is not None and layout.nbytes * total > self.arena.capacity:
                raise CacheFull(f"template {template.template_id!r} needs {layout.nbytes * total / GiB:.3g} "
                                f"GiB of host cache ({total} steps of {layout.nbytes / GiB:.3g} GiB), more "
                                f"than its whole budget of {self.arena.capacity / GiB:.3g} GiB; a larger host budget "
                                "(--cache-host-gib) holds it", held=False)
            template.layout = layout
            template.meta = {**template.meta, "source_dtype": dtype_name(source_dtype)}
        elif layout != template.layout:
            raise ValueError(f"template {template.template_id!r}: step {recording.step} recorded other "
                             "activations than step 0")
        offset = self._allocate(layout.nbytes)
        with self._lock:
            if recording.discarded:
                self.arena.release(offset)
                return
            template.step_offsets.append(offset)
            self.arena.retain(offset)  # ours while writing, should the recording be dropped meanwhile
        copied = None
        try:
            for entry in layout.entries:
                stored, scale = encode(recording.tensors[(entry.block, entry.name)], dtype)
                start = offset + entry.offset
                target = self.arena_bytes[start:start + stored.numel() * stored.element_size()]
                copied = self._copy_to_arena(target.view(dtype).view(stored.shape), stored) or copied
                if scale is not None:
                    start = offset + entry.scale_offset
                    target = self.arena_bytes[start:start + scale.numel() * 4].view(torch.float32)
                    copied = self._copy_to_arena(target, scale) or copied
        finally:
            with self._lock:
                if copied is None:
                    self.arena.release(offset)
                else:  # the copies still write into it: ours until they have landed
                    event = torch.cuda.Event()
                    event.record(copied)
                    recording.copies.append(event)
                    self._fenced.append((event, [offset]))
        recording.tensors.clear()

    def _copy_to_arena(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Stream | None:
        """target (a view of the arena) <- source. From a GPU, queued on a stream of the store's behind what
        the current stream has queued, without a host sync: a step of a recording is written while the next
        forward runs (a blocking copy per activation stalled every request in the batch). Returns that
        stream, None when the copy is done."""
        if not source.is_cuda:
            target.copy_(source)
            return None
        stream = self._write_streams.get(source.device)
        if stream is None:
            stream = self._write_streams[source.device] = torch.cuda.Stream(source.device)
        stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
        source.record_stream(stream)  # its memory is not reused before the copy has read it
        return stream

    # ---- reading ----

    def acquire(self, template_id: str) -> TemplateHandle:
        """A handle on the template in host memory, loading it from disk first if needed (CacheMiss if
        no tier holds it, or its file was corrupt: the file is then deleted)."""
        check_template_id(template_id)
        loaded = False  # by this call (or a prefetch it waited for): a disk hit, not a host hit
        while True:
            with self._lock:
                template = self._host.get(template_id)
                if template is not None:
                    template.readers += 1
                    for offset in template.step_offsets:
                        self.arena.retain(offset)
                    self._host.move_to_end(template_id)
                    if not loaded:
                        self.counters["hits"] += 1
                    return TemplateHandle(self, template)
                future, owner = self._loading.get(template_id), False
                if future is None:
                    if self.disk is None or not self.disk.contains(template_id):
                        self.counters["misses"] += 1
                        raise CacheMiss(f"template {template_id!r} is not cached")
                    future, owner = Future(), True
                    self._loading[template_id] = future
            if owner:
                self._load_into(future, template_id)
            future.result()  # raises CacheMiss when the load failed
            loaded = True

    def count_miss(self) -> None:
        """A lookup that found a template in no tier without `acquire` (the engine records it again first)."""
        with self._lock:
            self.counters["misses"] += 1

    def prefetch(self, template_id: str) -> Future:
        """Load the template from disk into host memory in the background (a request for it is
        queued); the future's result is True once it is in host memory, False if no tier holds it."""
        check_template_id(template_id)
        with self._lock:
            if template_id in self._host:
                return _done(True)
            future = self._loading.get(template_id)
            if future is None:
                if self.disk is None or not self.disk.contains(template_id):
                    return _done(False)
                future = Future()
                self._loading[template_id] = future
                if self._prefetcher is None:
                    self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="retouch-prefetch")
                self.counters["prefetches"] += 1
                self._prefetcher.submit(self._load_into, future, template_id, True)
        result = Future()
        future.add_done_callback(lambda f: result.set_result(f.exception() is None))
        return result

    def meta(self, template_id: str) -> dict | None:
        """The `meta` a committed recording of the template was begun with (and its source_dtype), from
        host memory or its file's header; None if no tier holds it (an unusable file is forgotten)."""
        check_template_id(template_id)
        with self._lock:
            template = self._host.get(template_id)
            if template is not None:
                return dict(template.meta)
            if self.disk is None or not self.disk.contains(template_id):
                return None
        try:
            return self.disk.read_meta(template_id)
        except (CorruptCacheFile, OSError) as exc:
            self._forget_unusable_file(template_id, exc)
            return None

    def _forget_unusable_file(self, template_id: str, exc: Exception) -> None:
        """The template's file could not be read (corrupt, gone, unreadable): counted, said, removed."""
        if isinstance(exc, CorruptCacheFile):
            with self._lock:
                self.counters["corrupt_files"] += 1
        logger.warning(f"cache file {self.disk.path(template_id)} is unusable ({exc}): removed; the template is "
                       "recorded again")
        self.disk.remove(template_id)

    def count_adoption(self) -> None:
        """A recording of an earlier process served a template registered again (`MaskAwareEditor.adopt`)."""
        with self._lock:
            self.counters["adoptions"] += 1

    def get(self, template_id, step, block, name):
        template_id, name = stored_key(template_id, name)
        with self.acquire(template_id) as handle:
            return handle.read(step, block, name)

    def contains(self, template_id):
        template_id, _ = stored_key(template_id, "")
        with self._lock:
            return template_id in self._host or (self.disk is not None and self.disk.contains(template_id))

    def drop(self, template_id):
        template_id, _ = stored_key(template_id, "")
        with self._lock:
            self._discard_recording(template_id)
            self._unlink_host(template_id)
        if self.disk is not None:
            self.disk.remove(template_id)

    def abandon(self, template_id: str) -> None:
        """Discard a recording in progress and the steps it wrote; a committed recording of the same
        template stays readable."""
        template_id, _ = stored_key(template_id, "")
        with self._lock:
            self._discard_recording(template_id)

    def evict(self, template_id: str) -> bool:
        """Move a template out of host memory now (to disk, if there is a disk tier), as the LRU policy
        would; False if it is not resident or is being read."""
        template_id, _ = stored_key(template_id, "")
        with self._lock:
            template = self._host.get(template_id)
        if template is not None and template.written is not None:
            template.written.result()  # its write-through: then it is not read, and the eviction writes nothing
        with self._lock:
            template = self._host.get(template_id)
            if template is None or template.readers or template.evicting:
                return False
            template.evicting = True
        self._evict(template)
        return True

    def free_bytes(self) -> int:
        """What a new recording can take without pushing a template out of every tier: host memory's free
        bytes, and the disk tier's."""
        with self._lock:
            free = self.arena.capacity - self.arena.used
        if self.disk is not None:
            free += max(0, self.disk.budget - self.disk.used)
        return max(0, free)

    def largest_recording(self) -> int:
        """The bytes of the largest recording either tier holds (0: none)."""
        with self._lock:
            largest = max((template.nbytes for template in self._host.values()), default=0)
        return max(largest, self.disk.largest if self.disk is not None else 0)

    def nbytes(self, template_id=None):
        with self._lock:
            if template_id is None:
                return self.arena.used
            template = self._host.get(stored_key(template_id, "")[0])
            return 0 if template is None else template.nbytes

    def metrics(self) -> dict[str, int | float]:
        """Counters (hits: found in host memory; misses: in no tier, or its file was unusable;
        disk_hits: loaded from disk; evictions, prefetches, prefetch_bytes, prefetch_seconds, disk_reads,
        disk_writes, disk_write_failures, disk_too_large, disk_bytes_read, disk_bytes_written, corrupt_files,
        registrations, adoptions) and tier occupancy."""
        with self._lock:
            report = {name: 0 for name in ("hits", "misses", "disk_hits", "evictions", "prefetches",
                                           "prefetch_bytes", "disk_reads", "disk_writes", "disk_write_failures",
                                           "disk_too_large",
                                           "disk_bytes_read", "disk_bytes_written", "corrupt_files",
                                           "registrations", "adoptions")}
            report.update(self.counters)
            report["prefetch_seconds"] = float(self.counters.get("prefetch_microseconds", 0)) / 1e6
            report.pop("prefetch_microseconds", None)
            report.update(host_bytes_used=self.arena.used, host_bytes_budget=self.arena.capacity,
                          host_templates=len(self._host))
        if self.disk is not None:
            report.update(disk_bytes_used=self.disk.used, disk_bytes_budget=self.disk.budget,
                          disk_evictions=self.disk.evictions)
        return report

    def in_host(self, most: int = 1024) -> list[str]:
        """The templates in host memory, at most `most` of them, the most recently used first: where an edit
        of one costs neither a disk read nor a recording (the router's template affinity)."""
        with self._lock:
            held = [template_id for template_id, template in reversed(self._host.items()) if not template.evicting]
        return held[:most]

    def close(self) -> None:
        """Finish the background reads and writes under way; templates committed later are not written."""
        with self._lock:
            self._closed = True
        try:
            self.flush()
        finally:
            for pool in (self._prefetcher, self._writer):
                if pool is not None:
                    pool.shutdown(wait=True)
            if self.disk is not None:
                self.disk.close()

    # ---- internals ----

    def _release(self, template: _Template, fence=None) -> None:
        with self._lock:
            template.readers -= 1
            if fence is not None and not fence.query():
                self._fenced.append((fence, list(template.step_offsets)))
                return
            for offset in template.step_offsets:
                self.arena.release(offset)

    def _free_fenced(self, wait_all: bool = False) -> None:
        """Release the memory of fenced handles whose fence has passed (`wait_all`: waiting for every one).
        Called with the lock held."""
        kept = []
        for fence, offsets in self._fenced:
            if wait_all:
                fence.synchronize()
            elif not fence.query():
                kept.append((fence, offsets))
                continue
            for offset in offsets:
                self.arena.release(offset)
        self._fenced = kept

    def _allocate(self, nbytes: int) -> int:
        """An arena allocation of `nbytes`, evicting least recently used templates nobody reads (after
        waiting for the device's reads of released memory, which costs no template)."""
        while True:
            with self._lock:
                self._free_fenced()
                offset = self.arena.allocate(nbytes)
                if offset < 0 and self._fenced:
                    self._free_fenced(wait_all=True)
                    offset = self.arena.allocate(nbytes)
                if offset >= 0:
                    return offset
                victim = next((t for t in self._host.values() if t.readers == 0 and not t.evicting), None)
                writes = [write for write in self._writes if not write.done()]
                if victim is not None:
                    victim.evicting = True
                elif not writes:
                    raise CacheFull(f"{nbytes} bytes do not fit the host cache budget of {self.arena.capacity} "
                                    f"bytes ({self.arena.used} held by templates in use or being recorded, this "
                                    "one's steps so far included); a larger host budget (--cache-host-gib) "
                                    "holds it")
            if victim is not None:
                self._evict(victim)
            else:  # templates being written through: evictable once written
                wait(writes, return_when=FIRST_COMPLETED)

    def _evict(self, template: _Template) -> None:
        """Write back (the template is marked evicting: readers may still take it meanwhile), then unlink.
        A write-back that fails (a full or broken disk) still unlinks it: its next edit records it again,
        and the host budget is not held by a template nobody can evict."""
        try:
            self._write_back(template)
        except OSError as exc:
            logger.warning("template %s: writing it to the disk tier failed (%s); it will be recorded again "
                           "when next edited", template.template_id, exc)
            with self._lock:
                self.counters["disk_write_failures"] += 1
        with self._lock:
            if self._host.get(template.template_id) is template:
                self._unlink_host(template.template_id)
                self.counters["evictions"] += 1

    def _write_back(self, template: _Template) -> None:
        """Keep an evicted template on disk (if there is a disk tier and the file is not there yet)."""
        if self.disk is None or template.too_large_for_disk or self.disk.contains(template.template_id):
            return
        steps = [self._numpy(offset, template.layout.nbytes) for offset in template.step_offsets]
        if self.disk.write(template.template_id, template.layout, steps, template.meta):
            with self._lock:
                self.counters["disk_writes"] += 1
                self.counters["disk_bytes_written"] += template.nbytes
            return
        template.too_large_for_disk = True
        logger.warning("template %s (%.3g GiB) is larger than the whole disk tier (--cache-disk-gib %.3g): not "
                       "written, so a restart records it again", template.template_id, template.nbytes / GiB,
                       self.disk.budget / GiB)
        with self._lock:
            self.counters["disk_too_large"] += 1

    def _load_into(self, future: Future, template_id: str, prefetch: bool = False) -> None:
        """Read the template's file into new arena allocations and publish it; completes `future`."""
        started = time.perf_counter()
        template = _Template(template_id, None, [], {})

        def allocate(num_steps: int, layout: StepLayout) -> list[np.ndarray]:
            template.layout = layout
            for _ in range(num_steps):
                template.step_offsets.append(self._allocate(layout.nbytes))
            return [self._numpy(offset, layout.nbytes) for offset in template.step_offsets]

        try:
            _, _, template.meta = self.disk.read(template_id, allocate)
            if "source_dtype" not in template.meta:
                raise CorruptCacheFile("no source_dtype in the header")
        except (CorruptCacheFile, OSError, CacheFull) as exc:
            # OSError: gone, unreadable (EIO, EACCES) or not a file: as unusable as a corrupt one
            with self._lock:
                for offset in template.step_offsets:
                    self.arena.release(offset)
                del self._loading[template_id]
                if not isinstance(exc, CacheFull):  # full: the file stays, and the caller retries later
                    self.counters["misses"] += 1
            if not isinstance(exc, CacheFull):  # the file is unusable or gone: forget it
                self._forget_unusable_file(template_id, exc)
            future.set_exception(exc if isinstance(exc, CacheFull) else
                                 CacheMiss(f"template {template_id!r}: cache file unusable ({exc})"))
            return
        except BaseException as exc:  # an unexpected failure must still wake every waiter
            with self._lock:
                for offset in template.step_offsets:
                    self.arena.release(offset)
                del self._loading[template_id]
            future.set_exception(exc)
            return
        with self._lock:
            template.linked = True
            self._unlink_host(template_id)
            self._host[template_id] = template
            del self._loading[template_id]
            self.counters["disk_hits"] += 1
            self.counters["disk_reads"] += 1
            self.counters["disk_bytes_read"] += template.nbytes
            if prefetch:
                self.counters["prefetch_bytes"] += template.nbytes
                self.counters["prefetch_microseconds"] += round((time.perf_counter() - started) * 1e6)
        future.set_result(True)

    def _unlink_host(self, template_id: str) -> None:
        """Drop the index's reference to a host template (its memory is freed once no reader holds it)."""
        template = self._host.pop(template_id, None)
        if template is not None and template.linked:
            template.linked = False
            for offset in template.step_offsets:
                self.arena.release(offset)

    def _discard_recording(self, template_id: str) -> None:
        recording = self._recordings.pop(template_id, None)
        if recording is not None:
            recording.discarded = True
            for offset in recording.template.step_offsets:
                self.arena.release(offset)

    def _numpy(self, offset: int, nbytes: int) -> np.ndarray:
        return self.arena_bytes[offset:offset + nbytes].numpy()


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future
