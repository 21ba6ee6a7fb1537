"""The one way to write a state machine in accelmig.

A machine is a class: an enum of states, an enum of events, and a
class-level ``TABLE`` of what each event does in each state::

    class DoorMachine(StateMachine):
        INITIAL = Door.SHUT                          # the states: an enum
        TABLE = {Push.OPEN: {Door.SHUT: Door.OPEN},  # the events: another
                 Push.CLOSE: {Door.OPEN: Door.SHUT}}
        REPEATS = {Push.CLOSE: frozenset({Door.SHUT})}   # closing a shut door

``fire(event)`` is the only place ``state`` is assigned (a house test,
``tests/house/test_state_assignment.py``, holds every shipped module to it).
A row's outcome is a state, or a ``To`` that also names what the owner does
next (``then``; hostd's steps); ``first_match`` writes ordered rows ("in
OUTGOING this, in any other phase that") as a table.  An event that has no
row in the current state is a harmless repeat where ``REPEATS`` says so
(hosts retry, events come twice), and otherwise is refused
(``IllegalTransition``: a bug, never a peer's doing) or, with
``UNLISTED = "ignore"``, changes nothing.

The table is checked when the class is created, so a wrong one fails at
import: one state enum and one event enum, every key and target a member,
every event with a row, every state reachable from ``INITIAL`` (or an
``ENTRY`` state an instance may be made in, such as a record adopted from
etcd), no row out of a ``FINAL`` state, ``REPEATS`` disjoint from the rows.

Cheap enough for 10,000 sessions: the table is the class's (no
per-instance copy), ``state`` is a plain attribute (a read is an attribute
read), and ``fire`` is two dict lookups.  A machine holds no lock: its
owner serialises the changes (and says how).  ``on_transition`` is the one
hook for what follows a change (history, time stamps, wake-ups); it runs
after ``state`` is assigned.

Standard library only, Python 3.9: the guest side uses it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Dict, FrozenSet, Mapping, Optional, Union


class IllegalTransition(RuntimeError):
    """An event that has no row in the current state: a bug in accelmig,
    never something a peer can cause (so it is no AccelmigError)."""


@dataclasses.dataclass(frozen=True)
class To:
    """One row's outcome: the next state (None: stay) and what the owner
    does next (``then``, any value the owner reads back from ``fire``)."""

    state: Optional[enum.Enum]
    then: Any = None


def first_match(*rows) -> Dict[enum.Enum, To]:
    """``{state: To}`` from ordered rows ``(states, To)``: the first row that
    names a state wins, as in "from OUTGOING this, from any phase that"."""
    out: Dict[enum.Enum, To] = {}
    for states, outcome in rows:
        if not isinstance(outcome, To):
            raise TypeError(f"first_match: a row's outcome must be a To, not {outcome!r}")
        for state in states:
            out.setdefault(state, outcome)
    return out


UNLISTED_CHOICES = ("raise", "ignore")


class StateMachine:
    """Base of every state machine; see the module's docstring.

    A mixin: ``class DataConnection(StateMachine, asyncio.BufferedProtocol)``
    works (no ``__slots__`` of its own to clash with, ``__init__`` passes on).
    """

    __slots__ = ()

    #: the state a new instance starts in
    INITIAL: ClassVar[enum.Enum]
    #: event -> {state it applies in: next state | To}
    TABLE: ClassVar[Mapping[enum.Enum, Mapping[enum.Enum, Union[enum.Enum, To]]]] = {}
    #: event -> states in which it is a harmless repeat (changes nothing, no hook)
    REPEATS: ClassVar[Mapping[enum.Enum, FrozenSet[enum.Enum]]] = {}
    #: other states an instance may be made in (restored from elsewhere)
    ENTRY: ClassVar[FrozenSet[enum.Enum]] = frozenset()
    #: states no row may leave
    FINAL: ClassVar[FrozenSet[enum.Enum]] = frozenset()
    #: an event with no row in the current state: "raise" (refuse) or "ignore"
    UNLISTED: ClassVar[str] = "raise"

    # Filled in by __init_subclass__: the table with every outcome a To, and
    # the repeats, both read by fire().
    _ROWS: ClassVar[Dict[enum.Enum, Dict[enum.Enum, To]]] = {}
    _REPEATS: ClassVar[Dict[enum.Enum, FrozenSet[enum.Enum]]] = {}
    STATES: ClassVar[Optional[type]] = None       # the state enum (set with the table)
    EVENTS: ClassVar[Optional[type]] = None       # the event enum

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.TABLE:
            return          # an abstract intermediate: checked where its table is given
        cls._check_and_compile()

    @classmethod
    def _check_and_compile(cls) -> None:
        name = cls.__name__

        def bad(reason: str):
            raise TypeError(f"state machine {name}: {reason}")

        initial = getattr(cls, "INITIAL", None)
        if not isinstance(initial, enum.Enum):
            bad(f"INITIAL must be a member of the state enum, not {initial!r}")
        states = type(initial)
        events = None
        for event in cls.TABLE:
            if not isinstance(event, enum.Enum):
                bad(f"event {event!r} is not an enum member")
            if events is None:
                events = type(event)
            elif type(event) is not events:
                bad(f"events of two enums: {events.__name__} and {type(event).__name__}")
        if events is states:
            bad("the events and the states are one enum")
        missing = [e.name for e in events if e not in cls.TABLE]
        if missing:
            bad(f"events without a row: {missing}")

        def member(value, what: str):
            if not isinstance(value, states):
                bad(f"{what}: {value!r} is not a {states.__name__}")
            return value

        for state in (*cls.ENTRY, *cls.FINAL):
            member(state, "ENTRY/FINAL")
        if cls.UNLISTED not in UNLISTED_CHOICES:
            bad(f"UNLISTED must be one of {UNLISTED_CHOICES}, not {cls.UNLISTED!r}")

        rows: Dict[enum.Enum, Dict[enum.Enum, To]] = {}
        for event, table in cls.TABLE.items():
            rows[event] = {}
            for state, outcome in table.items():
                member(state, f"{event.name}'s row")
                if not isinstance(outcome, To):
                    outcome = To(outcome)
                if outcome.state is not None:
                    member(outcome.state, f"{event.name} in {state.name}")
                    if state in cls.FINAL and outcome.state is not state:
                        bad(f"{event.name} leaves the final state {state.name}")
                rows[event][state] = outcome

        repeats: Dict[enum.Enum, FrozenSet[enum.Enum]] = {}
        for event, where in cls.REPEATS.items():
            if not isinstance(event, events):
                bad(f"REPEATS names {event!r}, not a {events.__name__}")
            where = frozenset(member(s, f"{event.name}'s repeats") for s in where)
            both = where & rows[event].keys()
            if both:
                bad(f"{event.name} both repeats and moves in {sorted(s.name for s in both)}")
            repeats[event] = where

        reached = {initial, *cls.ENTRY}
        frontier = list(reached)
        while frontier:
            state = frontier.pop()
            for table in rows.values():
                outcome = table.get(state)
                if outcome is not None and outcome.state is not None and outcome.state not in reached:
                    reached.add(outcome.state)
                    frontier.append(outcome.state)
        unreachable = [s.name for s in states if s not in reached]
        if unreachable:
            bad(f"states no event reaches: {unreachable}")

        cls.STATES, cls.EVENTS = states, events
        cls._ROWS, cls._REPEATS = rows, repeats

    def __init__(self, state: Optional[enum.Enum] = None, **kwargs) -> None:
        if state is None:
            state = self.INITIAL
        elif state is not self.INITIAL and state not in self.ENTRY:
            raise ValueError(f"{type(self).__name__} cannot start in {state!r}")
        self.state = state
        super().__init__(**kwargs)

    def can(self, event: enum.Enum) -> bool:
        """Whether ``event`` has a row in the current state (a repeat has none)."""
        return self.state in self._ROWS[event]

    def fire(self, event: enum.Enum, **context) -> Optional[To]:
        """Take ``event``'s row in the current state and return its ``To``;
        None for a repeat or an ignored event (nothing changed); unlisted
        and not ignored: ``refuse``."""
        old = self.state
        outcome = self._ROWS[event].get(old)
        if outcome is None:
            if old in self._REPEATS.get(event, ()) or self.UNLISTED == "ignore":
                return None
            self.refuse(event)
            return None
        if outcome.state is not None:
            self.state = outcome.state
        self.on_transition(old, self.state, event, **context)
        return outcome

    def refuse(self, event: enum.Enum) -> None:
        """An event with no row here.  Override to raise the owner's own
        error (a record raises ``RecordState``: a host's request, not a bug)."""
        raise IllegalTransition(f"{type(self).__name__}: {event.name} in {self.state.name} "
                                f"is not a legal transition")

    def on_transition(self, old: enum.Enum, new: enum.Enum, event: enum.Enum, **context) -> None:
        """Called after every row taken (``new`` is ``old`` for a row that
        stays), with ``fire``'s keyword arguments."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state.name}>"
