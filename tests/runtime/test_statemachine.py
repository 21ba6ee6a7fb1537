"""accelmig.runtime.statemachine: the one idiom.  A wrong table fails when
its class is created (at import); a right one takes its rows, repeats what
it says repeats, refuses or ignores the rest, and calls its one hook."""

from __future__ import annotations

import asyncio
import enum

import pytest

from accelmig.runtime.statemachine import IllegalTransition, StateMachine, To, first_match


class Door(enum.Enum):
    SHUT = "shut"
    OPEN = "open"
    LOCKED = "locked"
    BROKEN = "broken"


class Push(enum.Enum):
    OPEN = "open"
    SHUT = "shut"
    LOCK = "lock"
    UNLOCK = "unlock"
    KICK = "kick"


class DoorMachine(StateMachine):
    INITIAL = Door.SHUT
    FINAL = frozenset({Door.BROKEN})
    TABLE = {
        Push.OPEN: {Door.SHUT: Door.OPEN},
        Push.SHUT: {Door.OPEN: Door.SHUT},
        Push.LOCK: {Door.SHUT: To(Door.LOCKED, then="click")},
        Push.UNLOCK: {Door.LOCKED: Door.SHUT},
        Push.KICK: first_match((frozenset({Door.LOCKED}), To(Door.BROKEN, then="crash")),
                               (frozenset(Door) - {Door.BROKEN}, To(None, then="ouch"))),
    }
    REPEATS = {Push.OPEN: frozenset({Door.OPEN}), Push.SHUT: frozenset({Door.SHUT})}

    def __init__(self, state=None):
        super().__init__(state)
        self.seen = []

    def on_transition(self, old, new, event, **context):
        self.seen.append((old, new, event, context))


def test_rows_are_taken_and_the_hook_sees_each_one():
    door = DoorMachine()
    assert door.state is Door.SHUT and door.can(Push.OPEN) and not door.can(Push.UNLOCK)
    assert door.fire(Push.OPEN, by="alice") == To(Door.OPEN)
    assert door.state is Door.OPEN
    assert door.seen == [(Door.SHUT, Door.OPEN, Push.OPEN, {"by": "alice"})]
    door.fire(Push.SHUT)
    assert door.fire(Push.LOCK).then == "click" and door.state is Door.LOCKED


def test_a_repeat_changes_nothing_and_calls_no_hook():
    door = DoorMachine()
    assert door.fire(Push.SHUT) is None
    assert door.state is Door.SHUT and door.seen == []
    assert not door.can(Push.SHUT)


def test_an_unlisted_event_raises_and_changes_nothing():
    door = DoorMachine()
    with pytest.raises(IllegalTransition, match="DoorMachine: UNLOCK in SHUT is not a legal transition"):
        door.fire(Push.UNLOCK)
    assert door.state is Door.SHUT and door.seen == []


def test_first_match_takes_the_first_row_that_names_the_state_and_a_stay_keeps_it():
    door = DoorMachine()
    assert door.fire(Push.KICK) == To(None, then="ouch")
    assert door.state is Door.SHUT and door.seen == [(Door.SHUT, Door.SHUT, Push.KICK, {})]
    door.fire(Push.LOCK)
    assert door.fire(Push.KICK).then == "crash" and door.state is Door.BROKEN
    with pytest.raises(IllegalTransition):
        door.fire(Push.KICK)                       # no row out of a final state


def test_an_ignoring_machine_changes_nothing_for_an_unlisted_event():
    class Quiet(DoorMachine):
        UNLISTED = "ignore"

    door = Quiet()
    assert door.fire(Push.UNLOCK) is None and door.state is Door.SHUT and door.seen == []


def test_refuse_is_the_owners_to_override():
    class Refusing(DoorMachine):
        def refuse(self, event):
            raise LookupError(f"no {event.name} in {self.state.name}")

    with pytest.raises(LookupError, match="no UNLOCK in SHUT"):
        Refusing().fire(Push.UNLOCK)


def test_an_instance_starts_in_initial_or_an_entry_state_only():
    class Restored(DoorMachine):
        ENTRY = frozenset({Door.LOCKED})

    assert Restored(Door.LOCKED).state is Door.LOCKED
    with pytest.raises(ValueError, match="cannot start in"):
        DoorMachine(Door.LOCKED)
    with pytest.raises(ValueError, match="cannot start in"):
        Restored(Door.OPEN)


def test_the_table_is_the_classs_and_state_a_plain_attribute():
    a, b = DoorMachine(), DoorMachine()
    a.fire(Push.OPEN)
    assert b.state is Door.SHUT
    assert "state" in vars(a) and "_ROWS" not in vars(a) and "TABLE" not in vars(a)
    assert DoorMachine.STATES is Door and DoorMachine.EVENTS is Push


def test_it_mixes_into_a_protocol_class():
    class Conn(StateMachine, asyncio.BufferedProtocol):
        INITIAL = Door.SHUT
        TABLE = {Push.OPEN: {Door.SHUT: Door.OPEN}, Push.SHUT: {Door.OPEN: Door.SHUT},
                 Push.LOCK: {Door.SHUT: Door.LOCKED}, Push.UNLOCK: {Door.LOCKED: Door.SHUT},
                 Push.KICK: {Door.LOCKED: Door.BROKEN}}

        def get_buffer(self, sizehint):
            return bytearray(1)

        def buffer_updated(self, nbytes):
            pass

    conn = Conn()
    conn.fire(Push.OPEN)
    assert conn.state is Door.OPEN and isinstance(conn, asyncio.BaseProtocol)


# ---------------------------------------------------------------- bad tables fail at class creation

def _table(**changes) -> dict:
    table = {Push.OPEN: {Door.SHUT: Door.OPEN}, Push.SHUT: {Door.OPEN: Door.SHUT},
             Push.LOCK: {Door.SHUT: Door.LOCKED}, Push.UNLOCK: {Door.LOCKED: Door.SHUT},
             Push.KICK: {Door.LOCKED: Door.BROKEN}}
    table.update(changes)
    return table


class Other(enum.Enum):
    X = "x"


@pytest.mark.parametrize("attrs,reason", [
    ({"INITIAL": "shut"}, "INITIAL must be a member"),
    ({"TABLE": {**_table(), "kick": {Door.LOCKED: Door.BROKEN}}}, "not an enum member"),
    ({"TABLE": {**_table(), Other.X: {Door.SHUT: Door.OPEN}}}, "events of two enums"),
    ({"TABLE": {k: v for k, v in _table().items() if k is not Push.KICK}}, r"events without a row: \['KICK'\]"),
    ({"TABLE": {**_table(), Push.KICK: {Door.LOCKED: Other.X}}},
     "KICK in LOCKED: <Other.X: .x.> is not a Door"),
    ({"TABLE": {**_table(), Push.KICK: {"locked": Door.BROKEN}}}, "KICK's row: 'locked' is not a Door"),
    ({"TABLE": {**_table(), Push.KICK: {Door.SHUT: Door.OPEN}}}, r"states no event reaches: \['BROKEN'\]"),
    ({"FINAL": frozenset({Door.LOCKED})}, "UNLOCK leaves the final state LOCKED"),
    ({"REPEATS": {Push.OPEN: frozenset({Door.SHUT})}}, r"OPEN both repeats and moves in \['SHUT'\]"),
    ({"REPEATS": {Other.X: frozenset()}}, "REPEATS names"),
    ({"ENTRY": frozenset({"open"})}, "ENTRY/FINAL"),
    ({"UNLISTED": "shrug"}, "UNLISTED must be one of"),
], ids=["initial", "event-type", "two-event-enums", "event-without-row", "target", "from-state",
        "unreachable", "leaves-final", "repeat-and-row", "repeat-event", "entry", "unlisted"])
def test_a_bad_table_fails_when_its_class_is_made(attrs, reason):
    namespace = {"INITIAL": Door.SHUT, "TABLE": _table(), **attrs}
    with pytest.raises(TypeError, match=reason):
        type("Bad", (StateMachine,), namespace)


def test_a_bad_table_fails_at_import(tmp_path, monkeypatch):
    """As a module: importing it raises, nothing half-made is left to use."""
    (tmp_path / "bad_machine.py").write_text(
        "import enum\n"
        "from accelmig.runtime.statemachine import StateMachine\n"
        "class S(enum.Enum):\n    A = 1\n    B = 2\n"
        "class E(enum.Enum):\n    GO = 1\n"
        "class M(StateMachine):\n    INITIAL = S.A\n    TABLE = {E.GO: {S.A: S.A}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match=r"state machine M: states no event reaches: \['B'\]"):
        import bad_machine  # noqa: F401


def test_events_and_states_are_two_enums():
    with pytest.raises(TypeError, match="one enum"):
        type("Bad", (StateMachine,), {"INITIAL": Door.SHUT, "TABLE": {Door.SHUT: {Door.SHUT: Door.OPEN}}})


def test_first_match_rows_must_be_outcomes():
    with pytest.raises(TypeError, match="must be a To"):
        first_match((frozenset({Door.SHUT}), Door.OPEN))
