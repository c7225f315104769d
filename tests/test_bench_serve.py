"""`retouch bench serve` against a stub of the server's HTTP API: every request is counted exactly once as
ok, an HTTP error or lost, in-flight requests never exceed --concurrency, and --rps follows its schedule."""

import ast
import importlib.util
import io
import json
import statistics
import threading
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from retouch.bench import serve
from retouch.errors import RetouchError


class StubServer(ThreadingHTTPServer):
    """The API contract in miniature. The n-th edit to arrive (from 1) is dropped without an answer when
    n % drop_every == 0, held unanswered until the test ends when n % hang_every == 0, answered 429 when
    n % reject_every == 0, else 200 with a PNG. The first `rendezvous` edits wait for each other, so a
    client that never has that many in flight gets them answered 500."""

    daemon_threads = True
    # uvicorn listens with a backlog of 2048; socketserver's 5 overflowed when 16 clients connected at once on a
    # busy machine, and a connection reset before its request was read was counted lost by the client alone
    request_queue_size = 64

    def __init__(self, drop_every=0, reject_every=0, hang_every=0, rendezvous=0, template_fails=False,
                 metrics=False):
        super().__init__(("127.0.0.1", 0), StubHandler)
        self.metrics = metrics  # serve /metrics: each edit of a template not edited before is a recording
        self.edited_templates: list[str] = []
        self.drop_every, self.reject_every, self.template_fails = drop_every, reject_every, template_fails
        self.hang_every, self.release = hang_every, threading.Event()  # hung edits wait for release
        self.rendezvous = threading.Barrier(rendezvous, timeout=10) if rendezvous else None
        self.lock = threading.Lock()
        self.templates = {"tpl-existing": {"width": 48, "height": 32, "polls": 0}}
        self.edits = 0
        self.in_flight = self.max_in_flight = 0
        self.seeds, self.authorizations, self.mask_sizes = [], set(), set()
        self.one_off_images: list[bytes] = []

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves
    disable_nagle_algorithm = True  # as uvicorn does; else each answer waits ~40 ms for a delayed ACK

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/healthz":
            return self.answer(200, {"status": "ok"})
        if self.path == "/metrics":
            if not self.server.metrics:
                return self.answer(404, {"error": {"message": "no route", "type": "not_found", "param": None}})
            with self.server.lock:
                edits, recordings = len(self.server.edited_templates), len(set(self.server.edited_templates))
            text = "".join(f'retouch_worker_cache_{name}_total{{worker="w{i}"}} {value / 2}\n' for i in (0, 1)
                           for name, value in (("registrations", recordings), ("hits", edits), ("disk_hits", 0)))
            return self.answer(200, text + f'retouch_router_events_total{{event="template_affinity"}} {edits}\n')
        template_id = self.path.removeprefix("/v1/templates/").split("?")[0]
        with self.server.lock:
            template = self.server.templates.get(template_id)
            if template is None:
                return self.answer(404, {"error": {"message": f"no template {template_id}", "type": "not_found",
                                                   "param": "id"}})
            template["polls"] += 1
        return self.answer(200, self.template_json(template_id, template))

    def do_POST(self):
        fields = self.read_form()
        if self.path == "/v1/templates":
            image = Image.open(io.BytesIO(fields["image"]))
            with self.server.lock:
                template_id = f"tpl-{len(self.server.templates)}"
                template = self.server.templates[template_id] = {"width": image.width, "height": image.height,
                                                                 "steps": int(fields["steps"]), "polls": 0}
            return self.answer(202, self.template_json(template_id, template))
        if self.path == "/v1/edits":
            return self.edit(fields)
        return self.answer(404, {"error": {"message": "no route", "type": "not_found", "param": None}})

    def edit(self, fields):
        with self.server.lock:
            self.server.edits += 1
            arrival = self.server.edits
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
            self.server.seeds.append(int(fields["seed"]))
            self.server.authorizations.add(self.headers.get("Authorization"))
        try:
            barrier = self.server.rendezvous
            if barrier is not None and arrival <= barrier.parties:
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    return self.answer(500, {"error": {"message": "too few edits in flight", "type": "stub",
                                                       "param": None}})
            if "image" in fields:  # a one-off image instead of a template
                image = Image.open(io.BytesIO(fields["image"]))
                template = {"width": image.width, "height": image.height}
                with self.server.lock:
                    self.server.one_off_images.append(fields["image"])
            else:
                template = self.server.templates[fields["template_id"].decode()]
                with self.server.lock:
                    self.server.edited_templates.append(fields["template_id"].decode())
            mask = Image.open(io.BytesIO(fields["mask"]))
            self.server.mask_sizes.add(mask.size)
            assert mask.mode == "L" and mask.size == (template["width"], template["height"])
            assert fields["prompt"] and fields["response_format"] == b"png"
            if self.server.drop_every and arrival % self.server.drop_every == 0:
                self.close_connection = True  # no status line, no body: the client sees the socket close
                return None
            if self.server.hang_every and arrival % self.server.hang_every == 0:
                self.server.release.wait(timeout=30)
                self.close_connection = True
                return None
            if self.server.reject_every and arrival % self.server.reject_every == 0:
                return self.answer(429, {"error": {"message": "queue full", "type": "rate_limit", "param": None}},
                                   {"Retry-After": "1"})
            body = io.BytesIO()
            Image.new("RGB", mask.size, (200, 10, 10)).save(body, format="PNG")
            return self.answer(200, body.getvalue())
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def template_json(self, template_id, template):
        status = "ready" if template["polls"] >= 1 else "recording"
        if self.server.template_fails and template_id != "tpl-existing":
            status = "failed" if template["polls"] >= 1 else "recording"
        return {"id": template_id, "status": status, "progress": {"polls": template["polls"]},
                "width": template["width"], "height": template["height"], "steps": template.get("steps", 4)}

    def read_form(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not body:
            return {}
        message = BytesParser(policy=HTTP).parsebytes(
            f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + body)
        return {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                for part in message.iter_parts()}

    def answer(self, status, payload, headers=None):
        body, kind = ((payload, "image/png") if isinstance(payload, bytes)
                      else (payload.encode(), "text/plain") if isinstance(payload, str)
                      else (json.dumps(payload).encode(), "application/json"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def stub(request):
    server = StubServer(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("stub", [{"drop_every": 7, "reject_every": 5, "rendezvous": 16}], indirect=True)
def test_counts_every_request_once_at_concurrency_16(stub, tmp_path, capsys):
    out = tmp_path / "serve.json"
    report = serve.main(["--url", stub.url, "--requests", "60", "--concurrency", "16", "--api-key", "k3y",
                         "--timeout", "30", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "serve.png").stat().st_size > 0

    # Of arrivals 1..60: drops at multiples of 7 (8), 429s at the other multiples of 5 (12 - {35}).
    assert report["sent"] == stub.edits == 60
    assert report["lost"] == 8 and report["errors"] == {"429": 11} and report["ok"] == 41
    assert report["ok"] + sum(report["errors"].values()) + report["lost"] == report["sent"]
    assert set(report["lost_reasons"]) <= {"RemoteProtocolError", "ReadError", "WriteError"}
    assert report["error_messages"]["429"] == "queue full (Retry-After: 1)"
    assert len(report["latencies_s"]) == 41
    assert 0 < report["p50_s"] <= report["p95_s"] <= report["max_s"]
    assert stub.max_in_flight == 16  # the rendezvous of the first 16 proves all 16 slots were used at once
    assert sorted(stub.seeds) == list(range(60))
    assert stub.authorizations == {"Bearer k3y"}
    assert report["template"]["status"] == "ready" and report["template"]["width"] == 64


def test_rps_follows_its_schedule_under_the_concurrency_cap(stub):
    report = serve.main(["--url", stub.url, "--requests", "30", "--concurrency", "2", "--rps", "400",
                         "--seed", "3", "--template-id", "tpl-existing", "--mask-dist", "production"])
    assert report["sent"] == report["ok"] == 30 and report["errors"] == {} and report["lost"] == 0
    assert stub.max_in_flight <= 2
    # Nothing leaves before its arrival, so the run lasts at least until the last scheduled arrival.
    assert report["wall_s"] >= serve.arrival_offsets(30, 400, 3)[-1]
    assert report["mean_client_wait_s"] >= 0
    assert report["p50_from_arrival_s"] >= report["p50_s"]
    assert stub.mask_sizes == {(48, 32)}  # masks take the existing template's size, not --size
    assert report["settings"]["rps"] == 400 and report["settings"]["mask_dist"] == "production"


@pytest.mark.parametrize("stub", [{"hang_every": 2}], indirect=True)
def test_a_request_past_its_timeout_is_lost_and_the_run_ends(stub):
    report = serve.main(["--url", stub.url, "--requests", "6", "--concurrency", "6", "--timeout", "0.3"])
    assert report["sent"] == 6 and report["ok"] == 3 and report["lost"] == 3 and report["errors"] == {}
    assert set(report["lost_reasons"]) <= {"TimeoutError", "ReadTimeout"}


@pytest.mark.parametrize("stub", [{"template_fails": True}], indirect=True)
def test_a_failed_template_stops_the_run_with_its_reason(stub):
    with pytest.raises(RetouchError, match="template tpl-1 failed"):
        serve.main(["--url", stub.url, "--requests", "3"])
    assert stub.edits == 0


def test_no_server_is_said_plainly():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # the port is now closed: connections are refused
    with pytest.raises(RetouchError, match="no retouch server answers"):  # one line, exit 2 from the CLI
        serve.main(["--url", url, "--requests", "3"])


def test_arrivals_are_seeded_poisson():
    offsets = serve.arrival_offsets(20_000, 50.0, seed=1)
    assert offsets == serve.arrival_offsets(20_000, 50.0, seed=1) != serve.arrival_offsets(20_000, 50.0, seed=2)
    gaps = [b - a for a, b in zip([0.0] + offsets[:-1], offsets, strict=True)]
    assert all(gap > 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: sd == mean
    assert serve.arrival_offsets(4, None, seed=1) == [0.0] * 4


@pytest.mark.parametrize("dist,mean", [("public", 0.19), ("production", 0.11)])
@pytest.mark.parametrize("width,height", [(64, 64), (48, 32), (1, 1), (17, 5)])
def test_mask_boxes_follow_the_beta_and_stay_inside(dist, mean, width, height):
    boxes = serve.mask_boxes(3000, width, height, serve.MASK_BETA[dist], seed=0)
    for left, top, right, bottom in boxes:
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
    if width * height >= 1024:  # pixel rounding blurs the distribution on tiny images
        ratios = [serve.mask_ratio(box, width, height) for box in boxes]
        assert statistics.fmean(ratios) == pytest.approx(mean, abs=0.015)


def test_mask_png_is_white_exactly_on_its_box():
    import numpy as np

    mask = Image.open(io.BytesIO(serve.mask_png((3, 2, 7, 5), 10, 6)))
    assert mask.mode == "L" and mask.size == (10, 6)
    expected = np.zeros((6, 10), np.uint8)
    expected[2:5, 3:7] = 255
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_public_masks_match_the_batching_benchmark():
    # Read from the source: importing bench.batching loads the engine and diffusers (seconds).
    source = Path(importlib.util.find_spec("retouch.bench.batching").origin).read_text()
    assignment = next(node for node in ast.parse(source).body
                      if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MASK_BETA")
    assert serve.MASK_BETA["public"] == ast.literal_eval(assignment.value)


def test_template_image_is_deterministic():
    first, again = serve.template_png(64, seed=0), serve.template_png(64, seed=0)
    assert first == again != serve.template_png(64, seed=1)
    import numpy as np

    image = Image.open(io.BytesIO(first))
    assert image.mode == "RGB" and image.size == (64, 64)
    colours = np.unique(np.asarray(image).reshape(-1, 3), axis=0)
    assert len(colours) > 1000  # a gradient, not a flat fill


def test_one_off_mix_registrations_and_the_stock_pipeline(stub):
    report = serve.main(["--url", stub.url, "--requests", "8", "--concurrency", "1", "--one-off", "0.5",
                         "--registrations", "2", "--stock-model", "tiny-flux-fill", "--stock-samples", "2",
                         "--size", "32", "--steps", "2"])
    classes = report["classes"]
    assert classes["template"]["sent"] + classes["one_off"]["sent"] == 8 and classes["one_off"]["sent"] > 0
    # Both runs send new images: every one-off edit is a first edit.
    assert len(stub.one_off_images) == len(set(stub.one_off_images)) == 2 * classes["one_off"]["sent"]
    registrations = report["registrations"]
    assert registrations["registered"] == 2 and registrations["sent_with"] == registrations["ok_with"] == 8
    assert registrations["ratio"] == registrations["template_p95_with_s"] / registrations["template_p95_without_s"]
    for kind in ("template", "one_off"):
        stock = report["stock"][kind]
        assert stock["requests"] == 2 and stock["ratio_p50"] == stock["served_p50_s"] / stock["stock_p50_s"]


@pytest.mark.parametrize("stub", [{"metrics": True}], indirect=True)
def test_edits_spread_over_several_templates_and_the_server_says_what_they_cost(stub, tmp_path):
    report = serve.main(["--url", stub.url, "--requests", "30", "--concurrency", "4", "--templates", "3",
                         "--size", "32", "--steps", "2", "--out", str(tmp_path / "serve.json")])
    assert (tmp_path / "serve.png").stat().st_size > 0  # its title says what the server counted
    assert report["ok"] == 30 and len(report["template_ids"]) == 3 == len(set(report["template_ids"]))
    assert set(stub.edited_templates) == set(report["template_ids"])  # every one edited, seeded draws
    # The stub's counters: one recording per template first edited, a host hit and an affinity per edit.
    assert report["server"] == {"recordings": 3, "host_hits": 30, "disk_hits": 0, "template_affinity": 30}
    assert report["settings"]["templates"] == 3


def test_a_server_without_metrics_leaves_them_out_and_templates_need_their_own_images(stub):
    assert serve.main(["--url", stub.url, "--requests", "2", "--concurrency", "1"])["server"] is None
    for flags in (["--templates", "0"], ["--templates", "2", "--template-id", "tpl-existing"]):
        with pytest.raises(SystemExit):
            serve.main(["--url", stub.url, *flags])


def test_the_stock_pipeline_needs_concurrency_1(stub):
    with pytest.raises(SystemExit):
        serve.main(["--url", stub.url, "--stock-model", "tiny-flux-fill", "--concurrency", "2"])
