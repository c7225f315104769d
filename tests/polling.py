"""Waiting for state the way the tests may: poll a condition until a deadline, never a fixed sleep."""

from __future__ import annotations

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


def wait_for(predicate, what: str, timeout_s: float) -> None:
    """Return once `predicate()` holds; fail naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)
