"""A safetensors file read into memory the caller gives, its tensors as views of that memory.

safetensors' own loaders map the file: each first touch of a page is a fault, and the copy the loader then
makes lands in fresh pages, a fault each again. On this project's VMs the faults of a 280 MiB adapter cost
the loader ~0.15 s of CPU against ~0.03 s for `readinto` into pages touched before, which is what
`lora.host_memory` recycles. On a CPU-only server that CPU is taken from the forward the load should hide
behind (issue 20); on a GPU server the memory given is pinned, so the file lands where the upload reads it.

Where the file system allows it and the memory is aligned (`DIRECT_ALIGNMENT`: the LoRA arena's ranges are),
the file is read with O_DIRECT: the disk's DMA lands in that memory, and the CPU copies nothing. A cold
280 MiB file cost the loader ~0.05 s of CPU buffered here and ~0.01 s direct, in wall time within 15% of
each other either way on this VM's disk; on a CPU-only server that CPU is the forward's. The page cache is
bypassed: a file read again comes from the disk, not from memory, which is what the LRU host cache above it
is for, and no page cache is allocated (on this VM, fresh page cache cost buffered reads up to 0.7 s of
system time).

The parse checks what safetensors' own (`safetensors/src/tensor.rs`, `Metadata::validate`) checks: a header
that fits the file, known dtypes, and entries that tile the data exactly, each as long as its shape says.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (HeaderTooLarge)
READ_CHUNK = 16 << 20  # bytes per readinto: the GIL is released for each
# O_DIRECT needs memory, file offsets and lengths in multiples of the device's logical block size: 4 KiB
# covers every device Linux reports (512 B or 4 KiB).
DIRECT_ALIGNMENT = 4096
_direct_reads = True  # off inside `buffered_reads()`


@contextmanager
def buffered_reads() -> Iterator[None]:
    """Inside, every thread's reads are buffered: what `retouch bench lora` races the direct reads against
    (one benchmark at a time: the switch is the process's)."""
    global _direct_reads
    before, _direct_reads = _direct_reads, False
    try:
        yield
    finally:
        _direct_reads = before

# safetensors dtype names (safetensors/src/tensor.rs `Dtype`) -> torch. Others (F4, F6, F8_E8M0, C64) are
# refused by name: no adapter format uses them.
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
          "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class NotSafetensors(ValueError):
    """The bytes are not a safetensors file; the message says why, in one line."""


def read_file(path: str | Path, allocate: Callable[[int], torch.Tensor],
              check_names: Callable[[list[str]], None] | None = None) -> torch.Tensor:
    """The bytes of `path` in `allocate(size)` (a uint8 CPU tensor of that size). OSError as `open` raises it;
    NotSafetensors for a file that is not safetensors, or shrank while it was read. The header is read and
    checked first (with `check_names(tensor names)`, which may raise), so that a file refused costs no more
    than its header: no memory of its size, and no time reading it."""
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        _, entries, _ = _layout(memoryview(_header(file, size)), size)
        if check_names is not None:
            check_names([name for _, name in entries])
        raw = allocate(size)
        view = memoryview(raw.numpy())
        direct = _read_direct(file, view, raw.data_ptr(), size)
        file.seek(direct)
        _read_into(file, view[direct:], size - direct)
    return raw


def _read_direct(file, view: memoryview, address: int, size: int) -> int:
    """Read the file's first bytes, a multiple of DIRECT_ALIGNMENT, with O_DIRECT into `view` (at `address`);
    return how many. 0 where the memory is not aligned or the file system refuses direct reads (tmpfs)."""
    aligned = size // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
    if aligned == 0 or address % DIRECT_ALIGNMENT or not hasattr(os, "O_DIRECT") or not _direct_reads:
        return 0
    fd = file.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return 0
    done = 0
    try:
        while done < aligned:
            wanted = min(READ_CHUNK, aligned - done)
            try:
                count = os.preadv(fd, [view[done:done + wanted]], done)
            except OSError as error:
                if error.errno == errno.EINVAL and done == 0:  # refused at the first read: read it buffered
                    return 0
                raise
            if count < wanted:
                raise NotSafetensors(f"the file shrank while it was read ({done + count} of {size} bytes read)")
            done += count
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return done


def read_some(path: str | Path, wanted: Callable[[str], bool],
              check_names: Callable[[list[str]], None] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, the header's `__metadata__`) of `path`, reading the data of the tensors `wanted(name)`
    only, into memory of their own: the others are meta tensors of their shape and dtype, all that a
    converter which renames, reshapes and splits needs of them. Errors and `check_names` as `read_file`'s."""
    tensors = {}
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        start, entries, metadata = _layout(memoryview(_header(file, size)), size)
        if check_names is not None:
            check_names([name for _, name in entries])
        for (dtype, shape, begin, stop), name in entries:
            if not wanted(name):
                tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
                continue
            data = torch.empty(stop - begin, dtype=torch.uint8)
            file.seek(start + begin)
            _read_into(file, memoryview(data.numpy()), stop - begin)
            tensors[name] = data.view(dtype).view(shape)
    return tensors, metadata


def _header(file, size: int) -> bytes:
    """The first bytes of an open file: its 8-byte header length and the header, if the file holds them."""
    prefix = file.read(8)
    header_bytes = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    if 8 + header_bytes <= min(size, 8 + MAX_HEADER_BYTES):
        prefix += file.read(header_bytes)
    return prefix


def _read_into(file, view: memoryview, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        count = file.readinto(view[done:done + READ_CHUNK])
        if not count:
            raise NotSafetensors(f"the file shrank while it was read ({done} of {nbytes} bytes read)")
        done += count


def tensor_views(raw: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor, the header's `__metadata__`) of the safetensors bytes `raw`: each tensor a view of
    `raw` (a copy of its own only where its offset does not suit its dtype's alignment)."""
    start, entries, metadata = _layout(raw.numpy(), len(raw))
    tensors = {name: _view(raw, start + begin, start + stop, dtype, shape)
               for (dtype, shape, begin, stop), name in entries}
    return tensors, metadata


def _layout(data, size: int) -> tuple[int, list[tuple[tuple[torch.dtype, list[int], int, int], str]], dict[str, str]]:
    """(where the data starts, each tensor's ((dtype, shape, begin, stop), name) in data order, the header's
    `__metadata__`) of a safetensors file of `size` bytes whose first bytes, its header at least, are `data`
    (bytes sliced to bytes by `.tobytes()`: a memoryview or a uint8 numpy array)."""
    if size < 8:
        raise NotSafetensors(f"{size} bytes: shorter than a safetensors header")
    header_bytes = int.from_bytes(data[:8].tobytes(), "little")
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size:
        raise NotSafetensors(f"a header of {header_bytes} bytes in a file of {size}")
    try:
        header = json.loads(data[8:8 + header_bytes].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotSafetensors(f"its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise NotSafetensors("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise NotSafetensors("its __metadata__ is not a map of strings")
    start = 8 + header_bytes
    entries = sorted(((_entry(name, info), name) for name, info in header.items()), key=lambda e: e[0][2])
    end = 0
    for (dtype, shape, begin, stop), name in entries:
        if begin != end:
            raise NotSafetensors(f"{name} starts at byte {begin} of the data, not where the previous entry ends "
                                 f"({end})")
        if start + stop > size:
            raise NotSafetensors(f"{name} ends at byte {stop} of the data, the file holds {size - start}")
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise NotSafetensors(f"{name} has {stop - begin} bytes for a {dtype} tensor of shape {shape}")
        end = stop
    if start + end != size:
        raise NotSafetensors(f"its entries hold {end} bytes of data, the file {size - start}")
    return start, entries, metadata


def _entry(name: str, info) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(info, dict):
        raise NotSafetensors(f"{name} is not described by a JSON object")
    dtype = DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise NotSafetensors(f"{name} has dtype {info.get('dtype')!r}, which adapter files do not use")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise NotSafetensors(f"{name} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise NotSafetensors(f"{name} has data_offsets {offsets!r}")
    return dtype, shape, offsets[0], offsets[1]


def _view(raw: torch.Tensor, begin: int, stop: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    data = raw[begin:stop]
    if (raw.data_ptr() + begin) % dtype.itemsize:  # writers pad headers to 8 bytes; a file that did not is read
        data = data.clone()
    return data.view(dtype).view(shape)
