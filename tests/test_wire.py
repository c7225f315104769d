"""Process messages: msgpack header + raw frames round-trip every dtype exactly; damaged messages
are refused with WireError, never half-decoded."""

import msgpack
import pytest
import torch

from retouch.engine.wire import DTYPES, WireError, decode, encode, peek


@pytest.mark.parametrize("dtype", sorted(DTYPES.values(), key=str))
@pytest.mark.parametrize("shape", [(3, 5), (0, 4), (), (2, 1, 7)])
def test_tensors_and_blobs_round_trip_exactly(dtype, shape):
    tensor = (torch.randn(shape) * 10).to(dtype)
    strided = torch.randn(4, 6).to(dtype).t()  # not contiguous
    header, tensors, blobs = decode(encode({"kind": "x", "job": 3}, {"a": tensor, "b": strided}, {"png": b"\x89PNG"}))
    assert header == {"kind": "x", "job": 3}
    assert tensors["a"].dtype == dtype and tensors["a"].shape == tensor.shape
    assert torch.equal(tensors["a"], tensor) and torch.equal(tensors["b"], strided)
    assert blobs == {"png": b"\x89PNG"}


def test_damaged_messages_are_refused():
    frames = encode({"kind": "x"}, {"a": torch.ones(4)})
    with pytest.raises(WireError, match="frames"):
        decode(frames[:1])
    with pytest.raises(WireError, match="bytes for shape"):
        decode([frames[0], b"\x00" * 3])
    with pytest.raises(WireError, match="bad header"):
        decode([b"\xc1not msgpack"])
    with pytest.raises(WireError, match="unknown dtype"):
        decode([msgpack.packb({"_tensors": [["a", "complex64", [1]]], "_blobs": []}), b"\x00" * 8])
    with pytest.raises(WireError, match="empty"):
        decode([])


def test_peek_reads_the_header_alone_and_refuses_garbage():
    frames = encode({"kind": "prepare", "job": 7}, tensors={"x": torch.ones(4)}, blobs={"png": b"p"})
    assert peek(frames)["job"] == 7
    with pytest.raises(WireError):
        peek([b"\xc1"])


def test_a_helper_remembers_a_bounded_number_of_cancelled_jobs():
    from retouch.engine.processing import CancelledJobs

    cancelled = CancelledJobs(limit=3)
    for job in range(5):
        cancelled.add(job)
    assert [cancelled.take(job) for job in range(5)] == [False, False, True, True, True]
    assert not cancelled.take(4)  # taken once
