// The retouch playground: register or pick a template, paint its mask, run an edit and watch it.
// It is a client of the public HTTP API like any other (retouch/http_api.py); progress arrives as
// Server-Sent Events (retouch/http_events.py). Everything goes through fetch() because EventSource
// cannot send the Authorization header a server with API keys asks for.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "retouch.apiKey";
// The file each template was uploaded from, by template id. The server keeps no file names (a
// template is its pixels and settings), so the browser does, to tell templates apart in the list.
const NAMES_STORAGE = "retouch.templateNames";
const NAMES_KEPT = 200;
// Mask pixels as the overlay shows them (magenta reads over skin, sky and foliage alike). Alpha is
// what marks a pixel as masked: every masked pixel has exactly this alpha, every other pixel 0.
const OVERLAY = [255, 40, 130, 140];
const PIXELATED_FROM = 3; // display scales at or above this show image pixels as squares

// ---- the API ----

class ApiError extends Error {
  // status: the HTTP status (0: no answer); code: the API's error.code, which is what the page
  // decides on (never the message's wording)
  constructor(status, message, code = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

// An event stream that broke off: the server died or a proxy cut the connection.
class ConnectionLost extends Error {
  constructor(cause) {
    super(`lost the connection to the server (${cause})`);
    this.name = "ConnectionLost";
  }
}

function apiHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The server's error in the page's words: the API's messages are written for developers (field
// names, flags, byte counts).
function readable(status, error) {
  const message = error.message || `the server answered ${status}`;
  switch (error.code) {
    case "invalid_api_key":
      return "missing or wrong API key: type the server's key into the API key field";
    case "body_too_large":
      return page.limits ? `the image is too large to upload (limit ${Math.floor(page.limits.max_upload_bytes / 2 ** 20)} MB)`
        : "the image is too large to upload";
    case "too_much_work":
      return "the image is too large for this server at this many steps: use fewer steps or a smaller image";
    case "queue_full":
      return "the server is busy (its queue is full): try again in a moment";
    case "server_busy":
      return "the server is busy receiving other uploads: try again in a moment";
    case "template_not_found":
      return "the template is gone from the server (deleted, or the server restarted)";
    case "no_worker":
      return "no worker is connected to the server: edits wait until one joins";
    case "cancelled":
      return "edit cancelled";
    default:
      return message;
  }
}

async function errorOf(response) {
  try {
    const { error } = await response.json();
    return new ApiError(response.status, readable(response.status, error), error.code);
  } catch (_) {
    // not the API's JSON error shape (a proxy's page, say): the status line says enough
    return new ApiError(response.status, `the server answered ${response.status} ${response.statusText}`.trim());
  }
}

function sleep(seconds, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, 1000 * seconds);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(timer); reject(signal.reason); }, { once: true });
  });
}

// fetch() with the API key; a non-2xx answer throws ApiError. A full queue (429) is tried once more
// after the Retry-After the server names: it is what a person would do, and the page says so.
async function api(path, init = {}) {
  for (let attempt = 1; ; attempt++) {
    let response;
    try {
      response = await fetch(path, { ...init, headers: { ...apiHeaders(), ...(init.headers || {}) } });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(0, `cannot reach the server (${error.message})`);
    }
    $("api-key").setAttribute("aria-invalid", String(response.status === 401));
    if (response.ok) return response;
    const error = await errorOf(response);
    if (error.code !== "queue_full" || attempt > 1) throw error;
    const seconds = Number(response.headers.get("Retry-After")) || 1;
    status(`the server is busy; retrying in ${seconds} s`, "busy");
    await sleep(seconds, init.signal);
  }
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
    let chunk, done;
    try {
      ({ value: chunk, done } = await reader.read());
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ConnectionLost(error.message);
    }
    if (done) return;
    let start = 0;
    for (let newline = chunk.indexOf("\n"); newline >= 0; newline = chunk.indexOf("\n", start)) {
      partial.push(chunk.slice(start, newline));
      start = newline + 1;
      let line = partial.join("");
      partial = [];
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (data.length) yield { event: name, data: eventData(name, data.join("\n")) };
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

function eventData(name, text) {
  try {
    return JSON.parse(text);
  } catch (_) {
    throw new ApiError(0, `the server sent a "${name}" event this page cannot read (its data is not JSON)`,
      "malformed_event");
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

  // A canvas of the mask as it is now, masked pixels in `inside` and the rest in `outside` (RGBA).
  snapshot(inside, outside) {
    const canvas = document.createElement("canvas");
    canvas.width = this.width;
    canvas.height = this.height;
    const context = canvas.getContext("2d");
    const image = context.createImageData(this.width, this.height);
    const rgba = image.data;
    for (let i = 0; i < this.pixels.length; i++) rgba.set(this.pixels[i] ? inside : outside, 4 * i);
    context.putImageData(image, 0, 0);
    return canvas;
  }

  // What POST /v1/edits takes: a PNG of the template's size, white = repaint.
  png() {
    const canvas = this.snapshot([255, 255, 255, 255], [0, 0, 0, 255]);
    return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
  }
}

// ---- the page ----

const mask = new Mask($("mask-canvas"));
const page = {
  template: null, // the template shown (its JSON from the API): the image and the mask are of this one
  templateImage: null, // its image as the server sent it (a Blob): what registers it again if the server lost it
  templateGone: false, // the server deleted it: the next Submit registers it again
  loading: null, // a token of the template being uploaded or loaded; Submit waits for it to show
  watching: null, // AbortController of the shown template's recording events
  editing: null, // the edit in flight: {controller, cancelReason, accepted, steps, maskAlpha}
  appliedKey: null, // the API key the page last loaded the templates with
  imageUrl: null, // object URL of the template image shown
  resultUrl: null,
  saved: 0, // results offered for download so far: numbers their file names
  limits: null, // GET /v1/limits: what this server takes (steps, upload bytes, ...)
  said: 0, // how many statuses were shown (start's greeting must not cover what the user caused meanwhile)
  erasing: false,
  stroke: null, // the last point of the stroke being painted
  keyboardPoint: null, // where the keyboard's brush is (image pixels)
};

function status(message, kind = "info") {
  // Errors go to the role=alert line, which screen readers read out at once; the rest to role=status.
  page.said += 1;
  $("alert").textContent = kind === "error" ? message : "";
  $("status").textContent = kind === "error" ? "" : message;
  $("status").dataset.kind = kind;
}

function failed(error, context = "") {
  if (error.name === "AbortError") return;
  status(context ? `${context}: ${error.message}` : error.message, "error");
  if (error.code === "invalid_api_key") $("api-key").focus();
}

function meter(element, fraction, text, kind = "info", stage = "") {
  element.hidden = false;
  element.dataset.kind = kind;
  element.dataset.stage = stage;
  element.querySelector(".fill").style.width = `${Math.round(100 * Math.max(0, Math.min(1, fraction)))}%`;
  element.querySelector(".text").textContent = text;
  if (element.getAttribute("role") === "progressbar") {
    element.setAttribute("aria-valuenow", String(fraction));
    element.setAttribute("aria-valuetext", text);
  }
}

function percent(fraction) {
  return `${(100 * fraction).toFixed(fraction > 0 && fraction < 0.001 ? 2 : 1)} %`;
}

// Submit waits for a template being loaded (its mask would be the old one's) and for the edit in
// flight; Cancel shows while one is. A button that disables or hides itself drops the keyboard
// focus to <body>, so the focus moves to the button that takes its place.
function updateActions() {
  const submit = $("submit");
  const cancel = $("cancel");
  const focused = document.activeElement;
  submit.disabled = Boolean(page.editing || page.loading);
  cancel.hidden = !page.editing;
  if (page.editing && focused === submit) cancel.focus();
  else if (!page.editing && focused === cancel && !submit.disabled) submit.focus();
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

function templateNames() {
  try {
    return JSON.parse(localStorage.getItem(NAMES_STORAGE)) || {};
  } catch (_) {
    return {}; // storage off, or a value this page did not write
  }
}

function rememberName(templateId, fileName) {
  const names = templateNames();
  delete names[templateId]; // re-inserted last: the oldest names are the first keys
  names[templateId] = fileName;
  const ids = Object.keys(names);
  for (const id of ids.slice(0, Math.max(0, ids.length - NAMES_KEPT))) delete names[id];
  try {
    localStorage.setItem(NAMES_STORAGE, JSON.stringify(names));
  } catch (_) {
    // storage full or off: the list shows hashes, as before
  }
}

function shortName(template) {
  return templateNames()[template.id]
    || (template.prompt ? `"${template.prompt.slice(0, 24)}"` : template.id.replace(/^tpl-/, "").slice(0, 8));
}

// What tells templates apart comes first: a narrow <select> cuts the end off.
function describe(template, state = template.status) {
  return `${shortName(template)} · ${template.width}×${template.height} · ${template.steps} steps · ${state}`;
}

// The templates, newest first, into the list. The one shown stays listed even when the server has
// lost it, so the list always names what is on screen.
async function refreshTemplates() {
  const { data } = await (await api("/v1/templates")).json();
  const select = $("template-select");
  const chosen = page.loading && page.loading.template ? page.loading.template.id
    : page.template ? page.template.id : "";
  data.sort((a, b) => b.created - a.created);
  const options = data.map((template) => new Option(describe(template), template.id));
  if (page.template && !data.some((template) => template.id === page.template.id)) {
    options.unshift(new Option(describe(page.template, "gone from the server"), page.template.id));
  }
  if (!options.length) options.push(new Option("(none yet)", ""));
  select.replaceChildren(...options);
  select.value = options.some((option) => option.value === chosen) ? chosen : "";
  return data;
}

function showRecording(template) {
  const progress = template.progress || {};
  const element = $("template-progress");
  if (page.templateGone) meter(element, 0, "gone from the server: Submit registers it again", "error");
  else if (template.status === "ready") meter(element, 1, `ready: ${template.steps} steps recorded`);
  else if (template.status === "failed") meter(element, 1, `failed: ${template.error || "recording failed"}`, "error");
  else if (template.status === "pending") meter(element, 0, "recorded by its first edit");
  else if (progress.workers_connected === 0) meter(element, 0, "waiting for a worker to join and record it", "error");
  else meter(element, progress.steps ? progress.step / progress.steps : 0,
    `recording step ${progress.step || 0} of ${progress.steps || template.steps}`, "busy");
  $("template-info").textContent = `${template.width}×${template.height} · ${template.steps} steps`;
}

function beginLoading(template = null) {
  const token = { template };
  page.loading = token;
  updateActions();
  return token;
}

function endLoading(token) {
  if (page.loading !== token) return;
  page.loading = null;
  updateActions();
}

// Shows the template: its image as the server holds it (EXIF orientation applied, so the mask lines
// up with what the server repaints), an empty mask of its size, and its recording's progress. The
// template shown before stays, with its mask, until the new image has arrived and decoded; if it
// cannot, the old one stays. True once shown; false if another was chosen meanwhile.
async function showTemplate(template) {
  const token = beginLoading(template);
  $("template-select").value = template.id;
  let url = null;
  try {
    const blob = await (await api(`/v1/templates/${encodeURIComponent(template.id)}/image`)).blob();
    url = URL.createObjectURL(blob);
    const image = new Image();
    image.src = url;
    await image.decode().catch(() => { throw new ApiError(0, "its image does not decode in this browser"); });
    if (page.loading !== token) {
      URL.revokeObjectURL(url);
      return false;
    }
    if (page.watching) page.watching.abort();
    if (page.imageUrl) URL.revokeObjectURL(page.imageUrl);
    page.imageUrl = url;
    page.templateImage = blob;
    page.template = template;
    page.templateGone = false;
    $("template-image").src = url;
    mask.reset(template.width, template.height);
    const longest = Math.max(template.width, template.height);
    const brush = $("brush-size");
    brush.max = String(Math.max(16, Math.round(longest / 4)));
    brush.value = String(Math.max(2, Math.round(longest / 16)));
    page.keyboardPoint = null;
    showBrushSize();
    showCoverage();
    $("stage").hidden = false;
    $("template-empty").hidden = true;
    $("template-viewport").style.setProperty("--aspect", `${template.width} / ${template.height}`);
    $("result-viewport").style.setProperty("--aspect", `${template.width} / ${template.height}`);
    clearResult();
    layout();
    showRecording(template);
    if (template.status === "recording") watchRecording(template.id);
    return true;
  } catch (error) {
    if (url) URL.revokeObjectURL(url);
    if (page.loading === token) $("template-select").value = page.template ? page.template.id : "";
    const kept = page.template ? "; the template shown stays" : "";
    if (error.name !== "AbortError") error.message = `could not show template ${shortName(template)}: ${error.message}${kept}`;
    throw error;
  } finally {
    endLoading(token);
  }
}

// Nothing shown: what a new API key starts from (the old key's templates are not the new one's).
function forgetTemplate() {
  page.loading = null;
  if (page.watching) page.watching.abort();
  if (page.imageUrl) URL.revokeObjectURL(page.imageUrl);
  page.template = page.templateImage = page.imageUrl = null;
  page.templateGone = false;
  $("template-image").removeAttribute("src");
  mask.reset(1, 1);
  showCoverage();
  $("stage").hidden = true;
  $("template-empty").hidden = false;
  $("template-progress").hidden = true;
  $("template-info").textContent = "";
  $("template-select").replaceChildren(new Option("(loading)", ""));
  clearResult();
  updateActions();
}

function templateGone(templateId) {
  if (!page.template || page.template.id !== templateId) return;
  page.templateGone = true;
  showRecording(page.template);
  status("the template was deleted on the server: Submit registers it again from this page's copy", "error");
}

async function watchRecording(templateId) {
  const watch = new AbortController();
  page.watching = watch;
  try {
    const response = await api(`/v1/templates/${encodeURIComponent(templateId)}/events`, { signal: watch.signal });
    for await (const { event, data } of serverEvents(response)) {
      if (event === "deleted") {
        templateGone(templateId);
      } else if (event === "template" && page.template && page.template.id === templateId) {
        page.template = { ...page.template, ...data };
        showRecording(page.template);
      }
    }
    await refreshTemplates();
  } catch (error) {
    if (error.code === "template_not_found") templateGone(templateId);
    else failed(error, "watching the recording");
  }
}

async function register(file) {
  const token = beginLoading();
  try {
    const form = new FormData();
    form.append("image", file);
    if ($("steps").value) form.append("steps", $("steps").value);
    status(`registering ${file.name}…`, "busy");
    const template = await (await api("/v1/templates", { method: "POST", body: form })).json();
    rememberName(template.id, file.name);
    await refreshTemplates();
    if (page.loading !== token) return; // another template was picked meanwhile
    if (!await showTemplate(template)) return;
    status(template.status === "ready" ? "template ready: paint a mask"
      : "template registered: paint a mask while it records");
  } finally {
    endLoading(token);
  }
}

// Template ids are hashes of the image and its recording settings, so registering the page's copy
// of a template the server lost (deleted, or the server restarted) gives it back under its id.
async function registerAgain(template, signal) {
  status("the template is gone from the server: registering it again from this page's copy…", "busy");
  const form = new FormData();
  form.append("image", page.templateImage, "template.png");
  form.append("steps", String(template.steps));
  form.append("seed", String(template.seed || 0));
  if (template.prompt) form.append("prompt", template.prompt);
  if (template.negative_prompt) form.append("negative_prompt", template.negative_prompt);
  if (template.guidance !== null && template.guidance !== undefined) form.append("guidance", String(template.guidance));
  const again = await (await api("/v1/templates", { method: "POST", body: form, signal })).json();
  const name = templateNames()[template.id];
  if (name) rememberName(again.id, name);
  if (page.template && page.template.id === template.id) {
    page.template = again;
    page.templateGone = false;
    showRecording(again);
    if (again.status === "recording") watchRecording(again.id);
  }
  refreshTemplates().catch(() => {}); // the list is a nicety here; the edit goes on
  return again;
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

function paintLine(from, to) {
  mask.stroke(from, to, brushRadius(), page.erasing ? 0 : 1);
  showCoverage();
}

function paint(event) {
  const point = imagePoint(event);
  paintLine(page.stroke || point, point);
  page.stroke = point;
}

// The brush outline at `point` (image pixels).
function showCursor(point) {
  const cursor = $("brush-cursor");
  const box = $("mask-canvas").getBoundingClientRect();
  const scale = box.width / mask.width;
  const diameter = 2 * brushRadius() * scale;
  cursor.hidden = false;
  cursor.style.width = cursor.style.height = `${diameter}px`;
  cursor.style.left = `${point.x * scale - diameter / 2}px`;
  cursor.style.top = `${point.y * scale - diameter / 2}px`;
}

// The keyboard's brush: arrows move it by its radius (Shift paints along the way), Space or Enter
// paints where it is. A mouse is not the only way to say which region to repaint.
const KEY_MOVES = { ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowUp: [0, -1], ArrowDown: [0, 1] };

function paintWithKeys(event) {
  const from = page.keyboardPoint || { x: mask.width / 2, y: mask.height / 2 };
  let to = from;
  if (event.key in KEY_MOVES) {
    const [dx, dy] = KEY_MOVES[event.key];
    const step = Math.max(1, brushRadius());
    to = {
      x: Math.max(0, Math.min(mask.width, from.x + dx * step)),
      y: Math.max(0, Math.min(mask.height, from.y + dy * step)),
    };
    if (event.shiftKey) paintLine(from, to);
  } else if (event.key === " " || event.key === "Enter") {
    paintLine(from, from);
  } else {
    return;
  }
  event.preventDefault();
  page.keyboardPoint = to;
  showCursor(to);
}

function showCoverage() {
  $("mask-coverage").textContent = percent(mask.coverage());
}

function showBrushSize() {
  const size = `${$("brush-size").value} px`;
  $("brush-size-value").textContent = size;
  $("brush-size").setAttribute("aria-valuetext", size);
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
  $("result-empty").textContent = "Paint a mask, write a prompt, submit";
  $("latency").textContent = "–";
  $("mask-ratio").textContent = "–";
  $("download").hidden = true;
  meter($("progress"), 0, "idle");
}

// Cancels the edit in flight, if any; `reason` is said with "edit cancelled". True if one was.
function stopEdit(reason = "") {
  const edit = page.editing;
  if (!edit) return false;
  edit.cancelReason = reason;
  page.editing = null;
  edit.controller.abort();
  updateActions();
  return true;
}

// The server's previous answer stays until a new edit is accepted: a refused one leaves it as it was.
function editAccepted(edit, data) {
  edit.accepted = true;
  edit.steps = data.steps;
  $("result").hidden = true;
  $("download").hidden = true;
  $("latency").textContent = "–";
  $("mask-ratio").textContent = percent(data.mask_ratio);
  $("result-stage").hidden = false;
  $("result-empty").hidden = true;
  const preview = $("preview");
  preview.width = page.template.width;
  preview.height = page.template.height;
  preview.hidden = true;
  layout();
}

// What an accepted edit that did not finish leaves: no result, and no mask ratio of a result.
function editFailed(edit, why) {
  if (!edit.accepted) return;
  $("preview").hidden = true;
  $("result-stage").hidden = true;
  $("result-empty").hidden = false;
  $("result-empty").textContent = why;
  $("mask-ratio").textContent = "–";
}

// A preview is the whole image at 1/8 of its side, but only masked pixels change: the rest of the
// image is the template's, exactly, so the preview is painted inside the mask sent, over the template.
async function showPreview(edit, data) {
  const image = new Image();
  image.src = `data:image/png;base64,${data.image}`;
  await image.decode();
  if (page.editing !== edit) return;
  const canvas = $("preview");
  const context = canvas.getContext("2d");
  context.imageSmoothingQuality = "high";
  context.globalCompositeOperation = "copy";
  context.drawImage(image, 0, 0, canvas.width, canvas.height);
  context.globalCompositeOperation = "destination-in";
  context.drawImage(edit.maskAlpha, 0, 0);
  context.globalCompositeOperation = "destination-over";
  context.drawImage($("template-image"), 0, 0, canvas.width, canvas.height);
  context.globalCompositeOperation = "source-over";
  canvas.dataset.step = String(data.step);
  canvas.hidden = !$("result").hidden;
}

async function showResult(data) {
  const blob = await (await fetch(`data:image/png;base64,${data.b64_json}`)).blob();
  if (page.resultUrl) URL.revokeObjectURL(page.resultUrl);
  page.resultUrl = URL.createObjectURL(blob);
  const result = $("result");
  result.src = page.resultUrl;
  await result.decode();
  $("result-stage").hidden = false;
  $("result-empty").hidden = true;
  result.hidden = false;
  $("preview").hidden = true;
  $("latency").textContent = `${data.latency_s.toFixed(2)} s`;
  $("mask-ratio").textContent = percent(data.mask_ratio);
  // Named after the upload and numbered: every download used to be retouch-edit.png.
  const stem = (templateNames()[page.template.id] || page.template.id).replace(/\.[^.]*$/, "");
  page.saved += 1;
  $("download").download = `${stem}-edit-${page.saved}.png`;
  $("download").href = page.resultUrl;
  $("download").hidden = false;
}

// One edit event of POST /v1/edits stream=true onto the page; true once the stream's answer came.
async function showEditEvent(edit, event, data) {
  const progress = $("progress");
  switch (event) {
    case "accepted":
      editAccepted(edit, data);
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
      edit.stepsSeen = true;
      // The last step is not the end: the server still decodes the latents and encodes the PNG,
      // seconds for a large image. That stage gets the bar's last part and a line of its own.
      if (data.step < data.steps) meter(progress, data.step / (data.steps + 1), `step ${data.step} of ${data.steps}`, "busy");
      else meter(progress, data.step / (data.steps + 1), "finishing: decoding the image", "busy", "finishing");
      return false;
    case "preview":
      await showPreview(edit, data);
      return false;
    case "done":
      await showResult(data);
      meter(progress, 1, edit.stepsSeen ? `done: ${edit.steps} steps` : "nothing to repaint: the template itself");
      status(`done in ${data.latency_s.toFixed(2)} s`);
      return true;
    case "error":
      throw new ApiError(data.status, readable(data.status, data.error || {}), (data.error || {}).code);
    default:
      return false; // an event this page does not know yet
  }
}

async function editForm(templateId) {
  const form = new FormData();
  form.append("template_id", templateId);
  form.append("mask", await mask.png(), "mask.png");
  form.append("prompt", $("prompt").value);
  form.append("seed", $("seed").value || "0");
  if ($("strength").value && Number($("strength").value) !== 1) form.append("strength", $("strength").value);
  const negative = $("negative-prompt").value.trim();
  if (negative && !$("negative-prompt-field").hidden) form.append("negative_prompt", negative);
  form.append("stream", "true");
  if (Number($("preview-every").value) > 0) form.append("preview_every", $("preview-every").value);
  if ($("lora").value.trim()) form.append("lora", $("lora").value.trim());
  return form;
}

// POST /v1/edits; a template the server lost is registered again from the page's copy, once.
async function postEdit(edit, form) {
  const init = { method: "POST", body: form, signal: edit.controller.signal };
  if (!page.templateGone) {
    try {
      return await api("/v1/edits", init);
    } catch (error) {
      if (error.code !== "template_not_found") throw error;
    }
  }
  const again = await registerAgain(page.template, edit.controller.signal);
  form.set("template_id", again.id);
  status("editing…", "busy");
  return api("/v1/edits", init);
}

async function submit() {
  if (!page.template) {
    status("upload an image or pick a template first", "error");
    return;
  }
  if (page.editing || page.loading) return; // Enter in a field while Submit is disabled
  const edit = { controller: new AbortController(), cancelReason: "", accepted: false, stepsSeen: false, steps: 0 };
  // The mask as sent: previews are painted inside it, whatever is painted meanwhile.
  edit.maskAlpha = mask.snapshot([0, 0, 0, 255], [0, 0, 0, 0]);
  page.editing = edit;
  updateActions();
  meter($("progress"), 0, "sending", "busy");
  status("editing…", "busy");
  try {
    const response = await postEdit(edit, await editForm(page.template.id));
    let answered = false;
    for await (const { event, data } of serverEvents(response)) {
      answered = await showEditEvent(edit, event, data);
      if (answered) break;
    }
    if (!answered) throw new ConnectionLost("the stream ended before the answer");
  } catch (error) {
    if (error.name === "AbortError") {
      meter($("progress"), 0, "cancelled");
      status(edit.cancelReason ? `edit cancelled: ${edit.cancelReason}` : "edit cancelled");
      editFailed(edit, "Edit cancelled");
    } else if (error.name === "ConnectionLost") {
      meter($("progress"), 1, "connection lost", "error");
      status("lost the connection to the server during the edit; it did not complete", "error");
      editFailed(edit, "The edit did not complete");
    } else {
      meter($("progress"), 1, error.status ? `failed (${error.status})` : "failed", "error");
      failed(error);
      editFailed(edit, "The edit did not complete");
    }
  } finally {
    if (page.editing === edit) {
      page.editing = null;
      updateActions();
    }
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
  showCursor(imagePoint(event));
  if (page.stroke) paint(event);
});
for (const name of ["pointerup", "pointercancel"]) canvas.addEventListener(name, () => { page.stroke = null; });
canvas.addEventListener("pointerleave", () => { $("brush-cursor").hidden = true; });
canvas.addEventListener("keydown", paintWithKeys);
canvas.addEventListener("focus", () => {
  if (canvas.matches(":focus-visible")) showCursor(page.keyboardPoint || { x: mask.width / 2, y: mask.height / 2 });
});
canvas.addEventListener("blur", () => { $("brush-cursor").hidden = true; });

$("brush-size").addEventListener("input", showBrushSize);
$("brush").addEventListener("click", () => setErasing(false));
$("eraser").addEventListener("click", () => setErasing(true));
$("clear").addEventListener("click", () => { mask.clear(); showCoverage(); });
$("invert").addEventListener("click", () => { mask.invert(); showCoverage(); });

$("file").addEventListener("change", () => {
  const file = $("file").files[0];
  if (!file) return;
  const cancelled = stopEdit("an image was uploaded");
  register(file)
    .then(() => { if (cancelled) status(`edit cancelled; ${$("status").textContent}`); })
    .catch((error) => failed(error, `could not register ${file.name}`))
    .finally(() => { $("file").value = ""; });
});
$("template-select").addEventListener("change", async () => {
  const id = $("template-select").value;
  if (!id || (page.template && page.template.id === id && !page.loading)) return;
  const cancelled = stopEdit("another template was picked");
  try {
    const template = await (await api(`/v1/templates/${encodeURIComponent(id)}`)).json();
    if (await showTemplate(template)) status(`${cancelled ? "edit cancelled; " : ""}template loaded: paint a mask`);
  } catch (error) {
    $("template-select").value = page.template ? page.template.id : "";
    failed(error, cancelled ? "edit cancelled" : "");
    if (error.code === "template_not_found") refreshTemplates().catch(() => {});
  }
});
$("refresh").addEventListener("click", () => refreshTemplates().then(() => status("templates reloaded")).catch(failed));
$("controls").addEventListener("submit", (event) => {
  event.preventDefault();
  submit();
});
$("cancel").addEventListener("click", () => stopEdit());
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    $("controls").requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && page.editing) {
    event.preventDefault();
    stopEdit();
  }
});

// A new key is another tenant: what the old one showed is not theirs to see, nor to edit.
function applyKey() {
  const key = $("api-key").value.trim();
  if (key === page.appliedKey) return;
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  stopEdit("the API key changed");
  forgetTemplate();
  start();
}
$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", applyKey);
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  applyKey();
});

new ResizeObserver(layout).observe($("template-viewport"));

// The form follows the server's limits: its largest and default steps. Without them (a missing key,
// which the template list then reports; an older server) the form stays as it is.
async function readLimits() {
  try {
    page.limits = await (await api("/v1/limits")).json();
  } catch (error) {
    page.limits = null;
    return;
  }
  $("steps").max = String(page.limits.max_steps);
  $("steps").placeholder = `server default (${page.limits.default_steps})`;
  // Flux models run no unconditional branch for a negative prompt: the server would refuse it.
  $("negative-prompt-field").hidden = page.limits.negative_prompt === false;
}

// Lists the templates and, when none is shown yet, shows the newest.
async function start() {
  page.appliedKey = $("api-key").value.trim();
  const said = page.said;
  try {
    await readLimits();
    const templates = await refreshTemplates();
    // An upload made while the page started (its progress, or its error) says more than the greeting.
    if (page.said === said) status(templates.length ? "pick a template or upload an image" : "upload an image to start");
    if (!page.template && !page.loading && templates.length) await showTemplate(templates[0]);
  } catch (error) {
    failed(error);
  }
}

start();
