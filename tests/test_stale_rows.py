"""A KV-cache block whose unmasked output rows nobody reads writes its computed rows into its input when
an earlier such block of the same forward made that input (issue 16: one op and one full copy of the
hidden states fewer per block), and into a copy otherwise: the first such block's input belongs to the
caller, and a recording in the batch may still be copying it."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from forward_cases import FAMILY_MODELS, Forwards
from retouch.adapters.context import CacheMode, MaskAwareContext
from retouch.bench.trace import is_top_level_op
from retouch.cache.base import InMemoryActivationCache
from retouch.masks import centred_token_rectangle
from retouch.profile import build_target


def test_the_input_is_written_only_when_this_forward_made_it():
    forwards = Forwards(FAMILY_MODELS["flux-fill"], templates=1)
    adapter = forwards.adapter
    caller = torch.randn(1, 4, 8)
    with adapter.run(forwards.context(CacheMode.KV_CACHE, [0.2])):
        first = adapter.output_over_stale_rows(caller, records=False)
        assert first is not caller and torch.equal(first, caller)  # the caller's tensor: copied
        assert adapter.output_over_stale_rows(first, records=False) is first  # made here: written
        recorded = adapter.output_over_stale_rows(first, records=True)
        assert recorded is not first and torch.equal(recorded, first)  # a recording may read it: copied
    with adapter.run(forwards.context(CacheMode.KV_CACHE, [0.2])):
        assert adapter.output_over_stale_rows(first, records=False) is not first  # another forward's


def _clones(target, context, batch: int = 1) -> int:
    inputs = target.inputs(batch, 4)
    with torch.inference_mode(), target.adapter.run(context), profile(activities=[ProfilerActivity.CPU]) as prof:
        target.denoiser(**inputs)
    return sum(event.name == "aten::clone" and is_top_level_op(event) for event in prof.events())


def _copies_expected(adapter) -> int:
    """One copy per run of KV blocks that write stale rows: Flux and SD3 chain every block into one run; a
    UNet's run ends at the last block of each Transformer2DModel (proj_out reads every row), so a model of
    one block (SD2's) copies nothing and one of several blocks copies once."""
    last = getattr(adapter, "last_in_transformer", None)
    if last is None:
        return 1
    return sum(not last[b] and (b == 0 or last[b - 1]) for b in range(len(last)))


@pytest.mark.parametrize("model, copies", [("flux-size", 1), ("sd3-size", 1), ("sdxl-size", 11), ("sd2-size", 0)])
def test_a_kv_forward_copies_the_hidden_states_once_per_run_of_blocks(model, copies):
    """At the bench specs' depths: one copy for the first block of a run, then each block writes into what
    the one before made."""
    target = build_target(model, torch.device("cpu"), torch.float32, narrow=True, text_tokens=4)
    _, cache = target.record(1, 4, torch.device("cpu"))
    assert _copies_expected(target.adapter) == copies
    assert _clones(target, target.edit_context(CacheMode.KV_CACHE, 1, 4, 0.25, cache)) == copies


@pytest.mark.parametrize("model", ["flux-size", "sd3-size"])
def test_a_batch_that_records_copies_per_block(model):
    target = build_target(model, torch.device("cpu"), torch.float32, narrow=True, text_tokens=4)
    _, cache = target.record(1, 4, torch.device("cpu"))
    # A batch of an edit and a request that records (every token masked): a copy for every block but
    # the last, whose output is read whole.
    masks = [centred_token_rectangle((4, 4), 0.25), torch.arange(16)]
    with_recording = MaskAwareContext.edit(CacheMode.KV_CACHE, masks, ["t0", "t1"], [0, 0], 4, 16, cache,
                                           records=[False, True],
                                           record_to=InMemoryActivationCache())
    assert _clones(target, with_recording, batch=2) == target.adapter.num_blocks - 1
