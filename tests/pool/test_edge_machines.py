"""The pool's machines at its edges, each against a table written out here
by hand (independent of the classes' own: change a row there and a cell
here fails): a data-plane connection (``DataConnection``), an accepted
connection's admission (``AcceptedConnection``) and this node's
registration in etcd (``NodeRegistration``).  Every listed move is taken;
every other event is a harmless repeat where the machine says so, and
refused (``IllegalTransition``: a bug) everywhere else.  What the moves do
around them is the business of the tests of each (tests/pool/test_hostile_peers.py,
test_connection_floods.py, test_cluster.py)."""

from __future__ import annotations

import pytest

from accelmig.pool.admission import AcceptedConnection, AdmissionEvent, Phase
from accelmig.pool.cluster.registry import NodeRegistration, RegistrationEvent, RegistrationState
from accelmig.pool.dataplane import ConnEvent, ConnState, DataConnection
from accelmig.runtime.statemachine import IllegalTransition, StateMachine

REPEAT = "repeat"      # changes nothing, says nothing (fire answers None)

HELLO, READY, PLACING, ATTACHED, CLOSED = (ConnState.HELLO, ConnState.READY, ConnState.PLACING,
                                           ConnState.ATTACHED, ConnState.CLOSED)
DATA = {
    ConnEvent.WELCOMED: {HELLO: READY},
    ConnEvent.PLACE: {READY: PLACING},
    ConnEvent.PLACED: {PLACING: READY},
    ConnEvent.ATTACH: {READY: ATTACHED},
    ConnEvent.CLOSE: {HELLO: CLOSED, READY: CLOSED, PLACING: CLOSED, ATTACHED: CLOSED, CLOSED: REPEAT},
}
DATA_PATHS = {HELLO: (), READY: (ConnEvent.WELCOMED,), PLACING: (ConnEvent.WELCOMED, ConnEvent.PLACE),
              ATTACHED: (ConnEvent.WELCOMED, ConnEvent.ATTACH), CLOSED: (ConnEvent.CLOSE,)}

ADMISSION = {
    AdmissionEvent.REFUSED: {Phase.ACCEPTED: Phase.CLOSED},
    AdmissionEvent.AUTHENTICATED: {Phase.ACCEPTED: Phase.AUTHENTICATED, Phase.AUTHENTICATED: REPEAT,
                                   Phase.CLOSED: REPEAT},
    AdmissionEvent.CLOSED: {Phase.ACCEPTED: Phase.CLOSED, Phase.AUTHENTICATED: Phase.CLOSED, Phase.CLOSED: REPEAT},
}
ADMISSION_PATHS = {Phase.ACCEPTED: (), Phase.AUTHENTICATED: (AdmissionEvent.AUTHENTICATED,),
                   Phase.CLOSED: (AdmissionEvent.CLOSED,)}

UNREGISTERED, REGISTERED, LEASE_LOST, STOPPED = (RegistrationState.UNREGISTERED, RegistrationState.REGISTERED,
                                                 RegistrationState.LEASE_LOST, RegistrationState.STOPPED)
REGISTRATION = {
    RegistrationEvent.REGISTERED_OK: {UNREGISTERED: REGISTERED, LEASE_LOST: REGISTERED},
    RegistrationEvent.LEASE_EXPIRED: {REGISTERED: LEASE_LOST},
    RegistrationEvent.STOP: {UNREGISTERED: STOPPED, REGISTERED: STOPPED, LEASE_LOST: STOPPED, STOPPED: REPEAT},
}
REGISTRATION_PATHS = {UNREGISTERED: (), REGISTERED: (RegistrationEvent.REGISTERED_OK,),
                      LEASE_LOST: (RegistrationEvent.REGISTERED_OK, RegistrationEvent.LEASE_EXPIRED),
                      STOPPED: (RegistrationEvent.STOP,)}

MACHINES = {"DataConnection": (DataConnection, DATA, DATA_PATHS),
            "AcceptedConnection": (AcceptedConnection, ADMISSION, ADMISSION_PATHS),
            "NodeRegistration": (NodeRegistration, REGISTRATION, REGISTRATION_PATHS)}


def bare(cls):
    """An instance with only its machine made: the table, no socket, no etcd
    (what the moves do is tested with real peers elsewhere)."""
    machine = cls.__new__(cls)
    StateMachine.__init__(machine)
    return machine


def cells():
    for name, (cls, table, paths) in MACHINES.items():
        for event in cls.EVENTS:
            for state in cls.STATES:
                yield pytest.param(name, event, state, id=f"{name}-{event.name}-{state.name}")


def test_each_hand_table_names_the_machines_own_enums_and_a_way_to_every_state():
    for name, (cls, table, paths) in MACHINES.items():
        assert set(table) == set(cls.EVENTS), name
        assert set(paths) == set(cls.STATES), name


@pytest.mark.parametrize("name, event, state", list(cells()))
def test_every_event_in_every_state_does_what_the_hand_table_says(name, event, state):
    cls, table, paths = MACHINES[name]
    machine = bare(cls)
    for step in paths[state]:
        machine.fire(step)
    assert machine.state is state, f"{paths[state]} lead to {machine.state}"
    expected = table[event].get(state)
    if expected is None:
        assert not machine.can(event)
        with pytest.raises(IllegalTransition, match=f"{event.name} in {state.name}"):
            machine.fire(event)
        assert machine.state is state
    elif expected == REPEAT:
        assert not machine.can(event)
        assert machine.fire(event) is None and machine.state is state
    else:
        assert machine.can(event)
        assert machine.fire(event) is not None and machine.state is expected
