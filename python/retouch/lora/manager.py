"""The step loop's LoRA service: adapters named by requests are loaded on a thread of their own -- file ->
host cache (pinned) -> device, the device copy on a side CUDA stream -- while their requests already
denoise (SwiftDiffusion §3.2: a LoRA's effect on the first ~30% of steps is imperceptible), and handed to
the loop once their copy has landed (a CUDA event: no sync). Device copies stay for later requests, least
recently used first out, within the budget; a running request holds its own references, so an eviction
never takes weights from under it."""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from retouch.lora.files import LoraWeights, lora_path, read_lora
from retouch.lora.host_cache import LoraHostCache
from retouch.lora.layers import EntryAdapters, LoraLayers
from retouch.lora.spec import LoraChoice, LoraError


@dataclass(eq=False)
class DeviceLora:
    """An adapter's weights on the model's device; usable once `copied` (None: at once) has completed."""

    weights: LoraWeights
    copied: torch.cuda.Event | None = None
    streamed: bool = field(default=False, repr=False)  # its memory was recorded on the compute stream

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()


class LoraManager:
    """`check(choice)` and `prefetch(choice)` at submission; `acquire(choice)` at admission gives futures whose
    results are `DeviceLora`s; `entry(choice, futures)` is what a batch entry binds once they are `ready`."""

    def __init__(self, lora_dir: str | Path | None, cache_bytes: int, editor=None):
        self.lora_dir = None if lora_dir is None else Path(lora_dir)
        self.host = LoraHostCache(cache_bytes)
        self.editor = editor
        self._layers: LoraLayers | None = None
        self._device: OrderedDict[str, DeviceLora] = OrderedDict()
        self._loading: dict[str, Future] = {}
        self._failed: dict[str, tuple[tuple, BaseException]] = {}  # name -> (its file's identity, the error)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.loads = self.load_failures = self.device_evictions = self.device_hits = 0
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
        """Every adapter of `choice` is a file of the LoRA folder (`LoraError` naming it otherwise)."""
        if not choice:
            return
        if self.lora_dir is None:
            raise LoraError("this engine serves no LoRAs (start it with a LoRA folder: --lora-dir)")
        for use in choice:
            lora_path(self.lora_dir, use.name)

    def prefetch(self, choice: LoraChoice) -> None:
        """Start loading `choice`'s adapters now (submission: the load overlaps pre-processing too). This is a
        request's lookup in the metrics: a hit on the device here, or in the host cache or a miss in the loader;
        the `acquire` at its admission that follows is not counted again."""
        for use in choice:
            self._load(use.name, lookup=True)

    def acquire(self, choice: LoraChoice) -> list[Future]:
        """Futures of `choice`'s `DeviceLora`s, in order."""
        return [self._load(use.name) for use in choice]

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

    def _load(self, name: str, lookup: bool = False) -> Future:
        with self._lock:
            resident = self._device.get(name)
            if resident is not None:
                self._device.move_to_end(name)
                self.device_hits += lookup
                return _resolved(resident)
            failed = self._failed.get(name)
            if failed is not None and failed[0] == self._file_identity(name):  # the same broken file: not read again
                return _resolved(error=failed[1])
            future = self._loading.get(name)
            if future is None:
                future = self._loading[name] = Future()
                self._start_thread()
                self._queue.put(name)
            return future

    def _file_identity(self, name: str) -> tuple:
        """What changes when the operator replaces a name's file: (path, mtime, size); () without one."""
        try:
            path = lora_path(self.lora_dir, name)
            stat = path.stat()
        except (LoraError, OSError):
            return ()
        return (str(path), stat.st_mtime_ns, stat.st_size)

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
        remembered against the file's identity: requests for it fail at once until the file changes."""
        with self._lock:
            future = self._loading[name]
        file = self._file_identity(name)  # before the read: a file replaced during it is read again
        try:
            device_lora = DeviceLora(*self._host_to_device(self._host(name), stream))
        except BaseException as exc:  # noqa: BLE001 - the requests that asked fail with it
            error = exc if isinstance(exc, LoraError) else LoraError(f"LoRA {name!r} could not be loaded: {exc}")
            with self._lock:
                self.load_failures += 1
                del self._loading[name]
                self._failed[name] = (file, error)
            future.set_exception(error)
            return
        with self._lock:
            self._device[name] = device_lora
            del self._loading[name]
            self._failed.pop(name, None)
        future.set_result(device_lora)
        self._evict()

    def _host(self, name: str) -> LoraWeights:
        weights = self.host.get(name)
        if weights is None:
            started, cpu_started = time.perf_counter(), time.thread_time()
            weights = read_lora(lora_path(self.lora_dir, name), name, self.editor.pipe, self.editor.dtype,
                                pin=self.device.type == "cuda")
            self.host.put(name, weights)
            with self._lock:
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

    def _evict(self) -> None:
        """Device copies beyond the budget, least recently used first."""
        with self._lock:
            total = sum(d.weights.nbytes for d in self._device.values())
            for name in list(self._device):
                if total <= self.host.budget_bytes:
                    break
                device_lora = self._device.pop(name)
                total -= device_lora.weights.nbytes
                self.device_evictions += 1
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

    def metrics(self) -> dict:
        """Counters (cumulative) and occupancy of the host cache, the device copies and the loader."""
        with self._lock:
            device_bytes = sum(d.weights.nbytes for d in self._device.values())
            return {"cached_bytes": self.host.nbytes, "cached_adapters": len(self.host),
                    "budget_bytes": self.host.budget_bytes, "hits": self.device_hits + self.host.hits,
                    "misses": self.host.misses,
                    "evictions": self.host.evictions, "device_adapters": len(self._device),
                    "device_bytes": device_bytes, "device_evictions": self.device_evictions, "loads": self.loads,
                    "load_failures": self.load_failures, "load_seconds": self.load_seconds,
                    "load_cpu_seconds": self.load_cpu_seconds, "loading": len(self._loading)}


def _resolved(result=None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future
