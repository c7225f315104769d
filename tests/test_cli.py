"""The `retouch` command as a user runs it: a fresh interpreter per call, real files, exit codes."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image, ImageDraw
from polling import wait_for

from retouch.config import ServeOptions

TINY_MODELS = ["tiny-flux-fill", "tiny-flux-inpaint", "tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
BENCH_SPECS = ["flux-small", "flux-demo", "flux-size", "sd3-size", "sdxl-size", "sd2-size"]


@pytest.fixture
def inputs(tmp_path):
    """A 128x128 RGB template and a mask with a white square, as in the issue's acceptance test."""
    template = Image.new("RGB", (128, 128), (40, 120, 200))
    ImageDraw.Draw(template).ellipse((20, 30, 90, 100), fill=(230, 200, 60))
    mask = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(mask).rectangle((32, 32, 95, 95), fill=255)
    template.save(tmp_path / "T.png")
    mask.save(tmp_path / "M.png")
    return tmp_path


@pytest.mark.parametrize("model", TINY_MODELS)
def test_edit_writes_image_of_input_size(cli, inputs, model):
    out = inputs / f"{model}.png"
    result = cli("edit", "--model", model, "--image", inputs / "T.png", "--mask", inputs / "M.png",
                 "--prompt", "a red hat", "--steps", "4", "--out", out)
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout
    with Image.open(out) as edited, Image.open(inputs / "T.png") as template:
        assert edited.format == "PNG" and edited.size == (128, 128) and edited.mode == "RGB"
        # Outside the white square the template's pixels come back exactly; inside, the model's.
        outside = (0, 0, 128, 32)
        assert edited.crop(outside).tobytes() == template.crop(outside).tobytes()
        assert edited.crop((32, 32, 96, 96)).tobytes() != template.crop((32, 32, 96, 96)).tobytes()


def test_no_paste_back_returns_the_raw_pipeline_output(cli, inputs):
    long_prompt = "a red hat " * 3000  # CLIP keeps 77 tokens; the log of what it cut is capped, not 30 kB
    result = cli("edit", "--model", "tiny-sd2-inpaint", "--image", inputs / "T.png", "--mask", inputs / "M.png",
                 "--prompt", long_prompt, "--steps", "2", "--no-paste-back", "--out", inputs / "raw.png")
    assert result.returncode == 0, result.stderr
    assert len(result.stderr) < 2000 and "characters cut" in result.stderr
    with Image.open(inputs / "raw.png") as raw, Image.open(inputs / "T.png") as template:
        assert raw.crop((0, 0, 128, 32)).tobytes() != template.crop((0, 0, 128, 32)).tobytes()


@pytest.mark.parametrize("model, cache_mode", [("tiny-flux-fill", "y"), ("tiny-flux-fill", "kv"),
                                               ("tiny-sd3-inpaint", "kv"), ("tiny-sd2-inpaint", "y")])
def test_mask_aware_edit_registers_then_edits(cli, inputs, model, cache_mode):
    out = inputs / "mask_aware.png"
    result = cli("edit", "--model", model, "--image", inputs / "T.png", "--mask", inputs / "M.png",
                 "--prompt", "a red hat", "--steps", "4", "--mask-aware", "--cache-mode", cache_mode, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "register template" in result.stdout and f"{cache_mode}-cache" in result.stdout
    with Image.open(out) as edited, Image.open(inputs / "T.png") as template:
        assert edited.size == (128, 128)
        assert edited.crop((0, 0, 128, 32)).tobytes() == template.crop((0, 0, 128, 32)).tobytes()


@pytest.mark.parametrize("flags", [[], ["--mask-aware"], ["--mask-aware", "--cache-mode", "kv"]],
                         ids=["baseline", "mask-aware-y", "mask-aware-kv"])
def test_an_odd_size_keeps_every_unmasked_pixel_and_repaints_a_single_one(cli, tmp_path, flags):
    # 130x97 is no multiple of the 16-px patch: the pipeline runs on a 144x112 canvas and the
    # answer is pasted back at 130x97, so the mask is honoured to the pixel. An all-black mask returns
    # the file's bytes (through the CLI once: the editor's invariant tests cover it in every mode).
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (97, 130, 3), dtype=np.uint8)).save(tmp_path / "T.png")
    Image.new("L", (130, 97), 0).save(tmp_path / "black.png")
    one_pixel = Image.new("L", (130, 97), 0)
    one_pixel.putpixel((65, 48), 255)
    one_pixel.save(tmp_path / "pixel.png")
    for mask in ("pixel",) if flags else ("black", "pixel"):
        result = cli("edit", "--model", "tiny-flux-fill", *flags, "--image", tmp_path / "T.png",
                     "--mask", tmp_path / f"{mask}.png", "--prompt", "a red hat", "--steps", "2",
                     "--out", tmp_path / f"O-{mask}.png")
        assert result.returncode == 0, result.stderr
    if not flags:
        assert (tmp_path / "O-black.png").read_bytes() == (tmp_path / "T.png").read_bytes()
    with Image.open(tmp_path / "O-pixel.png") as edited, Image.open(tmp_path / "T.png") as template:
        differs = (np.asarray(edited) != np.asarray(template)).any(axis=2)
    assert differs[48, 65] and differs.sum() == 1


def test_a_transparent_template_keeps_its_alpha_outside_the_mask(cli, tmp_path):
    """A cut-out (RGBA, with a colour profile) edited mask-aware: the PNG answer is RGBA, every unmasked
    pixel the file's own RGBA pixel, the repainted ones opaque; a JPEG answer says it drops the alpha;
    both keep the profile."""
    rng = np.random.default_rng(1)
    cutout = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
    cutout[..., 3] = np.where(rng.random((48, 64)) < 0.5, 0, 255)
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    Image.fromarray(cutout).save(tmp_path / "T.png", icc_profile=profile)
    mask = Image.new("L", (64, 48), 0)
    mask.paste(255, (16, 16, 40, 40))
    mask.save(tmp_path / "M.png")
    for out in ("O.png", "O.jpg"):
        result = cli("edit", "--model", "tiny-flux-fill", "--mask-aware", "--image", tmp_path / "T.png",
                     "--mask", tmp_path / "M.png", "--prompt", "a red hat", "--steps", "2", "--out", tmp_path / out)
        assert result.returncode == 0, result.stderr
        assert ("drops the alpha" in result.stderr) == (out == "O.jpg")
        assert Image.open(tmp_path / out).info.get("icc_profile") == profile  # the colours as the file had them
    with Image.open(tmp_path / "O.png") as edited:
        answer = np.asarray(edited)
    keep = np.asarray(mask) == 0
    assert answer.shape == (48, 64, 4) and (answer[keep] == cutout[keep]).all()
    assert (answer[..., 3][~keep] == 255).all()


def test_edit_keeps_odd_input_size(cli, tmp_path):
    # 100x75 is not a multiple of the latent patch: run on a 112x80 canvas, returned at 100x75.
    Image.new("RGB", (100, 75), (200, 10, 10)).save(tmp_path / "T.png")
    mask = Image.new("L", (100, 75), 0)
    ImageDraw.Draw(mask).rectangle((10, 10, 50, 50), fill=255)
    mask.save(tmp_path / "M.png")
    result = cli("edit", "--model", "tiny-sd2-inpaint", "--image", tmp_path / "T.png", "--mask", tmp_path / "M.png",
                 "--prompt", "a cat", "--steps", "2", "--out", tmp_path / "O.jpg")
    assert result.returncode == 0, result.stderr
    with Image.open(tmp_path / "O.jpg") as edited:
        assert edited.size == (100, 75) and edited.format == "JPEG"


def test_an_edit_with_a_lora_is_the_stock_edit_with_the_adapter(cli, inputs):
    from lora_files import save_random_lora

    from retouch.models import load_pipeline

    save_random_lora(load_pipeline("tiny-flux-fill"), inputs / "loras" / "grain")
    runs = {"stock": [], "scale 0": ["--lora", "grain:0"], "lora": ["--lora", "grain:1.5"],
            "mask-aware lora": ["--lora", "grain:1.5", "--mask-aware"]}
    edited = {}
    for name, flags in runs.items():
        out = inputs / f"{name}.png"
        lora_dir = ["--lora-dir", inputs / "loras"] if flags else []
        result = cli("edit", "--model", "tiny-flux-fill", "--image", inputs / "T.png", "--mask", inputs / "M.png",
                     "--prompt", "a red hat", "--steps", "2", *flags, *lora_dir, "--out", out)
        assert result.returncode == 0, result.stderr
        assert ("LoRA grain:" in result.stdout) == bool(flags)
        edited[name] = np.asarray(Image.open(out))
    template = np.asarray(Image.open(inputs / "T.png"))
    assert np.array_equal(edited["scale 0"], edited["stock"])  # computed in full: the stock pipeline's result
    for name in ("lora", "mask-aware lora"):
        assert np.array_equal(edited[name][:32], template[:32]), name  # outside the mask: the template
        assert not np.array_equal(edited[name][32:96, 32:96], edited["stock"][32:96, 32:96]), name


def test_a_mask_aware_edit_refuses_a_broken_adapter_before_recording_the_template(cli, inputs):
    """The recording is a generation (minutes at full size): an adapter that cannot be applied is said first."""
    import torch
    from safetensors.torch import save_file

    (inputs / "loras").mkdir()
    save_file({"transformer.nowhere.lora_A.weight": torch.zeros(4, 8)},
              inputs / "loras" / "broken.safetensors")
    result = cli("edit", "--model", "tiny-flux-fill", "--image", inputs / "T.png", "--mask", inputs / "M.png",
                 "--prompt", "a red hat", "--steps", "2", "--mask-aware", "--lora", "broken", "--lora-dir",
                 inputs / "loras", "--out", inputs / "O.png")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "lora 'broken'" in result.stderr and "register template" not in result.stderr
    assert not (inputs / "O.png").exists()


@pytest.mark.parametrize("flags", [[], ["--mask-aware"]], ids=["baseline", "mask-aware"])
def test_an_edit_runs_the_scheduler_it_is_given(cli, inputs, flags):
    outs = {}
    for scheduler in (None, "dpm++2m-karras"):
        outs[scheduler] = inputs / f"{scheduler}.png"
        result = cli("edit", "--model", "tiny-sdxl-inpaint", "--image", inputs / "T.png", "--mask", inputs / "M.png",
                     "--prompt", "a red hat", "--steps", "3", "--out", outs[scheduler], *flags,
                     *(["--scheduler", scheduler] if scheduler else []))
        assert result.returncode == 0, result.stderr
    with Image.open(outs[None]) as default, Image.open(outs["dpm++2m-karras"]) as other:
        assert default.crop((0, 0, 128, 32)).tobytes() == other.crop((0, 0, 128, 32)).tobytes()
        assert default.crop((32, 32, 96, 96)).tobytes() != other.crop((32, 32, 96, 96)).tobytes()


@pytest.mark.parametrize("flags", [[], ["--mask-aware"], ["--mask-aware", "--lora", "grain", "--lora-dir", "loras"]],
                         ids=["baseline", "mask-aware", "mask-aware-lora"])
def test_an_edit_below_full_strength_keeps_every_unmasked_pixel_and_repaints_the_mask(cli, inputs, flags):
    if "--lora" in flags:
        from lora_files import save_random_lora

        from retouch.models import load_pipeline

        save_random_lora(load_pipeline("tiny-sdxl-inpaint"), inputs / "loras" / "grain")
    changed = {}
    for strength in ("1", "0.25"):
        out = inputs / f"strength-{strength}.png"
        result = cli("edit", "--model", "tiny-sdxl-inpaint", "--image", inputs / "T.png", "--mask", inputs / "M.png",
                     "--prompt", "a red hat", "--steps", "8", "--strength", strength, "--out", out, *flags, cwd=inputs)
        assert result.returncode == 0, result.stderr
        with Image.open(out) as edited, Image.open(inputs / "T.png") as template:
            assert edited.crop((0, 0, 128, 32)).tobytes() == template.crop((0, 0, 128, 32)).tobytes()
            changed[strength] = np.asarray(edited.crop((40, 40, 88, 88)))
    assert not np.array_equal(changed["0.25"], changed["1"])  # random weights: how much it keeps is a trained
    # model's matter; that it is diffusers' strength is tests/test_strength.py's


def test_exported_folder_loads_offline(cli, inputs):
    folder = inputs / "exported"
    result = cli("models", "export", "tiny-sdxl-inpaint", folder)
    assert result.returncode == 0, result.stderr
    assert (folder / "model_index.json").is_file()
    result = cli("edit", "--model", folder, "--image", inputs / "T.png", "--mask", inputs / "M.png",
                 "--prompt", "a red hat", "--steps", "4", "--out", inputs / "O.png", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    with Image.open(inputs / "O.png") as edited:
        assert edited.size == (128, 128)


def test_models_lists_tiny_models_and_bench_specs(cli):
    result = cli("models")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:]}
    assert listed == set(TINY_MODELS + BENCH_SPECS)
    as_json = json.loads(cli("models", "--json").stdout)
    assert {entry["name"]: entry["kind"] for entry in as_json} == {
        **{name: "tiny" for name in TINY_MODELS}, **{name: "bench" for name in BENCH_SPECS}}


def test_doctor_prints_json(cli):
    result = cli("doctor")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["extension"]["built"] and report["extension"]["cpu"]
    assert report["packages"]["diffusers"] == "0.42.1"
    assert isinstance(report["cuda_available"], bool)
    assert report["triton"]["usable"] is True, report["triton"]


def _bad_inputs(tmp_path):
    Image.new("RGB", (128, 128)).save(tmp_path / "T.png")
    Image.new("L", (128, 128)).save(tmp_path / "M.png")
    Image.new("L", (64, 64)).save(tmp_path / "M64.png")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    (tmp_path / "empty_dir").mkdir()
    return tmp_path


# case: (flag values replacing the good ones, extra flags, what the one error line must say)
BAD_EDITS = {
    "small mask": ({"--mask": "M64.png"}, [], "mask M64.png is 64x64 but image is 128x128"),
    "missing image": ({"--image": "nope.png"}, [], "image file not found"),
    "unreadable image": ({"--image": "junk.png"}, [], "cannot read image"),
    "image the process cannot read": ({"--image": "/proc/self/mem"}, [], "cannot read image /proc/self/mem"),
    "empty prompt": ({"--prompt": " "}, [], "--prompt is empty"),
    "unknown model": ({"--model": "no-such-model"}, [], "no-such-model"),
    "not a pipeline folder": ({"--model": "empty_dir"}, [], "empty_dir"),
    "bad steps": ({"--steps": "0"}, [], "--steps"),
    "a schedule of 10^10 steps": ({"--steps": "10000000000"}, [], "--steps must be in [1, 10000]"),
    "mask without alpha": ({}, ["--mask-alpha"], "no alpha channel"),
    "mask-aware without paste-back": ({}, ["--mask-aware", "--no-paste-back"], "--no-paste-back applies to the baseline"),
    "negative dilation": ({"--dilation": "-1"}, [], "--dilation"),
    "compile without mask-aware": ({}, ["--compile"], "add --mask-aware"),
    "dilation without mask-aware": ({"--dilation": "2"}, [], "--dilation, --cache-mode and --cache-host-gib apply"),
    "kv-cache without mask-aware": ({}, ["--cache-mode", "kv"], "--dilation, --cache-mode and --cache-host-gib apply"),
    "cache budget without mask-aware": ({"--cache-host-gib": "8"}, [], "--cache-host-gib apply to mask-aware"),
    "cache budget not a number": ({"--cache-host-gib": "nan"}, ["--mask-aware"], "--cache-host-gib must be a finite"),
    "cuda graphs on the cpu": ({}, ["--mask-aware", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA"),
    "bad lora": ({}, ["--lora", "bad::x", "--lora-dir", "."], "--lora: lora scale of 'bad' must be a number"),
    "lora without a folder": ({}, ["--lora", "grain"], "add --lora-dir"),
    "unknown lora": ({}, ["--lora", "grain", "--lora-dir", "empty_dir"], "grain"),
    "unknown scheduler": ({}, ["--scheduler", "dpm3"], "--scheduler 'dpm3' is neither a diffusers scheduler"),
    "scheduler of another kind": ({}, ["--scheduler", "flow-euler"], "cannot drive this StableDiffusionInpaint"),
    "scheduler setting it lacks": ({}, ["--scheduler", "ddim:karras=true"], "DDIMScheduler has no setting 'karras'"),
    # a schedule, but no step: every edit of a server that started failed
    "sampler settings that make no step": ({}, ["--scheduler", "dpm++2m:solver_order=0"], "solver_order=0"),
    "sampler settings that make no schedule": ({}, ["--scheduler", "ddim:num_train_timesteps=0"],
                                               "num_train_timesteps=0"),
    "more steps than the sampler makes": ({"--steps": "51"}, ["--scheduler", "lcm"],
                                          "--steps 51: LCMScheduler cannot make that many"),
    "strength of nothing": ({"--strength": "0"}, [], "--strength must be in (0, 1], got 0.0"),
    "strength of less than a step": ({"--strength": "0.2", "--steps": "4"}, ["--mask-aware"],
                                   "--strength 0.2 of 4 steps is less than one step's worth: it must be at least 1/4"),
}


@pytest.mark.parametrize("case", BAD_EDITS)
def test_bad_input_is_one_line_and_exit_2(cli_here, tmp_path, case):
    _bad_inputs(tmp_path)
    overrides, flags, expected = BAD_EDITS[case]
    values = {"--model": "tiny-sd2-inpaint", "--image": "T.png", "--mask": "M.png", "--prompt": "a hat",
              "--out": "O.png", **overrides}
    result = cli_here("edit", *[x for pair in values.items() for x in pair], *flags, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert not (tmp_path / "O.png").exists()


def test_simulate_prints_every_policy(cli):
    result = cli("simulate", "--workers", "4", "--rps", "1", "--requests", "40", "--policies",
                 "round-robin,mask-aware")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["workers"] == 4 and set(report["policies"]) == {"round-robin", "mask-aware"}
    assert all(p["p95_s"] >= p["p50_s"] > 0 for p in report["policies"].values())


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-flux-fill", "--workers", "-1"], "--workers must be >= 0"),
    (["--model", "tiny-flux-fill", "--no-worker-s", "nan"], "--no-worker-s must be > 0"),
    (["--model", "tiny-flux-fill", "--policy", "random"], "invalid choice"),
    (["--model", "tiny-flux-fill", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
    (["--model", "tiny-flux-fill", "--max-upload-mb", "2000"], "--max-inflight-mb (1024) must hold one upload"),
    (["--model", "tiny-flux-fill", "--steps", "60", "--max-steps", "50"], "--steps (60) must not exceed --max-steps"),
    (["--model", "tiny-flux-fill", "--cache-host-gib", "nan"], "--cache-host-gib must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--cache-disk-gib", "inf"], "--cache-disk-gib must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--cache-host-gib", "1e-9"], "--cache-host-gib must hold at least 1 MiB"),
    (["--model", "tiny-flux-fill", "--cache-disk-dir", "/etc/hostname"], "cannot use /etc/hostname as a folder"),
    (["--model", "tiny-flux-fill", "--cache-disk-dir", "/proc/retouch"], "cannot write in /proc/retouch"),
    (["--model", "tiny-flux-fill", "--cache-dtype", "int8"], "invalid choice"),
    (["--model", "tiny-flux-fill", "--lora-device-mb", "0"], "--lora-device-mb must be a finite number of at least"),
    (["--model", "tiny-flux-fill", "--served-model-name", "flux,,gpt-image-1"], "--served-model-name takes names"),
    (["--model", "tiny-flux-fill", "--cors-origins", "shop.example.com"], "--cors-origins takes scheme://host"),
    (["--model", "tiny-flux-fill", "--scheduler", "dpm++2m"], "cannot drive this FluxFillPipeline"),
    (["--model", "tiny-sd2-inpaint", "--scheduler", "lcm", "--steps", "60"], "LCMScheduler makes at most 50 steps"),
    # NaN passed `<= 0` checks, inf overflowed later, 0 spun a core: refused up front
    (["--model", "tiny-flux-fill", "--heartbeat-s", "nan"], "--heartbeat-s must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--heartbeat-s", "0"], "--heartbeat-s must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--heartbeat-s", "0.0001"], "--heartbeat-s must be at least 0.01 s"),
    (["--model", "tiny-flux-fill", "--max-upload-mb", "nan"], "--max-upload-mb must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--max-inflight-mb", "inf"], "--max-inflight-mb must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--result-store-mb", "inf"], "--result-store-mb must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--max-templates-mb", "0"], "--max-templates-mb must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--max-one-off-mb", "inf"], "--max-one-off-mb must be a finite number > 0"),
    (["--model", "tiny-flux-fill", "--max-batch", "4", "--edit-slots", "4"], "--edit-slots must be from 0 to"),
    (["--model", "tiny-flux-fill", "--mode", "static", "--edit-slots", "1"], "--edit-slots has no effect"),
    (["--model", "tiny-flux-fill", "--drain-s", "inf"], "--drain-s must be a finite number >= 0"),
    (["--model", "tiny-flux-fill", "--slo-ms-per-megapixel", "inf"], "--slo-ms-per-megapixel must be a finite"),
    (["--model", "tiny-flux-fill", "--lora-cache-mb", "inf"], "--lora-cache-mb must be a finite number of at least"),
    # a positive number of MiB under one byte: once a worker's traceback
    (["--model", "tiny-flux-fill", "--lora-cache-mb", "1e-7"], "--lora-cache-mb must be a finite number of at least"),
    (["--model", "tiny-flux-fill", "--worker-listen", "tcp://127.0.0.1:99999"], "--worker-listen must be"),
    (["--model", "tiny-flux-fill", "--worker-listen", "tcp://127.0.0.1:abc"], "--worker-listen must be"),
    (["--model", "tiny-flux-fill", "--max-steps", "10000000000"], "--max-steps must be at most 10000"),
])
def test_serve_refuses_bad_options_before_starting_anything(cli_here, args, message):
    result = cli_here("serve", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert "workers ready" not in result.stderr


def test_serve_refuses_a_port_in_use_before_loading_the_model(cli_here):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = cli_here("serve", "--model", "tiny-flux-fill", "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "workers ready" not in result.stderr


def test_max_steps_is_lowered_to_what_the_sampler_makes(capsys):
    from retouch.cli import fit_steps
    from retouch.models.loading import scheduler_for

    opts = ServeOptions(model="tiny-sd2-inpaint", scheduler="lcm")
    fit_steps(opts, scheduler_for(opts.model, opts.scheduler))
    assert opts.max_steps == 50 and "--max-steps lowered to 50" in capsys.readouterr().err
    opts = ServeOptions(model="tiny-sd2-inpaint", scheduler="ddim")
    fit_steps(opts, scheduler_for(opts.model, opts.scheduler))
    assert opts.max_steps == ServeOptions(model="m").max_steps


def test_images_per_request_are_capped_at_the_queue():
    from retouch.server import http_limits

    assert http_limits(ServeOptions(model="tiny-flux-fill", max_queue=6)).max_n == 6
    assert http_limits(ServeOptions(model="tiny-flux-fill")).max_n == 10


@pytest.mark.parametrize("field, value, says", [("guidance", float("nan"), "--guidance"),
                                                ("guidance", float("inf"), "--guidance"),
                                                ("seed", 2**64, "--seed"), ("seed", -1, "--seed")])
def test_edit_options_refuse_what_would_fail_late(field, value, says):
    from retouch.config import EditOptions
    from retouch.errors import InputError

    with pytest.raises(InputError, match=says):
        EditOptions(model="tiny-flux-fill", image="T.png", mask="M.png", prompt="a hat", **{field: value})


def test_the_baseline_and_mask_aware_edits_default_to_the_same_steps(inputs, monkeypatch):
    import retouch.baseline
    import retouch.editor
    from retouch import cli as retouch_cli

    ran = {}

    def baseline(pipe, image, mask, prompt, steps=None, **kwargs):
        ran["baseline"] = steps
        return image

    def register(self, image, prompt="", steps=None, **kwargs):
        ran["mask-aware"] = steps
        raise KeyboardInterrupt  # the steps are all this test wants of it

    monkeypatch.setattr(retouch.baseline, "run_baseline_edit", baseline)
    monkeypatch.setattr(retouch.editor.MaskAwareEditor, "register_template", register)
    argv = ["edit", "--model", "tiny-flux-fill", "--image", str(inputs / "T.png"), "--mask", str(inputs / "M.png"),
            "--prompt", "a hat", "--out", str(inputs / "O.png")]
    assert retouch_cli.main(argv) == 0
    assert retouch_cli.main(argv + ["--mask-aware"]) == 130  # what Ctrl-C exits with
    assert ran == {"baseline": retouch.editor.DEFAULT_STEPS, "mask-aware": retouch.editor.DEFAULT_STEPS}


def test_unwritable_folders_of_export_and_keys_are_input_errors(tmp_path, capsys):
    from retouch import cli as retouch_cli

    (tmp_path / "a_file").write_text("x")
    assert retouch_cli.main(["models", "export", "tiny-sd2-inpaint", str(tmp_path / "a_file" / "sub")]) == 2
    assert retouch_cli.main(["keys", "generate", "w1", "--out", str(tmp_path / "a_file")]) == 2
    errors = capsys.readouterr().err
    assert errors.count("cannot write") == 2 and "Traceback" not in errors and "internal error" not in errors
    assert "it is not a folder" in errors  # not "File exists"
    assert retouch_cli.main(["models", "export", "tiny-sd2-inpaint", " "]) == 2  # it exported into "."
    assert "needs a folder" in capsys.readouterr().err


@pytest.mark.parametrize("options", ["EditOptions", "ProfileOptions", "ServeOptions", "WorkerOptions"])
def test_every_flag_with_a_default_says_it_in_its_help(options):
    """An operator reads --help, not the README: a flag's default shows there, an on/off flag's as the flag
    that gives it."""
    import argparse
    import dataclasses

    from retouch import config

    cls = getattr(config, options)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, cls)
    helps = {action.dest: action.help for action in parser._actions}
    for field in dataclasses.fields(cls):
        if field.default not in (dataclasses.MISSING, None):
            assert "(default" in helps[field.name], field.name
        if field.default is True:
            assert f"(default: --{field.name.replace('_', '-')})" in helps[field.name], field.name


def test_the_in_process_runner_shows_what_a_terminal_would(cli_here, monkeypatch):
    """The refusal tests run `main` in this interpreter (`cli_here`): a library's warning or log line must
    reach their stderr as it would a user's, or "one line" would pass where a user sees two; a deprecation
    inside a library stays hidden, as Python hides it."""
    import logging
    import warnings

    from diffusers.utils import logging as diffusers_logging

    import retouch.cli

    def noisy_main(argv):
        warnings.warn("a future change", FutureWarning)
        warnings.warn("deprecated inside a library", DeprecationWarning)
        logging.getLogger("retouch.anything").warning("a log line")
        diffusers_logging.get_logger("diffusers.anything").warning("a diffusers line")
        print("retouch: error: refused", file=sys.stderr)
        return 2

    monkeypatch.setattr(retouch.cli, "main", noisy_main)
    result = cli_here("edit")
    assert result.returncode == 2 and result.stderr.endswith("retouch: error: refused\n")
    for line in ("a future change", "a log line", "a diffusers line"):
        assert line in result.stderr, result.stderr
    assert "deprecated inside a library" not in result.stderr


def test_a_benchmarks_help_shows_its_defaults_once(capsys):
    """`retouch bench serve --help`: where the server is assumed to be and how many edits it sends."""
    from retouch.bench import serve

    with pytest.raises(SystemExit):
        serve.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "(default: http://127.0.0.1:8000)" in shown and "edits to send (default: 100)" in shown
    assert shown.count("(default: 100)") == 1 and "(default: None)" not in shown
    assert "(default: 0)" in shown  # --registrations: a default of 0 was hidden as if there were none


@pytest.mark.parametrize("args, message", [
    (["simulate", "--seed", "-1"], "--seed must be >= 0"),
    (["simulate", "--out", "{folder}"], "it is a folder"),
    (["profile", "--model", "tiny-flux-fill", "--device", "cpu", "--out", "{folder}"], "it is a folder"),
])
def test_outputs_and_seeds_are_checked_before_the_run(cli_here, tmp_path, args, message):
    """An --out that is a folder failed after the whole profile or simulation had run; a negative seed in
    numpy's generator."""
    result = cli_here(*[arg.format(folder=tmp_path) for arg in args])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--run-dir", "{file}"], "as a folder: it is a file"),
    (["--health-host", "999.1.1.1", "--health-port", "18080"], "cannot serve health on 999.1.1.1:18080"),
])
def test_a_worker_refuses_a_run_dir_or_health_address_it_cannot_use(cli_here, tmp_path, args, message):
    """Both were internal errors (exit 1): NotADirectoryError when the helpers started, gaierror at the bind."""
    (tmp_path / "a-file").write_text("")
    result = cli_here("worker", "--connect", "tcp://127.0.0.1:9", "--model", "tiny-flux-fill", "--device", "cpu",
                      *[arg.format(file=tmp_path / "a-file") for arg in args])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_worker_that_cannot_start_says_why_in_one_line(cli_here):
    """`retouch serve`'s workers printed their tracebacks (a host cache no machine has, a broken model folder):
    each now says its error in one line, as `retouch worker` does, and the server stops with exit 2."""
    result = cli_here("serve", "--model", "tiny-flux-fill", "--port", "0", "--workers", "1",
                      "--cache-host-gib", "100000")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "retouch: error: cannot allocate 1e+05 GiB" in result.stderr


def test_sigterm_ends_a_command_through_its_cleanup(tmp_path):
    """SIGTERM (a process manager, `timeout`) left `bench lora`'s adapter file, hundreds of MiB, in /tmp
    after each run: the command ended without its `finally`s. It now exits 143 through them."""
    command = [sys.executable, "-m", "retouch.cli", "bench", "lora", "--model", "tiny-flux-fill", "--batch", "1",
               "--steps", "2", "--repeats", "1", "--load-rank", "4", "--load-repeats", "100000", "--device", "cpu"]
    bench = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(tmp_path.glob("retouch-bench-lora-*/*")), "the bench writes its adapter file", 120)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 143
    finally:
        if bench.poll() is None:
            bench.kill()
    assert not list(tmp_path.glob("retouch-bench-lora-*"))


BENCHES = ["step", "block", "image", "overlap", "lora", "mixed", "batching", "throughput", "serving", "flops",
           "planner", "copy", "fidelity", "serve", "overhead", "attention", "soak"]


@pytest.mark.parametrize("name", [*BENCHES, "simulate"])
def test_every_option_of_a_benchmark_says_what_it_is(name, monkeypatch):
    """About 75 options had no help, so `--help` listed them bare and without their defaults."""
    import importlib

    from retouch import errors

    class Parsed(Exception):
        pass

    parsers = []

    def keep(parser, *args, **kwargs):
        parsers.append(parser)
        raise Parsed
    monkeypatch.setattr(errors.ArgumentParser, "parse_args", keep)
    module = importlib.import_module("retouch.engine.simulate" if name == "simulate" else f"retouch.bench.{name}")
    with pytest.raises(Parsed):
        module.main([])
    bare = [action.option_strings[0] for action in parsers[0]._actions
            if action.option_strings and not action.help]
    assert bare == [], bare
