"""The guest side's two state machines: the driver's connection
(``LinkStateMachine``) and the agent's host channel (``ChannelStateMachine``),
against tables written out here.

Every listed move is taken, every repeat changes nothing, every other
event raises and changes nothing; and a driver whose resume fails, however it fails, is never left
in RESUMING (a scripted pool plays the failures a real one rarely makes).
"""

from __future__ import annotations

import collections
import socket
import threading

import pytest

from accelmig.agent.daemon.channel import ChannelEvent, ChannelState, ChannelStateMachine
from accelmig.agent.driver import LinkState, connect
from accelmig.agent.driver.session import LinkEvent, LinkStateMachine
from accelmig.runtime.statemachine import IllegalTransition, StateMachine
from accelmig.wire.errors import ProtocolError, SessionLost, TicketInvalid, Unavailable
from accelmig.wire.frames import FrameReader, Limits, encode_frame
from tests.conftest import ALICE
from tests.support.wait import wait_for

S = LinkState
L = LinkEvent
C = ChannelState
E = ChannelEvent

# The tables as the docstrings draw them, written out here (never read from
# the machines): event -> {from: to}, and event -> states where it repeats.
LINK_TABLE = {
    L.OPENED: {S.CONNECTING: S.CONNECTED},
    L.LOST: {S.CONNECTING: S.DISCONNECTED, S.CONNECTED: S.DISCONNECTED, S.RESUMING: S.DISCONNECTED},
    L.RESUME: {S.CONNECTED: S.RESUMING, S.DISCONNECTED: S.RESUMING},
    L.ACCEPTED: {S.RESUMING: S.CONNECTED},
    L.FAIL: {S.CONNECTING: S.FAILED, S.CONNECTED: S.FAILED, S.DISCONNECTED: S.FAILED, S.RESUMING: S.FAILED},
    L.CLOSE: {S.CONNECTED: S.CLOSED, S.DISCONNECTED: S.CLOSED, S.RESUMING: S.CLOSED},
}
LINK_REPEATS: dict = {}
CHANNEL_TABLE = {
    E.HOST_WROTE: {C.NO_HOST: C.CONNECTED},
    E.HOST_SYNCED: {C.CONNECTED: C.SYNCED, C.SYNCED: C.SYNCED},
    E.HOST_GONE: {C.CONNECTED: C.NO_HOST, C.SYNCED: C.NO_HOST},
}
CHANNEL_REPEATS = {E.HOST_WROTE: {C.CONNECTED, C.SYNCED}, E.HOST_GONE: {C.NO_HOST}}
MACHINES = [(LinkStateMachine, LINK_TABLE, LINK_REPEATS), (ChannelStateMachine, CHANNEL_TABLE, CHANNEL_REPEATS)]
IDS = ["link", "channel"]


def reach(machine_cls, table, target) -> StateMachine:
    """A new machine brought to ``target`` by the events of the test's own
    table (breadth first from the initial state)."""
    machine = machine_cls()
    paths = {machine.state: []}
    queue = collections.deque([machine.state])
    while queue:
        state = queue.popleft()
        for event, rows in table.items():
            nxt = rows.get(state)
            if nxt is not None and nxt not in paths:
                paths[nxt] = paths[state] + [event]
                queue.append(nxt)
    assert target in paths, f"{target} cannot be reached from {machine.state}"
    for event in paths[target]:
        machine.fire(event)
    assert machine.state is target
    return machine


def cells(table):
    """Every (state, event) pair of the machine's enums."""
    states = {s for rows in table.values() for s in rows} | {t for rows in table.values() for t in rows.values()}
    state_enum = type(next(iter(states)))
    return [(state, event) for state in state_enum for event in table]


@pytest.mark.parametrize("machine_cls,table,repeats", MACHINES, ids=IDS)
def test_every_listed_move_is_taken(machine_cls, table, repeats):
    for event, rows in table.items():
        for old, new in rows.items():
            machine = reach(machine_cls, table, old)
            assert machine.can(event)
            outcome = machine.fire(event)
            assert outcome is not None and outcome.state is new
            assert machine.state is new, f"{event.name} in {old.name}"


@pytest.mark.parametrize("machine_cls,table,repeats", MACHINES, ids=IDS)
def test_every_repeat_changes_nothing(machine_cls, table, repeats):
    for event, where in repeats.items():
        for state in where:
            machine = reach(machine_cls, table, state)
            assert not machine.can(event)
            assert machine.fire(event) is None
            assert machine.state is state


@pytest.mark.parametrize("machine_cls,table,repeats", MACHINES, ids=IDS)
def test_every_other_event_raises_and_changes_nothing(machine_cls, table, repeats):
    refused = [(state, event) for state, event in cells(table)
               if state not in table[event] and state not in repeats.get(event, ())]
    assert refused
    for state, event in refused:
        machine = reach(machine_cls, table, state)
        assert not machine.can(event)
        with pytest.raises(IllegalTransition, match=f"{event.name} in {state.name}"):
            machine.fire(event)
        assert machine.state is state


def test_the_link_machine_names_its_states_and_reports_each_change():
    seen = []
    machine = LinkStateMachine(on_change=seen.append)
    assert machine.state is S.CONNECTING and not machine.connected and not machine.ended
    machine.fire(L.OPENED)
    assert machine.connected and not machine.ended and seen == [S.CONNECTED]
    for final in (S.FAILED, S.CLOSED):
        assert reach(LinkStateMachine, LINK_TABLE, final).ended
    with pytest.raises(IllegalTransition):
        reach(LinkStateMachine, LINK_TABLE, S.CLOSED).fire(L.CLOSE)   # closing twice is the caller's to check


def test_the_channel_machine_follows_the_host():
    channel = ChannelStateMachine()
    assert channel.state is C.NO_HOST
    channel.host_gone()                       # no host, none gone: nothing happens
    assert channel.state is C.NO_HOST
    with pytest.raises(IllegalTransition):
        channel.host_synced()                 # a sync arrives in bytes, which say a host is there
    channel.host_wrote()
    channel.host_wrote()                      # more bytes from the same host
    assert channel.state is C.CONNECTED
    channel.host_synced()
    channel.host_synced()                     # a second sync on the same connection
    assert channel.state is C.SYNCED
    channel.host_wrote()
    assert channel.state is C.SYNCED
    channel.host_gone()
    assert channel.state is C.NO_HOST


# -- the driver never stays in RESUMING ---------------------------------------------
def _recv_frame(conn: socket.socket, reader: FrameReader):
    """The next frame's header; frames that came in the same read wait for
    the next call (a driver sends its open with its hello)."""
    pending = reader.__dict__.setdefault("pending", [])
    while not pending:
        n = conn.recv_into(reader.get_buffer())
        if n == 0:
            return None
        pending += reader.feed(n)
    return pending.pop(0).header


class ScriptedPool:
    """The pool's side of the data-plane handshakes, by script: each new
    connection is welcomed, then its request (open or resume) goes to the
    next script."""

    def __init__(self, *scripts):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.scripts = list(scripts)
        self.requests: list[dict] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.scripts:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            reader = FrameReader(Limits())
            if _recv_frame(conn, reader) is None:
                continue
            conn.sendall(encode_frame({"op": "welcome", "version": 1, "instance": "scripted",
                                       "challenge": "c"}))
            request = _recv_frame(conn, reader)
            if request is None:
                continue
            self.requests.append(request)
            self.scripts.pop(0)(conn, reader, request)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()

    # -- scripts ----------------------------------------------------------------------
    @staticmethod
    def _answer_commands(conn, reader) -> None:
        def run():
            try:
                while True:
                    header = _recv_frame(conn, reader)
                    if header is None:
                        return
                    if "seq" in header:
                        conn.sendall(encode_frame({"op": "reply", "seq": header["seq"], "ok": True}))
            except OSError:
                pass
        threading.Thread(target=run, daemon=True).start()

    @classmethod
    def opened(cls, conn, reader, request) -> None:
        conn.sendall(encode_frame({"op": "opened", "sid": "s-scripted", "epoch": 1}))
        cls._answer_commands(conn, reader)

    @classmethod
    def resumed(cls, conn, reader, request) -> None:
        conn.sendall(encode_frame({"op": "resumed", "sid": request["sid"], "epoch": request["epoch"] + 1,
                                   "expect": request["next_seq"], "replay": 0}))
        cls._answer_commands(conn, reader)

    @staticmethod
    def hang_up(conn, reader, request) -> None:
        conn.close()

    @staticmethod
    def wrong_answer(conn, reader, request) -> None:
        conn.sendall(encode_frame({"op": "opened", "sid": "s-other", "epoch": 9}))

    @staticmethod
    def session_lost(conn, reader, request) -> None:
        conn.sendall(encode_frame({"op": "error", "error": {"code": "SESSION_LOST",
                                                            "message": "the pool restarted"}}))

    @staticmethod
    def resumed_then_nonsense(conn, reader, request) -> None:
        # Accepted, and in the same segment a reply to a command never sent.
        conn.sendall(encode_frame({"op": "resumed", "sid": request["sid"], "epoch": request["epoch"] + 1,
                                   "expect": request["next_seq"], "replay": 0})
                     + encode_frame({"op": "reply", "seq": 99, "ok": True}))


@pytest.fixture
def scripted():
    pools = []

    def make(*scripts):
        pools.append(ScriptedPool(*scripts))
        return pools[-1]
    yield make
    for p in pools:
        p.close()


def _device(endpoint):
    return connect(endpoint, "token", agent=False, timeout=2, connect_timeout=2, auto_reconnect=False)


@pytest.mark.parametrize("failure,error", [
    (ScriptedPool.hang_up, Unavailable),
    (ScriptedPool.wrong_answer, ProtocolError),
], ids=["hang-up", "wrong-answer"])
def test_a_failed_resume_leaves_the_driver_disconnected_and_a_new_one_connects(scripted, failure, error):
    pool = scripted(ScriptedPool.opened, failure, ScriptedPool.resumed)
    dev = _device(pool.endpoint)
    assert dev.state is S.CONNECTED
    dev.finish()
    with pytest.raises(error):
        dev.resume()
    assert dev.state is S.DISCONNECTED
    outcome = dev.resume()
    assert dev.state is S.CONNECTED and outcome["epoch"] == 2
    dev.finish()
    assert [r["op"] for r in pool.requests] == ["open", "resume", "resume"]
    dev.close()
    assert dev.state is S.CLOSED


def test_a_resume_to_nowhere_leaves_the_driver_disconnected(scripted):
    pool = scripted(ScriptedPool.opened, ScriptedPool.resumed)
    dev = _device(pool.endpoint)
    nowhere = socket.create_server(("127.0.0.1", 0))
    port = nowhere.getsockname()[1]
    nowhere.close()                                      # nothing listens there now
    with pytest.raises(Unavailable):
        dev.resume(f"127.0.0.1:{port}")
    assert dev.state is S.DISCONNECTED
    dev.resume(pool.endpoint)
    assert dev.state is S.CONNECTED
    dev.close()


def test_a_terminal_refusal_of_a_resume_fails_the_session(scripted):
    pool = scripted(ScriptedPool.opened, ScriptedPool.session_lost)
    dev = _device(pool.endpoint)
    with pytest.raises(SessionLost, match="the pool restarted"):
        dev.resume()
    assert dev.state is S.FAILED
    with pytest.raises(SessionLost):
        dev.finish()
    with pytest.raises(SessionLost):
        dev.resume()                                     # no way back, and no new connection
    assert len(pool.requests) == 2
    dev.close()
    assert dev.state is S.FAILED                         # closing keeps why it ended


def test_nonsense_right_after_an_accepted_resume_never_leaves_it_resuming(scripted):
    """The frames that come with the pool's answer are dispatched by the
    resume itself: one the window cannot match loses that link, as it would
    from the reader, instead of escaping the resume half done."""
    pool = scripted(ScriptedPool.opened, ScriptedPool.resumed_then_nonsense, ScriptedPool.resumed)
    dev = _device(pool.endpoint)
    dev.resume()
    assert dev.state is not S.RESUMING
    wait_for(lambda: dev.state is S.DISCONNECTED, what="the link lost to the nonsense")
    dev.resume()
    assert dev.state is S.CONNECTED
    dev.finish()
    dev.close()


def test_a_real_pool_refusing_a_ticket_leaves_the_driver_disconnected(pool):
    dev = connect(pool.endpoint, ALICE, agent=False, timeout=5, auto_reconnect=False)
    buf = dev.upload(b"kept")
    with pytest.raises(TicketInvalid, match="not an accelmig ticket"):
        dev.resume(pool.endpoint, "garbage")
    assert dev.state is S.DISCONNECTED
    dev.resume()
    assert dev.state is S.CONNECTED and dev.read(buf) == b"kept"
    dev.close()
