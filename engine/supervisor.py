"""Worker processes on this host: start them, notice when one exits, start a replacement, and leave
nothing behind.

The router learns of an exit at once (`on_exit`), so the dead worker's requests are routed again
without waiting for its heartbeats to stop. Replacements get a fresh name (w0, then w0.1, ...) so
nothing addressed to the old process can reach the new one.

Each worker leads its own process group (its helper processes join it) and has a folder of its own
under the server's run folder (its helpers' sockets). When a worker exits, however it exits, the
supervisor kills what is left of its group, reaps it and removes its folder (`engine.process_tree`).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from retouch.engine.process_tree import child_env, kill_group

logger = logging.getLogger("retouch.supervisor")


@dataclass
class WorkerProcess:
    slot: int
    name: str
    process: subprocess.Popen
    run_dir: Path
    restarts: int = 0
    reported: bool = False  # its exit was handled
    given_up: bool = False  # exited in a crash loop: replaced once the restart budget allows again


class RestartBudget:
    """At most `max_restarts` replacements per worker slot within any `window_s`, as systemd's start limit
    counts them: a worker killed now and then over weeks is always replaced, where a count over the
    server's life had left a slot empty after its sixth exit. A crash loop pauses there, and its slot gets
    a replacement again once the window allows one (a GPU slot left empty for good by a passing fault, a
    full disk or a driver reset, was capacity lost until the server restarted): a slot that can never
    start costs a start every window_s / max_restarts seconds, as Kubernetes' back-off retries forever."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._times: dict[int, deque[float]] = {}

    def would_allow(self, slot: int) -> bool:
        """Whether slot `slot` may get a replacement now (nothing counted)."""
        now = self.clock()
        times = self._times.setdefault(slot, deque())
        while times and now - times[0] >= self.window_s:
            times.popleft()
        return len(times) < self.max_restarts

    def allow(self, slot: int) -> bool:
        """Whether slot `slot` may get a replacement now (counted when it may)."""
        if not self.would_allow(slot):
            return False
        self._times[slot].append(self.clock())
        return True


class Supervisor:
    def __init__(self, count: int, node_args: Sequence[str], router_address: str,
                 on_exit: Callable[[str], None], run_dir: Path, restart: bool = True, max_restarts: int = 5,
                 poll_s: float = 0.2, env: dict | None = None, gpus: bool = False, serve_id: str | None = None,
                 extra_env: dict | None = None, cache_disk_dir: Path | None = None, restart_window_s: float = 600.0):
        """`node_args`: the arguments of `python -m retouch.engine.node` other than --router/--name;
        with `gpus`, worker i sees only GPU i (CUDA_VISIBLE_DEVICES). `run_dir`: the server's folder;
        worker `name` gets `run_dir/name`. `extra_env`: for the workers only (their CURVE keys).
        `cache_disk_dir`: worker i's disk tier is its subfolder `w{i}`, which its replacements reuse."""
        self.node_args = list(node_args)
        self.cache_disk_dir = cache_disk_dir
        self.router_address = router_address
        self.on_exit = on_exit
        self.run_dir = Path(run_dir)
        self.restart = restart
        self.restarts = RestartBudget(max_restarts, restart_window_s)
        self.poll_s = poll_s
        self.env = dict(child_env(env, serve_id), **(extra_env or {}))
        self.gpus = gpus
        self.exits = 0  # worker processes that ended while the server ran
        self._closing = threading.Event()  # no more replacements
        self._presumed_dead: deque[str] = deque()  # names the router stopped hearing from (`presumed_dead`)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.workers: list[WorkerProcess] = []
        # Workers are started from the watcher thread only: their parent-death signal follows the
        # thread that forked them, and this one lives until every worker has exited.
        self._started = threading.Event()
        self._count = count
        self._thread = threading.Thread(target=self._watch, name="retouch-supervisor", daemon=True)
        self._thread.start()
        self._started.wait()

    def _spawn(self, slot: int, name: str, restarts: int) -> WorkerProcess:
        run_dir = self.run_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "retouch.engine.node", *self.node_args,
                   "--connect", self.router_address, "--name", name, "--run-dir", str(run_dir), "--supervised"]
        if self.cache_disk_dir is not None:
            command += ["--cache-disk-dir", str(Path(self.cache_disk_dir) / f"w{slot}")]
        env = dict(self.env, CUDA_VISIBLE_DEVICES=str(slot)) if self.gpus else self.env
        # A process group of its own: the worker and its helpers, killed together if the worker dies.
        process = subprocess.Popen(command, env=env, start_new_session=True)
        return WorkerProcess(slot, name, process, run_dir, restarts)

    def presumed_dead(self, name: str) -> None:
        """The router stopped hearing from worker `name` (stopped, hung, cut off) and sent its edits elsewhere:
        its process is killed, and so replaced as one that exited; alive, it would hold its slot (its GPU,
        its disk folder) for good. Quick and lock-free: the router calls it holding its own lock."""
        self._presumed_dead.append(name)

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {w.name: w.process.pid for w in self.workers if w.process.poll() is None}

    def _watch(self) -> None:
        with self._lock:
            self.workers = [self._spawn(slot, f"w{slot}", 0) for slot in range(self._count)]
        self._started.set()
        while not self._stop.wait(self.poll_s):
            with self._lock:
                self._kill_presumed_dead()
                for index, worker in enumerate(self.workers):
                    if worker.given_up and not self._closing.is_set() and self.restarts.allow(worker.slot):
                        logger.warning(f"worker slot {worker.slot}: starting a replacement again after its crash "
                                       "loop")
                        self._replace(index, worker)
                        continue
                    if worker.reported or worker.process.poll() is None:
                        continue
                    self._reap(worker)
                    if self._closing.is_set():
                        continue
                    self.exits += 1
                    self.on_exit(worker.name)
                    if not self.restart:
                        logger.warning(f"worker {worker.name} exited with {worker.process.returncode}")
                    elif self.restarts.allow(worker.slot):
                        logger.warning(f"worker {worker.name} exited with {worker.process.returncode}; starting "
                                       "a replacement")
                        self._replace(index, worker)
                    else:
                        worker.given_up = True
                        logger.error(f"worker {worker.name} exited with {worker.process.returncode}; not replaced "
                                     f"yet: {self.restarts.max_restarts} replacements of slot {worker.slot} in the "
                                     f"last {self.restarts.window_s:g} s (a crash loop; see its log above); one "
                                     "starts when the oldest of them is that old")

    def _replace(self, index: int, worker: WorkerProcess) -> None:
        """A new process in the exited `worker`'s slot, under the next name (w0, w0.1, ...)."""
        restarts = worker.restarts + 1
        self.workers[index] = self._spawn(worker.slot, f"w{worker.slot}.{restarts}", restarts)

    def _kill_presumed_dead(self) -> None:
        while self._presumed_dead:
            name = self._presumed_dead.popleft()
            for worker in self.workers:
                if worker.name == name and worker.process.poll() is None and not self._closing.is_set():
                    logger.warning(f"worker {name} stopped answering the router; killing it to start a replacement")
                    kill_group(worker.process.pid)  # its exit is seen, and handled, as any other

    def _reap(self, worker: WorkerProcess) -> None:
        """The worker has exited: kill what is left of its group (helpers), remove its folder."""
        kill_group(worker.process.pid)
        shutil.rmtree(worker.run_dir, ignore_errors=True)
        worker.reported = True

    def close(self, timeout_s: float = 60.0, stopping: set[str] | None = None, grace_s: float = 10.0) -> None:
        """Give the workers the router told to stop (`stopping`, default all) `timeout_s` from now, all
        together, to exit; stop the others at once; terminate what is left then, and kill what is still
        there `grace_s` later (a hung or stopped process: SIGTERM waits for it); then make sure their
        helpers and folders are gone. Waiting per worker had made it minutes past a drain; waiting the drain
        for a worker not told to stop (a stopped one) made it a minute."""
        self._closing.set()
        with self._lock:
            workers = list(self.workers)
        told = [worker for worker in workers if stopping is None or worker.name in stopping]
        for worker in workers:
            if worker not in told:
                worker.process.terminate()
        _wait_all(told, time.monotonic() + timeout_s, lambda process: process.terminate())
        _wait_all(workers, time.monotonic() + grace_s, lambda process: process.kill())
        for worker in workers:
            worker.process.wait()  # killed: it is gone, or about to be
        self._stop.set()
        self._thread.join()
        for worker in workers:
            if not worker.reported:
                self._reap(worker)


def _wait_all(workers: list[WorkerProcess], deadline: float, otherwise: Callable[[subprocess.Popen], None]) -> None:
    """Wait for each worker's process until `deadline` (time.monotonic); `otherwise` those still running."""
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            otherwise(worker.process)
