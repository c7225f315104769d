"""The disk tier: one file per template, a checksummed header, LRU eviction under a byte budget.

File format (`<template_id>.rtc`):

    magic     8 bytes   b"RTCACHE1"
    length    4 bytes   little-endian uint32, bytes of the JSON header
    crc32     4 bytes   little-endian uint32 of the JSON header
    header    JSON      {"template_id", "steps", "layout": StepLayout.to_dict(), "step_crc32": [...], "meta"}
    payload   steps x layout.nbytes bytes, step after step, exactly as they lie in the host arena

A file is written under a temporary name and renamed, so a reader sees a whole file or none. Reads
check the magic, the header checksum, the file size and each step's checksum: a truncated or corrupt
file raises `CorruptCacheFile` (the store then deletes it and the template is recomputed), never
returns wrong activations.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from retouch.cache.keys import check_template_id
from retouch.cache.layout import StepLayout
from retouch.errors import InputError
from retouch.paths import lock_folder, open_private

MAGIC = b"RTCACHE1"
PREAMBLE = struct.Struct("<8sII")
SUFFIX = ".rtc"
CHUNK = 64 << 20  # read and checksum in chunks: bounded memory, and crc32 of a whole 40 GB step at once is not possible


class CorruptCacheFile(Exception):
    """A cache file that is truncated, corrupt or not a cache file."""


def template_header(template_id: str, layout: StepLayout, steps: Sequence[np.ndarray], meta: dict | None = None) -> bytes:
    """The JSON header of a file holding `steps` (uint8 arrays of layout.nbytes each)."""
    return json.dumps({"template_id": template_id, "steps": len(steps), "layout": layout.to_dict(),
                       "step_crc32": [_crc32(step) for step in steps], "meta": meta or {}}).encode()


def file_size(header: bytes, layout: StepLayout, num_steps: int) -> int:
    return PREAMBLE.size + len(header) + num_steps * layout.nbytes


def write_template(path: Path, header: bytes, steps: Sequence[np.ndarray]) -> None:
    """Write the header and `steps` atomically to `path`."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open_private(temporary) as f:  # a template's activations (and its header's prompt) are a tenant's
            f.write(PREAMBLE.pack(MAGIC, len(header), zlib.crc32(header)))
            f.write(header)
            for step in steps:
                f.write(memoryview(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_header(f) -> dict:
    preamble = f.read(PREAMBLE.size)
    if len(preamble) != PREAMBLE.size:
        raise CorruptCacheFile("file is shorter than its preamble")
    magic, length, crc = PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise CorruptCacheFile("not a retouch cache file (bad magic)")
    raw = f.read(length)
    if len(raw) != length or zlib.crc32(raw) != crc:
        raise CorruptCacheFile("header checksum mismatch")
    try:
        header = json.loads(raw)
        header["layout"] = StepLayout.from_dict(header["layout"])
        if len(header["step_crc32"]) != int(header["steps"]):
            raise ValueError("one checksum per step")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCacheFile(f"bad header: {exc}") from None
    header["payload_offset"] = PREAMBLE.size + length
    return header


def read_template(path: Path, template_id: str, allocate: Callable[[int, StepLayout], list[np.ndarray]]) -> tuple[StepLayout, list[np.ndarray], dict]:
    """Read the file of `template_id`: `allocate(steps, layout)` gives one writable uint8 buffer of
    layout.nbytes per step (views of the host arena); their contents are verified before returning."""
    with open(path, "rb") as f:
        header = read_header(f)
        if header["template_id"] != template_id:
            raise CorruptCacheFile(f"file holds template {header['template_id']!r}")
        layout, num_steps = header["layout"], int(header["steps"])
        expected = header["payload_offset"] + num_steps * layout.nbytes
        if os.fstat(f.fileno()).st_size != expected:
            raise CorruptCacheFile(f"file has {os.fstat(f.fileno()).st_size} bytes, its header says {expected}")
        buffers = allocate(num_steps, layout)
        for step, (buffer, crc) in enumerate(zip(buffers, header["step_crc32"])):
            view = memoryview(buffer)
            for start in range(0, layout.nbytes, CHUNK):
                if f.readinto(view[start:start + CHUNK]) != min(CHUNK, layout.nbytes - start):
                    raise CorruptCacheFile(f"step {step} is truncated")
            if _crc32(buffer) != crc:
                raise CorruptCacheFile(f"step {step} checksum mismatch")
    return layout, buffers, header["meta"]


def _crc32(buffer: np.ndarray) -> int:
    view, crc = memoryview(buffer), 0
    for start in range(0, len(view), CHUNK):
        crc = zlib.crc32(view[start:start + CHUNK], crc)
    return crc


class DiskTier:
    """Template files in `directory` under `budget` bytes, least recently used evicted first.

    Files already in the directory (an earlier process's) are adopted at start, oldest first.
    `redundant(template_id)`: whether the template has another copy (in host memory); such files go
    first, so that a write-through does not push out the only copy of a template. It is called with
    the tier's lock held: it must take no lock that is held while calling into the tier.
    Thread-safe; file I/O happens outside the lock.
    """

    def __init__(self, directory: Path | str, budget: int, redundant: Callable[[str], bool] | None = None):
        if budget < 0:
            raise ValueError(f"disk budget must be >= 0 bytes, got {budget}")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Another process's tier in the same folder would count this one's files as its own and evict them.
        self._lock_file = lock_folder(self.directory, f"another retouch process keeps its disk tier in "
                                      f"{self.directory} (--cache-disk-dir); give each worker a folder of its own")
        self.budget = budget
        self.redundant = redundant or (lambda template_id: False)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # template id -> bytes, least recent first
        self.evictions = 0
        for path in sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            template_id = path.name[: -len(SUFFIX)]
            try:
                check_template_id(template_id)
            except InputError:
                continue  # not ours
            self._files[template_id] = path.stat().st_size
        self._evict_to(self.budget)

    def close(self) -> None:
        """Give the folder back (another process may take it)."""
        self._lock_file.close()

    def path(self, template_id: str) -> Path:
        return self.directory / (check_template_id(template_id) + SUFFIX)

    @property
    def largest(self) -> int:
        """The largest file's bytes (0: none)."""
        with self._lock:
            return max(self._files.values(), default=0)

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._files.values())

    def contains(self, template_id: str) -> bool:
        with self._lock:
            return template_id in self._files

    def touch(self, template_id: str) -> None:
        with self._lock:
            if template_id in self._files:
                self._files.move_to_end(template_id)

    def write(self, template_id: str, layout: StepLayout, steps: Sequence[np.ndarray], meta: dict | None = None) -> bool:
        """Keep the template on disk, evicting least recently used files to stay in budget; False (and
        nothing written) when it alone exceeds the budget. Another write may evict it as soon as it is
        reserved, even while it is written, as it may evict any file."""
        header = template_header(template_id, layout, steps, meta)
        size = file_size(header, layout, len(steps))
        if size > self.budget:
            return False
        with self._lock:
            self._files.pop(template_id, None)
            self._evict_to(self.budget - size)
            self._files[template_id] = size  # reserved before the write, so concurrent writers stay in budget
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # an operator may have removed it
            write_template(self.path(template_id), header, steps)
        except OSError:
            self.remove(template_id)
            raise
        with self._lock:
            if template_id not in self._files:
                # Evicted while written: the file came after the eviction's unlink, so it is deleted here, or
                # it would stay on disk uncounted, over the budget.
                try:
                    self.path(template_id).unlink(missing_ok=True)
                except OSError:
                    pass
        return True

    def read(self, template_id: str, allocate) -> tuple[StepLayout, list[np.ndarray], dict]:
        """See `read_template`; FileNotFoundError if the tier does not hold the template."""
        if not self.contains(template_id):
            raise FileNotFoundError(template_id)
        result = read_template(self.path(template_id), template_id, allocate)
        self.touch(template_id)
        return result

    def read_meta(self, template_id: str) -> dict:
        """The `meta` in the header of the template's file (its header checked, not its steps)."""
        with open(self.path(template_id), "rb") as f:
            header = read_header(f)
        if header["template_id"] != template_id or not isinstance(header["meta"], dict):
            raise CorruptCacheFile(f"the header of {template_id}'s file does not describe it")
        return header["meta"]

    def remove(self, template_id: str) -> None:
        """Forget the template's file and delete it; a path that cannot be deleted (not a file, a
        read-only folder) is forgotten all the same: it is never read again."""
        with self._lock:
            self._files.pop(template_id, None)
        try:
            self.path(template_id).unlink(missing_ok=True)
        except OSError:
            pass

    def _evict_to(self, limit: int) -> None:
        # Holding the lock: unlinking is quick, and an open reader keeps its file until it closes it.
        while self._files and sum(self._files.values()) > limit:
            victim = next((name for name in self._files if self.redundant(name)), next(iter(self._files)))
            del self._files[victim]
            try:
                (self.directory / (victim + SUFFIX)).unlink(missing_ok=True)
            except OSError:
                pass  # forgotten all the same (see `remove`)
            self.evictions += 1
