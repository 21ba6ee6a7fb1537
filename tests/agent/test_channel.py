"""The host<->guest channel: parser, handshake, drops, garbage, EAGAIN —
with the real agent, over a unix socket and over a pty."""

from __future__ import annotations

import os
import pty
import select
import socket
import threading
import time

import pytest

from accelmig.agent.daemon import Agent, ChannelState
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.errors import BadRequest, ErrorCode, UnknownOp
from tests.support.wait import wait_for


def test_parser_resynchronises_on_garbage_partial_and_oversized_lines():
    parser = ch.LineParser(max_line=100)
    got = parser.feed(b'{"type":"ping","id":1}\nnot json at all\n{"type":"ping",')
    assert got == [{"type": "ping", "id": 1}]
    assert "not JSON" in parser.dropped[-1]
    got = parser.feed(b'"id":2}\n[1,2]\n{"no":"type"}\n')
    assert got == [{"type": "ping", "id": 2}]
    assert len(parser.dropped) == 3
    got = parser.feed(b'{"type":"x","pad":"' + b"a" * 200 + b'"}\n{"type":"after","id":3}\n')
    assert got == [{"type": "after", "id": 3}] and "longer than 100" in parser.dropped[-1]
    # a partial line, then the sentinel of a host that reconnected
    got = parser.feed(b'{"type":"rehome","id":9,"migra' + ch.SENTINEL + b'{"type":"sync","id":4,"nonce":"n"}\n')
    assert got == [{"type": "sync", "id": 4, "nonce": "n"}] and parser.resyncs == 1
    assert "cut by a resync" in parser.dropped[-1]
    # invalid UTF-8
    assert parser.feed(b'{"type":"\xc3\x28"}\n') == [] and "not JSON" in parser.dropped[-1]


def test_encoded_lines_never_contain_the_sentinel():
    line = ch.encode({"type": "x", "text": "ÿ naïve \u00ff \xff"})
    assert ch.SENTINEL not in line and line.endswith(b"\n")
    assert ch.LineParser().feed(line)[0]["text"] == "ÿ naïve \u00ff \xff"


def test_handshake_hello_ping_status_and_unknown_requests(agent):
    with GuestChannel(agent.port_path) as host:
        hello = host.connect()
        assert hello["agent_version"] and hello["protocol"] == ch.CHANNEL_PROTOCOL
        assert hello["guest"]["hostname"] == socket.gethostname() and hello["sessions"] == []
        assert host.request("ping")["pong"] is True
        assert host.request("status")["channel"] == "synced"
        with pytest.raises(UnknownOp, match="teleport"):
            host.request("teleport")
        # the agent refuses it (BadRequest, from HostIdentity.from_wire), at once:
        # a Timeout would also mention "identity", so the type and the reason both count
        with pytest.raises(BadRequest, match="identity lacks 'host_id'") as refused:
            host.request("identity", timeout=5, identity={"nope": 1})
        assert type(refused.value) is BadRequest and refused.value.code is ErrorCode.BAD_REQUEST
        assert host.request("ping")["pong"] is True        # and the channel goes on


def test_host_drops_mid_message_and_comes_back(agent):
    host = socket.socket(socket.AF_UNIX)
    host.connect(agent.port_path)
    host.sendall(b'{"type":"identity","id":7,"identity":{"host_id":"A","pool_en')
    host.close()                                    # gone half-way through a line
    wait_for(lambda: agent.state is ChannelState.NO_HOST, 5, "the agent to see the host end gone (NO_HOST)",
             interval=0.01)
    with GuestChannel(agent.port_path) as again:    # the next host end starts clean
        again.connect()
        answer = again.request("identity", identity={"host_id": "hostB", "pool_endpoint": "10.0.0.1:7070"})
        assert answer == {"accepted": True, "network": []}     # no guest NIC in this identity
    assert agent.identity.host_id == "hostB"
    assert agent.status()["identity"]["pool_endpoint"] == "10.0.0.1:7070"


def test_stale_output_before_the_sync_answer_is_ignored_by_the_host(agent):
    with GuestChannel(agent.port_path) as host:
        host.connect()
        # Garbage from the host side: the agent drops it and goes on.
        host._send(b"\x00\x01 rubbish\n{broken json\n")
        assert host.request("ping")["pong"]
        assert any("not JSON" in reason for reason in agent.parser.dropped)
        # A second sync on the same connection: a fresh hello.
        assert host.sync()["type"] == "hello"


def test_identity_survives_an_agent_restart(tmp_path):
    state = str(tmp_path / "state")
    first = Agent(str(tmp_path / "c1.sock"), str(tmp_path / "a1.sock"), state_dir=state)
    from accelmig.wire.identity import HostIdentity
    first.channel.store_identity(HostIdentity(host_id="hostA", pool_endpoint="10.88.0.1:7070"))
    second = Agent(str(tmp_path / "c2.sock"), str(tmp_path / "a2.sock"), state_dir=state)
    assert second.identity.pool_endpoint == "10.88.0.1:7070"


def _read_until(fd: int, predicate, timeout: float = 5.0) -> bytes:
    data = b""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            data += os.read(fd, 65536)
            if predicate(data):
                return data
    raise AssertionError(f"timed out; got {data!r}")


def test_over_a_pty_garbage_resync_and_a_full_buffer(tmp_path):
    """The agent's VirtioPort on a real character device (a pty: the master
    plays the host).  Filling the pty while the host reads nothing makes the
    agent's writes fail with EAGAIN: it must wait and deliver everything."""
    master, slave = pty.openpty()
    agent = Agent(os.ttyname(slave), str(tmp_path / "agent.sock"), state_dir=str(tmp_path / "s"))
    agent.open()
    os.close(slave)        # the agent holds its own descriptor of the device
    import termios
    import tty
    tty.setraw(master, termios.TCSANOW)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        os.write(master, b"garbage\x00\x01 {half a line")
        os.write(master, ch.SENTINEL + ch.encode({"type": "sync", "id": 1, "nonce": "abc"}))
        data = _read_until(master, lambda d: b'"hello"' in d)
        assert ch.SENTINEL in data and b'"nonce":"abc"' in data
        assert agent.state is ChannelState.SYNCED
        assert any("not JSON" in r or "cut by a resync" in r for r in agent.parser.dropped)
        # Ask for many answers and read none: the pty's buffer fills up.
        pad = "x" * 2000
        for i in range(60):
            os.write(master, ch.encode({"type": "ping", "id": 100 + i, "pad": pad}))
            os.write(master, ch.encode({"type": "status", "id": 200 + i}))
        wait_for(lambda: agent.port.write_waits > 0, 10, "the agent's writes to the full pty to hit EAGAIN")
        got = _read_until(master, lambda d: d.count(b'"type":"result"') >= 120, timeout=20)
        parser = ch.LineParser()
        answers = [m for m in parser.feed(got.replace(ch.SENTINEL, b"")) if m.get("type") == "result"]
        assert sorted(m["id"] for m in answers) == sorted([100 + i for i in range(60)] +
                                                          [200 + i for i in range(60)])
        assert agent.port.write_waits > 0, "the pty never filled up: EAGAIN was not exercised"
    finally:
        agent.stop()
        thread.join(5)
        os.close(master)
