"""Waiting for a condition in tests, with a message that says what was awaited."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 10.0, what: str = "condition", interval: float = 0.05):
    """Poll ``predicate`` until it returns something true; return that value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not reached in {timeout} s")
