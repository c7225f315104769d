"""retouch.lora.raw_file against safetensors itself: the same tensors and metadata from any file safetensors
writes, views of the memory given (no copy), read with O_DIRECT into aligned memory where the file system
allows it and buffered otherwise, and the files safetensors refuses refused too."""

import errno
import fcntl
import json
import os
import re
import struct

import pytest
import safetensors
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from retouch.lora import raw_file
from retouch.lora.raw_file import DIRECT_ALIGNMENT, DTYPES, NotSafetensors, read_file, tensor_views

SAVABLE = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def fresh(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def aligned(nbytes: int) -> torch.Tensor:
    """Memory at a DIRECT_ALIGNMENT boundary, as the LoRA arena's ranges are: read with O_DIRECT."""
    block = torch.empty(nbytes + DIRECT_ALIGNMENT, dtype=torch.uint8)
    start = -block.data_ptr() % DIRECT_ALIGNMENT
    return block[start:start + nbytes]


def read(path, allocate=fresh) -> tuple[torch.Tensor, dict, dict]:
    raw = read_file(path, allocate)
    return (raw, *tensor_views(raw))


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


tensor_specs = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12),
    st.tuples(st.sampled_from(SAVABLE), st.lists(st.integers(0, 5), max_size=3)), max_size=6)


@settings(max_examples=40, deadline=None)
@given(specs=tensor_specs, metadata=st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=20), max_size=3),
       allocate=st.sampled_from([fresh, aligned]))
def test_the_views_are_what_safetensors_loads(specs, metadata, allocate, tmp_path_factory):
    """What safetensors writes, read back (into any memory, or aligned memory: O_DIRECT for whole 4 KiB
    blocks, buffered for the rest): the tensors and metadata safetensors loads, or refused where it refuses
    to load its own file."""
    path = tmp_path_factory.mktemp("files") / "any.safetensors"
    generator = torch.Generator().manual_seed(len(specs))
    tensors = {name: (torch.randn(shape, generator=generator) * 8).to(dtype) for name, (dtype, shape) in specs.items()}
    save_file(tensors, str(path), metadata=metadata)
    try:
        expected = load_file(str(path))
    except safetensors.SafetensorError:  # safetensors 0.8 writes `{},"__metadata__":{}}` for nothing at all
        with pytest.raises(NotSafetensors):
            read(path, allocate)
        return
    raw, views, read_metadata = read(path, allocate)
    assert views.keys() == expected.keys()
    for name, tensor in expected.items():
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
        assert bits(views[name]) == bits(tensor)  # bit for bit: NaN payloads and -0.0 too
    with safetensors.safe_open(str(path), framework="pt") as handle:
        assert read_metadata == (handle.metadata() or {})


def test_tensors_are_views_of_the_memory_given(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.randn(64, 8), "b": torch.randn(3, dtype=torch.float64).to(torch.bfloat16)}, str(path))
    raw, views, _ = read(path)
    start, stop = raw.data_ptr(), raw.data_ptr() + raw.numel()
    assert all(start <= v.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= stop for v in views.values())
    raw[-1] ^= 0xFF  # a byte of "b", the last entry: seen through the view
    assert not torch.equal(views["b"], load_file(str(path))["b"])


def handmade(entries: dict, data: bytes, pad_to: int = 8, header: bytes | None = None) -> bytes:
    """A file with the header `entries` (name -> dict) over `data`, the header padded with spaces to `pad_to`."""
    if header is None:
        header = json.dumps(entries).encode()
        header += b" " * (-(8 + len(header)) % pad_to)
    return struct.pack("<Q", len(header)) + header + data


def test_an_unaligned_entry_is_read_correctly(tmp_path):
    """A writer that did not pad its header leaves entries at odd addresses: they are copied, not viewed."""
    values = torch.arange(6, dtype=torch.float32)
    body = handmade({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, bits(values), pad_to=1)
    for extra in range(4):  # header lengths of every residue
        raw = torch.frombuffer(bytearray(handmade(
            {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {"k": "v" * extra}},
            bits(values), pad_to=1)), dtype=torch.uint8)
        views, metadata = tensor_views(raw)
        assert torch.equal(views["x"], values.view(2, 3)) and metadata == {"k": "v" * extra}
    assert safetensors.torch.load(body)["x"].equal(values.view(2, 3))  # safetensors reads it too


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F16", "shape": [2], "data_offsets": [8, 12]}}
BROKEN = {
    "too short": (b"\x01\x00\x00", "shorter than a safetensors header"),
    "header longer than the file": (struct.pack("<Q", 1 << 20) + b"{}", "a header of 1048576 bytes"),
    "header not JSON": (handmade({}, b"", header=b"not json"), "not JSON"),
    "header not an object": (handmade({}, b"", header=b"[1, 2]"), "not a JSON object"),
    "metadata not strings": (handmade({"__metadata__": {"k": 1}}, b""), "not a map of strings"),
    "unknown dtype": (handmade({"a": {**GOOD["a"], "dtype": "Q7"}}, bytes(8)), "dtype 'Q7'"),
    "negative shape": (handmade({"a": {**GOOD["a"], "shape": [-2]}}, bytes(8)), "has shape [-2]"),
    "offsets reversed": (handmade({"a": {**GOOD["a"], "data_offsets": [8, 0]}}, bytes(8)), "data_offsets [8, 0]"),
    "a gap": (handmade({"a": GOOD["a"], "b": {**GOOD["b"], "data_offsets": [10, 14]}}, bytes(14)),
              "not where the previous entry ends"),
    "overlap": (handmade({"a": GOOD["a"], "b": {**GOOD["b"], "data_offsets": [6, 10]}}, bytes(10)),
                "not where the previous entry ends"),
    "bytes for another shape": (handmade({"a": {**GOOD["a"], "shape": [3]}}, bytes(8)), "for a torch.float32"),
    "cut off": (handmade(GOOD, bytes(10)), "the file holds 10"),
    "trailing bytes": (handmade(GOOD, bytes(16)), "hold 12 bytes of data, the file 16"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_what_safetensors_refuses_is_refused(case):
    data, fragment = BROKEN[case]
    with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error types, or a JSON one
        safetensors.torch.load(data)
    with pytest.raises(NotSafetensors) as raised:
        tensor_views(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else fresh(0))
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_file_refused_from_its_header_takes_no_memory_of_its_size(case, tmp_path):
    """read_file checks the header before it allocates: junk of gigabytes costs its first bytes only."""
    data, fragment = BROKEN[case]
    path = tmp_path / "broken.safetensors"
    path.write_bytes(data)
    asked = []
    with pytest.raises(NotSafetensors, match=re.escape(fragment)):
        read_file(path, lambda nbytes: asked.append(nbytes) or fresh(nbytes))
    assert asked == []


def test_the_names_are_checked_before_the_data_is_read(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.randn(1024), "b": torch.randn(8)}, str(path))
    seen, asked = [], []

    def refuse(names: list[str]) -> None:
        seen.extend(names)
        raise KeyError("no")
    with pytest.raises(KeyError):
        read_file(path, lambda nbytes: asked.append(nbytes) or fresh(nbytes), refuse)
    assert sorted(seen) == ["a", "b"] and asked == []


def test_the_good_handmade_file_is_read_by_both():
    data = handmade(GOOD, bits(torch.tensor([1.0, 2.0])) + bits(torch.tensor([3.0, 4.0], dtype=torch.float16)))
    views, _ = tensor_views(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    expected = safetensors.torch.load(data)
    assert all(torch.equal(views[name], expected[name]) for name in expected)


def test_a_file_that_shrinks_while_it_is_read_is_refused(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"a": torch.randn(1024)}, str(path))

    def allocate_then_truncate(nbytes: int) -> torch.Tensor:
        with open(path, "r+b") as file:
            file.truncate(nbytes // 2)
        return fresh(nbytes)

    with pytest.raises(NotSafetensors, match="shrank"):
        read_file(path, allocate_then_truncate)


def direct_reads_allowed(folder) -> bool:
    with open(folder / "probe", "wb") as file:
        try:
            fcntl.fcntl(file.fileno(), fcntl.F_SETFL, fcntl.fcntl(file.fileno(), fcntl.F_GETFL) | os.O_DIRECT)
        except OSError:
            return False
    return True


@pytest.fixture
def counted_direct_reads(monkeypatch):
    """The bytes each read_file read with O_DIRECT."""
    counts = []
    read_direct = raw_file._read_direct
    monkeypatch.setattr(raw_file, "_read_direct", lambda *args: counts.append(read_direct(*args)) or counts[-1])
    return counts


def odd_sized_file(path):
    save_file({"a": torch.randn(3 * DIRECT_ALIGNMENT + 5), "b": torch.randn(7).half()}, str(path))
    return path


def test_aligned_memory_is_read_with_o_direct_and_the_tail_buffered(tmp_path, counted_direct_reads):
    if not direct_reads_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = odd_sized_file(tmp_path / "a.safetensors")
    raw, views, _ = read(path, aligned)
    size = path.stat().st_size
    assert counted_direct_reads == [size // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT] and size % DIRECT_ALIGNMENT
    assert all(torch.equal(views[name], tensor) for name, tensor in load_file(str(path)).items())


def test_unaligned_memory_and_file_systems_without_o_direct_read_buffered(tmp_path, counted_direct_reads,
                                                                          monkeypatch):
    """And any read inside `buffered_reads()` (what the LoRA bench races the direct reads against)."""
    path = odd_sized_file(tmp_path / "a.safetensors")
    expected = load_file(str(path))

    def unaligned(nbytes: int) -> torch.Tensor:
        return aligned(nbytes + 64)[64:]
    views = read(path, unaligned)[1]
    with raw_file.buffered_reads():
        with raw_file.buffered_reads():
            pass
        asked_buffered = read(path, aligned)[1]  # still buffered after the inner switch ended
    fcntl_call = fcntl.fcntl

    def no_direct(fd, command, flags=0):
        if command == fcntl.F_SETFL and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return fcntl_call(fd, command, flags)
    monkeypatch.setattr(raw_file.fcntl, "fcntl", no_direct)
    refused = read(path, aligned)[1]
    assert counted_direct_reads == [0, 0, 0]
    for views_read in (views, asked_buffered, refused):
        assert all(torch.equal(views_read[name], tensor) for name, tensor in expected.items())


def test_a_file_that_shrinks_during_a_direct_read_is_refused(tmp_path):
    if not direct_reads_allowed(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = odd_sized_file(tmp_path / "a.safetensors")

    def allocate_then_truncate(nbytes: int) -> torch.Tensor:
        with open(path, "r+b") as file:
            file.truncate(DIRECT_ALIGNMENT + 100)
        return aligned(nbytes)

    with pytest.raises(NotSafetensors, match="shrank"):
        read_file(path, allocate_then_truncate)


def test_every_torch_dtype_named_is_one_safetensors_writes():
    written = {}
    for name, dtype in DTYPES.items():
        try:
            data = safetensors.torch.save({"x": torch.zeros(2, dtype=dtype)})
        except Exception:  # noqa: BLE001 - a dtype this safetensors build cannot write
            continue
        written[name] = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])["x"]["dtype"]
    assert written and all(found == name for name, found in written.items())
