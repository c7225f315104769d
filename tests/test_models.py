"""Built-in models: build, export, load back through from_pretrained, and run an edit.

Everything runs on a CPU from files made here; HF_HUB_OFFLINE makes any download attempt fail.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported, which reads it once

import json
import shutil

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

import retouch.models as models
from retouch.errors import ModelError
from retouch.models import export
from retouch.models.tokenizers import CLIP_MAX_LENGTH, build_clip_tokenizer, build_t5_tokenizer

TINY_NAMES = [spec.name for spec in models.list_models() if spec.kind == "tiny"]
BENCH_NAMES = [spec.name for spec in models.list_models() if spec.kind == "bench"]
EDIT_SIZE = 128
EDIT_STEPS = 4

# Denoiser parameter counts of the published checkpoints. Base-model counts are the safetensors
# totals reported for the Hugging Face repos (FLUX.1-dev transformer 11,901,408,320; SDXL base UNet
# 2,567,463,684; SD 2 UNet 865,910,724). The inpainting variants differ only in their input layer:
# FLUX.1-Fill-dev's x_embedder takes 384 channels instead of 64 (+320 x 3072), and the SDXL / SD 2
# inpainting UNets' conv_in takes 9 channels instead of 4 (+5 x 320 x 3 x 3).
PUBLISHED_DENOISER_PARAMETERS = {
    "flux-size": 11_902_391_360,  # FLUX.1-Fill-dev transformer
    "sd3-size": 2_028_328_000,  # stable-diffusion-3-medium transformer
    "sdxl-size": 2_567_478_084,  # stable-diffusion-xl-1.0-inpainting-0.1 UNet
    "sd2-size": 865_925_124,  # stable-diffusion-2-inpainting UNet
}

PROMPTS = [
    "a photo of a cat",
    "a photo of a dog",
    "",
    "Zebra crossing, café über 4k!!",
    "replace the sky with a dramatic sunset over the mountains",
    " ".join(["mountains"] * 200),  # longer than CLIP's 77 positions
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private export cache for this module, so tests never read or fill ~/.cache."""
    directory = tmp_path_factory.mktemp("retouch-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(export.CACHE_DIR_VARIABLE, str(directory))
        yield directory


@pytest.fixture(scope="module", params=TINY_NAMES)
def tiny(request, cache_dir):
    """(spec, in-memory pipeline, pipeline loaded back from the exported folder) for one tiny model."""
    spec = models.get_spec(request.param)
    return spec, models.build_pipeline(spec.name), models.load_pipeline(spec.name)


def _white_square_edit(seed: int) -> dict:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (EDIT_SIZE, EDIT_SIZE, 3), dtype=np.uint8))
    mask = Image.new("L", (EDIT_SIZE, EDIT_SIZE), 0)
    mask.paste(255, (EDIT_SIZE // 4, EDIT_SIZE // 4, 3 * EDIT_SIZE // 4, 3 * EDIT_SIZE // 4))
    return {
        "prompt": "a photo of a cat",
        "image": image,
        "mask_image": mask,
        "height": EDIT_SIZE,
        "width": EDIT_SIZE,
        "num_inference_steps": EDIT_STEPS,
        "strength": 1.0,  # every family then runs all EDIT_STEPS steps
        "generator": torch.Generator().manual_seed(seed),
    }


def _module_components(pipe) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


# --- tiny models: round trip and edit --------------------------------------------------------------


def test_tiny_model_loads_back_with_identical_weights(tiny, cache_dir):
    spec, built, loaded = tiny
    assert type(loaded.pipe).__name__ == spec.pipeline_class
    assert (loaded.name, loaded.family, loaded.call_defaults) == (spec.name, spec.family, spec.call_defaults)
    assert models.family_of_pipeline(loaded.pipe) == spec.family
    assert loaded.source.parent == cache_dir and (loaded.source / "model_index.json").is_file()
    built_modules, loaded_modules = _module_components(built), _module_components(loaded.pipe)
    assert spec.denoiser_component in built_modules and built_modules.keys() == loaded_modules.keys()
    for component, module in built_modules.items():
        expected, actual = module.state_dict(), loaded_modules[component].state_dict()
        assert expected.keys() == actual.keys(), component
        for key, tensor in expected.items():
            assert actual[key].dtype == torch.float32, f"{component}.{key}"
            assert torch.equal(tensor, actual[key]), f"{component}.{key} changed in the save/load round trip"


def test_tiny_model_text_encoders_cover_their_tokenizers(tiny):
    spec, _, loaded = tiny
    for encoder in spec.text_encoders:
        tokenizer = getattr(loaded.pipe, encoder.tokenizer_component)
        text_encoder = getattr(loaded.pipe, encoder.component)
        assert text_encoder.get_input_embeddings().num_embeddings >= len(tokenizer), encoder.component
        assert text_encoder.config.eos_token_id == tokenizer.eos_token_id, encoder.component


def test_tiny_model_edit_is_seeded(tiny):
    spec, _, loaded = tiny
    denoiser = getattr(loaded.pipe, spec.denoiser_component)
    denoiser_calls = []
    hook = denoiser.register_forward_hook(lambda module, args, output: denoiser_calls.append(1))
    try:
        first = loaded.pipe(**_white_square_edit(seed=0), **loaded.call_defaults).images[0]
    finally:
        hook.remove()
    again = loaded.pipe(**_white_square_edit(seed=0), **loaded.call_defaults).images[0]
    other_seed = loaded.pipe(**_white_square_edit(seed=1), **loaded.call_defaults).images[0]
    # PNDM (the published SD 2 inpainting scheduler) repeats its first timestep to warm up PLMS.
    expected_calls = EDIT_STEPS + 1 if spec.scheduler_class == "PNDMScheduler" else EDIT_STEPS
    assert len(denoiser_calls) == expected_calls
    assert first.size == (EDIT_SIZE, EDIT_SIZE)
    assert np.array_equal(np.asarray(first), np.asarray(again))
    assert not np.array_equal(np.asarray(first), np.asarray(other_seed))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_build_denoiser_is_the_pipeline_denoiser(name):
    spec = models.get_spec(name)
    alone = models.build_denoiser(name).state_dict()
    in_pipeline = getattr(models.build_pipeline(name), spec.denoiser_component).state_dict()
    assert alone.keys() == in_pipeline.keys()
    assert all(torch.equal(alone[key], in_pipeline[key]) for key in alone)


def test_building_leaves_the_callers_rng_and_default_dtype_alone():
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    models.build_denoiser("tiny-sd3-inpaint", dtype=torch.bfloat16)
    assert torch.equal(torch.rand(4), expected)
    assert torch.get_default_dtype() == torch.float32


# --- export cache and folders ----------------------------------------------------------------------


def test_second_load_reuses_the_cached_export(cache_dir):
    first = models.load_pipeline("tiny-sd2-inpaint")
    written = (first.source / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    second = models.load_pipeline("tiny-sd2-inpaint")
    assert second.source == first.source
    assert (second.source / "unet" / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == written
    assert not [path.name for path in cache_dir.iterdir() if path.name.startswith(".")], "staging folder left behind"


def test_export_race_lost_to_another_process_keeps_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv(export.CACHE_DIR_VARIABLE, str(tmp_path))
    spec = models.get_spec("tiny-flux-inpaint")
    final = tmp_path / f"{spec.name}-{export.build_version(spec)}"
    real_export = export.export_pipeline

    def export_while_another_process_finishes_first(name, directory):
        real_export(name, final)  # the other process renames its finished export into place
        return real_export(name, directory)

    monkeypatch.setattr(export, "export_pipeline", export_while_another_process_finishes_first)
    assert export.cached_export(spec.name) == final
    assert sorted(path.name for path in tmp_path.iterdir()) == [final.name]


def test_an_interrupted_export_leaves_nothing_and_a_rerun_works(tmp_path, monkeypatch):
    """Ctrl-C during `retouch models export` left a folder of weights without model_index.json, which no
    loader read and which refused the rerun ("it exists and is not an empty folder")."""
    real_save = diffusers.DiffusionPipeline.save_pretrained

    def interrupted(self, folder, **options):
        real_save(self, folder, **options)
        raise KeyboardInterrupt
    monkeypatch.setattr(diffusers.DiffusionPipeline, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.export_pipeline("tiny-sd2-inpaint", tmp_path / "exported")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(diffusers.DiffusionPipeline, "save_pretrained", real_save)
    folder = models.export_pipeline("tiny-sd2-inpaint", tmp_path / "exported")
    assert (folder / "model_index.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    umask = os.umask(0)
    os.umask(umask)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask  # as a folder made by hand


def test_folder_without_manifest_takes_family_from_pipeline_class(tmp_path):
    folder = models.export_pipeline("tiny-sd2-inpaint", tmp_path / "my-inpainter")
    (folder / export.MANIFEST_NAME).unlink()
    loaded = models.load_pipeline(folder)
    assert (loaded.name, loaded.family, loaded.call_defaults, loaded.source) == ("my-inpainter", "sd2", {}, folder)


def test_a_manifest_family_that_contradicts_the_pipeline_class_is_refused(tmp_path):
    """The adapters follow the manifest's family and the weights the class: a mismatch would fail mid-edit."""
    folder = models.export_pipeline("tiny-sd2-inpaint", tmp_path / "mislabelled")
    manifest = json.loads((folder / export.MANIFEST_NAME).read_text())
    (folder / export.MANIFEST_NAME).write_text(json.dumps({**manifest, "family": "sdxl"}))
    with pytest.raises(ModelError, match="names family 'sdxl', but the folder holds a StableDiffusionInpaintPipeline"):
        models.load_pipeline(folder)


def test_loading_prints_nothing(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(export.CACHE_DIR_VARIABLE, str(tmp_path))  # a cache miss: build, save, load
    models.load_pipeline("tiny-sd3-inpaint")
    models.load_pipeline("tiny-sd3-inpaint")
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-flux-fill", "tiny-sdxl-inpaint"])
def test_a_pipeline_loaded_without_its_denoiser_keeps_every_other_component(name):
    """What a helper process loads: it stops every run at the first denoiser call, so the denoiser's weights
    never reach the device (on a GPU, a second copy of the transformer in the helper's process)."""
    model = models.load_pipeline(name, denoiser=False)
    denoiser = model.pipe.transformer if hasattr(model.pipe, "transformer") else model.pipe.unet
    assert {parameter.device.type for parameter in denoiser.parameters()} == {"meta"}
    others = [module for key, module in model.pipe.components.items()
              if isinstance(module, torch.nn.Module) and module is not denoiser]
    assert others and all(parameter.device.type == "cpu" for module in others for parameter in module.parameters())
    assert model.pipe.device.type == "cpu"


def test_unknown_name_lists_the_built_in_models():
    with pytest.raises(ModelError) as raised:
        models.get_spec("nope")
    message = str(raised.value)
    assert "nope" in message and "\n" not in message
    assert all(spec.name in message for spec in models.list_models())


def test_load_rejects_what_is_not_a_supported_pipeline_folder(tmp_path):
    with pytest.raises(ModelError, match="neither a built-in model"):
        models.load_pipeline("nope")
    with pytest.raises(ModelError, match="neither a built-in model"):
        models.load_pipeline(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not a pipeline")
    with pytest.raises(ModelError, match="no model_index.json"):
        models.load_pipeline(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ModelError, match="StableDiffusionPipeline") as raised:
        models.load_pipeline(tmp_path)
    assert "\n" not in str(raised.value)


def test_export_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(ModelError, match="not an empty folder"):
        models.export_pipeline("tiny-sd2-inpaint", tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["keep.txt"]


def test_family_of_pipeline_rejects_other_pipelines():
    class StableDiffusionPipeline:
        pass

    with pytest.raises(ModelError, match="StableDiffusionPipeline"):
        models.family_of_pipeline(StableDiffusionPipeline())


# --- tokenizers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("build_tokenizer", [build_clip_tokenizer, build_t5_tokenizer], ids=["clip", "t5"])
def test_tokenizer_separates_prompts_and_round_trips(build_tokenizer, tmp_path):
    tokenizer = build_tokenizer()
    ids = [tokenizer(prompt, truncation=True).input_ids for prompt in PROMPTS]
    assert len({tuple(prompt_ids) for prompt_ids in ids}) == len(PROMPTS)
    assert max(max(prompt_ids) for prompt_ids in ids) < len(tokenizer)
    corpus_prompt_ids = tokenizer(PROMPTS[4], add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in corpus_prompt_ids, "corpus words must not fall back to <unk>"
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(reloaded) is type(tokenizer)
    assert [reloaded(prompt, truncation=True).input_ids for prompt in PROMPTS] == ids
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab(), "the build must be deterministic"


def test_clip_tokenizer_pads_and_truncates_to_clip_positions():
    tokenizer = build_clip_tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer(prompt, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True).input_ids
        assert len(ids) == CLIP_MAX_LENGTH
        assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids


# --- bench specs and spec consistency --------------------------------------------------------------


def test_flux_small_has_the_requested_shape():
    transformer = models.build_denoiser("flux-small")
    assert transformer.inner_dim == 1024
    assert (transformer.config.num_attention_heads, transformer.config.attention_head_dim) == (8, 128)
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (2, 4)
    assert (transformer.config.in_channels, transformer.out_channels) == (384, 64)
    assert models.get_spec("flux-small").call_defaults["max_sequence_length"] == 64


def test_flux_demo_is_flux_small_with_the_tiny_flux_vae():
    demo, small, tiny = (models.get_spec(name) for name in ("flux-demo", "flux-small", "tiny-flux-fill"))
    assert demo.denoiser_config == small.denoiser_config and demo.text_encoders == small.text_encoders
    assert (demo.resolution, demo.call_defaults) == (small.resolution, small.call_defaults)
    assert {**demo.vae_config, "sample_size": None} == {**tiny.vae_config, "sample_size": None}
    assert "share of an edit it takes at full size on a GPU" in demo.description


@pytest.mark.parametrize("name", sorted(PUBLISHED_DENOISER_PARAMETERS))
def test_bench_denoiser_matches_published_size(name):
    denoiser = models.build_denoiser(name, device="meta", dtype=torch.bfloat16)
    assert all(parameter.is_meta for parameter in denoiser.parameters())
    parameters = sum(parameter.numel() for parameter in denoiser.parameters())
    assert parameters == pytest.approx(PUBLISHED_DENOISER_PARAMETERS[name], rel=0.01)


def _vae_scale_factor(spec) -> int:
    return 2 ** (len(spec.vae_config["block_out_channels"]) - 1)


def _width_contracts(spec) -> list[tuple[str, int, int]]:
    """(what, denoiser expects, components provide) for each width the pipeline wires together."""
    denoiser = spec.denoiser_config
    encoders = {encoder.component: encoder.config for encoder in spec.text_encoders}
    latent = spec.vae_config["latent_channels"]
    if spec.family.startswith("flux"):
        clip, t5 = encoders["text_encoder"], encoders["text_encoder_2"]
        # Fill tokens: 2x2 patches of latents and masked-image latents, plus the 8x8-pixel mask cells.
        packed_inputs = 4 * (2 * latent + _vae_scale_factor(spec) ** 2) if spec.family == "flux-fill" else 4 * latent
        return [
            ("input channels", denoiser["in_channels"], packed_inputs),
            ("output channels", denoiser.get("out_channels") or denoiser["in_channels"], 4 * latent),
            ("context width", denoiser["joint_attention_dim"], t5["d_model"]),
            ("pooled width", denoiser["pooled_projection_dim"], clip["hidden_size"]),
            ("rope axes", sum(denoiser["axes_dims_rope"]), denoiser["attention_head_dim"]),
        ]
    if spec.family == "sd3":
        clip_l, clip_g, t5 = encoders["text_encoder"], encoders["text_encoder_2"], encoders["text_encoder_3"]
        return [
            ("input channels", denoiser["in_channels"], latent),
            ("context width", denoiser["joint_attention_dim"], t5["d_model"]),
            ("CLIP fits in the T5 width", min(t5["d_model"], clip_l["hidden_size"] + clip_g["hidden_size"]),
             clip_l["hidden_size"] + clip_g["hidden_size"]),
            ("pooled width", denoiser["pooled_projection_dim"], clip_l["projection_dim"] + clip_g["projection_dim"]),
        ]
    contracts = [("input channels", denoiser["in_channels"], 2 * latent + 1)]  # latents, mask, masked image
    if spec.family == "sdxl":
        clip_l, clip_g = encoders["text_encoder"], encoders["text_encoder_2"]
        pooled_and_ids = 6 * denoiser["addition_time_embed_dim"] + clip_g["projection_dim"]
        contracts += [
            ("context width", denoiser["cross_attention_dim"], clip_l["hidden_size"] + clip_g["hidden_size"]),
            ("added embedding width", denoiser["projection_class_embeddings_input_dim"], pooled_and_ids),
        ]
    else:
        contracts.append(("context width", denoiser["cross_attention_dim"], encoders["text_encoder"]["hidden_size"]))
    return contracts


@pytest.mark.parametrize("spec", models.list_models(), ids=lambda spec: spec.name)
def test_denoiser_inputs_match_vae_and_text_encoders(spec):
    assert _vae_scale_factor(spec) == 8
    assert spec.resolution % (2 * _vae_scale_factor(spec)) == 0
    for what, expected, provided in _width_contracts(spec):
        assert expected == provided, f"{spec.name}: {what}"


def test_every_spec_is_listed_once_with_a_description():
    specs = models.list_models()
    assert [spec.name for spec in specs] == TINY_NAMES + BENCH_NAMES
    assert set(BENCH_NAMES) == {"flux-small", "flux-demo", "flux-size", "sd3-size", "sdxl-size", "sd2-size"}
    assert all(spec.description and "\n" not in spec.description for spec in specs)
    assert all(models.get_spec(spec.name) is spec for spec in specs)


def test_exported_folder_is_a_plain_diffusers_folder(tmp_path):
    folder = models.export_pipeline("tiny-flux-fill", tmp_path / "export")
    index = json.loads((folder / "model_index.json").read_text())
    manifest = json.loads((folder / export.MANIFEST_NAME).read_text())
    assert index["_class_name"] == "FluxFillPipeline"
    assert manifest == {"name": "tiny-flux-fill", "family": "flux-fill", "call_defaults": {"max_sequence_length": 32}}
    assert list(folder.rglob("*.safetensors")), "weights must be safetensors"
    shutil.rmtree(folder / "tokenizer")  # transformers would quietly load an empty tokenizer instead
    with pytest.raises(ModelError, match="components with no folder: tokenizer"):
        models.load_pipeline(folder)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_an_unpatched_twin_is_the_stock_model_on_the_patched_models_weights(name):
    """The bench baselines' denoiser (`unpatched_twin`): the stock class without the adapter's patches,
    computing what a freshly built stock model does, on the very tensors of the patched model."""
    from retouch.adapters import patch_flux, patch_sd3, patch_unet
    from retouch.models.inputs import random_flux_inputs, random_sd3_inputs, random_unet_inputs

    family = models.get_spec(name).family
    patched = models.build_denoiser(name).eval()
    patch = {"sd3": patch_sd3}.get(family, patch_unet if family.startswith("sd") else patch_flux)
    patch(patched)
    twin = models.unpatched_twin(patched)
    if family.startswith("flux"):
        inputs = random_flux_inputs(twin, 2, (4, 4), 8, seed=0)
    elif family == "sd3":
        inputs = random_sd3_inputs(twin, 2, (4, 4), 8, seed=0)
    else:
        inputs = random_unet_inputs(twin, 2, (64, 64), 8, seed=0)
    with torch.inference_mode():
        expected = models.build_denoiser(name).eval()(**inputs)[0]
        assert torch.equal(twin(**inputs)[0], expected)
    assert type(twin) is type(patched) and not twin.training
    patched_blocks = [module for module in patched.modules() if "forward" in module.__dict__]
    assert patched_blocks and not any("forward" in module.__dict__ for module in twin.modules())
    assert not any(module._forward_pre_hooks for module in twin.modules())
    shared = dict(patched.named_parameters()) | dict(patched.named_buffers())
    for key, tensor in [*twin.named_parameters(), *twin.named_buffers()]:
        assert tensor.data_ptr() == shared[key].data_ptr() and not tensor.requires_grad


@pytest.mark.parametrize("options, says", [
    ({"device": "gpu"}, "device must be cpu, cuda or cuda:N"),
    ({"device": "cuda:7"}, "no such CUDA device here"),
    ({"dtype": "nope"}, "dtype must be a floating torch dtype"),
    ({"dtype": torch.int8}, "dtype must be a floating torch dtype"),
    ({"scheduler": 123}, "scheduler must be a name"),
    ({"name_or_dir": None}, "model must be a built-in name or a pipeline folder"),
])
def test_load_refuses_what_it_cannot_load_on_naming_the_argument(options, says):
    """A device torch does not know or this machine lacks failed inside diffusers (an AssertionError); a
    dtype given by name was ignored (float32 ran)."""
    with pytest.raises(ModelError, match=says):
        models.load_pipeline(**{"name_or_dir": "tiny-flux-fill", **options})


def test_a_dtype_may_be_named():
    assert models.load_pipeline("tiny-flux-fill", dtype="float64").pipe.transformer.dtype == torch.float64
