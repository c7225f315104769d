"""Waiting for state the way the tests may: poll a condition until a deadline, never a fixed sleep."""

from __future__ import annotations

import time


def wait_for(predicate, what: str, timeout_s: float) -> None:
    """Return once `predicate()` holds; fail naming `what` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)
