"""Waiting for a condition in tests, with a message that says what was awaited.

The one polling loop of the test suite: tests wait with ``wait_for`` (or on
an ``Event`` the code under test sets), never with a loop of their own or a
bare ``time.sleep``."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 10.0, what: str = "condition", interval: float = 0.05):
    """Poll ``predicate`` until it returns something true; return that value.
    Raise ``AssertionError`` naming ``what`` (and the last value seen) if it
    is still false after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last value: {value!r})")
        time.sleep(interval)
