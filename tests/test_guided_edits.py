"""What classifier-free guidance lets an edit choose (SD3, SDXL, SD2): a negative prompt (`negative_prompt`)
and its own guidance scale (`guidance`, where the template's recording ran guidance too).

Against diffusers' own: with every token masked, an edit with a negative prompt, or at another scale, equals
the stock pipeline called with it, and a template is recorded with its own negative prompt. The step loop
batches edits of other negative prompts and scales (and none) and equals each alone, also prepared over the
wire by a helper. What would do nothing, or read a recording that lacks it (Flux, guidance <= 1), is refused
naming the field, in the editor, the HTTP head (before anything is queued) and the CLI. Through `retouch
serve` both reach the worker's pipeline.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import zmq
from editor_inputs import max_diff, square_mask, template_image
from loop_runs import run_loop
from PIL import Image
from scripted_worker import ScriptedWorker

from retouch.config import ServeOptions
from retouch.editor import EditRequest, MaskAwareEditor
from retouch.engine import processing, wire
from retouch.engine.router import Router, RouterConfig
from retouch.engine.worker import EngineConfig, Worker
from retouch.errors import InputError
from retouch.http_api import Limits, create_app, template_id_of
from retouch.images import png_bytes
from retouch.models import load_pipeline
from retouch.server import Server

GUIDED = ["tiny-sd3-inpaint", "tiny-sdxl-inpaint", "tiny-sd2-inpaint"]
STEPS = 3
NEGATIVE = "blurry, low quality"
EVERYTHING = Image.new("L", (128, 128), 255)
_editors: dict = {}


def editor_for(model: str) -> MaskAwareEditor:
    if model not in _editors:
        _editors[model] = MaskAwareEditor(load_pipeline(model))
    return _editors[model]


def batch_bound(latents: torch.Tensor) -> float:
    return 32 * torch.finfo(torch.float32).eps * max(1.0, latents.abs().max().item())


def stock(editor: MaskAwareEditor, request: EditRequest, negative: str | None,
          guidance: float | None = None) -> torch.Tensor:
    """The stock pipeline's final latents for `request` (checked), from the edit's own initial noise."""
    template = editor.templates[request.template_id]
    inputs = editor.prepare_edit(request, template)
    kwargs = editor.pipeline_kwargs([template], [inputs.mask], [request.prompt], inputs.latents[None], "latent",
                                    negative_prompts=[negative], guidance=guidance)
    assert guidance is None or kwargs["guidance_scale"] == guidance
    with torch.inference_mode():
        return editor.pipe(**kwargs).images[0]


@pytest.mark.parametrize("model,mode", [(model, "y") for model in GUIDED] + [("tiny-sd3-inpaint", "kv")])
def test_every_token_masked_equals_the_stock_pipeline_with_that_negative_prompt(model, mode):
    editor = editor_for(model)
    editor.switch_cache_mode(mode)
    try:
        template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=0)
        request = editor.check_request(EditRequest(template_id, EVERYTHING, "a red sofa", seed=5,
                                                   negative_prompt=NEGATIVE))
        edited = editor.edit_many([request], output_type="latent")[0]
        assert torch.equal(edited, stock(editor, request, NEGATIVE))
        # and the negative prompt did something: the same edit without one is another image
        plain = editor.edit(template_id, EVERYTHING, "a red sofa", seed=5, output_type="latent")
        assert max_diff(edited, plain) > 1e-2
    finally:
        editor.switch_cache_mode("y")


@pytest.mark.parametrize("model", ["tiny-sd3-inpaint", "tiny-sdxl-inpaint"])
def test_a_template_is_recorded_with_its_negative_prompt_and_has_its_own_id(model, monkeypatch):
    editor = editor_for(model)
    calls = []
    pipeline_kwargs = editor.pipeline_kwargs

    def spy(*args, **kwargs):
        calls.append(pipeline_kwargs(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(editor, "pipeline_kwargs", spy)
    with_negative = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=1,
                                             negative_prompt=NEGATIVE)
    [recorded_run] = calls
    assert recorded_run["negative_prompt"] == [NEGATIVE] and recorded_run["prompt"] == ["a scene"]
    without = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=1)
    assert "negative_prompt" not in calls[-1]  # the pipeline's own default (SDXL: zeros, not an encoded "")
    assert with_negative != without and editor.templates[with_negative].negative_prompt == NEGATIVE
    # Edits keep the template's recorded activations outside their masks: those of its own run.
    edits = [editor.edit(template_id, square_mask(), "a red hat", seed=5, output_type="latent")
             for template_id in (with_negative, without)]
    assert max_diff(*edits) > 1e-3


@pytest.mark.parametrize("model", GUIDED)
def test_every_token_masked_equals_the_stock_pipeline_at_the_edits_own_guidance(model):
    editor = editor_for(model)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=6)
    request = editor.check_request(EditRequest(template_id, EVERYTHING, "a red sofa", seed=5, guidance=2.5))
    assert request.guidance == 2.5
    edited = editor.edit_many([request], output_type="latent")[0]
    assert torch.equal(edited, stock(editor, request, None, guidance=2.5))
    assert torch.equal(editor.edit(template_id, EVERYTHING, "a red sofa", seed=5, guidance=2.5, output_type="latent"),
                       edited)
    plain = editor.edit(template_id, EVERYTHING, "a red sofa", seed=5, output_type="latent")
    assert max_diff(edited, plain) > 1e-2
    # the template's own scale is no other scale: the request runs as one without any
    same = editor.check_request(EditRequest(template_id, EVERYTHING, "a hat", guidance=editor.default_guidance))
    assert same.guidance is None


def test_ids_of_templates_without_a_negative_prompt_are_as_earlier_releases_made_them():
    """Disk tiers adopt recordings by template id, and registries keep ids: a release that adds a field must
    not rename the templates that do not use it."""
    editor = editor_for("tiny-sd2-inpaint")
    image = template_image()
    template = editor.new_template(image, prompt="a scene", steps=STEPS, seed=2)
    digest = hashlib.sha256(f"{editor.model.name}|{image.size}|a scene|{STEPS}|2|None|".encode())
    digest.update(image.tobytes())
    assert template.template_id == digest.hexdigest()[:16]
    head = hashlib.sha256(image.tobytes())
    head.update(f"|owner|{image.size}|a scene|{STEPS}|2|None".encode())
    assert template_id_of(image, "a scene", STEPS, 2, None, "owner") == "tpl-" + head.hexdigest()[:24]
    assert template_id_of(image, "a scene", STEPS, 2, None, "owner", negative_prompt=NEGATIVE) != \
        template_id_of(image, "a scene", STEPS, 2, None, "owner")


@pytest.mark.parametrize("model", ["tiny-sdxl-inpaint", "tiny-sd3-inpaint"])
def test_the_loop_batches_other_negative_prompts_and_scales_and_equals_each_edit_alone(model):
    editor = editor_for(model)
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=3, guidance=6.0)
    requests = [EditRequest(template_id, square_mask(), "a red hat", seed=5, negative_prompt="blurry"),
                EditRequest(template_id, square_mask((16, 48, 79, 95)), "a blue door", seed=7,
                            negative_prompt="a green door, watermark"),
                EditRequest(template_id, square_mask((64, 64, 120, 120)), "a cat", seed=9)]
    requests += [EditRequest(template_id, square_mask((8, 8, 40, 40)), "a lamp", seed=11, guidance=2.0),
                 EditRequest(template_id, square_mask((40, 72, 100, 120)), "a rug", seed=13, guidance=9.0,
                             negative_prompt="blurry")]
    jobs = [Worker.new_job(editor.check_request(request)) for request in requests]
    run_loop(editor, EngineConfig(mode="naive"), jobs)
    for job, request in zip(jobs, requests):
        alone = editor.edit_many([request], output_type="latent")[0]
        assert max_diff(job.row.latents[0], alone) <= batch_bound(alone)
    with_blurry = jobs[0].row.latents[0]
    other = editor.edit(template_id, square_mask(), "a red hat", seed=5, negative_prompt="sharp",
                        output_type="latent")
    assert max_diff(with_blurry, other) > 1e-2


def test_a_helper_prepares_the_negative_prompt_sent_over_the_wire():
    editor = editor_for("tiny-sd2-inpaint")
    template_id = editor.register_template(template_image(), prompt="a scene", steps=STEPS, seed=4,
                                           negative_prompt="dark")
    request = editor.check_request(EditRequest(template_id, square_mask(), "a red hat", seed=5,
                                               negative_prompt=NEGATIVE, guidance=3.5))
    template = editor.templates[template_id]
    header, tensors, blobs = wire.decode(processing.handle(editor, processing.prepare_message(1, request, template)))
    assert header["kind"] == "prepared", header
    back = processing.ready_from_message(header, tensors, blobs, template)
    inline = processing.preprocess(editor, request, template)
    assert back.prepared.guidance == inline.prepared.guidance == 3.5
    for name, tensor in inline.prepared.inputs.items():
        assert torch.equal(back.prepared.inputs[name], tensor), name
    # and a template's recording prepared there is made with the template's own negative prompt
    header, tensors, blobs = wire.decode(processing.handle(editor, processing.recording_message(2, template, True)))
    recorded = processing.ready_from_message(header, tensors, blobs, template)
    inline = processing.prepare_recording(editor, template)
    for name, tensor in inline.prepared.inputs.items():
        assert torch.equal(recorded.prepared.inputs[name], tensor), name


@pytest.mark.parametrize("model,guidance,words", [
    ("tiny-flux-fill", None, "Flux models are guidance-distilled"),
    ("tiny-sd2-inpaint", 1.0, "needs classifier-free guidance (guidance > 1); the guidance here is 1"),
])
def test_a_negative_prompt_that_would_do_nothing_is_refused_naming_it(model, guidance, words):
    editor = editor_for(model)
    with pytest.raises(InputError, match="negative_prompt") as refused:
        editor.register_template(template_image(), steps=STEPS, guidance=guidance, negative_prompt=NEGATIVE)
    assert words in str(refused.value)
    template_id = editor.register_template(template_image(), steps=STEPS, guidance=guidance)
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        editor.check_request(EditRequest(template_id, square_mask(), "a hat", negative_prompt=NEGATIVE))
    # blank is none, wherever it would be refused or not
    assert editor.check_request(EditRequest(template_id, square_mask(), "a hat", negative_prompt=" ")) \
        .negative_prompt is None


@pytest.mark.parametrize("model,recorded,asked,words", [
    ("tiny-flux-fill", None, 2.0, "guidance: Flux models take guidance as an input of every block"),
    ("tiny-sd2-inpaint", 1.0, 5.0, "was recorded without classifier-free guidance (guidance 1), so its edits run "
     "without it; got 5"),
    ("tiny-sd2-inpaint", None, 1.0, "run classifier-free guidance, as its recording (guidance 7.5): send a guidance "
     "> 1, got 1"),
])
def test_a_guidance_scale_the_recording_cannot_serve_is_refused_naming_it(model, recorded, asked, words):
    editor = editor_for(model)
    template_id = editor.register_template(template_image(), steps=STEPS, guidance=recorded)
    with pytest.raises(InputError) as refused:
        editor.check_request(EditRequest(template_id, square_mask(), "a hat", guidance=asked))
    assert words in str(refused.value)
    with pytest.raises(InputError, match="guidance must be a number >= 0"):
        editor.check_request(EditRequest(template_id, square_mask(), "a hat", guidance=float("nan")))


def test_a_negative_prompt_of_another_type_and_a_batch_mixing_none_with_some_are_refused():
    editor = editor_for("tiny-sd2-inpaint")
    template_id = editor.register_template(template_image(), steps=STEPS)
    with pytest.raises(InputError, match="negative_prompt must be a string, got list"):
        editor.check_request(EditRequest(template_id, square_mask(), "a hat", negative_prompt=["x"]))
    # One pipeline call has one kind of negative embeddings: SDXL's for none are zeros, not an encoded "".
    with pytest.raises(InputError, match="all give a negative_prompt or none do"):
        editor.edit_many([EditRequest(template_id, square_mask(), "a hat", negative_prompt="x"),
                          EditRequest(template_id, square_mask(), "a hat")])
    with pytest.raises(InputError, match="edit_many batches edits of one guidance scale"):
        editor.edit_many([EditRequest(template_id, square_mask(), "a hat", guidance=3.0),
                          EditRequest(template_id, square_mask(), "a hat")])


@pytest.mark.parametrize("model,flags,words", [
    ("tiny-flux-fill", [], "--negative-prompt: Flux models are guidance-distilled"),
    ("tiny-sd2-inpaint", ["--guidance", "1"], "--negative-prompt needs classifier-free guidance (--guidance > 1); "
     "the guidance here is 1"),
])
def test_the_cli_refuses_a_negative_prompt_that_would_do_nothing_in_one_line_naming_its_flags(model, flags, words,
                                                                                          tmp_path):
    template_image().save(tmp_path / "t.png")
    square_mask().save(tmp_path / "m.png")
    done = subprocess.run([sys.executable, "-m", "retouch.cli", "edit", "--model", model, "--image",
                           str(tmp_path / "t.png"), "--mask", str(tmp_path / "m.png"), "--prompt", "a hat",
                           "--negative-prompt", "blurry", "--steps", "1", *flags, "--out", str(tmp_path / "e.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert words in done.stderr
    assert not (tmp_path / "e.png").exists()


# ---- the HTTP head, against a scripted worker ----

async def head_answers(family: str) -> dict:
    router = Router(RouterConfig(address="tcp://127.0.0.1:0", policy="least-requests", heartbeat_s=0.05,
                                 dead_after_s=60.0, family=family)).start()
    context = zmq.Context()
    app = create_app(router, Limits(default_steps=2, request_timeout_s=20, max_prompt_chars=40))
    image = ("t.png", png_bytes(Image.new("RGB", (32, 32), "red")), "image/png")
    mask = ("m.png", png_bytes(Image.new("L", (32, 32), 255)), "image/png")
    alpha_mask = ("m.png", png_bytes(Image.new("RGBA", (32, 32), (0, 0, 0, 0))), "image/png")
    answers: dict = {}
    try:
        worker = ScriptedWorker(context, router, "w0")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retouch") as client:
            async def post(path: str, data: dict, files: dict) -> httpx.Response:
                return await client.post(path, data=data, files=files)

            answers["limits"] = (await client.get("/v1/limits")).json()
            plain = await post("/v1/templates", {"steps": "2"}, {"image": image})
            answers["template"] = await post("/v1/templates", {"steps": "2", "negative_prompt": NEGATIVE},
                                             {"image": image})
            answers["unguided template"] = await post(
                "/v1/templates", {"steps": "2", "guidance": "1", "negative_prompt": NEGATIVE}, {"image": image})
            answers["too long"] = await post("/v1/edits", {"template_id": plain.json()["id"], "prompt": "a cat",
                                                           "negative_prompt": "x" * 41}, {"mask": mask})
            answers["plain id"] = plain.json()["id"] if plain.status_code == 202 else None
            if family.startswith("flux"):  # refused before it is routed: the template need not be ready
                answers["flux guidance"] = await post("/v1/edits", {"template_id": answers["plain id"],
                                                                    "prompt": "a cat", "guidance": "4"}, {"mask": mask})
            if answers["template"].status_code != 202:
                return answers
            registered = answers["template"].json()["id"]
            sent = [await asyncio.to_thread(worker.receive, "register") for _ in range(2)]
            answers["register"] = {message["template"]: message for message in sent}
            worker.send({"kind": "template", "template": registered, "ok": True})
            await asyncio.to_thread(worker.sync)
            answers["listed"] = (await client.get(f"/v1/templates/{registered}")).json()
            for guidance in ("4", "1"):
                answers[f"guidance {guidance}"] = asyncio.create_task(post(
                    "/v1/edits", {"template_id": registered, "prompt": "a cat", "guidance": guidance}, {"mask": mask}))
                if guidance == "4" and family == "sd2":
                    edit = await asyncio.to_thread(worker.receive, "edit")
                    answers["guidance edit"] = edit
                    worker.answer(edit["request"], png_bytes(Image.new("RGB", (32, 32), "blue")))
                answers[f"guidance {guidance}"] = await answers[f"guidance {guidance}"]
            for path, files in (("/v1/edits", {"mask": mask}), ("/v1/images/edits", {"mask": alpha_mask})):
                guidance = {"guidance": "5"} if path == "/v1/images/edits" else {}  # an extra field there
                answer = asyncio.create_task(post(path, {"template_id": registered, "prompt": "a cat",
                                                          "negative_prompt": f"  {NEGATIVE}  ", **guidance}, files))
                edit = await asyncio.to_thread(worker.receive, "edit")
                worker.answer(edit["request"], png_bytes(Image.new("RGB", (32, 32), "blue")))
                answers[path] = (await answer, edit)
    finally:
        router.close(drain_s=0)
        context.destroy(linger=0)
    return answers


def test_the_head_sends_a_negative_prompt_and_an_edits_guidance_to_the_workers():
    answers = asyncio.run(head_answers("sd2"))
    assert answers["limits"]["negative_prompt"] is answers["limits"]["edit_guidance"] is True  # forms follow it
    assert answers["template"].status_code == 202, answers["template"].text
    assert answers["template"].json()["id"] != answers["plain id"]
    registered = answers["register"]
    assert registered[answers["template"].json()["id"]]["negative_prompt"] == NEGATIVE
    assert "negative_prompt" not in registered[answers["plain id"]]
    assert answers["listed"]["negative_prompt"] == NEGATIVE and answers["listed"]["status"] == "ready"
    for path in ("/v1/edits", "/v1/images/edits"):
        answer, edit = answers[path]
        assert answer.status_code == 200, answer.text
        assert edit["negative_prompt"] == NEGATIVE  # stripped, as prompts are
    refused = answers["unguided template"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "negative_prompt"
    assert "guidance here is 1" in refused.json()["error"]["message"]
    too_long = answers["too long"]
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "negative_prompt"
    assert answers["guidance 4"].status_code == 200 and answers["guidance edit"]["guidance"] == 4
    assert "guidance" not in answers["/v1/edits"][1]  # the template's: nothing to say
    assert answers["/v1/images/edits"][1]["guidance"] == 5
    unguided = answers["guidance 1"]
    assert unguided.status_code == 422 and unguided.json()["error"]["param"] == "guidance"
    assert "send a guidance > 1, got 1" in unguided.json()["error"]["message"]


def test_the_head_refuses_a_negative_prompt_or_another_guidance_for_a_flux_model_before_anything_is_made():
    answers = asyncio.run(head_answers("flux-fill"))
    refused = answers["template"]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "negative_prompt"
    assert "guidance-distilled" in refused.json()["error"]["message"]
    assert "register" not in answers and answers["limits"]["negative_prompt"] is answers["limits"]["edit_guidance"] \
        is False
    guided = answers["flux guidance"]
    assert guided.status_code == 422 and guided.json()["error"]["param"] == "guidance"
    assert "recorded with guidance the model's default (Flux models take guidance as an input of every block" in \
        guided.json()["error"]["message"]


# ---- through `retouch serve` ----

@pytest.fixture(scope="module")
def served():
    opts = ServeOptions(model="tiny-sd2-inpaint", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                        heartbeat_s=0.2, dead_after_s=5.0)
    with Server(opts).start() as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def served_edit(client: httpx.Client, fields: dict) -> np.ndarray:
    files = {"mask": ("m.png", png_bytes(EVERYTHING), "image/png")}
    if "template_id" not in fields:
        files["image"] = ("t.png", png_bytes(template_image()), "image/png")
    answer = client.post("/v1/edits", data={"prompt": "a red sofa", "seed": "1", **fields}, files=files)
    assert answer.status_code == 200, answer.text
    return np.asarray(Image.open(io.BytesIO(answer.content)).convert("RGB"), dtype=np.int16)


def test_a_served_edit_runs_the_negative_prompt_and_guidance_it_was_sent(served):
    registered = served.post("/v1/templates", data={"steps": "2", "negative_prompt": "dark", "prompt": "a room"},
                             files={"image": ("t.png", png_bytes(template_image()), "image/png")})
    assert registered.status_code in (200, 202), registered.text
    template_id = registered.json()["id"]
    assert served.get(f"/v1/templates/{template_id}", params={"wait": 60}).json()["status"] == "ready"
    with_negative = served_edit(served, {"template_id": template_id, "negative_prompt": NEGATIVE})
    assert np.array_equal(with_negative, served_edit(served, {"template_id": template_id,
                                                              "negative_prompt": NEGATIVE}))
    assert np.abs(with_negative - served_edit(served, {"template_id": template_id})).max() > 2
    guided = served_edit(served, {"template_id": template_id, "guidance": "3"})
    assert np.array_equal(guided, served_edit(served, {"template_id": template_id, "guidance": "3"}))
    assert np.abs(guided - served_edit(served, {"template_id": template_id})).max() > 2
    one_off = served_edit(served, {"negative_prompt": NEGATIVE, "steps": "2"})
    assert np.abs(one_off - served_edit(served, {"steps": "2", "seed": "1"})).max() > 2
