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
from pathlib import Path

SERVE_ID_ENV = "RETOUCH_SERVE_ID"
PARENT_PID_ENV = "RETOUCH_PARENT_PID"
RUN_DIR_PREFIX = "retouch-serve-"
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
    marker = f"{SERVE_ID_ENV}={serve_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def kill_group(pgid: int, signum: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def new_run_dir() -> Path:
    """A folder for one server's sockets and its workers' helper sockets; its name carries the
    server's pid so a later server can remove it if this one is killed outright."""
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))


def remove_stale_run_dirs(root: str | None = None) -> list[Path]:
    """Remove the run folders of servers that no longer run (killed with SIGKILL: nobody cleaned up)."""
    removed = []
    pattern = re.compile(re.escape(RUN_DIR_PREFIX) + r"(\d+)-")
    for path in Path(root or tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
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
