"""A guest with more sessions than one line can carry (issue 11): a
rehome's tickets come staged in pieces, bounded and checked; the agent's
answers (a rehome's outcome, its status) list what fits and say the rest;
drivers resume a window at a time.  A real agent; its drivers are hand
driven on its local socket."""

from __future__ import annotations

import threading

import pytest

from accelmig.agent.daemon import Agent
from accelmig.plugin.channel import GuestChannel
from accelmig.wire import channel as ch
from accelmig.wire.errors import BadRequest, QuotaExceeded

IDENTITY = {"host_id": "hostB", "pool_endpoint": "127.0.0.1:7070"}


def _register(sock, sids, name="n"):
    sock.sendall(b"".join(ch.encode({"type": "register", "id": i + 1, "sid": sid, "endpoint": "10.0.0.1:7070",
                                     "name": name}) for i, sid in enumerate(sids)))
    parser, got = ch.LineParser(), {}
    while len(got) < len(sids):
        data = sock.recv(1 << 16)
        assert data, "the agent closed"
        got.update({m["id"]: m for m in parser.feed(data) if m.get("type") == "result"})
    assert all(m["ok"] for m in got.values()), got


class Resumer:
    """Answers every ``resume`` on ``sock`` (ok, or the error ``fail`` gives
    for its sid) and counts how many were in flight at once."""

    def __init__(self, sock, fail=lambda sid: None):
        self.sock, self.fail = sock, fail
        self.asked: list[str] = []
        self.most_at_once = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        parser, pending = ch.LineParser(), []
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            pending += [m for m in parser.feed(data) if m.get("type") == "resume"]
            self.most_at_once = max(self.most_at_once, len(pending))
            for message in pending:
                self.asked.append(message["sid"])
                error = self.fail(message["sid"])
                self.sock.sendall(ch.encode(ch.result(message["id"], ok=error is None,
                                                      result={"epoch": 2, "ticket": bool(message["ticket"])},
                                                      error=error)))
            pending = []


def test_a_rehome_of_staged_tickets_resumes_every_session_with_its_own(agent_on_thread):
    agent = agent_on_thread(resume_window=8)
    sids = [f"s-{i:04d}" for i in range(200)]
    document = {"migration_id": "m-big", "identity": IDENTITY,
                "tickets": {sid: f"ticket-of-{sid}-" + "t" * 300 for sid in sids}}
    pieces, rehome = ch.rehome_pieces(document, line_budget=8 << 10, piece_bytes=8 << 10)
    assert len(pieces) >= 8
    with ch.connect_unix(agent.socket_path, 30) as sock, GuestChannel(agent.port_path) as host:
        _register(sock, sids)
        resumer = Resumer(sock)
        host.connect()
        for piece in pieces:
            assert host.request("tickets", **piece)["migration_id"] == "m-big"
        outcome = host.request("rehome", timeout=60, **rehome)
    assert outcome["ok"] and outcome["session_count"] == outcome["resumed_count"] == 200
    assert sorted(resumer.asked) == sids                       # each one asked once
    assert resumer.most_at_once <= 8                           # a window at a time, never all at once
    assert all(outcome["sessions"][sid]["ticket"] for sid in sids)


def test_staged_tickets_that_do_not_add_up_are_refused_and_a_full_resend_works(agent_on_thread):
    agent = agent_on_thread()
    sids = [f"s-{i}" for i in range(30)]
    document = {"migration_id": "m-lost", "identity": IDENTITY, "tickets": {sid: "t" * 300 for sid in sids}}
    pieces, rehome = ch.rehome_pieces(document, line_budget=2048, piece_bytes=2048)
    with ch.connect_unix(agent.socket_path, 30) as sock, GuestChannel(agent.port_path) as host:
        _register(sock, sids)
        Resumer(sock)
        host.connect()
        for piece in pieces[1:]:                 # a piece lost on the way
            host.request("tickets", **piece)
        arrived = 30 - len(pieces[0]["tickets"])
        with pytest.raises(BadRequest, match=f"30 tickets announced, {arrived} arrived"):
            host.request("rehome", **rehome)
        # pieces of another migration drop what was staged for this one
        host.request("tickets", migration_id="m-other", tickets={"s-0": "x"})
        for piece in pieces[1:]:
            host.request("tickets", **piece)
        host.request("tickets", migration_id="m-other", tickets={"s-0": "x"})
        with pytest.raises(BadRequest, match=f"30 tickets announced, {len(rehome['tickets'])} arrived"):
            host.request("rehome", **rehome)
        # the host sends it all again: it adds up
        for piece in pieces:
            host.request("tickets", **piece)
        assert host.request("rehome", timeout=30, **rehome)["ok"]


def test_staged_tickets_are_bounded_by_the_sessions_an_agent_keeps(agent_on_thread):
    agent = agent_on_thread(max_sessions=50)
    with GuestChannel(agent.port_path) as host:
        host.connect()
        host.request("tickets", migration_id="m", tickets={f"s-{i}": "t" for i in range(40)})
        with pytest.raises(QuotaExceeded, match="more than 50"):
            host.request("tickets", migration_id="m", tickets={f"s-{i}": "t" for i in range(40, 60)})
        with pytest.raises(BadRequest, match="at most 4096"):
            host.request("tickets", migration_id="m", tickets={"s-1": "t" * (ch.MAX_TICKET + 1)})
        assert len(agent.rehome_book.staged("m")) <= 50
        assert host.request("ping")["pong"]


def test_an_outcome_too_big_for_a_line_lists_the_failures_and_counts_the_rest(agent_on_thread):
    agent = agent_on_thread()
    # long sids make every outcome big: 1000 of them are far more than a line
    sids = [f"s-{i:04d}-" + "x" * 240 for i in range(1000)]
    tickets = {sid: "t" for sid in sids}
    with GuestChannel(agent.port_path) as host:
        host.connect()
        socks = [ch.connect_unix(agent.socket_path, 30) for _ in range(4)]
        try:
            for k, sock in enumerate(socks):
                _register(sock, sids[k * 250:(k + 1) * 250])
                Resumer(sock, fail=lambda sid: {"code": "TICKET_INVALID", "message": "no"}
                        if sid.startswith("s-0007-") else None)
            pieces, rehome = ch.rehome_pieces({"migration_id": "m-long", "identity": IDENTITY, "tickets": tickets})
            for piece in pieces:
                host.request("tickets", **piece)
            outcome = host.request("rehome", timeout=60, **rehome)
        finally:
            for sock in socks:
                sock.close()
    assert outcome["ok"] is False and outcome["session_count"] == 1000 and outcome["resumed_count"] == 999
    failed = [sid for sid, o in outcome["sessions"].items() if not o["ok"]]
    assert failed == [sids[7]] and outcome["sessions_omitted"] > 0
    assert len(outcome["sessions"]) + outcome["sessions_omitted"] == 1000


def test_status_lists_sessions_a_page_at_a_time(agent_on_thread):
    agent = agent_on_thread()
    sids = sorted(f"s-{i:04d}-" + "y" * 200 for i in range(Agent.MAX_SESSIONS_PER_LINK))
    with ch.connect_unix(agent.socket_path, 30) as sock:
        _register(sock, sids, name="n" * 1000)       # ~1.2 KiB a session: ~300 KiB in all
        with GuestChannel(agent.port_path) as host:
            host.connect(sync_timeout=30)
            seen, after = [], None
            while True:
                page = host.request("status", after=after)
                assert len(ch.encode(ch.result(1, result=page))) < ch.MAX_LINE
                seen += [s["sid"] for s in page["sessions"]]
                after = page.get("next")
                if not after:
                    break
                assert page["session_count"] == len(sids)
            with pytest.raises(BadRequest, match="after must be a session id"):
                host.request("status", after=["x"])
    assert seen == sids


def test_rehome_stdin_with_a_document_over_a_line_stages_its_tickets(agent_on_thread, monkeypatch, capsys):
    """guest-exec's path (a VM with only qemu-guest-agent): the document on
    stdin is bigger than a line of the local socket; the command sends its
    tickets in pieces, root's only like the rehome itself."""
    import io
    import json
    import os

    from accelmig.agent import cli
    if os.geteuid() != 0:
        pytest.skip("rehome_local and tickets are root's only")
    agent = agent_on_thread()
    sids = [f"s-{i:04d}" for i in range(200)]
    document = {"migration_id": "m-stdin", "identity": IDENTITY,
                "tickets": {sid: f"ticket-of-{sid}-" + "t" * 2000 for sid in sids}}
    assert len(json.dumps(document)) > ch.MAX_LINE
    with ch.connect_unix(agent.socket_path, 30) as sock:
        _register(sock, sids)
        resumer = Resumer(sock)
        monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(document)))
        assert cli.main(["rehome", "--stdin", "--socket", agent.socket_path]) == 0
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["ok"] and outcome["session_count"] == outcome["resumed_count"] == 200
    assert sorted(resumer.asked) == sids
