"""`retouch bench soak`: its pure parts (outcome classes, /proc parsing, the process watch over a fake
/proc, the request mix) without a server; then one short soak of a real server whose report must
keep the invariants: every request counted once, bad requests answered 4xx, kills done, nothing
lost and nothing left behind."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from retouch.bench import soak
from retouch.bench.soak import (BAD_STATUS, MIX, OUTCOMES, Outcome, ProcessWatch, SoakOptions, classify, longest_silence,
                                parse_request_counts, socket_dirs, summarize)
from retouch.engine import process_tree
from retouch.engine.process_tree import (ProcessInfo, descendants, parse_environ, parse_rss, parse_stat,
                                         read_process)
from retouch.errors import InputError

# A /proc/PID/stat line as the kernel writes it (fields 3.. after the name); the name here holds
# spaces and a ')' of its own.
STAT_TAIL = "S 41 41 41 0 -1 4194560 1 0 0 0 3 1 0 0 20 0 5 0 {start} 1000 200 18446744073709551615"


def stat_line(pid: int, name: str, ppid: int, start: int, state: str = "S") -> str:
    tail = STAT_TAIL.format(start=start).split()
    tail[0], tail[1] = state, str(ppid)
    return f"{pid} ({name}) " + " ".join(tail) + "\n"


def fake_process(proc: Path, pid: int, ppid: int, start: int, cmdline: list[str], state: str = "S",
                 rss_kb: int = 1000, env: dict | None = None) -> None:
    folder = proc / str(pid)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(stat_line(pid, cmdline[0].rsplit("/", 1)[-1], ppid, start, state))
    (folder / "cmdline").write_bytes(b"\0".join(part.encode() for part in cmdline) + b"\0")
    rss = f"VmRSS:\t  {rss_kb} kB\n" if state != "Z" else ""  # a zombie has no memory
    (folder / "status").write_text(f"Name:\tpython\nState:\t{state}\n{rss}")
    (folder / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in (env or {}).items()))


WORKER = ["/venv/bin/python", "-m", "retouch.engine.node", "--model", "tiny-flux-fill", "--name", "w0"]


def helper(folder: str) -> list[str]:
    return ["/venv/bin/python", "-m", "retouch.engine.processing", "--tasks", f"ipc://{folder}/tasks-0",
            "--results", f"ipc://{folder}/results"]


# ---- outcomes ----

@pytest.mark.parametrize("status, body_ok, client_left, outcome", [
    (200, True, False, "ok"),
    (200, False, False, "other"),  # a 200 without the promised body is not ok
    (400, False, False, "4xx"),
    (413, False, False, "4xx"),
    (499, False, False, "4xx"),
    (503, False, False, "5xx"),
    (504, False, False, "5xx"),
    (302, False, False, "other"),
    (None, False, False, "lost"),
    (None, False, True, "cancelled"),
    (200, True, True, "ok"),  # answered before the client left: the answer counts
])
def test_classify(status, body_ok, client_left, outcome):
    assert classify(status, body_ok, client_left) == outcome


def outcome(kind, result, status=None, sent=0.0, answered=1.0, reason=None):
    return Outcome(kind, sent, answered, result, status=status, reason=reason)


def test_summary_partitions_sent_and_checks_bad_requests():
    outcomes = [outcome("template", "ok", 200), outcome("one_off", "ok", 200, answered=2.0),
                outcome("openai_n2", "5xx", 503), outcome("template", "5xx", 500), outcome("template", "other", 200),
                outcome("cancel", "cancelled", reason="ReadTimeout"), outcome("template", "lost", reason="ReadTimeout"),
                outcome("bad_missing_prompt", "4xx", 400), outcome("bad_oversized", "4xx", 413),
                outcome("bad_mask_size", "4xx", 400),  # a 4xx, not the expected 422
                outcome("bad_unknown_template", "ok", 200)]  # a bad request that was served
    summary = summarize(outcomes, wall_s=10.0)
    counted = (summary["ok"] + sum(summary["4xx"].values()) + sum(summary["5xx"].values())
               + sum(summary["other"].values()) + summary["cancelled"] + summary["lost"])
    assert summary["sent"] == len(outcomes) == counted
    assert summary["ok"] == 3 and summary["5xx"] == {"500": 1, "503": 1} and summary["other"] == {"200": 1}
    assert summary["4xx"] == {"400": 2, "413": 1} and summary["cancelled"] == 1 and summary["lost"] == 1
    assert summary["bad_sent"] == 4 and summary["bad_not_4xx"] == 1 and summary["bad_unexpected_status"] == 1
    assert summary["by_kind"]["template"] == {"200": 1, "500": 1, "lost": 1, "ok": 1}
    assert summary["lost_by_reason"] == {"ReadTimeout": 1} and summary["lost_examples"][0]["kind"] == "template"
    assert summary["ok_per_s"] == 0.3


def test_longest_silence():
    assert longest_silence([], 0.0, 5.0) == 5.0
    assert longest_silence([1.0, 1.5, 4.0], 0.0, 5.0) == 2.5
    assert longest_silence([0.0, 5.0, 9.0], 0.0, 5.0) == 5.0  # answers outside the window do not count


def test_parse_request_counts():
    text = ('# HELP retouch_requests_total HTTP requests by endpoint and status\n'
            'retouch_requests_total{endpoint="/v1/edits",status="200"} 17\n'
            'retouch_requests_total{endpoint="/v1/edits",status="499"} 2.0\n'
            'retouch_requests_total{endpoint="/v1/images/edits",status="200"} 4\n'
            'retouch_request_seconds_count{endpoint="/v1/edits",outcome="ok"} 17\n')
    assert parse_request_counts(text) == {"/v1/edits": {"200": 17, "499": 2}, "/v1/images/edits": {"200": 4}}
    # prometheus_client's exposition: the new name, other labels, a timestamp, the _created series.
    text = ('retouch_http_requests_total{endpoint="/v1/edits",method="POST",status="413"} 3.0 1700000000\n'
            'retouch_http_requests_created{endpoint="/v1/edits",method="POST",status="413"} 1.7e+09\n')
    assert parse_request_counts(text) == {"/v1/edits": {"413": 3}}


# ---- /proc ----

def test_parse_stat_counts_fields_from_the_last_parenthesis():
    assert parse_stat(stat_line(7, "py (x) y", 41, 123456)) == ("S", 41, 123456)
    assert parse_stat(stat_line(7, "a)", 1, 9, state="Z")) == ("Z", 1, 9)


def test_parse_rss_and_environ_and_socket_dirs():
    assert parse_rss("Name:\tpython\nVmPeak:\t 9 kB\nVmRSS:\t  2048 kB\n") == 2048 * 1024
    assert parse_rss("Name:\tpython\nState:\tZ (zombie)\n") == 0
    assert parse_environ(b"A=1\0RETOUCH_SERVE_ID=abc=d\0junk\0\0") == {"A": "1", "RETOUCH_SERVE_ID": "abc=d"}
    assert socket_dirs(tuple(helper("/tmp/retouch-helpers-x"))) == {"/tmp/retouch-helpers-x"}
    assert socket_dirs(tuple(WORKER)) == set()


def test_descendants_walks_the_whole_tree():
    table = {pid: ProcessInfo(pid, ppid, "S", pid, ()) for pid, ppid in
             [(10, 1), (11, 10), (12, 10), (13, 11), (14, 13), (20, 1), (21, 20)]}
    assert sorted(p.pid for p in descendants(table, 10)) == [11, 12, 13, 14]
    assert descendants(table, 14) == []


def test_read_process_sees_a_real_child():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        info = read_process(child.pid)
        assert info.ppid == os.getpid() and info.alive  # its cmdline may still be ours: fork, then exec
        assert child.pid in {p.pid for p in descendants(process_tree.scan_processes(), os.getpid())}
        assert process_tree.rss_bytes(child.pid) > 0 and process_tree.open_fds(os.getpid()) > 0
    finally:
        child.communicate(b"")
    assert read_process(child.pid) is None  # reaped: gone from /proc
    assert process_tree.open_fds(child.pid) is None and process_tree.rss_bytes(child.pid) == 0


def test_process_watch_over_a_fake_proc(tmp_path):
    """Workers and helpers under the root are found and remembered; a new helper under a worker whose
    helpers were seen is a restart; an orphan keeps being found by pid and start time, a reused pid
    is not it."""
    proc = tmp_path / "proc"
    fake_process(proc, 100, 1, 1, ["/venv/bin/python", "-m", "pytest"])
    fake_process(proc, 200, 100, 10, WORKER, rss_kb=3000)
    fake_process(proc, 300, 200, 11, helper("/tmp/retouch-helpers-a"), rss_kb=2000)
    fake_process(proc, 400, 100, 12, ["git", "status"])  # not the server's
    watch = ProcessWatch(100, proc)
    sample = watch.sample(0.0)
    assert (sample.workers, sample.helpers, sample.workers_rss, sample.orphans_rss) == (1, 1, 5000 * 1024, 0)
    assert watch.helper_restarts_seen == 0 and watch.helper_dirs == {"/tmp/retouch-helpers-a"}

    fake_process(proc, 300, 200, 11, helper("/tmp/retouch-helpers-a"), state="Z")  # killed, not yet reaped
    fake_process(proc, 301, 200, 20, helper("/tmp/retouch-helpers-a"))  # its replacement
    watch.sample(1.0)
    assert watch.helper_restarts_seen == 1

    # The worker dies; its helper is re-parented to init and lives on: an orphan.
    (proc / "200" / "stat").unlink()
    fake_process(proc, 301, 1, 20, helper("/tmp/retouch-helpers-a"), rss_kb=700)
    sample = watch.sample(2.0)
    assert (sample.workers, sample.helpers, sample.orphans_rss) == (0, 0, 700 * 1024)
    assert watch.still_alive() == [(301, 20)]
    fake_process(proc, 301, 1, 99, ["/bin/sh"])  # the pid reused by another process
    assert watch.still_alive() == []


def test_processes_with_env(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 5, 1, 1, WORKER, env={"RETOUCH_SERVE_ID": "s1"})
    fake_process(proc, 6, 1, 2, WORKER, env={"RETOUCH_SERVE_ID": "s2"})
    fake_process(proc, 7, 1, 3, WORKER, env={"RETOUCH_SERVE_ID": "s1"}, state="Z")
    assert [p.pid for p in process_tree.processes_with_env("RETOUCH_SERVE_ID", "s1", proc)] == [5]


# ---- the request mix ----

def test_mix_is_a_distribution_over_the_kinds_built():
    assert abs(sum(MIX.values()) - 1) < 1e-9 and set(BAD_STATUS) <= set(MIX) | set(soak.LORA_MIX) | set(
        soak.DEADLINE_MIX)
    assert soak.mix_of(soak.make_assets(("tpl-a",), "tpl-long", seed=0)) == MIX
    assert set(soak.mix_of(soak.make_assets(("tpl-a",), "tpl-long", seed=0, loras=("x",)))) == set(MIX) | {
        "lora", "bad_unknown_lora"}
    assert set(soak.mix_of(soak.make_assets(("tpl-a",), "tpl-long", seed=0, deadlines=True))) == set(MIX) | {
        "deadline", "bad_deadline"}


def test_every_kind_builds_the_request_it_names():
    import random

    sizes = ((64, 48), (96, 64), (32, 32))
    assets = soak.make_assets(("tpl-a", "tpl-b", "tpl-c"), "tpl-long", seed=0, loras=("soak-0", "soak-1"),
                              sizes=sizes, deadlines=True)
    rng = random.Random(0)
    size = lambda data: Image.open(io.BytesIO(data)).size  # noqa: E731
    seen = set()
    for _ in range(20):  # the sizes in turn: every kind's mask is its image's size, whichever size it drew
        requests = {kind: soak.build_request(kind, assets, rng, fresh_seed=1) for kind in soak.mix_of(assets)}
        for kind, request in requests.items():
            fields = {name: value for name, (_, value, _) in request.files}
            assert ("prompt" in request.data) == (kind != "bad_missing_prompt"), kind
            if kind in ("template", "cancel", "lora", "deadline"):
                assert size(fields["mask"]) == assets.size_of_template(request.data["template_id"])
                seen.add(size(fields["mask"]))
            if kind in ("one_off", "openai_n2"):
                assert size(fields["mask"]) == size(fields["image"]), kind
                seen.add(size(fields["image"]))
        assert requests["template"].data["template_id"] in ("tpl-a", "tpl-b", "tpl-c")
        assert requests["cancel"].data["template_id"] == "tpl-long"
        assert requests["openai_n2"].path == "/v1/images/edits" and requests["openai_n2"].data["n"] == "2"
        assert len(requests["bad_oversized"].files[0][1][1]) > soak.MAX_UPLOAD_MB * (1 << 20)
        assert size(requests["bad_mask_size"].files[0][1][1]) not in sizes
    assert seen == set(sizes)
    assert [assets.size_of_template(t) for t in ("tpl-a", "tpl-b", "tpl-c", "tpl-long")] == [*sizes, sizes[0]]
    assert requests["bad_unknown_template"].data["template_id"] not in ("tpl-a", "tpl-b", "tpl-c", "tpl-long")
    name, scale = requests["lora"].data["lora"].split(":")
    assert name in assets.loras and 0.5 <= float(scale) <= 1
    assert requests["lora"].data["template_id"] in ("tpl-a", "tpl-b", "tpl-c")
    assert requests["bad_unknown_lora"].data["lora"] not in assets.loras
    assert (requests["deadline"].data["slo_ms"], requests["bad_deadline"].data["slo_ms"]) == ("60000", "1")


def test_options_are_checked_and_derived_as_flags():
    with pytest.raises(InputError):
        SoakOptions(duration=0)
    with pytest.raises(InputError):
        SoakOptions(duration=5, kill_every=0)
    # Non-finite values ran (NaN: nothing sent, exit 0; inf: an OverflowError); an unknown model printed a
    # traceback per worker; an --out that cannot be written failed after the whole soak.
    for bad, named in ((dict(duration=float("nan")), "--duration"), (dict(duration=float("inf")), "--duration"),
                       (dict(duration=5, kill_every=float("nan")), "--kill-every"),
                       (dict(duration=5, timeout=float("nan")), "--timeout"), (dict(duration=5, model="nope"), "nope"),
                       (dict(duration=5, out=Path("/proc/no/such")), "cannot write")):
        with pytest.raises(InputError, match=named):
            SoakOptions(**bad)
    for bad, named in ((dict(templates=0), "--templates"), (dict(template_replicas=-1), "--template-replicas"),
                       (dict(cache_host_mib=0), "--cache-host-mib"),
                       (dict(cache_disk_mib=float("nan")), "--cache-disk-mib"), (dict(loras=-1), "--loras"),
                       (dict(sizes="64x48,8x8"), "--sizes"), (dict(sizes="64*48"), "--sizes")):
        with pytest.raises(InputError, match=named):
            SoakOptions(duration=5, **bad)
    with pytest.raises(SystemExit):  # --duration is required
        soak.main([])


# ---- a real server ----

SMALL_CACHES = dict(steps=8, templates=32, template_replicas=1, cache_host_mib=1, cache_disk_mib=2, loras=2,
                    sizes="64x48,96x64", deadlines=True)


@pytest.mark.parametrize("caches", ["default", "small"])
def test_a_short_soak_loses_nothing_and_leaves_nothing(caches):
    """18 s of the mixed load on 2 workers: a worker SIGKILLed at 6 s, a helper at 12 s. "small": each
    template on one worker, in caches that hold a third of them: the load evicts templates to disk and
    reads them back, the killed worker's templates are taken over, and edits use LoRAs, two image sizes
    (packed into shared steps) and deadlines (a 60 s one met, a 1 ms one refused). (Whether the
    replacement has adopted its predecessor's recordings by the end depends on how fast it starts: the
    300 s run in bench/results/cpu/soak_small_caches counts those.)"""
    options = SMALL_CACHES if caches == "small" else {}
    report, outcomes = soak.run(SoakOptions(duration=18, kill_every=6, workers=2, concurrency=4, timeout=30,
                                            **options))
    assert report["sent"] == len(outcomes) > 0
    assert report["sent"] == (report["ok"] + sum(report["4xx"].values()) + sum(report["5xx"].values())
                              + sum(report["other"].values()) + report["cancelled"] + report["lost"])
    assert set(o.outcome for o in outcomes) <= set(OUTCOMES)
    assert report["bad_sent"] > 0 and report["bad_not_4xx"] == 0 and report["bad_unexpected_status"] == 0
    assert report["kills"]["worker"] >= 1 and report["kills"]["helper"] >= 1
    assert report["restarts"]["worker_exits"] >= report["kills"]["worker"]
    assert report["ok"] > 0
    assert report["recovery_s"] is not None  # every worker back, every template recorded on it
    assert report["leftovers"]["processes"] == [] and report["leftovers"]["folders"] == []
    assert report["lost"] == 0, report["lost_examples"]
    if caches == "small":
        assert report["by_kind"]["lora"]["ok"] > 0 and set(report["by_kind"]["bad_unknown_lora"]) == {"404"}
        assert report["by_kind"]["deadline"]["ok"] > 0 and set(report["by_kind"]["bad_deadline"]) == {"429"}
        counters = report["worker_counters_end"]
        assert counters["cache_evictions"] > 0 and counters["cache_disk_hits"] > 0, counters
        assert counters["failed"] == counters["failed_recordings"] == 0, counters
        assert counters["mixed_size_steps"] > 0, counters  # the two sizes shared steps


@pytest.mark.parametrize("model", ["tiny-flux-fill", "tiny-sd3-inpaint", "tiny-sdxl-inpaint"])
def test_the_soaks_adapters_are_read_as_the_server_reads_them(model, tmp_path):
    """--loras writes files under the denoiser's own key prefix ("unet." for the UNets): under another,
    every adapter would be refused and the `lora` requests would fail. Every other one adapts the text
    encoders too (the helpers apply those parts)."""
    from retouch.lora.files import read_lora, read_text_encoder_lora, text_encoder_components
    from retouch.models import load_pipeline

    names = soak.write_loras(model, tmp_path, 2)
    pipe = load_pipeline(model).pipe
    for name in names:
        assert len(read_lora(tmp_path / f"{name}.safetensors", name, pipe).modules) > 0
    assert set(read_text_encoder_lora(tmp_path / f"{names[0]}.safetensors", names[0], pipe)) == set(
        text_encoder_components(pipe))
    assert read_text_encoder_lora(tmp_path / f"{names[1]}.safetensors", names[1], pipe) == {}
