"""Keeping the server's process tree tidy: children die with their parent, and what a server started
can be found (and reaped) even after it was orphaned.

    die_with_parent(parent_pid)            # first thing in a worker or helper process
    serve_processes(serve_id)              # pids of every live process a server started
    remove_stale_run_dirs()                # run folders of servers that were killed outright

Three layers, because each misses a case the others catch:
- the parent-death signal (Linux prctl) kills a helper the moment its worker dies, however it dies;
- every worker leads its own process group, so the supervisor can kill a dead worker's whole group;
- every process a server starts carries RETOUCH_SERVE_ID in its environment, so tests and
  `retouch bench soak` can find leftovers that were re-parented to init.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVE_ID_ENV = "RETOUCH_SERVE_ID"
WORKER_MODULE, HELPER_MODULE = "retouch.engine.node", "retouch.engine.processing"
PROC = Path("/proc")
PARENT_PID_ENV = "RETOUCH_PARENT_PID"
RUN_DIR_PREFIX = "retouch-serve-"
HELPERS_DIR_PREFIX = "retouch-helpers-"  # a worker's helpers' sockets, where no server's run folder holds them
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `signum` to this process when its parent exits; exit now if the parent
    (`parent_pid`, default $RETOUCH_PARENT_PID) is already gone. A no-op off Linux.

    The signal follows the parent *thread* that forked us: parents must start their children from a
    thread that lives as long as they want the children to (the supervisor and the helper pool do)."""
    if parent_pid is None:
        value = os.environ.get(PARENT_PID_ENV)
        parent_pid = int(value) if value else None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before the prctl took hold
        os._exit(1)


def child_env(base: dict | None = None, serve_id: str | None = None) -> dict:
    """The environment of a child this process starts: it knows its parent (for `die_with_parent`)
    and inherits the server's id."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    env[PARENT_PID_ENV] = str(os.getpid())
    if serve_id is not None:
        env[SERVE_ID_ENV] = serve_id
    return env


def serve_processes(serve_id: str) -> list[int]:
    """Live processes (zombies excluded) whose environment names server `serve_id`."""
    return sorted(info.pid for info in processes_with_env(SERVE_ID_ENV, serve_id))


def kill_group(pgid: int, signum: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def new_run_dir() -> Path:
    """A folder for one server's sockets and its workers' helper sockets; its name carries the
    server's pid so a later server can remove it if this one is killed outright."""
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))


def remove_stale_run_dirs(root: str | None = None, prefix: str = RUN_DIR_PREFIX) -> list[Path]:
    """Remove the run folders (named `prefix` + the pid of their owner + "-") of servers, or of a worker's
    helpers (`HELPERS_DIR_PREFIX`), that no longer run (killed with SIGKILL: nobody cleaned up)."""
    removed = []
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    for path in Path(root or tempfile.gettempdir()).glob(prefix + "*"):
        match = pattern.match(path.name)
        if match is None or not path.is_dir() or _alive(int(match.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- reading /proc (Linux) ----

@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    ppid: int
    state: str  # /proc/PID/stat's: R, S, D, Z (zombie), ...
    start_ticks: int  # since boot; with the pid it names one process across pid reuse
    cmdline: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start_ticks

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")

    @property
    def role(self) -> str | None:
        """"worker" or "helper" when it runs one of the server's modules, else None."""
        if WORKER_MODULE in self.cmdline:
            return "worker"
        if HELPER_MODULE in self.cmdline:
            return "helper"
        return None


def parse_stat(text: str) -> tuple[str, int, int]:
    """(state, ppid, start_ticks) of a /proc/PID/stat line. The command name, in parentheses, may hold
    spaces and parentheses itself: the fields are counted from the last ')'."""
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def parse_rss(status_text: str) -> int:
    """Resident bytes from /proc/PID/status (`VmRSS:  1234 kB`); 0 where absent (a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def parse_environ(data: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated NAME=value entries."""
    pairs = (entry.split(b"=", 1) for entry in data.split(b"\0") if b"=" in entry)
    return {name.decode(errors="replace"): value.decode(errors="replace") for name, value in pairs}


def read_process(pid: int, proc: Path = PROC) -> ProcessInfo | None:
    """None when it is gone, or not ours to read."""
    try:
        state, ppid, start = parse_stat((proc / str(pid) / "stat").read_text())
        cmdline = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    return ProcessInfo(pid, ppid, state, start, tuple(part.decode(errors="replace") for part in cmdline if part))


def scan_processes(proc: Path = PROC) -> dict[int, ProcessInfo]:
    table = {}
    for entry in proc.iterdir():
        if entry.name.isdigit() and (info := read_process(int(entry.name), proc)) is not None:
            table[info.pid] = info
    return table


def descendants(table: dict[int, ProcessInfo], pid: int) -> list[ProcessInfo]:
    """Every process below `pid` in `table`'s tree, parents before children."""
    children: dict[int, list[ProcessInfo]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info)
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += [info.pid for info in below]
    return found


def rss_bytes(pid: int, proc: Path = PROC) -> int:
    try:
        return parse_rss((proc / str(pid) / "status").read_text())
    except OSError:
        return 0


def open_fds(pid: int, proc: Path = PROC) -> int | None:
    try:
        return len(os.listdir(proc / str(pid) / "fd"))
    except OSError:
        return None


def processes_with_env(name: str, value: str, proc: Path = PROC) -> list[ProcessInfo]:
    """Live processes (zombies excluded) whose environment has name=value."""
    found = []
    for info in scan_processes(proc).values():
        try:
            environ = parse_environ((proc / str(info.pid) / "environ").read_bytes())
        except OSError:
            continue
        if environ.get(name) == value and info.alive:
            found.append(info)
    return found
