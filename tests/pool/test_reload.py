"""SIGHUP on a real ``accelmig-pool serve``: the tenants and hosts files are
read again, sessions are untouched, a file that does not load keeps the
running configuration (and the log says why)."""

from __future__ import annotations

import pytest

from accelmig.agent.driver import connect
from accelmig.wire.control import ControlClient
from accelmig.wire.errors import AuthFailed
from tests.support.processes import PoolProcess, hosts_toml, tenants_toml

ALICE, BOB, CAROL = "alice-token-0001", "bob-token-000002", "carol-token-0003"
ALICE_NEW = "alice-token-rotated"
SECRET_A, SECRET_B = "hostA-secret-0123456789", "hostB-secret-0123456789"


@pytest.fixture
def pool(tmp_path):
    proc = PoolProcess(tmp_path, tenants_toml(alice=ALICE, bob=BOB), hosts_toml(hostA=SECRET_A))
    try:
        yield proc
    finally:
        proc.stop()


def test_sighup_reloads_tenants_and_leaves_sessions_alone(pool):
    data = pool.ready["data"]
    with connect(data, ALICE, agent=False) as alice, connect(data, BOB, agent=False) as bob:
        kept = alice.upload(b"kept across the reload")
        bobs = bob.upload(b"bob's")
        alice.finish()
        bob.finish()
        before = (alice.sid, alice.epoch)
        pool.tokens.write_text(tenants_toml(alice=ALICE_NEW, carol=CAROL))     # bob removed
        entry = pool.hup()
        assert entry["level"] == "info" and entry["reload"] == "done", entry
        assert entry["tenants_added"] == "carol" and entry["tenants_removed"] == "bob"
        assert entry["tenants_changed"] == "alice"
        assert "tenant bob's 1 session(s) keep running" in entry["msg"]
        # the sessions opened before: the same sessions, their device state intact
        assert alice.read(kept) == b"kept across the reload" and (alice.sid, alice.epoch) == before
        assert bob.read(bobs) == b"bob's"
        with connect(data, ALICE_NEW, agent=False) as fresh, connect(data, CAROL, agent=False) as carol:
            fresh.finish()
            carol.finish()
        for refused in (ALICE, BOB):            # the old token and the removed tenant's
            with pytest.raises(AuthFailed, match="unknown tenant token"):
                connect(data, refused, agent=False)
        assert alice.read(kept) == b"kept across the reload"
    assert pool.stop() == 0


def test_a_file_that_does_not_load_keeps_the_running_tenants(pool):
    data = pool.ready["data"]
    with connect(data, ALICE, agent=False) as alice:
        kept = alice.upload(b"x" * 4096)
        pool.tokens.write_text("[tenants.alice\ntoken = ")               # a half-written file
        entry = pool.hup()
        assert entry["level"] == "error" and entry["reload"] == "refused"
        assert "not valid TOML" in entry["msg"] and str(pool.tokens) in entry["msg"]
        assert "still serving the previous tenants and hosts" in entry["msg"]
        pool.tokens.write_text(tenants_toml(alice=ALICE, bob=BOB, carol=CAROL))
        pool.hosts.write_text('[hosts.hostB]\nsecret = "short"\n')        # one bad file: neither applies
        entry = pool.hup()
        assert entry["reload"] == "refused" and "hosts.hostB.secret must be 16+ characters" in entry["msg"]
        with pytest.raises(AuthFailed):
            connect(data, CAROL, agent=False)
        with connect(data, BOB, agent=False) as bob:
            bob.finish()
        assert alice.read(kept) == b"x" * 4096
    assert pool.stop() == 0


def test_sighup_reloads_hosts(pool):
    control = pool.ready["control"]
    with ControlClient(control, "hostA", SECRET_A.encode()) as host_a:
        assert host_a.call("ping")["caller"] == "hostA"
        with pytest.raises(AuthFailed, match="no secret for host 'hostB'"):
            ControlClient(control, "hostB", SECRET_B.encode()).call("ping")
        pool.hosts.write_text(hosts_toml(hostA=SECRET_A, hostB=SECRET_B))
        assert pool.hup()["hosts_added"] == "hostB"
        with ControlClient(control, "hostB", SECRET_B.encode()) as host_b:
            assert host_b.call("ping")["caller"] == "hostB"
            assert host_a.call("ping")["caller"] == "hostA"           # its connection is untouched
            pool.hosts.write_text(hosts_toml(hostB=SECRET_B))
            assert pool.hup()["hosts_removed"] == "hostA"
            with pytest.raises(AuthFailed, match="hostA is no longer in the pool's hosts file"):
                host_a.call("ping")                                   # the open connection, refused
            with pytest.raises(AuthFailed, match="no secret for host 'hostA'"):
                ControlClient(control, "hostA", SECRET_A.encode()).call("ping")
            assert host_b.call("ping")["caller"] == "hostB"
    assert pool.stop() == 0
