"""The control plane at scale (issue 11): one domain with a thousand sessions
migrates through the real pool, hostd's own calls and a real guest agent,
and every session resumes with its own ticket, exactly once — with every
control-plane answer and every channel line measured as it travelled.

The thousand "drivers" are hand-driven data-plane connections (``Raw``)
behind four local connections to the agent (at most 256 sessions each), so
the test holds no thousand driver threads; everything else is the
product's code: the pool, ``AsyncControlClient.call_all`` as hostd pages
``complete``, ``ChannelDelivery.rehome`` as hostd delivers (tickets in
pieces), the agent resuming its drivers a window at a time."""

from __future__ import annotations

import asyncio
import os
import threading
import types
import uuid

import pytest

from accelmig.agent.daemon import Agent
from accelmig.plugin.hostd.delivery import ChannelDelivery
from accelmig.wire import channel as ch
from accelmig.wire import control as wc
from accelmig.wire.control import AsyncControlClient, ControlClient
from accelmig.wire.records import RecordView
from tests.support.attest import bind
from tests.support.twohosts import SECRETS, Raw, make_pool
from tests.support.wait import wait_for

SESSIONS = 1000
PER_LINK = 250            # the agent takes at most 256 sessions per local connection


class FakeDrivers:
    """``PER_LINK`` sessions per local connection to the agent: each one
    registered, and resumed at the pool (its secret, the ticket the agent
    hands it) when the agent says so, from hostB's address."""

    def __init__(self, agent_socket: str, sessions: dict):
        self.sessions = sessions                       # sid -> secret
        self.resumed: dict[str, int] = {}              # sid -> how many times
        self.tickets: dict[str, str] = {}              # sid -> the ticket it resumed with
        self.errors: list = []
        self._lock = threading.Lock()
        sids = sorted(sessions)
        self.links = []
        for start in range(0, len(sids), PER_LINK):
            conn = ch.LineClient(agent_socket, timeout=30, what="the agent", name="fake-driver")
            for sid in sids[start:start + PER_LINK]:
                assert conn.call("register", sid=sid, endpoint="127.0.0.1:1", name="scale", epoch=1) == \
                    {"registered": sid}
            self.links.append(conn)
        self.threads = [threading.Thread(target=self._serve, args=(conn,), daemon=True) for conn in self.links]
        for thread in self.threads:
            thread.start()

    def _serve(self, conn: ch.LineClient) -> None:
        while True:
            try:
                message = conn.recv()
            except OSError:
                return
            if message is None:
                return
            if message.get("type") != "resume":
                continue
            sid, ticket = message["sid"], message["ticket"]
            raw = Raw(message["endpoint"])
            try:
                answer = raw.resume(sid, self.sessions[sid], 1, 0, ticket=ticket)
            finally:
                raw.close()
            with self._lock:
                if answer.get("op") == "resumed":
                    self.resumed[sid] = self.resumed.get(sid, 0) + 1
                    self.tickets[sid] = ticket
                else:
                    self.errors.append((sid, answer))
            ok = answer.get("op") == "resumed"
            conn.send(ch.result(message["id"], ok=ok, result={"epoch": answer.get("epoch")} if ok else None,
                                error=None if ok else answer.get("error")))

    def close(self) -> None:
        for conn in self.links:
            conn.close()


@pytest.fixture
def measured(monkeypatch):
    """The size of every control-plane frame a client reads (from its real
    prefix) and of every line either end of the guest channel writes."""
    sizes = {"answers": [], "lines": []}
    parse_prefix = wc.parse_prefix

    def measuring_prefix(data, limits=wc.ANSWER_LIMITS):
        flags, hlen, plen = parse_prefix(data, limits)
        sizes["answers"].append(wc.PREFIX_SIZE + hlen + plen)
        return flags, hlen, plen
    encode = ch.encode

    def measuring_encode(message):
        line = encode(message)
        sizes["lines"].append((message.get("type"), len(line)))
        return line
    monkeypatch.setattr(wc, "parse_prefix", measuring_prefix)
    monkeypatch.setattr(ch, "encode", measuring_encode)
    return sizes


def test_a_domain_of_a_thousand_sessions_migrates_and_each_resumes_once_with_its_own_ticket(tmp_path, measured):
    domain = str(uuid.uuid4())
    with make_pool(max_sessions_per_tenant=SESSIONS + 10, grace=600.0) as pool:
        agent = Agent(str(tmp_path / "channel.sock"), str(tmp_path / "agent.sock"),
                      state_dir=str(tmp_path / "state"), rehome_timeout=120)
        agent.open()
        agent_thread = threading.Thread(target=agent.run, daemon=True)
        agent_thread.start()
        a = ControlClient(pool.control_endpoint, "hostA", SECRETS["hostA"].encode())
        port = pool.endpoint.rsplit(":", 1)[1]
        drivers = None
        try:
            secrets_by_sid = {}
            for _ in range(SESSIONS):                 # opened on hostA, then their connections close
                raw = Raw(f"127.0.0.1:{port}")
                secret = os.urandom(32)
                secrets_by_sid[raw.open(secret)["sid"]] = secret
                raw.close()
            # hostd attests the sessions the agent reports, with their proofs
            assert sorted(bind(a, secrets_by_sid, domain)["bound"]) == sorted(secrets_by_sid)
            drivers = FakeDrivers(str(tmp_path / "agent.sock"), secrets_by_sid)
            wait_for(lambda: len(agent.sessions()) == SESSIONS, what="every session registered with the agent")

            async def migrate():
                # as the two hostds call it: the destination's hook opens, the
                # source switches over, the destination completes (every page)
                # and delivers the rehome over the guest channel
                src = AsyncControlClient(pool.control_endpoint, "hostA", SECRETS["hostA"].encode())
                dst = AsyncControlClient(pool.control_endpoint, "hostB", SECRETS["hostB"].encode())
                try:
                    record = await dst.call("open_migration", domain_uuid=domain)
                    await src.call("switchover", domain_uuid=domain)
                    first = await dst.call("complete", domain_uuid=domain, migration_id=record["migration_id"])
                    done = await dst.call_all("complete", domain_uuid=domain,
                                              migration_id=record["migration_id"])
                    delivery = ChannelDelivery(inspect=_nothing, on_event=lambda w, m: None, timeout=120)
                    watch = types.SimpleNamespace(name="scale", channel_path=str(tmp_path / "channel.sock"))
                    document = {"migration_id": record["migration_id"], "tickets": done["tickets"],
                                "identity": {"host_id": "hostB", "pool_endpoint": f"[::1]:{port}"}}
                    try:
                        outcome = await delivery.rehome(None, watch, document)
                    finally:
                        await delivery.close(watch)
                    await src.call("close", domain_uuid=domain, migration_id=record["migration_id"])
                    final = await dst.call("wait_record", domain_uuid=domain, migration_id=record["migration_id"],
                                           until="rehomed", timeout=30)
                    return first, done, outcome, final
                finally:
                    await src.close()
                    await dst.close()

            first, done, outcome, final = asyncio.run(migrate())
            # every ticket, one per session, though one answer holds only a page of them
            assert first["next"] and len(first["tickets"]) < SESSIONS
            assert set(done["tickets"]) == set(secrets_by_sid) and done["next"] is None
            assert len(set(done["tickets"].values())) == SESSIONS
            # every session resumed once, with its own ticket
            assert not drivers.errors, drivers.errors[:3]
            assert drivers.resumed == {sid: 1 for sid in secrets_by_sid}
            assert drivers.tickets == done["tickets"]
            assert outcome["ok"] and outcome["session_count"] == outcome["resumed_count"] == SESSIONS
            record = RecordView.from_wire(final["record"])
            assert final["reached"] and record.rehomed
            assert record.session_count == record.resumed_count == SESSIONS and not record.inline
            # (they are hostB's now: hostA, the migration's source, still reads them, bound elsewhere)
            moved = a.call_all("list_sessions", domain_uuid=domain)
            assert len(moved["sessions"]) == moved["elsewhere"] == SESSIONS
            with ControlClient(pool.control_endpoint, "hostB", SECRETS["hostB"].encode()) as b:
                sessions = {s["sid"]: s for s in b.call_all("list_sessions", domain_uuid=domain)["sessions"]}
            assert len(sessions) == SESSIONS
            assert {(s["bound_host"], s["epoch"], s["counters"]["resumes"]) for s in sessions.values()} == \
                {("hostB", 2, 1)}
            # nothing that travelled grew with the sessions: every control
            # answer within a page's bound, every channel line far below the
            # line limit (the tickets went in pieces)
            assert max(measured["answers"]) <= wc.PAGED_ANSWER_MAX, max(measured["answers"])
            lines = measured["lines"]
            assert max(size for _, size in lines) < ch.MAX_LINE, sorted(lines, key=lambda x: -x[1])[:5]
            assert sum(1 for kind, _ in lines if kind == "tickets") >= 4
            assert max(size for kind, size in lines if kind in ("tickets", "rehome")) <= ch.REHOME_LINE_BUDGET
        finally:
            if drivers is not None:
                drivers.close()
            a.close()
            agent.stop()
            agent_thread.join(10)


async def _nothing(dom, watch):
    return None
