"""The one-pass float8 decode (`retouch.kernels.fp8_decode`) against the cache's own decode
(`retouch.cache.layout.decode`: fp8 -> fp32, times the per-channel scale, -> the compute dtype): bit for bit
compiled on a GPU; under Triton's interpreter, which rounds fp32 -> bf16/fp16 its own way, within one unit
of the output dtype. Over row widths around the program's block, scale rows by division or by index
(packed batches), and empty inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_device import TRITON_DEVICE
from retouch.cache.layout import decode, encode
from retouch.kernels.fp8_decode import BLOCK, decode_fp8_rows

INTERPRETED = TRITON_DEVICE.type == "cpu"


def encoded_rows(rows_per_scale: list[int], row_elems: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, E] float8, [R, E] scales): R batch rows of activations, each encoded with its own scales."""
    generator = torch.Generator().manual_seed(seed)
    stored, scales = [], []
    for index, tokens in enumerate(rows_per_scale):
        values = torch.randn(tokens, row_elems, generator=generator) * (1 + 10 * index)
        if tokens == 0:  # nothing to take a scale from: any scale decodes no rows
            stored.append(values.to(torch.float8_e4m3fn))
            scales.append(torch.rand(row_elems, generator=generator) + 0.5)
            continue
        encoded, scale = encode(values, torch.float8_e4m3fn)
        stored.append(encoded)
        scales.append(scale)
    return torch.cat(stored).to(TRITON_DEVICE), torch.stack(scales).to(TRITON_DEVICE)


def assert_decodes_as_reference(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if not INTERPRETED or expected.dtype == torch.float32:
        assert torch.equal(actual, expected)
        return
    # One unit in the last place of the output dtype, at each element's magnitude.
    unit = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(torch.finfo(expected.dtype).tiny)
    assert bool(((actual.float() - expected.float()).abs() <= unit).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("row_elems", [1, 7, BLOCK, BLOCK + 1, 3072])
def test_rows_of_equal_batch_rows_decode_as_the_reference(dtype, row_elems):
    stored, scale = encoded_rows([5, 5, 5], row_elems, seed=row_elems)
    expected = decode(stored.view(3, 5, row_elems), scale, dtype).view(15, row_elems)
    assert_decodes_as_reference(decode_fp8_rows(stored, scale, dtype, tokens_per_row=5), expected)


@settings(max_examples=25, deadline=None)
@given(rows_per_scale=st.lists(st.integers(0, 9), min_size=1, max_size=5),
       row_elems=st.sampled_from([3, 64, BLOCK + 5]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2 ** 16))
def test_packed_rows_take_their_batch_rows_scales(rows_per_scale, row_elems, dtype, seed):
    """A mixed-resolution batch: batch row r's tokens, packed one row after another, use scale row r."""
    stored, scale = encoded_rows(rows_per_scale, row_elems, seed)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows_per_scale)), torch.tensor(rows_per_scale))
    expected = (stored.float() * scale[row_of_token.to(TRITON_DEVICE)]).to(dtype)
    actual = decode_fp8_rows(stored, scale, dtype, row_of_token=row_of_token.to(TRITON_DEVICE))
    assert_decodes_as_reference(actual, expected)


def test_bad_arguments_are_refused():
    stored, scale = encoded_rows([4, 4], 8, seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        decode_fp8_rows(stored, scale, torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        decode_fp8_rows(stored.float(), scale, torch.bfloat16, tokens_per_row=4)
    with pytest.raises(ValueError, match="scale must be"):
        decode_fp8_rows(stored, scale[:, :4], torch.bfloat16, tokens_per_row=4)
    with pytest.raises(ValueError, match="need 3 x 2 scale rows"):
        decode_fp8_rows(stored, scale, torch.bfloat16, tokens_per_row=3)
    with pytest.raises(ValueError, match="row_of_token must be"):
        decode_fp8_rows(stored, scale, torch.bfloat16, row_of_token=torch.zeros(3, dtype=torch.long,
                                                                                device=TRITON_DEVICE))
    empty = decode_fp8_rows(stored[:0], scale, torch.bfloat16, tokens_per_row=4)
    assert empty.shape == (0, 8) and empty.dtype == torch.bfloat16
