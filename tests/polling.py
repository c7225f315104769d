"""Waiting for state the way the tests may: poll a condition until a deadline, never a fixed sleep."""

from __future__ import annotations

import socket
import time


def lines_until(stream, marker: str) -> list[str]:
    """The lines a child process writes to `stream` up to the first that holds `marker` (that one last), or
    up to EOF if it exits first: the caller asserts on the last line."""
    said = []
    for line in stream:
        said.append(line)
        if marker in line:
            break
    return said


def until(predicate, timeout_s: float) -> bool:
    """Whether `predicate()` came to hold within `timeout_s` seconds (polled)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_for(predicate, what: str, timeout_s: float) -> None:
    """Return once `predicate()` holds; fail naming `what` after `timeout_s` seconds."""
    if not until(predicate, timeout_s):
        raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def free_port() -> int:
    """A TCP port on loopback nothing listens at now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
