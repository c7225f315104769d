"""`to_device_async`: host-built tables reach the device without waiting for the stream they are queued on
(on the copy engine's stream that wait would hold the host until compute reached a gate block)."""

import pytest
import torch

from retouch import ops


def test_on_the_cpu_the_table_is_the_host_tensor_itself():
    values = torch.arange(5, dtype=torch.int32)
    assert ops.to_device_async(values, "cpu") is values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_behind_a_busy_stream_returns_before_the_stream_is_done():
    stream = torch.cuda.Stream()
    values = torch.arange(1 << 12, dtype=torch.int32)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1 << 31)  # about a second of GPU time queued ahead of the copy
        on_device = ops.to_device_async(values, "cuda")
        busy = not stream.query()
    stream.synchronize()
    assert busy  # the host went on while the stream still had the sleep to run: no sync
    assert torch.equal(on_device.cpu(), values)
