"""The playground at `/`, driven in a real headless Chromium (Debian's, through playwright): upload an
image, paint a stroke with the mouse, submit, and get back an image whose pixels outside the painted
mask are the upload's, byte for byte; with API keys, the key typed into the page is what opens /v1.

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
# The stroke, as fractions of the displayed image: across the sky, where the docs' screenshot asks
# for a balloon.
STROKE = [(0.18, 0.22), (0.28, 0.14), (0.40, 0.20), (0.52, 0.13), (0.62, 0.22)]
WAIT_MS = 60_000


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


def serve(**options) -> Server:
    return Server(ServeOptions(model="tiny-flux-fill", workers=1, port=0, mode="naive", worker_threads=1, steps=2,
                               heartbeat_s=0.1, dead_after_s=5.0, **options)).start()


@pytest.fixture(scope="module")
def server():
    with serve() as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{API_KEY}\n")
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
        .observe(document.getElementById("preview"), {attributes: true, attributeFilter: ["src"]});
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
    expect(page.locator("#progress-text")).to_have_text(f"step {STEPS} of {STEPS}")
    progress_seen = page.evaluate("window.progressSeen")
    steps_seen = [text for text in progress_seen if text.startswith("step ")]
    assert steps_seen == [f"step {k} of {STEPS}" for k in range(1, STEPS + 1)], progress_seen
    assert page.evaluate("window.previewsSeen") >= 1
    expect(page.locator("#latency")).to_have_text(re.compile(r"^\d+\.\d\d s$"))
    expect(page.locator("#mask-ratio")).to_have_text(re.compile(r"^\d+\.\d %$"))
    assert page.locator("#mask-ratio").text_content() != "0.0 %"

    edited = image_of(page, "#result")
    assert edited.size == SIZE
    edited, upload = np.asarray(edited.convert("RGB")), np.asarray(template)
    assert np.array_equal(edited[~mask], upload[~mask]), "pixels outside the mask changed"
    assert not np.array_equal(edited[mask], upload[mask]), "the edit repainted nothing"
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
    expect(page.locator("#status")).to_contain_text("missing or wrong API key")
    expect(page.locator("#api-key")).to_have_attribute("aria-invalid", "true")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Enter")
    expect(page.locator(f"#template-select option[value='{template_id}']")).to_have_count(1)
    expect(page.locator("#stage")).to_be_visible()  # the newest template is shown
    expect(page.locator("#api-key")).not_to_have_attribute("aria-invalid", "true")

    page.reload()  # the key is remembered
    expect(page.locator("#api-key")).to_have_value(API_KEY)
    expect(page.locator(f"#template-select option[value='{template_id}']")).to_have_count(1)
    assert page_errors == []
