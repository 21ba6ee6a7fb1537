"""What a local client of the guest agent (any process of the guest: the
socket is mode 0666) may register, and what it may send (issue 14, fuzz
findings): a bounded number of sessions, per connection and in all, each
refused beyond the bound with a clear error; a field of the wrong type
answered ``BAD_REQUEST`` (or, for an answer to nothing the agent asked,
dropped with its reason), the rest of the same read still handled.

The per-connection bound on a real ``accelmig-agent run`` process; the total
on an agent on a thread with a small bound (4096 sessions are 4096 log
lines and host events for nothing).
"""

from __future__ import annotations

import socket
import threading

import pytest

from accelmig.agent.daemon import Agent
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.channel import LineClient
from accelmig.wire.errors import BadRequest, QuotaExceeded
from tests.support.processes import AgentProcess


def _answers(sock: socket.socket, ids) -> dict:
    """The answers with ``ids`` read off ``sock``, by id (its timeout bounds the wait)."""
    want, got = set(ids), {}
    parser = ch.LineParser(max_line=1 << 24)
    while not want <= set(got):
        data = sock.recv(1 << 16)
        assert data, f"the agent closed; answered {sorted(got)}"
        for message in parser.feed(data):
            if message.get("type") == "result" and message.get("id") in want:
                got[message["id"]] = message
    return got


def _register(i: int, sid: str) -> bytes:
    return ch.encode({"type": "register", "id": i, "sid": sid, "endpoint": "10.0.0.1:7070", "name": "t"})


def test_one_connection_may_register_only_so_many_sessions(tmp_path):
    limit = Agent.MAX_SESSIONS_PER_LINK
    proc = AgentProcess(tmp_path)
    try:
        with ch.connect_unix(str(tmp_path / "agent.sock"), 30) as sock:
            # one write: every register past the bound, and a where behind them, in the same reads
            sock.sendall(b"".join(_register(i, f"s-{i}") for i in range(1, limit + 3)) +
                         ch.encode({"type": "where", "id": 10_000}))
            got = _answers(sock, [*range(1, limit + 3), 10_000])
            assert all(got[i]["ok"] and got[i]["result"] == {"registered": f"s-{i}"} for i in range(1, limit + 1))
            for i in (limit + 1, limit + 2):
                error = got[i]["error"]
                assert not got[i]["ok"] and error["code"] == "QUOTA_EXCEEDED", got[i]
                assert f"this connection already holds {limit} sessions" in error["message"], error
                assert f"register session s-{i}" in error["message"], error
            assert got[10_000]["ok"] is True
            # registering one it holds again is no new one; unregistering one makes room
            sock.sendall(_register(20_001, "s-1") + ch.encode({"type": "unregister", "id": 20_002, "sid": "s-2"}) +
                         _register(20_003, f"s-{limit + 1}") + _register(20_004, "s-one-too-many"))
            got = _answers(sock, [20_001, 20_002, 20_003, 20_004])
            assert got[20_001]["result"] == {"registered": "s-1"}
            assert got[20_002]["result"] == {"unregistered": "s-2"}
            assert got[20_003]["result"] == {"registered": f"s-{limit + 1}"}
            assert got[20_004]["error"]["code"] == "QUOTA_EXCEEDED"
            # another connection is not bound by this one's sessions
            with LineClient(tmp_path / "agent.sock", timeout=30) as other:
                assert other.call("register", sid="s-other") == {"registered": "s-other"}
                assert len(other.call("status")["sessions"]) == limit + 1
        assert not [e for e in proc.entries() if e.get("level") in ("error", "critical") or "exc" in e]
    finally:
        assert proc.stop() == 0


@pytest.fixture
def small_agent(agent_on_thread):
    """An agent on a thread that keeps at most 4 sessions, 3 per connection."""
    return agent_on_thread(max_sessions_per_link=3, max_sessions=4)


def test_all_connections_together_may_register_only_so_many_sessions(small_agent):
    path = small_agent.socket_path
    with LineClient(path, timeout=10) as first, LineClient(path, timeout=10) as second, \
            LineClient(path, timeout=10) as third:
        for sid in ("a-1", "a-2", "a-3"):
            first.call("register", sid=sid)
        second.call("register", sid="b-1")
        with pytest.raises(QuotaExceeded) as refused:
            third.call("register", sid="c-1")
        assert "the agent already holds 4 sessions" in refused.value.message
        assert "(4)" in refused.value.message
        # the same process moving a session to a new connection keeps the total: allowed
        assert third.call("register", sid="a-1") == {"registered": "a-1"}
        assert sorted(s["sid"] for s in third.call("status")["sessions"]) == ["a-1", "a-2", "a-3", "b-1"]
        # one gone makes room
        assert second.call("unregister", sid="b-1") == {"unregistered": "b-1"}
        assert third.call("register", sid="c-1") == {"registered": "c-1"}
        assert len(small_agent.sessions()) == 4


@pytest.mark.parametrize("fields, words", [
    ({"sid": [1]}, "sid must be a string of 1 to 256 characters, not a list"),
    ({"sid": ""}, "sid must be a string"),
    ({"sid": "s" * 257}, "not a string of 257 characters"),
    ({"sid": "s-1", "endpoint": 5}, "endpoint must be a string"),
    ({"sid": "s-1", "name": {"a": 1}}, "name must be a string"),
    ({"sid": "s-1", "epoch": "1"}, "epoch must be an integer"),
    ({"sid": "s-1", "epoch": True}, "epoch must be an integer"),
    ({"sid": "s-1", "epoch": -1}, "epoch must be an integer"),
])
def test_a_register_with_a_field_of_the_wrong_type_is_refused_clearly(agent, fields, words):
    with ch.connect_unix(agent.socket_path, 10) as sock:
        sock.sendall(ch.encode({"type": "register", "id": 1, **fields}) + ch.encode({"type": "where", "id": 2}))
        got = _answers(sock, [1, 2])
    assert got[1]["error"]["code"] == "BAD_REQUEST" and words in got[1]["error"]["message"], got[1]
    assert got[2]["ok"] is True
    assert agent.sessions() == []


def test_a_long_name_is_cut_and_a_long_endpoint_refused(agent):
    with LineClient(agent.socket_path, timeout=10) as client:
        assert client.call("register", sid="s-1", name="n" * 5000) == {"registered": "s-1"}
        with pytest.raises(BadRequest, match="endpoint must be a string of at most 1024 characters"):
            client.call("register", sid="s-2", endpoint="e" * 1025)
        assert [(s["sid"], s["name"]) for s in agent.sessions()] == [("s-1", "n" * 1024)]


def test_an_unregister_and_a_result_of_the_wrong_type_cost_only_themselves(agent):
    with ch.connect_unix(agent.socket_path, 10) as sock:
        sock.sendall(_register(1, "s-1"))
        assert _answers(sock, [1])[1]["ok"] is True
        sock.sendall(ch.encode({"type": "unregister", "id": 2, "sid": {"s-1": 1}}) +
                     ch.encode({"type": "result", "id": [1], "ok": True}) +
                     ch.encode({"type": "result", "id": True, "ok": True}) +
                     ch.encode({"type": "where", "id": 3}))
        got = _answers(sock, [2, 3])
        assert [s["sid"] for s in agent.sessions()] == ["s-1"]      # still registered
    assert got[2]["error"]["code"] == "BAD_REQUEST" and "unregister: sid must be" in got[2]["error"]["message"]
    assert got[3]["ok"] is True


@pytest.mark.parametrize("answer, code", [
    ({"ok": True, "result": [1, 2]}, "PROTOCOL_ERROR"),
    ({"ok": "yes"}, "PROTOCOL_ERROR"),
    ({"ok": False, "error": "nope"}, "PROTOCOL_ERROR"),
    ({"ok": False, "error": {"code": "TICKET_INVALID", "message": "no"}}, "TICKET_INVALID"),
])
def test_a_driver_answering_a_resume_with_garbage_fails_only_its_session(agent, answer, code):
    """A ``result`` whose ``result`` is no object used to raise TypeError in
    the rehome (``dict.update``): the host got ``INTERNAL``."""
    with GuestChannel(agent.port_path) as host, ch.connect_unix(agent.socket_path, 10) as sock:
        host.connect()
        sock.sendall(_register(1, "s-1"))
        assert _answers(sock, [1])[1]["ok"] is True
        outcome = {}
        rehome = threading.Thread(target=lambda: outcome.update(host.request(
            "rehome", timeout=30, migration_id="m-1", tickets={"s-1": "t"},
            identity={"host_id": "hostB", "pool_endpoint": "127.0.0.1:7070"})))
        rehome.start()
        parser = ch.LineParser()
        resume = None
        while resume is None:
            data = sock.recv(1 << 16)
            assert data, "the agent closed"
            resume = next((m for m in parser.feed(data) if m.get("type") == "resume"), None)
        sock.sendall(ch.encode({"type": "result", "id": resume["id"], **answer}))
        rehome.join(30)
    assert outcome["ok"] is False and outcome["sessions"]["s-1"]["ok"] is False, outcome
    assert outcome["sessions"]["s-1"]["error"]["code"] == code, outcome


def test_a_result_with_a_wrong_id_is_dropped_with_its_reason(agent, caplog):
    with caplog.at_level("WARNING", logger="accelmig.wire.channel"):
        with ch.connect_unix(agent.socket_path, 10) as sock:
            sock.sendall(ch.encode({"type": "result", "id": {"x": 1}, "ok": True}) +
                         ch.encode({"type": "where", "id": 1}))
            assert _answers(sock, [1])[1]["ok"] is True
    reasons = [r.getMessage() for r in caplog.records if "dropped input" in r.getMessage()]
    assert any("whose id is an object" in reason for reason in reasons), reasons


def test_a_rehome_local_whose_document_is_no_object_is_refused_at_once(agent):
    import os
    if os.geteuid() != 0:
        pytest.skip("rehome_local is root's only")
    with ch.connect_unix(agent.socket_path, 10) as sock:
        sock.sendall(ch.encode({"type": "rehome_local", "id": 1, "document": [1]}) +
                     ch.encode({"type": "rehome_local", "id": 2}) +
                     ch.encode({"type": "where", "id": 3}))
        got = _answers(sock, [1, 2, 3])
    assert got[1]["error"]["code"] == "BAD_REQUEST" and "not a list" in got[1]["error"]["message"], got[1]
    assert got[2]["error"]["code"] == "BAD_REQUEST" and "not null" in got[2]["error"]["message"], got[2]
    assert got[3]["ok"] is True


def test_a_hello_too_big_for_one_line_is_split_and_the_host_still_syncs(agent_on_thread):
    """256 sessions with 1 KiB names and endpoints make a hello of ~600 KiB,
    past the host's 256 KiB line limit: the host dropped it and its sync
    with that guest timed out. Now the hello lists what fits and the rest
    follow as session_opened, one each: the host learns every session."""
    agent = agent_on_thread()
    long_name, long_endpoint = "n" * 1000, "10.0.0.1:7070"
    sids = [f"s-{i:04d}-" + "x" * 200 for i in range(Agent.MAX_SESSIONS_PER_LINK)]
    with ch.connect_unix(agent.socket_path, 30) as sock:
        sock.sendall(b"".join(ch.encode({"type": "register", "id": i + 1, "sid": sid, "endpoint": long_endpoint,
                                         "name": long_name}) for i, sid in enumerate(sids)))
        got = _answers(sock, range(1, len(sids) + 1))
        assert all(answer["ok"] for answer in got.values())
        assert len(ch.encode({"sessions": agent.sessions()})) > ch.MAX_LINE, "the test proves nothing"
        with GuestChannel(agent.port_path) as host:
            hello = host.connect(sync_timeout=30)
            told = {s["sid"] for s in hello["sessions"]}
            assert 0 < len(told) < len(sids)
            while len(told) < len(sids):
                event = host.events.get(timeout=30)
                if event.get("type") == "session_opened":
                    told.add(event["sid"])
            assert told == set(sids)
