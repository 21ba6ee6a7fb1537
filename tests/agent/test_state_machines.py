"""The guest side's two state machines: the driver's connection
(``LinkStateMachine``) and the agent's host channel (``ChannelStateMachine``).

Every legal transition is taken, every other one raises and changes
nothing; and a driver whose resume fails, however it fails, is never left
in RESUMING (a scripted pool plays the failures a real one rarely makes).
"""

from __future__ import annotations

import collections
import socket
import threading

import pytest

from accelmig.agent.daemon.channel import ChannelState, ChannelStateMachine
from accelmig.agent.driver import LinkState, connect
from accelmig.agent.driver.session import LinkStateMachine
from accelmig.agent.statemachine import IllegalTransition, StateMachine
from accelmig.wire.errors import ProtocolError, SessionLost, TicketInvalid, Unavailable
from accelmig.wire.frames import FrameReader, Limits, encode_frame
from tests.conftest import ALICE
from tests.support.wait import wait_for

S = LinkState
C = ChannelState

LINK_TABLE = {
    S.CONNECTING: {S.CONNECTED, S.DISCONNECTED, S.FAILED},
    S.CONNECTED: {S.DISCONNECTED, S.RESUMING, S.FAILED, S.CLOSED},
    S.DISCONNECTED: {S.RESUMING, S.FAILED, S.CLOSED},
    S.RESUMING: {S.CONNECTED, S.DISCONNECTED, S.FAILED, S.CLOSED},
    S.FAILED: set(),
    S.CLOSED: set(),
}
CHANNEL_TABLE = {
    C.NO_HOST: {C.CONNECTED},
    C.CONNECTED: {C.SYNCED, C.NO_HOST},
    C.SYNCED: {C.SYNCED, C.NO_HOST},
}
MACHINES = [(LinkStateMachine, LINK_TABLE), (ChannelStateMachine, CHANNEL_TABLE)]


def reach(machine_cls, target) -> StateMachine:
    """A new machine brought to ``target`` along legal transitions only."""
    machine = machine_cls()
    paths = {machine.state: []}
    queue = collections.deque([machine.state])
    while queue:
        state = queue.popleft()
        for nxt in machine_cls.TRANSITIONS[state]:
            if nxt not in paths:
                paths[nxt] = paths[state] + [nxt]
                queue.append(nxt)
    assert target in paths, f"{target} cannot be reached from {machine.state}"
    for state in paths[target]:
        machine.to(state)
    assert machine.state is target
    return machine


def pairs(table, legal: bool):
    return [(a, b) for a in table for b in table if (b in table[a]) is legal]


@pytest.mark.parametrize("machine_cls,table", MACHINES, ids=["link", "channel"])
def test_the_tables_are_the_documented_ones(machine_cls, table):
    assert {a: set(b) for a, b in machine_cls.TRANSITIONS.items()} == table
    assert set(machine_cls.TRANSITIONS) == set(type(next(iter(table))))   # every state described


@pytest.mark.parametrize("machine_cls,table", MACHINES, ids=["link", "channel"])
def test_every_legal_transition(machine_cls, table):
    for old, new in pairs(table, legal=True):
        machine = reach(machine_cls, old)
        assert machine.allows(new)
        assert machine.to(new) is old
        assert machine.state is new


@pytest.mark.parametrize("machine_cls,table", MACHINES, ids=["link", "channel"])
def test_every_illegal_transition_raises_and_changes_nothing(machine_cls, table):
    illegal = pairs(table, legal=False)
    assert illegal
    for old, new in illegal:
        machine = reach(machine_cls, old)
        assert not machine.allows(new)
        with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
            machine.to(new)
        assert machine.state is old


def test_the_link_machine_names_its_states():
    machine = LinkStateMachine()
    assert machine.state is S.CONNECTING and not machine.connected and not machine.ended
    machine.to(S.CONNECTED)
    assert machine.connected and not machine.ended
    for final in (S.FAILED, S.CLOSED):
        assert reach(LinkStateMachine, final).ended
    with pytest.raises(IllegalTransition):
        reach(LinkStateMachine, S.CLOSED).to(S.CLOSED)        # closing twice is the caller's to check


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


def test_a_table_that_names_an_undescribed_state_is_refused_at_once():
    import enum

    class Colour(enum.Enum):
        RED = 1
        GREEN = 2

    with pytest.raises(TypeError, match="undescribed"):
        class Broken(StateMachine):           # noqa: F841
            TRANSITIONS = {Colour.RED: frozenset({Colour.GREEN})}

    class Fine(StateMachine):
        TRANSITIONS = {Colour.RED: frozenset({Colour.GREEN}), Colour.GREEN: frozenset()}

    with pytest.raises(ValueError, match="unknown state"):
        Fine("blue")


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
