// The retouch playground: register or pick a template, paint its mask, run an edit and watch it.
// It is a client of the public HTTP API like any other (retouch/http_api.py); progress arrives as
// Server-Sent Events (retouch/http_events.py). Everything goes through fetch() because EventSource
// cannot send the Authorization header a server with API keys asks for.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "retouch.apiKey";
// Mask pixels as the overlay shows them (magenta reads over skin, sky and foliage alike). Alpha is
// what marks a pixel as masked: every masked pixel has exactly this alpha, every other pixel 0.
const OVERLAY = [255, 40, 130, 140];
const PIXELATED_FROM = 3; // display scales at or above this show image pixels as squares

// ---- the API ----

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// fetch() with the API key; a non-2xx answer throws ApiError carrying the server's error.message.
async function api(path, init = {}) {
  let response;
  try {
    response = await fetch(path, { ...init, headers: { ...apiHeaders(), ...(init.headers || {}) } });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, `cannot reach the server (${error.message})`);
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message || message;
    } catch (_) {
      // not the API's JSON error shape (a proxy's page, say): the status line says enough
    }
    $("api-key").setAttribute("aria-invalid", String(response.status === 401));
    throw new ApiError(response.status, message);
  }
  $("api-key").removeAttribute("aria-invalid");
  return response;
}

// The events of a text/event-stream body, as {event, data} with data parsed from JSON. Lines are cut
// out of each chunk as it comes, never by re-scanning what is buffered: a finished edit's event holds
// the whole PNG in base64 on one line, megabytes long.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let partial = [];
  let name = "message";
  let data = [];
  for (;;) {
    const { value: chunk, done } = await reader.read();
    if (done) return;
    let start = 0;
    for (let newline = chunk.indexOf("\n"); newline >= 0; newline = chunk.indexOf("\n", start)) {
      partial.push(chunk.slice(start, newline));
      start = newline + 1;
      let line = partial.join("");
      partial = [];
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (data.length) yield { event: name, data: JSON.parse(data.join("\n")) };
        name = "message";
        data = [];
      } else if (!line.startsWith(":")) { // ":" starts a comment: the server's keep-alive
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = text;
        else if (field === "data") data.push(text);
      }
    }
    partial.push(chunk.slice(start));
  }
}

// ---- the mask: one byte per template pixel (1 = repaint), drawn as a coloured overlay ----

class Mask {
  constructor(canvas) {
    this.canvas = canvas;
    this.context = canvas.getContext("2d");
    this.reset(1, 1);
  }

  reset(width, height) {
    this.width = width;
    this.height = height;
    this.canvas.width = width;
    this.canvas.height = height;
    this.pixels = new Uint8Array(width * height);
    this.painted = 0;
    this.overlay = this.context.createImageData(width, height);
    this.context.clearRect(0, 0, width, height);
  }

  // Sets (value 1) or clears (0) every pixel whose centre lies within `radius` of the segment a-b
  // (image pixels). Pixels are set exactly rather than through the canvas's antialiased paths:
  // the mask sent is what the overlay shows, and an eraser leaves no faint residue that would
  // still count as "repaint".
  stroke(a, b, radius, value) {
    const x0 = Math.max(0, Math.floor(Math.min(a.x, b.x) - radius));
    const x1 = Math.min(this.width - 1, Math.ceil(Math.max(a.x, b.x) + radius));
    const y0 = Math.max(0, Math.floor(Math.min(a.y, b.y) - radius));
    const y1 = Math.min(this.height - 1, Math.ceil(Math.max(a.y, b.y) + radius));
    if (x0 > x1 || y0 > y1) return;
    const dx = b.x - a.x;
    const dy = b.y - a.y;
    const length2 = dx * dx + dy * dy;
    const radius2 = radius * radius;
    for (let y = y0; y <= y1; y++) {
      for (let x = x0; x <= x1; x++) {
        const px = x + 0.5 - a.x;
        const py = y + 0.5 - a.y;
        const t = length2 ? Math.max(0, Math.min(1, (px * dx + py * dy) / length2)) : 0;
        const ex = px - t * dx;
        const ey = py - t * dy;
        if (ex * ex + ey * ey <= radius2) this.set(y * this.width + x, value);
      }
    }
    this.render(x0, y0, x1 - x0 + 1, y1 - y0 + 1);
  }

  set(index, value) {
    if (this.pixels[index] === value) return;
    this.pixels[index] = value;
    this.painted += value ? 1 : -1;
    const rgba = this.overlay.data;
    for (let c = 0; c < 4; c++) rgba[4 * index + c] = value ? OVERLAY[c] : 0;
  }

  clear() {
    this.pixels.fill(0);
    this.overlay.data.fill(0);
    this.painted = 0;
    this.render(0, 0, this.width, this.height);
  }

  invert() {
    for (let i = 0; i < this.pixels.length; i++) this.set(i, 1 - this.pixels[i]);
    this.render(0, 0, this.width, this.height);
  }

  render(x, y, width, height) {
    this.context.putImageData(this.overlay, 0, 0, x, y, width, height);
  }

  coverage() {
    return this.painted / this.pixels.length;
  }

  // What POST /v1/edits takes: a PNG of the template's size, white = repaint.
  png() {
    const canvas = document.createElement("canvas");
    canvas.width = this.width;
    canvas.height = this.height;
    const context = canvas.getContext("2d");
    const image = context.createImageData(this.width, this.height);
    const rgba = image.data;
    for (let i = 0; i < this.pixels.length; i++) {
      rgba[4 * i] = rgba[4 * i + 1] = rgba[4 * i + 2] = this.pixels[i] ? 255 : 0;
      rgba[4 * i + 3] = 255;
    }
    context.putImageData(image, 0, 0);
    return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
  }
}

// ---- the page ----

const mask = new Mask($("mask-canvas"));
const page = {
  template: null, // the template shown (its JSON from the API)
  watching: null, // AbortController of its recording's event stream
  editing: null, // AbortController of the edit in flight
  imageUrl: null, // object URL of the template image shown
  resultUrl: null,
  erasing: false,
  stroke: null, // the last point of the stroke being painted
};

function status(message, kind = "info") {
  const line = $("status");
  line.textContent = message;
  line.dataset.kind = kind;
}

function failed(error) {
  if (error.name === "AbortError") return;
  status(error.message, "error");
}

function meter(element, fraction, text, kind = "info") {
  element.hidden = false;
  element.dataset.kind = kind;
  element.querySelector(".fill").style.width = `${Math.round(100 * Math.max(0, Math.min(1, fraction)))}%`;
  element.querySelector(".text").textContent = text;
  if (element.getAttribute("role") === "progressbar") element.setAttribute("aria-valuenow", String(fraction));
}

function percent(fraction) {
  return `${(100 * fraction).toFixed(fraction > 0 && fraction < 0.001 ? 2 : 1)} %`;
}

// Fits a stage of the template's aspect into its viewport. Small templates are scaled up (a 96x64
// image would be a stamp otherwise), and from PIXELATED_FROM on their pixels show as squares.
function layout() {
  const template = page.template;
  if (!template) return;
  for (const [viewport, stage] of [["template-viewport", "stage"], ["result-viewport", "result-stage"]]) {
    const box = $(viewport).getBoundingClientRect();
    const scale = Math.min(box.width / template.width, box.height / template.height);
    $(stage).style.width = `${Math.floor(template.width * scale)}px`;
    $(stage).style.height = `${Math.floor(template.height * scale)}px`;
    $(stage).classList.toggle("pixelated", scale >= PIXELATED_FROM);
  }
}

// ---- templates ----

// What tells templates apart comes first: a narrow <select> cuts the end off.
function describe(template) {
  const name = template.prompt ? `"${template.prompt.slice(0, 24)}"` : template.id.replace(/^tpl-/, "").slice(0, 8);
  return `${template.width}×${template.height} · ${template.steps} steps · ${template.status} · ${name}`;
}

async function refreshTemplates() {
  const { data } = await (await api("/v1/templates")).json();
  const select = $("template-select");
  const chosen = page.template ? page.template.id : select.value;
  data.sort((a, b) => b.created - a.created);
  select.replaceChildren(...data.map((template) => new Option(describe(template), template.id)));
  if (!data.length) select.append(new Option("(none yet)", ""));
  select.value = data.some((template) => template.id === chosen) ? chosen : "";
  return data;
}

function showRecording(template) {
  const progress = template.progress || {};
  const element = $("template-progress");
  if (template.status === "ready") meter(element, 1, `ready: ${template.steps} steps recorded`);
  else if (template.status === "failed") meter(element, 1, `failed: ${template.error || "recording failed"}`, "error");
  else if (template.status === "pending") meter(element, 0, "recorded by its first edit");
  else if (progress.workers_connected === 0) meter(element, 0, "waiting for a worker to join and record it", "error");
  else meter(element, progress.steps ? progress.step / progress.steps : 0,
    `recording step ${progress.step || 0} of ${progress.steps || template.steps}`, "busy");
  $("template-info").textContent = `${template.width}×${template.height} · ${template.steps} steps`;
}

// Shows the template: its image as the server holds it (EXIF orientation applied, so the mask lines
// up with what the server repaints), an empty mask of its size, and its recording's progress.
async function showTemplate(template) {
  stopEdit();
  if (page.watching) page.watching.abort();
  page.template = template;
  $("template-select").value = template.id;
  const blob = await (await api(`/v1/templates/${encodeURIComponent(template.id)}/image`)).blob();
  if (page.template !== template) return; // another was chosen meanwhile
  if (page.imageUrl) URL.revokeObjectURL(page.imageUrl);
  page.imageUrl = URL.createObjectURL(blob);
  const image = $("template-image");
  image.src = page.imageUrl;
  await image.decode();
  if (page.template !== template) return;
  mask.reset(template.width, template.height);
  const longest = Math.max(template.width, template.height);
  const brush = $("brush-size");
  brush.max = String(Math.max(16, Math.round(longest / 4)));
  brush.value = String(Math.max(2, Math.round(longest / 16)));
  showBrushSize();
  showCoverage();
  $("stage").hidden = false;
  $("template-empty").hidden = true;
  clearResult();
  layout();
  showRecording(template);
  if (template.status === "recording") watchRecording(template.id);
}

async function watchRecording(templateId) {
  const watch = new AbortController();
  page.watching = watch;
  try {
    const response = await api(`/v1/templates/${encodeURIComponent(templateId)}/events`, { signal: watch.signal });
    for await (const { event, data } of serverEvents(response)) {
      if (event === "deleted") {
        status(`template ${templateId} was deleted`, "error");
      } else if (event === "template" && page.template && page.template.id === templateId) {
        page.template = { ...page.template, ...data };
        showRecording(page.template);
      }
    }
    await refreshTemplates();
  } catch (error) {
    failed(error);
  }
}

async function register(file) {
  const form = new FormData();
  form.append("image", file);
  if ($("steps").value) form.append("steps", $("steps").value);
  status(`registering ${file.name}…`, "busy");
  const template = await (await api("/v1/templates", { method: "POST", body: form })).json();
  await refreshTemplates();
  await showTemplate(template);
  status(template.status === "ready" ? "template ready: paint a mask"
    : "template registered: paint a mask while it records");
}

// ---- painting ----

function imagePoint(event) {
  const box = $("mask-canvas").getBoundingClientRect();
  return {
    x: ((event.clientX - box.left) * mask.width) / box.width,
    y: ((event.clientY - box.top) * mask.height) / box.height,
  };
}

function brushRadius() {
  // Half a pixel would miss the pixel under the pointer when it sits on a corner; sqrt(2)/2 cannot.
  return Math.max(Number($("brush-size").value) / 2, Math.SQRT1_2);
}

function paint(event) {
  const point = imagePoint(event);
  mask.stroke(page.stroke || point, point, brushRadius(), page.erasing ? 0 : 1);
  page.stroke = point;
  showCoverage();
}

function moveCursor(event) {
  const cursor = $("brush-cursor");
  const box = $("mask-canvas").getBoundingClientRect();
  const diameter = (2 * brushRadius() * box.width) / mask.width;
  cursor.hidden = false;
  cursor.style.width = cursor.style.height = `${diameter}px`;
  cursor.style.left = `${event.clientX - box.left - diameter / 2}px`;
  cursor.style.top = `${event.clientY - box.top - diameter / 2}px`;
}

function showCoverage() {
  $("mask-coverage").textContent = percent(mask.coverage());
}

function showBrushSize() {
  $("brush-size-value").textContent = `${$("brush-size").value} px`;
}

function setErasing(erasing) {
  page.erasing = erasing;
  $("brush").setAttribute("aria-pressed", String(!erasing));
  $("eraser").setAttribute("aria-pressed", String(erasing));
  $("stage").classList.toggle("erasing", erasing);
}

// ---- editing ----

function clearResult() {
  $("result").hidden = true;
  $("preview").hidden = true;
  $("result-stage").hidden = true;
  $("result-empty").hidden = false;
  $("latency").textContent = "–";
  $("mask-ratio").textContent = "–";
  $("download").hidden = true;
  meter($("progress"), 0, "idle");
}

function stopEdit() {
  if (page.editing) page.editing.abort();
  page.editing = null;
  $("submit").disabled = false;
  $("cancel").hidden = true;
}

async function showResult(data) {
  const blob = await (await fetch(`data:image/png;base64,${data.b64_json}`)).blob();
  if (page.resultUrl) URL.revokeObjectURL(page.resultUrl);
  page.resultUrl = URL.createObjectURL(blob);
  const result = $("result");
  result.src = page.resultUrl;
  await result.decode();
  result.hidden = false;
  $("preview").hidden = true;
  $("latency").textContent = `${data.latency_s.toFixed(2)} s`;
  $("mask-ratio").textContent = percent(data.mask_ratio);
  $("download").href = page.resultUrl;
  $("download").hidden = false;
}

// One edit event of POST /v1/edits stream=true onto the page; true once the stream's answer came.
async function showEditEvent(event, data, steps) {
  const progress = $("progress");
  switch (event) {
    case "accepted":
      $("mask-ratio").textContent = percent(data.mask_ratio);
      meter(progress, 0, `accepted: ${data.masked_tokens} of ${data.image_tokens} tokens to repaint`, "busy");
      return false;
    case "parked":
      meter(progress, 0, "waiting for the template to finish recording", "busy");
      return false;
    case "queued":
      meter(progress, 0, data.attempt > 1 ? `worker lost: re-queued at ${data.worker}, starting over`
        : `queued at ${data.worker}`, "busy");
      return false;
    case "step":
      meter(progress, data.step / data.steps, `step ${data.step} of ${data.steps}`, "busy");
      return false;
    case "preview":
      $("preview").src = `data:image/png;base64,${data.image}`;
      $("preview").hidden = !$("result").hidden;
      return false;
    case "done":
      await showResult(data);
      progress.dataset.kind = "info";
      if (!steps.seen) meter(progress, 1, "nothing to repaint: the template itself");
      status(`done in ${data.latency_s.toFixed(2)} s`);
      return true;
    case "error":
      meter(progress, 1, `failed (${data.status})`, "error");
      status(data.error.message, "error");
      return true;
    default:
      return false; // an event this page does not know yet
  }
}

async function submit() {
  const template = page.template;
  if (!template) {
    status("upload an image or pick a template first", "error");
    return;
  }
  stopEdit();
  const edit = new AbortController();
  page.editing = edit;
  $("submit").disabled = true;
  $("cancel").hidden = false;
  const form = new FormData();
  form.append("template_id", template.id);
  form.append("mask", await mask.png(), "mask.png");
  form.append("prompt", $("prompt").value);
  form.append("seed", $("seed").value || "0");
  form.append("stream", "true");
  if (Number($("preview-every").value) > 0) form.append("preview_every", $("preview-every").value);
  if ($("lora").value.trim()) form.append("lora", $("lora").value.trim());
  $("result-stage").hidden = false;
  $("result-empty").hidden = true;
  $("result").hidden = true;
  $("latency").textContent = "–";
  meter($("progress"), 0, "sending", "busy");
  status("editing…", "busy");
  const steps = { seen: false };
  try {
    const response = await api("/v1/edits", { method: "POST", body: form, signal: edit.signal });
    let answered = false;
    for await (const { event, data } of serverEvents(response)) {
      steps.seen ||= event === "step";
      answered = await showEditEvent(event, data, steps);
      if (answered) break;
    }
    if (!answered) throw new ApiError(0, "the server closed the stream before the edit was answered");
  } catch (error) {
    if (error.name === "AbortError") {
      meter($("progress"), 0, "cancelled");
      status("edit cancelled");
    } else {
      meter($("progress"), 1, "failed", "error");
      failed(error);
    }
  } finally {
    if (page.editing === edit) stopEdit();
  }
}

// ---- wiring ----

const canvas = $("mask-canvas");
canvas.addEventListener("pointerdown", (event) => {
  if (event.button !== 0) return;
  canvas.setPointerCapture(event.pointerId);
  page.stroke = null;
  paint(event);
});
canvas.addEventListener("pointermove", (event) => {
  moveCursor(event);
  if (page.stroke) paint(event);
});
for (const name of ["pointerup", "pointercancel"]) canvas.addEventListener(name, () => { page.stroke = null; });
canvas.addEventListener("pointerleave", () => { $("brush-cursor").hidden = true; });

$("brush-size").addEventListener("input", showBrushSize);
$("brush").addEventListener("click", () => setErasing(false));
$("eraser").addEventListener("click", () => setErasing(true));
$("clear").addEventListener("click", () => { mask.clear(); showCoverage(); });
$("invert").addEventListener("click", () => { mask.invert(); showCoverage(); });

$("file").addEventListener("change", () => {
  const file = $("file").files[0];
  if (!file) return;
  register(file).catch(failed).finally(() => { $("file").value = ""; });
});
$("template-select").addEventListener("change", async () => {
  const id = $("template-select").value;
  if (!id) return;
  try {
    const template = await (await api(`/v1/templates/${encodeURIComponent(id)}`)).json();
    await showTemplate(template);
    status("template loaded: paint a mask");
  } catch (error) {
    failed(error);
  }
});
$("refresh").addEventListener("click", () => refreshTemplates().then(() => status("templates reloaded")).catch(failed));
$("controls").addEventListener("submit", (event) => {
  event.preventDefault();
  submit();
});
$("cancel").addEventListener("click", stopEdit);

$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", () => {
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  start();
});

new ResizeObserver(layout).observe($("template-viewport"));

// Lists the templates and, when none is shown yet, shows the newest.
async function start() {
  try {
    const templates = await refreshTemplates();
    status(templates.length ? "pick a template or upload an image" : "upload an image to start");
    if (!page.template && templates.length) await showTemplate(templates[0]);
  } catch (error) {
    failed(error);
  }
}

start();
