"""A migration's rehome in this guest: the host's new identity applied,
the fabric NIC re-addressed (when the host assigns its address), every
registered driver asked to resume with its ticket.

Each migration id has one ``Rehome``, a state machine::

    RECEIVED --READDRESS--> READDRESSING --NIC_DONE/NIC_FAILED--> RESUMING --ALL_RESUMED--> SUCCEEDED
        \\------------------------RESUME--------------------------^      \\--NOT_ALL_RESUMED--> INCOMPLETE
    INCOMPLETE --READDRESS/RESUME--> (again: only what failed)

A failed NIC still resumes the drivers (they may reach the pool anyway);
the rehome is then INCOMPLETE.  Delivered again (the host reconnected,
reconciled, or fell back to guest-exec), a SUCCEEDED rehome gets the same
answer (``DELIVERED_AGAIN``, a repeat); an INCOMPLETE one is tried again,
for what failed only (the network if it failed, the sessions that did not
resume, with the tickets the new delivery brings), and keeps the outcomes
that were good.  A rehome's lock serialises the deliveries of one
migration (the channel and guest-exec may race, hostd retries).

Drivers resume a window at a time (``ResumeWindow``): a guest's resumes all
come from its one address, and the pool admits only a few connections per
address before they authenticate (32 by default); a thousand at once would
be refused, and retried, by the hundred.  Every outcome that is not a
driver's own answer is an error of ``accelmig.wire.errors``.

Nothing is written (the log's lines, the identity's file) until the
drivers have answered: right after a move under TCG every kernel path a
write takes (the console's tty and serial driver, the file system's) is
translated anew, and on a guest of one vCPU a write made while they resume
still lies on the blackout's path (docs/DESIGN.md).
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time

from accelmig.agent.daemon.drivers import DriverAsk
from accelmig.runtime.statemachine import StateMachine
from accelmig.wire import channel as ch
from accelmig.wire.errors import AccelmigError, BadRequest, InternalError, LimitExceeded, SessionNotHere, Timeout
from accelmig.wire.identity import HostIdentity
from accelmig.wire.values import is_number

# the agent's logger, as before the split: operators' filters keep working
LOG = logging.getLogger("accelmig.agent.daemon.agent")


class RehomeState(enum.Enum):
    RECEIVED = "received"           # delivered, not begun
    READDRESSING = "readdressing"   # the fabric NIC takes the new host's address
    RESUMING = "resuming"           # the drivers are asked to resume
    SUCCEEDED = "succeeded"         # the network and every session: the answer stays
    INCOMPLETE = "incomplete"       # something failed: a delivery again retries it


class RehomeEvent(enum.Enum):
    READDRESS = "readdress"             # begin (or retry) with the NIC to re-address
    RESUME = "resume"                   # begin (or retry) without: no NIC, or applied already
    NIC_DONE = "nic_done"
    NIC_FAILED = "nic_failed"           # the drivers are asked anyway
    ALL_RESUMED = "all_resumed"
    NOT_ALL_RESUMED = "not_all_resumed"
    FAILED = "failed"                   # an error stopped the attempt
    DELIVERED_AGAIN = "delivered_again"


S, E = RehomeState, RehomeEvent


class Rehome(StateMachine):
    """One migration's rehome; changed only under ``lock``."""

    INITIAL = S.RECEIVED
    TABLE = {
        E.READDRESS: {S.RECEIVED: S.READDRESSING, S.INCOMPLETE: S.READDRESSING},
        E.RESUME: {S.RECEIVED: S.RESUMING, S.INCOMPLETE: S.RESUMING},
        E.NIC_DONE: {S.READDRESSING: S.RESUMING},
        E.NIC_FAILED: {S.READDRESSING: S.RESUMING},
        E.ALL_RESUMED: {S.RESUMING: S.SUCCEEDED},
        E.NOT_ALL_RESUMED: {S.RESUMING: S.INCOMPLETE},
        E.FAILED: {S.READDRESSING: S.INCOMPLETE, S.RESUMING: S.INCOMPLETE},
        E.DELIVERED_AGAIN: {},
    }
    REPEATS = {E.DELIVERED_AGAIN: frozenset({S.SUCCEEDED})}    # the same answer, nothing done
    FINAL = frozenset({S.SUCCEEDED})

    def __init__(self, migration_id: str):
        super().__init__()
        self.migration_id = migration_id
        self.lock = threading.Lock()
        self.result: dict | None = None       # the last attempt's outcome
        self.attempts = 0
        self.resumed: dict[str, dict] = {}    # sid -> its good outcome, kept across attempts
        self.network: list[str] = []          # what re-addressing the NIC changed
        self.network_done = False             # the network step succeeded (or had nothing to do)


class ResumeWindow:
    """Asks the drivers of ``targets`` ((link, sid) pairs) to resume, at
    most ``size`` at once, until ``deadline`` (monotonic): each answer (or
    failure) frees a place for the next.  ``ask(link, sid, on_done)`` sends
    one (never blocking: a link's buffer is bounded) and returns its
    ``DriverAsk``, whose settling calls ``answered``.

    Whichever thread frees a place fills the window, under the lock; a send
    that fails at once settles its ask on the filling thread itself, which
    then goes on filling (a loop, not a recursion: ``filling``)."""

    def __init__(self, targets, size: int, deadline: float, ask):
        self._targets = collections.deque(targets)
        self.size = max(1, size)
        self.deadline = deadline
        self._ask = ask
        self.asked: list[DriverAsk] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._filling = False
        self._lock = threading.RLock()
        self.settled = threading.Event()     # nothing in flight and nothing more to ask

    def start(self) -> None:
        with self._lock:
            self._fill()

    def answered(self, ask: DriverAsk) -> None:
        """``ask`` is settled (any thread): its place goes to the next one."""
        with self._lock:
            self.in_flight -= 1
            if not self._filling:
                self._fill()

    def _fill(self) -> None:
        self._filling = True
        try:
            while self._targets and self.in_flight < self.size and time.monotonic() < self.deadline:
                link, sid = self._targets.popleft()
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
                self.asked.append(self._ask(link, sid, self.answered))
        finally:
            self._filling = False
        if not self.in_flight:
            self.settled.set()

    def close(self) -> list:
        """The targets never asked; a late answer asks nobody else."""
        with self._lock:
            unasked = list(self._targets)
            self._targets.clear()
        return unasked


def failure(error: AccelmigError) -> dict:
    """A session's outcome that is no answer of its driver's."""
    return {"ok": False, "error": error.to_wire()}


def answered(outcome: dict, received: float) -> dict:
    """A rehome's outcome as its answer carries it: bounded, with the
    answer's own clock (``wire.channel``)."""
    return ch.timed_outcome(ch.bounded_outcome(outcome), received)


def _driver_connected(times) -> float | None:
    """When a driver says its new connection was up (its ``times``), if it
    says it as a number: a claim for the timeline, never used otherwise."""
    value = times.get("connected") if isinstance(times, dict) else None
    return float(value) if is_number(value) else None


class RehomeBook:
    """Every migration's rehome in this guest (the last ``KEPT``), and the
    staged tickets of a rehome too big for one line.  ``channel`` holds the
    identity (a driver's ``where`` answers it), ``registry`` the drivers."""

    KEPT = 64

    def __init__(self, registry, channel, network, stats, *, timeout: float, window: int, max_staged: int):
        self.registry, self.channel, self.network, self.stats = registry, channel, network, stats
        self.timeout, self.window, self.max_staged = timeout, window, max_staged
        self.rehomes: collections.OrderedDict[str, Rehome] = collections.OrderedDict()
        # The tickets of a rehome too big for one line come first, in pieces
        # (``tickets``): staged here for that one migration id (a piece of
        # another migration drops them), at most ``max_staged`` of them.
        self._staged: tuple[str, dict[str, str]] | None = None
        self._lock = threading.Lock()

    # -- staged tickets ---------------------------------------------------------------------
    def stage_tickets(self, message: dict) -> dict:
        """A piece of the tickets of a rehome too big for one line: kept for
        the ``rehome`` of the same migration id that follows."""
        migration_id, tickets = ch.parse_tickets(message)
        with self._lock:
            staged = self._staged[1] if self._staged and self._staged[0] == migration_id else {}
            if len(staged) + len(tickets) > self.max_staged:
                self._staged = None
                raise LimitExceeded(f"tickets of rehome {migration_id}: more than {self.max_staged}, "
                                    f"the most sessions this agent keeps")
            staged.update(tickets)
            self._staged = (migration_id, staged)
            return {"migration_id": migration_id, "staged": len(staged)}

    def staged(self, migration_id: str) -> dict[str, str]:
        """The tickets staged for ``migration_id`` (a copy)."""
        with self._lock:
            return dict(self._staged[1]) if self._staged and self._staged[0] == migration_id else {}

    def _all_tickets(self, migration_id: str, tickets: dict, count: int | None) -> dict:
        """The rehome's tickets: its own, and the pieces staged before it
        when it says it has ``count`` in all; BadRequest when they do not
        add up (a piece lost: the host sends them all again)."""
        if count is None:
            return tickets
        with self._lock:
            staged = self._staged[1] if self._staged and self._staged[0] == migration_id else {}
            self._staged = None
        merged = dict(staged, **tickets)
        if len(merged) != count:
            raise BadRequest(reason=f"rehome {migration_id}: {count} tickets announced, {len(merged)} "
                                    f"arrived (a piece was lost: send them all again)")
        return merged

    # -- the rehome -------------------------------------------------------------------------
    def rehome(self, message: dict, received: float | None = None) -> dict:
        """Apply a rehome and return its outcome (every session's: the
        answers bound it, ``ch.bounded_outcome``); see the module's docstring."""
        migration_id, identity, tickets = ch.parse_rehome(message)
        tickets = self._all_tickets(migration_id, tickets, ch.parse_rehome_count(message))
        with self._lock:
            entry = self.rehomes.get(migration_id)
            if entry is None:
                entry = self.rehomes[migration_id] = Rehome(migration_id)
                while len(self.rehomes) > self.KEPT:
                    self.rehomes.popitem(last=False)
        if not entry.lock.acquire(timeout=self.timeout + 10):
            raise Timeout(what=f"rehome {migration_id} (still running)", timeout=self.timeout)
        try:
            if entry.state is S.SUCCEEDED:
                entry.fire(E.DELIVERED_AGAIN)
                self.stats["rehome_repeated"] += 1
                return entry.result
            if entry.state is S.INCOMPLETE:
                self.stats["rehome_retried"] += 1
            entry.attempts += 1
            self._attempt(entry, identity, tickets, time.time() if received is None else received)
            entry.result["attempts"] = entry.attempts
            return entry.result
        finally:
            entry.lock.release()

    def _attempt(self, entry: Rehome, identity: HostIdentity, tickets: dict, received: float) -> None:
        started = time.monotonic()
        times = {"agent_received": received}
        retry = entry.state is S.INCOMPLETE
        said = [("rehome %s%s: host %s, pool at %s, %d ticket(s)", entry.migration_id,
                 f" (attempt {entry.attempts}, {len(entry.resumed)} session(s) already resumed)" if retry else "",
                 identity.host_id, identity.pool_endpoint, len(tickets))]
        network_error = None
        readdress = identity.guest_nic is not None and not entry.network_done
        entry.fire(E.READDRESS if readdress else E.RESUME)
        try:
            if readdress:
                try:
                    entry.network = self.network.apply(identity.guest_nic)
                    times["nic_readdressed"] = time.time()
                    said.append(("rehome %s: network: %s", entry.migration_id, "; ".join(entry.network) or "unchanged"))
                    entry.network_done = True
                    entry.fire(E.NIC_DONE)
                except AccelmigError as exc:
                    network_error = exc.to_wire()
                    for line in said:
                        LOG.info(*line)
                    said.clear()
                    LOG.error("rehome %s: guest network not applied: %s", entry.migration_id, exc)
                    entry.network = []
                    entry.fire(E.NIC_FAILED)
            elif not entry.network_done:        # no NIC to change: nothing to do again either
                entry.network, entry.network_done = [], True
            network_s = time.monotonic() - started
            self.channel.identity = identity    # (the drivers' ``where`` answers it from now on; the file below)
            sessions = self._resume(entry, identity, tickets, times)
        except Exception as exc:
            error = exc if isinstance(exc, AccelmigError) else InternalError(reason=f"{type(exc).__name__}: {exc}")
            entry.result = {"migration_id": entry.migration_id, "ok": False, "error": error.to_wire(),
                            "sessions": dict((entry.result or {}).get("sessions") or {}), "network": []}
            entry.fire(E.FAILED)
            if not isinstance(exc, AccelmigError):
                raise
            return
        # the drivers have answered (the pool has their resumes): what waited is written now
        for line in said:
            LOG.info(*line)
        self.channel.store_identity(identity)
        entry.resumed = {sid: outcome for sid, outcome in sessions.items() if outcome["ok"]}
        ok = network_error is None and len(entry.resumed) == len(sessions)
        entry.result = {"migration_id": entry.migration_id, "ok": ok, "host_id": identity.host_id,
                        "network": list(entry.network), "network_error": network_error,
                        "network_seconds": round(network_s, 6), "sessions": sessions, "times": times,
                        "seconds": round(time.monotonic() - started, 6)}
        entry.fire(E.ALL_RESUMED if ok else E.NOT_ALL_RESUMED)
        LOG.info("rehome %s done in %.1f ms: %d/%d session(s) resumed", entry.migration_id,
                 entry.result["seconds"] * 1000, len(entry.resumed), len(sessions))

    def _resume(self, entry: Rehome, identity: HostIdentity, tickets: dict, times: dict) -> dict:
        """Every registered session that has not resumed yet asked to, a
        window at a time, until the rehome's time is up: each one's outcome."""
        def ask(link, sid, on_done) -> DriverAsk:
            return self.registry.ask(link, {"type": "resume", "sid": sid, "endpoint": identity.pool_endpoint,
                                            "ticket": tickets.get(sid), "migration_id": entry.migration_id},
                                     on_done)

        deadline = time.monotonic() + self.timeout
        window = ResumeWindow(self.registry.targets(skip=entry.resumed), self.window, deadline, ask)
        window.start()
        window.settled.wait(max(0.0, deadline - time.monotonic()))
        unasked = window.close()
        sessions = dict(entry.resumed)
        for asked in window.asked:
            sessions[asked.sid] = self._outcome(asked, times)
        for _link, sid in unasked:          # never asked: the rehome's time ran out first
            sessions[sid] = failure(Timeout(what="asking every driver to resume", timeout=self.timeout))
        for sid in tickets:
            sessions.setdefault(sid, failure(SessionNotHere(sid=sid)))
        return sessions

    def _outcome(self, ask: DriverAsk, times: dict) -> dict:
        if not ask.answered:
            return failure(Timeout(what="the driver's resume", timeout=self.timeout))
        reply = ask.reply
        outcome = {"ok": bool(reply["ok"]), "seconds": round(ask.done - ask.sent, 6)}
        if reply["ok"]:
            outcome.update(reply["result"])
            outcome["ok"] = True        # the driver's result does not say otherwise
            connected = _driver_connected(outcome.pop("times", None))
            if connected is not None:
                times["driver_connected"] = min(connected, times.get("driver_connected", connected))
        else:
            outcome["error"] = reply["error"]
        return outcome
