"""Grace periods, parked retention, ticket TTLs and record leases, on an
injected clock: nothing here sleeps.

Each test drives a real ``Pool`` (frames through its own ``DataConnection``
logic, on a fake transport) and hands it the time explicitly:
``Pool.sweep(now)``, ``Pool.connection_lost(..., now=)``,
``Pool.resume_session(..., now=)``, ``MigrationLedger.open_record(..., now=)``,
``MigrationLedger.complete_record(..., now=)`` and ``TicketBook.check(..., now)``.
The boundaries are checked on both sides, so an off-by-one (``>`` for
``>=``) or a deadline computed from the wrong base fails here.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from accelmig.pool.config import PoolConfig, TenantSpec
from accelmig.pool.session import SessionState
from accelmig.pool.state import Pool
from accelmig.wire import attestation as att
from accelmig.wire import dataplane as dp
from accelmig.wire.errors import SessionExpired, TicketInvalid
from accelmig.wire.records import RecordStateName
from tests.support.fakepool import ListConnection, NullBackend

TOKEN = "clock-token-0001"
SECRET = bytes(range(16, 32))
DOMAIN = "dom-clock"
ADDRESSES = {"hostA": "10.0.1.5", "hostB": "10.0.2.5"}
T0 = 1_000_000.0          # the injected clock starts here (far from the real one)


class Rig:
    """A pool, one session opened from hostA, and an event loop run by hand."""

    def __init__(self, **config):
        self.loop = asyncio.new_event_loop()
        self.pool = Pool(PoolConfig(admin_socket="/nonexistent/clock.sock", **config), NullBackend(),
                         {"t": TenantSpec("t", TOKEN, 1 << 30)})
        self.pool.loop = self.loop
        self.ledger = self.pool.ledger
        self.conn = ListConnection(self.pool, "hostA", ADDRESSES["hostA"], hello=True)
        self.conn._handle({"op": "open", "token": TOKEN, "secret": SECRET.hex()}, b"")
        self.sid = self.conn.frames.pop(0)["sid"]
        self.session = self.pool.sessions[self.sid]
        # what hostA's bind_sessions does with the session's proof
        challenge = self.ledger.bind_challenge("hostA")["challenge"]
        proof = att.bind_proof(SECRET, challenge=challenge, instance=self.pool.instance, host="hostA",
                               domain=DOMAIN, sid=self.sid)
        assert self.ledger.bind_sessions("hostA", DOMAIN, {self.sid: proof}, challenge,
                                         self.pool.instance)["bound"] == [self.sid]
        self.tenant = self.session.tenant

    def command(self, header):
        log = self.session.log
        self.conn._handle({"seq": log.next_seq, "epoch": self.session.epoch, **header}, b"")

        async def answered():
            deadline = time.monotonic() + 10
            while log.highest_reply < log.next_seq - 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)
        self.loop.run_until_complete(answered())
        return self.conn.frames.pop()

    def cut(self, now):
        self.conn.lost(now)

    def resume(self, host, now, ticket=None):
        conn = ListConnection(self.pool, host, ADDRESSES[host], hello=True)
        header = {"op": "resume", "sid": self.sid, "epoch": self.session.epoch,
                  "last_seen": self.session.log.highest_reply,
                  "next_seq": self.session.log.next_seq,
                  "proof": dp.ownership_proof(SECRET, conn.challenge, self.sid, self.session.epoch)}
        if ticket is not None:
            header["ticket"] = ticket
        session, replay = self.pool.resume_session(conn, header, now=now)
        conn._attach(session)
        self.conn = conn
        return replay

    def migrate(self, now, dest="hostB", mid="m1"):
        record = self.ledger.open_record(dest, DOMAIN, mid, None, None, False, now=now, vouched=True)
        return record, self.ledger.complete_record(record, now=now)

    def close(self):
        for session in list(self.pool.sessions.values()):
            self.pool._release(session, "test over")
            session.wait_released(5)
        self.loop.close()


@pytest.fixture
def make_rig():
    made = []

    def make(**config):
        made.append(Rig(**config))
        return made[-1]
    yield make
    for one in made:
        one.close()


@pytest.fixture
def rig(make_rig):
    return make_rig()


# -- sessions: grace and parked retention -------------------------------------------------
def test_grace_expiry_releases_the_session_and_its_device_memory(rig):
    """Replaces tests/continuity/test_sessions.py::test_grace_expiry_releases_device_memory
    (which waits 0.4 s of real grace)."""
    assert rig.command({"op": "alloc", "buf": 1, "size": 8 << 20})["ok"]
    assert rig.tenant.used == 8 << 20
    rig.cut(now=T0)
    assert rig.session.state is SessionState.DETACHED
    assert rig.session.deadline == T0 + rig.pool.config.grace
    rig.pool.sweep(T0 + rig.pool.config.grace - 0.001)          # not yet
    assert rig.sid in rig.pool.sessions and rig.session.live
    rig.pool.sweep(T0 + rig.pool.config.grace)                  # the deadline itself: gone
    assert rig.sid not in rig.pool.sessions
    rig.session.wait_released(5)
    assert rig.tenant.used == 0
    with pytest.raises(SessionExpired, match="expired and its device memory was released"):
        rig.resume("hostA", now=T0 + rig.pool.config.grace + 1)


def test_a_resume_within_grace_keeps_the_session_and_clears_the_deadline(rig):
    rig.cut(now=T0)
    rig.resume("hostA", now=T0 + rig.pool.config.grace - 1)
    assert rig.session.state is SessionState.ATTACHED and rig.session.deadline is None
    rig.pool.sweep(T0 + 10 * rig.pool.config.grace)             # attached: never expires
    assert rig.sid in rig.pool.sessions


def test_parked_sessions_outlive_the_grace_period_then_expire_after_retention(make_rig):
    """Replaces tests/continuity/test_sessions.py::test_parked_sessions_outlive_the_grace_period
    (which waits 1 s of real time past a 0.3 s grace)."""
    rig = make_rig(grace=30.0)
    rig.session.park(T0, 3600.0)                  # what the host's park does, domain saved
    rig.cut(now=T0 + 1)
    assert rig.session.state is SessionState.PARKED
    rig.pool.sweep(T0 + 1 + 30.0 + 1)              # well past the grace period
    assert rig.pool.sessions[rig.sid].state is SessionState.PARKED
    rig.pool.sweep(T0 + 1 + 3600.0 - 0.001)
    assert rig.sid in rig.pool.sessions
    rig.pool.sweep(T0 + 1 + 3600.0)                # retention over
    assert rig.sid not in rig.pool.sessions
    assert rig.pool.tombstones[rig.sid] == "expired"


def test_unpark_gives_back_an_ordinary_grace_period_from_the_unpark(make_rig):
    rig = make_rig(grace=30.0)
    rig.session.park(T0, 3600.0)
    rig.cut(now=T0)
    rig.session.unpark(T0 + 100, rig.pool.config.grace)          # the domain was restored
    assert rig.session.state is SessionState.DETACHED
    rig.pool.sweep(T0 + 100 + 30.0 - 0.001)
    assert rig.sid in rig.pool.sessions
    rig.pool.sweep(T0 + 100 + 30.0)
    assert rig.sid not in rig.pool.sessions


# -- tickets ------------------------------------------------------------------------------
def test_ticket_expiry_and_a_fresh_ticket_from_completing_again(make_rig):
    """Replaces tests/continuity/test_tickets_and_records.py::test_ticket_expiry
    (which sleeps 0.5 s past a 0.3 s TTL)."""
    rig = make_rig(ticket_ttl=300.0)
    record, tickets = rig.migrate(now=T0)
    ticket = tickets[rig.sid]
    rig.cut(now=T0 + 1)
    late = T0 + 300.0 + 0.5
    with pytest.raises(TicketInvalid, match="ticket expired"):
        rig.resume("hostB", now=late, ticket=ticket)
    assert rig.session.bound_host == "hostA" and rig.session.epoch == 1     # nothing changed
    # the destination can mint a fresh ticket for the same migration (idempotent complete)
    again = rig.ledger.complete_record(record, now=late)[rig.sid]
    assert again != ticket
    rig.resume("hostB", now=late + 1, ticket=again)
    assert rig.session.bound_host == "hostB" and rig.session.pending_move is None
    assert rig.command({"op": "finish"})["ok"]


def test_ticket_ttl_boundary(make_rig):
    rig = make_rig(ticket_ttl=300.0)
    _, tickets = rig.migrate(now=T0)
    token = tickets[rig.sid]
    authority = rig.ledger.tickets
    claims = authority.check(token, rig.sid, "hostB", T0 + 300.0)            # the last valid instant
    assert claims["exp"] == T0 + 300.0
    with pytest.raises(TicketInvalid, match="ticket expired"):
        authority.check(token, rig.sid, "hostB", T0 + 300.0 + 0.01)
    # completing again before the expiry hands back the same live ticket, not a new one
    record = rig.ledger.records[f"{DOMAIN}/m1"]
    assert rig.ledger.complete_record(record, now=T0 + 299.0)[rig.sid] == token
    # ... after it, a new one
    assert rig.ledger.complete_record(record, now=T0 + 301.0)[rig.sid] != token


def test_ticket_use_is_stamped_with_the_injected_time(rig):
    _, tickets = rig.migrate(now=T0)
    rig.cut(now=T0 + 1)
    rig.resume("hostB", now=T0 + 2, ticket=tickets[rig.sid])
    with pytest.raises(TicketInvalid, match="already used by a resume at 1970-01-12T13:46:42.000Z"):
        rig.ledger.tickets.check(tickets[rig.sid], rig.sid, "hostB", T0 + 3)


# -- record leases --------------------------------------------------------------------------
def test_an_expired_lease_aborts_the_record(make_rig):
    """Replaces tests/continuity/test_tickets_and_records.py::test_an_expired_lease_aborts_the_record
    (which sleeps 0.8 s of renewals and 1 s unrenewed)."""
    rig = make_rig(lease_ttl=30.0)
    record = rig.ledger.open_record("hostB", DOMAIN, "m1", None, "start", False, now=T0, vouched=True)
    assert rig.session.paused                       # policy "start": paused while it is open
    for step in range(1, 5):                        # a host that renews keeps it alive
        now = T0 + step * 20.0
        rig.pool.sweep(now)
        assert record.state is RecordStateName.OPEN
        record.renew(now)
    last_renewal = T0 + 80.0
    rig.pool.sweep(last_renewal + 30.0 - 0.001)
    assert record.state is RecordStateName.OPEN
    rig.pool.sweep(last_renewal + 30.0)             # then nobody renews
    assert record.state is RecordStateName.ABORTED
    assert "lease expired" in record.abort_reason
    assert record.times["aborted"] == last_renewal + 30.0
    assert not rig.session.paused and rig.session.pending_move is None
    assert rig.command({"op": "finish"})["ok"]      # the source goes on


def test_a_lease_expiring_after_commit_completes_the_record_and_mints_tickets(make_rig):
    rig = make_rig(lease_ttl=30.0)
    record = rig.ledger.open_record("hostB", DOMAIN, "m1", None, None, True, now=T0, vouched=True)
    record.commit(T0 + 5)
    rig.pool.sweep(T0 + 30.0)                       # expired after commit: no way back
    assert record.state is RecordStateName.CLOSED
    assert record.sessions == [rig.sid]
    assert rig.session.pending_move == (DOMAIN, "m1")
    nonce = rig.ledger.tickets.held_by(rig.sid).nonce
    assert rig.ledger.tickets.live(nonce, T0 + 30.0) is not None
    # the ticket's TTL counts from the sweep that minted it
    assert rig.ledger.tickets.live(nonce, T0 + 30.0 + rig.pool.config.ticket_ttl + 1) is None


def test_final_records_are_forgotten_an_hour_after_their_last_event(rig):
    record = rig.ledger.open_record("hostB", DOMAIN, "m1", None, None, False, now=T0, vouched=True)
    rig.ledger.abort_record(record, "test", now=T0 + 1)
    rig.pool.sweep(T0 + 1 + 3600.0)
    assert record.key in rig.ledger.records
    rig.pool.sweep(T0 + 1 + 3600.0 + 0.001)
    assert record.key not in rig.ledger.records
