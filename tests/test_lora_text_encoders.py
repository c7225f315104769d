"""The text-encoder parts of LoRA files (retouch.lora.text_encoders): read as diffusers' `load_lora_weights`
loads them into each CLIP encoder (PEFT and kohya layouts, every tiny family), known absent from a file's
header alone, refused in words when they cannot apply; and applied where prompts are encoded, in the
helper processes as inline, so that an edit equals diffusers' (tests/test_lora_engine.py compares the
whole edit with diffusers for every family)."""

import numpy as np
import pytest
import test_lora_files as kohya_files  # the module, not its names: its tests are collected there only
import torch
from editor_inputs import square_mask, template_image
from lora_files import save_kohya_lora, save_random_lora
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from retouch.editor import EditRequest
from retouch.engine.api import Engine
from retouch.engine.worker import EngineConfig
from retouch.lora import LoraError, LoraUse
from retouch.lora import files as lora_files
from retouch.lora import text_encoders
from retouch.lora.files import read_lora, read_text_encoder_lora, text_encoder_components
from retouch.lora.text_encoders import TextEncoderLoras, applied
from retouch.models import load_pipeline, quiet_libraries

TINY_NAMES = ["tiny-flux-fill", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module", params=TINY_NAMES)
def models(request):
    """(a pipeline files are read for, the same loaded again for diffusers to load files into)."""
    return load_pipeline(request.param), load_pipeline(request.param)


def diffusers_text_encoder_factors(reference, path) -> dict[str, dict[str, tuple]]:
    """Per text encoder, what PEFT holds after diffusers' `load_lora_weights(path)`: A, B and scaling."""
    with quiet_libraries():
        reference.pipe.load_lora_weights(str(path), adapter_name="reference")
    try:
        found = {}
        for component in text_encoder_components(reference.pipe):
            layers = {path: (layer.lora_A["reference"].weight.detach().clone(),
                             layer.lora_B["reference"].weight.detach().clone(), layer.scaling["reference"])
                      for path, layer in getattr(reference.pipe, component).named_modules()
                      if isinstance(layer, BaseTunerLayer)}
            if layers:
                found[component] = layers
        return found
    finally:
        reference.pipe.unload_lora_weights()


def assert_same_as_diffusers(parts, expected) -> None:
    assert list(parts) == list(expected) and expected
    for component, layers in expected.items():
        modules = parts[component].modules
        assert list(modules) == list(layers)  # the encoder's named_modules() order
        for path, (A, B, scaling) in layers.items():
            assert torch.equal(modules[path].A, A) and torch.equal(modules[path].B, B), (component, path)
            assert modules[path].scaling == pytest.approx(scaling, rel=1e-12)


@pytest.fixture
def part_read_only(monkeypatch):
    """Fails a test whose text-encoder part needed the whole file (`read_text_encoder_lora`'s fallback)."""
    def whole_file(*args):
        raise AssertionError("the whole file was read")
    monkeypatch.setattr(lora_files, "_read_raw_file", whole_file)


def test_text_encoder_factors_match_diffusers(models, tmp_path, part_read_only):
    model, reference = models
    path = save_random_lora(model, tmp_path, rank=RANK, alpha=ALPHA, text_encoders=True)
    parts = read_text_encoder_lora(path, "x", model.pipe)
    assert set(parts) == set(text_encoder_components(model.pipe)) and len(parts) == (2 if model.family in (
        "sdxl", "sd3") else 1)  # CLIP encoders only: Flux's and SD3's T5 take no LoRA in diffusers
    assert {m.scaling for w in parts.values() for m in w.modules.values()} == {ALPHA / RANK}
    assert_same_as_diffusers(parts, diffusers_text_encoder_factors(reference, path))


def test_the_denoiser_part_reads_as_without_a_text_encoder_part(tmp_path):
    model = load_pipeline("tiny-sdxl-inpaint")
    with_encoders = read_lora(save_random_lora(model, tmp_path / "te", rank=RANK, text_encoders=True), "x", model.pipe)
    without = read_lora(save_random_lora(model, tmp_path / "plain", rank=RANK), "x", model.pipe)
    assert with_encoders.digest == without.digest and with_encoders.modules.keys() == without.modules.keys()


def kohya_text_encoder_tensors(model, rank: int, alpha: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """kohya-ss' names for the q/k/v/out projections of each CLIP encoder's first layer."""
    prefixes = {"sdxl": {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"},
                "sd2": {"text_encoder": "lora_te_"}, "flux-fill": {"text_encoder": "lora_te1_"}}[model.family]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component, prefix in prefixes.items():
        encoder = getattr(model.pipe, component)
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear = encoder.get_submodule(f"{'text_model.' if hasattr(encoder, 'text_model') else ''}"
                                           f"encoder.layers.0.self_attn.{projection}")
            name = f"{prefix}text_model_encoder_layers_0_self_attn_{projection}"
            tensors |= {f"{name}.lora_down.weight": torch.randn(rank, linear.in_features, generator=generator) * 0.2,
                        f"{name}.lora_up.weight": torch.randn(linear.out_features, rank, generator=generator) * 0.2,
                        f"{name}.alpha": torch.tensor(alpha)}
    return tensors


@pytest.mark.parametrize("name", ["tiny-sdxl-inpaint", "tiny-sd2-inpaint", "tiny-flux-fill"])
def test_a_kohya_text_encoder_part_reads_through_diffusers_converter(name, tmp_path, part_read_only):
    model, reference = load_pipeline(name), load_pipeline(name)
    if model.family == "flux-fill":
        path = tmp_path / "kohya_lora.safetensors"
        save_file(kohya_files.kohya_flux_tensors(model), path)
    else:
        path, _ = save_kohya_lora(model, tmp_path, rank=RANK, alpha=ALPHA)
    save_file({**load_file(path), **kohya_text_encoder_tensors(model, RANK, ALPHA)}, path)
    parts = read_text_encoder_lora(path, "kohya", model.pipe)
    assert sum(len(w.modules) for w in parts.values()) == 4 * len(parts)
    assert_same_as_diffusers(parts, diffusers_text_encoder_factors(reference, path))


def test_only_the_text_encoder_tensors_are_read(tmp_path, monkeypatch):
    """A file without a text-encoder part costs its header; one with a part, the part's data only (the
    denoiser's factors reach diffusers' converters as meta tensors)."""
    model = load_pipeline("tiny-sd2-inpaint")
    reads = []
    read_some = lora_files.read_some

    def recording(*args):
        reads.append(read_some(*args)[0])
        return reads[-1], {}
    monkeypatch.setattr(lora_files, "read_some", recording)
    assert read_text_encoder_lora(save_random_lora(model, tmp_path / "plain", rank=RANK), "plain", model.pipe) == {}
    assert reads == []  # refused from its header
    path = save_random_lora(model, tmp_path / "te", rank=RANK, text_encoders=True)
    parts = read_text_encoder_lora(path, "te", model.pipe)
    (tensors,) = reads
    assert {key for key, value in tensors.items() if not value.is_meta} == {
        key for key in tensors if key.startswith("text_encoder.")}
    assert len(parts["text_encoder"].modules) == sum(key.endswith(".up.weight") for key in tensors
                                                     if key.startswith("text_encoder.")) > 0


def test_a_conversion_that_needs_the_denoiser_values_reads_the_whole_file(sd2_file, tmp_path, monkeypatch):
    model, tensors = sd2_file
    save_file(tensors, tmp_path / "a.safetensors")
    expected = read_text_encoder_lora(tmp_path / "a.safetensors", "a", model.pipe)
    state_dict_of = lora_files._pipeline_state_dict
    calls = []

    def needing_values(pipe, family, tensors, *args):
        calls.append(any(value.is_meta for value in tensors.values()))
        if calls[-1]:
            raise LoraError("a converter read a value")
        return state_dict_of(pipe, family, tensors, *args)
    monkeypatch.setattr(lora_files, "_pipeline_state_dict", needing_values)
    parts = read_text_encoder_lora(tmp_path / "a.safetensors", "a", model.pipe)
    assert calls == [True, False]
    for component, weights in expected.items():
        assert weights.digest == parts[component].digest
        # its own bytes, not views of the whole file read for it (a part kept would hold the file)
        assert parts[component].host_bytes < (tmp_path / "a.safetensors").stat().st_size / 2
        assert all(torch.equal(m.A, parts[component].modules[p].A) for p, m in weights.modules.items())


@pytest.fixture(scope="module")
def sd2_file(tmp_path_factory):
    model = load_pipeline("tiny-sd2-inpaint")
    path = save_random_lora(model, tmp_path_factory.mktemp("sd2"), rank=RANK, alpha=ALPHA, text_encoders=True)
    return model, load_file(path)


def _refusal(model, tensors, tmp_path, read=read_text_encoder_lora) -> str:
    path = tmp_path / "broken.safetensors"
    save_file(tensors, path)
    with pytest.raises(LoraError) as raised:
        read(path, "broken", model.pipe)
    message = str(raised.value)
    assert "broken" in message and "\n" not in message and str(tmp_path) not in message, message
    return message


def test_a_text_encoder_part_that_cannot_apply_is_refused_in_words(sd2_file, tmp_path):
    model, tensors = sd2_file
    q = next(key for key in tensors if key.startswith("text_encoder.") and key.endswith("q_proj.lora_linear_layer"
                                                                                      ".down.weight"))
    elsewhere = {key.replace("layers.0.", "layers.9."): value for key, value in tensors.items()}
    assert "which this CLIPTextModel does not have" in _refusal(model, elsewhere, tmp_path)
    narrow = {**tensors, q: tensors[q][:, :-1].contiguous()}
    assert "features but the layer maps" in _refusal(model, narrow, tmp_path)
    nan = {**tensors, q: tensors[q].clone().fill_(float("nan"))}
    assert "NaN or infinite values" in _refusal(model, nan, tmp_path)
    alone = {key: value for key, value in tensors.items() if key.startswith("text_encoder.")}
    assert "no LoRA weights for the unet" in _refusal(model, alone, tmp_path, read=read_lora)


def test_text_encoder_entries_under_names_the_header_check_misses_are_refused(sd2_file, tmp_path, monkeypatch):
    """The header check decides whether a helper reads a file; were a layout's names to escape it, its
    text-encoder part would be dropped unseen. `read_lora`, which converts the whole file, refuses it."""
    model, tensors = sd2_file
    monkeypatch.setattr(lora_files, "TEXT_ENCODER_NAMES", lora_files.re.compile("(?!)"))  # matches nothing
    assert "under names retouch does not recognise" in _refusal(model, tensors, tmp_path, read=read_lora)


def test_adapters_apply_for_the_call_only_and_add_up(sd2_file, tmp_path):
    model, tensors = sd2_file
    save_file(tensors, tmp_path / "a.safetensors")
    loras = TextEncoderLoras(str(tmp_path), model.pipe)
    encoder = model.pipe.text_encoder
    ids = torch.arange(8)[None]
    with torch.no_grad():
        base = encoder(ids)[0]
        with applied(model.pipe, loras.of((LoraUse("a", 0.5),))):
            half = encoder(ids)[0]
        with applied(model.pipe, loras.of((LoraUse("a", 0.25), LoraUse("a", 0.25)))):
            quarters = encoder(ids)[0]
        assert torch.equal(encoder(ids)[0], base)  # hooks gone
    assert (half - base).abs().max() > 1e-3
    torch.testing.assert_close(quarters, half, rtol=1e-5, atol=1e-5)
    assert loras.reads == 1  # one read of the file for all its uses


def test_a_file_is_read_once_until_it_is_replaced(sd2_file, tmp_path, monkeypatch):
    """Broken or not: a broken file's every request fails in the same words, from one read."""
    model, tensors = sd2_file
    calls = []
    monkeypatch.setattr(text_encoders, "read_text_encoder_lora",
                        lambda *args: calls.append(args) or read_text_encoder_lora(*args))
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"not a safetensors file")
    loras = TextEncoderLoras(str(tmp_path), model.pipe)
    for _ in range(2):
        with pytest.raises(LoraError, match="not a readable safetensors file"):
            loras.of((LoraUse("a"),))
    assert len(calls) == 1
    save_file(tensors, path)
    first = loras.of((LoraUse("a"),))
    assert len(calls) == 2 and loras.of((LoraUse("a"),)) == first
    save_file({key: value * 2 for key, value in tensors.items()}, path)
    second = loras.of((LoraUse("a"),))
    assert loras.reads == 2 and len(calls) == 3
    module = next(iter(first[0][0]["text_encoder"].modules))
    before, after = (uses[0][0]["text_encoder"].modules[module] for uses in (first, second))
    assert torch.equal(after.A, 2 * before.A)


def test_the_parts_kept_stay_within_the_byte_budget_least_recently_used_first_out(sd2_file, tmp_path):
    model, tensors = sd2_file
    for name in ("a", "b", "c"):
        save_file(tensors, tmp_path / f"{name}.safetensors")
    part_bytes = sum(w.nbytes for w in read_text_encoder_lora(tmp_path / "a.safetensors", "a", model.pipe).values())
    loras = TextEncoderLoras(str(tmp_path), model.pipe, max_bytes=2 * part_bytes + part_bytes // 2)
    for name in ("a", "b", "a", "c"):  # c evicts b, the least recently used
        loras.of((LoraUse(name),))
    assert loras.reads == 3 and loras.nbytes == 2 * part_bytes
    loras.of((LoraUse("a"),))
    assert loras.reads == 3  # kept
    loras.of((LoraUse("b"),))
    assert loras.reads == 4 and loras.nbytes == 2 * part_bytes
    tiny = TextEncoderLoras(str(tmp_path), model.pipe, max_bytes=1)  # smaller than any part: the last one stays
    tiny.of((LoraUse("a"),))
    tiny.of((LoraUse("a"),))
    assert tiny.reads == 1 and tiny.nbytes == part_bytes


def test_the_helpers_apply_the_text_encoder_part_as_the_worker_does(tmp_path):
    """Disaggregated (prompts encoded in a helper process) and inline give one image; without its
    text-encoder part the image differs; a broken text-encoder part fails its request with a LoraError."""
    model = load_pipeline("tiny-sdxl-inpaint")
    save_random_lora(model, tmp_path / "te", rank=RANK, alpha=ALPHA, seed=2, text_encoders=True)
    save_random_lora(model, tmp_path / "plain", rank=RANK, alpha=ALPHA, seed=2)
    broken = load_file(tmp_path / "te" / lora_files.FOLDER_WEIGHT_NAME)
    broken = {key.replace("layers.0.", "layers.9.") if key.startswith("text_encoder.") else key: value
              for key, value in broken.items()}
    save_file(broken, tmp_path / "broken.safetensors")
    images = {}
    for mode in ("naive", "disagg"):
        config = EngineConfig(mode=mode, lora_dir=str(tmp_path), lora_latest_step=0.0, helpers=1)
        with Engine.load("tiny-sdxl-inpaint", config) as engine:
            template_id = engine.register_template(template_image(), prompt="a scene", steps=3, seed=3)
            request = EditRequest(template_id, square_mask(), "a red hat", seed=5)
            for name in ("te", "plain"):
                images[mode, name] = engine.submit(request, lora=name).result(timeout=300).image
            with pytest.raises(LoraError, match="which this CLIPTextModel does not have"):
                engine.submit(request, lora="broken").result(timeout=300)

    def differ(a, b) -> int:
        return int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())
    assert differ(images["naive", "te"], images["disagg", "te"]) <= 1
    assert differ(images["disagg", "te"], images["disagg", "plain"]) > 8
