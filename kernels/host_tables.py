"""Host-built tables (segment bounds, row indices, scales) moved to the device without a host sync.

A copy from pageable host memory is not asynchronous: without `non_blocking` torch waits for the stream
to drain, and with it the driver may. On the copy engine's stream, whose copies wait for compute to
reach their gate blocks, that wait holds the host until the GPU gets there, so it cannot launch the
blocks after; on the compute stream it is a bubble per call. From pinned memory (the caching host
allocator's, which reuses a block once the copies reading it are done) the copy is queued and the host
goes on."""

from __future__ import annotations

import torch


def to_device_async(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`values` (a host tensor) on `device`, copied on the current stream without a host sync; the tensor
    itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)
