"""Worker processes on this host: start them, notice when one exits, start a replacement.

The router learns of an exit at once (`on_exit`), so the dead worker's requests are routed again
without waiting for its heartbeats to stop. Replacements get a fresh name (w0, then w0.1, ...) so
nothing addressed to the old process can reach the new one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class WorkerProcess:
    slot: int
    name: str
    process: subprocess.Popen
    restarts: int = 0
    reported: bool = False  # its exit was handled


class Supervisor:
    def __init__(self, count: int, node_args: Sequence[str], router_address: str,
                 on_exit: Callable[[str], None], restart: bool = True, max_restarts: int = 5,
                 poll_s: float = 0.2, env: dict | None = None, gpus: bool = False):
        """`node_args`: the arguments of `python -m retouch.engine.node` other than --router/--name;
        with `gpus`, worker i sees only GPU i (CUDA_VISIBLE_DEVICES)."""
        self.node_args = list(node_args)
        self.router_address = router_address
        self.on_exit = on_exit
        self.restart = restart
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.gpus = gpus
        self.exits = 0  # worker processes that ended while the server ran
        self.workers = [self._spawn(slot, f"w{slot}", 0) for slot in range(count)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="retouch-supervisor", daemon=True)
        self._thread.start()

    def _spawn(self, slot: int, name: str, restarts: int) -> WorkerProcess:
        command = [sys.executable, "-m", "retouch.engine.node", *self.node_args,
                   "--router", self.router_address, "--name", name]
        env = dict(self.env, CUDA_VISIBLE_DEVICES=str(slot)) if self.gpus else self.env
        return WorkerProcess(slot, name, subprocess.Popen(command, env=env), restarts)

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {w.name: w.process.pid for w in self.workers if w.process.poll() is None}

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                for index, worker in enumerate(self.workers):
                    if worker.reported or worker.process.poll() is None:
                        continue
                    if self._stop.is_set():
                        return
                    self.exits += 1
                    self.on_exit(worker.name)
                    if self.restart and worker.restarts < self.max_restarts:
                        print(f"retouch: worker {worker.name} exited with {worker.process.returncode}; "
                              "starting a replacement", file=sys.stderr)
                        restarts = worker.restarts + 1
                        self.workers[index] = self._spawn(worker.slot, f"w{worker.slot}.{restarts}", restarts)
                    else:
                        print(f"retouch: worker {worker.name} exited with {worker.process.returncode}",
                              file=sys.stderr)
                        worker.reported = True

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for the workers to exit (the router told them to stop), then make sure they have."""
        self._stop.set()
        self._thread.join()
        for worker in self.workers:
            try:
                worker.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                worker.process.terminate()
        for worker in self.workers:
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
