"""Reading LoRA files (retouch.lora.files) against diffusers' own loading, for every tiny family: the same
modules, factors and scalings PEFT ends up with after `pipe.load_lora_weights`, and the same fused weights;
kohya files through diffusers' converter; a one-line LoraError for every file retouch cannot apply; and
where names are looked up in --lora-dir."""

import json
import math
import os
from pathlib import Path

import pytest
import safetensors
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_files import denoiser_of, save_kohya_lora, save_random_lora
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from retouch.lora.files import (DENOISER_COMPONENT, FLUX_FAMILIES, FOLDER_WEIGHT_NAME, LoraModule, LoraWeights,
                                _one_line, all_finite, copy_all_finite, file_identity, list_loras, lora_path,
                                read_lora)
from retouch.lora.spec import LoraError, LoraUse, parse_lora
from retouch.models import load_pipeline, quiet_libraries
from retouch.models.inputs import random_flux_inputs, random_sd3_inputs, random_unet_inputs

TINY_NAMES = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
RANK, ALPHA = 4, 8.0  # scaling 2: a reader that ignored alpha would be caught
FUSE_SCALE = 0.7  # the request's scale, folded in by fuse_lora
# fp32 weights: diffusers (PEFT's merge) computes W + (B @ A) * (scaling * scale) with the same fp32 ops as
# the reference, so only the order of the two scalar products can differ: a few ulp of the largest value.
ULPS = 4
REFERENCE_ADAPTER = "reference"


@pytest.fixture(scope="module", params=TINY_NAMES)
def model(request):
    """A tiny pipeline that LoRA files are made for and read with; never given an adapter."""
    return load_pipeline(request.param)


@pytest.fixture(scope="module")
def reference(model):
    """The same pipeline loaded again, where diffusers loads the files (unloaded after each use)."""
    return load_pipeline(model.name)


@pytest.fixture(scope="module")
def sd2(tmp_path_factory):
    """(model, reference, a LoRA folder) for the checks that one family shows as well as five."""
    return load_pipeline("tiny-sd2-inpaint"), load_pipeline("tiny-sd2-inpaint"), tmp_path_factory.mktemp("sd2")


def diffusers_factors(reference, path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """What PEFT holds after diffusers' `load_lora_weights(path)`: per wrapped module, A, B and scaling."""
    with quiet_libraries():
        reference.pipe.load_lora_weights(str(path), adapter_name=REFERENCE_ADAPTER)
    try:
        return {module_path: (layer.lora_A[REFERENCE_ADAPTER].weight.detach().clone(),
                              layer.lora_B[REFERENCE_ADAPTER].weight.detach().clone(),
                              layer.scaling[REFERENCE_ADAPTER])
                for module_path, layer in denoiser_of(reference).named_modules()
                if isinstance(layer, BaseTunerLayer)}
    finally:
        reference.pipe.unload_lora_weights()


def assert_same_as_diffusers(weights: LoraWeights, expected: dict) -> None:
    assert list(weights.modules) == list(expected)  # same modules, in named_modules() order
    for module_path, (A, B, scaling) in expected.items():
        module = weights.modules[module_path]
        assert torch.equal(module.A, A) and torch.equal(module.B, B), module_path
        assert module.scaling == pytest.approx(scaling, rel=1e-12), module_path


def denoiser_output(model) -> torch.Tensor:
    """One forward of the denoiser on fixed random inputs."""
    denoiser = denoiser_of(model)
    if model.family in FLUX_FAMILIES:
        inputs = random_flux_inputs(denoiser, batch=1, grid=(8, 8), num_text=8, seed=0)
    elif model.family == "sd3":
        inputs = random_sd3_inputs(denoiser, batch=1, grid=(8, 8), num_text=8, seed=0)
    else:
        inputs = {**random_unet_inputs(denoiser, batch=1, image_size=(64, 64), num_text=8, seed=0),
                  "return_dict": False}
    with torch.no_grad():
        return denoiser(**inputs)[0]


@pytest.fixture(scope="module")
def fused(model, tmp_path_factory):
    """(LoRA file, its LoraWeights, a third pipeline with the file loaded and fused by diffusers)."""
    path = save_random_lora(model, tmp_path_factory.mktemp("fused"), rank=RANK, alpha=ALPHA)
    weights = read_lora(path, "fused", model.pipe)
    pipeline = load_pipeline(model.name)
    with quiet_libraries():
        pipeline.pipe.load_lora_weights(str(path), adapter_name="x")
        pipeline.pipe.fuse_lora(components=[DENOISER_COMPONENT[model.family]], lora_scale=FUSE_SCALE)
    return path, weights, pipeline


def test_fused_weights_match_diffusers(model, fused):
    _, weights, pipeline = fused
    assert {m.scaling for m in weights.modules.values()} == {ALPHA / RANK}
    base = dict(denoiser_of(model).named_modules())
    wrapped = {p: layer for p, layer in denoiser_of(pipeline).named_modules() if isinstance(layer, BaseTunerLayer)}
    assert set(wrapped) == set(weights.modules)
    for module_path, module in weights.modules.items():
        assert module.A.dtype == torch.float32 and module.A.device.type == "cpu"
        expected = base[module_path].weight + (module.B @ module.A) * (module.scaling * FUSE_SCALE)
        atol = ULPS * torch.finfo(torch.float32).eps * expected.abs().max().item()
        torch.testing.assert_close(wrapped[module_path].get_base_layer().weight, expected, rtol=0, atol=atol)


def test_random_lora_visibly_changes_the_denoiser_output(model, fused):
    _, _, pipeline = fused
    base, adapted = denoiser_output(model), denoiser_output(pipeline)
    assert torch.isfinite(adapted).all()
    # The default LoRA moves the output by 7-33 % (at FUSE_SCALE); fp32 rounding alone by ~1e-7.
    assert (adapted - base).norm() > 0.02 * base.norm()


def test_factors_match_diffusers(model, reference, fused):
    path, weights, _ = fused
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


def test_random_lora_leaves_the_model_as_it_was(model, tmp_path):
    denoiser = denoiser_of(model)
    before = {key: value.clone() for key, value in denoiser.state_dict().items()}
    types = [(p, type(m)) for p, m in denoiser.named_modules()]
    trainable = [p.requires_grad for p in denoiser.parameters()]
    save_random_lora(model, tmp_path, rank=RANK, alpha=ALPHA)
    assert [(p, type(m)) for p, m in denoiser.named_modules()] == types
    assert [p.requires_grad for p in denoiser.parameters()] == trainable
    assert not getattr(denoiser, "_hf_peft_config_loaded", False)
    assert all(torch.equal(value, before[key]) for key, value in denoiser.state_dict().items())


def test_rank_equal_to_alpha_writes_no_metadata_and_scales_by_one(sd2):
    model, reference, folder = sd2
    path = save_random_lora(model, folder / "plain", rank=8)
    assert "lora_adapter_metadata" not in _file_metadata(path)
    weights = read_lora(path, "plain", model.pipe)
    assert {m.scaling for m in weights.modules.values()} == {1.0}
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


def test_rslora_metadata_scales_by_the_root_of_the_rank(sd2):
    model, reference, folder = sd2
    tensors, metadata = _read(save_random_lora(model, folder / "rs-source", rank=RANK, alpha=ALPHA))
    adapter = json.loads(metadata["lora_adapter_metadata"])
    adapter["unet.use_rslora"] = True
    path = _write(folder / "rslora.safetensors", tensors, {**metadata, "lora_adapter_metadata": json.dumps(adapter)})
    weights = read_lora(path, "rslora", model.pipe)
    assert {m.scaling for m in weights.modules.values()} == {ALPHA / math.sqrt(RANK)}
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


def test_mixed_ranks_without_metadata_match_diffusers(sd2):
    """diffusers infers a rank_pattern from the B shapes (and, without alphas, alpha = rank per module)."""
    model, reference, folder = sd2
    wide = save_random_lora(model, folder / "wide", rank=8, targets=["to_q", "to_k"])
    narrow = save_random_lora(model, folder / "narrow", rank=2, targets=["to_v"], seed=1)
    path = _write(folder / "mixed.safetensors", {**load_file(wide), **load_file(narrow)})
    weights = read_lora(path, "mixed", model.pipe)
    assert {m.rank for m in weights.modules.values()} == {8, 2}
    assert {m.scaling for m in weights.modules.values()} == {1.0}
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


@pytest.fixture(scope="module", params=["tiny-sdxl-inpaint", "tiny-sd2-inpaint"])
def unet_models(request):
    return load_pipeline(request.param), load_pipeline(request.param)


def test_kohya_file_reads_through_diffusers_converter(unet_models, tmp_path):
    model, reference = unet_models
    path, deltas = save_kohya_lora(model, tmp_path, rank=RANK, alpha=ALPHA)
    weights = read_lora(path, "kohya", model.pipe)
    assert list(weights.modules) == list(deltas)
    for module_path, module in weights.modules.items():
        assert module.scaling == ALPHA / RANK
        # The same fp32 product as the reference, scaled in another order: a few ulp.
        torch.testing.assert_close(module.scaling * (module.B @ module.A), deltas[module_path], rtol=1e-6, atol=1e-7)
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


@pytest.mark.filterwarnings("ignore:The following alpha_pattern keys did not match:RuntimeWarning")  # PEFT's
def test_kohya_per_module_alphas_are_ignored_as_diffusers_ignores_them(unet_models, tmp_path, caplog):
    """diffusers 0.42.1 names kohya's alphas after the old attention processors, so PEFT matches none of
    them and gives every module the most common alpha; retouch reads what diffusers applies, and warns."""
    model, reference = unet_models
    path, deltas = save_kohya_lora(model, tmp_path, rank=RANK, alpha=ALPHA)
    tensors = load_file(path)
    odd = next(key for key in tensors if key.endswith(".alpha"))
    path = _write(path, {**tensors, odd: torch.tensor(2.0)})
    weights = read_lora(path, "kohya", model.pipe)
    assert {m.scaling for m in weights.modules.values()} == {ALPHA / RANK}
    assert "ignores the per-module alphas of 1 modules" in caplog.text
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


def test_flux_pads_an_adapter_for_a_narrower_x_embedder_as_diffusers_does(tmp_path):
    """A FLUX.1-dev LoRA on x_embedder read for FLUX.1-Fill, whose x_embedder also takes the mask latents."""
    inpaint, fill, reference = (load_pipeline(n) for n in ("tiny-flux-inpaint", "tiny-flux-fill", "tiny-flux-fill"))
    path = save_random_lora(inpaint, tmp_path, targets=["x_embedder", "transformer_blocks.0.attn.to_q"])
    weights = read_lora(path, "dev-lora", fill.pipe)
    narrow = denoiser_of(inpaint).x_embedder.in_features
    assert weights.modules["x_embedder"].A.shape[1] == denoiser_of(fill).x_embedder.in_features > narrow
    assert not weights.modules["x_embedder"].A[:, narrow:].any()
    assert_same_as_diffusers(weights, diffusers_factors(reference, path))


def kohya_flux_tensors(model, extra: dict | None = None) -> dict[str, torch.Tensor]:
    """A kohya-ss Flux LoRA for the tiny model: every double block's image attention output and every single
    block's linear2, with alphas, plus `extra` entries."""
    denoiser = denoiser_of(model)
    generator = torch.Generator().manual_seed(3)

    def pair(name: str, linear: torch.nn.Linear) -> dict:
        return {f"{name}.lora_down.weight": torch.randn(RANK, linear.in_features, generator=generator),
                f"{name}.lora_up.weight": torch.randn(linear.out_features, RANK, generator=generator) * 0.01,
                f"{name}.alpha": torch.tensor(ALPHA)}
    tensors = {}
    for i, block in enumerate(denoiser.transformer_blocks):
        tensors |= pair(f"lora_unet_double_blocks_{i}_img_attn_proj", block.attn.to_out[0])
    for i, block in enumerate(denoiser.single_transformer_blocks):
        tensors |= pair(f"lora_unet_single_blocks_{i}_linear2", block.proj_out)
    return tensors | (extra or {})


def _kohya_pair(name: str, rows: int, columns: int, value: float) -> dict:
    return {f"{name}.lora_down.weight": torch.full((RANK, columns), value),
            f"{name}.lora_up.weight": torch.full((rows, RANK), value)}


@pytest.mark.parametrize("extra, fragment", [
    (lambda d: _kohya_pair("lora_unet_img_in", d.inner_dim, d.x_embedder.in_features, 0.1),
     "has x_embedder.lora_A.weight, a layer of this transformer that diffusers' converter leaves without its "
     "'transformer.' prefix"),
    (lambda d: {"lora_unet_double_blocks_0_img_attn_proj.diff_b": torch.full((d.inner_dim,), 0.1)},
     "adapts biases (lora_unet_double_blocks_0_img_attn_proj.diff_b), which diffusers' converter drops"),
    (lambda d: _kohya_pair("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q", 8, 8, 0.1),
     "adapts the T5 text encoder (text_encoders.t5xxl."),
    (lambda d: _kohya_pair("lora_te3_encoder_block_0_layer_0_SelfAttention_q", 8, 8, 0.1),  # sd-scripts' own names
     "adapts the T5 text encoder (lora_te3_encoder"),
], ids=["img_in", "diff_b", "t5", "t5-sd-scripts"])
def test_a_kohya_flux_file_diffusers_would_apply_in_part_is_refused_whole(extra, fragment, tmp_path):
    """diffusers' Flux converter drops T5 entries and bias deltas (logging at INFO), and leaves img_in, txt_in,
    ... and final_layer without the prefix its loader looks for, applying the rest of such a file without a
    word: retouch refuses it, naming the entry."""
    model = load_pipeline("tiny-flux-fill")
    path = tmp_path / "broken.safetensors"
    save_file(kohya_flux_tensors(model, extra(denoiser_of(model))), path)
    _check_refused(model, path, fragment)


def test_entries_the_flux_converter_drops_pass_when_they_change_nothing(tmp_path):
    """Trainers write all-zero bias deltas and T5 factors; diffusers drops them quietly, and so they pass."""
    model = load_pipeline("tiny-flux-fill")
    denoiser = denoiser_of(model)
    zeros = {"lora_unet_double_blocks_0_img_attn_proj.diff_b": torch.zeros(denoiser.inner_dim),
             **_kohya_pair("text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q", 8, 8, 0.0)}
    save_file(kohya_flux_tensors(model, zeros), tmp_path / "zeros.safetensors")
    save_file(kohya_flux_tensors(model), tmp_path / "plain.safetensors")
    with_zeros = read_lora(tmp_path / "zeros.safetensors", "zeros", model.pipe)
    plain = read_lora(tmp_path / "plain.safetensors", "plain", model.pipe)
    assert list(with_zeros.modules) == list(plain.modules) and with_zeros.digest == plain.digest
    assert len(plain.modules) == len(denoiser.transformer_blocks) + len(denoiser.single_transformer_blocks)


def test_a_converter_stopping_without_a_message_is_said_in_words(tmp_path):
    """kohya's Flux linear1 split assumes FLUX.1's widths: on other widths the converter stops on a bare
    AssertionError, which alone says nothing to the user."""
    model = load_pipeline("tiny-flux-fill")
    denoiser = denoiser_of(model)
    linear1 = {}
    for i in range(len(denoiser.single_transformer_blocks)):
        linear1 |= _kohya_pair(f"lora_unet_single_blocks_{i}_linear1", 3 * denoiser.inner_dim + 4 * denoiser.inner_dim,
                               denoiser.inner_dim, 0.1)
    save_file(kohya_flux_tensors(model, linear1), tmp_path / "broken.safetensors")
    _check_refused(model, tmp_path / "broken.safetensors",
                   "is not a LoRA diffusers can read for flux-fill: its converter stopped on an AssertionError "
                   "(layer shapes of another model")


def test_a_rank_above_the_layer_widths_works(sd2):
    """Benchmarks save rank-512 adapters; on the tiny models that exceeds every width, which PEFT allows."""
    model, _, folder = sd2
    weights = read_lora(save_random_lora(model, folder / "big", rank=512, alpha=16), "big", model.pipe)
    assert weights.max_rank == 512 and {m.scaling for m in weights.modules.values()} == {16 / 512}


def test_weights_convert_and_report_their_size(sd2):
    model, _, folder = sd2
    weights = read_lora(save_random_lora(model, folder / "size"), "size", model.pipe, dtype=torch.bfloat16)
    assert all(m.A.dtype == m.B.dtype == torch.bfloat16 for m in weights.modules.values())
    assert weights.nbytes == 2 * sum(m.A.numel() + m.B.numel() for m in weights.modules.values())
    assert weights.max_rank == RANK and all(m.rank == RANK for m in weights.modules.values())
    converted = weights.to(dtype=torch.float32)
    assert converted is not weights and converted.nbytes == 2 * weights.nbytes and converted.name == "size"
    assert all(converted.modules[p].scaling == m.scaling for p, m in weights.modules.items())
    pinned = read_lora(folder / "size" / "pytorch_lora_weights.safetensors", "size", model.pipe, torch.bfloat16,
                       pin=True)
    assert all(m.A.is_pinned() == m.B.is_pinned() == torch.cuda.is_available() for m in pinned.modules.values())
    assert all(torch.equal(pinned.modules[p].A, m.A) and torch.equal(pinned.modules[p].B, m.B)
               for p, m in weights.modules.items())


def test_a_digest_names_a_file_whatever_the_dtype_it_is_read_in(sd2):
    """Workers compare their files of one name by digest (the router warns when two differ): the same file
    (copied to another host, read in another dtype, converted, or moved to the device) has one digest,
    and another training of the same shapes or another alpha has another."""
    import shutil

    model, _, folder = sd2
    path = save_random_lora(model, folder / "digest", seed=1)
    copy = folder / "digest-copy.safetensors"
    shutil.copy(path, copy)
    weights = read_lora(path, "digest", model.pipe)
    same = {read_lora(copy, "digest", model.pipe, dtype=torch.bfloat16).digest, weights.to(dtype=torch.float16).digest}
    assert len(weights.digest) == 16 and same == {weights.digest}
    other_seed = save_random_lora(model, folder / "other-seed", seed=2)
    other_alpha = save_random_lora(model, folder / "other-alpha", seed=1, alpha=2 * RANK)
    others = {read_lora(other_seed, "x", model.pipe).digest, read_lora(other_alpha, "x", model.pipe).digest}
    assert weights.digest not in others and len(others) == 2


def test_weights_do_not_change_when_their_file_is_overwritten(sd2):
    """A file the operator overwrites in place (`cp` over it) leaves what was read as it was: the weights
    are not a mapping of the file (which would also SIGBUS once the file is truncated)."""
    model, _, folder = sd2
    path = save_random_lora(model, folder / "overwritten")
    weights = read_lora(path, "overwritten", model.pipe)
    before = {p: (m.A.clone(), m.B.clone()) for p, m in weights.modules.items()}
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    with open(path, "r+b") as file:  # same length: no truncation, so a mapping would show the new bytes
        file.seek(header)
        file.write(bytes(len(data) - header))
    assert all(torch.equal(m.A, before[p][0]) and torch.equal(m.B, before[p][1]) for p, m in weights.modules.items())


def test_reading_leaves_the_pipeline_without_adapters(sd2):
    model, _, folder = sd2
    read_lora(save_random_lora(model, folder / "untouched"), "untouched", model)  # a LoadedModel is accepted too
    assert not any(isinstance(m, BaseTunerLayer) for m in denoiser_of(model).modules())


# Broken files: a good SD 2 file (rank 4, no metadata) edited with safetensors.
@pytest.fixture(scope="module")
def good(sd2):
    model, _, folder = sd2
    tensors = load_file(save_random_lora(model, folder / "good"))
    return model, tensors, sorted({key.rsplit(".lora_", 1)[0] for key in tensors})


def _without(tensors: dict, module: str) -> dict:
    return {key: value for key, value in tensors.items() if not key.startswith(f"{module}.")}


def _with_factors(tensors: dict, module: str, A: torch.Tensor, B: torch.Tensor) -> dict:
    return {**_without(tensors, module), f"{module}.lora_A.weight": A, f"{module}.lora_B.weight": B}


def _edited(tensors: dict, key: str, change) -> dict:
    value = tensors[key].clone()
    change(value)
    return {**tensors, key: value}


BROKEN = {
    "T5 encoder": (lambda t, m: {**t, "text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight":
                                 torch.ones(4, 32), "text_encoder_3.encoder.block.0.layer.0.SelfAttention.q"
                                 ".lora_B.weight": torch.ones(32, 4)},
                   "text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight, which is not a weight"),
    "no denoiser keys": (lambda t, m: {}, "no LoRA weights for the unet"),
    "another model's denoiser": (lambda t, m: {k.replace("unet.", "transformer.", 1): v for k, v in t.items()},
                                 "not a weight of this model's unet"),
    "missing module": (lambda t, m: {k.replace(m[0], "unet.down_blocks.7.attentions.0.proj_in"): v
                                     for k, v in t.items()},
                       "down_blocks.7.attentions.0.proj_in, which this UNet2DConditionModel does not have, though its "
                       "other"),
    "no module fits": (lambda t, m: {k.replace("unet.", "unet.nowhere_", 1): v for k, v in t.items()},
                       "does not have (an adapter for another model?)"),
    "conv target": (lambda t, m: {**t, "unet.conv_in.lora_A.weight": torch.zeros(4, 9, 3, 3),
                                  "unet.conv_in.lora_B.weight": torch.zeros(32, 4, 1, 1)},
                    "conv_in, a Conv2d; retouch applies LoRA to linear layers only"),
    "wrong in features": (lambda t, m: _edited_shape(t, m[0], in_delta=1), "features but the layer maps"),
    "ranks disagree": (lambda t, m: _with_factors(t, m[0], t[f"{m[0]}.lora_A.weight"],
                                                  t[f"{m[0]}.lora_B.weight"][:, :3]),
                       "lora_A of rank 4 but lora_B of rank 3"),
    "rank 0": (lambda t, m: _with_factors(t, m[0], t[f"{m[0]}.lora_A.weight"][:0], t[f"{m[0]}.lora_B.weight"][:, :0]),
               "has rank 0"),
    "A without B": (lambda t, m: {k: v for k, v in t.items() if k != f"{m[0]}.lora_B.weight"}, "no lora_B for"),
    "DoRA magnitude": (lambda t, m: {**t, f"{m[0]}.lora_magnitude_vector": torch.ones(32)}, "DoRA adapter"),
    "kohya DoRA scale": (lambda t, m: {**t, "lora_unet_conv_in.dora_scale": torch.ones(1)}, "DoRA adapter"),
    "LoRA bias": (lambda t, m: {**t, f"{m[0]}.lora_B.bias": torch.zeros(32)}, "LoRA bias"),
    "NaN": (lambda t, m: _edited(t, f"{m[0]}.lora_A.weight", lambda v: v.view(-1)[3].fill_(float("nan"))),
            "lora_A has NaN or infinite values"),
    "infinity": (lambda t, m: _edited(t, f"{m[1]}.lora_B.weight", lambda v: v.view(-1)[0].fill_(float("inf"))),
                 "lora_B has NaN or infinite values"),
    "integer factor": (lambda t, m: _with_factors(t, m[0], t[f"{m[0]}.lora_A.weight"].to(torch.int32),
                                                  t[f"{m[0]}.lora_B.weight"]),
                       "has a factor of dtype int32; LoRA factors are floating point"),
    "not a LoRA entry": (lambda t, m: {**t, "unet.conv_in.weight": torch.zeros(32, 9, 3, 3)},
                         "not a LoRA A or B weight: conv_in.weight"),
}


SPECIAL_VALUES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38, -3e38, 65504.0, 1e6]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       size=st.sampled_from([0, 1, 7, (1 << 20) - 1, (1 << 20) + 5]),
       specials=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.sampled_from(SPECIAL_VALUES)), max_size=3))
def test_all_finite_agrees_with_torch(dtype, size, specials):
    """The loader's single-threaded copy and check say what torch.isfinite(t).all() says, at any chunk position
    (the chunk is 1M values), for the dtypes adapter files hold; values that overflow fp16 become inf."""
    values = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    for where, value in specials if size else ():
        values[int(where * size)] = value
    assert all_finite(values) == bool(torch.isfinite(values).all())
    assert all_finite(values.view(1, -1) if size else values) == all_finite(values)
    copy = torch.full_like(values, 7)
    assert copy_all_finite(values, copy) == all_finite(values)
    assert torch.equal(copy.view(torch.uint8), values.view(torch.uint8))  # bit for bit, NaN payloads too


def _edited_shape(tensors: dict, module: str, in_delta: int) -> dict:
    A, B = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
    return _with_factors(tensors, module, torch.zeros(A.shape[0], A.shape[1] + in_delta), B)


def _check_refused(model, path, fragment: str, dtype=None) -> str:
    with pytest.raises(LoraError) as raised:
        read_lora(path, "broken", model.pipe, dtype=dtype)
    message = str(raised.value)
    assert fragment in message and "broken" in message and "\n" not in message, message
    assert str(Path(path).parent) not in message  # it reaches HTTP clients: no server folders
    return message


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_file_gives_one_line_naming_the_problem(good, case, tmp_path):
    model, tensors, modules = good
    edit_tensors, fragment = BROKEN[case]
    path = _write(tmp_path / "broken.safetensors", edit_tensors(dict(tensors), modules))
    _check_refused(model, path, fragment)


def test_unreadable_files_are_refused(good, tmp_path):
    model, tensors, _ = good
    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    _check_refused(model, tmp_path / "text.safetensors", "not a readable safetensors file")
    truncated = _write(tmp_path / "truncated.safetensors", tensors)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    _check_refused(model, truncated, "not a readable safetensors file")
    _check_refused(model, tmp_path / "absent.safetensors", "does not exist")


def test_values_that_overflow_the_dtype_are_refused(good, tmp_path):
    model, tensors, modules = good
    huge = _edited(tensors, f"{modules[0]}.lora_A.weight", lambda v: v.view(-1)[0].fill_(1e6))
    path = _write(tmp_path / "huge.safetensors", huge)
    _check_refused(model, path, "too large for torch.float16", dtype=torch.float16)
    assert read_lora(path, "huge", model.pipe).modules[modules[0].removeprefix("unet.")].A.abs().max() == 1e6


BROKEN_METADATA = {
    "rank": ({"unet.r": 8}, "has rank 4 but the file's adapter metadata says 8"),
    "alpha": ({"unet.lora_alpha": "eight"}, "has lora_alpha 'eight' in the file's adapter metadata"),
    "unknown field": ({"unet.no_such_field": 1}, "has adapter metadata PEFT cannot use (its fields: "),
    "DoRA": ({"unet.use_dora": True}, "its metadata says use_dora"),
    "bias": ({"unet.lora_bias": True}, "its metadata says lora_bias"),
    "targets": ({"unet.target_modules": ["to_q"]}, "but its adapter metadata does not target it"),
}


@pytest.mark.parametrize("case", list(BROKEN_METADATA))
def test_metadata_that_contradicts_the_file_is_refused(sd2, case, tmp_path):
    model, _, folder = sd2
    tensors, metadata = _read(save_random_lora(model, folder / f"metadata-{case}", rank=RANK, alpha=ALPHA))
    change, fragment = BROKEN_METADATA[case]
    adapter = {**json.loads(metadata["lora_adapter_metadata"]), **change}
    path = _write(tmp_path / "broken.safetensors", tensors, {**metadata, "lora_adapter_metadata": json.dumps(adapter)})
    _check_refused(model, path, fragment)


def test_an_sd3_file_is_refused_by_flux(tmp_path):
    sd3, flux = load_pipeline("tiny-sd3-inpaint"), load_pipeline("tiny-flux-inpaint")
    path = save_random_lora(sd3, tmp_path, targets=["transformer_blocks.1.attn.to_q"])
    _check_refused(flux, path, "which this FluxTransformer2DModel does not have")


def test_a_kohya_unet_file_refused_by_flux_names_its_first_incompatible_keys(sd2, tmp_path):
    """diffusers' Flux converter lists every key it cannot convert after a blank line; the one-line message
    keeps the first few (it once kept the text before the line break: an empty list)."""
    model, _, _ = sd2
    path, _ = save_kohya_lora(model, tmp_path / "loras")
    message = _check_refused(load_pipeline("tiny-flux-fill"), path, "Incompatible keys detected: lora_unet_")
    keys = sorted(key for key in load_file(path))
    listed = message.split("Incompatible keys detected: ", 1)[1]
    assert listed.startswith(", ".join(keys[:3])) and f"({len(keys) - 3} more)" in listed
    assert len(message) < 600 and str(tmp_path) not in message


@pytest.mark.parametrize("layout", ["NAME.safetensors", "NAME/" + FOLDER_WEIGHT_NAME])
def test_a_quoted_error_names_no_server_path(tmp_path, layout):
    """What a library says about a file may carry its path; the LoraError quoting it, which reaches HTTP
    clients, says which file in words."""
    path = tmp_path / "loras" / layout.replace("NAME", "style")
    error = OSError(f"[Errno 13] Permission denied: '{path}' (in {path.parent}, under {tmp_path / 'loras'})")
    message = _one_line(error, path)
    assert str(tmp_path) not in message and "Permission denied: 'the adapter's file'" in message


# --lora-dir lookups.
def test_lora_path_finds_both_layouts_and_prefers_the_file(tmp_path):
    (tmp_path / "plain.safetensors").write_bytes(b"")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    assert lora_path(tmp_path, "plain") == tmp_path / "plain.safetensors"
    assert lora_path(str(tmp_path), "saved") == tmp_path / "saved" / "pytorch_lora_weights.safetensors"
    (tmp_path / "saved.safetensors").write_bytes(b"")
    assert lora_path(tmp_path, "saved") == tmp_path / "saved.safetensors"


@pytest.mark.parametrize("name", ["../x", "x/y", "..", ".hidden", "", "a" * 129, "/etc/passwd", None])
def test_lora_path_refuses_names_that_could_leave_the_folder(name, tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"")
    with pytest.raises(LoraError, match="must be 1-128 letters") as raised:
        lora_path(tmp_path / "loras", name)
    assert repr(name) in str(raised.value)


def test_lora_path_names_what_is_missing_but_not_the_folder(tmp_path):
    """Its messages reach HTTP clients (a worker answers 422 with them), who must not learn the server's
    folders: they name the adapter and the layouts looked for."""
    messages = []
    for folder, name, fragment in ((tmp_path, "absent", "no LoRA 'absent' in the LoRA folder: expected "
                                    "absent.safetensors or absent/pytorch_lora_weights.safetensors"),
                                   (tmp_path, "style.safetensors", "name it without .safetensors"),
                                   (tmp_path, "empty", "no LoRA 'empty'"),
                                   (tmp_path, "pickled", "; the folder has pickled.ckpt, a pickle file, which retouch "
                                    "does not read: convert it to safetensors"),
                                   (tmp_path / "nowhere", "absent", "the LoRA folder (--lora-dir) does not exist"),
                                   (tmp_path, "../up", "must be 1-128 letters")):
        (tmp_path / "empty").mkdir(exist_ok=True)  # a folder without the weights file is no LoRA
        (tmp_path / "pickled.ckpt").write_bytes(b"never unpickled")
        with pytest.raises(LoraError) as raised:
            lora_path(folder, name)
        messages.append(str(raised.value))
        assert fragment in messages[-1]
    with pytest.raises(LoraError) as raised:
        list_loras(tmp_path / "nowhere")
    messages.append(str(raised.value))
    assert not [message for message in messages if str(tmp_path) in message]


def test_file_identity_changes_when_the_file_is_replaced(tmp_path):
    """What a lookup compares with its loaded copy: a copy over the file, an atomic rename over it, the
    other layout winning, and no file at all."""
    path = tmp_path / "style.safetensors"
    path.write_bytes(b"one")
    first = file_identity(tmp_path, "style")
    assert first[0] == str(path) and file_identity(tmp_path, "style") == first
    os.utime(path, ns=(1, 1))
    touched = file_identity(tmp_path, "style")
    assert touched != first
    path.write_bytes(b"twenty")  # cp over it, its mtime kept (cp -p): same inode, another size
    os.utime(path, ns=(1, 1))
    assert file_identity(tmp_path, "style") != touched
    rewritten = file_identity(tmp_path, "style")
    (tmp_path / "new").write_bytes(b"twenty")
    os.utime(tmp_path / "new", ns=(1, 1))
    os.replace(tmp_path / "new", path)  # mv: same size and mtime, another inode
    assert file_identity(tmp_path, "style") != rewritten
    path.unlink()
    assert file_identity(tmp_path, "style") == ()
    (tmp_path / "style").mkdir()
    (tmp_path / "style" / "pytorch_lora_weights.safetensors").write_bytes(b"three")
    assert file_identity(tmp_path, "style")[0] == str(tmp_path / "style" / "pytorch_lora_weights.safetensors")


# The lora field's syntax (retouch.lora.spec).
SCALES = {"1": 1.0, "0.8": 0.8, "-0.5": -0.5, "+2": 2.0, ".5": 0.5, "3.": 3.0, " 0.25 ": 0.25, "16": 16.0}
NOT_SCALES = ["1_0", "1e-1", "1E1", "inf", "-inf", "nan", "0x10", "\u0661", "", ".", "-", "1.2.3", "1 0", "½"]


@pytest.mark.parametrize("text", list(SCALES))
def test_a_scale_is_a_plain_decimal(text):
    assert parse_lora(f"style:{text}") == (LoraUse("style", SCALES[text]),)


@pytest.mark.parametrize("text", NOT_SCALES)
def test_other_spellings_of_numbers_are_not_scales(text):
    """float() reads "1_0" as 10 and takes exponents, inf, nan and non-ASCII digits: none is a scale here (an
    exponent only hides a typo within [-16, 16]). A JSON number is JSON's: {"scale": 1e-1} is 0.1."""
    with pytest.raises(LoraError, match="lora scale of 'style' must be a number"):
        parse_lora(f"style:{text}")
    assert parse_lora([{"name": "style", "scale": 1e-1}]) == (LoraUse("style", 0.1),)


def test_list_loras_lists_both_layouts(tmp_path):
    for name in ("b.safetensors", "a.v2.safetensors", ".hidden.safetensors", "notes.txt", "c.bin"):
        (tmp_path / name).write_bytes(b"")
    for folder, weights in (("saved", "pytorch_lora_weights.safetensors"), ("other", "model.safetensors")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / weights).write_bytes(b"")
    assert list_loras(tmp_path) == ["a.v2", "b", "saved"]
    assert all(lora_path(tmp_path, name) for name in list_loras(tmp_path))
    with pytest.raises(LoraError, match="does not exist"):
        list_loras(tmp_path / "nowhere")


def test_lora_module_rank_is_the_inner_dimension():
    module = LoraModule(torch.zeros(3, 10), torch.zeros(7, 3), 0.5)
    assert module.rank == 3
    assert LoraWeights("empty", {}).max_rank == 0


def _read(path) -> tuple[dict, dict]:
    return load_file(path), _file_metadata(path)


def _file_metadata(path) -> dict:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}


def _write(path, tensors: dict, metadata: dict | None = None):
    save_file({key: value.contiguous() for key, value in tensors.items()}, path, metadata=metadata)
    return path
