"""Property test of the pool's resume and sequencing rules, driving the real code.

Hypothesis plays one guest driver (and stale copies of it) against a real
``Pool``: every frame goes through the pool's own ``DataConnection._handle``
(so ``Pool.open_session``, ``Pool.resume_session``, the session's
``SequenceLog`` and its worker thread do all the deciding), migrations go
through the ledger's ``open_record`` / ``complete_record`` / ``abort_record``
(which mint and revoke the real tickets).  Only the transport is fake: a
``DataConnection`` whose outgoing frames land in a list, on an event loop
this test runs by hand, so the interleaving is the one Hypothesis chose.

What the test knows is what a driver knows: what it sent, what it was
answered, which ticket it holds.  From that alone it says what must happen:

- every command the driver issued executes exactly once, with the content
  it was issued with, however often it is re-sent (a lost answer is
  answered from the log);
- an accepted resume replays exactly the replies the driver had not seen,
  moves the epoch up by exactly one, and fences the connection it replaces
  (frames of the old epoch are refused with STALE_EPOCH);
- a resume from another host needs the ticket of a completed migration
  (TICKET_REQUIRED while one is pending, WRONG_HOST otherwise), a used or
  revoked ticket is TICKET_INVALID, a stale copy of the driver is
  SESSION_DIVERGED, and a refused resume changes nothing;
- a resume whose answer was lost may be retried (same ticket included),
  as often as the retry's answer is lost too;
- ``bound_host`` follows the tickets that were used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from accelmig.pool import session as session_module
from accelmig.pool.config import PoolConfig, TenantSpec
from accelmig.pool.dataplane import ConnState
from accelmig.pool.state import Pool
from accelmig.wire import attestation as att
from accelmig.wire import dataplane as dp
from accelmig.wire.errors import (SessionDiverged, StaleEpoch, TicketInvalid, TicketRequired,
                                  WrongHost)
from tests.support.fakepool import ListConnection, NullBackend

TOKEN = "model-token-0001"
SECRET = bytes(range(16))
DOMAIN = "dom-model"
HOSTS = ("hostA", "hostB")
ADDRESSES = {"hostA": "10.0.1.5", "hostB": "10.0.2.5"}


@dataclasses.dataclass
class DriverState:
    """What a driver knows (a snapshot of it is a stale copy)."""

    epoch: int = 1
    next_seq: int = 1
    last_seen: int = 0
    received: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class HeldTicket:
    token: str
    dest: str
    migration: str
    state: str = "live"      # live | used | revoked


class PoolModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.executed: dict[int, list] = {}             # filled by the session's worker thread
        self.executed_lock = threading.Lock()
        self._real_execute = session_module.execute
        session_module.execute = self._execute          # count executions, then run the real one
        # a finish the pool answers on its loop (nothing in flight) is an execution too
        self._real_finish_inline = session_module.Session._finish_inline
        session_module.Session._finish_inline = lambda session, command: self._finish_inline(session, command)
        self.loop = asyncio.new_event_loop()
        config = PoolConfig(admin_socket="/nonexistent/model.sock", log_format="text")
        self.pool = Pool(config, NullBackend(), {"t": TenantSpec("t", TOKEN, 1 << 30)})
        self.pool.loop = self.loop
        self.issued: dict[int, int | str] = {}           # seq -> the value sent under it ("finish": a finish)
        self.driver = DriverState()
        self.host = HOSTS[0]                             # where the guest runs now
        self.conn = self._connect(self.host)
        self._frame(self.conn, {"op": "open", "token": TOKEN, "secret": SECRET.hex()})
        opened = self._pop(self.conn, "opened")
        self.sid = opened["sid"]
        self.session = self.pool.sessions[self.sid]
        assert opened["epoch"] == 1 and opened["bound_host"] == self.host
        # what the host's bind_sessions does with the session's proof
        challenge = self.pool.ledger.bind_challenge(self.host)["challenge"]
        proof = att.bind_proof(SECRET, challenge=challenge, instance=self.pool.instance, host=self.host,
                               domain=DOMAIN, sid=self.sid)
        assert self.pool.ledger.bind_sessions(self.host, DOMAIN, {self.sid: proof}, challenge,
                                              self.pool.instance)["bound"] == [self.sid]
        self.connected = True
        self.tickets: list[HeldTicket] = []
        self.expected_epoch = 1
        self.expected_bound = self.host
        self.migrations = 0
        self.copies: list[tuple[DriverState, int, int]] = []   # (state, sends, resumes) at the snapshot
        self.resumed_from: list[int] = []        # the epoch each accepted resume came from
        self.sends = 0
        self.resumes = 0
        self.lost_resume: dict | None = None            # a resume accepted whose answer was lost

    # -- plumbing ------------------------------------------------------------------
    def _execute(self, session, command):
        with self.executed_lock:
            self.executed.setdefault(command.seq, []).append(command.header.get("v", command.op.value))
        return self._real_execute(session, command)

    def _finish_inline(self, session, command):
        event("a finish answered on the pool's loop")
        with self.executed_lock:
            self.executed.setdefault(command.seq, []).append("finish")
        return self._real_finish_inline(session, command)

    def _command(self, seq: int, value) -> dict:
        """The frame of command ``seq`` as issued: an info carrying ``value``, or a finish."""
        d = self.driver
        if value == "finish":
            return {"op": "finish", "seq": seq, "epoch": d.epoch, "ack": d.last_seen}
        return {"op": "info", "seq": seq, "epoch": d.epoch, "ack": d.last_seen, "v": value}

    def _connect(self, host: str) -> ListConnection:
        return ListConnection(self.pool, host, ADDRESSES[host], hello=True)

    def _frame(self, conn, header):
        conn._handle(dict(header), b"")

    @staticmethod
    def _pop(conn, op):
        frame = conn.frames.pop(0)
        assert frame["op"] == op, frame
        return frame

    def _settle(self):
        """Run the loop until the worker has answered every accepted command."""
        log = self.session.log

        async def until_done():
            deadline = time.monotonic() + 10
            while log.highest_reply < log.next_seq - 1:
                assert time.monotonic() < deadline, "the session worker did not answer"
                await asyncio.sleep(0.0005)
        self.loop.run_until_complete(until_done())

    def _read_replies(self, conn):
        for frame in conn.frames:
            assert frame["op"] == "reply" and frame["ok"], frame
            self.driver.received.add(frame["seq"])
        conn.frames.clear()
        d = self.driver
        while d.last_seen + 1 in d.received:
            d.last_seen += 1

    def _pool_state(self):
        s = self.session
        return (s.state, s.epoch, s.bound_host, s.pending_move, s.connection,
                tuple(sorted(s.log.snapshot().items())), dict(s.last_resume))

    def _resume_header(self, conn, state: DriverState, ticket: str | None):
        header = {"op": "resume", "sid": self.sid, "epoch": state.epoch,
                  "last_seen": state.last_seen, "next_seq": state.next_seq,
                  "proof": dp.ownership_proof(SECRET, conn.challenge, self.sid, state.epoch)}
        if ticket:
            header["ticket"] = ticket
        return header

    def _refused(self, host, state, ticket, error, match=None):
        """A resume that must be refused with ``error``, changing nothing."""
        before = self._pool_state()
        conn = self._connect(host)
        with pytest.raises(error, match=match) as refused:
            self._frame(conn, self._resume_header(conn, state, ticket))
        event(f"resume refused: {refused.value.code.value}")
        assert self._pool_state() == before, "a refused resume changed the session"
        assert conn.frames == [] and conn.state is ConnState.READY

    def _live_ticket(self):
        live = [t for t in self.tickets if t.state == "live"]
        assert len(live) <= 1
        return live[0] if live else None

    def _accepted_resume(self, host, ticket: HeldTicket | None, *, answer_lost=False):
        d = self.driver
        old = self.session.connection
        highest = self.session.log.highest_reply
        conn = self._connect(host)
        self._frame(conn, self._resume_header(conn, d, ticket.token if ticket else None))
        resumed = self._pop(conn, "resumed")
        event(f"resume accepted (ticket: {ticket is not None}, retry: {d.epoch != self.session.epoch - 1}, "
              f"replayed: {bool(conn.frames)}, fenced: {old is not None})")
        self.expected_epoch += 1
        self.resumes += 1
        self.resumed_from.append(d.epoch)
        assert resumed["epoch"] == self.expected_epoch == self.session.epoch
        assert resumed["expect"] == self.session.log.next_seq
        # exactly the replies the driver had not seen are replayed, in order
        replayed = [f["seq"] for f in conn.frames]
        assert replayed == list(range(d.last_seen + 1, highest + 1)), (replayed, d.last_seen, highest)
        assert resumed["replay"] == len(replayed)
        if old is not None and old is not conn:          # the connection it replaces is fenced
            assert old.state is ConnState.CLOSED
            assert old.frames[-1]["op"] == "error"
            assert old.frames[-1]["error"]["code"] == "STALE_EPOCH"
            with pytest.raises(StaleEpoch):
                old._handle({"op": "info", "seq": d.next_seq, "epoch": old.epoch, "v": -1}, b"")
        if ticket is not None:
            ticket.state = "used"
            self.expected_bound = ticket.dest
        assert resumed["bound_host"] == self.expected_bound
        if answer_lost:
            # the connection dies before the driver reads the answer: it stays at its epoch
            conn.connection_lost(None)
            self.connected = False
            self.lost_resume = {"host": host, "ticket": ticket}
            return
        self.lost_resume = None
        d.epoch = resumed["epoch"]
        self.conn = conn
        self.connected = True
        self._read_replies(conn)

    # -- commands --------------------------------------------------------------------
    @precondition(lambda self: self.connected)
    @rule(value=st.one_of(st.integers(0, 1000), st.just("finish")))
    def send(self, value):
        d = self.driver
        self._frame(self.conn, self._command(d.next_seq, value))
        self.issued[d.next_seq] = value
        d.next_seq += 1
        self.sends += 1

    @rule()
    def pool_executes(self):
        self._settle()

    @precondition(lambda self: self.connected)
    @rule()
    def driver_reads(self):
        self._read_replies(self.conn)

    @precondition(lambda self: self.connected)
    @rule()
    def answers_lost(self):
        self.conn.frames.clear()

    @precondition(lambda self: self.connected and self.driver.next_seq - 1 > self.driver.last_seen)
    @rule()
    def driver_resends_unanswered(self):
        """The same commands under the same numbers: answered from the log."""
        d = self.driver
        answered = self.session.log.highest_reply
        if answered > d.last_seen:
            event("resent commands answered from the log")
        for seq in range(d.last_seen + 1, d.next_seq):
            self._frame(self.conn, self._command(seq, self.issued[seq]))

    @precondition(lambda self: self.connected)
    @rule()
    def driver_acks(self):
        self._frame(self.conn, {"op": "ack", "ack": self.driver.last_seen})

    @precondition(lambda self: self.connected)
    @rule(pool_notices=st.booleans())
    def connection_dies(self, pool_notices):
        """Cut; the pool may notice at once, or only when a resume fences it."""
        if pool_notices:
            self.conn.connection_lost(None)
        self.conn.frames.clear()
        self.connected = False

    # -- resumes ---------------------------------------------------------------------
    @precondition(lambda self: not self.connected and self.lost_resume is None)
    @rule(answer_lost=st.booleans())
    def driver_resumes(self, answer_lost):
        self._accepted_resume(self.host, self._live_ticket(), answer_lost=answer_lost)

    @precondition(lambda self: self.lost_resume is not None)
    @rule(answer_lost=st.booleans())
    def driver_retries_the_lost_resume(self, answer_lost):
        """Same epoch, same progress, same ticket: the retry is accepted, and
        so is the retry of a retry whose answer was lost too."""
        lost = self.lost_resume
        if lost["ticket"] is not None:
            lost["ticket"].state = "live"                 # the driver still holds it
        self._accepted_resume(lost["host"], lost["ticket"], answer_lost=answer_lost)

    @precondition(lambda self: not self.connected and self.lost_resume is None)
    @rule()
    def resume_from_another_host_without_ticket(self):
        other = next(h for h in HOSTS if h != self.session.bound_host)
        if self._live_ticket() is not None:
            self._refused(other, self.driver, None, TicketRequired)
        else:
            self._refused(other, self.driver, None, WrongHost)

    @precondition(lambda self: not self.connected and self.lost_resume is None
                  and any(t.state != "live" for t in self.tickets))
    @rule(data=st.data())
    def resume_with_a_dead_ticket(self, data):
        dead = [t for t in self.tickets if t.state != "live"]
        ticket = data.draw(st.sampled_from(dead))
        match = "already used" if ticket.state == "used" else "superseded"
        self._refused(ticket.dest, self.driver, ticket.token, TicketInvalid, match)

    @precondition(lambda self: len(self.copies) < 3)
    @rule()
    def snapshot(self):
        d = self.driver
        self.copies.append((DriverState(d.epoch, d.next_seq, d.last_seen, set(d.received)),
                            self.sends, self.resumes))

    def _is_stale(self, copy: DriverState, sends: int, resumes: int) -> bool:
        """The live driver has moved past the copy: it sent more, acknowledged
        more, or resumed from a later epoch than the copy's since (it had
        the answer of a resume).  A copy of a driver whose resumes since all
        lost their answers is that driver, as far as anyone can tell."""
        return sends < self.sends or copy.last_seen < self.session.log.acked \
            or any(epoch > copy.epoch for epoch in self.resumed_from[resumes:])

    @precondition(lambda self: any(self._is_stale(*c) for c in self.copies))
    @rule(data=st.data())
    def stale_copy_resumes(self, data):
        """A copy the live driver has moved past is refused, whatever it presents."""
        stale = [c for c in self.copies if self._is_stale(*c)]
        copy, _, _ = data.draw(st.sampled_from(stale))
        session = self.session
        bound = session.bound_host
        if session.pending_move is not None:
            # refused at the ticket check or at the progress check, whichever comes first
            self._refused(bound, copy, None, (TicketRequired, SessionDiverged))
        else:
            self._refused(bound, copy, None, SessionDiverged)

    # -- migrations ------------------------------------------------------------------
    @precondition(lambda self: self.lost_resume is None)
    @rule(then_abort=st.booleans())
    def migrate(self, then_abort):
        """The domain moves to the other host (the guest's connection breaks),
        or the migration is aborted before it completes.  Completing while an
        earlier ticket is still unused supersedes that ticket."""
        dest = next(h for h in HOSTS if h != self.host)
        self.migrations += 1
        mid = f"m{self.migrations}"
        pending = self.session.pending_move
        record = self.pool.ledger.open_record(dest, DOMAIN, mid, None, None, False, vouched=True)
        if then_abort:
            self.pool.ledger.abort_record(record, "the model aborted it")
            assert self.session.pending_move == pending
            return
        tickets = self.pool.ledger.complete_record(record)
        assert set(tickets) == {self.sid}
        assert self.session.pending_move == (DOMAIN, mid)
        earlier = self._live_ticket()
        if earlier is not None:
            earlier.state = "revoked"
        self.tickets.append(HeldTicket(tickets[self.sid], dest, mid))
        self.host = dest
        if self.connected:
            self.connection_dies(pool_notices=True)

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def every_command_executed_at_most_once_as_issued(self):
        with self.executed_lock:
            executed = {seq: list(values) for seq, values in self.executed.items()}
        for seq, values in executed.items():
            assert values == [self.issued[seq]], f"seq {seq} executed as {values}"

    @invariant()
    def epoch_counts_the_accepted_resumes(self):
        assert self.session.epoch == self.expected_epoch

    @invariant()
    def bound_host_follows_the_tickets(self):
        assert self.session.bound_host == self.expected_bound

    def teardown(self):
        try:
            if self.lost_resume is not None:
                self.driver_retries_the_lost_resume(answer_lost=False)
            if not self.connected:
                self.driver_resumes(answer_lost=False)
            self._settle()
            self._read_replies(self.conn)
            if self.driver.last_seen < len(self.issued):     # answers lost on a live connection
                self.driver_resends_unanswered()
                self._read_replies(self.conn)
            assert sorted(self.executed) == sorted(self.issued)
            assert all(len(v) == 1 for v in self.executed.values())
            assert self.driver.received == set(self.issued)
            assert self.driver.last_seen == len(self.issued)
        finally:
            session_module.execute = self._real_execute
            session_module.Session._finish_inline = self._real_finish_inline
            for session in list(self.pool.sessions.values()):
                self.pool._release(session, "model over")
                session.wait_released(5)
            self.loop.close()


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                  derandomize=True, database=None, print_blob=True,
                                  suppress_health_check=[HealthCheck.too_slow])
