"""The guest agent's own machines, against tables written out here (never
read from the machines): a migration's ``Rehome`` and a driver's
``DriverLink``; the ``ResumeWindow`` that asks the drivers to resume (fake
asks answered by the test: no driver, no sleep); and the shape of the
agent's package (each module under 400 lines, the NIC over netlink only).
"""

from __future__ import annotations

import functools
import pathlib
import queue
import socket
import threading

import pytest

from accelmig.agent.daemon.drivers import DriverAsk, DriverEvent, DriverLink, DriverState
from accelmig.agent.daemon.netconfig import NetworkConfigurator
from accelmig.agent.daemon.rehome import Rehome, RehomeEvent, RehomeState, ResumeWindow
from accelmig.runtime.statemachine import IllegalTransition
from accelmig.wire.errors import Unavailable
from tests.agent.test_state_machines import cells, reach

R, RE = RehomeState, RehomeEvent
D, DE = DriverState, DriverEvent

# A rehome: begun with the NIC to re-address or without; a failed NIC still
# resumes; every driver resumed or not; an error stops the attempt; an
# INCOMPLETE rehome delivered again retries, a SUCCEEDED one repeats.
REHOME_MOVES = [
    # from             event               to
    (R.RECEIVED,     RE.READDRESS,       R.READDRESSING),
    (R.INCOMPLETE,   RE.READDRESS,       R.READDRESSING),
    (R.RECEIVED,     RE.RESUME,          R.RESUMING),
    (R.INCOMPLETE,   RE.RESUME,          R.RESUMING),
    (R.READDRESSING, RE.NIC_DONE,        R.RESUMING),
    (R.READDRESSING, RE.NIC_FAILED,      R.RESUMING),
    (R.RESUMING,     RE.ALL_RESUMED,     R.SUCCEEDED),
    (R.RESUMING,     RE.NOT_ALL_RESUMED, R.INCOMPLETE),
    (R.READDRESSING, RE.FAILED,          R.INCOMPLETE),
    (R.RESUMING,     RE.FAILED,          R.INCOMPLETE),
]
REHOME_REPEATS = {RE.DELIVERED_AGAIN: {R.SUCCEEDED}}

# A driver's link: it overflows once, and is dropped once (EOF and a failed
# write may both drop it).
LINK_MOVES = [
    (D.OPEN,       DE.OVERFLOW, D.OVERFLOWED),
    (D.OPEN,       DE.DROP,     D.DROPPED),
    (D.OVERFLOWED, DE.DROP,     D.DROPPED),
]
LINK_REPEATS = {DE.DROP: {D.DROPPED}}


@pytest.fixture
def socket_pair():
    pair = socket.socketpair()
    yield pair
    for sock in pair:
        sock.close()


def _table(moves, events) -> dict:
    """The moves as ``reach`` and ``cells`` take them: event -> {from: to}."""
    table = {event: {} for event in events}
    for old, event, new in moves:
        table[event][old] = new
    return table


REHOME_TABLE = _table(REHOME_MOVES, RehomeEvent)
LINK_TABLE = _table(LINK_MOVES, DriverEvent)


def _check_every_cell(make, table, repeats):
    """Every (state, event) of the machine's enums: a listed move is taken,
    a repeat changes nothing, anything else raises and changes nothing."""
    taken = repeated = refused = 0
    for state, event in cells(table):
        machine = reach(make, table, state)
        if state in table[event]:
            assert machine.can(event)
            outcome = machine.fire(event)
            assert outcome is not None and machine.state is table[event][state], f"{event.name} in {state.name}"
            taken += 1
        elif state in repeats.get(event, ()):
            assert not machine.can(event) and machine.fire(event) is None and machine.state is state
            repeated += 1
        else:
            assert not machine.can(event)
            with pytest.raises(IllegalTransition, match=f"{event.name} in {state.name}"):
                machine.fire(event)
            assert machine.state is state
            refused += 1
    return taken, repeated, refused


def test_the_rehome_machine_takes_every_listed_move_and_refuses_the_rest():
    counts = _check_every_cell(functools.partial(Rehome, "m-1"), REHOME_TABLE, REHOME_REPEATS)
    assert counts == (10, 1, 29)            # 5 states x 8 events, every kind of cell met


def test_the_driver_link_machine_takes_every_listed_move_and_refuses_the_rest(socket_pair):
    counts = _check_every_cell(functools.partial(DriverLink, socket_pair[0]), LINK_TABLE, LINK_REPEATS)
    assert counts == (3, 1, 2)


def test_a_link_that_overflows_refuses_sends_and_is_dropped_once(socket_pair):
    woken = []
    socket_pair[0].setblocking(False)       # as the registry makes it
    link = DriverLink(socket_pair[0], wake=lambda: woken.append(1), max_backlog=1 << 14)
    asked = DriverAsk("s-1")
    link.ask(7, {"type": "resume", "sid": "s-1", "pad": "x" * 4096}, asked)    # the socket takes it
    while link.state is D.OPEN:             # nobody reads: the backlog grows past its bound
        link.ask(8, {"type": "resume", "sid": "s-2", "pad": "x" * 4096}, DriverAsk("s-2"))
    assert link.state is D.OVERFLOWED and woken
    refused = link.ask(9, {"type": "resume", "sid": "s-3"}, DriverAsk("s-3"))
    assert refused.answered and refused.reply["error"]["code"] == "UNAVAILABLE"
    assert link.drop() and link.state is D.DROPPED
    assert asked.answered and asked.reply["error"]["message"] == \
        Unavailable(what="the driver", reason="it went away").message
    assert not link.drop()                  # gone already: nothing happens twice


# -- the window -------------------------------------------------------------------------
class FakeDrivers:
    """Asks kept in flight until the test answers them; ``fail_at_once``:
    sids whose send fails on the asking thread itself (an unreachable driver)."""

    def __init__(self, fail_at_once=()):
        self.fail_at_once = set(fail_at_once)
        self.out: "queue.Queue[DriverAsk]" = queue.Queue()
        self.asked: list[str] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0

    def ask(self, link, sid, on_done) -> DriverAsk:
        ask = DriverAsk(sid, on_done=self._done(on_done))
        with self.lock:
            self.asked.append(sid)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        if sid in self.fail_at_once:
            ask.fail(Unavailable(what="the driver", reason="it cannot be reached"))
        else:
            self.out.put(ask)
        return ask

    def _done(self, on_done):
        def done(ask):
            with self.lock:
                self.in_flight -= 1
            on_done(ask)
        return done


@pytest.mark.parametrize("size,count,fail_at_once", [(1, 5, ()), (4, 37, ()), (8, 8, ()), (16, 3, ()),
                                                     (3, 20, {"s-0", "s-1", "s-2", "s-3", "s-9", "s-19"})])
def test_a_window_of_n_never_has_more_than_n_asks_out_and_asks_every_driver(size, count, fail_at_once):
    targets = [(object(), f"s-{i}") for i in range(count)]
    drivers = FakeDrivers(fail_at_once)
    window = ResumeWindow(targets, size, deadline=float("inf"), ask=drivers.ask)
    answerer_done = threading.Event()

    def answer():                         # the drivers answer on a thread of their own, in order
        while not window.settled.is_set():
            try:
                ask = drivers.out.get(timeout=0.1)
            except queue.Empty:
                continue
            ask.settle({"ok": True, "result": {}})
        answerer_done.set()

    threading.Thread(target=answer, daemon=True).start()
    window.start()
    assert window.settled.wait(30), f"the window never settled: {drivers.asked}"
    assert answerer_done.wait(30)
    assert sorted(drivers.asked) == sorted(sid for _, sid in targets)     # every one, once
    assert drivers.most <= size and window.most_in_flight <= size
    if not fail_at_once:
        assert window.most_in_flight == min(size, count)          # the window is used, not one at a time
    assert window.close() == [] and window.in_flight == 0
    assert [ask.sid for ask in window.asked] == drivers.asked


def test_a_window_past_its_deadline_asks_nobody_and_says_whom():
    targets = [(object(), f"s-{i}") for i in range(3)]
    drivers = FakeDrivers()
    window = ResumeWindow(targets, 2, deadline=0.0, ask=drivers.ask)     # long past
    window.start()
    assert window.settled.is_set() and drivers.asked == []
    assert window.close() == targets


def test_a_late_answer_after_close_asks_nobody_else():
    targets = [(object(), f"s-{i}") for i in range(4)]
    drivers = FakeDrivers()
    window = ResumeWindow(targets, 1, deadline=float("inf"), ask=drivers.ask)
    window.start()
    assert drivers.asked == ["s-0"]
    assert window.close() == targets[1:]           # the rehome's time ran out
    drivers.out.get_nowait().settle({"ok": True, "result": {}})
    assert drivers.asked == ["s-0"] and window.settled.is_set()


# -- the package's shape ----------------------------------------------------------------
def test_each_module_of_the_agent_daemon_is_under_400_lines():
    folder = pathlib.Path(__file__).resolve().parents[2] / "agent" / "daemon"
    sizes = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert "agent.py" in sizes and "rehome.py" in sizes
    assert {name: n for name, n in sizes.items() if n >= 400} == {}


@pytest.mark.parametrize("args,kwargs", [((), {"method": "pyroute2"}), ((), {"use_pyroute2": True}),
                                         (("ip",), {}), ((), {"ip_tool": "/sbin/ip"})])
def test_the_removed_ways_to_configure_the_nic_are_refused_by_name(args, kwargs):
    with pytest.raises(TypeError, match="netlink only"):
        NetworkConfigurator(*args, **kwargs)
    assert NetworkConfigurator().method == "netlink"
