"""Output paths checked before any work: a run that computes for minutes must not fail at its last line."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

from retouch.errors import InputError


def check_writable(path: Path | str) -> Path:
    """`path` as a Path, once a file can be created beside it: its folder is made if missing, and a probe
    file is created there and removed (permission bits say nothing to root, nor of /proc or a read-only
    mount). InputError naming the path otherwise."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a folder")
    probe = path.parent / f".retouch-probe-{os.getpid()}"  # short: a 255-byte name must still pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    with contextlib.suppress(OSError):  # a folder that takes files but refuses removals is still writable
        probe.unlink()
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"cannot write {path}: permission denied")
    return path


def check_writable_folder(path: Path | str) -> Path:
    """`path` as a Path, once it is a folder files can be created in (made if missing; see
    `check_writable`). InputError naming the path otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"cannot use {path} as a folder: it is a file")
    probe = path / f".retouch-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as exc:
        raise InputError(f"cannot write in {path}: {exc.strerror or exc}") from None
    with contextlib.suppress(OSError):
        probe.unlink()
    return path


def open_private(path: Path) -> IO[bytes]:
    """`path` opened for writing (made, or emptied), readable by this user only: the files hold tenants' images."""
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


def write_whole(path: Path, data: bytes) -> None:
    """`data` to `path` whole or not at all (a temporary `.<name>.<pid>.tmp` renamed over it, which
    `lock_folder` removes when a kill cut a write short)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(temporary) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def lock_folder(directory: Path, taken: str | None = None) -> IO:
    """Make `directory` this process's alone (one server per folder: two would each miss the other's files
    and delete each other's), and remove what a killed one left half-written. The open lock file: closing
    it gives the folder back. InputError when another process holds it (`taken`: what it says then)."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / ".lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise InputError(taken or f"another retouch serve uses {directory.parent} (--cache-disk-dir); give each "
                         "server a folder of its own") from None
    for stale in directory.glob(".*.tmp"):
        with contextlib.suppress(OSError):  # a folder that refuses removals is still served (its files read)
            stale.unlink(missing_ok=True)
    return lock
