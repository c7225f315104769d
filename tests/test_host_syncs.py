"""A planned mask-aware forward makes no host sync (issue 16): once its context is built (the ragged
descriptor and index layouts: the planning), the denoiser forward only launches work. Every call that
reads tensor values on the host (`retouch.host_syncs.SYNC_METHODS`, torch.nonzero) is counted during
the forward, for every family and cache mode, over ragged batches with empty, partial, whole and
recording requests, and with blocks that run in full. The CPU path counts what a GPU would sync on:
the same Python reads the same values (the Triton kernel is left out: its CPU interpreter copies
tensors to NumPy by design).
"""

import pytest
import torch

from forward_cases import EDIT_MODES, FAMILY_MODELS, Forwards
from retouch import ops
from retouch.host_syncs import counting_host_syncs

BATCHES = {"one request": [0.2], "ragged": [0.1, 0.6, 0.0], "with a recording": [0.3, 1.0]}


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def forwards(request):
    return Forwards(FAMILY_MODELS[request.param])


@pytest.mark.parametrize("mode", EDIT_MODES, ids=lambda mode: mode.name)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_planned_forward_makes_no_host_sync(forwards, mode, batch):
    context = forwards.context(mode, BATCHES[batch])
    inputs = forwards.target.inputs(len(context.template_ids), 8)
    with torch.inference_mode(), forwards.adapter.run(context), counting_host_syncs() as calls:
        forwards.denoiser(**inputs)
    assert dict(calls) == {}


def test_full_blocks_in_the_plan_make_no_host_sync(forwards):
    """Y-cache with every other block in full: the unmodified blocks and their recorded outputs too."""
    plan = [index % 2 == 0 for index in range(forwards.adapter.num_blocks)]
    context = forwards.context(EDIT_MODES[0], [0.4, 0.2], block_plan=plan)
    inputs = forwards.target.inputs(2, 8)
    with torch.inference_mode(), forwards.adapter.run(context), counting_host_syncs() as calls:
        forwards.denoiser(**inputs)
    assert dict(calls) == {}


def test_the_counter_sees_a_sync():
    """The unplanned attention call reads its cu_seqlens back (what every masked block did before)."""
    q = torch.randn(6, 2, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    with counting_host_syncs() as calls:
        ops.ragged_attention(q, q, q, cu_seqlens, cu_seqlens, 4, 4, backend="sdpa")
    assert calls["tolist"] >= 1
    assert torch.Tensor.tolist.__name__ == "tolist"  # restored
