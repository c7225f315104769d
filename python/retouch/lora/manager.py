"""The step loop's LoRA service: adapters named by requests are loaded on a thread of their own -- file ->
host cache (pinned) -> device, the device copy on a side CUDA stream -- while their requests already
denoise (SwiftDiffusion §3.2: a LoRA's effect on the first ~30% of steps is imperceptible), and handed to
the loop once their copy has landed (a CUDA event: no sync).

Device copies stay for later requests, least recently used first out, within a budget of their own (device
memory is not host memory; by default as many bytes as the host cache's). A copy is pinned while a request
needs it: from the lookup at its submission (`prefetch`) to its admission (`acquire`), which then holds a
lease (a future of its own) until the request is gone. So a budget smaller than one adapter still reads each
file once per lookup, and an eviction never takes weights from under a running request. Both pins are weak
references to what the request holds (its `LoraUse`s, then its futures): a request that is cancelled, fails
or ends unpins by going away, with no call to forget. Every lookup compares the file's identity
(`files.file_identity`: a stat) with its copies', so a file the operator replaced is read again and its stale
copies are dropped."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from retouch.lora.files import LoraWeights, file_identity, lora_path, read_lora
from retouch.lora.host_cache import LoraHostCache
from retouch.lora.host_memory import AdapterMemory
from retouch.lora.layers import EntryAdapters, LoraLayers
from retouch.lora.spec import LoraChoice, LoraError, LoraUse


@dataclass(eq=False)
class DeviceLora:
    """An adapter's weights on the model's device; usable once `copied` (None: at once) has completed."""

    weights: LoraWeights
    copied: torch.cuda.Event | None = None
    identity: tuple = ()  # `files.file_identity` of the file its weights were read from
    streamed: bool = field(default=False, repr=False)  # its memory was recorded on the compute stream
    # The futures `acquire` gave out for it, alive while their requests are: it is in use while any is.
    leases: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()


@dataclass(eq=False)
class _Load:
    """A read in flight: the future lookups share, the leases of admissions waiting for it, and how many
    lookups wait (counted as hits, misses or failures by its outcome)."""

    future: Future = field(default_factory=Future)
    leases: list[Future] = field(default_factory=list)
    lookups: int = 0


class LoraManager:
    """`check(choice)` and `prefetch(choice)` at submission; `acquire(choice)` at admission gives futures whose
    results are `DeviceLora`s; `entry(choice, futures)` is what a batch entry binds once they are `ready`. A
    request passes the same `LoraUse` objects to both calls (its reservation in between is a weak reference).

    cache_bytes: the host cache's budget; device_bytes: the device copies' (default: the same number)."""

    def __init__(self, lora_dir: str | Path | None, cache_bytes: int, editor=None, device_bytes: int | None = None):
        self.lora_dir = None if lora_dir is None else Path(lora_dir)
        self.host = LoraHostCache(cache_bytes)
        self.memory = AdapterMemory(cache_bytes)  # what files are read into: the host cache's, recycled
        if lora_dir is not None and editor is not None and editor.device.type == "cuda":
            self.memory.reserve(pinned=True)
        self._digests: dict[str, str] = {}  # name -> digest of its file's last read
        self.device_budget_bytes = cache_bytes if device_bytes is None else device_bytes
        if self.device_budget_bytes <= 0:
            raise ValueError(f"the LoRA device budget must be > 0 bytes, got {self.device_budget_bytes}")
        self.editor = editor
        self._layers: LoraLayers | None = None
        self._device: OrderedDict[str, DeviceLora] = OrderedDict()
        self._loading: dict[str, _Load] = {}
        self._failed: dict[str, tuple[tuple, str]] = {}  # name -> (its file's identity, the error's message)
        # name -> the LoraUses of requests looked up but not admitted yet (weakly: a dropped request unpins)
        self._reserved: dict[str, list[weakref.ref]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        # Lookups (a request's adapters at submission) end as a hit (no read), a miss (a read) or a failure
        # (answered 422: no such file, or one that cannot be loaded; a failed read is a miss too).
        self.hits = self.misses = self.load_failures = 0
        self.loads = self.device_evictions = 0
        self.loads_skipped = 0  # loads whose requests had all gone before the loader came to them
        self.load_seconds = self.load_cpu_seconds = 0.0  # wall and loader-thread CPU seconds of file reads

    @property
    def device(self) -> torch.device:
        return self.editor.device

    @property
    def layers(self) -> LoraLayers:
        """The denoiser's LoRA layers: one per denoiser (kept on its mask-aware adapter, whose mixed-size path
        reads them), made on first use."""
        if self._layers is None:
            adapter = self.editor.adapter
            if adapter.lora_layers is None:
                adapter.lora_layers = LoraLayers(self.editor.denoiser)
            self._layers = adapter.lora_layers
        return self._layers

    # ---- requests ----

    def check(self, choice: LoraChoice) -> None:
        """Every adapter of `choice` is a file of the LoRA folder (`LoraError` naming it otherwise: a lookup
        that failed, in the metrics)."""
        if not choice:
            return
        if self.lora_dir is None:
            raise LoraError("this engine serves no LoRAs (start it with a LoRA folder: --lora-dir)")
        for use in choice:
            try:
                lora_path(self.lora_dir, use.name)
            except LoraError:
                with self._lock:
                    self.load_failures += 1
                raise

    def prefetch(self, choice: LoraChoice) -> None:
        """Start loading `choice`'s adapters now (submission: the load overlaps pre-processing too), and keep
        them on the device for the `acquire` at the request's admission. This is a request's lookup in the
        metrics; that `acquire` is not counted again."""
        for use in choice:
            self._request(use, lookup=True)

    def acquire(self, choice: LoraChoice) -> list[Future]:
        """Futures of `choice`'s `DeviceLora`s, in order: leases that keep them on the device while the
        request holds them."""
        return [self._request(use, lookup=False) for use in choice]

    @staticmethod
    def ready(futures: list[Future]) -> bool | BaseException:
        """True once every adapter is usable on the device; the first load error if one failed."""
        for future in futures:
            if not future.done():
                return False
            if future.exception() is not None:
                return future.exception()
        return all(future.result().ready() for future in futures)

    def wait(self, futures: list[Future], timeout_s: float) -> None:
        """Block until one of `futures` resolves (or its copy lands), or `timeout_s`: the loop's wait when every
        running request waits for its LoRA."""
        pending = [f for f in futures if not f.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
            return
        for future in futures:
            if future.exception() is None and future.result().copied is not None:
                future.result().copied.synchronize()

    def entry(self, choice: LoraChoice, futures: list[Future]) -> EntryAdapters:
        """What a batch entry of a request with `choice` binds (its loads complete), ready on the compute stream."""
        loaded = [future.result() for future in futures]
        for device_lora in loaded:
            self._on_compute_stream(device_lora)
        return tuple((device_lora.weights, use.scale) for device_lora, use in zip(loaded, choice))

    # ---- loading ----

    def _request(self, use: LoraUse, lookup: bool) -> Future:
        """A lookup (`prefetch`: reserves the adapter for its admission) or an admission (`acquire`: takes that
        reservation and gets a lease). A copy read from a file since replaced is dropped, host and device."""
        name = use.name
        identity = self._file_identity(name)  # a stat, outside the lock
        with self._lock:
            if lookup:
                self._reserve(use)
            else:
                self._unreserve(use)
            resident = self._device.get(name)
            if resident is not None and resident.identity != identity:
                self._drop_locked(name)
                self.host.discard(name)
                resident = None
            if resident is not None:
                self._device.move_to_end(name)
                self.hits += lookup
                future = _resolved(resident)
                if not lookup:
                    resident.leases.add(future)
                self._evict_locked()  # leases of requests gone since the last load no longer pin theirs
                return future
            failed = self._failed.get(name)
            if failed is not None and failed[0] == identity:  # the same broken file: not read again
                self.load_failures += lookup
                return _resolved(error=LoraError(failed[1]))
            load = self._loading.get(name)
            if load is None:
                load = self._loading[name] = _Load()
                self._start_thread()
                self._queue.put(name)
            if lookup:
                load.lookups += 1
                return load.future
            lease: Future = Future()
            load.leases.append(lease)
            return lease

    def _reserve(self, use: LoraUse) -> None:
        uses = self._live_reservations(use.name)
        if not any(ref() is use for ref in uses):  # a request looked up twice is one reservation
            self._reserved[use.name] = [*uses, weakref.ref(use)]

    def _unreserve(self, use: LoraUse) -> None:
        uses = [ref for ref in self._live_reservations(use.name) if ref() is not use]
        if uses:
            self._reserved[use.name] = uses
        else:
            self._reserved.pop(use.name, None)

    def _live_reservations(self, name: str) -> list[weakref.ref]:
        """`name`'s reservations of requests still alive (those of requests gone are forgotten here)."""
        uses = [ref for ref in self._reserved.get(name, ()) if ref() is not None]
        if uses:
            self._reserved[name] = uses
        else:
            self._reserved.pop(name, None)
        return uses

    def _pinned(self, name: str, device_lora: DeviceLora) -> bool:
        """Reserved for a request still queued, or leased to one admitted (theirs are alive)."""
        return len(device_lora.leases) > 0 or bool(self._live_reservations(name))

    def _file_identity(self, name: str) -> tuple:
        """What changes when the operator replaces a name's file (`files.file_identity`); () without one."""
        return file_identity(self.lora_dir, name)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="retouch-lora-loader", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        while True:
            name = self._queue.get()
            if name is None:
                return
            self._load_one(name, stream)
            self._queue.task_done()  # `_queue.join()` returns once every queued load's frame has gone

    def _load_one(self, name: str, stream) -> None:
        """One load, in a frame of its own: nothing of it stays referenced while the thread waits for the
        next (a finished load held by `_run`'s locals would keep an evicted adapter's memory). A failure is
        remembered against the file's identity: requests for it fail at once until the file changes. A load
        every request that asked for has gone without (cancelled, refused) is not made."""
        with self._lock:
            load = self._loading[name]
            if not load.leases and not self._live_reservations(name):
                del self._loading[name]
                self.loads_skipped += 1
                load.future.cancel()
                return
        file = self._file_identity(name)  # before the read: a file replaced during it is read again
        weights = self.host.get(name, file)  # only a read of this very file
        read = weights is None
        try:
            if read:
                if stream is not None:  # earlier uploads read host memory this read may now be given
                    stream.synchronize()
                weights = self._read(name, file)
            device_lora = DeviceLora(*self._host_to_device(weights, stream), identity=file)
        except BaseException as exc:  # noqa: BLE001 - the requests that asked fail with it
            # Only the message is kept and passed on: the exception's traceback holds the read's frames,
            # whose locals are the whole file, for as long as anything holds the exception.
            message = str(exc) if isinstance(exc, LoraError) else f"LoRA {name!r} could not be loaded: {exc}"
            with self._lock:
                lookups = max(load.lookups, 1)  # a load no lookup asked for (an admission's) counts as one
                self.misses += lookups if read else 0
                self.load_failures += lookups
                del self._loading[name]
                self._failed[name] = (file, message)
            for future in (load.future, *load.leases):
                future.set_exception(LoraError(message))
            return
        with self._lock:
            lookups = max(load.lookups, 1)
            if read:
                self.misses += lookups
            else:
                self.hits += lookups
            if name in self._device:  # a copy of the file this load replaces
                self._drop_locked(name)
            self._device[name] = device_lora
            for lease in load.leases:
                device_lora.leases.add(lease)
            del self._loading[name]
            self._failed.pop(name, None)
        for future in (load.future, *load.leases):
            future.set_result(device_lora)
        with self._lock:
            self._evict_locked()

    def _read(self, name: str, file: tuple) -> LoraWeights:
        """The adapter's file, read for the denoiser and kept in the host cache (as a read of `file`)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        pinned = self.device.type == "cuda"
        self.host.make_room(file[-1] if file else 0)  # its size: the read takes the memory of those evicted
        if self.device.type == "cpu":  # where the device copies are the host cache's own tensors
            with self._lock:
                self._evict_locked()
        weights = read_lora(lora_path(self.lora_dir, name), name, self.editor.pipe, self.editor.dtype,
                            allocate=lambda nbytes: self.memory.block(nbytes, pinned))
        self.host.put(name, weights, file)
        with self._lock:
            self._digests[name] = weights.digest
            self.loads += 1
            self.load_seconds += time.perf_counter() - started
            self.load_cpu_seconds += time.thread_time() - cpu_started
        return weights

    def _host_to_device(self, weights: LoraWeights, stream) -> tuple[LoraWeights, torch.cuda.Event | None]:
        if stream is None:
            return weights.to(self.device), None
        with torch.cuda.stream(stream):
            on_device = weights.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return on_device, copied

    def _on_compute_stream(self, device_lora: DeviceLora) -> None:
        """Order the compute stream after the copy, and tell the allocator the compute stream uses the memory
        (it was allocated on the loader's stream)."""
        if device_lora.copied is None or device_lora.streamed:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(device_lora.copied)
        for module in device_lora.weights.modules.values():
            module.A.record_stream(compute)
            module.B.record_stream(compute)
        device_lora.streamed = True

    def settle(self) -> None:
        """A request let its adapters go (`Worker._release`): device copies that only its lease kept beyond
        the budget go now, not at the next lookup, which a worker whose later requests name no LoRA would
        never make."""
        with self._lock:
            self._evict_locked()

    def _evict_locked(self) -> None:
        """Device copies beyond the device budget, least recently used first, except those pinned: reserved
        for an admission to come, or leased to a request (its futures are alive). On a CPU worker a device
        copy is the host cache's tensors, so one the host cache has let go goes too (once not pinned): its
        memory is what the next read is to take."""
        if self.device.type == "cpu":
            cached = set(self.host.names())
            for name, device_lora in list(self._device.items()):
                if name not in cached and not self._pinned(name, device_lora):
                    self._drop_locked(name)
                    self.device_evictions += 1
        total = sum(d.weights.nbytes for d in self._device.values())
        for name, device_lora in list(self._device.items()):
            if total <= self.device_budget_bytes:
                break
            if self._pinned(name, device_lora):
                continue
            total -= device_lora.weights.nbytes
            self._drop_locked(name)
            self.device_evictions += 1

    def _drop_locked(self, name: str) -> None:
        device_lora = self._device.pop(name)
        if self._layers is not None:
            self._layers.forget(device_lora.weights)

    def clear(self) -> None:
        """Forget every loaded adapter (host and device; loads in flight complete): the next request reads its
        file again."""
        with self._lock:
            self._device.clear()
            self._failed.clear()
            if self._layers is not None:
                self._layers._stacks.clear()
        self.host.clear()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def resident(self) -> list[str]:
        """The adapters a request can name without a read of its file: on the device, in the host cache or
        being read (what the worker's heartbeat tells the router, which prefers such workers)."""
        with self._lock:
            names = set(self._device) | set(self._loading)
        return sorted(names | set(self.host.names()))

    def digests(self) -> dict[str, str]:
        """The digest (`LoraWeights.digest`) of the last read of each resident adapter's file: the router
        compares them across workers, whose folders should hold the same files."""
        with self._lock:
            digests = dict(self._digests)
        return {name: digests[name] for name in self.resident() if name in digests}

    def metrics(self) -> dict:
        """Counters (cumulative) and occupancy of the host cache, the device copies and the loader. hits,
        misses and load_failures count lookups (a request's adapters at submission), not reads."""
        with self._lock:
            device_bytes = sum(d.weights.nbytes for d in self._device.values())
            pinned = sum(1 for name, d in self._device.items() if self._pinned(name, d))
            return {"cached_bytes": self.host.nbytes, "cached_adapters": len(self.host),
                    "budget_bytes": self.host.budget_bytes, "hits": self.hits, "misses": self.misses,
                    "evictions": self.host.evictions, "device_adapters": len(self._device),
                    "device_bytes": device_bytes, "device_budget_bytes": self.device_budget_bytes,
                    "device_pinned": pinned, "device_evictions": self.device_evictions, "loads": self.loads,
                    "load_failures": self.load_failures, "load_seconds": self.load_seconds,
                    "load_cpu_seconds": self.load_cpu_seconds, "read_fallbacks": self.memory.fallbacks,
                    "loads_skipped": self.loads_skipped,
                    "loading": len(self._loading)}


def _resolved(result=None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future
