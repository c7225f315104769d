"""The playground at `/`, driven in a real headless Chromium (Debian's, through playwright): upload an
image, paint a stroke with the mouse, submit, and get back an image whose pixels outside the painted
mask are the upload's, byte for byte; with API keys, the key typed into the page is what opens /v1 and
a new key shows that tenant's templates only. Also: the layout at narrow and short windows (Submit and
the mask canvas uncovered), the mask always of the template shown, a template the server lost
registered again, previews that keep the template outside the mask, accessible names, the keyboard,
and the server's errors in the page's words.

Chromium is /usr/bin/chromium; where it is missing, the set-up installs Debian's package if it can
(root and apt-get) and skips, saying why, if it cannot. playwright never downloads a browser here.
A screenshot goes to out/playground.png; RETOUCH_UPDATE_DOCS=1 also refreshes docs/playground.png."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw

from retouch.config import ServeOptions
from retouch.images import png_bytes
from retouch.server import Server

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (requirements.txt) is not installed")
expect = sync_api.expect

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_TIMEOUT_S = 600
SIZE = (256, 192)
STEPS = 3  # typed into the page's steps field: the template records, and every edit of it runs, this many
VIEWPORT = {"width": 1280, "height": 720}
API_KEY = "sk-playground-0123456789"
OTHER_KEY = "sk-playground-other-tenant"
# The stroke, as fractions of the displayed image: across the sky, where the docs' screenshot asks
# for a balloon.
STROKE = [(0.18, 0.22), (0.28, 0.14), (0.40, 0.20), (0.52, 0.13), (0.62, 0.22)]
WAIT_MS = 60_000
# Every wait is for a state, never a fixed time; a loaded machine (CI's two cores running the server, its
# worker and chromium) may take longer than playwright's 5 s default to reach it.
expect.set_options(timeout=WAIT_MS)


def install_chromium() -> None:
    """Debian's chromium through apt-get, or a skip that says why not."""
    if shutil.which("apt-get") is None:
        pytest.skip(f"{CHROMIUM} is missing and there is no apt-get to install Debian's chromium")
    if os.geteuid() != 0:
        pytest.skip(f"{CHROMIUM} is missing and installing it (apt-get install chromium) needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        try:
            subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=True)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"could not install chromium: `{' '.join(command)}` failed: {exc.stderr.strip()[-500:]}")
        except subprocess.TimeoutExpired:
            pytest.skip(f"could not install chromium: `{' '.join(command)}` took over {INSTALL_TIMEOUT_S} s")
    if not CHROMIUM.exists():
        pytest.skip(f"apt-get installed chromium but {CHROMIUM} is not there (not Debian's package?)")


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        install_chromium()
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium):
    # Module-scoped: playwright's sync API keeps an event loop of its own while it runs, and the
    # other modules' asyncio.run should never meet it.
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: the test may run as root in a container, where Chromium's sandbox cannot start.
        browser = playwright.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
        yield browser
        browser.close()


def serve(model: str = "tiny-flux-fill", **options) -> Server:
    return Server(ServeOptions(model=model, workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                               heartbeat_s=0.1, dead_after_s=5.0, **options)).start()


@pytest.fixture(scope="module")
def server():
    with serve() as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{API_KEY}\n{OTHER_KEY}\n")
    with serve(api_keys_file=keys) as running:
        yield running


@pytest.fixture
def page_errors() -> list:
    return []


@pytest.fixture
def page(browser, page_errors):
    """A fresh page (its own storage) that records the script errors it meets in `page_errors`."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.on("pageerror", lambda error: page_errors.append(error))
    yield page
    context.close()


def scene(size=SIZE) -> Image.Image:
    """A template that reads as a picture in the docs' screenshot: sky, sun, hills, a house."""
    width, height = size
    sky = np.linspace([70, 120, 200], [250, 200, 160], height)[:, None, :].repeat(width, axis=1)
    image = Image.fromarray(sky.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((0.74 * width, 0.10 * height, 0.88 * width, 0.29 * height), fill=(255, 226, 120))
    draw.ellipse((-0.3 * width, 0.55 * height, 0.7 * width, 1.5 * height), fill=(86, 140, 74))
    draw.ellipse((0.35 * width, 0.62 * height, 1.3 * width, 1.6 * height), fill=(60, 112, 58))
    house = (0.56 * width, 0.52 * height, 0.74 * width, 0.72 * height)
    draw.rectangle(house, fill=(222, 210, 188))
    draw.polygon([(house[0] - 6, house[1]), ((house[0] + house[2]) / 2, house[1] - 24), (house[2] + 6, house[1])],
                 fill=(170, 64, 52))
    draw.rectangle((0.63 * width, 0.62 * height, 0.67 * width, 0.72 * height), fill=(92, 60, 40))
    return image


# Every text the edit's progress line shows, and how many previews come, as the page changes them:
# the final DOM alone would not tell a live progress bar from one set once at the end.
RECORD_PROGRESS = """() => {
    window.progressSeen = [];
    window.previewsSeen = 0;
    new MutationObserver((records) => {
        for (const record of records) for (const node of record.addedNodes) window.progressSeen.push(node.textContent);
    }).observe(document.getElementById("progress-text"), {childList: true});
    new MutationObserver(() => { window.previewsSeen++; })
        .observe(document.getElementById("preview"), {attributes: true, attributeFilter: ["data-step"]});
}"""


def data_url_bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def image_of(page, selector: str) -> Image.Image:
    """The image an <img> shows (a blob: or data: URL), as the page holds it."""
    url = page.eval_on_selector(selector, """async (img) => {
        const blob = await (await fetch(img.src)).blob();
        return await new Promise((resolve) => {
            const reader = new FileReader();
            reader.onload = () => resolve(reader.result);
            reader.readAsDataURL(blob);
        });
    }""")
    return Image.open(io.BytesIO(data_url_bytes(url)))


def painted_mask(page) -> np.ndarray:
    """The mask the page sends, read from its overlay: a pixel is masked where the overlay is not
    transparent. [H, W] bool."""
    url = page.eval_on_selector("#mask-canvas", "canvas => canvas.toDataURL('image/png')")
    return np.asarray(Image.open(io.BytesIO(data_url_bytes(url))).convert("RGBA"))[..., 3] > 0


def distance_to_polyline(points: list[tuple[float, float]], size: tuple[int, int]) -> np.ndarray:
    """Each pixel centre's distance to the polyline through `points` (image pixels). [H, W]"""
    ys, xs = np.mgrid[0:size[1], 0:size[0]] + 0.5
    nearest = np.full(xs.shape, np.inf)
    for (ax, ay), (bx, by) in zip(points, points[1:]):
        dx, dy = bx - ax, by - ay
        t = np.clip(((xs - ax) * dx + (ys - ay) * dy) / max(dx * dx + dy * dy, 1e-9), 0, 1)
        nearest = np.minimum(nearest, np.hypot(xs - ax - t * dx, ys - ay - t * dy))
    return nearest


def paint(page, fractions: list[tuple[float, float]]) -> tuple[list[tuple[float, float]], float]:
    """Drag the mouse through `fractions` of the displayed mask canvas; the same points in image
    pixels, and the size of one CSS pixel in image pixels."""
    box = page.locator("#mask-canvas").bounding_box()
    screen = [(box["x"] + fx * box["width"], box["y"] + fy * box["height"]) for fx, fy in fractions]
    page.mouse.move(*screen[0])
    page.mouse.down()
    for point in screen[1:]:
        page.mouse.move(*point, steps=5)
    page.mouse.up()
    scale = SIZE[0] / box["width"]
    return [((x - box["x"]) * scale, (y - box["y"]) * scale) for x, y in screen], scale


def test_playground_paints_a_mask_and_keeps_every_pixel_outside_it(server, page, page_errors):
    template = scene()
    page.goto(server.url + "/")
    page.fill("#steps", str(STEPS))
    page.set_input_files("#file", files=[{"name": "scene.png", "mimeType": "image/png", "buffer": png_bytes(template)}])
    expect(page.locator("#template-progress")).to_contain_text(f"ready: {STEPS} steps recorded", timeout=WAIT_MS)
    expect(page.locator("#stage")).to_be_visible()
    assert page.eval_on_selector("#mask-canvas", "c => [c.width, c.height]") == list(SIZE)

    stroke, css_pixel = paint(page, STROKE)
    radius = int(page.input_value("#brush-size")) / 2
    mask = painted_mask(page)
    distance = distance_to_polyline(stroke, SIZE)
    slack = 1 + css_pixel  # mouse positions reach the page rounded to CSS pixels
    assert mask.any(), "the stroke painted nothing"
    assert not mask[distance > radius + slack].any(), "the mask reaches beyond the stroke"
    assert mask[distance < radius - slack].all(), "the mask misses part of the stroke"
    shown = page.text_content("#mask-coverage")
    assert shown.endswith(" %") and abs(float(shown[:-2]) - 100 * mask.mean()) <= 0.05 + 1e-9, shown

    page.fill("#prompt", "a red hot-air balloon")
    page.fill("#seed", "7")
    page.evaluate(RECORD_PROGRESS)
    page.click("#submit")
    expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#progress-text")).to_have_text(f"done: {STEPS} steps")
    progress_seen = page.evaluate("window.progressSeen")
    steps_seen = [text for text in progress_seen if text.startswith("step ")]
    # the last step is followed by the server's decode and encode: a stage of its own, not a full bar
    assert steps_seen == [f"step {k} of {STEPS}" for k in range(1, STEPS)], progress_seen
    assert progress_seen.index("finishing: decoding the image") > progress_seen.index(steps_seen[-1]), progress_seen
    assert page.evaluate("window.previewsSeen") >= 1
    expect(page.locator("#latency")).to_have_text(re.compile(r"^\d+\.\d\d s$"))
    expect(page.locator("#mask-ratio")).to_have_text(re.compile(r"^\d+\.\d %$"))
    assert page.locator("#mask-ratio").text_content() != "0.0 %"

    edited = image_of(page, "#result")
    assert edited.size == SIZE
    edited, upload = np.asarray(edited.convert("RGB")), np.asarray(template)
    assert np.array_equal(edited[~mask], upload[~mask]), "pixels outside the mask changed"
    assert not np.array_equal(edited[mask], upload[mask]), "the edit repainted nothing"
    # the page keeps the upload's name: in the list of templates and in the download's file name
    expect(page.locator("#template-select option:checked")).to_have_text(re.compile(r"^scene\.png · "))
    expect(page.locator("#download")).to_have_attribute("download", "scene-edit-1.png")
    assert page_errors == []

    screenshot = ROOT / "out" / "playground.png"
    screenshot.parent.mkdir(exist_ok=True)
    page.screenshot(path=screenshot)
    if os.environ.get("RETOUCH_UPDATE_DOCS") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(screenshot, ROOT / "docs" / "playground.png")


def test_playground_sends_the_api_key_it_is_given(keyed_server, page, page_errors):
    registered = httpx.post(keyed_server.url + "/v1/templates", headers={"Authorization": f"Bearer {API_KEY}"},
                            files={"image": ("scene.png", png_bytes(scene((64, 48))), "image/png")}, timeout=30)
    assert registered.status_code in (200, 202), registered.text
    template_id = registered.json()["id"]

    page.goto(keyed_server.url + "/")
    expect(page.locator("#alert")).to_contain_text("missing or wrong API key")
    expect(page.locator("#api-key")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#api-key")).to_be_focused()  # where the message points
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    expect(page.locator(f"#template-select option[value='{template_id}']")).to_have_count(1)
    expect(page.locator("#stage")).to_be_visible()  # the newest template is shown
    expect(page.locator("#api-key")).not_to_have_attribute("aria-invalid", "true")

    page.reload()  # the key is remembered
    expect(page.locator("#api-key")).to_have_value(API_KEY)
    expect(page.locator(f"#template-select option[value='{template_id}']")).to_have_count(1)
    assert page_errors == []


# ---- helpers of the tests below ----

def upload(page, image: Image.Image, name: str = "scene.png") -> None:
    """Upload `image` through the page's file field and wait until its template is recorded."""
    page.fill("#steps", str(STEPS))
    page.set_input_files("#file", files=[{"name": name, "mimeType": "image/png", "buffer": png_bytes(image)}])
    expect(page.locator("#template-progress")).to_contain_text(f"ready: {STEPS} steps recorded", timeout=WAIT_MS)
    expect(page.locator("#submit")).to_be_enabled()


def register(server, image: Image.Image, key: str | None = None) -> str:
    """Register `image` through the API, as another client would; its template id."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(server.url + "/v1/templates", headers=headers, data={"steps": str(STEPS)},
                        files={"image": ("image.png", png_bytes(image), "image/png")}, timeout=30)
    assert answer.status_code in (200, 202), answer.text
    return answer.json()["id"]


def canvas_size(page) -> list[int]:
    return page.eval_on_selector("#mask-canvas", "canvas => [canvas.width, canvas.height]")


# What is on top at nine points of an element's box, by document.elementFromPoint: "self" where the
# element itself is hit; null where the point is outside the window.
TOP_ELEMENTS = """(element) => {
    const box = element.getBoundingClientRect();
    const hits = [];
    for (const fx of [0.05, 0.5, 0.95]) for (const fy of [0.05, 0.5, 0.95]) {
        const hit = document.elementFromPoint(box.left + fx * box.width, box.top + fy * box.height);
        hits.push(hit === element ? "self" : hit && (hit.id || hit.className || hit.tagName));
    }
    return hits;
}"""

# The boxes the page is made of: none may overlap another, at any window size.
BOXES = ["#template-fields", "#mask-fields", "#edit-fields", ".actions", "#template-panel", "#result-panel"]


def overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


# ---- layout ----

@pytest.mark.parametrize("width, height", [(375, 667), (800, 600), (1280, 720), (1440, 900)])
def test_the_mask_and_submit_are_in_reach_at_every_window_size(server, page, page_errors, width, height):
    page.set_viewport_size({"width": width, "height": height})
    page.goto(server.url + "/")
    upload(page, scene())
    submit = page.locator("#submit")
    if width > 900:  # one screen: Submit shows without scrolling anything
        assert submit.evaluate(TOP_ELEMENTS) == ["self"] * 9
        assert page.evaluate("document.documentElement.scrollHeight <= innerHeight")

    boxes = {selector: page.locator(selector).bounding_box() for selector in BOXES}
    for i, a in enumerate(BOXES):
        for b in BOXES[i + 1:]:
            # on one screen the Submit bar sticks over the controls scrolling under it, by design
            if width > 900 and {a, b} == {"#edit-fields", ".actions"}:
                continue
            assert not overlap(boxes[a], boxes[b]), (a, b, boxes)
    assert page.evaluate("document.documentElement.scrollWidth <= innerWidth"), "the page scrolls sideways"

    canvas = page.locator("#mask-canvas")
    canvas.scroll_into_view_if_needed()
    assert canvas.evaluate(TOP_ELEMENTS) == ["self"] * 9  # nothing covers any part of it
    paint(page, STROKE)
    assert painted_mask(page).any()
    page.fill("#prompt", "a red hot-air balloon")
    submit.scroll_into_view_if_needed()
    assert submit.evaluate(TOP_ELEMENTS) == ["self"] * 9
    submit.click()
    expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
    assert page_errors == []


# ---- the template shown and its mask ----

# Holds the page's fetch of one template's image until window.releaseImage() is called.
HOLD_IMAGE = """(templateId) => {
    const held = new Promise((resolve) => { window.releaseImage = resolve; });
    const fetchFirst = window.fetch;
    window.fetch = async (url, init) => {
        if (String(url).endsWith(`/${templateId}/image`)) await held;
        return fetchFirst(url, init);
    };
}"""


def test_the_mask_is_always_of_the_template_shown(server, page, page_errors):
    small, large = register(server, scene((64, 48))), register(server, scene((96, 64)))
    page.goto(server.url + "/")
    expect(page.locator(f"#template-select option[value='{large}']")).to_have_count(1)
    page.select_option("#template-select", small)
    page.wait_for_function("() => document.getElementById('mask-canvas').width === 64")
    expect(page.locator("#submit")).to_be_enabled()

    # while the next template's image loads, the shown one stays with its mask, and Submit waits
    page.evaluate(HOLD_IMAGE, large)
    page.select_option("#template-select", large)
    expect(page.locator("#submit")).to_be_disabled()
    assert canvas_size(page) == [64, 48]
    expect(page.locator("#template-info")).to_have_text(f"64×48 · {STEPS} steps")
    page.evaluate("window.releaseImage()")
    expect(page.locator("#submit")).to_be_enabled()
    assert canvas_size(page) == [96, 64]
    expect(page.locator("#template-info")).to_have_text(f"96×64 · {STEPS} steps")

    # an image that cannot be fetched: the template shown stays, and the page says why
    page.route(f"**/v1/templates/{small}/image", lambda route: route.abort())
    page.select_option("#template-select", small)
    expect(page.locator("#alert")).to_contain_text("could not show template")
    expect(page.locator("#template-select")).to_have_value(large)
    expect(page.locator("#submit")).to_be_enabled()
    assert canvas_size(page) == [96, 64]
    assert page_errors == []


def test_a_new_api_key_shows_that_tenants_templates_only(keyed_server, page, page_errors):
    mine = register(keyed_server, scene((64, 48)), API_KEY)
    page.goto(keyed_server.url + "/")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    expect(page.locator("#template-select")).to_have_value(mine)
    expect(page.locator("#stage")).to_be_visible()

    page.fill("#api-key", OTHER_KEY)  # another tenant, with no template yet
    page.press("#api-key", "Enter")
    expect(page.locator("#status")).to_have_text("upload an image to start")
    expect(page.locator("#stage")).to_be_hidden()
    expect(page.locator("#template-empty")).to_be_visible()
    expect(page.locator(f"#template-select option[value='{mine}']")).to_have_count(0)

    upload(page, scene((96, 64)), "theirs.png")
    theirs = page.input_value("#template-select")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    expect(page.locator("#template-select")).to_have_value(mine)
    page.wait_for_function("() => document.getElementById('mask-canvas').width === 64")
    expect(page.locator(f"#template-select option[value='{theirs}']")).to_have_count(0)
    assert page_errors == []


def test_a_template_the_server_lost_is_registered_again(server, page, page_errors):
    page.goto(server.url + "/")
    upload(page, scene((80, 60)), "lost.png")
    template_id = page.input_value("#template-select")
    paint(page, STROKE)
    page.fill("#prompt", "a kite")
    assert httpx.delete(f"{server.url}/v1/templates/{template_id}", timeout=30).status_code == 200

    page.click("#submit")
    expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
    # registered again from the page's copy, under the same id (ids are content hashes)
    assert httpx.get(f"{server.url}/v1/templates/{template_id}", timeout=30).status_code == 200
    expect(page.locator("#template-select")).to_have_value(template_id)
    expect(page.locator("#template-select option:checked")).to_have_text(re.compile(r"^lost\.png · "))
    assert page_errors == []


def test_on_a_guided_model_the_negative_prompt_is_sent_and_a_lost_template_keeps_its_own(page, page_errors):
    """On SD2 the form shows its negative-prompt field and the edit sends it; a template the server lost, registered
    with a negative prompt, is registered again with it: under its own id, as the recording it was."""
    with serve("tiny-sd2-inpaint") as sd2:
        registered = httpx.post(f"{sd2.url}/v1/templates", data={"steps": "2", "negative_prompt": "dark"},
                                files={"image": ("t.png", png_bytes(scene((64, 48))), "image/png")}, timeout=60).json()
        page.goto(sd2.url + "/")
        expect(page.locator("#template-select")).to_have_value(registered["id"], timeout=WAIT_MS)
        expect(page.locator("#negative-prompt")).to_be_visible()
        paint(page, STROKE)
        page.fill("#prompt", "a kite")
        page.fill("#negative-prompt", "blurry")
        page.evaluate("""() => {  // the negative prompt of each edit form sent (Chromium hides form bodies)
            window.negativeSent = [];
            const fetched = window.fetch;
            window.fetch = (url, init) => {
                if (String(url).endsWith("/v1/edits")) window.negativeSent.push(init.body.get("negative_prompt"));
                return fetched(url, init);
            };
        }""")
        assert httpx.delete(f"{sd2.url}/v1/templates/{registered['id']}", timeout=30).status_code == 200
        page.click("#submit")
        expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
        again = httpx.get(f"{sd2.url}/v1/templates/{registered['id']}", timeout=30)
        sent = page.evaluate("window.negativeSent")
    assert again.status_code == 200 and again.json()["negative_prompt"] == "dark"
    assert sent == ["blurry", "blurry"]  # the edit, and again once its template is registered again
    assert page_errors == []


# ---- the edit ----

def painted_edit(server, page, fields: dict[str, str]) -> tuple[Image.Image, np.ndarray]:
    """Upload the scene, paint the stroke, fill the prompt and `fields` (selector -> value), submit, and
    wait for the result: (the upload, the painted mask)."""
    template = scene()
    page.goto(server.url + "/")
    upload(page, template)
    paint(page, STROKE)
    mask = painted_mask(page)
    page.fill("#prompt", "a red hot-air balloon")
    for selector, value in fields.items():
        page.fill(selector, value)
    page.click("#submit")
    expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
    return template, mask


def test_previews_keep_the_template_outside_the_mask(server, page, page_errors):
    template, mask = painted_edit(server, page, {"#preview-every": "1"})
    expect(page.locator("#preview")).to_have_attribute("data-step", re.compile(r"^\d+$"))

    url = page.eval_on_selector("#preview", "canvas => canvas.toDataURL('image/png')")
    preview, upload_pixels = np.asarray(Image.open(io.BytesIO(data_url_bytes(url))).convert("RGB")), np.asarray(template)
    assert preview.shape == upload_pixels.shape
    assert np.array_equal(preview[~mask], upload_pixels[~mask]), "the preview changed pixels outside the mask"
    assert not np.array_equal(preview[mask], upload_pixels[mask]), "the preview shows nothing inside the mask"
    assert page_errors == []


# Edits that are never answered: only the page can end them (by aborting its fetch).
HANG_EDITS = """() => {
    const fetchFirst = window.fetch;
    window.fetch = (url, init = {}) => {
        if (!String(url).endsWith("/v1/edits")) return fetchFirst(url, init);
        return new Promise((_, reject) => {
            if (init.signal.aborted) reject(init.signal.reason);
            init.signal.addEventListener("abort", () => reject(init.signal.reason));
        });
    };
}"""


def test_keyboard_submits_cancels_and_keeps_the_focus(server, page, page_errors):
    other = register(server, scene((72, 54)))
    page.goto(server.url + "/")
    upload(page, scene())
    paint(page, STROKE)
    page.evaluate(HANG_EDITS)

    page.fill("#prompt", "a kite")
    page.press("#prompt", "Control+Enter")
    expect(page.locator("#cancel")).to_be_visible()
    expect(page.locator("#submit")).to_be_disabled()
    page.keyboard.press("Escape")
    expect(page.locator("#status")).to_have_text("edit cancelled")
    expect(page.locator("#cancel")).to_be_hidden()

    # Submit disables itself: the focus goes to Cancel, and back to Submit when Cancel hides
    page.click("#submit")
    expect(page.locator("#cancel")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator("#submit")).to_be_focused()
    expect(page.locator("#status")).to_have_text("edit cancelled")

    # another template picked mid-edit ends the edit, and the page says so
    page.click("#submit")
    expect(page.locator("#cancel")).to_be_visible()
    page.select_option("#template-select", other)
    expect(page.locator("#status")).to_have_text("edit cancelled; template loaded: paint a mask")

    # the mask canvas takes the keyboard: Space paints under the brush, Shift+arrows paint a line
    page.focus("#mask-canvas")
    page.keyboard.press("Space")
    dot = painted_mask(page).sum()
    assert dot > 0
    page.keyboard.press("Shift+ArrowRight")
    assert painted_mask(page).sum() > dot
    assert page_errors == []


def test_controls_have_accessible_names(server, page, page_errors):
    page.goto(server.url + "/")
    upload(page, scene())
    snapshot = page.locator("body").aria_snapshot()
    for line in ('slider "Brush size"', 'combobox "Registered"', 'button "Reload the list of templates"',
                 'application "mask: paint the region to repaint"', 'button "Submit"', 'progressbar "edit progress"',
                 'textbox "API key"', "- alert"):
        assert line in snapshot, snapshot
    assert "↻" not in snapshot, snapshot
    assert page_errors == []


# ---- the server's answers in the page's words ----

ACCEPTED = 'event: accepted\ndata: {"id":"e","steps":3,"mask_ratio":0.1,"masked_tokens":1,"image_tokens":10}\n\n'


@pytest.mark.parametrize("stream, said", [
    (ACCEPTED, "lost the connection to the server during the edit; it did not complete"),
    (ACCEPTED + "event: step\ndata: {not json\n\n", 'the server sent a "step" event this page cannot read'),
])
def test_a_broken_edit_stream_is_said_plainly(server, page, page_errors, stream, said):
    page.goto(server.url + "/")
    upload(page, scene())
    paint(page, STROKE)
    page.route("**/v1/edits", lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
    page.click("#submit")
    expect(page.locator("#alert")).to_contain_text(said)
    expect(page.locator("#mask-ratio")).to_have_text("–")  # no result, so no ratio of one
    expect(page.locator("#submit")).to_be_enabled()
    assert page_errors == []


def error_body(code: str, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def test_an_upload_over_the_limit_is_said_in_megabytes(server, page, page_errors):
    page.goto(server.url + "/")
    expect(page.locator("#status")).to_have_text(re.compile("upload an image"))  # the page knows the limits
    page.route("**/v1/templates", lambda route: route.fulfill(
        status=413, json=error_body("body_too_large", "request body over the limit of 33554432 bytes"))
        if route.request.method == "POST" else route.fallback())
    page.set_input_files("#file", files=[{"name": "big.png", "mimeType": "image/png", "buffer": png_bytes(scene())}])
    expect(page.locator("#alert")).to_have_text("could not register big.png: the image is too large to upload "
                                                "(limit 32 MB)")
    assert page_errors == []


def test_an_upload_refused_while_the_page_starts_stays_said(server, page, page_errors):
    """The page's greeting, once it has read the server's limits and templates, must not wipe the error of
    an upload made meanwhile (a slow server, a quick user)."""
    held = []
    page.route("**/v1/limits", lambda route: held.append(route))  # the page's start waits on this
    page.route("**/v1/templates", lambda route: route.fulfill(
        status=413, json=error_body("body_too_large", "request body over the limit of 33554432 bytes"))
        if route.request.method == "POST" else route.fallback())
    page.goto(server.url + "/")
    page.set_input_files("#file", files=[{"name": "big.png", "mimeType": "image/png", "buffer": png_bytes(scene())}])
    said = "could not register big.png: the image is too large to upload"
    expect(page.locator("#alert")).to_have_text(said)
    with page.expect_response(lambda answer: answer.url.endswith("/v1/templates")
                              and answer.request.method == "GET"):
        held[0].continue_()
    page.evaluate("() => new Promise((done) => setTimeout(done, 0))")  # the page's start has said its piece
    assert page.locator("#alert").text_content() == said and page_errors == []


def test_a_full_queue_is_tried_again_after_retry_after(server, page, page_errors):
    page.goto(server.url + "/")
    upload(page, scene())
    paint(page, STROKE)
    page.fill("#prompt", "a kite")
    # The first edit is refused with 429 in the page itself (a route would lose the form's files when
    # the second is let through).
    page.evaluate("""(refusal) => {
        const fetchFirst = window.fetch;
        window.refusals = 0;
        window.fetch = (url, init) => {
            if (!String(url).endsWith("/v1/edits") || window.refusals++) return fetchFirst(url, init);
            return Promise.resolve(new Response(JSON.stringify(refusal),
                {status: 429, headers: {"Retry-After": "1", "Content-Type": "application/json"}}));
        };
    }""", error_body("queue_full", "server busy"))
    page.evaluate("""() => {
        window.statusSeen = [];
        new MutationObserver(() => window.statusSeen.push(document.getElementById("status").textContent))
            .observe(document.getElementById("status"), {childList: true});
    }""")
    page.click("#submit")
    expect(page.locator("#result")).to_be_visible(timeout=WAIT_MS)
    assert page.evaluate("window.refusals") == 2  # refused once, then sent again
    assert "the server is busy; retrying in 1 s" in page.evaluate("window.statusSeen")
    assert page_errors == []


def test_a_strength_below_one_runs_the_last_steps_and_keeps_the_pixels_outside_the_mask(server, page, page_errors):
    template, mask = painted_edit(server, page, {"#strength": "0.5"})
    expect(page.locator("#progress-text")).to_have_text("done: 2 steps")  # Flux: 3 - int(3 - 1.5) of 3
    edited = np.asarray(image_of(page, "#result").convert("RGB"))
    assert np.array_equal(edited[~mask], np.asarray(template)[~mask])
    assert page_errors == []


def test_the_form_follows_the_servers_limits(server, page, page_errors):
    """The steps field takes what the server takes (GET /v1/limits), and says its default; a Flux server takes
    no negative prompt, so its field is not shown."""
    limits = httpx.get(server.url + "/v1/limits").json()
    page.goto(server.url + "/")
    expect(page.locator("#steps")).to_have_attribute("max", str(limits["max_steps"]))
    expect(page.locator("#steps")).to_have_attribute("placeholder", f"server default ({limits['default_steps']})")
    assert limits["negative_prompt"] is False
    expect(page.locator("#negative-prompt")).to_be_hidden()
    assert (limits["default_steps"], limits["max_upload_bytes"]) == (2, 32 << 20) and page_errors == []
