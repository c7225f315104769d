"""torch.compile of the mask-aware blocks (`MaskAwareAdapter.compile`): the compiled forward equals the
eager one within fp32 tolerance for every cache mode and batch shape, and after a warm-up over the shapes
a graph specializes on (a batch of one or more, each cache mode) no new mask, ratio or batch composition
compiles again (`torch._dynamo.config.error_on_recompile`).

Tolerance: inductor fuses and reorders the elementwise ops and reductions of a block (e.g. layer norm's
mean and variance in one pass), a few fp32 ulps per op; COMPILED_ULPS units of fp32 eps at the output's
scale is ~4x the worst seen over these cases.

Backend: inductor on a GPU for every family. On the CPU, inductor for Flux and aot_eager (dynamo and
AOTAutograd, no code generation) for SD3 and the UNet: most of what these tests catch (a graph break, a
dynamo guard that recompiles, a core dynamo cannot trace) is decided before code generation; what is not
(inductor's lowering, its own shape guards) is checked for them on a GPU, where it matters, and for Flux
here. Inductor's C++ for two more families cost this suite two minutes on a cold cache.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from forward_cases import EDIT_MODES, Forwards
from retouch.adapters.base import SIZE_OBLIVIOUS
from retouch.cache import InMemoryActivationCache
from retouch.ragged import token_bucket
from replay_checks import assert_close_ulps

COMPILED_ULPS = 64
# "No new graph after warm-up" holds where sizes 0 and 1 trace like any other (torch >= 2.13, SIZE_OBLIVIOUS);
# before, a one-token mask or a batch of one compiles once more, and only equality is checked.


def no_new_graphs():
    return torch._dynamo.config.patch(error_on_recompile=SIZE_OBLIVIOUS)
# One graph per (core, cache mode, batch of one or more): warm-up visits each.
WARM_UP = [[0.2], [0.1, 0.5]]
# New masks, ratios and compositions (empty and recording requests, three requests): no new graph.
AFTER_WARM_UP = [[0.6], [0.01], [0.0], [0.9, 0.3, 0.0], [1.0, 0.4], [0.25, 0.25]]
MODELS = ["tiny-flux-fill", "tiny-sd3-inpaint", "tiny-sdxl-inpaint"]


def backend(model: str) -> str:
    return "inductor" if torch.cuda.is_available() or model == "tiny-flux-fill" else "aot_eager"


@pytest.fixture(scope="module", params=MODELS)
def compiled_forwards(request):
    """(forwards, eager outputs per (mode, case)), the adapter compiled after the eager outputs were taken."""
    forwards = Forwards(request.param)
    cases = [(mode, tuple(case)) for mode in EDIT_MODES for case in WARM_UP + AFTER_WARM_UP]
    eager = {case: forwards.forward(forwards.context(*case)) for case in cases}
    forwards.eager_stock = forwards.forward(batch=2)
    forwards.adapter.compile(backend=backend(request.param))
    torch._dynamo.reset()
    return forwards, eager


def test_compiled_equals_eager_and_never_recompiles(compiled_forwards):
    forwards, eager = compiled_forwards
    for mode in EDIT_MODES:
        for case in WARM_UP:
            assert_close_ulps(forwards.forward(forwards.context(mode, case)), eager[mode, tuple(case)], COMPILED_ULPS)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the cores ran compiled
    with no_new_graphs():
        for mode in EDIT_MODES:
            for case in AFTER_WARM_UP:
                actual = forwards.forward(forwards.context(mode, case))
                assert_close_ulps(actual, eager[mode, tuple(case)], COMPILED_ULPS)
    assert counters["stats"]["unique_graphs"] == graphs or not SIZE_OBLIVIOUS


# ---- the adapter invariants, compiled ----

@pytest.mark.parametrize("mode", EDIT_MODES, ids=lambda mode: mode.name)
def test_compiled_replay_identity(compiled_forwards, mode):
    """An edit of a template on the inputs it was recorded from returns the recorded output."""
    forwards, _ = compiled_forwards
    cache = InMemoryActivationCache()
    recorded = forwards.record(cache)
    replayed = forwards.forward(forwards.context(mode, [0.3], cache=cache))
    assert_close_ulps(replayed, recorded, COMPILED_ULPS)


@pytest.mark.parametrize("mode", EDIT_MODES, ids=lambda mode: mode.name)
def test_compiled_all_masked_equals_stock(compiled_forwards, mode):
    """Every token masked (the request records itself) against the model's own forward, eager."""
    forwards, _ = compiled_forwards
    all_masked = forwards.forward(forwards.context(mode, [1.0, 1.0]))
    assert_close_ulps(all_masked, forwards.eager_stock, COMPILED_ULPS)


def test_compiled_all_full_plan_is_the_compiled_stock_forward(compiled_forwards):
    """Every block in full under a context: bit for bit the compiled blocks without one."""
    forwards, _ = compiled_forwards
    plan = [False] * forwards.adapter.num_blocks
    in_full = forwards.forward(forwards.context(EDIT_MODES[0], [0.3, 0.5], block_plan=plan))
    assert torch.equal(in_full, forwards.forward(batch=2))


def test_compiled_padded_path_equals_eager(compiled_forwards):
    """The CUDA-graph path's shapes (tokens padded to `token_bucket` sizes) through the same graphs."""
    forwards, eager = compiled_forwards
    forwards.adapter.pad_tokens(token_bucket)
    try:
        for mode in EDIT_MODES:  # padded index tensors are made inside the forward: new guards, once
            for case in WARM_UP:
                assert_close_ulps(forwards.forward(forwards.context(mode, case)), eager[mode, tuple(case)],
                                  COMPILED_ULPS)
        with no_new_graphs():
            for mode in EDIT_MODES:
                for case in AFTER_WARM_UP:
                    actual = forwards.forward(forwards.context(mode, case))
                    assert_close_ulps(actual, eager[mode, tuple(case)], COMPILED_ULPS)
    finally:
        forwards.adapter.pad_tokens(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a GPU")
@pytest.mark.parametrize("model", MODELS)
def test_cuda_graphs_capture_and_replay(model):
    """On a GPU: `compile(cuda_graphs=True)` captures every core (no cudagraph skip) and replays equal
    the eager forward, over new masks of the same buckets."""
    forwards = Forwards(model, device="cuda")
    cases = [(mode, tuple(case)) for mode in EDIT_MODES for case in WARM_UP + AFTER_WARM_UP]
    eager = {case: forwards.forward(forwards.context(*case)) for case in cases}
    forwards.adapter.compile(cuda_graphs=True)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):  # the first forwards of a shape record its graph, later ones replay it
        for case in cases:
            assert_close_ulps(forwards.forward(forwards.context(*case)), eager[case], COMPILED_ULPS)
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_cuda_graphs_start_one_generation_per_denoiser_forward(model, monkeypatch):
    """Inductor's CUDA graph trees start a generation at every entry into a compiled function unless told
    otherwise, and a new generation overwrites the last one's outputs: block i's output, which block i+1
    reads. The adapter marks one step per denoiser forward instead (stock, masked and all-full forwards
    alike). Counted here on the CPU, where nothing is captured; the capture itself runs on a GPU above."""
    forwards = Forwards(model)
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    forwards.forward(batch=1)
    assert marks == []  # eager blocks: nothing to mark
    forwards.adapter.compile(cuda_graphs=True)
    monkeypatch.setattr(forwards.adapter, "core", lambda function: function)  # which code runs is not the point
    forwards.forward(batch=1)
    assert len(marks) == 1
    forwards.forward(forwards.context(EDIT_MODES[0], [0.3, 0.5]))
    assert len(marks) == 2
    forwards.forward(forwards.context(EDIT_MODES[-1], [0.3], block_plan=[False] * forwards.adapter.num_blocks))
    assert len(marks) == 3


def test_cuda_graphs_keep_flux_attention_on_device_tensors(monkeypatch):
    """Under CUDA graphs the Flux cores attend with the ragged kernel's device-side plan, never the measured
    choice (`ops.choose_attention`), whose SDPA reads host lengths when compiled: inductor would skip
    capturing that graph. On the CPU with the measured choice forced on: eager consults it, graphs do not."""
    from retouch import ops

    forwards = Forwards("tiny-flux-fill")
    chosen = []
    monkeypatch.setattr(ops, "attention_costs", lambda *args: ops.ATTENTION_COSTS[9, 128])
    monkeypatch.setattr(ops, "choose_attention", lambda *args: chosen.append(args) or ("sdpa", False))
    forwards.forward(forwards.context(EDIT_MODES[0], [0.3]))
    assert chosen
    chosen.clear()
    forwards.adapter.compile(cuda_graphs=True)
    monkeypatch.setattr(forwards.adapter, "core", lambda function: function)  # which code runs is not the point
    forwards.forward(forwards.context(EDIT_MODES[0], [0.3]))
    assert chosen == [] and not forwards.adapter.measured_attention


# ---- the opt-in flag: editor, CLI and server options ----

def test_a_compiled_engine_edits_as_the_eager_one_and_warms_up_once():
    """`compile=True` (what `--compile` sets) through the whole pipeline: after `Engine.warm_up` (what a
    worker runs before it takes requests), a template of another size, its recording and a ragged batch of
    edits compile nothing new, nor does a step-loop batch of three sizes in one forward (Flux and SD3
    workers pack sizes: `EngineConfig.mixed_sizes`, whose packed rows are graphs of their own), and the
    edits equal the eager engine's within the compiled tolerance."""
    from editor_inputs import square_mask, template_image
    from PIL import Image
    from test_mixed_sizes import edits, run, templates

    from retouch.editor import EditRequest
    from retouch.engine.api import Engine
    from retouch.engine.worker import EngineConfig

    torch._dynamo.reset()
    latents = []
    for compiled in (False, True):
        engine = Engine.load("tiny-flux-fill", EngineConfig(mode="naive"), compile=compiled)
        editor = engine.editor
        assert editor.compiled == compiled
        if compiled:
            engine.warm_up()
            assert not editor.templates  # the warm-up's templates are gone
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=compiled and SIZE_OBLIVIOUS):  # recompiles
            template = editor.register_template(template_image(), prompt="a scene", steps=2, seed=0)
            requests = [EditRequest(template, square_mask(), "a red hat", seed=1),
                        EditRequest(template, Image.new("L", (128, 128), 0), "nothing", seed=2),
                        EditRequest(template, square_mask((0, 0, 127, 40)), "a blue sky", seed=3)]
            latents.append(editor.edit_many(requests, output_type="latent"))
            _, jobs, forwards = run(editor, edits(editor, templates(editor)))
        assert forwards[0] == 3  # the three sizes in one forward
        if compiled and SIZE_OBLIVIOUS:
            assert counters["stats"]["unique_graphs"] == graphs  # nor first compiles of another function
        latents[-1] += [job.row.latents[0] for job in jobs]
    for eager, compiled in zip(*latents):
        assert_close_ulps(compiled, eager, COMPILED_ULPS)


def test_cuda_graphs_are_refused_off_cuda():
    from retouch import load
    from retouch.config import EditOptions, ServeOptions
    from retouch.errors import InputError

    with pytest.raises(InputError, match="cuda_graphs needs a CUDA device"):
        load("tiny-flux-fill", cuda_graphs=True)
    edit = dict(model="m", image="i.png", mask="m.png", prompt="p")
    with pytest.raises(InputError, match="add --mask-aware"):
        EditOptions(**edit, compile=True)
    with pytest.raises(InputError, match="--cuda-graphs needs a CUDA device"):
        EditOptions(**edit, mask_aware=True, cuda_graphs=True, device="cpu")
    with pytest.raises(InputError, match="--cuda-graphs needs a CUDA device"):
        ServeOptions(model="m", cuda_graphs=True, device="cpu")
    if not torch.cuda.is_available():  # device "auto" resolves to the CPU here: refused before anything starts
        from retouch.server import Server

        server = Server(ServeOptions(model="tiny-flux-fill", cuda_graphs=True))
        with pytest.raises(InputError, match="--cuda-graphs needs a CUDA device"):
            server.start()
        assert getattr(server, "router", None) is None
