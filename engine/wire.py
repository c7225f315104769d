"""Messages between processes: a msgpack header, then one raw frame per tensor or byte string.

    frames = encode({"kind": "prepare", "job": 7}, tensors={"latents": x}, blobs={"png": b"..."})
    header, tensors, blobs = decode(frames)

The header lists each tensor's name, dtype and shape and each blob's name, in frame order. Nothing
is pickled: a peer can only ever send data, never code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgpack
import torch

# What the messages between a router and its workers mean. A change of meaning (a field read another way, a
# message a peer must understand) takes the next number: a router refuses a worker of another protocol at
# its hello, so a head and workers of releases that would misread each other say so instead of serving.
PROTOCOL = 2  # 2: edits and registrations may carry a negative_prompt, edits a guidance (1 would drop them)

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)}


class WireError(ValueError):
    """A message that does not decode: wrong frame count, unknown dtype, sizes that do not match."""


def encode(header: Mapping, tensors: Mapping[str, torch.Tensor] | None = None,
           blobs: Mapping[str, bytes] | None = None) -> list:
    tensors, blobs = dict(tensors or {}), dict(blobs or {})
    specs, frames = [], []
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise WireError(f"tensor {name!r}: dtype {tensor.dtype} does not cross the wire")
        specs.append([name, dtype, list(tensor.shape)])
        frames.append(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
    full = {**header, "_tensors": specs, "_blobs": list(blobs)}
    return [msgpack.packb(full, use_bin_type=True), *frames, *blobs.values()]


def peek(frames: Sequence) -> dict:
    """The header alone (no tensor is copied): to route or skip a message before decoding it."""
    try:
        return msgpack.unpackb(bytes(frames[0]), raw=False)
    except (ValueError, IndexError, TypeError, msgpack.ExtraData) as exc:
        raise WireError(f"bad header: {exc}") from None


def decode(frames: Sequence) -> tuple[dict, dict[str, torch.Tensor], dict[str, bytes]]:
    if not frames:
        raise WireError("empty message")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False)
        specs, blob_names = header.pop("_tensors"), header.pop("_blobs")
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
        raise WireError(f"bad header: {exc}") from None
    if len(frames) != 1 + len(specs) + len(blob_names):
        raise WireError(f"{len(frames)} frames for {len(specs)} tensors and {len(blob_names)} blobs")
    tensors = {}
    for (name, dtype, shape), frame in zip(specs, frames[1:]):
        if dtype not in DTYPES:
            raise WireError(f"tensor {name!r}: unknown dtype {dtype!r}")
        data = bytearray(frame)  # writable, owned: torch.frombuffer shares it
        expected = DTYPES[dtype].itemsize * math.prod(shape)
        if len(data) != expected:
            raise WireError(f"tensor {name!r}: {len(data)} bytes for shape {shape} {dtype}")
        flat = torch.frombuffer(data, dtype=DTYPES[dtype]) if expected else torch.empty(0, dtype=DTYPES[dtype])
        tensors[name] = flat.view(shape)
    blobs = {name: bytes(frame) for name, frame in zip(blob_names, frames[1 + len(specs):])}
    return header, tensors, blobs

