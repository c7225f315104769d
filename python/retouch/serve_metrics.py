"""The HTTP frontend's Prometheus metrics, with prometheus_client.

One `CollectorRegistry` per app (never the process-wide one: several apps share a test process).
What the frontend counts itself (answers by endpoint and status, edit latency, routing decision
time) lives in client metrics; what the router knows (queue, workers, their template caches) is read
from `router.snapshot()` when scraped (`RouterCollector`), so nothing is copied between scrapes.

    metrics = ServeMetrics(router)
    body, content_type = metrics.exposition(request.headers.get("accept", ""))

A worker's counters (steps, completed, cache hits, LoRA loads, ...) are cumulative in its process and
arrive in its heartbeat (so they lag the HTTP counters by up to one heartbeat); they are exposed as
counters that restart from zero when the worker does, which Prometheus' rate() reads as a counter
reset. A local worker's replacement (w0.1 of `retouch serve`) keeps its slot's label (w0); a worker
that joins with `retouch worker` keeps its label across restarts only with a fixed `--name`.

SLOs, per size class (`engine.router.size_class`): `retouch_slo_requests_total{class, outcome}`
counts edits with a deadline (outcome "with_deadline") and how each ended (met, missed, refused at
admission, cancelled); `retouch_slo_goodput{class}` is met / (met + missed + refused).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from retouch.edit_jobs import STATUSES, EditJobs
from retouch.engine.router import SLO_OUTCOMES, Router
from retouch.webhooks import WebhookSender

LOCAL_WORKER = re.compile(r"(?P<slot>w\d+)(\.(?P<restart>\d+))?")  # the supervisor's names: w0, w0.1, ...
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
# A policy decision takes microseconds (least-requests) to a millisecond or so (mask-aware, many workers).
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)

# Routes, not URLs: a label per route keeps unknown paths and template ids from growing the series.
ENDPOINTS = ("/v1/templates", "/v1/edits", "/v1/images/edits", "/v1/models", "/v1/loras", "/v1/limits", "/metrics",
             "/healthz", "/readyz", "/openapi.json", "/docs", "/redoc", "/")
ROUTES_WITH_ID = ("/v1/templates/", "/v1/edits/")

# (heartbeat key, help[, metric name when not the key]) per worker; the keys of
# engine.metrics.WorkerMetrics.summary and of the router's own per-worker view.
WORKER_GAUGES = (("running", "requests in the worker's running batch (edits, and templates it records)"),
                 ("queued", "requests queued at the worker (edits, and templates it was sent to record)"),
                 ("assigned", "requests the router has sent the worker and not yet had answered"),
                 ("mean_batch_size", "mean batch size over the worker process's life (windowed: "
                  "rate(batch_rows) / rate(steps))"),
                 ("mean_step_s", "mean seconds per denoising step over the worker process's life (windowed: "
                  "rate(step_seconds) / rate(steps))", "mean_step_seconds"))
WORKER_COUNTERS = (("steps", "denoising steps run"),
                   ("step_seconds", "seconds spent in denoising steps"),
                   ("batch_rows", "requests summed over the denoising steps (their batch sizes)"),
                   ("completed", "edits completed"),
                   ("failed", "edits failed"),
                   ("failed_recordings", "template recordings failed: registrations, and the worker's own "
                    "recordings of templates it had lost"),
                   ("cancelled", "edits cancelled"),
                   ("recorded", "templates recorded"),
                   ("unrecorded", "one-off images answered in full but not recorded: their recording did not fit "
                    "the host cache (--cache-host-gib), so their later edits are not mask-aware either"),
                   ("recording_retries", "registrations started over because templates in use held the host "
                    "cache their recording needed"),
                   ("mixed_size_steps", "steps of a batch of requests of different image sizes, run as one "
                    "forward (Flux and SD3 pack them)"),
                   ("deferred_recordings", "templates a joining worker was sent that its caches had no room for "
                    "beside those it had recorded: each is recorded by its first edit there"),
                   ("interruptions", "inline pre/post-processing tasks, and templates recorded again, while "
                    "other requests were denoising"),
                   ("helper_restarts", "pre/post-processing helper processes replaced: they died, or said nothing "
                    "for --helper-silence-s"))
# The keys of cache.store.CacheStore.metrics.
CACHE_COUNTERS = (("hits", "template activation lookups found in host memory"),
                  ("misses", "template activation lookups in no tier (or an unusable file): recorded again"),
                  ("disk_hits", "template activation lookups read back from disk"),
                  ("evictions", "templates evicted from host memory"),
                  ("prefetches", "templates prefetched from disk"),
                  ("prefetch_bytes", "bytes prefetched from disk"),
                  ("prefetch_seconds", "seconds spent prefetching"),
                  ("disk_reads", "activation files read"),
                  ("disk_writes", "activation files written"),
                  ("disk_write_failures", "activation files that could not be written (disk full or broken)"),
                  ("disk_too_large", "templates not written: alone larger than the disk tier (--cache-disk-gib)"),
                  ("disk_bytes_read", "bytes read from the disk tier"),
                  ("disk_bytes_written", "bytes written to the disk tier"),
                  ("disk_evictions", "templates evicted from the disk tier"),
                  ("corrupt_files", "activation files found corrupt and dropped"),
                  ("registrations", "templates registered in the cache"),
                  ("adoptions", "templates served by the disk tier's recording of an earlier process instead "
                   "of being recorded again"))
CACHE_GAUGES = (("host_bytes_used", "bytes of activations in pinned host memory", "host_used_bytes"),
                ("host_bytes_budget", "the host tier's budget in bytes", "host_budget_bytes"),
                ("host_templates", "templates resident in host memory"),
                ("disk_bytes_used", "bytes of activations on disk", "disk_used_bytes"),
                ("disk_bytes_budget", "the disk tier's budget in bytes", "disk_budget_bytes"))
# The keys of lora.manager.LoraManager.metrics.
LORA_COUNTERS = (("hits", "LoRA lookups served without reading the file (on the device or in the host cache)"),
                 ("misses", "LoRA lookups that needed a read of the file (failed reads included)"),
                 ("evictions", "LoRAs evicted from the host cache"),
                 ("loads", "LoRA files loaded"),
                 ("load_failures", "LoRA lookups a worker answered 422: no such file, or one that cannot be "
                  "loaded (names the HTTP frontend answers 404 never reach a worker)"),
                 ("load_seconds", "seconds spent loading LoRA files"),
                 ("load_cpu_seconds", "CPU seconds the loader thread spent on them (the rest: waiting on storage)"),
                 ("read_fallbacks", "LoRA files read into fresh host memory: the recycled memory had no free range "
                  "of their size (evicted adapters still in use by requests, or a file converted to the serving "
                  "dtype, whose read and converted factors are held at once)"),
                 ("device_evictions", "LoRA copies evicted from the worker's device"),
                 ("loads_skipped", "LoRA loads not made: every request that asked for it had gone (cancelled)"))
LORA_GAUGES = (("cached_bytes", "bytes of host memory the worker's LoRA cache holds (the files as read)"),
               ("cached_adapters", "LoRAs in the worker's host cache"),
               ("budget_bytes", "the LoRA host cache's budget in bytes"),
               ("device_bytes", "bytes of LoRA weights on the worker's device"),
               ("device_budget_bytes", "the budget of the LoRA copies on the device in bytes"),
               ("device_adapters", "LoRAs on the worker's device"),
               ("device_pinned", "LoRAs on the device held by queued or running requests (kept beyond the budget)"),
               ("loading", "LoRA files being read"))


def endpoint_label(path: str) -> str:
    for prefix in ROUTES_WITH_ID:
        if path.startswith(prefix):
            return prefix + "{id}"
    return path if path in ENDPOINTS else "other"


class ServeMetrics:
    """The app's registry: `requests` (every HTTP answer), `latency` (edits, by outcome),
    `decisions` (the router's policy time: `router.on_decision = metrics.decisions.observe`),
    `inflight_body_bytes` (request bodies reserved), `connections_closed` (by the connection guards:
    `http_connections.guarded_protocol(..., on_close=...)`), and the router's state at scrape time."""

    def __init__(self, router: Router):
        self.registry = CollectorRegistry()
        self.requests = Counter("retouch_http_requests", "HTTP answers by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.latency = Histogram("retouch_request_seconds", "end-to-end edit latency by outcome",
                                 ("endpoint", "outcome"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.decisions = Histogram("retouch_router_decision_seconds", "routing policy time per decision",
                                   buckets=DECISION_BUCKETS, registry=self.registry)
        self.inflight_body_bytes = Gauge("retouch_http_inflight_body_bytes",
                                         "request body bytes reserved by requests being handled",
                                         registry=self.registry)
        self.connections_closed = Counter("retouch_http_connections_closed",
                                          "connections the server closed without an answer, by reason "
                                          "(header_timeout, body_timeout, over_cap)", ("reason",),
                                          registry=self.registry)
        self.registry.register(RouterCollector(router))

    def watch_webhooks(self, sender: WebhookSender) -> None:
        """Webhook deliveries (`retouch.webhooks.WebhookSender`), read at scrape time."""
        self.registry.register(WebhookCollector(sender))

    def watch_jobs(self, jobs: EditJobs) -> None:
        """Asynchronous and keyed edits (`retouch.edit_jobs.EditJobs`), read at scrape time."""
        self.registry.register(JobCollector(jobs))

    def count(self, path: str, status: int) -> None:
        self.requests.labels(endpoint_label(path), str(status)).inc()

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The metrics in the format the scraper asked for (`Accept`): OpenMetrics or Prometheus
        text 0.0.4; (body, content type)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class JobCollector(Collector):
    def __init__(self, jobs: EditJobs):
        self.jobs = jobs

    def collect(self) -> Iterator[Metric]:
        counts = self.jobs.counts()
        held = GaugeMetricFamily("retouch_edit_jobs", "asynchronous and keyed edits running or kept, by status",
                                 labels=("status",))
        for status in STATUSES:
            held.add_metric((status,), counts[status])
        yield held
        yield GaugeMetricFamily("retouch_edit_job_bytes", "bytes of the kept answers of asynchronous and keyed edits",
                                value=counts["kept_bytes"])
        yield CounterMetricFamily("retouch_idempotent_replays", "edits answered from an earlier request with the "
                                  "same Idempotency-Key", value=self.jobs.replays)
        dropped = CounterMetricFamily("retouch_edit_jobs_dropped", "kept answers dropped: past --result-ttl-s "
                                      "(expired) or over --result-store-mb (evicted)", labels=("reason",))
        for reason, value in self.jobs.dropped.items():
            dropped.add_metric((reason,), value)
        yield dropped
        if self.jobs.folder is not None:
            yield CounterMetricFamily("retouch_edit_job_disk_errors", "kept answers that could not be written to "
                                      "(or removed from) --cache-disk-dir/edits; they stay in memory",
                                      value=self.jobs.folder.write_errors)


class WebhookCollector(Collector):
    def __init__(self, sender: WebhookSender):
        self.sender = sender

    def collect(self) -> Iterator[Metric]:
        outcomes = CounterMetricFamily("retouch_webhooks", "webhook deliveries by how they ended: delivered (a 2xx "
                                       "came back), failed (no attempt had one), gone (410), refused (an origin no "
                                       "longer allowed), cancelled (a DELETE, or the stop: sent after a restart); and "
                                       "retried: attempts after a first", labels=("outcome",))
        for outcome, value in dict(self.sender.counts).items():
            outcomes.add_metric((outcome,), value)
        yield outcomes
        yield GaugeMetricFamily("retouch_webhooks_pending", "webhooks being delivered or waiting to be retried",
                                value=self.sender.pending())


class RouterCollector(Collector):
    """Gauges and counters read from `router.snapshot()` when scraped. A worker's heartbeat may
    lack any key (a worker without a CacheStore sends no "cache"); what is missing, or not a number,
    is left out rather than failing the scrape."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self) -> Iterator[Metric]:
        snapshot = self.router.snapshot()
        workers = stable_labels(list(snapshot["workers"].items()))
        for name, help_text, value in (("retouch_queue_depth", "edits accepted and not yet answered",
                                        snapshot["pending"]),
                                       ("retouch_parked_edits", "edits waiting for their template's recording",
                                        snapshot["parked"]),
                                       ("retouch_workers", "live workers", len(workers)),
                                       ("retouch_templates", "registered templates and one-off images",
                                        snapshot["templates"])):
            yield GaugeMetricFamily(name, help_text, value=value)
        held = GaugeMetricFamily("retouch_template_bytes", "bytes of images the head holds in memory: registered "
                                 "templates (--max-templates-mb) and one-off images (--max-one-off-mb)",
                                 labels=("kind",))
        for kind, value in sorted(snapshot["template_bytes"].items()):
            held.add_metric((kind,), value)
        yield held
        events = CounterMetricFamily("retouch_router_events", "router events (routed, rerouted, ...)",
                                     labels=("event",))
        for event, value in sorted(snapshot["counters"].items()):
            events.add_metric((event,), value)
        yield events
        yield from _slo(snapshot.get("slo", {}))
        yield from worker_families(workers)
        about_keys = ("model", "dtype", "weights", "scheduler")
        info = GaugeMetricFamily("retouch_worker_info", "1 per worker, labelled with the model, dtype, weights "
                                 "(a digest, scheduler included) and scheduler it serves: workers whose weights differ "
                                 "answer one edit differently", labels=("worker", *about_keys))
        for name, report in workers:
            about = report.get("info") or {}
            info.add_metric((name, *(str(about.get(key) or "") for key in about_keys)), 1)
        yield info


def _slo(per_class: dict[str, dict[str, int]]) -> Iterator[Metric]:
    requests = CounterMetricFamily("retouch_slo_requests", "edits with a deadline (outcome with_deadline) and "
                                   "how they ended (met, missed, refused, cancelled), by size class",
                                   labels=("class", "outcome"))
    goodput = GaugeMetricFamily("retouch_slo_goodput", "edits that met their deadline / those met, missed or "
                                "refused, by size class", labels=("class",))
    for size, counts in sorted(per_class.items()):
        for outcome in ("with_deadline", *SLO_OUTCOMES):
            requests.add_metric((size, outcome), counts.get(outcome, 0))
        decided = sum(counts.get(outcome, 0) for outcome in ("met", "missed", "refused"))
        if decided:
            goodput.add_metric((size,), counts.get("met", 0) / decided)
    yield requests
    yield goodput


def worker_label(name: str) -> str:
    """A worker's `worker` label: a local worker's replacement (w0.1, w0.2, ... of `retouch serve`'s
    supervisor) reports as its slot (w0), so its series go on across restarts, as a counter reset."""
    local = LOCAL_WORKER.fullmatch(name)
    return local["slot"] if local else name


def stable_labels(workers: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(label, report) per worker; of a slot's old process and its replacement, both still connected
    (the old one not yet declared dead), the newest."""
    newest: dict[str, tuple[int, str, dict]] = {}
    for name, report in workers:
        local = LOCAL_WORKER.fullmatch(name)
        restart = int(local["restart"] or 0) if local else 0
        label = worker_label(name)
        if label not in newest or restart > newest[label][0]:
            newest[label] = (restart, name, report)
    return [(label, report) for label, (_, _, report) in sorted(newest.items())]


def worker_families(workers: list[tuple[str, dict]]) -> Iterator[Metric]:
    """The per-worker families of (label, heartbeat metrics) pairs: the head's view of every worker,
    and a worker's own health port (`engine.health`), under the same names."""
    yield from _per_worker("retouch_worker_", workers, WORKER_GAUGES, WORKER_COUNTERS)
    caches = [(name, report["cache"]) for name, report in workers if isinstance(report.get("cache"), dict)]
    yield from _per_worker("retouch_worker_cache_", caches, CACHE_GAUGES, CACHE_COUNTERS)
    loras = [(name, report["lora"]) for name, report in workers if isinstance(report.get("lora"), dict)]
    yield from _per_worker("retouch_worker_lora_", loras, LORA_GAUGES, LORA_COUNTERS)


def _per_worker(prefix: str, reports: list[tuple[str, dict]], gauges: Iterable[tuple[str, ...]],
                counters: Iterable[tuple[str, ...]]) -> Iterator[Metric]:
    for kind, fields in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for key, help_text, *renamed in fields:
            family = kind(prefix + (renamed[0] if renamed else key), help_text, labels=("worker",))
            for name, report in reports:
                value = report.get(key)
                if isinstance(value, (int, float)):
                    family.add_metric((name,), value)
            yield family
