"""Per-row LoRA on the denoiser's linears (`retouch.lora.layers`): a batch whose rows use different adapters
(or none, or several stacked) gives each row what it gets alone, in the stock forward and in mask-aware
forwards of every layout (uniform, packed masked tokens, mixed resolutions); one adapter equals its merged
weight; layouts that cannot be told apart are refused before anything runs; the op's two backends agree."""

import pytest
import torch
from editor_inputs import max_diff
from kernel_device import TRITON_DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch import ops
from retouch.adapters import CacheMode, MaskAwareContext, patch_flux
from retouch.cache import InMemoryActivationCache
from retouch.lora.files import LoraModule, LoraWeights
from retouch.lora.layers import AmbiguousRows, LoraLayers
from retouch.masks import centred_token_rectangle
from retouch.models import build_denoiser
from retouch.models.inputs import random_flux_inputs

BATCH_ATOL = 1e-5  # fp32: a row's result in a bigger batch differs only in summation order
GRID, NUM_TEXT = (4, 4), 8


def random_adapter(denoiser, name, rank, seed, targets=("to_q", "to_v", "add_k_proj", "ff.net.2", "proj_out")):
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for path, linear in denoiser.named_modules():
        if isinstance(linear, torch.nn.Linear) and "blocks." in path and path.endswith(targets):
            A = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5
            B = torch.randn(linear.out_features, rank, generator=generator) * 0.5
            modules[path] = LoraModule(A, B, 2.0)
    return LoraWeights(name, modules)


@pytest.fixture(scope="module")
def flux():
    torch.manual_seed(0)
    denoiser = build_denoiser("tiny-flux-fill").eval()
    adapter = patch_flux(denoiser)
    layers = LoraLayers(denoiser)
    adapter.lora_layers = layers
    loras = [random_adapter(denoiser, "a", 4, 1), random_adapter(denoiser, "b", 8, 2, targets=("to_k", "ff.net.0.proj",
                                                                                             "proj_mlp", "to_add_out"))]
    return denoiser, adapter, layers, loras


CHOICES = st.lists(st.sampled_from([(), ((0, 1.0),), ((1, 0.5),), ((0, -0.7), (1, 1.3)), ((1, 1.0),)]),
                   min_size=1, max_size=4)


def entries_of(loras, choice_rows):
    return [tuple((loras[i], scale) for i, scale in choice) for choice in choice_rows]


def rows_alone(run, entries):
    return [run([entry], b) for b, entry in enumerate(entries)]


@settings(max_examples=12, deadline=None)
@given(choices=CHOICES)
def test_the_stock_forward_gives_each_row_its_own_adapters(flux, choices):
    denoiser, _, layers, loras = flux
    entries = entries_of(loras, choices)
    inputs = random_flux_inputs(denoiser, len(entries), GRID, NUM_TEXT, seed=3)

    def run(batch_entries, row=None):
        row_inputs = inputs if row is None else {k: (v[row:row + 1] if torch.is_tensor(v) and v.dim() and
                                                     k not in ("img_ids", "txt_ids") else v) for k, v in inputs.items()}
        with torch.inference_mode(), layers.bind(layers.batch(batch_entries)):
            return denoiser(**row_inputs)[0]

    together = run(entries)
    for b, alone in enumerate(rows_alone(run, entries)):
        assert max_diff(together[b], alone[0]) < BATCH_ATOL
    if any(entries):  # and the adapters change something
        with torch.inference_mode():
            assert max_diff(together, denoiser(**inputs)[0]) > 1e-3


@pytest.mark.parametrize("mode", [CacheMode.Y_CACHE, CacheMode.KV_CACHE])
@pytest.mark.parametrize("sizes", [((4, 4), (4, 4), (4, 4)), ((4, 4), (2, 6), (3, 3))], ids=["uniform", "mixed"])
def test_mask_aware_forwards_give_each_row_its_own_adapters(flux, mode, sizes):
    """Packed masked and query tokens (and, mixed, packed image and joint matrices) find their rows."""
    denoiser, adapter, layers, loras = flux
    cache = InMemoryActivationCache()
    per_request = [random_flux_inputs(denoiser, 1, grid, NUM_TEXT, seed=10 + i) for i, grid in enumerate(sizes)]
    for i, (grid, inputs) in enumerate(zip(sizes, per_request)):
        with torch.inference_mode(), adapter.run(MaskAwareContext.record([f"t{i}"], [0], NUM_TEXT, grid[0] * grid[1],
                                                                         cache)):
            denoiser(**inputs)
    masks = [centred_token_rectangle(grid, ratio) for grid, ratio in zip(sizes, (0.25, 0.5, 0.1))]
    entries = entries_of(loras, [((0, 1.0),), (), ((0, 0.5), (1, 1.0))])
    lens = [g[0] * g[1] for g in sizes]
    packed = {"hidden_states": [i["hidden_states"][0] for i in per_request],
              "img_ids": [i["img_ids"] for i in per_request], "txt_ids": per_request[0]["txt_ids"],
              **{name: torch.cat([i[name] for i in per_request])
                 for name in ("encoder_hidden_states", "pooled_projections", "timestep", "guidance")}}

    def run(requests, batch_entries):
        context = MaskAwareContext.edit(mode, [masks[r] for r in requests], [f"t{r}" for r in requests],
                                        [0] * len(requests), NUM_TEXT, [lens[r] for r in requests], cache)
        lora_batch = layers.batch(batch_entries, adapter.row_layouts(context))
        with torch.inference_mode(), adapter.run(context), layers.bind(lora_batch):
            if context.mixed:
                return adapter.forward_packed(**{k: ([v[r] for r in requests] if isinstance(v, list) else
                                                     v if k == "txt_ids" else v[list(requests)])
                                                 for k, v in packed.items()})
            stacked = {k: (torch.stack([v[r] for r in requests]) if isinstance(v, list) and k == "hidden_states"
                           else v[requests[0]] if k == "img_ids" else v if k == "txt_ids" else v[list(requests)])
                       for k, v in packed.items()}
            return list(denoiser(**stacked)[0])

    together = run([0, 1, 2], entries)
    for b in range(3):
        alone = run([b], [entries[b]])[0]
        assert max_diff(together[b], alone) < BATCH_ATOL
    without = run([0], [()])[0]
    assert max_diff(together[0], without) > 1e-3  # request 0's adapter applies to its computed rows


def test_one_adapter_equals_its_merged_weights(flux):
    denoiser, _, layers, loras = flux
    lora = loras[0]
    inputs = random_flux_inputs(denoiser, 2, GRID, NUM_TEXT, seed=4)
    with torch.inference_mode():
        with layers.bind(layers.batch([((lora, 0.8),)] * 2)):
            got = denoiser(**inputs)[0]
        linears = dict(denoiser.named_modules())
        saved = {name: linears[name].weight.clone() for name in lora.modules}
        try:
            for name, module in lora.modules.items():
                linears[name].weight += 0.8 * module.scaling * module.B @ module.A
            merged = denoiser(**inputs)[0]
        finally:
            for name, weight in saved.items():
                linears[name].weight.copy_(weight)
    assert max_diff(got, merged) < 1e-4 * max(1.0, merged.abs().max().item())


def test_layouts_that_cannot_be_told_apart_are_refused_before_the_forward(flux):
    _, _, layers, loras = flux
    a, b = ((loras[0], 1.0),), ((loras[1], 1.0),)
    with pytest.raises(AmbiguousRows):
        layers.batch([a, b], [(2, 0), (1, 1)])  # two layouts of 2 rows: request 0's rows differ
    layers.batch([a, a], [(2, 0), (1, 1)])  # the same adapter everywhere: the split does not matter
    layers.batch([a, ()], [(3, 0), (3, 0)])  # one layout given twice


def test_an_input_of_no_known_layout_is_an_error_not_a_silent_mixup(flux):
    denoiser, _, layers, loras = flux
    inputs = random_flux_inputs(denoiser, 3, GRID, NUM_TEXT, seed=5)
    with pytest.raises(RuntimeError, match="row layout"):
        with torch.inference_mode(), layers.bind(layers.batch([((loras[0], 1.0),)] * 2)):
            denoiser(**inputs)  # three rows where the binding says two entries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_backends_of_the_op_agree_over_ragged_segments(dtype):
    generator = torch.Generator().manual_seed(0)

    def drawn(*shape):
        return torch.randn(*shape, generator=generator).to(device=TRITON_DEVICE, dtype=dtype)

    groups = [(drawn(r, 40), drawn(24, r), s) for r, s in ((4, 1.0), (16, -0.5), (128, 0.25))]
    x, y = drawn(70, 40), drawn(70, 24)
    segments = [(0, 5, 1), (5, 5, 0), (9, 40, 2), (40, 41, 1), (60, 70, 0)]  # an empty one, gaps without LoRA
    by_torch, by_triton = y.clone(), y.clone()
    ops.segmented_lora_(x, by_torch, groups, segments, backend="torch")
    ops.segmented_lora_(x, by_triton, groups, segments, backend="triton")
    tolerance = 1e-4 if dtype == torch.float32 else 0.25
    assert max_diff(by_torch, by_triton) < tolerance * max(1.0, by_torch.abs().max().item())
    untouched = torch.ones(70, dtype=torch.bool, device=TRITON_DEVICE)
    for start, stop, _ in segments:
        untouched[start:stop] = False
    assert torch.equal(by_torch[untouched], y[untouched]) and torch.equal(by_triton[untouched], y[untouched])
