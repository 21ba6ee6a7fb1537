"""Waiting for a condition in tests, with a message that says what was awaited.

The one polling loop of the test suite: tests wait with ``wait_for`` (or on
an ``Event`` the code under test sets), never with a loop of their own or a
bare ``time.sleep``."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 10.0, what: str = "condition", interval: float = 0.05, *,
             errors: tuple = (), explain=None):
    """Poll ``predicate`` until it returns something true; return that value.
    Raise ``AssertionError`` naming ``what`` (and the last value seen) if it
    is still false after ``timeout`` seconds.  ``errors``: exception types
    that count as "not yet" (a guest agent not up yet), the last one named in
    the message; ``explain``: a callable whose text ends the message (logs,
    consoles: what a failure needs to be understood)."""
    deadline = time.monotonic() + timeout
    value = None
    while True:
        try:
            value = predicate()
        except errors as exc:
            value = exc
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout} s waiting for {what} (last value: {value!r})"
            raise AssertionError(message + (f"\n{explain()}" if explain is not None else ""))
        time.sleep(interval)
