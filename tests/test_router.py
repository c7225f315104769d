"""The router against scripted workers (DEALER sockets driven by the test): template replication,
parking until a recording is ready, routing only to workers that hold the template, re-routing
when a worker dies or falls silent, exactly one answer per request, back-pressure, and an edit's LoRA
carried along (as JSON) wherever it goes."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
from polling import free_port
from scripted_worker import TIMEOUT_S, ScriptedWorker

from retouch.engine import wire
from retouch.engine.policies import RequestLoad
from retouch.engine.router import (RETRY_AFTER_MAX_S, RETRY_AFTER_UNKNOWN_S, EditTask, NoWorkerConnected, QueueFull,
                                   RouterConfig, TemplateLimit, TemplateRecord, TemplateStorageFull)
from retouch.lora import LoraUse, parse_lora

LOAD = RequestLoad(image_tokens=16, masked_tokens=4, steps=2)


def template(template_id: str = "t1", replicas: int = 0) -> TemplateRecord:
    return TemplateRecord(template_id, b"png-of-template", (64, 64), "", 2, 0, None, replicas)


def task(template_id: str = "t1", lora=()) -> EditTask:
    return EditTask(template_id, bytes(64 * 64), (64, 64), "a cat", 0, LOAD, lora=lora)


def test_templates_go_to_every_worker_and_edits_wait_for_a_ready_one(context, make_router):
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template())
    future = router.submit(task())  # parked: no recording is ready yet
    assert router.snapshot()["parked"] == 1
    w1.register("t1")
    edit = w1.receive("edit")  # the only worker holding it
    assert edit["template"] == "t1" and edit["prompt"] == "a cat"
    assert len(edit["blobs"]["mask"]) == 64 * 64
    w1.answer(edit["request"], b"edited")
    assert future.result(TIMEOUT_S).png == b"edited"
    assert future.result().worker == "w1"
    w0.register("t1")
    assert router.template("t1")["progress"]["workers_ready"] == 2


def recorded_on_one(router, workers: list[ScriptedWorker], name: str = "t1") -> ScriptedWorker:
    """Register template `name` on a router of `--template-replicas 1`: the one worker sent it records it;
    that worker."""
    router.register_template(template(name))
    for worker in workers:
        worker.sync()
    (holder,) = [w for w in workers if "register" in w.pending_kinds()]
    holder.register(name)
    return holder


def test_template_replicas_record_a_template_on_that_many_workers_and_replace_a_lost_one(context, make_router):
    """`--template-replicas 1`: a registration is one generation on one worker, not one on each; its edits
    go there; when that worker goes, another records it."""
    router = make_router(template_replicas=1)
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    holder = recorded_on_one(router, [w0, w1])
    other = w1 if holder is w0 else w0
    assert router.template("t1")["progress"]["workers_ready"] == 1 and "register" not in other.pending_kinds()
    assert _edit_goes_to(task(), router, [w0, w1]) == holder.name
    router.worker_exited(holder.name)  # its process ended: what it held is recorded elsewhere
    other.register("t1")
    assert router.template("t1")["progress"]["workers_ready"] == 1
    with pytest.raises(ValueError, match="template_replicas"):
        RouterConfig(template_replicas=-1)


@pytest.mark.parametrize("grow", [1, None])
def test_a_template_whose_replicas_are_busy_gets_another(context, make_router, grow):
    """`--template-replicas 1`: the template's edits pile onto its one worker while the others idle (the
    simulator: p95 160 s at 4 replicas of 64 workers, against 10 s recorded everywhere). Once its replicas
    all carry more than `--template-replicas-grow` (1) requests beyond the least loaded other worker, that one
    records it too, and later edits go there; one at a time (a replica being recorded weighs as a request)."""
    router = make_router(template_replicas=1, template_replicas_grow=grow)
    workers = [ScriptedWorker(context, router, name) for name in ("w0", "w1", "w2")]
    holder = recorded_on_one(router, workers)
    edits = [router.submit(task()) for _ in range(4)]
    for worker in workers:
        worker.sync()
    registering = [w for w in workers if "register" in w.pending_kinds()]
    assert len([m for m in holder.inbox if m["kind"] == "edit"]) == 4  # ready only there: all four go there
    if grow is None:
        assert registering == [] and router.snapshot()["counters"]["replicas_added"] == 0
        return
    assert len(registering) == 1 and router.snapshot()["counters"]["replicas_added"] == 1  # at the third edit
    (added,) = registering
    added.register("t1")
    assert router.template("t1")["progress"]["workers_ready"] == 2
    fifth = router.submit(task())
    added.answer(added.receive("edit")["request"])  # the holder still has four in flight
    for message in [m for m in holder.inbox if m["kind"] == "edit"]:
        holder.answer(message["request"])
    assert all(edit.result(TIMEOUT_S).status == 200 for edit in [*edits, fifth])
    assert fifth.result().worker == added.name
    with pytest.raises(ValueError, match="template_replicas_grow"):
        RouterConfig(template_replicas_grow=-1)


def grown(context, router) -> tuple[list[ScriptedWorker], ScriptedWorker, ScriptedWorker, list]:
    """Two workers, t1 on one (`--template-replicas 1`), and three edits of it there: the third asks the other
    to record it too. (workers, the holder, the added replica, the edits' futures)."""
    workers = [ScriptedWorker(context, router, name) for name in ("w0", "w1")]
    holder = recorded_on_one(router, workers)
    edits = [router.submit(task()) for _ in range(3)]
    (added,) = [w for w in workers if w is not holder]
    added.sync()
    assert [m["template"] for m in added.inbox if m["kind"] == "register"] == ["t1"]  # answered by the caller
    assert router.snapshot()["counters"]["replicas_added"] == 1
    return workers, holder, added, edits


def test_a_template_edited_once_on_a_busy_worker_gets_no_replica(context, make_router):
    """Growth follows the template's own edits: its worker busy with another template's is no reason (each
    such edit gave the template a replica for good, and --template-replicas K became every worker)."""
    router = make_router(template_replicas=1)
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    for name in ("hot", "cold"):
        recorded_on_one(router, [w0, w1], name)
    holders = {name: [w for w, state in router.templates[name].states.items() if state == "ready"]
               for name in ("hot", "cold")}
    assert holders["hot"] == holders["cold"]  # both on one worker: it was the least busy both times
    for name in ("hot", "hot", "cold"):
        router.submit(task(name))
    for worker in (w0, w1):
        worker.sync()
    assert router.snapshot()["counters"]["replicas_added"] == 0
    assert "register" not in w0.pending_kinds() + w1.pending_kinds()


def test_an_added_replica_that_fails_to_record_is_not_the_templates_failure(context, make_router):
    router = make_router(template_replicas=1)
    _, holder, added, _ = grown(context, router)
    added.register("t1", ok=False)  # out of memory there
    assert router.template("t1")["status"] == "ready" and router.template("t1")["error"] is None
    router.worker_exited(holder.name)  # the template's one replica goes: the other is asked again
    assert added.receive("register")["template"] == "t1"


def test_an_added_replica_no_edit_went_to_for_a_while_is_dropped(context, make_router, monkeypatch):
    import retouch.engine.router as router_module

    router = make_router(template_replicas=1)
    _, holder, added, edits = grown(context, router)
    added.register("t1")
    for _ in edits:
        holder.answer(holder.receive("edit")["request"])
    assert all(edit.result(TIMEOUT_S).status == 200 for edit in edits)
    monkeypatch.setattr(router_module, "REPLICA_IDLE_S", 0.0)
    assert added.receive("drop")["template"] == "t1"
    assert router.snapshot()["counters"]["replicas_removed"] == 1
    assert router.template("t1")["progress"]["workers_ready"] == 1 and holder.name in router.templates["t1"].states


def test_a_worker_that_joins_records_the_most_recently_edited_templates_first(context, make_router):
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    for template_id in ("t1", "t2", "t3"):
        router.register_template(template(template_id))
        w0.register(template_id)
    for template_id in ("t3", "t1"):  # t1 edited last; t2 never edited since it was registered
        router.submit(task(template_id))
        w0.answer(w0.receive("edit")["request"])
    late = ScriptedWorker(context, router, "late")
    assert [late.receive("register")["template"] for _ in range(3)] == ["t1", "t3", "t2"]


def test_a_worker_that_joins_later_records_the_templates(context, make_router):
    router = make_router()
    router.register_template(template())
    assert router.template("t1")["status"] == "recording"
    late = ScriptedWorker(context, router, "late")
    late.register("t1")
    assert router.submit(task()) is not None
    late.answer(late.receive("edit")["request"])


def an_edit_moved_off_a_silent_worker(context, router) -> tuple:
    """w0 takes an edit and falls silent; w1 joins and heartbeats until the edit comes to it (w0 presumed
    dead). (w0, w1, the edit's future, the edit as w0 got it, as w1 got it)."""
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task())
    first = w0.receive("edit")
    w1 = ScriptedWorker(context, router, "w1")
    w1.register("t1")
    return w0, w1, future, first, w1.receive("edit", keepalive=[w1])


def back_after_a_pause(worker: ScriptedWorker) -> None:
    """The worker, removed while paused, says hello again and records the template again."""
    worker.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1})
    worker.receive("welcome")
    worker.register("t1")


def test_silent_worker_is_removed_its_request_rerouted_and_its_late_answer_dropped(context, make_router):
    router = make_router(dead_after_s=0.5)
    lost = []
    router.on_worker_lost = lost.append  # `retouch serve`: its supervisor kills the process
    w0, w1, future, first, second = an_edit_moved_off_a_silent_worker(context, router)
    assert second["request"] == first["request"]
    assert "w0" not in router.snapshot()["workers"] and lost == ["w0"]
    w1.answer(second["request"], b"from w1")
    assert future.result(TIMEOUT_S).png == b"from w1"
    w0.answer(first["request"], b"from w0, too late")  # a zombie's answer does not count
    # Its hello comes after the answer on the same socket: once welcomed, the answer was seen.
    w0.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1})
    w0.receive("welcome")
    assert router.snapshot()["counters"]["duplicates_dropped"] == 1
    assert future.result().png == b"from w1"


def test_a_worker_back_after_a_pause_is_told_to_drop_the_edits_that_went_elsewhere(context, make_router):
    """Paused (SIGSTOP, a long GC, a network cut) past dead_after_s, the worker comes back still holding the
    edits the router sent elsewhere meanwhile: its heartbeats list them, and it is told to cancel each once,
    not the ones it was sent since."""
    router = make_router(dead_after_s=0.5)
    w0, w1, future, first, _ = an_edit_moved_off_a_silent_worker(context, router)
    back_after_a_pause(w0)
    w1.heartbeat({}, running=[[first["request"], 1]])  # busy: the next edit goes to w0
    mine = router.submit(task())
    own = w0.receive("edit")
    for _ in range(2):
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [first["request"], own["request"]]})
        w0.sync()
    cancels = [m["request"] for m in w0.inbox if m["kind"] == "cancel"]
    assert cancels == [first["request"]] and router.snapshot()["counters"]["stale_edits_dropped"] == 1
    w1.answer(first["request"])
    w0.answer(own["request"])
    assert future.result(TIMEOUT_S).worker == "w1" and mine.result(TIMEOUT_S).worker == "w0"


def test_a_stale_cancel_that_meets_its_edit_sent_back_does_not_answer_it(context, make_router):
    """The edit told dropped on the worker back from a pause comes back to it (the other worker died) before
    the cancel is done: that copy's "cancelled" is no answer, the edit runs again. An edit answered meanwhile,
    listed by a heartbeat built before its answer, is not told dropped."""
    router = make_router(dead_after_s=0.5)
    w0, w1, future, first, _ = an_edit_moved_off_a_silent_worker(context, router)
    back_after_a_pause(w0)
    w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [first["request"]]})
    assert w0.receive("cancel")["request"] == first["request"]
    router.worker_exited("w1")
    assert w0.receive("edit")["request"] == first["request"]  # back to w0, whose old copy is being cancelled
    w0.fail(first["request"], 409, "Cancelled", "the edit was cancelled")
    again = w0.receive("edit")  # sent again, not answered 409
    w0.answer(again["request"], b"from w0")
    assert future.result(TIMEOUT_S).status == 200 and future.result().png == b"from w0"
    w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [first["request"]]})  # built before
    w0.sync()
    assert "cancel" not in w0.pending_kinds() and router.snapshot()["counters"]["stale_edits_dropped"] == 1


def test_an_edit_sent_again_to_the_same_worker_is_heard_of_from_that_copy_only(context, make_router):
    """The only worker, presumed dead while paused, is sent its parked edit again when it is back, while
    the copy it was sent first may still run there: the steps and the answer of that copy (attempt 1) went
    into the edit's stream beside the new one's (steps 51, 1, 52, 2, ...), and its answer could end it."""
    router = make_router(dead_after_s=0.5)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task())
    first = w0.receive("edit")
    events = []
    router.watch("request", first["request"], events.append)
    assert router.wait_until(lambda r: "w0" not in r.workers, TIMEOUT_S)  # silent: presumed dead, edit parked
    back_after_a_pause(w0)
    again = w0.receive("edit")
    assert (first["request"], first["attempt"]) == (again["request"], 1) and again["attempt"] == 2
    w0.step(first["request"], 51, 100, attempt=1)
    w0.step(first["request"], 1, 100, attempt=2)
    w0.answer(first["request"], b"from the first copy", attempt=1)
    w0.sync()
    assert not future.done() and router.snapshot()["counters"]["duplicates_dropped"] == 1
    w0.answer(first["request"], b"from the second copy", attempt=2)
    assert future.result(TIMEOUT_S).png == b"from the second copy"
    steps = [event["step"] for event in events if event["event"] == "step"]
    assert steps == [1] and [event.get("attempt") for event in events if event["event"] == "queued"][-1] == 2


def test_a_worker_back_after_missing_a_templates_deletion_is_told_to_drop_it(context, make_router):
    """Deleted while its worker was presumed dead, a template stayed in that worker's cache for good once it
    came back (a deleted tenant's activations resident). A template registered again meanwhile is kept."""
    router = make_router(dead_after_s=0.5)
    w0 = ScriptedWorker(context, router, "w0")
    for template_id in ("t1", "t2"):
        router.register_template(template(template_id))
        w0.register(template_id)
    assert router.wait_until(lambda r: "w0" not in r.workers, TIMEOUT_S)  # silent: presumed dead
    assert router.drop_template("t1") and router.drop_template("t2")
    router.register_template(template("t2"))  # back before the worker is
    w0.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1, "templates": ["t1", "t2"]})
    w0.receive("welcome")
    w0.sync()
    assert [m["template"] for m in w0.inbox if m["kind"] == "drop"] == ["t1"]
    assert router.template("t2")["progress"]["workers_ready"] == 1  # t2: ready there, as it said


def test_exited_worker_is_rerouted_at_once(context, make_router):
    router = make_router()  # dead_after_s=60: only the supervisor's notice can remove it in time
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template())
    w0.register("t1")
    w1.register("t1")
    futures = [router.submit(task()) for _ in range(4)]  # least-requests: two each
    on_w0 = [w0.receive("edit")["request"] for _ in range(2)]
    on_w1 = [w1.receive("edit")["request"] for _ in range(2)]
    router.worker_exited("w0")
    moved = sorted(w1.receive("edit")["request"] for _ in range(2))
    assert moved == sorted(on_w0)
    for request in on_w1 + moved:
        w1.answer(request)
    assert all(f.result(TIMEOUT_S).status == 200 for f in futures)
    assert router.snapshot()["counters"]["rerouted"] == 2


def router_lines(caplog, level: str = "INFO") -> list[str]:
    """What the router logged of its workers at `level` (caplog set to INFO for retouch.router)."""
    return [r.getMessage() for r in caplog.records if r.name == "retouch.router" and r.levelname == level]


def test_with_no_worker_left_waiting_edits_get_503_and_new_ones_are_refused(context, make_router, caplog):
    """A cluster whose last worker died answers its parked edits 503 after `no_worker_s`, and refuses new
    ones at once (they waited the whole request timeout for a 504); a worker that joins ends it."""
    caplog.set_level("INFO", logger="retouch.router")
    router = make_router(no_worker_s=0.3)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task())
    w0.receive("edit")
    router.worker_exited("w0")  # its edit is parked: no worker holds the template now
    answer = future.result(TIMEOUT_S)
    assert (answer.status, answer.error) == (503, "no_worker") and "no worker" in answer.message
    assert router_lines(caplog) == ["worker w0 joined (pid 1); 1 connected",
                                    "worker w0 left: its process exited; 0 connected"]
    assert router.template("t1")["status"] == "recording"  # by the next worker that joins
    assert router.template("t1")["progress"]["workers_connected"] == 0  # which a client can see
    with pytest.raises(NoWorkerConnected, match="no worker has been connected"):
        router.submit(task())
    w1 = ScriptedWorker(context, router, "w1")
    assert router.template("t1")["progress"]["workers_connected"] == 1
    w1.register("t1")
    accepted = router.submit(task())
    w1.answer(w1.receive("edit")["request"])
    assert accepted.result(TIMEOUT_S).status == 200
    with pytest.raises(ValueError, match="no_worker_s"):
        RouterConfig(no_worker_s=0)


def test_replicas_one_records_on_one_worker_and_again_when_it_dies(context, make_router):
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template("solo", replicas=1))
    w0.sync()
    w1.sync()  # the router answered both pings, so any register was sent before
    holder, other = (w0, w1) if "register" in w0.pending_kinds() else (w1, w0)
    holder.register("solo")
    assert "register" not in other.pending_kinds()  # only one recording
    router.worker_exited(holder.name)
    other.register("solo")
    future = router.submit(task("solo"))
    other.answer(other.receive("edit")["request"])
    assert future.result(TIMEOUT_S).status == 200


def test_the_templates_a_worker_is_sent_at_its_hello_come_in_bulk_and_weigh_as_one(context, make_router):
    """A joining worker records those it is sent at its hello one at a time, only while its caches have room
    (`Node`): they weigh as the one it records (all of them weighed, a worker joining a server of 1,000
    templates was avoided by every policy until it had reported each). A template registered later is asked
    for by name, and recorded there whatever it pushes out."""
    router = make_router()
    for name in ("b1", "b2", "b3"):
        router.register_template(template(name))
    w0 = ScriptedWorker(context, router, "w0")

    def load() -> int:
        w0.sync()
        return router.snapshot()["workers"]["w0"]["queued"]

    sent = [w0.receive("register") for _ in range(3)]
    assert [(m["template"], m.get("bulk")) for m in sent] == [("b3", True), ("b2", True), ("b1", True)]
    w0.inbox[:0] = sent
    assert load() == 1
    w0.register("b3")
    assert load() == 1  # the next one weighs now
    w0.register("b2")
    w0.register("b1")
    assert load() == 0
    router.register_template(template("after"))
    later = w0.receive("register")
    assert later["template"] == "after" and "bulk" not in later and load() == 1


@pytest.mark.parametrize("leaves", ["exits", "drains"])
def test_the_templates_of_a_worker_that_leaves_go_elsewhere_in_bulk(context, make_router, leaves):
    """Taking over a worker's templates is many registrations at once, as a join is: its caches may hold
    none of them beside its own (recorded outright, they pushed out its own templates, one by one)."""
    router = make_router(template_replicas=1)
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    for name in ("t1", "t2", "t3"):
        router.register_template(template(name))
    for worker in (w0, w1):
        worker.sync()
    for worker in (w0, w1):
        for message in [m for m in worker.inbox if m["kind"] == "register"]:
            assert "bulk" not in message  # a registration is asked for by name
            worker.register(message["template"])
    leaving = max((w0, w1), key=lambda w: sum(w.name in router.templates[t].states for t in ("t1", "t2", "t3")))
    taking_over = w1 if leaving is w0 else w0
    held = sorted(t for t in ("t1", "t2", "t3") if leaving.name in router.templates[t].states)
    if leaves == "exits":
        router.worker_exited(leaving.name)
    else:
        leaving.send({"kind": "draining"})
        leaving.sync()
    sent = [taking_over.receive("register") for _ in held]
    assert sorted(m["template"] for m in sent) == held and all(m["bulk"] for m in sent)


def test_an_edit_of_a_template_queued_in_bulk_asks_for_it_by_name(context, make_router):
    """An edit that waits for a template a worker has queued among its bulk registrations (it joined, or took
    over: the templates before it there are recorded first, while other workers idle) has it sent again by
    name, recorded now."""
    router = make_router()
    for name in ("t1", "t2", "t3"):
        router.register_template(template(name))
    w0 = ScriptedWorker(context, router, "w0")
    w0.sync()
    assert [(m["template"], m.get("bulk")) for m in w0.inbox if m["kind"] == "register"] == [
        ("t3", True), ("t2", True), ("t1", True)]
    router.submit(task("t1"))
    w0.sync()
    again = [m for m in w0.inbox if m["kind"] == "register"][3:]
    assert [(m["template"], m.get("bulk")) for m in again] == [("t1", None)]
    assert router.snapshot()["workers"]["w0"]["queued"] == 2  # t3 (its bulk turn) and t1; the edit is parked
    router.submit(task("t3"))  # first in its turn: recorded now already
    w0.sync()
    assert len([m for m in w0.inbox if m["kind"] == "register"]) == 4


def test_a_worker_recording_a_template_weighs_as_busy_until_it_reports_or_is_lost(context, make_router):
    """A recording computes every token for all its steps: the policies see it in its worker's load (so an
    edit goes to an idle worker instead), from when it is sent until the worker reports it, fails it, or
    it is lost and sent again."""
    # Long enough that a stalled test process (CI runs four on two cores) does not lose a worker between its
    # messages: the router then ignored its ping, and the test waited for a pong that never came.
    router = make_router(dead_after_s=1.0)
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template("both"))
    w0.register("both")
    w1.register("both")
    router.register_template(template("solo", replicas=1))
    for worker in (w0, w1):
        worker.sync()
    holder, other = (w0, w1) if "register" in w0.pending_kinds() else (w1, w0)
    load = router.snapshot()["workers"]
    assert (load[holder.name]["queued"], load[other.name]["queued"]) == (1, 0)
    assert _edit_goes_to(task("both"), router, [w0, w1]) == other.name
    holder.send({"kind": "progress", "template": "solo", "step": 1, "steps": 2})
    holder.sync()
    assert router.snapshot()["workers"][holder.name]["running"] == 1  # its first step ran
    holder.register("solo")  # reported: no longer its load
    assert router.snapshot()["workers"][holder.name]["running"] == 0
    assert _edit_goes_to(task("both"), router, [w0, w1]) == holder.name  # the other has an edit in flight

    router.register_template(template("lost", replicas=1))
    for worker in (w0, w1):
        worker.sync()
    receiver = next(w for w in (w0, w1) if "register" in w.pending_kinds())
    receiver.receive("register")  # as if it never arrived: sent again once overdue, and weighed once
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_recordings"] == 0 and time.monotonic() < deadline:
        for worker in (w0, w1):
            worker.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "recording": []})
        for worker in (w0, w1):
            worker.sync()
    assert sum(w["queued"] + w["running"] for w in router.snapshot()["workers"].values()) == 3  # 2 edits + 1
    for worker in (w0, w1):
        worker.sync()
    next(w for w in (w0, w1) if "register" in w.pending_kinds()).register("lost")
    assert sum(w["queued"] + w["running"] for w in router.snapshot()["workers"].values()) == 2
    router.register_template(template("dropped", replicas=1))
    assert sum(w["queued"] + w["running"] for w in router.snapshot()["workers"].values()) == 3
    router.drop_template("dropped")  # its recording stops where it ran: no longer anyone's load
    assert sum(w["queued"] + w["running"] for w in router.snapshot()["workers"].values()) == 2


def test_a_joining_workers_bulk_registrations_hold_one_place_in_the_queue(context, make_router):
    """A worker joining a server of many templates is sent them all, and records one at a time: counted
    each, they refused every registration (429) until it had reported them all."""
    router = make_router(max_queue=2)
    for name in ("t1", "t2", "t3"):
        router.register_template(template(name))
    w0 = ScriptedWorker(context, router, "w0")
    w0.sync()
    assert [m["template"] for m in w0.inbox if m["kind"] == "register"] == ["t3", "t2", "t1"]
    router.register_template(template("t4"))  # one place for the bulk, one for this
    with pytest.raises(QueueFull):
        router.register_template(template("t5"))


def test_back_pressure_deletion_and_failed_recordings(context, make_router):
    router = make_router(max_queue=2)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template("t1"))
    router.register_template(template("t2"))
    parked = [router.submit(task("t1")), router.submit(task("t2"))]
    with pytest.raises(QueueFull):
        router.submit(task("t1"))
    assert router.drop_template("t1")
    assert parked[0].result(TIMEOUT_S).status == 404
    assert w0.receive("register")["template"] == "t1"
    w0.register("t2", ok=False)  # its only worker failed to record it
    answer = parked[1].result(TIMEOUT_S)
    assert answer.status == 422 and "out of memory" in answer.message
    assert router.template("t2")["status"] == "failed"



def test_an_edit_whose_recording_a_delete_dropped_is_answered_template_deleted_or_runs_again(context, make_router):
    """The worker fails an edit whose recording the delete dropped (MissingTemplate): the client is told what
    a waiting edit is told, 404 template_deleted; registered again meanwhile, the edit runs again. A failure
    of its own stays the worker's answer, deleted template or not."""
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template("t1"))
    w0.register("t1")
    dropped, failing, again = router.submit(task("t1")), router.submit(task("t1")), router.submit(task("t1"))
    first, second, third = w0.receive("edit"), w0.receive("edit"), w0.receive("edit")
    assert router.drop_template("t1") and w0.receive("drop")["template"] == "t1"
    w0.fail(first["request"], 422, "MissingTemplate", "template 't1' was dropped before the edit ran")
    answer = dropped.result(TIMEOUT_S)
    assert (answer.status, answer.error) == (404, "template_deleted")
    w0.fail(second["request"], 500, "RuntimeError", "out of memory")
    assert failing.result(TIMEOUT_S).status == 500
    router.register_template(template("t1"))  # the same image registered again (ids follow content)
    assert w0.receive("register")["template"] == "t1"
    w0.fail(third["request"], 422, "MissingTemplate", "template 't1' was dropped before the edit ran")
    w0.register("t1")
    rerun = w0.receive("edit")
    assert rerun["request"] == third["request"]
    w0.answer(rerun["request"], b"edited")
    assert again.result(TIMEOUT_S).png == b"edited"


def test_a_full_queue_says_when_to_retry_from_the_rate_of_recent_answers(make_router):
    router = make_router(max_queue=1)
    router.register_template(template("t1"))
    router.submit(task("t1"))  # parked: no worker
    with pytest.raises(QueueFull) as nothing_answered:
        router.submit(task("t1"))
    assert nothing_answered.value.retry_after_s == RETRY_AFTER_UNKNOWN_S
    now = time.monotonic()
    router._answered.extend(now - 25 + 2.5 * i for i in range(10))  # 10 answers in the last 25 s: 0.4/s
    with pytest.raises(QueueFull) as three_over:
        router.submit_many([task("t1")] * 3)
    assert three_over.value.retry_after_s == 8  # 3 more answers at 0.4/s: 7.5 s
    router._answered.clear()
    router._answered.append(now - 1000)  # a stalled cluster: never more than the cap
    with pytest.raises(QueueFull) as stalled:
        router.submit(task("t1"))
    assert stalled.value.retry_after_s == RETRY_AFTER_MAX_S


def test_one_tenants_burst_does_not_fill_the_queue_for_everyone(make_router):
    router = make_router(max_queue=4, max_queue_per_tenant=2)
    router.register_template(replace(template("a"), owner="tenant a"))
    router.register_template(replace(template("b"), owner="tenant b"))
    router.submit_many([task("a"), task("a")])  # parked: no worker
    with pytest.raises(QueueFull, match="this API key has 2 requests waiting"):
        router.submit(task("a"))
    router.submit_many([task("b"), task("b")])  # another key still gets its share
    with pytest.raises(QueueFull, match="max_queue 4"):
        router.submit(task("b"))


def test_a_tenant_keeps_at_most_its_template_limit_and_one_offs_do_not_count(make_router):
    router = make_router(max_templates_per_tenant=2)
    router.register_template(template("t1"))
    router.register_template(template("t2"))
    router.register_template(template("t2"))  # the same template again is no new one
    router.submit_many([task("o1")], one_off=replace(template("o1"), one_off=True))
    with pytest.raises(TemplateLimit, match="keeps 2 templates"):
        router.register_template(template("t3"))
    router.register_template(replace(template("u1"), owner="another key"))  # its own count
    assert router.drop_template("t1")
    router.register_template(template("t3"))  # room again
    assert {t["id"] for t in router.list_templates("")} == {"t2", "t3", "o1"}


def test_registered_templates_are_bounded_by_bytes_across_tenants(make_router):
    """The head holds every registered template's image: past --max-templates-mb a new one is refused,
    whoever registers it; the same template again costs nothing more, a deletion makes room, and one-off
    images have their own bound."""
    size = len(template().image)
    router = make_router(max_template_bytes=2 * size + 1)
    router.register_template(template("t1"))
    router.register_template(replace(template("u1"), owner="another key"))
    router.register_template(template("t1"))  # the same template again: no more bytes
    router.submit_many([task("o1")], one_off=one_off("o1"))
    with pytest.raises(TemplateStorageFull, match="no memory left for this template"):
        router.register_template(template("t2"))
    assert router.snapshot()["template_bytes"] == {"registered": 2 * size, "one_off": len(one_off().image)}
    assert router.drop_template("u1", owner="another key")
    router.register_template(template("t2"))  # room again
    assert router.held_bytes(one_off=False) == 2 * size


def test_one_off_images_are_bounded_by_bytes_evicting_idle_ones_first(context, make_router):
    """Past max_one_off_bytes the least recently edited idle images go until the rest fit; an image an
    accepted edit waits for stays, over the bound if it must."""
    size = len(one_off().image)
    router = make_router(max_one_off_bytes=2 * size)
    w0 = ScriptedWorker(context, router, "w0")
    answers = []
    for image in ("img-1", "img-2"):
        answers += router.submit_many([task(image)], one_off(image))[1]
    held = [w0.receive("edit"), w0.receive("edit")]  # both busy: a third goes over the bound for now
    answers += router.submit_many([task("img-3")], one_off("img-3"))[1]
    held.append(w0.receive("edit"))
    assert router.held_bytes(one_off=True) == 3 * size and router.snapshot()["counters"]["one_offs_evicted"] == 0
    for message in held:
        w0.answer(message["request"])
    assert all(answer.result(TIMEOUT_S).status == 200 for answer in answers)
    # idle once answered: img-1, answered first, went then (its bound is checked at every answer, not only
    # when the next image comes)
    assert router.held_bytes(one_off=True) == 2 * size and router.template("img-1") is None
    router.templates["img-2"].last_used = 0.0  # the least recently edited
    answers = router.submit_many([task("img-4")], one_off("img-4"))[1]
    assert router.template("img-2") is None
    assert {t["id"] for t in router.list_templates()} == {"img-3", "img-4"}
    assert router.snapshot()["counters"]["one_offs_evicted"] == 2
    w0.answer(w0.receive("edit")["request"])
    assert answers[0].result(TIMEOUT_S).status == 200


def test_close_answers_what_it_could_not_run(context, make_router):
    router = make_router()
    router.register_template(template())
    future = router.submit(task())
    router.close(drain_s=0)
    answer = future.result(TIMEOUT_S)
    assert (answer.status, answer.error) == (503, "interrupted")  # the server's stop: send it again


def test_close_cancels_on_their_workers_the_edits_it_answers(context, make_router):
    """Answered 503 by the closing router, an edit is no longer anyone's: its worker drops it rather than
    computing it while it drains."""
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task())
    edit = w0.receive("edit")
    router.close(drain_s=0)
    assert future.result(TIMEOUT_S).status == 503
    assert w0.receive("cancel")["request"] == edit["request"] and w0.receive("stop")


def test_a_worker_saying_hello_once_told_the_router_closes_is_told_again_not_welcomed(context, make_router):
    """A worker started on its own says hello as soon as it hears the router is closing; a hello that
    comes before the router's loop ends must not welcome it (it would count itself joined to a router
    that is gone)."""
    router = make_router()
    with router._lock:
        router._said_goodbye = True  # what close() sets once it told its workers, before its loop ends
    ScriptedWorker(context, router, "own", welcome="closing", supervised=False)
    ScriptedWorker(context, router, "supervised", welcome="stop", supervised=True)
    assert router.snapshot()["workers"] == {}


@pytest.mark.parametrize("bulk", [False, True])
def test_a_template_whose_register_was_lost_is_sent_again(context, make_router, bulk):
    """Sent again as it was sent: one of a joining worker's bulk registrations stays one (it was then
    recorded outright, whatever the worker's caches held)."""
    router = make_router(dead_after_s=1.0)
    if bulk:  # registered before the worker joins: sent at its hello
        router.register_template(template("t1"))
    w0 = ScriptedWorker(context, router, "w0")
    if not bulk:
        router.register_template(template("t1"))
    assert w0.receive("register").get("bulk", False) is bulk  # as if it never arrived: not recording it
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_recordings"] == 0 and time.monotonic() < deadline:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "recording": []})
        w0.sync()
    w0.pending_kinds()
    (again,) = [message for message in w0.inbox if message["kind"] == "register"]
    assert again.get("bulk", False) is bulk
    w0.register("t1")  # sent again: recorded this time
    assert router.template("t1")["status"] == "ready"


def one_off(template_id: str = "img-1") -> TemplateRecord:
    return TemplateRecord(template_id, b"png-of-image", (64, 64), "", 2, 0, None, replicas=1, one_off=True)


def test_a_one_off_image_is_recorded_by_its_first_edit_and_later_edits_follow_it(context, make_router):
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    [first_id], [first] = router.submit_many([task("img-1")], one_off())
    carrier, other = (w0, w1) if router.pending[first_id].worker == "w0" else (w1, w0)
    message = carrier.receive("edit")
    assert message["one_off"] == {"steps": 2, "guidance": None} and message["blobs"]["image"] == b"png-of-image"
    assert "register" not in carrier.pending_kinds() + other.pending_kinds()  # never registered on its own
    _, [second] = router.submit_many([task("img-1")], one_off())  # the same image meanwhile: it waits
    assert router.snapshot()["parked"] == 1 and router.template("img-1")["status"] == "recording"
    carrier.send({"kind": "template", "template": "img-1", "ok": True})
    carrier.answer(message["request"], b"first")
    assert first.result(TIMEOUT_S).png == b"first"
    again = carrier.receive("edit")  # mask-aware where it was recorded, without the image
    assert "one_off" not in again and "image" not in again["blobs"]
    carrier.answer(again["request"], b"second")
    assert second.result(TIMEOUT_S).png == b"second"
    assert "edit" not in other.pending_kinds()


def test_a_one_off_edit_that_fails_or_is_cancelled_leaves_the_image_to_the_next_edit(context, make_router):
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    [first_id], [first] = router.submit_many([task("img-1")], one_off())
    message = w0.receive("edit")
    _, [waiting] = router.submit_many([task("img-1")], one_off())
    assert router.cancel(first_id) and not router.cancel(first_id)
    assert first.result(TIMEOUT_S).status == 409 and first.result().error == "Cancelled"
    assert w0.receive("cancel")["request"] == message["request"]
    retry = w0.receive("edit")  # the waiting edit now records the image
    assert "one_off" in retry
    w0.send({"kind": "result", "request": retry["request"], "status": 422, "error": "InputError", "message": "bad"})
    assert waiting.result(TIMEOUT_S).status == 422
    assert router.template("img-1")["status"] == "pending"  # nobody holds it; the next edit records it
    w0.send({"kind": "result", "request": message["request"], "status": 409, "error": "Cancelled"})
    w0.sync()
    assert router.snapshot()["counters"]["duplicates_dropped"] == 0


def test_a_one_off_image_too_large_to_record_is_recorded_elsewhere_or_edited_side_by_side(context, make_router):
    """Edits of a one-off image wait while one of them records it, to be mask-aware after it. An image that
    a worker's whole host cache cannot hold (its edit answered unrecorded, "too_large") is recorded by a
    worker whose cache may hold it; where none can, its edits no longer wait for each other: each runs in
    full, carrying the image (they ran one at a time across the cluster, each trying again)."""
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    [first_id], [first] = router.submit_many([task("img-1")], one_off())
    carrier, other = (w0, w1) if router.pending[first_id].worker == "w0" else (w1, w0)
    message = carrier.receive("edit")
    _, waiting = router.submit_many([task("img-1"), task("img-1")], one_off())
    assert router.snapshot()["parked"] == 2  # waiting for the recording
    carrier.send({"kind": "result", "request": message["request"], "status": 200, "unrecorded": "too_large"},
                 {"png": b"first"})
    assert first.result(TIMEOUT_S).png == b"first"
    retry = other.receive("edit")  # the other worker may hold it: it records it, the third edit waits
    assert "one_off" in retry and router.snapshot()["parked"] == 1
    assert "edit" not in carrier.pending_kinds()
    other.send({"kind": "result", "request": retry["request"], "status": 200, "unrecorded": "too_large"},
               {"png": b"second"})
    [last] = next_edits((w0, w1), 1)  # no one can hold it: it runs in full, recording nothing
    assert "one_off" in last and router.pending[last["request"]].records is False
    router.submit_many([task("img-1"), task("img-1")], one_off())  # both go at once, carrying the image
    assert router.snapshot()["parked"] == 0
    assert all("one_off" in message for message in next_edits((w0, w1), 2))
    for worker in (w0, w1):
        worker.sync()
        assert "edit" not in worker.pending_kinds()
    assert router.snapshot()["counters"]["one_offs_too_large"] == 2
    assert router.template("img-1")["status"] == "pending" and all(not w.done() for w in waiting[1:])


def test_edits_waiting_for_a_recording_go_as_soon_as_the_worker_says_it_records_nothing(context, make_router):
    """A worker that finds, at a step, that it cannot record the image its one-off edit was to record says so
    at once: the edits waiting for that recording go then, not after the edit's answer (with n images of
    one big picture, they waited a whole generation). Its answer then counts nothing twice."""
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    [first_id], [first] = router.submit_many([task("img-1")], one_off())
    message = w0.receive("edit")
    _, [waiting] = router.submit_many([task("img-1")], one_off())
    assert router.snapshot()["parked"] == 1
    w0.send({"kind": "unrecorded", "request": message["request"], "attempt": message["attempt"],
             "reason": "too_large"})
    sent = w0.receive("edit")  # before the first edit is answered: in full, recording nothing
    assert "one_off" in sent and router.pending[sent["request"]].records is False and not first.done()
    w0.send({"kind": "result", "request": message["request"], "status": 200, "unrecorded": "too_large"},
            {"png": b"first"})
    w0.answer(sent["request"], b"second")
    assert first.result(TIMEOUT_S).png == b"first" and waiting.result(TIMEOUT_S).png == b"second"
    assert router.snapshot()["counters"]["one_offs_too_large"] == 1
    assert router.templates["img-1"].too_large_for == {"w0"} and router.template("img-1")["status"] == "pending"


def next_edits(workers, count: int) -> list[dict]:
    """The next `count` edits the router sends to any of `workers`."""
    found, deadline = [], time.monotonic() + TIMEOUT_S
    while len(found) < count and time.monotonic() < deadline:
        for worker in workers:
            worker.socket.poll(10)
            if "edit" in worker.pending_kinds():
                found.append(worker.receive("edit"))
    assert len(found) == count, f"{len(found)} of {count} edits sent"
    return found


def test_submit_many_is_all_or_nothing(context, make_router):
    router = make_router(max_queue=3)
    router.register_template(template())
    router.submit_many([task(), task()])
    with pytest.raises(QueueFull):
        router.submit_many([task(), task()], one_off("img-2"))
    assert router.snapshot()["pending"] == 2 and router.template("img-2") is None


def test_one_off_images_are_bounded_by_evicting_the_least_recently_edited_idle_one(context, make_router):
    router = make_router(max_one_off=2)
    w0 = ScriptedWorker(context, router, "w0")

    def edit_and_record(image: str) -> None:
        _, [answer] = router.submit_many([task(image)], one_off(image))
        message = w0.receive("edit")
        w0.send({"kind": "template", "template": image, "ok": True})
        w0.answer(message["request"])
        assert answer.result(TIMEOUT_S).status == 200

    edit_and_record("img-1")
    edit_and_record("img-2")
    _, [busy] = router.submit_many([task("img-1")], one_off("img-1"))  # img-1 is now the most recent, and busy
    running = w0.receive("edit")
    edit_and_record("img-3")  # one too many: img-2 (least recently edited, idle) goes
    assert router.template("img-2") is None and w0.receive("drop")["template"] == "img-2"
    assert router.template("img-1") is not None and router.template("img-3") is not None
    assert router.snapshot()["counters"]["one_offs_evicted"] == 1
    w0.answer(running["request"])
    assert busy.result(TIMEOUT_S).status == 200


def test_watchers_see_every_step_once_a_reroute_start_over_and_the_answer(context, make_router):
    """Events of a watched request (what the SSE streams relay): parked until its template is ready,
    queued, each step its worker reports; steps a dead worker sends after it was replaced are not
    told; the answer ends them."""
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(TemplateRecord("t1", b"png-of-template", (64, 64), "", 3, 0, None, 0))
    seen: list[tuple[int, dict]] = []
    [request], [future] = router.submit_many([task()], on_event=lambda rid, event: seen.append((rid, event)))
    w0.register("t1")  # the parked edit goes to the first worker ready
    assert w0.receive("edit")["request"] == request
    w1.register("t1")
    for step in (1, 2):
        w0.send({"kind": "progress", "request": request, "step": step})
    w0.sync()
    late = []
    assert router.watch("request", request, late.append) is not None
    router.worker_exited("w0")
    assert w1.receive("edit")["request"] == request
    w0.send({"kind": "progress", "request": request, "step": 3})  # w0's last words: not this request's now
    for step in (1, 2, 3):
        w1.send({"kind": "progress", "request": request, "step": step})
    w1.answer(request)
    assert future.result(TIMEOUT_S).status == 200
    events = [(e["event"], e.get("step", e.get("attempt"))) for rid, e in seen if rid == request]
    assert events == [("parked", None), ("queued", 1), ("step", 1), ("step", 2), ("queued", 2),
                                          ("step", 1), ("step", 2), ("step", 3), ("answered", None)]
    # A watcher that comes later starts from where the request is (running at step 2 on w0).
    assert [(e["event"], e.get("step")) for e in late][:2] == [("running", 2), ("queued", None)]
    assert router.watch("request", request, late.append) is None  # answered: nothing to watch
    assert not router._watchers  # nothing left behind


def test_template_watchers_see_its_recording_to_the_end(context, make_router):
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(TemplateRecord("t1", b"png-of-template", (64, 64), "", 3, 0, None, 0))
    seen: list[dict] = []
    stop = router.watch("template", "t1", seen.append)
    assert w0.receive("register")["template"] == "t1"
    for step in (1, 2, 3):
        w0.send({"kind": "progress", "template": "t1", "step": step})
    w0.send({"kind": "template", "template": "t1", "ok": True})
    w0.sync()
    assert [(e["status"], e["progress"]["step"]) for e in seen][-4:] == [
        ("recording", 1), ("recording", 2), ("recording", 3), ("ready", 3)]
    # A second worker recording it behind the first does not send its progress backwards.
    w1 = ScriptedWorker(context, router, "w1")
    assert w1.receive("register")["template"] == "t1"
    w1.send({"kind": "progress", "template": "t1", "step": 1})
    w1.sync()
    assert router.template("t1")["progress"] == {"workers_ready": 1, "workers_recording": 1, "workers_cached": 0,
                                                 "workers_connected": 2, "step": 3, "steps": 3}
    assert all(e["progress"]["step"] == 3 for e in seen if e["status"] == "ready")
    stop()
    assert router.watch("template", "unknown", seen.append) is None and not router._watchers



def test_before_any_worker_says_the_served_models_family_and_sampler_count(context, make_router):
    """A head that serves SD2 (PLMS: a call more) counts an edit that comes before any worker joined
    as its workers will run it, not with Flux's rounding (5 steps at 0.5: 2 on SD2, 3 on Flux)."""
    router = make_router(family="sd2", calls=(1, 1))
    assert router.steps_run(5, 0.5) == 2 and router.denoiser_calls(5, strength=0.5) == 3
    assert router.denoiser_calls(8, strength=0.125) == 2 and router.denoiser_calls(1) == 1
    ScriptedWorker(context, router, "w0", calls=[1, 0], family="flux-fill")
    assert router.steps_run(5, 0.5) == router.denoiser_calls(5, strength=0.5) == 3  # what the worker says wins


def test_progress_counts_the_workers_denoiser_calls(context, make_router):
    """A worker on a second-order sampler (Heun: 5 denoiser calls for 3 steps) says how many calls a
    request makes: its events count calls, its steps left too, and a template's progress stays in its steps."""
    router = make_router()
    assert router.denoiser_calls(3) == 3  # until a worker says otherwise
    w0 = ScriptedWorker(context, router, "w0", calls=[2, -1])
    assert router.denoiser_calls(3) == router.denoiser_calls(3, "w0") == 5 and router.denoiser_calls(1) == 1
    ScriptedWorker(context, router, "w9", calls=[1, 1])
    assert router.denoiser_calls(3, "w9") == 4  # each worker's own line once routed
    assert router.denoiser_calls(8, "w9", strength=0.125) == 2  # a one-step tail of PLMS: two calls
    router.worker_exited("w9")
    router.register_template(TemplateRecord("t1", b"png-of-template", (64, 64), "", 3, 0, None, 0))
    assert w0.receive("register")["template"] == "t1"
    w0.send({"kind": "progress", "template": "t1", "step": 4, "steps": 5})
    w0.sync()
    assert router.template("t1")["progress"]["step"] == 2  # 4 of 5 calls: 2 of its 3 steps done
    seen: list[dict] = []
    [request], [future] = router.submit_many([task()], on_event=lambda rid, event: seen.append(event))  # parked
    w0.send({"kind": "template", "template": "t1", "ok": True})  # sent after the edit: it was parked, always
    assert w0.receive("edit")["request"] == request
    w0.send({"kind": "progress", "request": request, "step": 4, "steps": 5})
    w0.sync()
    assert router.pending[request].steps_left == 1
    assert router.request_status(request) == {"status": "running", "worker": "w0", "step": 4, "steps": 5}
    w0.answer(request)
    assert future.result(TIMEOUT_S).status == 200
    # One unit throughout: what the stream says first is what its steps count to.
    assert [(e["event"], e["steps"]) for e in seen if "steps" in e] == [("parked", 5), ("queued", 5), ("step", 5)]
    assert [e["step"] for e in seen if e["event"] == "step"] == [4]

LORA = (LoraUse("grain", 0.5), LoraUse("ink"))


def test_an_edit_carries_its_lora_as_json_and_keeps_it_when_rerouted(context, make_router):
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task(lora=LORA))
    first = w0.receive("edit")
    assert first["lora"] == [{"name": "grain", "scale": 0.5}, {"name": "ink", "scale": 1.0}]
    assert parse_lora(first["lora"]) == LORA
    w1.register("t1")
    router.worker_exited("w0")
    again = w1.receive("edit")
    assert again["request"] == first["request"] and parse_lora(again["lora"]) == LORA
    w1.answer(again["request"])
    assert future.result(TIMEOUT_S).status == 200
    router.submit(task())
    assert "lora" not in w1.receive("edit")  # none: no field


def test_a_one_off_edit_with_a_lora_carries_the_image_but_leaves_its_recording_to_another(context, make_router):
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    _, [with_lora] = router.submit_many([task("img-1", LORA)], one_off())
    first = w0.receive("edit")  # computed in full with the image; the cache holds the base model's rows only
    assert first["one_off"] == {"steps": 2, "guidance": None} and first["blobs"]["image"] == b"png-of-image"
    assert router.template("img-1")["status"] == "pending"
    _, [plain] = router.submit_many([task("img-1")], one_off())  # not parked behind it: it records the image
    second = w0.receive("edit")
    assert "one_off" in second and "lora" not in second
    assert router.template("img-1")["status"] == "recording"
    w0.answer(first["request"])
    w0.send({"kind": "template", "template": "img-1", "ok": True})
    w0.answer(second["request"])
    assert with_lora.result(TIMEOUT_S).status == plain.result(TIMEOUT_S).status == 200
    assert router.template("img-1")["status"] == "ready"


def _edit_goes_to(task_, router, workers) -> str:
    """The worker the router sends `task_` to (the only one that receives an edit for it)."""
    router.submit(task_)
    for worker in workers:
        worker.sync()
    (name,) = [w.name for w in workers if "edit" in w.pending_kinds()]
    next(w for w in workers if w.name == name).receive("edit")
    return name


def test_an_edit_with_a_lora_goes_where_its_adapters_are_while_that_worker_is_about_as_loaded(context,
                                                                                             make_router):
    """Least-requests would spread these edits over the three workers; affinity (bound 1) keeps an adapter's
    edits where it is held -- reported in a heartbeat, or named by an edit sent there -- unless that worker
    has more than one request more in flight than the least loaded."""
    router = make_router(lora_affinity=1)
    workers = [ScriptedWorker(context, router, f"w{i}") for i in range(3)]
    router.register_template(template())
    for worker in workers:
        worker.register("t1")
    workers[2].heartbeat({}, loras=["grain", "ink", "other"])
    assert _edit_goes_to(task(lora=LORA), router, workers) == "w2"
    assert _edit_goes_to(task(lora=LORA), router, workers) == "w2"  # 1 in flight there, 0 elsewhere: within 1
    assert _edit_goes_to(task(lora=LORA), router, workers) == "w0"  # w2 has 2: the policy's choice
    # w0 now holds grain and ink too (its edit's load has started), and has 1 in flight: within 1 of w1's 0.
    assert _edit_goes_to(task(lora=parse_lora("grain")), router, workers) == "w0"
    assert _edit_goes_to(task(lora=parse_lora("unheard-of")), router, workers) == "w1"  # nobody holds it
    assert _edit_goes_to(task(), router, workers) == "w1"  # no LoRA: the policy (least requests)
    assert router.snapshot()["counters"]["lora_affinity"] == 3


@pytest.mark.parametrize("bound, expected", [(None, ["w0", "w1", "w0"]), (0, ["w1", "w0", "w1"])])
def test_lora_affinity_0_prefers_holders_among_the_least_loaded_and_none_leaves_it_to_the_policy(
        context, make_router, bound, expected):
    router = make_router(lora_affinity=bound)
    workers = [ScriptedWorker(context, router, f"w{i}") for i in range(2)]
    router.register_template(template())
    for worker in workers:
        worker.register("t1")
    workers[1].heartbeat({}, loras=["grain", "ink"])
    # Bound 0: w1 first (it holds them); then w1 has one more in flight than w0, which gets the next (and
    # holds them from then on); then both hold them with one each: nothing to narrow, the policy breaks the tie.
    assert [_edit_goes_to(task(lora=LORA), router, workers) for _ in range(3)] == expected
    assert router.snapshot()["counters"]["lora_affinity"] == (0 if bound is None else 1)  # the first edit only


@pytest.mark.parametrize("bound, expected", [(None, ["w0", "w1", "w0", "w1"]), (0, ["w1", "w0", "w1", "w0"])])
def test_an_edit_goes_where_its_template_is_in_host_memory_among_the_least_loaded(context, make_router, bound,
                                                                                  expected):
    """Every worker recorded t1 and t2, but only w1's host memory still holds t1: with bound 0 its edit goes
    there; the next (w1 now one ahead) to the policy's choice, w0, which then holds it too (its edit brings it
    there), so the third has nothing to narrow; t2, held nowhere, is the policy's alone."""
    router = make_router(template_affinity=bound)
    workers = [ScriptedWorker(context, router, f"w{i}") for i in range(2)]
    for template_id in ("t1", "t2"):
        router.register_template(template(template_id))
        for worker in workers:
            worker.register(template_id)
    workers[1].heartbeat({}, cached=["t1"])
    assert [router.template(t)["progress"]["workers_cached"] for t in ("t1", "t2")] == [1, 0]
    assert router.template("t1")["progress"]["workers_ready"] == 2
    routed = [_edit_goes_to(task("t1"), router, workers) for _ in range(3)] + [_edit_goes_to(task("t2"), router,
                                                                                             workers)]
    assert routed == expected
    assert router.snapshot()["counters"]["template_affinity"] == (0 if bound is None else 1)  # the first edit
    workers[1].heartbeat({}, cached=[])  # evicted there since
    assert not router.workers["w1"].cached and router.template("t1")["progress"]["workers_cached"] == 0
    with pytest.raises(ValueError, match="template_affinity"):
        RouterConfig(template_affinity=-1)


def test_an_answer_says_what_the_workers_host_memory_holds_without_waiting_for_a_heartbeat(context, make_router):
    """Edits a tenth of a second apart would otherwise be routed by what the host memory held up to a
    heartbeat ago."""
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template())
    w0.register("t1")
    future = router.submit(task())
    w0.send({"kind": "result", "request": w0.receive("edit")["request"], "status": 200, "cached": ["t1"]},
            {"png": b"png"})
    assert future.result(TIMEOUT_S).status == 200
    w0.sync()
    assert router.workers["w0"].cached == {"t1"} and router.template("t1")["progress"]["workers_cached"] == 1


def test_lora_affinity_needs_a_free_slot_and_ends_when_the_adapter_goes(context, make_router):
    router = make_router(lora_affinity=5)  # in flight never binds here: the free batch slot does
    w0, w1 = ScriptedWorker(context, router, "w0", max_batch=1), ScriptedWorker(context, router, "w1")
    router.register_template(template())
    for worker in (w0, w1):
        worker.register("t1")
    w0.heartbeat({}, loras=["grain", "ink"])
    assert _edit_goes_to(task(lora=LORA), router, [w0, w1]) == "w0"
    assert _edit_goes_to(task(lora=LORA), router, [w0, w1]) == "w1"  # w0's only batch slot is taken

    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")
    router.register_template(template())
    for worker in (w0, w1):
        worker.register("t1")
    w1.heartbeat({}, loras=["grain", "ink"])
    w1.heartbeat({}, loras=["ink"])  # its cache let grain go
    assert _edit_goes_to(task(lora=LORA), router, [w0, w1]) == "w0"  # the policy's choice, not w1's stale hold
    assert router.snapshot()["counters"]["lora_affinity"] == 0
    with pytest.raises(ValueError, match="lora_affinity"):
        RouterConfig(lora_affinity=-1)


def test_a_worker_of_another_protocol_is_refused_saying_so(context, make_router, caplog):
    """A head and workers of releases that would read each other's messages another way: the worker is
    refused at its hello, naming both protocols, before any edit or recording reaches it."""
    caplog.set_level("WARNING", logger="retouch.router")
    router = make_router()
    newer = ScriptedWorker(context, router, "w0", welcome="refused", protocol=wire.PROTOCOL + 1)
    assert newer.answer_to_hello["reason"].startswith(
        f"it speaks protocol {wire.PROTOCOL + 1}, this server protocol {wire.PROTOCOL}: run the same retouch release")
    older = ScriptedWorker(context, router, "w1", welcome="refused", protocol=None)
    assert "no protocol (a release from before protocol numbers)" in older.answer_to_hello["reason"]
    ScriptedWorker(context, router, "w2")
    assert set(router.workers) == {"w2"} and router.snapshot()["counters"]["workers_mismatched"] == 2
    warnings = router_lines(caplog, "WARNING")
    assert sum(line.startswith("worker w0 refused: it speaks protocol") for line in warnings) == 1


def test_a_worker_of_another_model_is_refused_and_other_weights_are_told(context, make_router, caplog):
    caplog.set_level("INFO", logger="retouch.router")
    router = make_router(model="tiny-flux-fill")
    w0 = ScriptedWorker(context, router, "w0", model="tiny-flux-fill", dtype="float32", weights="aaa",
                        scheduler="FlowMatchEulerDiscreteScheduler", scheduler_id="s0")
    refused = ScriptedWorker(context, router, "w1", welcome="refused", model="/models/tiny-sd3-inpaint")
    assert "it serves the model 'tiny-sd3-inpaint', this server 'tiny-flux-fill'" in refused.answer_to_hello["reason"]
    ScriptedWorker(context, router, "w2", model="/mnt/x/tiny-flux-fill", dtype="bfloat16", weights="bbb")
    ScriptedWorker(context, router, "w3", model="tiny-flux-fill", dtype="float32", weights="ccc",
                   scheduler="FlowMatchEulerDiscreteScheduler(use_karras_sigmas=true)", scheduler_id="s3")
    ScriptedWorker(context, router, "w4", model="tiny-flux-fill", dtype="float32", weights="ddd",
                   scheduler="FlowMatchEulerDiscreteScheduler", scheduler_id="s0")
    ScriptedWorker(context, router, "w5", model="tiny-flux-fill", dtype="float32", weights="eee")  # says no sampler
    assert set(router.workers) == {"w0", "w2", "w3", "w4", "w5"}  # a folder is its name: hosts mount it anywhere
    assert router.snapshot()["counters"]["workers_mismatched"] == 1
    warnings = router_lines(caplog, "WARNING")
    assert any(line.startswith("worker w1 refused") for line in warnings)
    # What differs is named: the dtype, the scheduler (a forgotten --scheduler), or the weights alone.
    assert any(line.startswith("worker w2 runs another dtype (bfloat16) than worker w0 (float32)") for line in warnings)
    assert any(line.startswith("worker w3 runs another scheduler (FlowMatchEulerDiscreteScheduler(use_karras_sigmas="
                               "true)) than worker w0 (FlowMatchEulerDiscreteScheduler)") for line in warnings)
    assert any(line.startswith("worker w4 runs other weights than worker w0") for line in warnings)
    assert any(line.startswith("worker w5 runs other weights, scheduler or dtype than worker w0") for line in warnings)
    assert not any("stores cached activations" in line for line in warnings)  # none said how
    assert router.snapshot()["workers"]["w2"]["info"]["weights"] == "bbb"
    # the same weights, their cached activations stored in another format: other pixels too
    ScriptedWorker(context, router, "w6", model="tiny-flux-fill", dtype="float32", weights="aaa",
                   scheduler="FlowMatchEulerDiscreteScheduler", scheduler_id="s0", cache_dtype="float32")
    ScriptedWorker(context, router, "w7", model="tiny-flux-fill", dtype="float32", weights="aaa",
                   scheduler="FlowMatchEulerDiscreteScheduler", scheduler_id="s0", cache_dtype="float8_e4m3fn")
    assert any(line.startswith("worker w7 stores cached activations as float8_e4m3fn, worker w6 as float32")
               for line in router_lines(caplog, "WARNING"))
    # the same process saying hello again (its welcome lost) is welcomed, not removed and added
    w0.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1, "model": "tiny-flux-fill",
             "weights": "aaa"})
    assert w0.receive("welcome") and router.snapshot()["counters"]["workers_removed"] == 0


def test_an_edit_with_a_lora_goes_only_to_workers_that_serve_loras(context, make_router):
    router = make_router(no_worker_s=0.3)
    plain = ScriptedWorker(context, router, "plain", lora=False)
    router.register_template(template("t1"))
    plain.register("t1")
    lora = parse_lora("style")
    refused = router.submit(task("t1", lora)).result(TIMEOUT_S)  # nobody could run it, for no_worker_s
    assert refused.status == 503 and refused.error == "lora_unavailable"
    one_off = replace(template("o1", replicas=1), one_off=True)  # recorded where LoRAs are not served
    first = router.submit_many([task("o1")], one_off=one_off)[1][0]
    recording = plain.receive("edit")
    plain.send({"kind": "template", "template": "o1", "ok": True})
    plain.answer(recording["request"])
    assert first.result(TIMEOUT_S).status == 200
    serving = ScriptedWorker(context, router, "serving", lora=True)
    with_lora = router.submit(task("o1", lora))  # one that serves LoRAs computes it from the image
    edit = serving.receive("edit")
    assert edit["template"] == "o1" and "image" in edit["blobs"]
    serving.answer(edit["request"])
    assert with_lora.result(TIMEOUT_S).status == 200
    answer = router.submit(task("t1", lora))  # parked until the worker that serves LoRAs holds the template
    serving.register("t1")
    edit = serving.receive("edit")
    serving.answer(edit["request"])
    assert answer.result(TIMEOUT_S).status == 200 and "edit" not in plain.pending_kinds()

def test_a_worker_that_outlived_its_router_cannot_answer_the_next_ones_requests(context, make_router):
    """Request ids start at random per router and each welcome names the router's session: an edit of the
    last router that finishes after the worker joined the next one is dropped, not given to whichever of
    the new router's requests had the same id (another tenant's, maybe)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    old = make_router(address=address)
    w0 = ScriptedWorker(context, old, "w0")
    old.register_template(template("t1"))
    w0.register("t1")
    old.submit(task("t1"))
    stale = w0.receive("edit")
    old_session = w0.answer_to_hello["session"]
    old.close(drain_s=0)
    new = make_router(address=address)
    new.register_template(template("t1"))
    w0.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1, "templates": ["t1"]})
    assert w0.receive("welcome")["session"] != old_session
    answer = new.submit(task("t1"))
    current = w0.receive("edit")
    assert current["request"] != stale["request"]
    w0.answer(stale["request"], b"the old request's image")
    w0.answer(current["request"], b"its own image")
    assert answer.result(TIMEOUT_S).png == b"its own image"
    assert new.snapshot()["counters"]["duplicates_dropped"] == 1


def test_an_edit_lost_on_the_way_to_a_live_worker_is_sent_again(context, make_router):
    """A link that drops and comes back before the worker is presumed dead loses what was in flight; the
    worker's heartbeats list what it holds, and an edit missing from them for dead_after_s goes again."""
    router = make_router(dead_after_s=0.5)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template("t1"))
    w0.register("t1")
    answer = router.submit(task("t1"))
    lost = w0.receive("edit")  # as if it never arrived: the worker does not hold it
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_requests"] == 0 and time.monotonic() < deadline:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": []})
        w0.sync()
    again = w0.receive("edit")
    assert again["request"] == lost["request"] and router.snapshot()["counters"]["lost_requests"] == 1
    w0.answer(again["request"])
    assert answer.result(TIMEOUT_S).status == 200


def test_an_edit_still_on_its_way_is_not_sent_again(context, make_router):
    """A large image over a slow link takes longer than dead_after_s to arrive: the worker's heartbeats
    say the last message number they saw, and an edit carried by a later one is on its way, not lost
    (it was sent again, and again, to every worker in turn). Once they saw it, lacking it is a loss."""
    router = make_router(dead_after_s=0.6)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template("t1"))
    w0.register("t1")
    answer = router.submit(task("t1"))
    edit = w0.receive("edit")
    window = time.monotonic() + 4 * 0.6  # the edit is still "arriving" for four times dead_after_s
    while time.monotonic() < window:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "seen": edit["seq"] - 1})
        w0.sync()
    assert router.snapshot()["counters"]["lost_requests"] == 0
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_requests"] == 0 and time.monotonic() < deadline:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "seen": edit["seq"]})
        w0.sync()
    again = w0.receive("edit")
    assert again["request"] == edit["request"] and again["seq"] > edit["seq"]
    w0.answer(again["request"])
    assert answer.result(TIMEOUT_S).status == 200


def test_workers_whose_lora_files_of_one_name_differ_are_said_once(context, make_router, caplog):
    """The same LoRA name on two workers with other files (a folder copied to some hosts only) gives its edits
    another image depending on where they run: the head says so once per pair of files, and counts it."""
    caplog.set_level("INFO", logger="retouch.router")
    router = make_router()
    w0, w1 = ScriptedWorker(context, router, "w0"), ScriptedWorker(context, router, "w1")

    def heartbeat(worker, digests):
        worker.send({"kind": "heartbeat", "running": [], "queued": [], "loras": sorted(digests),
                     "lora_digests": digests})
        worker.sync()

    heartbeat(w0, {"ink": "aaaa", "grain": "cccc"})
    heartbeat(w1, {"ink": "aaaa"})
    assert router.snapshot()["counters"]["lora_mismatches"] == 0
    for _ in range(3):  # every heartbeat says it again: one warning
        heartbeat(w1, {"ink": "bbbb", "grain": "cccc"})
        heartbeat(w0, {"ink": "aaaa", "grain": "cccc"})
    assert router.snapshot()["counters"]["lora_mismatches"] == 1
    [warning] = [line for line in router_lines(caplog, "WARNING") if "LoRA" in line]
    assert warning.startswith("LoRA 'ink' differs between worker") and "aaaa" in warning and "bbbb" in warning


def test_a_template_on_its_way_waits_at_most_transfer_timeout_s(context, make_router):
    """A template to record (its image) still on its way is not lost; one that has not arrived after
    transfer_timeout_s is (a link that carries heartbeats but not the router's messages)."""
    router = make_router(dead_after_s=0.5, transfer_timeout_s=3.0)
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(template("t1"))
    register = w0.receive("register")

    def heartbeat(seen: int) -> None:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "recording": [], "seen": seen})
        w0.sync()

    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # four dead_after_s on its way: not lost
        heartbeat(register["seq"] - 1)
    assert router.snapshot()["counters"]["lost_recordings"] == 0
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_recordings"] == 0 and time.monotonic() < deadline:
        heartbeat(register["seq"] - 1)  # past transfer_timeout_s it is lost all the same
    assert router.snapshot()["counters"]["lost_recordings"] == 1 and time.monotonic() - started >= 3.0
    assert w0.receive("register")["template"] == "t1"  # sent again


def test_a_restarted_process_with_the_same_name_and_pid_is_a_new_worker(context, make_router):
    """PID 1 in a container restarted in its pod: the same identity, another process (boot id). Its
    edits must go elsewhere, not wait for a process that is gone."""
    router = make_router()
    first = ScriptedWorker(context, router, "w0", boot="one")
    router.register_template(template("t1"))
    first.register("t1")
    answer = router.submit(task("t1"))
    first.receive("edit")
    # the restarted process
    first.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 1, "boot": "two"})
    first.receive("welcome")
    assert router.snapshot()["counters"]["workers_removed"] == 1
    first.register("t1")  # the new process records the template again, then gets the edit again
    edit = first.receive("edit")
    first.answer(edit["request"])
    assert answer.result(TIMEOUT_S).status == 200


def test_a_second_live_worker_of_one_name_waits_for_the_first_to_be_gone(context, make_router, caplog):
    """Two workers given one --name: taking the second's hello for a restart removed the first, whose next
    heartbeat rejoined it and removed the second, twice a second, rerouting their edits each time. The
    name stays the live holder's; the other is told, once in the log and at each hello, and joins once the
    holder is presumed dead."""
    router = make_router(dead_after_s=0.5)
    first = ScriptedWorker(context, router, "gpu-b")
    router.register_template(template("t1"))
    first.register("t1")
    answer = router.submit(task("t1"))
    edit = first.receive("edit")
    with caplog.at_level("WARNING", logger="retouch.router"):
        second = ScriptedWorker(context, router, "gpu-b", identity="gpu-b:2", welcome="name_taken", pid=2)
        for _ in range(3):  # it keeps saying hello, as a worker does until it is welcomed
            first.heartbeat({})
            second.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 2})
            second.receive("name_taken")
    snapshot = router.snapshot()
    assert snapshot["counters"]["workers_removed"] == 0 and snapshot["counters"]["rerouted"] == 0
    assert snapshot["counters"]["worker_names_taken"] == 4
    assert sum("a second worker named gpu-b" in line for line in router_lines(caplog, "WARNING")) == 1
    first.answer(edit["request"])
    assert answer.result(TIMEOUT_S).status == 200 and answer.result().worker == "gpu-b"
    deadline = time.monotonic() + TIMEOUT_S  # the first falls silent: once it is presumed dead, the name is free
    while "welcome" not in second.pending_kinds() and time.monotonic() < deadline:
        second.send({"kind": "hello", "protocol": wire.PROTOCOL, "max_batch": 4, "pid": 2})
        second.socket.poll(100)
    assert "welcome" in second.pending_kinds() and router.snapshot()["counters"]["workers_removed"] == 1


def test_a_lost_first_edit_of_a_one_off_is_sent_again_and_records_it(context, make_router):
    """The lost edit was recording the image on its worker: that recording is over too, so the edit goes
    again with the image (it once waited for a recording nobody was making)."""
    router = make_router(dead_after_s=1.0)
    w0 = ScriptedWorker(context, router, "w0")
    answer = router.submit_many([task("o1")], one_off=replace(template("o1", replicas=1), one_off=True))[1][0]
    lost = w0.receive("edit")
    deadline = time.monotonic() + TIMEOUT_S
    while router.snapshot()["counters"]["lost_requests"] == 0 and time.monotonic() < deadline:
        w0.send({"kind": "heartbeat", "running": [], "queued": [], "held": []})
        w0.sync()
    again = w0.receive("edit")
    assert again["request"] == lost["request"] and "image" in again["blobs"]
    w0.send({"kind": "template", "template": "o1", "ok": True})
    w0.answer(again["request"])
    assert answer.result(TIMEOUT_S).status == 200


def test_a_draining_worker_is_known_from_its_heartbeats_and_its_refusals_fail_no_template(context, make_router):
    """Its "draining" message may be lost, or the head may be new: every heartbeat says it, and an edit or
    a recording it refuses while stopping goes elsewhere without marking the template failed."""
    router = make_router()
    stopping = ScriptedWorker(context, router, "stopping")
    router.register_template(template("t1"))
    stopping.register("t1")
    answer = router.submit(task("t1"))
    edit = stopping.receive("edit")
    stopping.fail(edit["request"], 503, "WorkerDraining", "this worker is stopping")
    stopping.sync()
    assert router.workers["stopping"].draining and router.template("t1")["status"] != "failed"
    other = ScriptedWorker(context, router, "other")
    register = other.receive("register")
    other.send({"kind": "template", "template": register["template"], "ok": True})
    again = other.receive("edit")
    other.answer(again["request"])
    assert answer.result(TIMEOUT_S).status == 200
    router.register_template(template("t2"))  # recorded by the open worker only
    assert other.receive("register")["template"] == "t2" and "register" not in stopping.pending_kinds()
    late = ScriptedWorker(context, router, "late")  # a heartbeat says it drains, though nothing else did
    late.send({"kind": "heartbeat", "running": [], "queued": [], "held": [], "draining": True})
    late.sync()
    assert router.workers["late"].draining


def test_lora_edits_wait_while_the_worker_that_serves_them_drains_and_go_where_the_image_can(context, make_router):
    router = make_router(no_worker_s=0.3)
    lora = parse_lora("style")
    plain = ScriptedWorker(context, router, "plain", lora=False)
    first = router.submit_many([task("o1")], one_off=replace(template("o1", replicas=1), one_off=True))[1][0]
    recording = plain.receive("edit")
    plain.send({"kind": "template", "template": "o1", "ok": True})
    plain.answer(recording["request"])
    assert first.result(TIMEOUT_S).status == 200
    serving = ScriptedWorker(context, router, "serving", lora=True)
    serving.send({"kind": "draining"})
    serving.sync()
    waiting = router.submit(task("o1", lora))  # the only worker that serves LoRAs stops: wait, not 503
    assert not router.wait_until(lambda r: waiting.done(), 0.6)
    replacement = ScriptedWorker(context, router, "replacement", lora=True)  # the waiting edit goes there
    edit = replacement.receive("edit")
    assert edit["template"] == "o1" and "image" in edit["blobs"]  # the image only the plain worker holds
    replacement.answer(edit["request"])
    assert waiting.result(TIMEOUT_S).status == 200


def test_a_failing_watcher_is_logged_through_the_router_log_and_routing_goes_on(context, make_router, caplog):
    """A watcher's bug is the router's log record with its traceback (escaped and indented by the serving
    log's formatter, as every record is), not raw text on stderr; the template still gets ready."""
    router = make_router()
    w0 = ScriptedWorker(context, router, "w0")
    router.register_template(TemplateRecord("t1", b"png-of-template", (64, 64), "", 3, 0, None, 0))

    def broken(event):
        if event["status"] == "ready":  # not its first event, which `watch` itself hands over
            raise ValueError("a watcher's bug\nforged: line")

    router.watch("template", "t1", broken)
    assert w0.receive("register")["template"] == "t1"
    with caplog.at_level(logging.ERROR, logger="retouch.router"):
        w0.send({"kind": "template", "template": "t1", "ok": True})
        w0.sync()
    assert router.template("t1")["status"] == "ready"
    failures = [r for r in caplog.records if r.name == "retouch.router" and r.exc_info]
    assert failures and "watcher of template t1 failed" in failures[-1].getMessage()
    assert failures[-1].exc_info[0] is ValueError
