"""A planned mask-aware forward makes no host sync (issue 16): once its context is built (the ragged
descriptor and index layouts: the planning), the denoiser forward only launches work. Every call that
reads tensor values on the host (`retouch.host_syncs.SYNC_METHODS`, torch.nonzero) is counted during
the forward, for every family and cache mode, over ragged batches with empty, partial, whole and
recording requests, and with blocks that run in full. The CPU path counts what a GPU would sync on:
the same Python reads the same values (the Triton kernel is left out: its CPU interpreter copies
tensors to NumPy by design).
"""

from contextlib import contextmanager

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


@pytest.mark.parametrize("mode", EDIT_MODES, ids=lambda mode: mode.name)
def test_planning_what_a_forward_reads_from_the_cache_reads_nothing_back(forwards, mode):
    """The copy engine's row lists come from the descriptor's host indices (`RaggedBatch.query_idx_host`),
    not from the device copies: on a GPU each `.cpu()` waited for the step before."""
    from retouch.adapters.reads import forward_reads

    context = forwards.context(mode, BATCHES["ragged"])
    with counting_host_syncs() as calls:
        reads = forward_reads(forwards.adapter, context, lambda block: ("out", "k", "v"))
    # Host work on host tensors (the unmasked rows' nonzero) syncs nothing; a copy back to the host would.
    assert calls["cpu"] == calls["tolist"] == calls["item"] == 0 and reads.blocks


def test_the_counter_sees_a_sync():
    """The unplanned attention call reads its cu_seqlens back (what every masked block did before)."""
    q = torch.randn(6, 2, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    with counting_host_syncs() as calls:
        ops.ragged_attention(q, q, q, cu_seqlens, cu_seqlens, 4, 4, backend="sdpa")
    assert calls["tolist"] >= 1
    assert torch.Tensor.tolist.__name__ == "tolist"  # restored


@contextmanager
def sync_errors():
    """CUDA's sync debug mode at "error" within the block: a blocking copy, a read of a device value or a
    stream sync raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("model", list(FAMILY_MODELS.values()))
def test_on_a_gpu_planning_and_the_forward_make_no_sync(model):
    """Planning included (the ragged descriptors and attention plans are built on the host and copied from
    pinned memory): the host can plan step n+1 while the GPU runs step n."""
    forwards = Forwards(model, device="cuda")
    for mode in EDIT_MODES:
        for fractions in BATCHES.values():
            inputs = forwards.target.inputs(len(fractions), 8)
            forwards.forward(forwards.context(mode, fractions))  # first calls: library set-up and kernel builds
            with sync_errors(), torch.inference_mode():
                context = forwards.context(mode, fractions)
                with forwards.adapter.run(context):
                    forwards.denoiser(**inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("mode", ["y", "kv"])
def test_on_a_gpu_recording_and_staged_edits_plan_and_run_each_forward_without_a_sync(mode):
    """The editor on the cache store, sync errors on around every denoiser forward from before the editor's
    own hook: a registration's forwards (each step's activations copied to the pinned arena on a stream of
    the store's while the next forward runs), then an edit's (planning in the editor's forward pre-hook,
    staged copies from pinned host memory, the blocks)."""
    from editor_inputs import LATENT_ATOL, max_diff, square_mask, template_image

    from retouch import load
    from retouch.cache import CacheStore, StoreConfig

    editor = load("tiny-flux-fill", device="cuda", cache=CacheStore(StoreConfig(host_bytes=64 << 20)),
                  cache_mode=mode)
    warm = editor.register_template(template_image(), prompt="a room", steps=3, seed=1)
    editor.edit(warm, square_mask((16, 16, 40, 40)), "a hat", seed=2, output_type="latent")  # library set-up
    forwards = []

    def errors_on(module, args, kwargs):
        forwards.append(sync_errors())
        forwards[-1].__enter__()

    def errors_off(module, args, kwargs, output):
        forwards[-1].__exit__(None, None, None)

    hooks = [editor.denoiser.register_forward_pre_hook(errors_on, with_kwargs=True),
             editor.denoiser.register_forward_hook(errors_off, with_kwargs=True)]
    try:
        template_id = editor.register_template(template_image((200, 90, 30)), prompt="a cat", steps=3, seed=3,
                                               mask=square_mask((8, 24, 48, 40)))
        edited = editor.edit(template_id, square_mask((8, 24, 48, 40)), "a cat", seed=3, output_type="latent")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for hook in hooks:
            hook.remove()
    assert len(forwards) == 6 and editor.copy_engine.stats.blocks > 0
    # What the asynchronous copies recorded replays (the edit the template was recorded from, as full compute).
    full = editor.edit(template_id, square_mask((8, 24, 48, 40)), "a cat", seed=3, output_type="latent",
                       full_compute=True)
    assert max_diff(edited, full) <= LATENT_ATOL
