"""The supervisor's stop and restart rules, without processes: stand-ins for worker processes and a clock
that moves only as they are waited for."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.engine import supervisor as supervisor_module
from retouch.engine.supervisor import RestartBudget, Supervisor, WorkerProcess


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StandInProcess:
    """A worker process: it exits `exits_after` seconds into the stop (None: never by itself, as a hung or
    stopped process), or when terminated if it heeds SIGTERM; a kill always ends it. Waiting moves the
    clock on by what is waited."""

    def __init__(self, clock: Clock, exits_after: float | None = None, heeds_sigterm: bool = False):
        self.clock, self.exits_after, self.heeds_sigterm = clock, exits_after, heeds_sigterm
        self.signals: list[str] = []
        self.pid = -1
        self.returncode = None

    def poll(self):
        return self.returncode

    def _ends_at(self) -> float | None:
        if "kill" in self.signals or ("terminate" in self.signals and self.heeds_sigterm):
            return self.clock.now
        return self.exits_after

    def wait(self, timeout: float | None = None):
        ends = self._ends_at()
        if ends is not None and (timeout is None or ends <= self.clock.now + timeout):
            self.clock.now = max(self.clock.now, ends)
            self.returncode = 0
            return 0
        assert timeout is not None, "waited without a timeout for a process that does not end"
        self.clock.now += timeout
        raise subprocess.TimeoutExpired("worker", timeout)

    def terminate(self):
        self.signals.append("terminate")

    def kill(self):
        self.signals.append("kill")


def stopped(processes: list[StandInProcess], tmp_path, monkeypatch, clock: Clock, **close) -> float:
    monkeypatch.setattr(supervisor_module, "time", SimpleNamespace(monotonic=clock))
    supervisor = Supervisor(0, [], "tcp://127.0.0.1:1", lambda name: None, tmp_path, poll_s=0.01)
    with supervisor._lock:  # reported: nothing of theirs to reap (no process group, no folder)
        supervisor.workers = [WorkerProcess(slot, f"w{slot}", process, tmp_path / f"w{slot}", reported=True)
                              for slot, process in enumerate(processes)]
    supervisor.close(**close)
    return clock.now


def test_hung_workers_share_one_deadline_then_are_killed(tmp_path, monkeypatch):
    """Each worker had `timeout_s` of its own, then 10 s after SIGTERM: three hung workers held a stopping
    server 3 x (60 + 10) s past its drain."""
    clock = Clock()
    hung = [StandInProcess(clock) for _ in range(3)]
    polite = StandInProcess(clock, exits_after=4.0)
    assert stopped([*hung, polite], tmp_path, monkeypatch, clock, timeout_s=20.0, grace_s=5.0) == 25.0
    assert all(process.signals == ["terminate", "kill"] for process in hung)
    assert polite.signals == [] and polite.returncode == 0


def test_a_worker_that_heeds_sigterm_is_not_killed(tmp_path, monkeypatch):
    clock = Clock()
    slow = StandInProcess(clock, heeds_sigterm=True)
    assert stopped([slow], tmp_path, monkeypatch, clock, timeout_s=3.0, grace_s=5.0) == 3.0
    assert slow.signals == ["terminate"]


def test_workers_not_told_to_stop_are_terminated_at_once(tmp_path, monkeypatch):
    clock = Clock()
    told, untold = StandInProcess(clock, exits_after=2.0), StandInProcess(clock, heeds_sigterm=True)
    assert stopped([told, untold], tmp_path, monkeypatch, clock, timeout_s=30.0, grace_s=5.0,
                   stopping={"w0"}) == 2.0
    assert told.signals == [] and untold.signals == ["terminate"]


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.floats(0, 400, allow_nan=False), max_size=30), max_restarts=st.integers(1, 5),
       window_s=st.floats(1, 1000, allow_nan=False))
def test_replacements_are_limited_per_window_not_per_life(gaps, max_restarts, window_s):
    """Allowed replacements never exceed `max_restarts` within any window, and an exit is refused only
    when the window before it already holds that many."""
    clock = Clock()
    budget = RestartBudget(max_restarts, window_s, clock)
    allowed = []
    for gap in gaps:
        clock.now += gap
        recent = [t for t in allowed if clock.now - t < window_s]
        assert budget.would_allow(0) == (len(recent) < max_restarts)  # asking counts nothing
        if budget.allow(0):
            assert len(recent) < max_restarts
            allowed.append(clock.now)
        else:
            assert len(recent) == max_restarts
    assert budget.allow(1)  # slots count apart


def test_a_worker_killed_now_and_then_is_always_replaced():
    clock = Clock()
    budget = RestartBudget(5, 600.0, clock)
    for _ in range(50):
        clock.now += 601.0
        assert budget.allow(0)


def test_a_hung_worker_not_told_to_stop_gets_the_grace_only(tmp_path, monkeypatch):
    """A stopped worker the router no longer counted (not told to drain) held a stopping server for the
    whole drain, then the grace: 67 s with --drain-s 60."""
    clock = Clock()
    told, hung = StandInProcess(clock, exits_after=2.0), StandInProcess(clock)
    assert stopped([told, hung], tmp_path, monkeypatch, clock, timeout_s=60.0, grace_s=5.0,
                   stopping={"w0"}) == 2.0 + 5.0
    assert told.signals == [] and hung.signals == ["terminate", "kill"]


def test_a_worker_presumed_dead_is_killed_and_replaced(tmp_path, monkeypatch):
    """The router stopped hearing from w0 (SIGSTOPped, here a sleeper that never answers): the supervisor
    kills it, reports its exit, and starts w0.1 in its slot. A name it does not run is ignored."""
    def sleeper(self, slot, name, restarts):
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        return WorkerProcess(slot, name, process, tmp_path / name, restarts)
    monkeypatch.setattr(Supervisor, "_spawn", sleeper)
    exited = threading.Event()
    names = []

    def on_exit(name):
        names.append(name)
        exited.set()
    supervisor = Supervisor(1, [], "tcp://127.0.0.1:1", on_exit, tmp_path, poll_s=0.01)
    try:
        first = supervisor.workers[0].process
        supervisor.presumed_dead("w7")  # not one of its workers
        supervisor.presumed_dead("w0")
        assert exited.wait(30) and names == ["w0"]
        assert first.wait(10) == -signal.SIGKILL
        with supervisor._lock:  # the replacement is made under the lock the exit was handled under
            assert [worker.name for worker in supervisor.workers] == ["w0.1"]
    finally:
        supervisor.close(timeout_s=0, grace_s=5)


def test_a_slot_in_a_crash_loop_is_started_again_once_its_window_allows(tmp_path, monkeypatch):
    """Workers that exit at once: two replacements in the window, then the slot waits (it had stayed
    empty until the server restarted), and gets the next replacement once the first of the two is a
    window old."""
    window_s = 1.0
    started: dict[str, float] = {}
    again = threading.Event()

    def crasher(self, slot, name, restarts):
        started[name] = time.monotonic()
        if name == "w0.3":
            again.set()
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
        return WorkerProcess(slot, name, process, tmp_path / name, restarts)
    monkeypatch.setattr(Supervisor, "_spawn", crasher)
    supervisor = Supervisor(1, [], "tcp://127.0.0.1:1", lambda name: None, tmp_path, poll_s=0.01, max_restarts=2,
                            restart_window_s=window_s)
    try:
        assert again.wait(60), f"the slot was not started again: {sorted(started)}"
    finally:
        supervisor.close(timeout_s=1.0, grace_s=1.0)
    assert started["w0.3"] - started["w0.1"] >= window_s  # not before the budget allowed it
    assert supervisor.exits >= 3
