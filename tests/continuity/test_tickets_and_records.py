"""Moves through the control plane: records, tickets, host binding, pauses."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from accelmig.agent.driver import connect, u32
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import (AuthFailed, Conflict, NoSuchRecord, RecordState, TicketInvalid,
                                  TicketRequired, WrongHost)
from accelmig.wire.frames import FrameReader, encode_frame
from tests.conftest import ALICE, BOB
from tests.support.attest import bind
from tests.support.kernels import COUNTER
from tests.support.twohosts import SECRETS, Raw, TwoHosts, make_pool
from tests.support.wait import wait_for


def on_host(hosts, host, token=ALICE, **kw):
    kw.setdefault("timeout", 10)
    return connect(host.endpoint, token, agent=False, **kw)


def attest(host, dev, domain):
    return bind(host, dev, domain)


def pool_session(hosts, sid):
    return hosts.pool.session(sid)


def test_a_move_with_a_ticket_rebinds_the_session_and_nothing_is_resent(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(16, dtype=np.uint32))
        attest(hosts.a, dev, domain)
        assert pool_session(hosts, dev.sid)["bound_host"] == "hostA"
        prog.launch("bump", 16, None, buf, u32(3))
        tickets = hosts.migrate(domain, hosts.a, hosts.b)["tickets"]
        assert set(tickets) == {dev.sid}
        result = dev.resume(hosts.b.endpoint, tickets[dev.sid])
        assert result["epoch"] == 2 and result["ticket"]
        prog.launch("bump", 16, None, buf, u32(4))
        assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {7}
        state = pool_session(hosts, dev.sid)
        assert state["bound_host"] == "hostB" and state["epoch"] == 2
        assert state["counters"]["builds"] == 1
        assert state["counters"]["bytes_uploaded"] == 64
        assert state["counters"]["duplicates"] == 0
        records = hosts.a.call("list_records")["records"]
        assert records[0]["state"] == "closed" and dev.sid in records[0]["resumed"]


def test_resume_from_another_host_needs_a_ticket(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        with pytest.raises(WrongHost, match="bound to host hostA"):
            dev.resume(hosts.b.endpoint)
        record = hosts.b.call("open_migration", domain_uuid=domain)
        hosts.a.call("switchover", domain_uuid=domain)
        hosts.b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])
        # the session is moving: even its own host needs the ticket now
        with pytest.raises(TicketRequired, match="moving to host hostB"):
            dev.resume(hosts.a.endpoint)
        with pytest.raises(TicketRequired):
            dev.resume(hosts.b.endpoint)


def test_tickets_are_single_use_unforgeable_and_bound_to_host_and_session(hosts, domain):
    with on_host(hosts, hosts.a) as dev, on_host(hosts, hosts.a, BOB) as other:
        attest(hosts.a, dev, domain)
        attest(hosts.a, other, domain)
        moved = hosts.migrate(domain, hosts.a, hosts.b)
        tickets, mid = moved["tickets"], moved["record"]["migration_id"]
        mine, theirs = tickets[dev.sid], tickets[other.sid]
        forged = mine[:-4] + ("0000" if not mine.endswith("0000") else "1111")
        with pytest.raises(TicketInvalid, match="signature does not verify"):
            dev.resume(hosts.b.endpoint, forged)
        with pytest.raises(TicketInvalid, match="not an accelmig ticket"):
            dev.resume(hosts.b.endpoint, "garbage")
        with pytest.raises(TicketInvalid, match=f"ticket is for session {other.sid}"):
            dev.resume(hosts.b.endpoint, theirs)
        with pytest.raises(TicketInvalid, match="ticket is for host hostB, the resume comes from host hostA"):
            dev.resume(hosts.a.endpoint, mine)
        dev.resume(hosts.b.endpoint, mine, mid)
        dev.finish()
        # replayed by someone holding the secret and the ticket: refused by the pool
        raw = Raw(hosts.b.endpoint)
        state = hosts.pool.session(dev.sid)
        replay = raw.resume(dev.sid, dev._session.secret, state["epoch"], dev.last_seen, ticket=mine)
        assert replay["error"]["code"] == "TICKET_INVALID" and "already used" in replay["error"]["message"]
        # the driver itself knows the move is done: delivering the migration again is a no-op
        assert dev.resume(hosts.b.endpoint, mine, mid).get("already") is True
        dev.resume(hosts.b.endpoint)        # bound to B now: no ticket needed at B
        other.resume(hosts.b.endpoint, theirs)
        other.finish()


def test_completing_again_hands_back_the_live_tickets_never_revokes_them(hosts, domain):
    """Two hostds, reconciliation racing the event, a retry after a failed
    delivery: every extra ``complete`` of one migration must leave the ticket
    already on its way to the guest valid (issue 9)."""
    with on_host(hosts, hosts.a) as dev, on_host(hosts, hosts.a, BOB) as other:
        buf = dev.upload(b"state" * 8)
        attest(hosts.a, dev, domain)
        attest(hosts.a, other, domain)
        record = hosts.b.call("open_migration", domain_uuid=domain)
        hosts.a.call("switchover", domain_uuid=domain)
        mid = record["migration_id"]
        first = hosts.b.call("complete", domain_uuid=domain, migration_id=mid)["tickets"]
        # the same host through a second control connection (a second hostd)
        with ControlClient(hosts.pool.control_endpoint, "hostB", SECRETS["hostB"].encode()) as twin:
            second = twin.call("complete", domain_uuid=domain, migration_id=mid)["tickets"]
        assert second == first and set(first) == {dev.sid, other.sid}
        dev.resume(hosts.b.endpoint, first[dev.sid])       # the ticket the first call gave
        assert dev.read(buf) == b"state" * 8
        # once used, a ticket is no longer handed out: only the session still moving gets one
        third = hosts.b.call("complete", domain_uuid=domain, migration_id=mid)["tickets"]
        assert third == {other.sid: first[other.sid]}
        other.resume(hosts.b.endpoint, second[other.sid])  # the ticket the second call gave
        other.finish()
        assert hosts.b.call("complete", domain_uuid=domain, migration_id=mid)["tickets"] == {}
        # a used ticket presented by someone else says when it was used
        raw = Raw(hosts.b.endpoint)
        state = hosts.pool.session(dev.sid)
        replay = raw.resume(dev.sid, dev._session.secret, state["epoch"], dev.last_seen, ticket=first[dev.sid])
        assert replay["error"]["code"] == "TICKET_INVALID"
        assert "already used by a resume at 20" in replay["error"]["message"]
        raw.close()


def test_concurrent_completes_of_one_migration_agree_on_the_tickets(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        record = hosts.b.call("open_migration", domain_uuid=domain)
        hosts.a.call("switchover", domain_uuid=domain)
        answers, errors = [], []

        def complete():
            try:
                with ControlClient(hosts.pool.control_endpoint, "hostB", SECRETS["hostB"].encode()) as c:
                    answers.append(c.call("complete", domain_uuid=domain,
                                          migration_id=record["migration_id"])["tickets"])
            except Exception as exc:    # reported below
                errors.append(exc)

        threads = [threading.Thread(target=complete) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors and len(answers) == 4
        assert all(a == answers[0] for a in answers) and set(answers[0]) == {dev.sid}
        dev.resume(hosts.b.endpoint, answers[3][dev.sid])
        dev.finish()


def test_a_ticket_does_not_replace_ownership(hosts, domain):
    """Someone holding a ticket but not the session secret gets nowhere."""
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        ticket = hosts.migrate(domain, hosts.a, hosts.b)["tickets"][dev.sid]
        host, port = hosts.b.endpoint.rsplit(":", 1)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
            reader = FrameReader()
            sock.sendall(encode_frame({"op": "hello", "versions": [1]}))
            sock.sendall(encode_frame({"op": "resume", "sid": dev.sid, "epoch": 1, "last_seen": 0,
                                       "proof": "00" * 32, "ticket": ticket}))
            frames = []
            while len(frames) < 2:
                n = sock.recv_into(reader.get_buffer())
                if not n:
                    break
                frames += [f.header for f in reader.feed(n)]
        assert frames[1]["error"]["code"] == "AUTH_FAILED"
        # and the ticket is still good for its owner
        dev.resume(hosts.b.endpoint, ticket)
        dev.finish()


def test_ticket_expiry():
    with make_pool(ticket_ttl=0.3) as pool:
        hosts = TwoHosts(pool)
        with on_host(hosts, hosts.a) as dev:
            attest(hosts.a, dev, "dom-expiry")
            ticket = hosts.migrate("dom-expiry", hosts.a, hosts.b)["tickets"][dev.sid]
            time.sleep(0.5)
            with pytest.raises(TicketInvalid, match="ticket expired"):
                dev.resume(hosts.b.endpoint, ticket)
            # the destination can mint fresh tickets for the same migration (idempotent complete)
            record = hosts.b.call("list_records")["records"][0]
            again = hosts.b.call("complete", domain_uuid="dom-expiry", migration_id=record["migration_id"])
            dev.resume(hosts.b.endpoint, again["tickets"][dev.sid])
            dev.finish()
        hosts.close()


def test_back_to_back_moves_before_the_first_ticket_is_used(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(8, dtype=np.uint32))
        attest(hosts.a, dev, domain)
        first = hosts.migrate(domain, hosts.a, hosts.b)["tickets"][dev.sid]
        second = hosts.migrate(domain, hosts.b, hosts.a)["tickets"][dev.sid]
        with pytest.raises(TicketInvalid, match="superseded by migration"):
            dev.resume(hosts.b.endpoint, first)     # superseded by the move back
        dev.resume(hosts.a.endpoint, second)
        prog.launch("bump", 8, None, buf, u32(1))
        assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {1}
        records = hosts.a.call("list_records")["records"]
        assert [r["state"] for r in records] == ["closed", "closed"]


def test_abort_leaves_the_source_running_with_nothing_lost(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(8, dtype=np.uint32))
        attest(hosts.a, dev, domain)
        record = hosts.b.call("open_migration", domain_uuid=domain)
        hosts.a.call("switchover", domain_uuid=domain)
        for _ in range(100):
            prog.launch("bump", 8, None, buf, u32(1))
        aborted = hosts.a.call("abort", domain_uuid=domain, migration_id=record["migration_id"],
                               reason="cancelled by the operator")
        assert aborted["state"] == "aborted" and "cancelled by the operator" in aborted["abort_reason"]
        for _ in range(100):
            prog.launch("bump", 8, None, buf, u32(1))
        assert set(np.frombuffer(dev.read(buf), dtype=np.uint32)) == {200}
        dev.resume(hosts.a.endpoint)            # still at home: no ticket needed
        dev.finish()
        with pytest.raises(NoSuchRecord):
            hosts.b.call("complete", domain_uuid=domain)
        with pytest.raises(RecordState, match="is aborted: cannot complete"):
            hosts.b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])


def test_abort_is_refused_once_the_guest_ran_on_the_destination(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        hosts.a.call("register_intent", domain_uuid=domain, dest_host="hostB")     # (vouched for)
        record = hosts.b.call("open_migration", domain_uuid=domain, postcopy=True)
        hosts.b.call("commit", domain_uuid=domain, migration_id=record["migration_id"])
        with pytest.raises(RecordState, match="is committed: cannot abort"):
            hosts.a.call("abort", domain_uuid=domain, migration_id=record["migration_id"])
        tickets = hosts.b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])["tickets"]
        dev.resume(hosts.b.endpoint, tickets[dev.sid])
        dev.finish()


def test_an_expired_lease_aborts_the_record():
    with make_pool(lease_ttl=0.4) as pool:
        hosts = TwoHosts(pool)
        with on_host(hosts, hosts.a) as dev:
            attest(hosts.a, dev, "dom-lease")
            kept = hosts.b.call("open_migration", domain_uuid="dom-lease")
            for _ in range(4):           # a host that renews keeps it alive
                time.sleep(0.2)
                out = hosts.b.call("renew", records=[["dom-lease", kept["migration_id"]]])
                assert len(out["renewed"]) == 1
            # then nobody renews: the pool aborts it once the lease ran out
            record = wait_for(lambda: next((r for r in hosts.a.call("list_records")["records"]
                                            if r["state"] == "aborted"), None),
                              10, "the pool to abort the record whose lease expired")
            assert record["state"] == "aborted" and "lease expired" in record["abort_reason"]
            dev.finish()                 # the source goes on
        hosts.close()


def _blocked_read(dev, buf, results):
    try:
        results.append(np.frombuffer(dev.read(buf), dtype=np.uint32).copy())
    except Exception as exc:
        results.append(exc)


@pytest.mark.parametrize("policy", ["none", "switchover", "start"])
def test_pause_policies(hosts, domain, policy):
    with on_host(hosts, hosts.a) as dev:
        prog = dev.build(COUNTER)
        buf = dev.upload(np.zeros(8, dtype=np.uint32))
        attest(hosts.a, dev, domain)
        hosts.a.call("register_intent", domain_uuid=domain, policy=policy, dest_host="hostB")
        record = hosts.b.call("open_migration", domain_uuid=domain)
        assert record["policy"] == policy

        def held_after(n_launches):
            for _ in range(n_launches):
                prog.launch("bump", 8, None, buf, u32(1))
            results = []
            reader = threading.Thread(target=_blocked_read, args=(dev, buf, results))
            reader.start()
            reader.join(0.5)
            return reader, results

        reader, results = held_after(5)
        if policy == "start":
            assert reader.is_alive() and pool_session(hosts, dev.sid)["held"] >= 1
        else:
            reader.join(5)
            assert results and set(results[0]) == {5}
        hosts.a.call("switchover", domain_uuid=domain)
        if policy == "switchover":
            reader, results = held_after(5)
            assert reader.is_alive() and pool_session(hosts, dev.sid)["paused"]
        done = hosts.b.call("complete", domain_uuid=domain, migration_id=record["migration_id"])
        if policy != "none":
            assert reader.is_alive()      # still paused until the session resumes at B
        dev.resume(hosts.b.endpoint, done["tickets"][dev.sid])
        reader.join(10)
        assert not reader.is_alive() and isinstance(results[0], np.ndarray)
        dev.finish()
        assert pool_session(hosts, dev.sid)["paused"] == []
        blackout = hosts.b.call("list_records")["records"][0]["resumed"][dev.sid]
        assert blackout >= 0


def test_control_plane_authentication(hosts, domain):
    endpoint = hosts.pool.control_endpoint
    with pytest.raises(AuthFailed, match="does not verify"):
        ControlClient(endpoint, "hostA", b"not the secret at all").call("ping")
    with pytest.raises(AuthFailed, match="no secret for host 'hostZ'"):
        ControlClient(endpoint, "hostZ", b"whatever-whatever").call("ping")
    with ControlClient(hosts.pool.admin_endpoint, "admin", None) as admin:
        assert admin.call("ping")["caller"] == "admin"
        with pytest.raises(AuthFailed, match="for hypervisor hosts"):
            admin.call("open_migration", domain_uuid=domain)
    # a replayed call id on one connection is refused
    host, port = endpoint.rsplit(":", 1)
    from accelmig.wire.control import request_mac
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        reader = FrameReader()

        def rx():
            while True:
                frames = reader.feed(sock.recv_into(reader.get_buffer()))
                if frames:
                    return frames[0].header

        sock.sendall(encode_frame({"op": "hello", "versions": [1], "host": "hostA"}))
        challenge = rx()["challenge"]
        call = {"op": "call", "id": 1, "method": "ping", "args": {},
                "mac": request_mac(SECRETS["hostA"].encode(), challenge, 1, "ping", {})}
        sock.sendall(encode_frame(call))
        assert rx()["ok"] is True
        sock.sendall(encode_frame(call))
        answer = rx()
        assert answer["op"] == "error" and "strictly increasing" in answer["error"]["message"]


def test_only_the_parties_of_a_record_act_on_it(hosts, domain):
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        with pytest.raises(Conflict, match="bound to host hostA"):
            bind(hosts.b, dev, domain)
        hosts.a.call("register_intent", domain_uuid=domain, dest_host="hostB")
        record = hosts.b.call("open_migration", domain_uuid=domain)
        # the destination of an in-flight migration of this domain, its host
        # vouched for, may attest (a VM with only qemu-guest-agent reports its
        # sessions there)
        assert bind(hosts.b, dev, domain)["bound"] == [dev.sid]
        assert pool_session(hosts, dev.sid)["bound_host"] == "hostA"
        with pytest.raises(Conflict, match="bound to host hostA"):    # B migrates no other domain
            bind(hosts.b, dev, "another-domain")
        with pytest.raises(Conflict, match="belongs to domain"):
            bind(hosts.a, dev, "another-domain")
        with pytest.raises(Conflict, match="is the destination"):
            hosts.b.call("switchover", domain_uuid=domain)
        with pytest.raises(Conflict, match="goes to hostB, not hostA"):
            hosts.a.call("complete", domain_uuid=domain, migration_id=record["migration_id"])


def test_waiting_for_a_rehome_outlasts_the_close_of_the_record(hosts, domain):
    """The source closes the record as soon as its QEMU is gone; the guest's
    sessions resume after that.  ``wait_record until=rehomed`` (what
    ``accelmig migrate`` waits on) answers only once they all have."""
    waiter = ControlClient(hosts.pool.control_endpoint, "hostB", SECRETS["hostB"].encode(), timeout=30)
    with on_host(hosts, hosts.a) as dev:
        attest(hosts.a, dev, domain)
        done = hosts.migrate(domain, hosts.a, hosts.b)          # opened, switched over, completed, closed
        mid = hosts.b.call("list_records", domain_uuid=domain)["records"][-1]["migration_id"]
        now = waiter.call("wait_record", domain_uuid=domain, migration_id=mid, until="rehomed", timeout=0)
        assert now["reached"] is False and now["record"]["state"] == "closed"
        assert now["record"]["resumed"] == {}
        answers = []
        thread = threading.Thread(target=lambda: answers.append(waiter.call(
            "wait_record", domain_uuid=domain, migration_id=mid, until="rehomed", timeout=20)))
        thread.start()
        dev.resume(hosts.b.endpoint, done["tickets"][dev.sid])
        thread.join(25)
        assert answers and answers[0]["reached"] is True
        assert set(answers[0]["record"]["resumed"]) == {dev.sid}
        final = waiter.call("wait_record", domain_uuid=domain, migration_id=mid, until="final", timeout=0)
        assert final["reached"] is True
    waiter.close()
