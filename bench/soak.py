"""Soak: a bounded mixed load on an in-process server while its workers and helpers are SIGKILLed.

What it lost, how long it went silent, how its memory and descriptors moved, and what it left behind.

    retouch bench soak --duration 60 [--workers 2] [--kill-every 10] [--model tiny-flux-fill]
                       [--concurrency 4] [--timeout 60] [--out DIR]     (or python -m retouch.bench.soak)
                       [--templates 2] [--template-replicas K] [--cache-host-mib M] [--cache-disk-mib D]
                       [--loras N] [--sizes 64x48,96x64] [--deadlines]

The server is `retouch.server.Server` on loopback (port 0) in the disaggregated mode (each worker's
pre/post-processing runs in helper processes, so there are helpers to kill), `--steps` steps, one torch
thread per worker and helper, 64x48 images (--sizes: several, which templates and one-off images take in
turn, so that Flux and SD3 workers batch them in one forward) and a 1 MiB body limit. `--templates`
templates for edits and one of CANCEL_STEPS steps for the requests that go away are recorded before the
load starts, on every worker or on --template-replicas of them. Caches smaller than the templates
(--cache-host-mib, with a disk tier of --cache-disk-mib in a temporary folder) make the load evict
templates, record them again, defer a joining worker's recordings and adopt a killed worker's from disk,
while workers die:

    retouch bench soak --duration 300 --kill-every 10 --steps 8 --templates 32 --template-replicas 1 \
                       --cache-host-mib 1 --cache-disk-mib 2 --loras 4 --sizes 64x48,96x64,48x80 --deadlines

With `--loras N` the workers serve N random adapters from a temporary --lora-dir, and the mix adds
LORA_MIX's kinds (below), so adapters load on workers that die mid-load. With `--deadlines` the server
refuses edits that cannot meet their `slo_ms` (--slo-admission reject), and the mix adds DEADLINE_MIX's.

The load: `--concurrency` client threads in a closed loop (while the good requests wait, so does
everything else); each request's kind is drawn from MIX (and LORA_MIX, DEADLINE_MIX):

    template              POST /v1/edits with a registered template_id and a box mask         -> 200 PNG
    one_off               POST /v1/edits with image + mask; the image is drawn from a pool of
                          ONE_OFF_POOL (a later edit of an image finds its recording and runs
                          mask-aware) or, one time in three, is new                             -> 200 PNG
    openai_n2             POST /v1/images/edits, image + alpha mask (pool images), n=2            -> 200, 2 images
    cancel                an edit of the CANCEL_STEPS template whose client closes the connection
                          0.05-0.4 s after sending it
    bad_missing_prompt    no prompt                                                             -> 400
    bad_garbage_image     a one-off whose image is not an image                                 -> 400
    bad_mask_size         a 32x32 mask (a size no image has) for a template                      -> 422
    bad_unknown_template  template_id of no template                                            -> 404
    bad_oversized         a body over the 1 MiB limit                                           -> 413
    lora                  (--loras) a template edit with one of the adapters, scale 0.5-1       -> 200 PNG
    bad_unknown_lora      (--loras) a template edit naming an adapter the folder lacks          -> 404
    deadline              (--deadlines) a template edit with slo_ms 60000                       -> 200 PNG
    bad_deadline          (--deadlines) a template edit with slo_ms 1: no worker can meet it    -> 429

Every `--kill-every` seconds one process gets SIGKILL, alternately a worker (a random one of
`Server.supervisor.pids()` whose slot the supervisor would still restart) and a helper (a random child
of a live worker running `retouch.engine.processing`); when no process of the kind due exists, one of
the other kind is killed.

Every request sent ends as exactly one of (sent == ok + sum(4xx) + sum(5xx) + sum(other) + cancelled + lost):

    ok         200 with the body its kind promises (a PNG; JSON with n images)
    4xx, 5xx   an answer with such a status, by status code: a 503 is an answer, never lost
    other      any other answer, including a 200 whose body is not what its kind promises (as "200")
    cancelled  a `cancel` request that had no answer when its client left: the client's doing
    lost       any other request with no HTTP answer at all: the connection refused or reset, closed
               without a status line, or `--timeout` seconds without an answer (a client thread still
               waiting --timeout + 60 s after the load ended counts its request lost, "StillWaiting")

After the load the bench waits (up to `--timeout`) for every worker to be connected with every
template recorded, then measures the end's RSS and descriptors and closes the server.

The report (times in seconds from the start of the load, sizes in bytes):

    sent ok 4xx 5xx other cancelled lost     the partition above (4xx, 5xx, other: {status: count})
    bad_sent bad_not_4xx bad_unexpected_status   bad_* requests; answered other than 4xx; 4xx but not BAD_STATUS
    by_kind                                  {kind: {"ok" | "cancelled" | "lost" | status: count}}
    lost_by_reason lost_examples error_messages   why (exception class), the first ten, first 5xx/other message
    ok_p50_s ok_p95_s ok_per_s wall_s        latency of ok answers; ok per second over wall_s (load + drain)
    longest_silence_s                        the longest stretch of wall_s in which nothing at all was
                                             answered: an outage, even when nothing is lost in the end
    kills                                    {"worker": n, "helper": n, "events": [{t_s, target, name, pid}]}
    restarts                                 worker_exits, worker_restarts (the supervisor's), helper_restarts_seen
                                             (a new helper under a worker whose helpers were seen), workers_live_end,
                                             workers_ready_end (connected to the router)
    router_counters server_answers           the router's counters; the server's own count of its HTTP
                                             answers (/metrics: {endpoint: {status: n}}, 499 = client gone)
    worker_counters_end                      recordings and cache-tier events summed over the workers live
                                             at the end (a killed worker's counts died with it)
    router_templates_end                     templates the router holds at the end: the registered ones and
                                             every one-off image it has seen
    rss                                      this process (router, HTTP frontend *and* the bench's clients) at
                                             start/end, growth, growth_second_half (end minus the middle of the
                                             load: past warm-up); workers = live workers + their helpers;
                                             per_worker_start/end: {name: [worker RSS, its helpers' RSS]}
    fds                                      open descriptors of this process and of the workers at start/end
    recovery_s                               from the end of the load until every worker was back and every
                                             template ready on its workers (null: not within --timeout)
    close_s serve_id leftovers failed        Server.close's time; the server's id (null: it has none);
                                             what was left behind (below); lost > 0 or anything left
    samples settings                         RSS every SAMPLE_S; the options
    command versions retouch_commit device   as every benchmark records them (bench/report.environment)

Leftovers, looked for once the server is closed: live processes whose environment carries
RETOUCH_SERVE_ID=<Server.serve_id> (when the server has a `serve_id`), and live worker or helper
processes this bench saw among this process's descendants during the run (sampled every SAMPLE_S and
just before each kill, so an orphan re-parented to init is still found by its pid and start time);
and the folders of the server's sockets under the temporary folder: `retouch-serve-<this pid>-*` and
the helpers' `retouch-helpers-*` named in their command lines. Other new `retouch-*` folders there
(another server on this host may own them) are reported as unattributed and do not fail the run.
Leftover processes are killed and leftover folders removed after they are reported.

Prints one JSON object (and writes DIR/soak.json and DIR/soak.png); exits 1 when a request was lost
or something was left behind.
"""

from __future__ import annotations

import base64
import io
import math
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw

from retouch.bench.serve import MASK_BETA, PNG_SIGNATURE, mask_boxes, mask_png, template_png
from retouch.config import DEVICES, add_arguments, from_arguments, option
from retouch.engine.process_tree import (PROC, SERVE_ID_ENV, ProcessInfo, descendants, open_fds, processes_with_env,
                                         read_process, rss_bytes, scan_processes)
from retouch.errors import ArgumentParser, InputError
from retouch.images import png_bytes
from retouch.models.registry import is_builtin
from retouch.paths import check_writable

SIZE = (64, 48)  # width, height of the images the load sends (--sizes: several)
CANCEL_STEPS = 40  # the cancelled requests' template: long enough that most still run when their client goes
ONE_OFF_POOL = 6  # one-off images drawn from a pool, so most of them are seen again
MAX_UPLOAD_MB = 1.0  # the server's body limit; bad_oversized sends more
SAMPLE_S = 0.5  # RSS and process-tree sampling period
PROGRESS_S = 10.0  # a line on stderr this often
MIX = {"template": 0.30, "one_off": 0.20, "openai_n2": 0.10, "cancel": 0.10,
       "bad_missing_prompt": 0.06, "bad_garbage_image": 0.06, "bad_mask_size": 0.06,
       "bad_unknown_template": 0.06, "bad_oversized": 0.06}
# With --loras N, a share of the template edits name an adapter, and some name one the folder lacks.
LORA_MIX = {"lora": 0.15, "bad_unknown_lora": 0.03}
LORA_RANK = 4
# With --deadlines, edits that carry an SLO: one any worker meets, and one none can (refused at admission).
DEADLINE_MIX = {"deadline": 0.08, "bad_deadline": 0.03}
BAD_STATUS = {"bad_missing_prompt": 400, "bad_garbage_image": 400, "bad_mask_size": 422,
              "bad_unknown_template": 404, "bad_oversized": 413, "bad_unknown_lora": 404, "bad_deadline": 429}
# The server's counter of HTTP answers by endpoint and status, under its old and its new name.
REQUEST_COUNTERS = ("retouch_requests_total", "retouch_http_requests_total")


@dataclass(slots=True)
class SoakOptions:
    """A soak run: the server it starts, the load, the kills."""

    duration: float = option(help="seconds of load (then the requests in flight are waited for, up to --timeout)")
    workers: int = option(2, help="worker processes of the server")
    kill_every: float | None = option(None, help="SIGKILL a worker or a helper (alternately) every this many "
                                      "seconds (default: no kills)")
    model: str = option("tiny-flux-fill", help="built-in model the server runs")
    concurrency: int = option(4, help="client threads, each with one request in flight")
    steps: int = option(2, help="denoising steps of the templates and one-off edits")
    helpers: int = option(1, help="helper processes per worker")
    timeout: float = option(60.0, help="seconds a request may go without an answer before it counts as lost")
    device: str = option("auto", help="where the workers run", choices=DEVICES)
    seed: int = option(0, help="seeds the request mix, the masks and the choice of victims")
    templates: int = option(2, help="registered templates the `template` requests edit")
    template_replicas: int = option(0, help="the server's --template-replicas: workers each template is recorded "
                                    "on (0: every worker); a killed worker's templates are taken over")
    cache_host_mib: float | None = option(None, help="each worker's host cache, MiB (at least 1; default: the "
                                          "server's): below what the templates and one-off images take, "
                                          "templates are evicted, and recorded again by their next edit")
    cache_disk_mib: float | None = option(None, help="each worker's disk tier, MiB, in a temporary folder "
                                          "(default: none): evicted recordings go there, and a replacement "
                                          "worker adopts its predecessor's")
    loras: int = option(0, help="random adapters (rank 4) in a temporary --lora-dir: `lora` requests edit a "
                        "template with one of them, `bad_unknown_lora` requests name one the folder lacks")
    sizes: str = option("64x48", help="image sizes WxH, comma-separated: templates and one-off images take them "
                        "in turn, so Flux and SD3 workers batch several sizes in one forward")
    deadlines: bool = option(False, help="the server refuses edits that cannot meet their slo_ms (--slo-admission "
                             "reject): `deadline` requests carry 60 s, `bad_deadline` ones 1 ms")
    out: Path | None = option(None, help="folder for soak.json and soak.png")

    def __post_init__(self):
        for name in ("duration", "timeout", "kill_every", "cache_host_mib", "cache_disk_mib"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InputError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
        for name in ("workers", "concurrency", "steps", "helpers", "templates"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("template_replicas", "loras"):
            if getattr(self, name) < 0:
                raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        parse_sizes(self.sizes)
        if not is_builtin(self.model):  # each worker would fail to load it, with its traceback
            raise InputError(f"--model {self.model!r} is not a built-in model (see `retouch models`)")
        if self.out is not None:
            check_writable(Path(self.out) / "soak.json")


# ---- /proc ----

def socket_dirs(cmdline: tuple[str, ...]) -> set[str]:
    """The folders of the ipc:// sockets a helper's command line names (--tasks, --results)."""
    dirs = set()
    for flag, value in zip(cmdline, cmdline[1:]):
        if flag in ("--tasks", "--results") and value.startswith("ipc://"):
            dirs.add(os.path.dirname(value.removeprefix("ipc://")))
    return dirs


# ---- outcomes ----

OUTCOMES = ("ok", "4xx", "5xx", "other", "cancelled", "lost")


def classify(status: int | None, body_ok: bool, client_left: bool) -> str:
    """One of OUTCOMES. `status`: the answer's, None when none came; `body_ok`: the body is what the
    request's kind promises; `client_left`: the client closed the connection on purpose (a `cancel`)."""
    if status is None:
        return "cancelled" if client_left else "lost"
    if status == 200 and body_ok:
        return "ok"
    if 400 <= status < 500:
        return "4xx"
    if 500 <= status < 600:
        return "5xx"
    return "other"


@dataclass(slots=True)
class Outcome:
    kind: str  # a MIX key
    sent_s: float  # from the start of the load
    answered_s: float  # when the answer (or the failure) came
    outcome: str  # one of OUTCOMES
    status: int | None = None
    reason: str | None = None  # the exception's class when no answer came
    message: str | None = None  # the server's error message, or the exception's text

    @property
    def label(self) -> str:
        """What the by-kind table counts: "ok", "cancelled", "lost", else the status code."""
        return self.outcome if self.outcome in ("ok", "cancelled", "lost") else str(self.status)


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """The report's counts; its categories partition `sent`."""
    counts = Counter(o.outcome for o in outcomes)
    by_status = {name: Counter(str(o.status) for o in outcomes if o.outcome == name)
                 for name in ("4xx", "5xx", "other")}
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.label] += 1
    bad = [o for o in outcomes if o.kind in BAD_STATUS]
    messages: dict[str, str | None] = {}
    for o in outcomes:
        if o.outcome in ("5xx", "other"):
            messages.setdefault(str(o.status), o.message)
    lost = [o for o in outcomes if o.outcome == "lost"]
    latencies = sorted(o.answered_s - o.sent_s for o in outcomes if o.outcome == "ok")
    return {"sent": len(outcomes), "ok": counts["ok"], "4xx": dict(sorted(by_status["4xx"].items())),
            "5xx": dict(sorted(by_status["5xx"].items())), "other": dict(sorted(by_status["other"].items())),
            "cancelled": counts["cancelled"], "lost": counts["lost"],
            "bad_sent": len(bad), "bad_not_4xx": sum(o.outcome != "4xx" for o in bad),
            "bad_unexpected_status": sum(o.outcome == "4xx" and o.status != BAD_STATUS[o.kind] for o in bad),
            "by_kind": {kind: dict(sorted(c.items())) for kind, c in sorted(by_kind.items())},
            "lost_by_reason": dict(sorted(Counter(o.reason for o in lost).items())),
            "lost_examples": [{"kind": o.kind, "sent_s": round(o.sent_s, 3),
                               "waited_s": round(o.answered_s - o.sent_s, 3), "reason": o.reason,
                               "message": o.message} for o in lost[:10]],
            "error_messages": dict(sorted(messages.items())),
            "ok_p50_s": _percentile(latencies, 50), "ok_p95_s": _percentile(latencies, 95),
            "ok_per_s": counts["ok"] / wall_s if wall_s > 0 else None,
            "longest_silence_s": longest_silence([o.answered_s for o in outcomes], 0.0, wall_s)}


def longest_silence(answered_s: list[float], start_s: float, end_s: float) -> float:
    """The longest interval of [start_s, end_s] containing none of `answered_s`."""
    marks = [start_s, *sorted(t for t in answered_s if start_s <= t <= end_s), end_s]
    return max(b - a for a, b in zip(marks, marks[1:]))


def _percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def parse_request_counts(metrics_text: str) -> dict[str, dict[str, int]]:
    """The server's count of its HTTP answers from /metrics, as {endpoint: {status: count}}: the sample
    lines of REQUEST_COUNTERS (Prometheus text format)."""
    counts: dict[str, dict[str, int]] = {}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name not in REQUEST_COUNTERS or "}" not in rest:
            continue
        labels, value = rest.rsplit("}", 1)
        fields = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        if "endpoint" in fields and "status" in fields:
            endpoint = counts.setdefault(fields["endpoint"], {})
            endpoint[fields["status"]] = endpoint.get(fields["status"], 0) + int(float(value.split()[0]))
    return counts


# ---- the load ----

@dataclass(frozen=True)
class Assets:
    """Everything the load sends, encoded once."""

    template_ids: tuple[str, ...]
    cancel_template_id: str
    masks: dict[tuple[int, int], tuple[bytes, ...]]  # per size: PNG, mode L, white = repaint
    alpha_masks: dict[tuple[int, int], tuple[bytes, ...]]  # per size: PNG, RGBA, alpha 0 = repaint
    pool: tuple[bytes, ...]  # one-off images, PNG RGB, of the sizes in turn
    pool_rgba: tuple[bytes, ...]
    small_mask: bytes  # of a size no image has
    oversized: bytes
    loras: tuple[str, ...] = ()  # adapter names in the server's --lora-dir (--loras)
    sizes: tuple[tuple[int, int], ...] = (SIZE,)  # template i and pool image i have size i mod len(sizes)
    deadlines: bool = False  # the server refuses edits that cannot meet their slo_ms (--deadlines)

    def size_of_template(self, template_id: str) -> tuple[int, int]:
        if template_id == self.cancel_template_id:
            return self.sizes[0]
        return self.sizes[self.template_ids.index(template_id) % len(self.sizes)]


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """"64x48,96x64" -> ((64, 48), (96, 64)); each side 16 to 512 pixels."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if match is None or not all(16 <= int(side) <= 512 for side in match.groups()):
            raise InputError(f"--sizes must be WxH sizes of 16 to 512 pixels a side, comma-separated; got {text!r}")
        sizes.append((int(match[1]), int(match[2])))
    return tuple(dict.fromkeys(sizes))


def mix_of(assets: Assets) -> dict[str, float]:
    """The request kinds and their weights: MIX, LORA_MIX where the server has adapters, DEADLINE_MIX where it
    refuses edits that cannot meet their deadline."""
    return MIX | (LORA_MIX if assets.loras else {}) | (DEADLINE_MIX if assets.deadlines else {})


def write_loras(model: str, folder: Path, count: int) -> tuple[str, ...]:
    """`count` random adapters for `model` in diffusers' file format, in `folder`: their names. Every other
    one adapts the text encoders too, so that the helpers apply LoRA as they encode prompts."""
    from retouch.bench.lora import save_diffusers_lora
    from retouch.lora.files import text_encoder_components
    from retouch.models import load_pipeline

    pipe = load_pipeline(model).pipe
    component = "transformer" if hasattr(pipe, "transformer") else "unet"
    encoders = {name: getattr(pipe, name) for name in text_encoder_components(pipe)}
    names = tuple(f"soak-{i}" for i in range(count))
    for seed, name in enumerate(names):
        save_diffusers_lora(getattr(pipe, component), folder, LORA_RANK, name, seed, component,
                            encoders if seed % 2 == 0 else None)
    return names


def scene_png(seed: int, mode: str = "RGB", size: tuple[int, int] = SIZE) -> bytes:
    image = Image.open(io.BytesIO(template_png(max(size), seed))).crop((0, 0, *size)).convert(mode)
    return png_bytes(image)


def alpha_mask_png(box: tuple[int, int, int, int], size: tuple[int, int] = SIZE) -> bytes:
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    ImageDraw.Draw(mask).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=(0, 0, 0, 0))
    return png_bytes(mask)


def make_assets(template_ids: tuple[str, ...], cancel_template_id: str, seed: int,
                loras: tuple[str, ...] = (), sizes: tuple[tuple[int, int], ...] = (SIZE,),
                deadlines: bool = False) -> Assets:
    boxes = {size: mask_boxes(16, *size, MASK_BETA["public"], seed) for size in sizes}
    pool_sizes = [sizes[i % len(sizes)] for i in range(max(ONE_OFF_POOL, len(sizes)))]
    small = next(side for side in (32, 24, 40) if (side, side) not in sizes)
    return Assets(template_ids, cancel_template_id,
                  {size: tuple(mask_png(b, *size) for b in size_boxes) for size, size_boxes in boxes.items()},
                  {size: tuple(alpha_mask_png(b, size) for b in size_boxes) for size, size_boxes in boxes.items()},
                  tuple(scene_png(100 + i, size=size) for i, size in enumerate(pool_sizes)),
                  tuple(scene_png(100 + i, "RGBA", size) for i, size in enumerate(pool_sizes)),
                  mask_png((0, 0, 16, 16), small, small), os.urandom(int(MAX_UPLOAD_MB * (1 << 20)) + (512 << 10)),
                  loras, sizes, deadlines)


@dataclass
class HttpRequest:
    path: str
    data: dict
    files: list
    images: int | None = None  # JSON answer with this many images; None: a PNG answer


def build_request(kind: str, assets: Assets, rng: random.Random, fresh_seed: int) -> HttpRequest:
    """The request of `kind` (a MIX key); `fresh_seed` draws a new one-off image when one is wanted."""
    edit = {"prompt": f"a red balloon {rng.randrange(1000)}", "seed": str(rng.randrange(1 << 20))}
    template_id = assets.cancel_template_id if kind == "cancel" else rng.choice(assets.template_ids)
    mask = ("mask", ("mask.png", rng.choice(assets.masks[assets.size_of_template(template_id)]), "image/png"))
    if kind in ("template", "bad_mask_size", "bad_missing_prompt", "bad_unknown_template", "bad_oversized",
                "lora", "bad_unknown_lora", "deadline", "bad_deadline"):
        edit["template_id"] = template_id
    if kind == "template":
        return HttpRequest("/v1/edits", edit, [mask])
    if kind in ("deadline", "bad_deadline"):
        return HttpRequest("/v1/edits", {**edit, "slo_ms": "60000" if kind == "deadline" else "1"}, [mask])
    if kind == "lora":
        return HttpRequest("/v1/edits", {**edit, "lora": f"{rng.choice(assets.loras)}:{rng.uniform(0.5, 1.0):.2f}"},
                           [mask])
    if kind == "bad_unknown_lora":
        return HttpRequest("/v1/edits", {**edit, "lora": "soak-no-such-lora"}, [mask])
    if kind == "cancel":
        return HttpRequest("/v1/edits", {**edit, "template_id": assets.cancel_template_id}, [mask])
    if kind == "one_off":
        index = rng.randrange(len(assets.pool))
        size = assets.sizes[index % len(assets.sizes)]
        image = assets.pool[index] if rng.random() < 2 / 3 else scene_png(fresh_seed, size=size)
        mask = ("mask", ("mask.png", rng.choice(assets.masks[size]), "image/png"))
        return HttpRequest("/v1/edits", {**edit, "steps": ""}, [("image", ("image.png", image, "image/png")), mask])
    if kind == "openai_n2":
        index = rng.randrange(len(assets.pool_rgba))
        size = assets.sizes[index % len(assets.sizes)]
        files = [("image", ("image.png", assets.pool_rgba[index], "image/png")),
                 ("mask", ("mask.png", rng.choice(assets.alpha_masks[size]), "image/png"))]
        return HttpRequest("/v1/images/edits", {**edit, "n": "2", "response_format": "b64_json"}, files, images=2)
    if kind == "bad_missing_prompt":
        return HttpRequest("/v1/edits", {k: v for k, v in edit.items() if k != "prompt"}, [mask])
    if kind == "bad_garbage_image":
        return HttpRequest("/v1/edits", edit, [("image", ("image.png", b"not an image " * 20, "image/png")), mask])
    if kind == "bad_mask_size":
        return HttpRequest("/v1/edits", edit, [("mask", ("mask.png", assets.small_mask, "image/png"))])
    if kind == "bad_unknown_template":
        return HttpRequest("/v1/edits", {**edit, "template_id": "tpl-soak-no-such-template"}, [mask])
    if kind == "bad_oversized":
        return HttpRequest("/v1/edits", edit, [("mask", ("mask.png", assets.oversized, "image/png"))])
    raise ValueError(f"unknown request kind {kind!r}")


def body_ok(response, images: int | None) -> bool:
    if images is None:
        return response.content.startswith(PNG_SIGNATURE)
    try:
        data = response.json()["data"]
        return len(data) == images and all(base64.b64decode(item["b64_json"]).startswith(PNG_SIGNATURE)
                                           for item in data)
    except (ValueError, KeyError, TypeError):
        return False


def send(client, kind: str, request: HttpRequest, rng: random.Random, timeout_s: float, t0: float) -> Outcome:
    """One request, its outcome classified. A `cancel` reads its answer for 0.05-0.4 s only, then the
    client closes the connection (httpx drops a connection whose read timed out)."""
    import httpx

    read_s = rng.uniform(0.05, 0.4) if kind == "cancel" else timeout_s
    sent = time.monotonic() - t0
    try:
        response = client.post(request.path, data=request.data, files=request.files,
                               timeout=httpx.Timeout(timeout_s, read=read_s))
    except httpx.TransportError as exc:
        left = kind == "cancel" and isinstance(exc, httpx.ReadTimeout)
        return Outcome(kind, sent, time.monotonic() - t0, classify(None, False, left),
                       reason=type(exc).__name__, message=str(exc)[:200] or None)
    good = response.status_code == 200 and body_ok(response, request.images)
    message = None if good else _error_message(response)
    return Outcome(kind, sent, time.monotonic() - t0, classify(response.status_code, good, False),
                   status=response.status_code, message=message)


def _error_message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{len(response.content)} bytes of {response.headers.get('content-type', 'unknown type')}"


def client_loop(url: str, assets: Assets, opts: SoakOptions, index: int, t0: float, until: float,
                outcomes: list[Outcome], waiting: dict[int, tuple[str, float]]) -> None:
    """Requests until `until`, one at a time; `waiting[index]` holds (kind, sent_s) while one is out."""
    import httpx

    rng = random.Random(opts.seed * 1000 + index)
    mix = mix_of(assets)
    kinds, weights = list(mix), list(mix.values())
    with httpx.Client(base_url=url) as client:
        count = 0
        while time.monotonic() < until:
            kind = rng.choices(kinds, weights)[0]
            request = build_request(kind, assets, rng, fresh_seed=10_000 + index * 1_000_000 + count)
            waiting[index] = (kind, time.monotonic() - t0)
            outcomes.append(send(client, kind, request, rng, opts.timeout, t0))  # list.append is atomic
            del waiting[index]
            count += 1


# ---- the server's processes: sampled, killed, left behind ----

@dataclass(slots=True)
class Kill:
    t_s: float
    target: str  # "worker" or "helper"
    name: str  # the worker's name; a helper's is "<worker>/helper"
    pid: int


@dataclass(slots=True)
class Sample:
    t_s: float
    router_rss: int  # this process
    workers_rss: int  # live workers and their helpers
    orphans_rss: int  # workers and helpers seen before, alive, no longer under this process
    workers: int
    helpers: int


@dataclass
class ProcessWatch:
    """The server's worker and helper processes as this process's descendants, sampled: RSS over time,
    every one seen (by pid and start time, to find those left behind), and helper restarts (a helper
    that appears under a worker whose helpers were already seen)."""

    root_pid: int
    proc: Path = PROC
    samples: list[Sample] = field(default_factory=list)
    seen: dict[tuple[int, int], ProcessInfo] = field(default_factory=dict)
    helpers_of: dict[tuple[int, int], set] = field(default_factory=dict)  # worker key -> helper keys seen
    helper_restarts_seen: int = 0
    helper_dirs: set = field(default_factory=set)

    def look(self) -> tuple[list[ProcessInfo], list[ProcessInfo]]:
        """(live workers, live helpers under them) now; remembers every one."""
        tree = [p for p in descendants(scan_processes(self.proc), self.root_pid) if p.alive and p.role]
        # A child between fork and exec still shows its parent's command line: a worker is a child of
        # the root, a helper a child of a worker.
        workers = [p for p in tree if p.role == "worker" and p.ppid == self.root_pid]
        worker_pids = {p.pid for p in workers}
        helpers = [p for p in tree if p.role == "helper" and p.ppid in worker_pids]
        for p in workers + helpers:
            self.seen[p.key] = p  # the latest look: its command line after exec
        for worker in workers:
            mine = {h.key for h in helpers if h.ppid == worker.pid}
            known = self.helpers_of.setdefault(worker.key, set())
            if known:
                self.helper_restarts_seen += len(mine - known)
            known |= mine
        for helper in helpers:
            self.helper_dirs |= socket_dirs(helper.cmdline)
        return workers, helpers

    def sample(self, t_s: float) -> Sample:
        workers, helpers = self.look()
        current = {p.key for p in workers + helpers}
        orphans = [k for k in self.still_alive() if k not in current]
        sample = Sample(t_s, rss_bytes(self.root_pid, self.proc),
                        sum(rss_bytes(p.pid, self.proc) for p in workers + helpers),
                        sum(rss_bytes(pid, self.proc) for pid, _ in orphans), len(workers), len(helpers))
        self.samples.append(sample)
        return sample

    def still_alive(self) -> list[tuple[int, int]]:
        """Keys of the processes seen that still run (same pid and start time, not a zombie)."""
        alive = []
        for key in self.seen:
            info = read_process(key[0], self.proc)
            if info is not None and info.key == key and info.alive:
                alive.append(key)
        return alive


def kill_one(due: str, server, watch: ProcessWatch, rng: random.Random, t_s: float) -> Kill | None:
    """SIGKILL a process of kind `due` ("worker" or "helper"), else one of the other kind; None when
    there is neither. Workers whose slot the supervisor would not restart again are spared."""
    supervisor = server.supervisor
    restartable = {w.name for w in supervisor.workers if supervisor.restarts.would_allow(w.slot)}
    workers = {name: pid for name, pid in supervisor.pids().items() if name in restartable}
    _, helpers = watch.look()
    name_of = {pid: name for name, pid in supervisor.pids().items()}
    candidates = {"worker": [(name, pid) for name, pid in sorted(workers.items())],
                  "helper": [(f"{name_of.get(h.ppid, h.ppid)}/helper", h.pid) for h in helpers]}
    for target in (due, "helper" if due == "worker" else "worker"):
        if candidates[target]:
            name, pid = rng.choice(candidates[target])
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return Kill(t_s, target, name, pid)
    return None


def conduct(server, watch: ProcessWatch, opts: SoakOptions, t0: float, stop: threading.Event,
            outcomes: list[Outcome], kills: list[Kill]) -> None:
    """The bench's clock, on a thread: a sample every SAMPLE_S, a kill every --kill-every (during the
    load only), a progress line every PROGRESS_S, until `stop`."""
    rng = random.Random(opts.seed + 17)
    next_sample, next_progress = 0.0, PROGRESS_S
    next_kill = opts.kill_every if opts.kill_every is not None else float("inf")
    while True:
        now = time.monotonic() - t0
        if now >= next_sample:
            sample = watch.sample(now)
            next_sample += SAMPLE_S
        if now >= next_kill:
            if now < opts.duration:
                due = "worker" if len(kills) % 2 == 0 else "helper"
                kill = kill_one(due, server, watch, rng, now)
                if kill is not None:
                    kills.append(kill)
                print(f"soak: {now:5.1f} s: " + (f"SIGKILL {kill.target} {kill.name} (pid {kill.pid})" if kill
                      else "nothing to kill"), file=sys.stderr)
            next_kill += opts.kill_every
        if now >= next_progress:
            counts = Counter(o.outcome for o in list(outcomes))
            print(f"soak: {now:5.1f} s: sent {sum(counts.values())}, " + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES)
                  + f"; {sample.workers} workers, {sample.helpers} helpers, workers RSS "
                  f"{sample.workers_rss / 2**20:.0f} MiB, router RSS {sample.router_rss / 2**20:.0f} MiB",
                  file=sys.stderr)
            next_progress += PROGRESS_S
        if stop.wait(max(0.0, min(next_sample, next_kill, next_progress) - (time.monotonic() - t0))):
            return


def resources(server, pid: int) -> dict:
    """RSS and open descriptors of this process and of every live worker (with its helpers' RSS)."""
    table = scan_processes()
    workers = {}
    for name, worker_pid in sorted(server.supervisor.pids().items()):
        helpers = [p for p in table.values() if p.ppid == worker_pid and p.alive and p.role == "helper"]
        workers[name] = {"pid": worker_pid, "rss": rss_bytes(worker_pid), "fds": open_fds(worker_pid),
                         "helpers_rss": sum(rss_bytes(h.pid) for h in helpers), "helpers": len(helpers)}
    return {"router_rss": rss_bytes(pid), "router_fds": open_fds(pid),
            "workers_rss": sum(w["rss"] + w["helpers_rss"] for w in workers.values()),
            "workers_fds": sum(w["fds"] or 0 for w in workers.values()), "workers": workers}


def socket_folders(root: Path) -> set[str]:
    return {str(p) for pattern in ("retouch-serve-*", "retouch-helpers-*") for p in root.glob(pattern)}


def leftovers(watch: ProcessWatch, serve_id: str | None, folders_before: set[str], root: Path) -> dict:
    """What outlived the server: processes (see the module's docstring) and socket folders."""
    found = {}
    for key in watch.still_alive():
        info = read_process(key[0])  # as it is now: an orphan's parent is init
        if info is not None and info.key == key:
            found[key] = info
    if serve_id is not None:
        for info in processes_with_env(SERVE_ID_ENV, serve_id):
            if info.pid != os.getpid():
                found.setdefault(info.key, info)
    folders_now = socket_folders(root)
    ours = {str(p) for p in root.glob(f"retouch-serve-{os.getpid()}-*")} - folders_before
    ours |= {d for d in watch.helper_dirs if os.path.isdir(d)}
    return {"processes": [{"pid": p.pid, "ppid": p.ppid, "role": p.role, "cmdline": " ".join(p.cmdline)[:200]}
                          for p in sorted(found.values(), key=lambda p: p.pid)],
            "folders": sorted(ours),
            "unattributed_new_folders": sorted(folders_now - folders_before - ours),
            "found_by": "RETOUCH_SERVE_ID and descendants seen" if serve_id is not None
            else "descendants seen (the server has no serve_id)"}


def clean_up(left: dict) -> None:
    for process in left["processes"]:
        try:
            os.kill(process["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    for folder in left["folders"]:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the run ----

def register(client, image: bytes, prompt: str, steps: int) -> str:
    response = client.post("/v1/templates", files={"image": ("t.png", image, "image/png")},
                           data={"prompt": prompt, "steps": str(steps)})
    if response.status_code not in (200, 202):
        raise RuntimeError(f"registering a template answered {response.status_code}: {response.text[:200]}")
    return response.json()["id"]


def recovered(router, opts: SoakOptions, template_ids: tuple[str, ...]) -> bool:
    """Every worker connected and every template ready on as many as it is recorded on (every worker, or
    --template-replicas; the router may have added replicas), checked under the router's lock."""
    replicas = min(opts.template_replicas or opts.workers, opts.workers)
    return len(router.workers) == opts.workers and all(
        (router.template(t) or {}).get("progress", {}).get("workers_ready", 0) >= replicas for t in template_ids)


def start_server(opts: SoakOptions, scratch: Path):
    """The server, with the load's templates recorded (`recovered`): (server, Assets). `scratch`: a
    temporary folder for the workers' disk tier (--cache-disk-mib) and the adapters (--loras)."""
    import httpx

    from retouch.config import ServeOptions
    from retouch.server import Server

    extra, loras = {}, ()
    if opts.cache_host_mib is not None:
        extra["cache_host_gib"] = opts.cache_host_mib / 1024
    if opts.cache_disk_mib is not None:
        extra.update(cache_disk_dir=scratch / "disk", cache_disk_gib=opts.cache_disk_mib / 1024)
    if opts.loras:
        (scratch / "loras").mkdir()
        loras = write_loras(opts.model, scratch / "loras", opts.loras)
        extra["lora_dir"] = scratch / "loras"
    serve = ServeOptions(model=opts.model, workers=opts.workers, port=0, mode="disagg", helpers=opts.helpers,
                         worker_threads=1, helper_threads=1, steps=opts.steps, device=opts.device,
                         max_upload_mb=MAX_UPLOAD_MB, heartbeat_s=0.2, dead_after_s=3.0,
                         template_replicas=opts.template_replicas,
                         slo_admission="reject" if opts.deadlines else "accept", **extra)
    server = Server(serve).start()
    try:
        with httpx.Client(base_url=server.url, timeout=opts.timeout) as client:
            sizes = parse_sizes(opts.sizes)
            template_ids = tuple(register(client, scene_png(i, size=sizes[i % len(sizes)]), f"a room {i}",
                                          opts.steps) for i in range(opts.templates))
            cancel_id = register(client, scene_png(opts.templates, size=sizes[0]), "a long room", CANCEL_STEPS)
        if not server.router.wait_until(lambda r: recovered(r, opts, (*template_ids, cancel_id)), 300):
            raise RuntimeError("the templates were not recorded within 300 s")
    except BaseException:
        server.close(drain_s=5.0)
        raise
    return server, make_assets(template_ids, cancel_id, opts.seed, loras, sizes, opts.deadlines)


@dataclass
class Load:
    """What the load saw: every request's outcome, the kills, how long it took; and how long the
    server took after it to have every worker back with every template (None: not within --timeout)."""

    outcomes: list[Outcome]
    kills: list[Kill]
    wall_s: float
    recovery_s: float | None


def drive(server, assets: Assets, opts: SoakOptions, watch: ProcessWatch) -> Load:
    """The clients for --duration (then their last requests, up to --timeout + 60 s), the kills
    meanwhile, then the wait for recovery; sampled throughout."""
    outcomes: list[Outcome] = []
    kills: list[Kill] = []
    waiting: dict[int, tuple[str, float]] = {}
    t0 = time.monotonic()
    stop = threading.Event()
    conductor = threading.Thread(target=conduct, args=(server, watch, opts, t0, stop, outcomes, kills),
                                 name="soak-conductor", daemon=True)
    conductor.start()
    clients = [threading.Thread(target=client_loop, name=f"soak-client-{i}", daemon=True,
                                args=(server.url, assets, opts, i, t0, t0 + opts.duration, outcomes, waiting))
               for i in range(opts.concurrency)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(max(0.0, t0 + opts.duration + opts.timeout + 60 - time.monotonic()))
    wall_s = time.monotonic() - t0
    outcomes = list(outcomes) + [Outcome(kind, sent_s, wall_s, "lost", reason="StillWaiting")
                                 for kind, sent_s in dict(waiting).values()]
    templates = (*assets.template_ids, assets.cancel_template_id)
    back = server.router.wait_until(lambda r: recovered(r, opts, templates), opts.timeout)
    recovery_s = time.monotonic() - t0 - wall_s if back else None
    stop.set()
    conductor.join()
    return Load(outcomes, kills, wall_s, recovery_s)


def process_report(server, watch: ProcessWatch, start: dict, end: dict, duration_s: float) -> dict:
    """Restarts, RSS and descriptors of the report, before the server closes."""
    supervisor = server.supervisor
    middle_rss = next((s.router_rss for s in watch.samples if s.t_s >= duration_s / 2), end["router_rss"])
    return {"restarts": {"worker_exits": supervisor.exits,
                         "worker_restarts": sum(w.restarts for w in supervisor.workers),
                         "helper_restarts_seen": watch.helper_restarts_seen,
                         "workers_live_end": len(supervisor.pids()),
                         "workers_ready_end": len(server.router.snapshot()["workers"])},
            "router_counters": server.router.snapshot()["counters"],
            "worker_counters_end": worker_counters(server.router.snapshot()["workers"]),
            "router_templates_end": server.router.snapshot()["templates"],
            "rss": {"router_start": start["router_rss"], "router_end": end["router_rss"],
                    "router_growth": end["router_rss"] - start["router_rss"],
                    "router_growth_second_half": end["router_rss"] - middle_rss,
                    "workers_start": start["workers_rss"], "workers_end": end["workers_rss"],
                    "per_worker_start": {n: [w["rss"], w["helpers_rss"]] for n, w in start["workers"].items()},
                    "per_worker_end": {n: [w["rss"], w["helpers_rss"]] for n, w in end["workers"].items()}},
            "fds": {"router_start": start["router_fds"], "router_end": end["router_fds"],
                    "workers_start": start["workers_fds"], "workers_end": end["workers_fds"],
                    "per_worker_start": {n: w["fds"] for n, w in start["workers"].items()},
                    "per_worker_end": {n: w["fds"] for n, w in end["workers"].items()}}}


# The workers' counters of recordings and cache tiers the report sums (`worker_counters`)
WORKER_COUNTERS = ("completed", "failed", "failed_recordings", "recorded", "deferred_recordings", "interruptions",
                   "mixed_size_steps")
CACHE_COUNTERS = ("hits", "misses", "disk_hits", "evictions", "adoptions", "corrupt_files")


def worker_counters(workers: dict) -> dict:
    """Recordings and cache-tier events summed over the workers connected at the end, from their last
    heartbeats: a killed worker's counts died with it, so these are lower bounds of the run's."""
    reports = list(workers.values())
    return ({key: sum(int(report.get(key, 0)) for report in reports) for key in WORKER_COUNTERS}
            | {f"cache_{key}": sum(int(report.get("cache", {}).get(key, 0)) for report in reports)
               for key in CACHE_COUNTERS})


def run(opts: SoakOptions) -> tuple[dict, list[Outcome]]:
    """Start the server, load it for --duration while killing, wait for it to recover, close it, look
    for leftovers: the report and every request's outcome."""
    import httpx

    root = Path(tempfile.gettempdir())
    folders_before = socket_folders(root)
    started = time.monotonic()
    scratch = tempfile.TemporaryDirectory(prefix="retouch-soak-")
    try:
        server, assets = start_server(opts, Path(scratch.name))
    except BaseException:
        scratch.cleanup()
        raise
    serve_id = getattr(server, "serve_id", None)
    watch = ProcessWatch(os.getpid())
    try:
        start = resources(server, os.getpid())
        print(f"soak: server ready after {time.monotonic() - started:.1f} s; {opts.duration:g} s of load at "
              f"concurrency {opts.concurrency}" + (f", a kill every {opts.kill_every:g} s" if opts.kill_every else ""),
              file=sys.stderr)
        load = drive(server, assets, opts, watch)
        processes = process_report(server, watch, start, resources(server, os.getpid()), opts.duration)
        server_answers = parse_request_counts(httpx.get(server.url + "/metrics", timeout=30).text)
    finally:
        closing = time.monotonic()
        server.close(drain_s=min(opts.timeout, 30.0))
        close_s = time.monotonic() - closing
        scratch.cleanup()
    left = leftovers(watch, serve_id, folders_before, root)
    clean_up(left)
    summary = summarize(load.outcomes, load.wall_s)
    kill_counts = Counter(k.target for k in load.kills)
    report = {"bench": "soak", **summary, "wall_s": load.wall_s,
              "kills": {"worker": kill_counts["worker"], "helper": kill_counts["helper"],
                        "events": [asdict(k) for k in load.kills]},
              **processes, "recovery_s": load.recovery_s, "server_answers": server_answers, "close_s": close_s,
              "serve_id": serve_id, "leftovers": left,
              "failed": summary["lost"] > 0 or bool(left["processes"]) or bool(left["folders"]),
              "samples": [asdict(s) for s in watch.samples],
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()}
              | {"sizes": [list(size) for size in assets.sizes], "cancel_steps": CANCEL_STEPS,
                 "max_upload_mb": MAX_UPLOAD_MB, "mix": mix_of(assets)}}
    return report, load.outcomes


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="retouch bench soak", description=__doc__)
    add_arguments(parser, SoakOptions)
    args = parser.parse_args(argv)
    try:
        opts = from_arguments(SoakOptions, args)
    except InputError as exc:
        parser.error(str(exc))
    import torch

    from retouch.bench.report import environment, write_json

    report, outcomes = run(opts)
    device = opts.device if opts.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    report.update(environment("soak", argv, device))  # command, versions, commit, device
    if opts.out is not None:
        write_json(report, opts.out / "soak.json")
        plot(report, outcomes, opts.out / "soak.png")
    from retouch.bench.report import json_text

    print(json_text(report))
    if report["failed"]:
        print(f"soak: FAILED: {report['lost']} lost, {len(report['leftovers']['processes'])} processes and "
              f"{len(report['leftovers']['folders'])} folders left behind", file=sys.stderr)
        raise SystemExit(1)
    return report


def plot(report: dict, outcomes: list[Outcome], out: Path) -> None:
    """Requests/s by outcome (by when each was answered) and RSS over time, with the kills marked."""
    from retouch.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return
    figure, (rates, memory) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    seconds = int(report["wall_s"]) + 1
    for name in OUTCOMES:
        per_second = Counter(int(o.answered_s) for o in outcomes if o.outcome == name)
        if per_second:
            rates.plot(range(seconds), [per_second[s] for s in range(seconds)], drawstyle="steps-post",
                       label=f"{name} ({sum(per_second.values())})")
    rates.set_ylabel("answers per second")
    samples = report["samples"]
    times = [s["t_s"] for s in samples]
    for key, label in (("router_rss", "router (this process)"), ("workers_rss", "workers + helpers"),
                       ("orphans_rss", "orphans (no longer under the router)")):
        memory.plot(times, [s[key] / 2**20 for s in samples], label=label)
    memory.set_ylabel("RSS (MiB)")
    memory.set_xlabel("seconds from the start of the load")
    for axes in (rates, memory):
        for kill in report["kills"]["events"]:
            axes.axvline(kill["t_s"], color="red" if kill["target"] == "worker" else "orange",
                         linestyle="-" if kill["target"] == "worker" else "--", linewidth=0.8)
        axes.legend(fontsize=8)
    figure.suptitle(f"soak: {report['sent']} requests, ok {report['ok']}, lost {report['lost']}; kills (red: worker, "
                    f"orange dashed: helper) {report['kills']['worker']} + {report['kills']['helper']}")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
