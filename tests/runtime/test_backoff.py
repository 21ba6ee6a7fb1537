"""Capped, jittered backoff and the log lines of a repeated failure, on an
injected clock (no sleeps)."""

from __future__ import annotations

import logging

import pytest

from accelmig.runtime.backoff import Backoff, FailureLog


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_jitter_only_shortens():
    assert [Backoff(2, 30, rng=lambda: 0.0).next() for _ in range(1)] == [2]
    plain = Backoff(2, 30, rng=lambda: 0.0)
    assert [plain.next() for _ in range(6)] == [2, 4, 8, 16, 30, 30]
    jittered = Backoff(2, 30, jitter=0.5, rng=lambda: 1.0)
    assert [jittered.next() for _ in range(6)] == [1, 2, 4, 8, 15, 15]
    plain.reset()
    assert plain.next() == 2
    with pytest.raises(ValueError):
        Backoff(10, 5)


def test_a_failure_every_2_s_for_an_hour_is_a_handful_of_lines(caplog):
    clock = Clock()
    log = FailureLog(logging.getLogger("test.backoff"), "pool registration", first=30, cap=900,
                     clock=clock, rng=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="test.backoff")
    logged = []
    for _ in range(1800):                       # what hostd did: one attempt every 2 s, for an hour
        logged.append(log.failed("the pool's control plane is unavailable: connection refused"))
        clock.now += 2
    lines = [r.getMessage() for r in caplog.records]
    # the first, then after 30, 60, 120, 240, 480, 900, 900 s ...: 3600 s hold 8 lines
    assert len(lines) == sum(logged) == 8, lines
    assert lines[0] == "pool registration: the pool's control plane is unavailable: connection refused"
    assert lines[1].startswith("pool registration still failing (16 times since ")
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert log.failures == 1800
    caplog.clear()
    clock.now += 2
    assert log.ok() is True
    [recovered] = caplog.records
    assert recovered.levelno == logging.INFO
    assert recovered.getMessage() == "pool registration works again after 1800 failure(s) in 3602 s"
    assert log.ok() is False                    # once, not at every later success
    caplog.clear()
    assert log.failed("connection refused") is True       # a new run of failures starts afresh
    assert caplog.records[0].getMessage() == "pool registration: connection refused"


def test_a_new_reason_is_logged_at_once(caplog):
    clock = Clock()
    log = FailureLog(logging.getLogger("test.backoff"), "registration", first=30, clock=clock,
                     rng=lambda: 0.0)
    caplog.set_level(logging.INFO, logger="test.backoff")
    assert log.failed("connection refused") is True
    clock.now += 2
    assert log.failed("connection refused") is False
    clock.now += 2
    assert log.failed("AUTH_FAILED: request MAC does not verify") is True
    assert "registration: AUTH_FAILED: request MAC does not verify (failing since " \
        in caplog.records[-1].getMessage()
    clock.now += 2
    assert log.failed("AUTH_FAILED: request MAC does not verify") is False


def test_the_intervals_are_jittered():
    clock = Clock()
    lines = []

    class Sink(logging.Handler):
        def emit(self, record):
            lines.append(clock.now)

    logger = logging.getLogger("test.backoff.jitter")
    logger.propagate = False
    logger.addHandler(Sink())
    try:
        log = FailureLog(logger, "x", first=100, cap=100, jitter=0.5, clock=clock, rng=lambda: 1.0)
        for _ in range(300):
            log.failed("same")
            clock.now += 1
    finally:
        logger.handlers.clear()
        logger.propagate = True
    gaps = {b - a for a, b in zip(lines, lines[1:])}
    assert gaps == {50}                         # 100 s shortened by the full jitter share
