"""Local clients that never read cannot stall a real ``accelmig-agent run``
(issue 14, item 10), and a line nested too deeply costs only itself (low
items).

The agent answers every driver through a bounded outgoing buffer that its
poll loop writes when the socket is writable: while three clients that
never read pile answers up, the host's ping and a fourth client's status
are answered, and the three get every answer once they read.  A client
that lets more pile up than the bound is dropped, and only it.
"""

from __future__ import annotations

import socket
import threading

from accelmig.agent.daemon.drivers import DriverLink
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.channel import LineClient
from tests.support.processes import AgentProcess

BACKLOG = getattr(DriverLink, "MAX_BACKLOG", 1 << 20)       # what the agent keeps for a client that does not read


def _where_answer_size(path) -> int:
    with LineClient(path, timeout=30) as client:
        answer = client.call("where")
    return len(ch.encode(ch.result(10 ** 6, result=answer)))


class Stalled:
    """A local client that sends ``count`` requests and reads nothing until told."""

    def __init__(self, path, count: int, first_id: int = 1):
        self.count = count
        self.sock = ch.connect_unix(str(path), 30)
        self.ids = range(first_id, first_id + count)
        requests = b"".join(ch.encode({"type": "where", "id": i}) for i in self.ids)
        self.sent = threading.Event()
        # sendall from a thread: while the agent is stuck it reads nothing either
        self.thread = threading.Thread(target=self._send, args=(requests,), daemon=True)
        self.thread.start()

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass
        self.sent.set()

    def read_answers(self) -> list:
        """Every answer until the agent closes or all came (its ids)."""
        parser, got = ch.LineParser(), []
        while len(got) < self.count:
            try:
                data = self.sock.recv(1 << 16)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            got += [m["id"] for m in parser.feed(data) if m.get("type") == "result"]
        return got

    def close(self) -> None:
        self.sock.close()
        self.thread.join(30)


def test_clients_that_never_read_do_not_stall_the_host_channel_or_other_clients(tmp_path):
    proc = AgentProcess(tmp_path)
    stalled = []
    try:
        # well past what a socket buffers, well below the agent's bound
        count = BACKLOG // 2 // _where_answer_size(tmp_path / "agent.sock")
        with GuestChannel(str(tmp_path / "channel.sock")) as host:
            host.connect()
            stalled = [Stalled(tmp_path / "agent.sock", count) for _ in range(3)]
            for client in stalled:
                assert client.sent.wait(30), "the agent stopped reading a client's requests"
            # liveness, not speed: the bound only ends a test that would hang.  What
            # matters is the order: these are answered while the three are still
            # connected (the agent used to block 5 s on each, then drop it)
            assert host.request("ping", timeout=30)["pong"] is True
            with LineClient(tmp_path / "agent.sock", timeout=30) as fourth:
                assert fourth.call("status")["channel"] == "synced"
            assert host.request("ping", timeout=30)["pong"] is True
        # ... and the stalled ones were kept, not dropped: each gets every answer
        for client in stalled:
            assert client.read_answers() == list(client.ids)
        assert not [e for e in proc.seen if "dropped" in e["msg"]]
    finally:
        for client in stalled:
            client.close()
        assert proc.stop() == 0


def test_a_client_that_lets_too_much_pile_up_is_dropped_and_only_it(tmp_path):
    proc = AgentProcess(tmp_path)
    try:
        count = 3 * BACKLOG // _where_answer_size(tmp_path / "agent.sock")
        with GuestChannel(str(tmp_path / "channel.sock")) as host, \
                LineClient(tmp_path / "agent.sock", timeout=30) as reader:
            host.connect()
            assert reader.call("register", sid="s-reads", endpoint="10.0.0.1:7070") == \
                {"registered": "s-reads"}
            flood = Stalled(tmp_path / "agent.sock", count)
            try:
                entry = proc.wait_log(lambda e: "dropped" in e["msg"])
                assert entry["level"] == "warning" and "does not read" in entry["msg"], entry
                got = flood.read_answers()
                assert 0 < len(got) < count and got == list(flood.ids)[:len(got)]
            finally:
                flood.close()
            # everyone else goes on
            assert host.request("ping", timeout=30)["pong"] is True
            assert [s["sid"] for s in reader.call("status")["sessions"]] == ["s-reads"]
    finally:
        assert proc.stop() == 0


def _answer(sock, session: ch.LineSession, want: int):
    """The answer with id ``want``, read off ``sock`` (its timeout bounds the wait)."""
    while True:
        data = sock.recv(1 << 16)
        assert data, "the agent closed"
        for kind, msg_id, message in session.feed(data):
            if kind in ("answer", "synced") and msg_id == want:
                return message


def test_a_line_nested_too_deeply_costs_only_itself(tmp_path):
    """It used to raise RecursionError out of the parser: the rest of that
    read, a ping with it, was lost."""
    proc = AgentProcess(tmp_path)
    nested = b'{"type":"ping","id":1,"x":' + b"[" * 100000 + b"]" * 100000 + b"}\n"
    try:
        with ch.connect_unix(str(tmp_path / "channel.sock"), 30) as host:
            session = ch.LineSession("test-host")
            sync_id, sync = session.sync()
            host.sendall(sync)
            assert _answer(host, session, sync_id)["nonce"] == session.wanted_nonce
            # one write: the ping after it arrives in the same read as the nested line's end
            host.sendall(nested + ch.encode({"type": "ping", "id": 777}))
            assert _answer(host, session, 777)["result"]["pong"] is True
        entry = proc.wait_log(lambda e: "dropped input" in e["msg"])
        assert "nested too deeply" in entry["msg"]
        with ch.connect_unix(str(tmp_path / "agent.sock"), 30) as driver:     # the local socket too
            driver.sendall(nested + ch.encode({"type": "where", "id": 5}))
            answer = _answer(driver, ch.LineSession("test-driver"), 5)
            assert answer["ok"] is True and answer["result"]["endpoint"] is None
        assert not [e for e in proc.seen if "failed" in e["msg"]]
    finally:
        assert proc.stop() == 0
