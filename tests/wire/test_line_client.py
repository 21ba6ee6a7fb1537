"""The one line conversation (accelmig.wire.channel): the sans-IO session
and the blocking client every unix-socket peer uses (the driver and the
agent, the hook and the CLI and hostd, the lab's responder), against a
scripted peer on a real socket."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from accelmig.wire import channel as ch
from accelmig.wire.errors import NoSuchObject, Timeout, Unavailable


def line(message: dict) -> bytes:
    return ch.encode(message)


def test_a_gated_session_drops_everything_before_its_own_sync_answer():
    session = ch.LineSession("t", gated=True, first_id=100)
    sync_id, frame = session.sync()
    assert frame.startswith(ch.SENTINEL) and json.loads(frame[1:])["nonce"] == session.wanted_nonce
    stale = line({"type": "result", "id": 7, "ok": True}) + line({"type": "sync", "id": 1, "nonce": "old"})
    assert session.feed(stale + line({"type": "hello", "id": 0})) == []
    answer = line({"type": "sync", "id": sync_id, "nonce": session.wanted_nonce})
    items = session.feed(answer + line({"type": "hello", "id": 0}) + line({"type": "result", "id": 101, "ok": True}))
    assert [(k, i) for k, i, _ in items] == [("synced", sync_id), ("event", 0), ("answer", 101)]
    # a new handshake gates again: the next sync's nonce, and nothing else, opens it
    session.sync()
    assert session.feed(line({"type": "result", "id": 102, "ok": True})) == []


def test_answers_decode_into_results_or_the_typed_error():
    assert ch.answer_of({"type": "result", "id": 1, "ok": True, "result": {"a": 1}}) == {"a": 1}
    with pytest.raises(NoSuchObject, match="no such"):
        ch.answer_of({"type": "result", "id": 1, "ok": False,
                      "error": {"code": NoSuchObject.code.value, "message": "no such session s1"}})


class Peer:
    """A unix-socket peer on a thread: ``script(message, send)`` for each line."""

    def __init__(self, path: str, script):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(4)
        self.script = script
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            parser = ch.LineParser()
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                for message in parser.feed(data):
                    if self.script(message, lambda m: conn.sendall(line(m))) == "close":
                        return

    def close(self):
        self.listener.close()


def test_a_call_skips_stale_answers_and_keeps_what_else_arrived_in_order(tmp_path):
    def script(message, send):
        if message["type"] == "slow":
            return                                  # never answered in time
        send({"type": "result", "id": message["id"] - 1, "ok": True, "result": "stale"})
        send({"type": "resume", "id": 900, "sid": "s1"})
        send({"type": "result", "id": message["id"], "ok": True, "result": {"echo": message.get("data")}})
        send({"type": "resume", "id": 901, "sid": "s2"})

    peer = Peer(str(tmp_path / "p.sock"), script)
    with ch.LineClient(str(tmp_path / "p.sock"), timeout=5, what="the peer") as client:
        with pytest.raises(Timeout, match="the peer's answer to slow"):
            client.call("slow", timeout=0.2)
        assert client.call("echo", data=[1, 2]) == {"echo": [1, 2]}
        # the stale answer was dropped; the peer's own requests wait for recv
        assert [client.recv(timeout=5)["id"] for _ in range(2)] == [900, 901]
    peer.close()


def test_a_closed_or_absent_peer_is_unavailable_not_an_oserror(tmp_path):
    with pytest.raises(Unavailable, match="the agent is unavailable"):
        ch.LineClient(str(tmp_path / "nobody.sock"), what="the agent")

    def script(message, send):
        return "close"                             # the peer hangs up without an answer

    peer = Peer(str(tmp_path / "p.sock"), script)
    with ch.LineClient(str(tmp_path / "p.sock"), timeout=5, what="the agent") as client:
        with pytest.raises(Unavailable, match="closed"):
            client.call("ping")
        assert client.recv(timeout=1) is None
    peer.close()


def test_a_socket_path_longer_than_sun_path_is_reached_through_its_directory(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = str(deep / "channel.sock")
    assert len(os.fsencode(path)) > 108
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dirfd = os.open(str(deep), os.O_PATH | os.O_DIRECTORY)
    try:
        listener.bind(f"/proc/self/fd/{dirfd}/channel.sock")
    finally:
        os.close(dirfd)
    listener.listen(1)
    sock = ch.connect_unix(path, 5)
    accepted, _ = listener.accept()
    sock.sendall(b"x")
    assert accepted.recv(1) == b"x"
    for s in (sock, accepted, listener):
        s.close()
