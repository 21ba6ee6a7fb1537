"""Capped, jittered backoff, and the log lines of something that keeps failing.

A daemon retries what failed (the pool is down, libvirt restarts), and a
warning per attempt floods the journal: hostd logged the same line every
2 s while the pool was down, 1,800 an hour.  ``FailureLog`` writes the first
failure as it is, then a "still failing (N times since ...)" summary at
backed-off intervals, and one line when it works again::

    registration = FailureLog(LOG, "pool registration")
    while True:
        try:
            register()
            registration.ok()         # "pool registration works again after ..." (once)
        except Unavailable as exc:
            registration.failed(exc)  # logged at first, then ever more rarely

Time and randomness are injected (``clock``, ``rng``) so that tests need no
sleeps.  Standard library only (the guest agent may use it).
"""

from __future__ import annotations

import logging
import random
import time


class Backoff:
    """Delays ``first``, ``first * factor``, ... up to ``cap``, each shortened
    by a random share of up to ``jitter`` (so that many hosts retrying one
    pool do not retry in step); ``reset()`` after a success."""

    def __init__(self, first: float, cap: float, *, factor: float = 2.0, jitter: float = 0.2,
                 rng=random.random):
        if not 0 < first <= cap or factor < 1 or not 0 <= jitter < 1:
            raise ValueError("backoff needs 0 < first <= cap, factor >= 1, 0 <= jitter < 1")
        self.first, self.cap, self.factor, self.jitter = first, cap, factor, jitter
        self.rng = rng
        self.attempts = 0

    def next(self) -> float:
        """The delay before the next attempt (and count this one)."""
        base = min(self.cap, self.first * self.factor ** min(self.attempts, 64))
        self.attempts += 1
        return base * (1 - self.jitter * self.rng())

    def reset(self) -> None:
        self.attempts = 0


class FailureLog:
    """The log lines of one thing that fails repeatedly (``what``).

    - the first failure is logged at ``level`` with its reason;
    - later failures with the same reason are counted, and summarised as
      "WHAT still failing (N times since TIME): REASON" once the current
      interval is over; the intervals back off from ``first`` to ``cap``
      seconds (jittered);
    - a failure with another reason is logged at once (it is news) and
      the intervals start again;
    - ``ok()`` after failures logs "WHAT works again after N failure(s)
      in S s" once, at INFO.
    """

    def __init__(self, logger: logging.Logger, what: str, *, level: int = logging.WARNING,
                 first: float = 30.0, cap: float = 900.0, jitter: float = 0.2,
                 clock=time.time, rng=random.random):
        self.logger, self.what, self.level = logger, what, level
        self.clock = clock
        self.backoff = Backoff(first, cap, jitter=jitter, rng=rng)
        self.failures = 0           # since the last success
        self.since: float | None = None
        self._reason: str | None = None
        self._next_line = 0.0

    @property
    def failing(self) -> bool:
        return self.failures > 0

    def failed(self, reason) -> bool:
        """Count one failure; whether a line was logged for it."""
        now = self.clock()
        reason = str(reason)
        self.failures += 1
        if self.since is None:
            self.since = now
        if reason != self._reason:
            first = self._reason is None
            self._reason = reason
            self.backoff.reset()
            self._log(now, (f"{self.what}: {reason}" if first else
                            f"{self.what}: {reason} (failing since {_at(self.since)})"))
            return True
        if now < self._next_line:
            return False
        self._log(now, f"{self.what} still failing ({self.failures} times since "
                       f"{_at(self.since)}): {reason}")
        return True

    def _log(self, now: float, message: str) -> None:
        self.logger.log(self.level, "%s", message, extra={"failures": self.failures})
        self._next_line = now + self.backoff.next()

    def ok(self) -> bool:
        """It worked; whether a recovery line was logged (only after failures)."""
        if not self.failures:
            return False
        now = self.clock()
        self.logger.info("%s works again after %d failure(s) in %.0f s", self.what, self.failures,
                         now - self.since, extra={"failures": self.failures})
        self.failures, self.since, self._reason = 0, None, None
        self.backoff.reset()
        self._next_line = 0.0
        return True


def _at(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when))
