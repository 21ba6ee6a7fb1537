"""The migration ledger's own pieces, each alone: the record's and the
session's state machines against tables written out here (never read from
the machines), the one ticket table, the one minter of migration ids, and
the record's one serialiser.

The rules that name a party run against a real pool in
``test_control_authorization.py`` (with the bounds on intents and on
domains' hosts, issue 29); the ledger's behaviour as hosts see it is pinned
by ``tests/continuity/test_tickets_and_records.py``
and the others of issue 29's table."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest

from accelmig.pool.ledger.ledger import MigrationLedger
from accelmig.pool.ledger.record import LedgerRecord, RecordEvent
from accelmig.pool.ledger.tickets import TicketBook
from accelmig.pool.session import Session, SessionEvent, SessionState
from accelmig.runtime.statemachine import StateMachine
from accelmig.wire.errors import InternalError, RecordState, TicketInvalid
from accelmig.wire.records import PausePolicy, RecordStateName, RecordView
from tests.agent.test_state_machines import reach     # (a machine brought to a state by a test's own table)

R, RE = RecordStateName, RecordEvent
S, SE = SessionState, SessionEvent
DOMAIN = "5f0c1f4e-0000-4000-8000-0000000000c1"


def table(moves: str, states, events) -> dict:
    """``{event: {from: to}}`` from lines ``FROM... --EVENT--> TO``: the
    tables below are written as the diagrams draw them, one arrow a line."""
    out: dict = {}
    for line in moves.strip().splitlines():
        sources, rest = line.split("--", 1)
        event, target = rest.split("-->")
        for old in sources.split():
            out.setdefault(events[event.strip()], {})[states[old]] = states[target.strip()]
    return out


# -- the record's moves, as pool/ledger/record.py's docstring and wire/records.py's diagram say ----
RECORD_TABLE = table("""
    OPEN --SWITCHOVER--> SWITCHED_OVER
    OPEN SWITCHED_OVER --COMMIT--> COMMITTED
    OPEN SWITCHED_OVER COMMITTED --COMPLETE--> COMPLETED
    COMPLETED --CLOSE--> CLOSED
    OPEN SWITCHED_OVER --ABORT--> ABORTED
""", R.__members__, RE.__members__)
RECORD_REPEATS = {
    RE.SWITCHOVER: {R.SWITCHED_OVER},
    RE.COMMIT: {R.COMMITTED, R.COMPLETED, R.CLOSED},
    RE.COMPLETE: {R.COMPLETED, R.CLOSED},
    RE.CLOSE: {R.CLOSED},
    RE.ABORT: {R.ABORTED},
}

# -- and the session's, as pool/session.py's diagram draws them (issue 29's plan, §2) ---------------
SESSION_TABLE = table("""
    ATTACHED DETACHED --ATTACH--> ATTACHED
    ATTACHED_SAVED PARKED --ATTACH--> ATTACHED_SAVED
    ATTACHED --DETACH--> DETACHED
    ATTACHED_SAVED --DETACH--> PARKED
    ATTACHED --PARK--> ATTACHED_SAVED
    DETACHED PARKED --PARK--> PARKED
    ATTACHED_SAVED --UNPARK--> ATTACHED
    PARKED --UNPARK--> DETACHED
    ATTACHED ATTACHED_SAVED DETACHED PARKED --RELEASE--> RELEASED
""", S.__members__, SE.__members__)
SESSION_REPEATS = {
    SE.DETACH: {S.DETACHED, S.PARKED, S.RELEASED},
    SE.PARK: {S.ATTACHED_SAVED},
    SE.UNPARK: {S.ATTACHED, S.DETACHED, S.RELEASED},
    SE.RELEASE: {S.RELEASED},
}


def new_record(now: float = 1000.0) -> LedgerRecord:
    return LedgerRecord(DOMAIN, "a1b2c3d4e5f6", "hostA", "hostB", PausePolicy.NONE, 30.0, now)


def bare_session() -> Session:
    """A ``Session`` with its machine only: the table is the class's, and
    ``fire`` needs nothing else (no tenant, device or worker)."""
    session = Session.__new__(Session)
    session.sid, session.released_reason = "s-1", None
    StateMachine.__init__(session)
    return session


MACHINES = [(new_record, RECORD_TABLE, RECORD_REPEATS, R, RecordState),
            (bare_session, SESSION_TABLE, SESSION_REPEATS, S, InternalError)]
IDS = ["record", "session"]


@pytest.mark.parametrize("make,table,repeats,states,refusal", MACHINES, ids=IDS)
def test_every_listed_move_is_taken(make, table, repeats, states, refusal):
    for event, rows in table.items():
        for old, new in rows.items():
            machine = reach(make, table, old)
            assert machine.can(event), f"{event.name} in {old.name}"
            machine.fire(event)
            assert machine.state is new, f"{event.name} in {old.name}"


@pytest.mark.parametrize("make,table,repeats,states,refusal", MACHINES, ids=IDS)
def test_every_repeat_changes_nothing(make, table, repeats, states, refusal):
    for event, where in repeats.items():
        for state in where:
            machine = reach(make, table, state)
            assert not machine.can(event)
            assert machine.fire(event) is None and machine.state is state, f"{event.name} in {state.name}"


@pytest.mark.parametrize("make,table,repeats,states,refusal", MACHINES, ids=IDS)
def test_every_other_event_is_refused_and_changes_nothing(make, table, repeats, states, refusal):
    refused = [(state, event) for state in states for event in table
               if state not in table[event] and state not in repeats.get(event, ())]
    assert refused
    for state, event in refused:
        machine = reach(make, table, state)
        # a record refuses a host's request (RecordState, a wire error); a
        # session refuses with the pool's InternalError (a caller's bug)
        with pytest.raises(refusal):
            machine.fire(event)
        assert machine.state is state, f"{event.name} in {state.name}"


def test_the_tables_are_the_classes_not_instances():
    """10,000 sessions (issue 31): no per-instance copy of a table."""
    assert "TABLE" not in vars(bare_session()) and "TABLE" not in vars(new_record())


def test_a_refused_step_names_the_record_its_state_and_the_action():
    record = reach(new_record, RECORD_TABLE, R.ABORTED)
    with pytest.raises(RecordState, match=f"{record.key}.*aborted.*switch over|switch over.*{record.key}"):
        record.switchover(1001.0)
    with pytest.raises(InternalError, match="session s-1 is released: it cannot attach"):
        reach(bare_session, SESSION_TABLE, S.RELEASED).fire(SE.ATTACH)


def test_a_record_stamps_each_state_it_enters_once():
    record = new_record(1000.0)
    record.switchover(1001.0)
    record.switchover(1002.0)                    # a repeat: the first time stays
    record.complete(1003.0, ["s-2", "s-1"])
    record.close(1004.0)
    assert record.times == {"opened": 1000.0, "switchover": 1001.0, "completed": 1003.0,
                            "closed": 1004.0, "source_stopped": 1004.0}
    assert record.sessions == ["s-1", "s-2"]


def test_a_source_that_stopped_before_complete_closes_it_on_complete():
    record = new_record()
    assert record.close(1001.0) is False and record.state is R.OPEN      # a flag, no transition
    record.complete(1002.0, [])
    assert record.state is R.CLOSED and record.times["source_stopped"] == 1001.0


# -- the one record model: the view is the one serialiser -----------------------------------------
def test_the_view_round_trips_with_the_vouching_and_the_verdict():
    record = new_record()
    record.vouched = True
    record.switchover(1001.0)
    record.complete(1002.0, ["s-1", "s-2"])
    record.note_resumed("s-1", 0.25, 1003.0)
    half = RecordView.from_wire(record.to_wire(1003.0))
    assert half.vouched is True and half.rehomed is False and half.unresumed_count == 1
    record.note_resumed("s-2", 0.5, 1004.0)
    wire = record.to_wire(1004.0)
    view = RecordView.from_wire(wire)
    assert view == record.view(1004.0) and view.to_wire() == wire
    assert view.rehomed is True and wire["rehomed"] is True and wire["vouched"] is True
    assert view.key == record.key and view.resumed == {"s-1": 0.25, "s-2": 0.5}


def test_the_verdict_is_read_from_the_wire_never_recomputed():
    """hostd reads the ledger's verdict: a view whose counts say "all
    resumed" but whose ledger said not rehomed is not rehomed."""
    wire = new_record().to_wire(1000.0)
    assert RecordView.from_wire({**wire, "rehomed": False}).rehomed is False
    with pytest.raises(Exception, match="rehomed"):
        RecordView.from_wire({**wire, "rehomed": "yes"})


# -- the one ticket table ---------------------------------------------------------------------------
def _record(key_mid: str = "a1b2c3d4e5f6"):
    return types.SimpleNamespace(domain_uuid=DOMAIN, migration_id=key_mid, dest_host="hostB",
                                 key=f"{DOMAIN}/{key_mid}")


def test_a_used_ticket_is_good_for_its_own_retry_only_and_then_names_its_use():
    book = TicketBook(ttl=60.0)
    token = book.mint_for("s-1", _record(), 1000.0)
    claims = book.check(token, "s-1", "hostB", 1001.0)
    book.use("s-1", claims["n"], 1001.5)
    # the driver whose answer was lost presents it again: the same resume
    assert book.check(token, "s-1", "hostB", 1002.0, retry_of=book.last_used("s-1"))["n"] == claims["n"]
    # anyone else (or the same session, once its retry window is over) is refused, told when it was used
    with pytest.raises(TicketInvalid, match=r"already used by a resume at 1970-01-01T00:16:41\.500Z"):
        book.check(token, "s-1", "hostB", 1003.0)
    book.use("s-1", None, 1004.0)                # a later resume without a ticket ends the window
    assert book.last_used("s-1") is None
    with pytest.raises(TicketInvalid, match="already used"):
        book.check(token, "s-1", "hostB", 1005.0, retry_of=book.last_used("s-1"))


def test_a_released_sessions_live_ticket_is_revoked_with_the_reason():
    book = TicketBook(ttl=60.0)
    token = book.mint_for("s-1", _record(), 1000.0)
    book.drop_session("s-1", "session released: expired", 1001.0)
    assert book.held_by("s-1") is None
    with pytest.raises(TicketInvalid, match="session released: expired"):
        book.check(token, "s-1", "hostB", 1002.0)


def test_one_live_ticket_per_session_a_newer_migration_revokes_the_older():
    book = TicketBook(ttl=60.0)
    first = book.mint_for("s-1", _record(), 1000.0)
    assert book.mint_for("s-1", _record(), 1001.0) == first          # complete is idempotent
    second = book.mint_for("s-1", _record("0000000000aa"), 1002.0)
    assert second != first and book.held_by("s-1").token == second
    with pytest.raises(TicketInvalid, match="superseded by migration 0000000000aa"):
        book.check(first, "s-1", "hostB", 1003.0)
    book.revoke_record(f"{DOMAIN}/0000000000aa", "migration aborted: by a host", 1004.0)
    with pytest.raises(TicketInvalid, match="migration aborted"):
        book.check(second, "s-1", "hostB", 1005.0)


def test_a_ticket_is_for_its_session_and_its_host():
    book = TicketBook(ttl=60.0)
    token = book.mint_for("s-1", _record(), 1000.0)
    with pytest.raises(TicketInvalid, match="for session s-1, not s-2"):
        book.check(token, "s-2", "hostB", 1001.0)
    with pytest.raises(TicketInvalid, match="for host hostB, the resume comes from host hostC"):
        book.check(token, "s-1", "hostC", 1001.0)
    with pytest.raises(TicketInvalid, match="expired"):
        book.check(token, "s-1", "hostB", 1061.0)
    with pytest.raises(TicketInvalid, match="signature does not verify"):
        TicketBook(ttl=60.0).check(token, "s-1", "hostB", 1001.0)


# -- one minter ---------------------------------------------------------------------------------------
POOL = pathlib.Path(__file__).resolve().parents[2] / "pool"


def _id_minters() -> list[str]:
    """Where shipped pool code makes an id of a migration id's making: a
    ``uuid4`` (``pool/state.py`` once cut one down to 12 characters) or
    ``token_hex(6)`` (the ledger's).  The other ``token_hex`` calls are
    challenges, nonces and session ids, of other lengths."""
    found = []
    for path in sorted(POOL.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            six = [a.value for a in node.args if isinstance(a, ast.Constant)] == [6]
            if name in ("uuid4", "uuid1") or (name == "token_hex" and six):
                found.append(f"{path.relative_to(POOL.parent)}:{node.lineno}")
    return found


def test_migration_ids_are_minted_in_one_place():
    source = (POOL / "ledger" / "ledger.py").read_text()
    minter_line = source[:source.index("return secrets.token_hex(6)")].count("\n") + 1
    assert _id_minters() == [f"pool/ledger/ledger.py:{minter_line}"]
    assert len(MigrationLedger.new_migration_id()) == 12


def test_each_ledger_module_stays_small():
    """Issue 29: one concern a module, each under 400 lines."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in (POOL / "ledger").glob("*.py")}
    assert sizes and {name: n for name, n in sizes.items() if n >= 400} == {}
