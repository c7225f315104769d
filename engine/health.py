"""A worker's health port (`retouch worker --health-port`): what an orchestrator probes and scrapes.

    GET /healthz   200 while the process serves (liveness)
    GET /readyz    200 once the model is loaded and the router took the worker in, else 503
    GET /metrics   the worker's metrics under the names and `worker` label the head gives them
                   (`serve_metrics.worker_families`): steps, batches, its template cache, its LoRA
                   cache; its running and queued requests; whether the router took it in

The standard library's threaded HTTP server is enough for three probes; the step loop never sees it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, exposition
from prometheus_client.core import GaugeMetricFamily

from retouch.errors import InputError
from retouch.serve_metrics import worker_families, worker_label

class EngineCollector:
    """The node's metrics (`Node.metrics`) at scrape time."""

    def __init__(self, health: HealthServer):
        self.health = health

    def collect(self):
        node = self.health.node
        if node is None:  # still loading the model
            return
        running, queued = node.engine.load_report()
        report = {**node.metrics(), "running": len(running), "queued": len(queued)}
        yield from worker_families([(worker_label(node.name), report)])
        yield GaugeMetricFamily("retouch_worker_joined", "1 while the router has taken this worker in",
                                value=float(node.welcomed.is_set()))


class HealthServer:
    def __init__(self, host: str, port: int):
        """Started before the model loads (liveness holds meanwhile); `node` is set once it runs."""
        self.node = None
        health = self
        registry = CollectorRegistry()
        registry.register(EngineCollector(self))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the standard library's name
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._answer(200, "application/json", json.dumps({"status": "ok"}).encode())
                elif path == "/readyz":
                    node = health.node
                    draining = node is not None and node.draining  # SIGTERM: it takes nothing new
                    ready = node is not None and node.welcomed.is_set() and not draining
                    status = "ready" if ready else "draining" if draining else "not ready"
                    self._answer(200 if ready else 503, "application/json", json.dumps({"status": status}).encode())
                elif path == "/metrics":
                    encoder, content_type = exposition.choose_encoder(self.headers.get("Accept"))
                    self._answer(200, content_type, encoder(registry))
                else:
                    self._answer(404, "application/json", b'{"error": "not found"}')

            def _answer(self, status: int, content_type: str, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # a probe that timed out and left: not news
                    pass

            def log_message(self, *args):  # probes every few seconds are not news
                pass

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # taken, or an address this host does not have (a gaierror among them)
            raise InputError(f"cannot serve health on {host}:{port} (--health-host, --health-port): "
                             f"{exc.strerror or exc}") from None
        self.server.daemon_threads = True
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="retouch-health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
